"""Moving activations between the device and host memory.

:class:`HostPool` hands out host buffers (pinned on CUDA) that are allocated once and reused every
iteration: a layer's offloaded tensors have the same sizes in every iteration, so after the first
one no new host memory is taken. The pool enforces the host-memory budget on what is really
pinned: torch's pinned allocator (``CachingHostAllocator``) rounds every block up to a power of
two and keeps freed blocks cached, so up to twice the bytes asked for would be page-locked; the
pool instead maps whole pages itself and registers exactly those with the driver
(``cudaHostRegister``, :func:`pinned_host_bytes`), and counts them.

A transfer engine copies device → host after a layer's forward and host → device before its
backward. :class:`SyncTransferEngine` does it synchronously (CPU, and the reference every decision
is tested against); :class:`CudaTransferEngine` uses one stream per direction and events, so copies
overlap the compute stream. Both return a :class:`Completion` that the caller waits on before it
reads a copy's destination or frees its source.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from memo_ext.config import DEFAULT_HOST_SHARE, MemoConfig
from memo_ext.device import clock
from memo_ext.hardware import GIB, available_host_memory_bytes
from memo_ext.memo.alpha import HostMemoryError

logger = logging.getLogger(__name__)


def host_budget_bytes(config: MemoConfig) -> int:
    """This process's host-memory budget in bytes (see :attr:`MemoConfig.host_memory_gb`)."""
    if config.host_memory_gb is not None:
        return int(config.host_memory_gb * GIB)
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(available_host_memory_bytes() * DEFAULT_HOST_SHARE / max(1, local_procs))


@dataclass
class Completion:
    """The end of a batch of copies: ``event`` on CUDA, ``None`` when already done."""

    event: object | None = None


DONE = Completion()


@dataclass
class HostBuffer:
    """One reusable host buffer; ``last_read`` is the copy that last read it (CUDA)."""

    data: Tensor
    last_read: Completion = field(default_factory=Completion)


PAGE_BYTES = mmap.PAGESIZE


def host_bytes_for(nbytes: int, *, pin_memory: bool) -> int:
    """Host bytes a buffer of ``nbytes`` takes: whole pages when pinned."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES if pin_memory else nbytes


def pinned_host_bytes(nbytes: int) -> Tensor:
    """A ``uint8`` tensor of ``nbytes`` bytes in page-locked host memory, exactly
    :func:`host_bytes_for` bytes of it: anonymous pages registered with the CUDA driver, and
    unregistered when the tensor's memory is released.

    Raises:
        HostMemoryError: when the driver refuses to pin them.
    """
    span = host_bytes_for(nbytes, pin_memory=True)
    pages = mmap.mmap(-1, span)  # page-aligned, zero-filled, returned to the system on close
    data = torch.frombuffer(pages, dtype=torch.uint8)
    status = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), span, 0)
    if status != 0:
        pages.close()
        raise HostMemoryError(
            f"the CUDA driver would not pin {span:,} bytes of host memory (error {int(status)}); "
            "lower --memo-host-memory-gb or raise the locked-memory limit (ulimit -l)"
        )
    # the tensor's storage holds `pages`; when it goes, unpin first, then let the pages go
    weakref.finalize(data.untyped_storage(), _unpin, data.data_ptr(), pages)
    return data[:nbytes]


def _unpin(ptr: int, pages: mmap.mmap) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    """Host buffers by exact byte size, reused every iteration, within a byte budget."""

    def __init__(self, *, budget_bytes: int, pin_memory: bool):
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.allocated_bytes = 0
        """Host bytes the pool's buffers take (pinned: whole pages, as registered)."""
        self.in_use_bytes = 0
        self.buffers: list[HostBuffer] = []
        """Every buffer the pool allocated, in order."""
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of ``nbytes`` bytes, reused when one is free.

        Raises:
            HostMemoryError: when a new buffer would exceed the budget.
        """
        free = self._free[nbytes]
        if free:
            buf = free.pop()
        else:
            buf = HostBuffer(self._allocate(nbytes))
            self.buffers.append(buf)
        self.in_use_bytes += nbytes
        return buf

    def _allocate(self, nbytes: int) -> Tensor:
        taken = host_bytes_for(nbytes, pin_memory=self.pin_memory)
        if self.allocated_bytes + taken > self.budget_bytes:
            raise HostMemoryError(
                f"MEMO's host buffers would exceed the host budget of {self.budget_bytes:,} "
                f"bytes per process ({self.allocated_bytes:,} already taken); raise "
                "--memo-host-memory-gb or lower --memo-alpha"
            )
        data = self._host_bytes(nbytes)
        self.allocated_bytes += taken
        return data

    def _host_bytes(self, nbytes: int) -> Tensor:
        if self.pin_memory:
            return pinned_host_bytes(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buffers: list[HostBuffer]) -> None:
        for buf in buffers:
            self.in_use_bytes -= buf.data.numel()
            self._free[buf.data.numel()].append(buf)

    def scratch(self, nbytes: int) -> Tensor:
        """A buffer outside the pool's reuse (a bandwidth probe), counted against the budget
        while it lives: at most what the budget has left."""
        nbytes = max(1, min(nbytes, self.budget_bytes - self.allocated_bytes))
        data = self._host_bytes(nbytes)
        taken = host_bytes_for(nbytes, pin_memory=self.pin_memory)
        self.allocated_bytes += taken
        weakref.finalize(data.untyped_storage(), self._return_scratch, taken)
        return data

    def _return_scratch(self, taken: int) -> None:
        self.allocated_bytes -= taken


def host_view(buf: HostBuffer, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A contiguous ``dtype`` view of ``shape`` on a host buffer."""
    return buf.data.view(dtype).view(shape)


class SyncTransferEngine:
    """Copies on the calling thread; every completion is immediate (CPU)."""

    device_type = "cpu"
    pin_memory = False

    def stage(self, pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """The pairs :meth:`to_host` copies from (here: as they are)."""
        return pairs

    def to_host(self, pairs: list[tuple[Tensor, Tensor]], *, reuse: list[Completion]) -> Completion:
        """Copy each ``(host destination, device source)`` pair."""
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        return DONE

    def to_device(
        self, hosts: list[Tensor], *, device: torch.device, after: Completion
    ) -> tuple[list[Tensor], Completion]:
        """Device copies of ``hosts`` (fresh tensors: the host buffers are reused later)."""
        with torch.no_grad():
            return [h.to(device, copy=True) for h in hosts], DONE

    def done(self, completion: Completion) -> bool:
        return True

    def wait(self, completion: Completion) -> None:
        """Order the compute stream after ``completion`` (nothing to do here)."""

    def take_wait_s(self) -> float | None:
        return None


class CudaTransferEngine:
    """Device ↔ host copies on two side streams, ordered against the compute stream by events.

    Device → host: the D2H stream waits for the compute stream (the sources are written), copies
    into pinned buffers and records an event; the caller keeps the sources alive until the compute
    stream has waited on that event (ping-pong rule in :mod:`memo_ext.memo.runtime`).
    Host → device: destinations are allocated on the compute stream, the H2D stream waits for it,
    copies, and records an event the compute stream waits on before the first read.
    """

    device_type = "cuda"
    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        # (start, end) timing events around each compute-stream wait on a copy
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self, stream: torch.cuda.Stream) -> Completion:
        event = torch.cuda.Event()
        event.record(stream)
        return Completion(event)

    def stage(self, pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """The pairs :meth:`to_host` copies from: a source a DMA copy cannot read as it is (a
        strided head: V's view of the fused QKV output, a tensor gathered over TP) is gathered
        here, on the compute stream. Left to the copy, CUDA would gather it into a temporary on
        the copy stream, memory the compute stream's pool (and a planned allocator) never sees.
        The caller holds the returned sources until the copies are waited for."""
        staged = []
        with torch.no_grad():
            for dst, src in pairs:
                if _dma_pieces(dst, src) is None:
                    src = src.contiguous()  # [head shape], contiguous; on the compute stream
                staged.append((dst, src))
        return staged

    def to_host(self, pairs: list[tuple[Tensor, Tensor]], *, reuse: list[Completion]) -> Completion:
        """Copy each staged ``(host destination, device source)`` pair (:meth:`stage`)."""
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        for previous in reuse:  # the host buffers' last H2D reads
            if previous.event is not None:
                self.d2h.wait_event(previous.event)
        with torch.cuda.stream(self.d2h), torch.no_grad():
            for dst, src in pairs:
                pieces = _dma_pieces(dst, src)
                if pieces is None:
                    raise ValueError("a strided source reached the copy stream; stage() it first")
                for d, s in pieces:
                    d.copy_(s, non_blocking=True)
        return self._event(self.d2h)

    def to_device(
        self, hosts: list[Tensor], *, device: torch.device, after: Completion
    ) -> tuple[list[Tensor], Completion]:
        with torch.no_grad():
            outs = [torch.empty(h.shape, dtype=h.dtype, device=device) for h in hosts]
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
            if after.event is not None:  # the D2H copy that filled these host buffers
                self.h2d.wait_event(after.event)
            with torch.cuda.stream(self.h2d):
                for out, h in zip(outs, hosts):
                    out.copy_(h, non_blocking=True)
        return outs, self._event(self.h2d)

    def done(self, completion: Completion) -> bool:
        return completion.event is None or completion.event.query()

    def wait(self, completion: Completion) -> None:
        if completion.event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(completion.event)
        end.record(compute)
        self._waits.append((start, end))

    def take_wait_s(self) -> float:
        """Seconds the compute stream stalled on copies since the last call."""
        if not self._waits:
            return 0.0
        self._waits[-1][1].synchronize()
        total_ms = sum(start.elapsed_time(end) for start, end in self._waits)
        self._waits.clear()
        return total_ms / 1e3


def _dma_pieces(dst: Tensor, src: Tensor) -> list[tuple[Tensor, Tensor]] | None:
    """``(dst, src)`` as copies a DMA engine takes as they are (same dtype, both contiguous):
    the pair itself, or one pair per index of the first dimension (the heads of a tensor
    gathered over TP: ``[tp, kept, ...]``, each rank's block contiguous); ``None`` when some
    piece is strided."""
    if dst.dtype != src.dtype:
        return None
    if dst.is_contiguous() and src.is_contiguous():
        return [(dst, src)]
    if src.dim() > 1 and all(d.is_contiguous() and s.is_contiguous() for d, s in zip(dst, src)):
        return list(zip(dst, src))
    return None


def build_transfer_engine(device: torch.device) -> SyncTransferEngine | CudaTransferEngine:
    """The engine for ``device``: CUDA streams on a GPU, synchronous copies elsewhere."""
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return SyncTransferEngine()


def measure_copy_gbps(
    engine,
    *,
    device: torch.device,
    dst: Tensor,
    align: Callable[[], None] | None = None,
    repeats: int = 3,
) -> float:
    """Device → host bandwidth in GB/s (1e9 bytes), measured with ``repeats`` copies into
    ``dst`` (a ``uint8`` host buffer, pinned where the engine's copies go to pinned memory)
    after one untimed copy. ``align`` runs between the two (the ranks that share a host link
    start their timed copies together)."""
    nbytes = dst.numel()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    engine.to_host([(dst, src)], reuse=[])  # warm-up
    _synchronize(device)
    if align is not None:
        align()
    start = clock()
    for _ in range(repeats):
        engine.to_host([(dst, src)], reuse=[])
    _synchronize(device)
    return repeats * nbytes / max(clock() - start, 1e-9) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
