"""The baselines' device memory as PyTorch's caching allocator serves it.

Megatron's methods (no recomputation, full, selective) allocate through PyTorch's caching
allocator, which reserves more than is allocated (fragmentation) and, near the device's limit,
empties its cache and retries (``cudaFree`` of every cached segment, which synchronises the
device, then ``cudaMalloc`` again). MEMO serves its activations from a planned region instead.
This module prices that difference:

- :func:`iteration_fit` traces the busiest pipeline stage's iteration on fake tensors (the
  planner's ``trace_transformer_layer``: embedding, the stage's layers, the loss, backward; full
  recomputation as megatron-core's checkpoint of each layer, selective through the config) at two
  lengths. Every tensor's size is affine in the tokens and the event order does not depend on
  them, so one pair of traces gives the trace at any length (checked against a third trace in
  ``tests/unit/test_fragmentation.py``).
- :func:`replay_iteration` runs that trace through the caching-allocator model
  (``memo_ext.planner.caching_allocator``) with the memory left beside the model states as its
  limit: the pipeline's micro-batches in flight (1F1B), two iterations (the second starts from
  the first's cache, as every later one does), and the empty-cache-and-retry of a request that
  would pass the limit. Its outcome is the reserved peak, whether the run fits, and how often
  it retried.

Model states (weights, gradient buffer, optimizer state) are allocated once, in large buffers,
before the first iteration; they are counted as reserved = allocated. Retry cost: an assumption
of :data:`RETRY_SYNC_S` per empty-cache (the device drains its queue, the host stops issuing
kernels) plus :data:`CUDA_CALL_S` per segment released or reserved again, order-of-magnitude
figures of ``cudaFree`` / ``cudaMalloc`` on large segments; a calibration does not measure them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memo_ext.estimate.trace_cache import cached
from memo_ext.parallel import ParallelLayout
from memo_ext.planner.caching_allocator import CachingAllocatorModel, OutOfMemory
from memo_ext.planner.trace import Alloc, Trace
from memo_ext.shapes import ModelShape

if TYPE_CHECKING:
    from memo_ext.estimate.stage import MemoryMethod

RETRY_SYNC_S = 5e-3
"""One empty-cache-and-retry: a device synchronisation that drains the queue (assumption)."""
CUDA_CALL_S = 1e-3
"""One ``cudaFree`` or ``cudaMalloc`` of a large segment (assumption, order of magnitude)."""
MAX_REPLAYED_MICROBATCHES = 2
"""Micro-batches replayed beyond those in flight: enough for the steady state of 1F1B."""


@dataclass(frozen=True)
class IterationFit:
    """An iteration's events with each allocation's size affine in the local tokens."""

    t1: int
    events: tuple[tuple[str, str, int, int], ...]
    """``(op, id, size at t1, size at 2·t1)``; frees carry sizes 0."""
    first_backward: int
    """Index of the first backward event (the forward part is ``events[:first_backward]``)."""

    def events_at(self, tokens: int) -> list[tuple[str, str, int]]:
        """``(op, id, size)`` at ``tokens`` local tokens (at least 1 byte each)."""
        out = []
        for op, tid, low, high in self.events:
            size = 0 if op == "free" else max(1, round(low + (high - low) * (tokens / self.t1 - 1)))
            out.append((op, tid, size))
        return out


def _trace(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    method: MemoryMethod,
    tokens: int,
    layers: int,
    loss: bool,
    micro_batch_size: int,
    settings: Any = None,
    loss_chunks: int = 1,
) -> Trace:
    from memo_ext.mcore.transformer_config import traced_transformer_config
    from memo_ext.planner.capture import trace_transformer_layer

    # full recomputation is traced as megatron-core's checkpoint of each layer, its config plain
    overrides, recompute_layers = method.replay_layers(settings)
    config = traced_transformer_config(
        model, layout=ParallelLayout(tp=tp, sp=sp), num_layers=1, **overrides
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_transformer_layer(
            config=config,
            seq_length=tokens,
            micro_batch_size=micro_batch_size,
            num_layers=layers,
            vocab_size=model.vocab_size if loss else None,
            recompute_layers=recompute_layers,
            megatron_loss=True,
            loss_chunks=loss_chunks if loss else 1,
        )


@functools.lru_cache(maxsize=128)
def iteration_fit(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    method: MemoryMethod,
    layers: int,
    loss: bool,
    settings: Any = None,
    micro_batch_size: int = 1,
    loss_chunks: int = 1,
) -> IterationFit:
    """The iteration of ``layers`` layers (with the embedding and loss ends if ``loss``, the
    loss over ``loss_chunks`` slices as the trainer's ``--loss-chunks``), traced at two lengths,
    as an :class:`IterationFit` in local tokens (``s / cp``).

    Kept on disk by its inputs, the method and the code (``memo_ext.estimate.trace_cache``).

    Raises:
        ValueError: if the two traces' events differ in order (a size that is not affine in the
            tokens would show there).
    """
    loss_chunks = loss_chunks if loss else 1  # the first stage's trace is the same for any
    key = dict(
        model=dataclasses.asdict(model),
        tp=tp,
        sp=sp,
        layers=layers,
        loss=loss,
        micro_batch_size=micro_batch_size,
        loss_chunks=loss_chunks,
    )
    return cached(
        "iteration",
        key,
        lambda: _iteration_fit(
            model,
            tp=tp,
            sp=sp,
            method=method,
            layers=layers,
            loss=loss,
            settings=settings,
            micro_batch_size=micro_batch_size,
            loss_chunks=loss_chunks,
        ),
        encode=dataclasses.asdict,
        decode=_decode_iteration,
        method=method,
        settings=settings,
    )


def _decode_iteration(value: dict) -> IterationFit:
    events = tuple((str(op), str(tid), int(a), int(b)) for op, tid, a, b in value["events"])
    return IterationFit(
        t1=int(value["t1"]), events=events, first_backward=int(value["first_backward"])
    )


def _iteration_fit(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    method: MemoryMethod,
    layers: int,
    loss: bool,
    settings: Any,
    micro_batch_size: int,
    loss_chunks: int,
) -> IterationFit:
    """The traces behind :func:`iteration_fit`."""
    t1 = 2048 * (tp if sp else 1)
    kw = dict(
        tp=tp,
        sp=sp,
        method=method,
        settings=settings,
        layers=layers,
        loss=loss,
        micro_batch_size=micro_batch_size,
        loss_chunks=loss_chunks,
    )
    low, high = (_trace(model, tokens=t, **kw).events for t in (t1, 2 * t1))
    if len(low) != len(high):
        raise ValueError(
            f"the {method.name} iteration's trace has {len(low)} events at {t1} tokens "
            f"but {len(high)} at {2 * t1}"
        )
    events, first_backward = [], None
    for k, (a, b) in enumerate(zip(low, high)):
        if type(a) is not type(b) or a.id != b.id:
            raise ValueError(f"the {method.name} iteration's trace differs at event {k}: {a} / {b}")
        if isinstance(a, Alloc):
            if first_backward is None and a.phase in ("loss_bwd", "bwd", "embedding_bwd"):
                first_backward = k
            events.append(("alloc", a.id, a.size, b.size))
        else:
            events.append(("free", a.id, 0, 0))
    return IterationFit(t1=t1, events=tuple(events), first_backward=first_backward or len(events))


@dataclass(frozen=True)
class AllocatorOutcome:
    """What the caching allocator does with a stage's iterations under a memory limit."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    """Activations only (the model states come on top, reserved as allocated)."""
    fits: bool
    """No request failed after emptying the cache."""
    retries: int
    """Empty-cache-and-retry events in the last replayed iteration (each later one repeats it)."""
    segment_calls: int
    """``cudaFree`` + ``cudaMalloc`` calls those retries cost in the last iteration."""
    microbatches: int = 1
    """Micro-batches one replayed iteration runs."""

    @property
    def fragmentation_bytes(self) -> int:
        return self.reserved_peak_bytes - self.allocated_peak_bytes

    @property
    def retry_s(self) -> float:
        """Seconds per iteration the retries cost (:data:`RETRY_SYNC_S`, :data:`CUDA_CALL_S`)."""
        return self.retries * RETRY_SYNC_S + self.segment_calls * CUDA_CALL_S


def replayed_microbatches(in_flight: int) -> int:
    """Micro-batches one replayed iteration runs with ``in_flight`` in flight (1F1B)."""
    return in_flight + MAX_REPLAYED_MICROBATCHES - 1 if in_flight > 1 else 1


def _schedule(
    fit: IterationFit, *, tokens: int, in_flight: int
) -> list[tuple[str, str, int, bool]]:
    """One iteration of 1F1B on this stage as ``(op, id, size, persistent)``: ``in_flight``
    forwards, then backward / forward pairs, then the last backwards, tensor ids made unique per
    micro-batch.

    What the trace never frees is of two kinds: a forward's (megatron's global buffer for the
    sequence-parallel all-gather) lives as long as the process and is allocated once, by the
    first micro-batch (``persistent``); a backward's (the gradient of a stage's input, which
    1F1B sends to the previous stage) ends with its micro-batch's backward."""
    events = fit.events_at(tokens)
    freed = {tid for op, tid, _ in events if op == "free"}
    forward, backward = events[: fit.first_backward], events[fit.first_backward :]
    persistent = {tid for op, tid, _ in forward if op == "alloc" and tid not in freed}
    sent = [tid for op, tid, _ in backward if op == "alloc" and tid not in freed]
    micro = replayed_microbatches(in_flight)
    order = [("f", m) for m in range(min(in_flight, micro))]
    next_forward = len(order)
    for m in range(micro):
        order.append(("b", m))
        if next_forward < micro:
            order.append(("f", next_forward))
            next_forward += 1
    out = []
    for part, m in order:
        for op, tid, size in forward if part == "f" else backward:
            if tid in persistent:
                if m == 0:
                    out.append((op, tid, size, True))
                continue
            out.append((op, f"{tid}.{m}", size, False))
        if part == "b":
            out += [("free", f"{tid}.{m}", 0, False) for tid in sent]
    return out


def replay_iteration(
    fit: IterationFit,
    *,
    tokens: int,
    in_flight: int,
    limit_bytes: int | None,
    iterations: int = 2,
) -> AllocatorOutcome:
    """Replays ``iterations`` iterations of the stage at ``tokens`` local tokens through the
    caching-allocator model, with ``limit_bytes`` for the activations (``None``: no limit).
    Retries are those of the last iteration: the steady state every later one repeats."""
    model = CachingAllocatorModel(limit_bytes=limit_bytes)
    schedule = _schedule(fit, tokens=tokens, in_flight=in_flight)
    fits = True
    retries = calls = 0
    for it in range(iterations):
        retries_before, calls_before = model.retries, model.segment_calls
        try:
            for op, tid, size, persistent in schedule:
                if persistent:  # allocated once, by the first iteration, and kept
                    if it == 0 and op == "alloc":
                        model.malloc(tid, size)
                elif op == "alloc":
                    model.malloc(f"{tid}/{it}", size)
                else:
                    model.free(f"{tid}/{it}")
        except OutOfMemory:
            fits = False
            break
        retries, calls = model.retries - retries_before, model.segment_calls - calls_before
    report = model.report
    return AllocatorOutcome(
        allocated_peak_bytes=report.allocated_peak_bytes,
        reserved_peak_bytes=report.reserved_peak_bytes,
        fits=fits,
        retries=retries,
        segment_calls=calls,
        microbatches=replayed_microbatches(in_flight),
    )


def stage_replay(
    model: ModelShape,
    layout: ParallelLayout,
    *,
    method: MemoryMethod,
    settings: Any = None,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    limit_bytes: int | None,
    loss_chunks: int = 1,
) -> AllocatorOutcome:
    """The busiest stage under the caching allocator: with PP the first stage (its layers,
    ``min(pp, micro-batches)`` in flight) and the last (its layers and the loss, one in flight),
    whichever reserves more; without PP the whole model. ``method`` with ``settings`` says how
    the layers are built (``MemoryMethod.replay_layers``); ``loss_chunks``: the trainer's
    ``--loss-chunks``. Kept on disk (``memo_ext.estimate.trace_cache``): the replays of a
    question asked again cost nothing either."""
    tokens = seq_length // layout.cp
    in_flight = min(layout.pp, num_microbatches)
    key = dict(
        model=dataclasses.asdict(model),
        tp=layout.tp,
        sp=layout.sp,
        pp=layout.pp,
        tokens=tokens,
        in_flight=in_flight,
        micro_batch_size=micro_batch_size,
        limit_bytes=limit_bytes,
        loss_chunks=loss_chunks,
    )
    return cached(
        "replay",
        key,
        lambda: _stage_replay(
            model,
            layout,
            method=method,
            settings=settings,
            tokens=tokens,
            in_flight=in_flight,
            micro_batch_size=micro_batch_size,
            limit_bytes=limit_bytes,
            loss_chunks=loss_chunks,
        ),
        encode=dataclasses.asdict,
        decode=lambda value: AllocatorOutcome(**value),
        method=method,
        settings=settings,
    )


def _stage_replay(
    model: ModelShape,
    layout: ParallelLayout,
    *,
    method: MemoryMethod,
    settings: Any,
    tokens: int,
    in_flight: int,
    micro_batch_size: int,
    limit_bytes: int | None,
    loss_chunks: int,
) -> AllocatorOutcome:
    """The replays behind :func:`stage_replay`, at ``tokens`` local tokens with ``in_flight``
    micro-batches in flight on the first stage."""
    stage_layers = model.num_layers // layout.pp
    kw = dict(
        tp=layout.tp,
        sp=layout.sp,
        method=method,
        settings=settings,
        layers=stage_layers,
        micro_batch_size=micro_batch_size,
    )
    if layout.pp == 1:
        fit = iteration_fit(model, loss=True, loss_chunks=loss_chunks, **kw)
        return replay_iteration(fit, tokens=tokens, in_flight=1, limit_bytes=limit_bytes)
    first = replay_iteration(
        iteration_fit(model, loss=False, **kw),
        tokens=tokens,
        in_flight=in_flight,
        limit_bytes=limit_bytes,
    )
    last = replay_iteration(
        iteration_fit(model, loss=True, loss_chunks=loss_chunks, **kw),
        tokens=tokens,
        in_flight=1,
        limit_bytes=limit_bytes,
    )
    if not first.fits or not last.fits:
        return first if not first.fits else last
    return max(first, last, key=lambda o: o.reserved_peak_bytes)
