"""The clock of the modeled GPU: what each kernel, copy, collective and wait of a run costs.

The emulated device (:mod:`memo_ext.simulate.device`) sees every op the program issues, on the
stream it is issued to, in program order. :class:`Clock` gives each a start and an end:

* **Kernels** take ``max(FLOPs / (peak × efficiency), bytes / HBM bandwidth, floor)``. FLOPs are
  torch's own formulas (``torch.utils.flop_counter``: matrix products, the SDPA kernels forward
  and backward, causal ones at half); everything else is memory-bound, its bytes the tensors it
  reads and writes. Attention runs at the attention efficiency times the estimator's small-work
  factor ``c / (c + ATTENTION_HALF_TOKENS)`` for ``c`` query tokens, matrix products at the
  matmul efficiency: the estimator's constants, or a calibration file's.
* **Host ↔ device copies** run on one copy engine per direction at the host link's bandwidth
  (pinned memory), shared as the estimator shares an uplink between the GPUs behind one PCIe
  switch; copies of pageable memory run at :data:`PAGEABLE_FRACTION` of it and the host waits
  for them, as CUDA stages them through a pinned buffer.
* **Collectives** run on a stream of their group's, after the work the issuing stream has
  queued (as NCCL's do), and ``Work.wait()`` makes a stream wait for them: a ring over the
  group (NVLink inside a node, the network across nodes): all-reduce moves ``2(n−1)/n`` of the
  tensor, all-gather, reduce-scatter and all-to-all ``(n−1)/n`` of the whole one, broadcast and
  point-to-point all of it; each pays the estimator's latency.
* **The host** spends :data:`HOST_LAUNCH_S` per launch, not the emulator's own CPU time. A
  kernel starts when its stream is free and the host has launched it. Events carry times; a
  stream that waits takes the max; a host sync (``synchronize``, ``.item()``, a blocking copy)
  moves the host to the stream's time.

What is not modeled: contention between ranks (each rank is alone on its links but for the
uplink sharing above), clock throttling, kernels overlapping on one stream, kernels of two
streams slowing each other (a copy or a collective beside a kernel takes none of its HBM or
SMs), L2 effects, launch queues filling up. ``docs/simulate.md`` has the whole list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memo_ext.estimate.cost_model import (
    ATTENTION_HALF_TOKENS,
    CAUSAL_FRACTION,
    COLLECTIVE_START_S,
    HBM_EFFICIENCY,
    KERNEL_FLOOR_S,
    NETWORK_HOP_S,
    NVLINK_HOP_S,
    Efficiency,
)
from memo_ext.hardware import Calibration, DeviceSpec

HOST_LAUNCH_S = 6e-6
"""Host time to issue one kernel or copy: PyTorch's eager dispatch plus the CUDA launch call
(assumption: a few microseconds, the order measured for eager PyTorch on current CPUs)."""
PAGEABLE_FRACTION = 0.5
"""Copies of pageable host memory reach this share of the pinned bandwidth (assumption: CUDA
stages them through a pinned buffer, one more host memory pass)."""

BACKWARD_AS_COUNTED = 0.8
"""torch's formulas count a flash attention backward as 2.5 forwards (it recomputes the scores:
five products to the forward's two); the attention efficiency, the estimator's and a
calibration's (``memo_ext.estimate.calibration.attention_tflops``), is a rate of FLOPs counted
as twice the forward's. The backward's FLOPs are scaled to that count, so that the efficiency
means the same here."""

COMPUTE, TO_HOST, TO_DEVICE, COLLECTIVE = "compute", "to_host", "to_device", "collective"
"""What a stream's work is: the kinds a wait is charged to."""
MATMUL, ATTENTION, MEMORY_BOUND = "matmul", "attention", "memory-bound"
"""What a kernel is priced as: its FLOPs at the matmul or the attention rate, or its bytes at
the HBM bandwidth (element-wise ops, norms, reductions, the optimizer; the estimator counts
these as free, inside its efficiencies)."""
IDLE = "idle"
"""The trace's kind for the compute stream standing still (named by what it waited on)."""


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What the modeled GPU achieves: one set of constants for every op of a run."""

    device: str
    """The preset (``h100-80g``)."""
    peak_flops: float
    matmul_efficiency: float
    attention_efficiency: float
    hbm_bytes_per_s: float
    """Achieved device memory bandwidth (data sheet × ``HBM_EFFICIENCY``)."""
    host_bytes_per_s: float
    """Pinned host ↔ device bandwidth per GPU and direction, the uplink's sharing applied."""
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    gpus_per_node: int
    kernel_floor_s: float = KERNEL_FLOOR_S
    launch_s: float = HOST_LAUNCH_S
    source: str = "preset"
    """``preset`` (the estimator's default efficiencies) or the calibration file's path."""

    @classmethod
    def of(
        cls, spec: DeviceSpec, *, gpus: int = 1, calibration: Calibration | None = None,
        source: str = "preset",
    ) -> Rates:  # fmt: skip
        """The rates of ``spec`` with ``gpus`` GPUs of a node copying at once (every rank copies
        its layer's activations together), the calibration's efficiencies and host link if
        given, as the estimator applies them (``apply_calibration``)."""
        efficiency = Efficiency()
        if calibration is not None:
            from memo_ext.estimate.calibration import apply_calibration

            spec, efficiency = apply_calibration(calibration, device=spec, efficiency=efficiency)
        copying = min(gpus, spec.gpus_per_node)
        return cls(
            device=spec.name,
            peak_flops=spec.peak_tflops * 1e12,
            matmul_efficiency=efficiency.matmul,
            attention_efficiency=efficiency.attention,
            hbm_bytes_per_s=(spec.hbm_gbps or 2000.0) * 1e9 * HBM_EFFICIENCY,
            host_bytes_per_s=spec.host_copy_gbps(copying) * 1e9,
            nvlink_bytes_per_s=spec.nvlink_gbps * 1e9,
            network_bytes_per_s=spec.internode_gbps * 1e9,
            gpus_per_node=spec.gpus_per_node,
            source=source,
        )

    def describe(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Interval:
    """One op on one stream (kept for the trace when it is asked for)."""

    stream: int
    start: float
    end: float
    name: str
    kind: str


@dataclass
class StepFigures:
    """What one marked range (a training step) spent, on the clock."""

    name: str
    start: float
    end: float = 0.0
    busy_s: dict[int, float] = field(default_factory=dict)
    """Seconds of work per stream."""
    ops: dict[int, int] = field(default_factory=dict)
    idle_s: dict[str, float] = field(default_factory=dict)
    """The compute stream's idle seconds, by what it waited on."""
    host_syncs: dict[str, int] = field(default_factory=dict)
    """Host syncs by call site."""
    host_sync_s: dict[str, float] = field(default_factory=dict)
    """Host seconds spent waiting, by call site."""
    peak_device_bytes: int = 0
    """The most device bytes allocated at once."""
    compute_s: dict[str, float] = field(default_factory=dict)
    """The compute stream's kernel seconds by what they are priced as (``MATMUL``, ...)."""


class Clock:
    """Times of the streams, the copy engines and the host (see the module docstring)."""

    def __init__(self, rates: Rates, *, compute_stream: int, keep_intervals: bool = False):
        self.rates = rates
        self.compute_stream = compute_stream
        self.host = 0.0
        self.streams: dict[int, float] = {}
        """When each stream's queued work ends."""
        self.kinds: dict[int, str] = {}
        """The kind of each stream's latest work (a wait on it is charged to that kind)."""
        self.engines = {TO_HOST: 0.0, TO_DEVICE: 0.0}
        self.intervals: list[Interval] | None = [] if keep_intervals else None
        self.marks: list[tuple[str, float, str]] = []
        """(name, host time, "B" / "E") of the ranges the program marked."""
        self.steps: list[StepFigures] = []
        self._open: StepFigures | None = None
        self._host_waited_for: str | None = None
        """Why the host last stood still (a sync's site), until it launches again."""
        self.totals = StepFigures("total", 0.0)

    # -- the stream's side --------------------------------------------------------------

    def now(self, stream: int) -> float:
        return self.streams.get(stream, 0.0)

    def launch(
        self, stream: int, seconds: float, kind: str, name: str, priced_as: str | None = None
    ) -> float:
        """The host issues work of ``seconds`` to ``stream``; returns when it ends. ``priced_as``:
        a kernel's class (:func:`kernel_class`)."""
        self.host += self.rates.launch_s
        ready = self.now(stream)
        start = max(ready, self.host)
        if kind in self.engines:  # one copy engine per direction
            start = max(start, self.engines[kind])
        if stream == self.compute_stream and start > ready:
            if start == self.host and self.host > ready:
                why = self._host_waited_for or "launch (host-bound)"
            else:
                why = f"copy engine ({kind})"
            self._idle(why, ready, start)
        end = start + seconds
        if kind in self.engines:
            self.engines[kind] = end
        self.streams[stream] = end
        self.kinds[stream] = kind
        self._host_waited_for = None
        for figures in self._figures():
            figures.busy_s[stream] = figures.busy_s.get(stream, 0.0) + seconds
            figures.ops[stream] = figures.ops.get(stream, 0) + 1
            if priced_as is not None and stream == self.compute_stream:
                figures.compute_s[priced_as] = figures.compute_s.get(priced_as, 0.0) + seconds
        if self.intervals is not None:
            self.intervals.append(Interval(stream, start, end, name, kind))
        return end

    def wait(self, stream: int, until: float, on: int | None) -> None:
        """``stream`` waits for work that ends at ``until`` (an event, another stream)."""
        ready = self.now(stream)
        if until <= ready:
            return
        if stream == self.compute_stream:
            kind = self.kinds.get(on, COMPUTE) if on is not None else COMPUTE
            self._idle(f"wait for {kind}", max(ready, self.host), until)
        self.streams[stream] = until

    def sync(self, until: float, site: str) -> None:
        """The host waits until ``until`` (a sync at ``site``)."""
        for figures in self._figures():
            figures.host_syncs[site] = figures.host_syncs.get(site, 0) + 1
        if until > self.host:
            for figures in self._figures():
                figures.host_sync_s[site] = figures.host_sync_s.get(site, 0.0) + until - self.host
            self.host = until
            self._host_waited_for = f"host sync at {site}"

    def _idle(self, why: str, start: float, end: float) -> None:
        """The compute stream stands still from ``start`` to ``end`` (a slice of the trace)."""
        if end <= start:
            return
        for figures in self._figures():
            figures.idle_s[why] = figures.idle_s.get(why, 0.0) + end - start
        if self.intervals is not None:
            self.intervals.append(Interval(self.compute_stream, start, end, why, IDLE))

    def allocated(self, nbytes: int) -> None:
        """Device bytes allocated now (after an allocation)."""
        for figures in self._figures():
            figures.peak_device_bytes = max(figures.peak_device_bytes, nbytes)

    # -- ranges -------------------------------------------------------------------------

    def push(self, name: str) -> None:
        self.marks.append((name, self.host, "B"))
        if self._open is None and name.startswith("step "):
            self._open = StepFigures(name, self.host)

    def pop(self, name: str | None = None) -> None:
        self.marks.append((name or "", self.host, "E"))
        if self._open is not None and (name is None or name == self._open.name):
            self._open.end = self.host
            self.steps.append(self._open)
            self._open = None

    def _figures(self) -> list[StepFigures]:
        return [self.totals] if self._open is None else [self.totals, self._open]


# ---- what an op costs ---------------------------------------------------------------------


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def kernel_seconds(rates: Rates, func, args, kwargs, out, tensors) -> float:
    """One kernel on the roofline (see the module docstring); ``tensors``: what it reads and
    writes."""
    from torch.utils.flop_counter import flop_registry

    moved = sum(tensor_bytes(t) for t in tensors)
    seconds = moved / rates.hbm_bytes_per_s
    packet = func.overloadpacket
    formula = flop_registry.get(packet)
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=out)
        except Exception:  # noqa: BLE001 - an op the formula does not cover: memory-bound
            flops = 0
        if packet in _ATTENTION:
            query_tokens = args[0].shape[-2] if args[0].dim() >= 2 else 1
            if _causal(func, args, kwargs):
                flops *= CAUSAL_FRACTION
            if packet in _ATTENTION_BACKWARD:  # counted as the efficiencies are: see below
                flops *= BACKWARD_AS_COUNTED
            rate = (
                rates.attention_efficiency * query_tokens / (query_tokens + ATTENTION_HALF_TOKENS)
            )
        else:
            rate = rates.matmul_efficiency
        seconds = max(seconds, flops / (rates.peak_flops * rate))
    return max(seconds, rates.kernel_floor_s)


def kernel_class(func) -> str:
    """What :func:`kernel_seconds` prices ``func`` as: ``ATTENTION``, ``MATMUL`` (any other op
    torch has a FLOP formula for) or ``MEMORY_BOUND``."""
    from torch.utils.flop_counter import flop_registry

    packet = func.overloadpacket
    if packet in _ATTENTION:
        return ATTENTION
    return MATMUL if packet in flop_registry else MEMORY_BOUND


def copy_seconds(rates: Rates, nbytes: int, *, pinned: bool) -> float:
    rate = rates.host_bytes_per_s * (1.0 if pinned else PAGEABLE_FRACTION)
    return nbytes / rate + rates.kernel_floor_s


def collective_seconds(rates: Rates, name: str, nbytes: int, ranks: list[int]) -> float:
    """A ring collective ``name`` (c10d's op name) of ``nbytes`` (the whole tensor) over
    ``ranks``."""
    n = len(ranks)
    if n <= 1:
        return rates.kernel_floor_s
    one_node = len({r // rates.gpus_per_node for r in ranks}) == 1
    bandwidth = rates.nvlink_bytes_per_s if one_node else rates.network_bytes_per_s
    if "allreduce" in name:
        moved = 2 * (n - 1) / n * nbytes
    elif "gather" in name or "scatter" in name or "alltoall" in name:
        moved = (n - 1) / n * nbytes
    else:  # broadcast, send, recv
        moved = nbytes
    hops = 1 if name in ("send", "recv_", "recv_any_source_") else n - 1
    latency = COLLECTIVE_START_S + hops * (NVLINK_HOP_S if one_node else NETWORK_HOP_S)
    return latency + moved / bandwidth


def _causal(func, args, kwargs) -> bool:
    """Whether an SDPA kernel op runs causally (its ``is_causal`` argument)."""
    schema = func._schema
    for i, argument in enumerate(schema.arguments):
        if argument.name == "is_causal":
            return bool(args[i] if i < len(args) else kwargs.get("is_causal", False))
    return False


def _attention_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset(
        {
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_backward,
            aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_efficient_attention_backward,
            aten._scaled_dot_product_cudnn_attention,
            aten._scaled_dot_product_cudnn_attention_backward,
            aten._flash_attention_forward,
            aten._flash_attention_backward,
            aten._efficient_attention_forward,
            aten._efficient_attention_backward,
        }
    )


_ATTENTION: frozenset = frozenset()
_ATTENTION_BACKWARD: frozenset = frozenset()


def load() -> None:
    """Resolve the op sets (torch is imported by then)."""
    global _ATTENTION, _ATTENTION_BACKWARD
    if not _ATTENTION:
        _ATTENTION = _attention_ops()
        _ATTENTION_BACKWARD = frozenset(op for op in _ATTENTION if "backward" in str(op))
