"""The Python half of the emulated CUDA device: a compute device that is not the host.

Inside :func:`emulated_cuda` the program runs its CUDA branch on a CPU-only torch build:

* ``torch.cuda`` says a device exists; tensors placed on it are FakeTensors (shapes, dtypes,
  strides and aliasing, no data; :class:`EmulatedCudaMode`), so a CPU tensor mixed with a
  device tensor fails exactly where it fails on a GPU. Host tensors stay real: data loaders,
  tokenizers and host buffers run for real. A value read from the device (``.item()``) is 0.
* ``torch.distributed``'s NCCL is torch's fake process group registered for the ``cuda`` device
  only: a collective of a CPU tensor on it raises ``No backend type associated with device type
  cpu``, as NCCL does.
* Streams and events are stand-ins with vector clocks (:class:`Timeline`). Every op is an access
  of its tensors' bytes on the thread's current stream; an access that is not ordered after a
  conflicting access on another stream (a copy consumed before its event was waited on, a
  buffer written while a copy still reads it, a block freed while another stream may still use
  it) raises :class:`OrderError`. The GPU is modelled as infinitely slow: an event is complete
  only once the host has waited for it, so ``query()`` never excuses a missing wait.
* Pinned host memory goes through an emulated ``CachingHostAllocator`` (power-of-two blocks,
  cached) and ``cudaHostRegister``, both counted (:meth:`EmulatedCuda.pinned_bytes`).
* ``torch.cuda.memory.CUDAPluggableAllocator`` loads a real allocator library; once installed,
  every device storage is allocated and freed through it, on the storage's stream and the
  thread that drops it, and torch's own memory statistics raise as they do under a pluggable
  allocator.

It is not a GPU: kernels, timings and values are not emulated. It catches the wrong-device,
wrong-stream and wrong-allocator classes of defects on a CPU machine.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves, tree_map_only

from memo_ext import device as package_device
from memo_ext.hardware import device_spec
from memo_ext.simulate import runtime, timing
from memo_ext.simulate.parts import GPUS, EmulatedGpu, part

aten = torch.ops.aten
HOST = 0
"""The host's key in the timeline (streams are numbered from 1)."""


class OrderError(AssertionError):
    """Work on two streams (or a stream and the host) that a GPU would run in either order."""


# ---- the timeline: vector clocks of streams and the host ------------------------------------


@dataclass
class _Access:
    stream: int
    tick: int
    start: int
    end: int
    write: bool
    what: str


@dataclass
class _Storage:
    nbytes: int
    stream: int
    """The stream the storage was allocated on (a freed block is reused there)."""
    ptr: int | None = None
    """Its block from the installed pluggable allocator."""
    accesses: list[_Access] = field(default_factory=list)
    recorded: set[int] = field(default_factory=set)
    """Streams named by ``record_stream`` (the caching allocator defers reuse past them)."""
    device: int = 0
    """The GPU it lives on."""


class Timeline:
    """Happens-before over streams and the host, and every tracked storage's accesses."""

    def __init__(self) -> None:
        self.clocks: dict[int, dict[int, int]] = {HOST: {HOST: 0}}

    def clock(self, stream: int) -> dict[int, int]:
        return self.clocks.setdefault(stream, {stream: 0})

    def tick(self, stream: int) -> int:
        clock = self.clock(stream)
        if stream != HOST:  # work launched after what the host has seen completes
            self.join(stream, self.clocks[HOST])
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def join(self, stream: int, other: dict[int, int]) -> None:
        clock = self.clock(stream)
        for key, value in other.items():
            if value > clock.get(key, 0):
                clock[key] = value

    def ordered(self, stream: int, access: _Access) -> bool:
        """Whether ``stream``'s next work comes after ``access``."""
        return access.stream == stream or self.clock(stream).get(access.stream, 0) >= access.tick

    def access(self, storage: _Storage, access: _Access) -> None:
        """Check ``access`` against the storage's earlier ones and record it."""
        for earlier in storage.accesses:
            overlaps = earlier.start < access.end and access.start < earlier.end
            if not overlaps or not (earlier.write or access.write):
                continue
            if not self.ordered(access.stream, earlier):
                raise OrderError(
                    f"{access.what} on {_name(access.stream)} "
                    f"{'writes' if access.write else 'reads'} bytes that {earlier.what} on "
                    f"{_name(earlier.stream)} {'wrote' if earlier.write else 'reads'}, with no "
                    "event or stream wait between them"
                )
        # an access supersedes earlier ones of its stream over the same bytes (a write: any
        # kind; a read: reads); the newest is the one the others must be ordered after
        storage.accesses = [
            a
            for a in storage.accesses
            if not (
                a.stream == access.stream
                and access.start <= a.start
                and a.end <= access.end
                and (access.write or not a.write)
            )
        ]
        storage.accesses.append(access)

    def released(self, storage: _Storage, what: str) -> None:
        """A storage dies: its block may be handed out again on its allocation stream, to work
        launched from now on (which also comes after everything the host has seen complete)."""
        for access in storage.accesses:
            if access.stream in storage.recorded or self.ordered(storage.stream, access):
                continue
            if self.ordered(HOST, access):
                continue
            raise OrderError(
                f"a device block is freed (reused next on {_name(storage.stream)}) while "
                f"{access.what} on {_name(access.stream)} may still "
                f"{'write' if access.write else 'read'} it: keep the tensor alive until that "
                "stream's work is waited on"
            )


def _name(stream: int) -> str:
    return "the host" if stream == HOST else f"stream {stream}"


# ---- streams and events ----------------------------------------------------------------------

_ids = itertools.count(1)


class Stream:
    """Stands in for ``torch.cuda.Stream``."""

    def __init__(self, device=None, priority: int = 0, **_: object) -> None:
        self.id = next(_ids)
        self.device = torch.device("cuda", _current_index() if device is None else _index(device))
        self.priority = priority
        self.cuda_stream = 0x5000 + 16 * self.id
        """The ``cudaStream_t`` a pluggable allocator sees."""

    def wait_stream(self, other: Stream) -> None:
        device = _device()
        device.timeline.join(self.id, dict(device.timeline.clock(other.id)))
        device.clock.wait(self.id, device.clock.now(other.id), on=other.id)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        timeline = _device().timeline
        return timeline.clock(HOST).get(self.id, 0) >= timeline.clock(self.id).get(self.id, 0)

    def synchronize(self) -> None:
        device = _device()
        device.timeline.join(HOST, dict(device.timeline.clock(self.id)))
        device.clock.sync(device.clock.now(self.id), _site())

    def __enter__(self) -> Stream:
        self._previous = getattr(_local, "stream", None)
        _local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stream = self._previous

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<emulated cuda stream {self.id}>"


class Event:
    """Stands in for ``torch.cuda.Event``: complete once the host has waited for it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: object) -> None:
        self.enable_timing = enable_timing
        self.clock: dict[int, int] | None = None
        self.stream: int | None = None
        self.time_s: float | None = None
        """When the work before it ends on the device's clock."""

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        device = _device()
        device.timeline.tick(stream.id)
        self.clock, self.stream = dict(device.timeline.clock(stream.id)), stream.id
        self.time_s = device.clock.now(stream.id)

    def wait(self, stream: Stream | None = None) -> None:
        if self.clock is not None:
            device, waiting = _device(), (stream or current_stream()).id
            device.timeline.join(waiting, self.clock)
            device.clock.wait(waiting, self.time_s, on=self.stream)

    def query(self) -> bool:
        if self.clock is None:
            return True
        return _device().timeline.clock(HOST).get(self.stream, 0) >= self.clock[self.stream]

    def synchronize(self) -> None:
        if self.clock is not None:
            _device().timeline.join(HOST, self.clock)
            _device().clock.sync(self.time_s, _site())

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between the two records on the device's clock; both must be complete,
        as CUDA refuses ``cudaEventElapsedTime`` on an event that is not."""
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready (the events are not complete)")
        return (end.time_s - self.time_s) * 1e3


_local = threading.local()


def current_stream(device=None) -> Stream:
    """This thread's current stream (a new thread starts on the default stream)."""
    return getattr(_local, "stream", None) or _device().default


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Stands in for ``torch.cuda.stream``."""
    if s is None:
        yield
        return
    with s:
        yield


def set_stream(s: Stream) -> None:
    _local.stream = s


def _current_index() -> int:
    """This thread's current device (CUDA's is per thread; autograd's device threads set it)."""
    return runtime.loaded().memo_emulated_current_device()


def _index(device) -> int:
    """A device argument (``1``, ``"cuda:1"``, ``torch.device``) as an ordinal."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else _current_index()


def synchronize(device=None) -> None:
    emulated = _device()
    timeline = emulated.timeline
    for key in list(timeline.clocks):
        timeline.join(HOST, dict(timeline.clock(key)))
    emulated.clock.sync(max(emulated.clock.streams.values(), default=0.0), _site())


# ---- the pluggable allocator and the CUDA runtime's host registration --------------------------


class PluggableAllocator:
    """Stands in for ``torch.cuda.memory.CUDAPluggableAllocator``: the library is loaded and its
    functions found as torch finds them (``AttributeError`` for a missing name)."""

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        self.library = ctypes.CDLL(path_to_so_file)
        self.alloc_fn = ctypes.cast(getattr(self.library, alloc_fn_name), ctypes.c_void_p).value
        self.free_fn = ctypes.cast(getattr(self.library, free_fn_name), ctypes.c_void_p).value

    def allocator(self) -> PluggableAllocator:
        return self

    def alloc(self, nbytes: int, stream: Stream) -> int:
        """``alloc(nbytes, 0, stream)`` as torch calls it; a C++ ``c10::OutOfMemoryError`` is
        raised as ``torch.OutOfMemoryError``, a NULL becomes the illegal address it would be."""
        out, message = ctypes.c_void_p(), ctypes.create_string_buffer(1024)
        status = runtime.loaded().memo_emulated_pluggable_alloc(
            self.alloc_fn, nbytes, 0, stream.cuda_stream, ctypes.byref(out), message, 1024
        )
        if status == 1:
            raise torch.OutOfMemoryError(message.value.decode())
        if status == 2:
            raise RuntimeError(message.value.decode())
        if not out.value:
            raise RuntimeError(
                f"CUDA error: an illegal memory access was encountered (the pluggable allocator "
                f"returned NULL for {nbytes} bytes, which torch hands to the first kernel)"
            )
        return out.value


class CudaRuntime:
    """Stands in for ``torch.cuda.cudart()``: host registration, counted by the shim."""

    @staticmethod
    def cudaHostRegister(ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        return runtime.loaded().memo_emulated_host_register(ptr, size)

    @staticmethod
    def cudaHostUnregister(ptr: int) -> int:  # noqa: N802
        return runtime.loaded().memo_emulated_host_unregister(ptr)


# ---- the dispatch mode -----------------------------------------------------------------------


def _is_cuda(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


def _on_device(t: object) -> bool:
    return isinstance(t, FakeTensor) and t.device.type == "cuda"


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return start, start + extent * t.element_size()


class EmulatedCudaMode(FakeTensorMode):
    """FakeTensors for the device, real tensors for the host, and every device op checked
    against the timeline (see the module docstring)."""

    def __init__(self, device: EmulatedCuda) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.device = device
        self.values = HostKnownValues()
        self._within_op = False
        """Inside FakeTensorMode's handling of a device op (under the device's lock)."""

    @property
    def avoid_device_init(self) -> bool:
        return True  # no device to initialise: never materialise a tensor on it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # one op at a time: FakeTensorMode keeps its in-kernel state on the mode, not per
        # thread, and the threads of a process (a copy thread per GPU, autograd's device
        # threads) share this one mode
        with self.device.lock:
            if self._within_op and _lands_on_device(func, args, kwargs or {}):
                # FakeTensorMode runs some ops as their decomposition (gelu_backward as six
                # element-wise ops, in fp32), re-entering the mode: on a GPU the op is one
                # kernel, placed and timed as itself, whose inner steps allocate nothing
                return super().__torch_dispatch__(func, types, args, kwargs or {})
            return self._dispatch(func, types, args, kwargs or {})

    def _dispatch(self, func, types, args, kwargs):
        device = self.device
        device.collect_released()
        if func is aten.record_stream.default:
            return device.record_stream(args[0], args[1])
        leaves = tree_leaves((args, kwargs))
        if _host_op(leaves):
            device.host_op(func, args, kwargs)  # runs for real
            return func(*args, **kwargs)
        if func.namespace == "c10d":
            device.device_op(func, args, kwargs, touches_data=True)
            return _collective(func, args, kwargs)
        if func is aten._local_scalar_dense.default:
            device.device_op(func, args, kwargs, touches_data=True)
            device.host_waits_for_current_stream()
            device.scalar_reads += 1
            known = self.values.get(args[0])
            return known.item() if known is not None else _zero_of(args[0].dtype)
        if func is aten._scaled_dot_product_efficient_attention_backward.default:
            _check_philox_on_the_host(*args, **kwargs)
        if func is aten.copy_.default and _copy_needs_temporaries(*args):
            args = self._through_temporaries(types, *args)
        inputs = (args, kwargs)
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else self.from_tensor(t),
            (args, kwargs),
        )  # fmt: skip
        within, self._within_op = self._within_op, True
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._within_op = within
        self.values.propagate(func, inputs, out)
        device.device_op(func, args, kwargs, outputs=tree_leaves(out), inputs=inputs)
        if _blocking_copy_to_host(func, kwargs):
            device.host_waits_for_current_stream()
        if _blocking_copy_from_host(func, *inputs):
            device.blocking_host_copies += 1
            device.clock.sync(device.clock.now(current_stream().id), _site())
        if func is aten._scaled_dot_product_efficient_attention.default:
            # the kernel keeps its philox seed and offset as host scalars (outside CUDA graph
            # capture), and its backward reads them there
            with no_dispatch():
                out = (
                    *out[:2],
                    torch.zeros((), dtype=torch.long),
                    torch.zeros((), dtype=torch.long),
                )
        return out

    def _through_temporaries(self, types, dst, src, *rest) -> tuple:
        """What CUDA's copy kernel does for a copy it cannot hand to ``cudaMemcpyAsync``: a
        contiguous device temporary made on the current stream (the source gathered for a
        device → host copy; the destination's staging for a host → device one)."""
        contiguous = {"memory_format": torch.contiguous_format}
        if _on_device(src):
            src = self._dispatch(aten.clone.default, types, (src,), contiguous)
        else:
            self._dispatch(aten.empty_like.default, types, (dst,), contiguous)
        return (dst, src, *rest)


_real_sdpa = torch.nn.functional.scaled_dot_product_attention


def _sdpa_kernels(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False,
):  # fmt: skip
    """``scaled_dot_product_attention`` as it runs on an H100: the CPU build's composite takes
    the math path for any device, so the choice of torch's ``sdp_utils`` is made here (in
    short: flash in half precision without a mask, head dims up to 256 in steps of 8; the
    memory-efficient kernel otherwise; math for grouped-query attention outside flash) and the
    kernel's own op is called, with what it saves for its backward."""
    if not _on_device(query):
        return _real_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa)  # fmt: skip
    head_dim, grouped = query.size(-1), enable_gqa and query.size(-3) != key.size(-3)
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and attn_mask is None and not grouped and head_dim <= 256 and head_dim % 8 == 0:
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if grouped:
        return _real_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa)  # fmt: skip
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdp_utils converts it
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        attn_mask = bias.masked_fill(~attn_mask, float("-inf"))
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale
    )[0]


def _check_philox_on_the_host(
    grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
    dropout_p, *args, **kwargs,
) -> None:  # fmt: skip
    """The memory-efficient backward reads its philox seed and offset on the host when it drops
    out (``*philox_seed.data_ptr<int64_t>()``): a device tensor there is a host read of a device
    address, a segmentation fault on a GPU."""
    if dropout_p > 0 and any(
        isinstance(t, FakeTensor) or t.device.type != "cpu" for t in (philox_seed, philox_offset)
    ):
        raise OrderError(
            "the memory-efficient attention backward got its philox seed / offset on the device; "
            "it reads them on the host (a segmentation fault on a GPU): keep saved host tensors "
            "on the host"
        )


def _copy_needs_temporaries(dst, src, *_) -> bool:
    """``copy_requires_temporaries`` of torch's ``Copy.cu`` for a host ↔ device copy: anything
    but a same-dtype copy between contiguous tensors."""
    if not isinstance(src, torch.Tensor) or _on_device(dst) == _on_device(src):
        return False
    return not (dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous())


class HostKnownValues:
    """Values of small FakeTensors that the host can know: copied from host tensors (document
    boundaries, positions, indices), or computed from such only. Their ops are replayed on the
    host, so ``.tolist()`` of them reads what a GPU would give; every other read is 0."""

    MAX_ELEMENTS = 1 << 16

    def __init__(self) -> None:
        # id -> (weak reference, value): a tensor's == is an op, so no WeakKeyDictionary
        self._values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(t, FakeTensor):
            return t
        entry = self._values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t: FakeTensor, value: torch.Tensor) -> None:
        key = id(t)
        self._values[key] = (weakref.ref(t, lambda _: self._values.pop(key, None)), value)

    def propagate(self, func, inputs, out) -> None:
        """Replay ``func`` on the inputs' values when every tensor input has one."""
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
        small = all(t.numel() <= self.MAX_ELEMENTS for t in tensors + outputs)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        known = [self.get(t) for t in tensors]
        if not (tensors and outputs and small) or seeded or any(v is None for v in known):
            for t in _written(func, inputs):
                self._values.pop(id(t), None)  # written from values the host does not know
            return
        replace = dict(zip(map(id, tensors), known))
        args, kwargs = tree_map_only(torch.Tensor, lambda t: replace[id(t)], inputs)
        kwargs = {k: torch.device("cpu") if _is_cuda(v) else v for k, v in kwargs.items()}
        args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        try:
            with no_dispatch():
                values = [
                    v for v in tree_leaves(func(*args, **kwargs)) if isinstance(v, torch.Tensor)
                ]
        except RuntimeError:  # an op the host cannot replay: the values become unknown
            return
        for t, value in zip(outputs, values):
            self._set(t, value)


def _written(func, inputs) -> list[torch.Tensor]:
    args, kwargs = inputs
    ids = _written_arguments(func, args, kwargs)
    return [t for t in tree_leaves(inputs) if isinstance(t, FakeTensor) and id(t) in ids]


def _collective(func, args, kwargs):
    """A collective of device tensors completes at once (the other ranks are emulated): its
    group must have a backend for the device, as a real one must. Host tensors go to the group
    as they are, which refuses them when it has no CPU backend (NCCL)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not all(_on_device(t) for t in tensors):
        with no_dispatch():
            return func(*args, **kwargs)
    group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject))
    group._get_backend(torch.device("cuda"))  # raises without one
    work = _TimedWork(_device(), *_device().last_collective)
    _device().works.append(work)  # C++ holds the handle; its Python half must live on too
    work = work.boxed()
    returns = func._schema.returns
    return (args[0], work) if len(returns) == 2 else work if returns else None


class _TimedWork(dist.Work):
    """A collective's handle: done on arrival (the other ranks are emulated), and ``wait()``
    makes the current stream wait for the end of the collective on its group's stream, as
    NCCL's ``Work.wait`` does."""

    def __init__(self, device: EmulatedCuda, end_s: float, stream: int) -> None:
        super().__init__()
        self.device, self.end_s, self.stream = device, end_s, stream

    def wait(self, timeout=None) -> bool:
        self.device.clock.wait(current_stream().id, self.end_s, on=self.stream)
        return True

    def is_completed(self) -> bool:
        return True


def _lands_on_device(func, args, kwargs) -> bool:
    """The op's result is on the device: a factory or a transfer aimed at it, or an op whose
    tensors are all on it but for host scalars (0-dim tensors, which a CUDA kernel takes as
    arguments). Anything else (a copy to the host) takes the host's path."""
    target = kwargs.get("device")
    if func is torch.ops.prims.device_put.default:
        target = args[1] if len(args) > 1 else target
    if target is not None:
        return torch.device(target).type == "cuda"
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = [t for t in tensors if _on_device(t)]
    return bool(device) and all(_on_device(t) or t.dim() == 0 for t in tensors)


def _host_op(leaves: list) -> bool:
    """An op of real host tensors only: no FakeTensor, meta tensor or storage, no CUDA device."""
    for v in leaves:
        if isinstance(v, FakeTensor) or _is_cuda(v):
            return False
        if isinstance(v, (torch.Tensor, torch.UntypedStorage)) and v.device.type == "meta":
            return False
    return True


def _zero_of(dtype: torch.dtype) -> object:
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


def _blocking_copy_to_host(func, kwargs) -> bool:
    """A device → host copy the host waits for (``.cpu()``, ``.to("cpu")``)."""
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return target is not None and target.type == "cpu" and not kwargs.get("non_blocking")
    return False


def _blocking_copy_from_host(func, args, kwargs) -> bool:
    """A host → device copy without ``non_blocking`` (``.to("cuda")`` of a host tensor): CUDA
    copies it and synchronizes the stream before the host goes on."""
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        from_host = not isinstance(args[0], FakeTensor) and args[0].device.type == "cpu"
        return _is_cuda(target) and from_host and not kwargs.get("non_blocking")
    return False


# ---- the device --------------------------------------------------------------------------------


class EmulatedCuda:
    """The state of the emulated device while :func:`emulated_cuda` is active."""

    def __init__(
        self,
        *,
        first_gemm_s: float = 0.0,
        gpu: str = "h100",
        gpus: int = 1,
        rates: timing.Rates | None = None,
        keep_intervals: bool = False,
    ) -> None:
        self.shim = runtime.loaded()
        if self.shim is None:
            raise RuntimeError(
                "the emulated CUDA shim is not loaded: run `python -m tests.emulated`"
            )
        gpu = part(gpu)
        if not 1 <= gpus <= 8:
            raise ValueError(f"an emulated machine has 1 to 8 GPUs, got {gpus}")
        self.gpu, self.gpus, self.preset = GPUS[gpu], gpus, gpu
        self.shim.memo_emulated_set_device_count(gpus)
        self.shim.memo_emulated_init()  # as CUDA's first use does
        self.shim.memo_emulated_registered_peak(1)
        self.timeline = Timeline()
        self.default = Stream()
        timing.load()
        self.clock = timing.Clock(
            rates or timing.Rates.of(device_spec(gpu), gpus=gpus),
            compute_stream=self.default.id,
            keep_intervals=keep_intervals,
        )
        """The device's time (:mod:`memo_ext.simulate.timing`)."""
        self.storages: dict[int, _Storage] = {}
        """Live device storages, by token."""
        self.host_storages: dict[int, _Storage] = {}
        """Pinned host storages a device op touched, by data pointer."""
        self.allocator: PluggableAllocator | None = None
        self.initialized = False
        """A device tensor existed or a device was set: the allocator can no longer change."""
        self.scalar_reads = 0
        self.blocking_host_copies = 0
        """Host → device copies the host waited for (each a stream sync on a GPU)."""
        self.first_gemm_s = first_gemm_s
        """Host seconds a matrix product of shapes not seen before takes (CUDA loads kernels
        lazily, cuBLAS makes its handle and workspace at first use)."""
        self._gemm_shapes: set[tuple] = set()
        self.allocated_bytes = self.peak_bytes = 0
        self.lifetime_peak_bytes = 0
        self.memory_fraction = 1.0
        """``torch.cuda.set_per_process_memory_fraction``'s (``--memory-limit-gb``)."""
        self.comm_streams: dict[int, int] = {}
        """The stream of each process group's collectives (NCCL's), by the group's id."""
        self.last_collective: tuple[float, int] = (0.0, 0)
        """When the latest collective ends, and its stream."""
        self.works: collections.deque = collections.deque(maxlen=1 << 16)
        """The latest collectives' handles: a handle whose Python object died would wait as
        c10d's base ``Work`` does, forever (pybind keeps no Python subclass alive)."""
        """The most device bytes allocated at once since the device started (never reset)."""
        self.history: list[list[dict]] | None = None
        """The allocator history per GPU while it is recorded (``_record_memory_history``)."""
        self.allocations_by_stream: dict[int, int] = {}
        """Device storages allocated per stream id (a copy stream's own allocations show
        here: on a GPU they come from that stream's pool, and a planned allocator misses)."""
        self.lock = threading.RLock()
        self.generators = tuple(torch.Generator(device=f"cuda:{i}") for i in range(gpus))
        """One generator per GPU, as CUDA has (``torch.cuda.default_generators``)."""
        self.mode = EmulatedCudaMode(self)

    # -- accesses -------------------------------------------------------------------------

    def device_op(self, func, args, kwargs, *, outputs=(), touches_data=None, inputs=None) -> None:
        """Record a device op's accesses on the current stream, then register new storages,
        and give it its time on the clock (``inputs``: the op's arguments before host tensors
        became fake ones, which say whether a host buffer is pinned). An op touches data unless
        it aliases (a view) or answers metadata (a device, a size)."""
        written = _written_arguments(func, args, kwargs)
        if touches_data is None:
            tensors_out = any(isinstance(t, torch.Tensor) for t in outputs)
            touches_data = not func.is_view and bool(written or tensors_out)
        if not touches_data:
            return
        if self.first_gemm_s and func in _GEMMS:
            shapes = (func, *(tuple(t.shape) for t in args if isinstance(t, torch.Tensor)))
            if shapes not in self._gemm_shapes:  # a kernel loaded (and tuned) on first use
                self._gemm_shapes.add(shapes)
                self.clock.host += self.first_gemm_s
        with self.lock:
            stream = current_stream().id
            tick = self.timeline.tick(stream)
            if func not in _NO_KERNEL:
                self._time(func, args, kwargs, outputs, stream, inputs)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self._touch(t, stream, tick, write=id(t) in written, what=str(func))
            for t in outputs:
                if _on_device(t):
                    self._register(t, stream)
                    self._touch(t, stream, tick, write=True, what=str(func))

    def _time(self, func, args, kwargs, outputs, stream: int, inputs) -> None:
        """The op's place on the clock: a collective, a host ↔ device copy, or a kernel."""
        rates, name = self.clock.rates, str(func)
        if func.namespace == "c10d":
            group = next(
                (dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)),
                None,
            )
            ranks = _group_ranks(group)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not all(_on_device(t) for t in tensors):
                return  # a host collective (gloo): the host's work, not the device's
            nbytes = max((timing.tensor_bytes(t) for t in tensors), default=0)
            seconds = timing.collective_seconds(rates, func._opname, nbytes, ranks)
            # NCCL runs a group's collectives on a stream of its own, after the work the
            # issuing stream has queued; its Work.wait() makes a stream wait for it
            comm = self.comm_streams.setdefault(id(group), Stream().id)
            self.clock.wait(comm, self.clock.now(stream), on=stream)
            end = self.clock.launch(comm, seconds, timing.COLLECTIVE, name)
            self.last_collective = (end, comm)
            return
        copy = _host_copy(func, inputs if inputs is not None else (args, kwargs), outputs)
        if copy is not None:
            kind, nbytes, pinned = copy
            seconds = timing.copy_seconds(rates, nbytes, pinned=pinned)
            end = self.clock.launch(stream, seconds, kind, name)
            if not pinned:  # staged through a pinned buffer: the host waits for it
                self.clock.sync(end, _site())
            return
        tensors = [
            t for t in tree_leaves((args, kwargs, list(outputs))) if isinstance(t, torch.Tensor)
        ]
        out = outputs[0] if len(outputs) == 1 else outputs
        seconds = timing.kernel_seconds(rates, func, args, kwargs, out, tensors)
        self.clock.launch(stream, seconds, timing.COMPUTE, name, timing.kernel_class(func))

    def host_op(self, func, args, kwargs) -> None:
        """A host op touching a pinned buffer a device op touched must be ordered after it."""
        if not self.host_storages:
            return
        with self.lock:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            tracked = [t for t in tensors if _host_key(t) in self.host_storages]
            if tracked and not func.is_view:
                tick = self.timeline.tick(HOST)
                written = _written_arguments(func, args, kwargs)
                for t in tracked:
                    self._touch(t, HOST, tick, write=id(t) in written, what=str(func))

    def _touch(self, t: torch.Tensor, stream: int, tick: int, *, write: bool, what: str) -> None:
        storage = self._storage_of(t)
        if storage is None:
            return
        start, end = _byte_range(t)
        self.timeline.access(storage, _Access(stream, tick, start, end, write, what))

    def _storage_of(self, t: torch.Tensor) -> _Storage | None:
        if _on_device(t):
            return self.storages.get(self._token(t))
        if isinstance(t, FakeTensor) or t.device.type != "cpu" or not t.is_pinned():
            return None  # pageable host memory: CUDA copies to and from it synchronously
        key = _host_key(t)
        if key not in self.host_storages:
            nbytes = t.untyped_storage().nbytes()
            self.host_storages[key] = _Storage(nbytes=nbytes, stream=HOST)
        return self.host_storages[key]

    def _token(self, t: torch.Tensor) -> int:
        return self.shim.memo_emulated_storage_token(t.untyped_storage()._cdata)

    def _register(self, t: torch.Tensor, stream: int) -> None:
        token = self._token(t)
        if token in self.storages:
            return
        self.initialized = True
        storage = _Storage(
            nbytes=t.untyped_storage().nbytes(), stream=stream, device=t.device.index
        )
        if self.allocator is None and self.allocated_bytes + storage.nbytes > self.capacity():
            raise torch.OutOfMemoryError(_out_of_memory(storage, self))
        self._log("alloc", token, storage)
        if self.allocator is not None and storage.nbytes:
            s = current_stream()
            storage.ptr = self.allocator.alloc(storage.nbytes, s)
            self.shim.memo_emulated_bind_block(
                token, self.allocator.free_fn, storage.ptr, storage.nbytes, s.cuda_stream
            )
        self.storages[token] = storage
        self.allocations_by_stream[stream] = self.allocations_by_stream.get(stream, 0) + 1
        self.allocated_bytes += storage.nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self.lifetime_peak_bytes = max(self.lifetime_peak_bytes, self.allocated_bytes)
        self.clock.allocated(self.allocated_bytes)

    def collect_released(self) -> None:
        """Check the device storages dropped since the last op (the shim's meta allocator
        reports them; it has already freed their allocator blocks, on the dropping thread)."""
        buffer = (ctypes.c_size_t * 256)()
        while n := self.shim.memo_emulated_take_released(buffer, 256):
            with self.lock:
                for token in buffer[:n]:
                    storage = self.storages.pop(token, None)
                    if storage is not None:
                        self._log("free_requested", token, storage)
                        self.allocated_bytes -= storage.nbytes
                        self.timeline.released(storage, "a device block")

    def _log(self, action: str, token: int, storage: _Storage) -> None:
        if self.history is not None:  # the token stands for the block's address
            entry = {"action": action, "addr": token, "size": storage.nbytes, "frames": []}
            self.history[storage.device].append(entry)

    def record_memory_history(self, enabled="all", *args, **kwargs) -> None:
        """``torch.cuda.memory._record_memory_history``: every device block handed out and
        released is logged from now on (``enabled=None`` stops)."""
        self._stats_under_pluggable("recordHistory")
        self.history = None if enabled is None else [[] for _ in range(self.gpus)]

    def snapshot(self, *args, **kwargs) -> dict:
        """``torch.cuda.memory._snapshot``: the logged history per device, as torch gives it."""
        self._stats_under_pluggable("snapshot")
        return {"segments": [], "device_traces": [list(h) for h in self.history or []]}

    def record_stream(self, t: torch.Tensor, s) -> None:
        """``Tensor.record_stream``: the caching allocator defers the block's reuse past ``s``'s
        work; a pluggable allocator without a record-stream function does nothing with it."""
        if self.allocator is not None:
            raise OrderError(
                "record_stream under a pluggable allocator (the MEMO allocator core) does "
                "nothing: the block would be reused while the other stream still uses it"
            )
        storage = self.storages.get(self._token(t))
        if storage is not None:
            storage.recorded.add(getattr(s, "id", None) or current_stream().id)

    def host_waits_for_current_stream(self) -> None:
        stream = current_stream().id
        self.timeline.join(HOST, dict(self.timeline.clock(stream)))
        self.clock.sync(self.clock.now(stream), _site())

    # -- memory ---------------------------------------------------------------------------

    def registered_peak_bytes(self) -> int:
        """The most host bytes registered (cudaHostRegister) at once on this device."""
        return self.shim.memo_emulated_registered_peak(0)

    def pinned_bytes(self) -> int:
        """Host bytes pinned now: the emulated CachingHostAllocator's blocks (power-of-two,
        cached ones included) plus cudaHostRegister'ed ranges."""
        return (
            self.shim.memo_emulated_pinned_reserved() + self.shim.memo_emulated_registered_bytes()
        )

    def change_current_allocator(self, allocator: PluggableAllocator) -> None:
        if self.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.allocator = allocator

    def _stats_under_pluggable(self, what: str) -> None:
        if self.allocator is not None:
            raise RuntimeError(
                f"CUDAPluggableAllocator does not yet support {what}. If you need it, please "
                "file an issue describing your use case."
            )

    def memory_allocated(self, device=None) -> int:
        self._stats_under_pluggable("getDeviceStats")
        return self.allocated_bytes

    def max_memory_allocated(self, device=None) -> int:
        self._stats_under_pluggable("getDeviceStats")
        return self.peak_bytes

    def reset_peak_memory_stats(self, device=None) -> None:
        self._stats_under_pluggable("resetPeakStats")
        self.peak_bytes = self.allocated_bytes

    def memory_stats(self, device=None) -> dict:
        self._stats_under_pluggable("getDeviceStats")
        return {"allocated_bytes.all.current": self.allocated_bytes}

    def memory_snapshot(self, *args, **kwargs) -> list:
        self._stats_under_pluggable("snapshot")
        return []

    def capacity(self) -> int:
        """Device bytes the caching allocator can hand out: the GPU's memory less the CUDA
        context's, or the process's fraction of it."""
        usable = self.gpu.total_memory - CONTEXT_BYTES
        return int(min(usable, self.memory_fraction * self.gpu.total_memory))

    def set_memory_fraction(self, fraction: float, device=None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid memory fraction {fraction}, must be in [0, 1]")
        self.memory_fraction = fraction

    def set_device(self, device) -> None:
        index = _index(device)
        if not 0 <= index < self.gpus:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.shim.memo_emulated_set_current_device(index)
        self.initialized = True

    def properties(self, device=None) -> EmulatedGpu:
        if device is not None and not 0 <= _index(device) < self.gpus:
            raise AssertionError("Invalid device id")
        return self.gpu

    # -- installation ---------------------------------------------------------------------

    def patches(self) -> list[tuple[object, str, object]]:
        c, generators = torch.cuda, self.generators

        def generator(device="cuda"):
            return generators[_index(device)]

        def seed_all(seed):
            for g in generators:
                g.manual_seed(seed)

        return [
            (c, "is_available", lambda: True),
            (c, "is_initialized", lambda: True),
            (c, "_lazy_init", lambda: None),
            (c, "_lazy_call", lambda fn, **_: fn()),
            (c, "device_count", lambda: self.gpus),
            (c, "current_device", _current_index),
            (c, "set_device", self.set_device),
            (c, "synchronize", synchronize),
            (c.nvtx, "range_push", lambda msg: self.clock.push(msg) or 0),
            (c.nvtx, "range_pop", lambda: self.clock.pop() or 0),
            (c.nvtx, "mark", lambda msg: None),
            (c, "Stream", Stream),
            (c, "Event", Event),
            (c, "current_stream", current_stream),
            (c, "default_stream", lambda device=None: self.default),
            (c, "stream", stream),
            (c, "set_stream", set_stream),
            (c, "get_device_properties", self.properties),
            (c, "get_device_capability", lambda device=None: (self.gpu.major, self.gpu.minor)),
            (c, "get_device_name", lambda device=None: self.properties(device).name),
            (c, "is_bf16_supported", lambda *a, **k: True),
            (c, "memory_allocated", self.memory_allocated),
            (c, "max_memory_allocated", self.max_memory_allocated),
            (c, "memory_reserved", self.memory_allocated),
            (c, "max_memory_reserved", self.max_memory_allocated),
            (c, "reset_peak_memory_stats", self.reset_peak_memory_stats),
            (c, "memory_stats", self.memory_stats),
            (c, "memory_snapshot", self.memory_snapshot),
            (c, "empty_cache", lambda: None),
            (c, "mem_get_info", lambda device=None: (self.gpu.total_memory,) * 2),
            (c, "set_per_process_memory_fraction", self.set_memory_fraction),
            (c, "cudart", lambda: CudaRuntime),
            (c, "default_generators", generators),
            (c, "manual_seed", lambda seed: generator().manual_seed(seed) and None),
            (c, "manual_seed_all", seed_all),
            (c, "get_rng_state", lambda device="cuda": generator(device).get_state()),
            (c, "set_rng_state", lambda state, device="cuda": generator(device).set_state(state)),
            (c.random, "get_rng_state", lambda device="cuda": generator(device).get_state()),
            (c.random, "set_rng_state", lambda s, device="cuda": generator(device).set_state(s)),
            (c.memory, "CUDAPluggableAllocator", PluggableAllocator),
            (c.memory, "_record_memory_history", self.record_memory_history),
            (c.memory, "_snapshot", self.snapshot),
            (c.memory, "change_current_allocator", self.change_current_allocator),
            (torch.utils, "swap_tensors", _swap_tensors),
            (torch, "tensor", _on_current_device(_real_tensor)),
            (torch.nn.functional, "scaled_dot_product_attention", _sdpa_kernels),
            (torch, "as_tensor", _on_current_device(_real_as_tensor)),
            *[(module, "causal_lower_right", _dense_causal_lower_right) for module in _biases()],
            (dist, "init_process_group", _init_process_group),
            (dist, "new_group", _new_group),
            (dist, "all_gather_object", _all_gather_object),
            (dist, "gather_object", _gather_object),
            (dist, "scatter_object_list", _scatter_object_list),
            (dist, "broadcast_object_list", _broadcast_object_list),
        ]


_active: list[EmulatedCuda] = []


def _device() -> EmulatedCuda:
    if not _active:
        raise RuntimeError("the emulated CUDA device is not active")
    return _active[-1]


def _host_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
    aten._unsafe_view.default, aten.set_.source_Storage_storage_offset, aten.resize_.default,
}  # fmt: skip
"""Device ops that allocate, or alias without the schema saying so, and launch nothing."""


CONTEXT_BYTES = 512 << 20
"""Device memory the CUDA context, cuBLAS's workspace and NCCL's buffers take before torch's
allocator gets any (assumption: the order nvidia-smi shows for a process that initialised CUDA
on a Hopper part)."""


def _out_of_memory(storage: _Storage, device: EmulatedCuda) -> str:
    """torch's sentence for a caching-allocator failure (the sizes as it formats them)."""

    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

    total = device.gpu.total_memory
    free = max(0, device.capacity() - device.allocated_bytes)
    return (
        f"CUDA out of memory. Tried to allocate {size(storage.nbytes)}. GPU {storage.device} "
        f"has a total capacity of {size(total)} of which {size(free)} is free. Of the allocated "
        f"memory {size(device.allocated_bytes)} is allocated by PyTorch (emulated device)"
    )


def _group_ranks(group) -> list[int]:
    """The world ranks of a process group (its size alone where they cannot be read)."""
    if group is None:
        return [0]
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        return list(range(group.size()))


def _host_copy(func, inputs, outputs) -> tuple[str, int, bool] | None:
    """(direction, bytes, pinned) of an op copying between the host and the device."""
    args, kwargs = inputs
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
    elif func is aten._to_copy.default and outputs:
        dst, src = outputs[0], args[0]
    else:
        return None
    if not isinstance(src, torch.Tensor) or _on_device(dst) == _on_device(src):
        return None
    host = src if _on_device(dst) else dst
    pinned = not isinstance(host, FakeTensor) and host.is_pinned()
    kind = timing.TO_DEVICE if _on_device(dst) else timing.TO_HOST
    return kind, timing.tensor_bytes(src), pinned


_OWN_FILES = (
    os.path.dirname(__file__), os.path.dirname(torch.__file__), contextlib.__file__,
    package_device.__file__,
)  # fmt: skip


def _site() -> str:
    """Where the program asked for what is happening now: the innermost frame outside torch,
    this device and the standard library's plumbing (``file:line (function)``)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_OWN_FILES) and "/threading.py" not in path:
            return f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    """``memo_ext/...``, ``megatron/...`` and the like: the path from its package on."""
    for root in ("/memo_ext/", "/megatron/", "/tests/", "/tools/"):
        at = path.rfind(root)
        if at >= 0:
            return path[at + 1 :]
    return os.path.basename(path)


def _written_arguments(func, args, kwargs) -> set[int]:
    """``id`` of the tensors an op writes in place (its schema's mutable arguments)."""
    written = set()
    schema = func._schema
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
    for argument, value in zip(schema.arguments, values):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written |= {id(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)}
    return written


# ---- torch functions that cannot work unchanged on a device without data ----------------------

_real_swap_tensors = torch.utils.swap_tensors
_real_tensor, _real_as_tensor = torch.tensor, torch.as_tensor
_real_init_process_group = dist.init_process_group
_real_new_group = dist.new_group


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``Module.to`` swaps FakeTensor parameters, which FakeTensorMode holds weak references to
    (a swap refuses those); moving a device module to its own device changes nothing but the
    tensor, so the data assignment torch uses for plain tensors stands in."""
    if not isinstance(t1, FakeTensor):
        return _real_swap_tensors(t1, t2)
    with torch.no_grad():
        t1.data = t2.detach()


def _on_current_device(construct):
    """``torch.tensor`` / ``torch.as_tensor`` with ``device="cuda"`` give a tensor on the current
    device, as they do on a GPU: the CPU build's C++ constructor names device 0 instead."""

    def on_current_device(*args, device=None, **kwargs):
        if _is_cuda(device) and torch.device(device).index is None:
            device = torch.device("cuda", _current_index())
        return construct(*args, device=device, **kwargs)

    return on_current_device


def _biases() -> list:
    """Where ``causal_lower_right`` is looked up: torch's module, and the attention module once
    it imported the name (a later import picks up the stand-in)."""
    import sys

    import torch.nn.attention.bias

    loaded = sys.modules.get("memo_ext.mcore.attention")
    return [torch.nn.attention.bias, *([loaded] if loaded is not None else [])]


def _dense_causal_lower_right(queries: int, keys: int) -> torch.Tensor:
    """torch's ``CausalBias`` is a tensor subclass, which cannot wrap a FakeTensor: the same
    lower-right causal mask, dense (``True`` = attend), on the device."""
    rows = torch.arange(queries, device="cuda")[:, None] + (keys - queries)
    return torch.arange(keys, device="cuda")[None, :] <= rows


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _init_process_group(backend: str | None = None, **kwargs):
    """NCCL is torch's fake process group registered for ``cuda`` only (a CPU tensor on it
    raises, as on NCCL). One process: a real store, so gloo groups (``cpu:gloo,cuda:nccl``,
    megatron's gloo groups) are real; several emulated ranks in one process: a fake store and
    fake gloo groups, and the collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, world = _world()
    if backend and "nccl" in backend:
        backend = "cuda:fake" if backend == "nccl" else backend.replace("nccl", "fake")
        kwargs.setdefault("rank", rank)
        kwargs.setdefault("world_size", world)
        kwargs["store"] = dist.HashStore() if world == 1 else FakeStore()
        kwargs.pop("init_method", None)
    return _real_init_process_group(backend=backend, **kwargs)


def _new_group(*args, **kwargs):
    if _world()[1] > 1 and kwargs.get("backend") == "gloo":
        kwargs["backend"] = "cpu:fake"
    return _real_new_group(*args, **kwargs)


def _all_gather_object(object_list: list, obj: object, group=None) -> None:
    """Every emulated rank holds what this one holds (FakeTensors carry no pickled bytes)."""
    import copy

    for i in range(len(object_list)):
        object_list[i] = copy.deepcopy(obj)


def _gather_object(obj: object, object_gather_list: list | None = None, dst=None, group=None, **_):
    """The destination's list, where there is one: every emulated rank holds what this one does
    (torch.distributed.checkpoint gathers its save plans so)."""
    _all_gather_object(object_gather_list or [], obj)


def _scatter_object_list(
    scatter_object_output_list: list, scatter_object_input_list=None, src=None, group=None, **_
):
    """This rank's entry of the source's list (the source is this process, rank 0)."""
    scatter_object_output_list[0] = scatter_object_input_list[dist.get_rank(group)]


def _broadcast_object_list(object_list: list, src: int | None = None, group=None, **_) -> None:
    """The source's list: this process's own (it is rank 0 of the emulated world)."""


@contextlib.contextmanager
def emulated_cuda(
    *,
    rank: int | None = 0,
    world_size: int | None = 1,
    first_gemm_s: float = 0.0,
    gpu: str = "h100",
    gpus: int = 1,
    rates: timing.Rates | None = None,
    keep_intervals: bool = False,
) -> Iterator[EmulatedCuda]:
    """Run the block on the emulated CUDA device as rank ``rank`` of ``world_size``; each first
    matrix product of new shapes takes ``first_gemm_s`` host seconds (a kernel's first use).

    Args:
        rank: this process's rank; ``None`` (with ``world_size=None``): the launcher's, from the
            environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), left as it is.
        world_size: ranks of the job (the others are emulated: collectives move nothing).
        gpu: the part the device is (:data:`GPUS`, or a short name of :data:`ALIASES`).
        gpus: GPUs of the emulated machine (``torch.cuda.device_count()``).
        rates: the clock's rates (default: the part's preset, the estimator's efficiencies).
        keep_intervals: keep every op's interval for a trace (``device.clock.intervals``).

    Inside the block the package times device work on the device's clock
    (``memo_ext.device.clock``).

    Raises:
        RuntimeError: when the shim was not loaded before torch (``python -m tests.emulated``).
    """
    device = EmulatedCuda(
        first_gemm_s=first_gemm_s, gpu=gpu, gpus=gpus, rates=rates, keep_intervals=keep_intervals
    )
    _local.stream = None
    patches = device.patches()
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in patches]
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    for owner, name, value in patches:
        setattr(owner, name, value)
    _active.append(device)
    package_device.use_clock(lambda: device.clock.host)
    try:
        with device.mode:
            yield device
            gc.collect()  # what the block dropped dies on the device (pinned pages unpinned)
        device.collect_released()
    finally:
        _active.pop()
        package_device.use_clock(None)
        device.shim.memo_emulated_set_current_device(0)
        for owner, name, value in saved:
            setattr(owner, name, value)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["GPUS", "EmulatedCuda", "EmulatedGpu", "Event", "OrderError", "Stream", "emulated_cuda"]
