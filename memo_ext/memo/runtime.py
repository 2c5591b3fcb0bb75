"""Per-process MEMO state shared by every layer of a model.

:class:`MemoRuntime` decides α (fixed, or solved at the first layer call), owns the host pool and
the transfer engine, runs each offloaded layer's forward under a :class:`LayerActivations`, keeps
the two ping-pong slots of source tensors whose device → host copies are in flight, prefetches the
next layer's host data during a layer's backward, and counts what moved for the metrics.

Ping-pong rule: the forward of the k-th offloaded layer puts its copy sources in slot ``k % 2``;
before that, the compute stream waits for the copies of layer ``k - 2`` in the same slot and drops
their sources. So at most two layers' worth of sources wait for copies at any time, and a layer's
compute never waits for the copies of the layer just before it.

The kept last layers take the slots' place (the paper's last two layers stay in the slots they
were produced in): before a kept layer's forward the compute stream waits for the copies of every
offloaded layer but the one just before it, whose copy still hides under this layer. With two
kept layers the device therefore holds two layers' sets when the forward ends, not two kept
layers plus two slots; the wait costs nothing when the copies kept pace with the compute (the
α rule makes them).

A layer runs through the runtime's mode (``memo_ext.memo.modes``): whole, or by sub-sequence
chunks (``--memo-chunk-tokens``, :mod:`memo_ext.memo.chunked_activations`), whose copies go out
in batches, one per chunk's phase and one for the layer's whole storages, at most
``Chunks.COPIES_IN_FLIGHT`` in flight. When the host budget cannot hold every chunked layer's
whole storages, the stage's last offloaded layers keep theirs on the device
(:attr:`MemoRuntime.skeletons`, fewest needed). The estimator prices a stage by the same mode.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mrandom
from torch import Tensor

from memo_ext.collectives import all_reduce_values
from memo_ext.config import MemoConfig
from memo_ext.device import gpu_rng_state, set_gpu_rng_state
from memo_ext.mcore.chunked import sp_groups
from memo_ext.memo.activations import (
    LayerActivations,
    MemoStats,
    ProbeShapes,
    ZeroAttention,
    run_token_slice,
)
from memo_ext.memo.alpha import HostMemoryError, LayerCost, solve_alpha
from memo_ext.memo.chunked_activations import ChunkedActivations
from memo_ext.memo.modes import PROBE_TOKENS, Chunks, WholeLayers, layer_mode, stage_counts
from memo_ext.memo.rules import offload_rule
from memo_ext.memo.transfer import (
    PAGE_BYTES,
    Completion,
    HostPool,
    build_transfer_engine,
    host_budget_bytes,
    measure_copy_gbps,
)

logger = logging.getLogger(__name__)

# the bandwidth probe copies this much at most (enough to reach steady PCIe throughput)
BANDWIDTH_PROBE_BYTES = 64 * 2**20


@dataclass
class _Slot:
    completion: Completion
    sources: list[Tensor] = field(default_factory=list)
    layer_index: int = -1
    """Index within the stage of the layer whose sources these are."""


class PassObserver(Protocol):
    """Told where each offloaded layer's passes start and end (the planned allocator).

    A forward pass is one offloaded layer's forward, copies issued; it is ended by
    :meth:`end_pass`. A backward pass starts when an offloaded layer's backward starts (its
    recompute first) and lasts until the next pass begins or the caller closes it: passes
    never overlap.
    """

    def begin_pass(self, name: str) -> None: ...

    def end_pass(self) -> None: ...


class MemoRuntime:
    """MEMO for the layers of one model in this process (see the module docstring)."""

    def __init__(self, config: MemoConfig):
        if config.chunk_tokens == "auto":
            raise ValueError("--memo-chunk-tokens auto must be settled (resolve_run) first")
        self.config = config
        self.rule = offload_rule(config.offload_rule)
        """Where a whole layer's saves go (``--memo-offload-rule``, ``memo_ext.memo.rules``)."""
        self.mode = layer_mode(config.chunk_tokens)
        """How layers run: whole, or by chunks of ``config.chunk_tokens`` local tokens."""
        self.skeletons = 0
        """Chunked: the stage's last offloaded layers that keep their whole storages on the
        device because the host budget holds only the others' (``skeleton_layers``)."""
        self.alpha: float | None = config.alpha
        """α in use; ``None`` until ``auto`` has been solved."""
        self.budget_bytes = host_budget_bytes(config)
        self.engine = None
        self.pool: HostPool | None = None
        self.stats = MemoStats()
        self.cost: LayerCost | None = None
        """What the first offloaded layer measured (bytes, and for ``auto`` the times)."""
        self._probes: dict[tuple, ProbeShapes] = {}
        self._slots: list[_Slot | None] = [None] * WholeLayers.COPY_SLOTS
        self._copies: deque[_Slot] = deque()
        """Chunked layers' copy batches in flight, oldest first."""
        self._forwards = 0
        self._last: weakref.ref | None = None
        self._budget_checked = False
        self.slot_bytes = 0
        """Largest device memory one ping-pong slot has pinned (the storages of its sources)."""
        self.live: weakref.WeakSet[LayerActivations] = weakref.WeakSet()
        self.passes: PassObserver | None = None
        """Told where layer passes start and end (``--memo-allocator plan``)."""

    # ------------------------------------------------------------------------------ forward

    def host_tokens(self, tokens: int) -> int:
        """Tokens per block that go to host memory: ``floor(α · tokens)``."""
        return min(tokens, math.floor(self.alpha * tokens + 1e-9))

    def forward_layer(self, layer: torch.nn.Module, kwargs: dict[str, Any]):
        """Run one offloaded layer's forward under MEMO; returns what the layer returns."""
        if self.passes is None:
            return self._forward_layer(layer, kwargs)
        self.passes.begin_pass("forward")
        try:
            return self._forward_layer(layer, kwargs)
        finally:
            self.passes.end_pass()

    def _forward_layer(self, layer: torch.nn.Module, kwargs: dict[str, Any]):
        x = kwargs["hidden_states"]
        self._ensure_engine(x.device)
        groups = sp_groups(layer)
        if self.alpha is None:
            self._solve_alpha(layer, kwargs, groups)
        a = self.host_tokens(x.size(0))
        return self.mode.offloaded_forward(self, layer, kwargs, host_tokens=a, groups=groups)

    def chunked(self, layer, kwargs: dict[str, Any], **options) -> ChunkedActivations:
        """A chunked layer's saves, offloaded through :meth:`_copy_chunk`."""
        index = layer.memo_index
        return ChunkedActivations(
            layer,
            kwargs,
            chunk_tokens=self.mode.chunk_tokens,
            offload=lambda pairs, reuse: self._copy_chunk(index, pairs, reuse),
            **self._served(),
            **options,
        )

    def activations(self, layer, kwargs: dict[str, Any], **options) -> LayerActivations:
        """A layer's saved tensors, served by this runtime's pool and transfer engine."""
        return LayerActivations(layer, kwargs, **self._served(), rule=self.rule, **options)

    def _served(self) -> dict[str, Any]:
        """What a layer's activations take from this runtime: host buffers, copies, counters,
        and the call at the start of its backward."""
        return dict(
            pool=self.pool, engine=self.engine, stats=self.stats, on_backward=self.begin_backward
        )

    def _ensure_engine(self, device: torch.device) -> None:
        if self.engine is None:
            self.engine = build_transfer_engine(device)
            self.pool = HostPool(budget_bytes=self.budget_bytes, pin_memory=self.engine.pin_memory)

    def probe(self, layer, kwargs: dict[str, Any], groups: int) -> ProbeShapes:
        """Shapes the layer saves on :data:`PROBE_TOKENS` tokens (cached per input shape)."""
        x = kwargs["hidden_states"]
        rope = kwargs.get("rotary_pos_emb")
        key = (type(layer), tuple(x.shape), x.dtype, _shape_of(rope), groups)
        if key not in self._probes:
            shapes: list[tuple[int, ...]] = []
            with _preserved_rng():
                run_token_slice(
                    layer,
                    kwargs,
                    start=0,
                    stop=PROBE_TOKENS,
                    groups=groups,
                    requires_grad=x.requires_grad,
                    stand_in=ZeroAttention(),
                    on_save=lambda t: shapes.append(tuple(t.shape)),
                )
            self._probes[key] = ProbeShapes(tokens=PROBE_TOKENS, shapes=shapes)
        return self._probes[key]

    def offload(self, acts: LayerActivations, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Issue the layer's device → host copies under the ping-pong rule."""
        slot_index = self._forwards % 2
        self._forwards += 1
        previous = self._slots[slot_index]
        if previous is not None:
            self.engine.wait(previous.completion)
        reuse = [buf.last_read for buf in acts.host_buffers]
        pairs = self.engine.stage(pairs)
        acts.offloaded = self.engine.to_host(pairs, reuse=reuse)
        sources = [src for _, src in pairs]
        self._slots[slot_index] = _Slot(acts.offloaded, sources, acts.layer_index)
        self.slot_bytes = max(self.slot_bytes, _storage_bytes(sources))
        self._drop_finished_slots()
        self.stats.d2h_bytes += sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        self.track(acts)

    def _copy_chunk(self, layer_index: int, pairs, reuse) -> Completion:
        """Issue one batch of a chunked layer's copies, at most :data:`COPIES_IN_FLIGHT` in
        flight (``Chunks.COPIES_IN_FLIGHT``): the oldest is waited for (its sources dropped)
        first."""
        while len(self._copies) >= Chunks.COPIES_IN_FLIGHT:
            self.engine.wait(self._copies.popleft().completion)
        pairs = self.engine.stage(pairs)
        completion = self.engine.to_host(pairs, reuse=reuse)
        self._copies.append(_Slot(completion, [src for _, src in pairs], layer_index))
        self.slot_bytes = max(self.slot_bytes, self.in_flight_source_bytes())
        while self._copies and self.engine.done(self._copies[0].completion):
            self._copies.popleft()
        self.stats.d2h_bytes += sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        return completion

    def track(self, acts: LayerActivations | ChunkedActivations) -> None:
        """A layer's forward is done (its copies are issued): count it, release its host
        buffers with it, and link it to the layer before for prefetching."""
        self.stats.offloaded_layers += 1
        weakref.finalize(acts, self.pool.release, list(acts.host_buffers))
        last = self._last() if self._last is not None else None
        if last is not None and last.layer_index == acts.layer_index - 1:
            acts.previous = weakref.ref(last)
        self._last = weakref.ref(acts)
        self.live.add(acts)

    def before_kept_layer(self, index: int) -> None:
        """A kept layer's forward (``index`` within the stage) starts: wait for the copies of
        every offloaded layer but the one just before it and drop their sources."""
        if self.engine is None:
            return
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.layer_index != index - 1:
                self.engine.wait(slot.completion)
                self._slots[i] = None
        for slot in [c for c in self._copies if c.layer_index != index - 1]:
            self.engine.wait(slot.completion)
            self._copies.remove(slot)

    def after_kept_layer(self, index: int, output) -> None:
        """A kept layer's forward is done: when it follows the last offloaded layer, that
        layer's host data is fetched as soon as this layer's backward starts (its output's
        gradient arrives), so the copy runs under this layer's backward as every other
        layer's runs under its successor's. Offloaded layers prefetch their predecessor when
        their own backward starts (:meth:`begin_backward`); a kept layer has no such start."""
        last = self._last() if self._last is not None else None
        hidden = output[0] if isinstance(output, tuple) else output
        if last is None or last.layer_index != index - 1 or not hidden.requires_grad:
            return
        previous = weakref.ref(last)

        def prefetch(grad):
            acts = previous()
            if acts is not None:
                acts.prefetch()
            return grad

        hidden.register_hook(prefetch)

    def _drop_finished_slots(self) -> None:
        for i, slot in enumerate(self._slots):
            if slot is not None and self.engine.done(slot.completion):
                self._slots[i] = None

    def in_flight_source_bytes(self) -> int:
        """Device bytes held only until in-flight device → host copies finish."""
        slots = [slot for slot in self._slots if slot is not None] + list(self._copies)
        return _storage_bytes([t for slot in slots for t in slot.sources])

    # ----------------------------------------------------------------------------- backward

    def begin_backward(self, acts: LayerActivations) -> None:
        """A layer's backward starts: free copied sources, prefetch the layer before it."""
        if self.passes is not None:
            self.passes.begin_pass("backward")
        for i, slot in enumerate(self._slots):
            if slot is not None:
                self.engine.wait(slot.completion)
                self._slots[i] = None
        while self._copies:
            self.engine.wait(self._copies.popleft().completion)
        previous = acts.previous() if acts.previous is not None else None
        if previous is not None:
            previous.prefetch()

    # --------------------------------------------------------------------- α and the budget

    def _solve_alpha(self, layer, kwargs: dict[str, Any], groups: int) -> None:
        """``auto``: measure one layer (bytes, forward time) and the copy bandwidth, solve α.

        On CUDA the layer runs once untimed first: the process's first launches pay for cuBLAS
        handles and workspaces and kernel loading, which would make the layer look slow and α
        too high (copies that no longer hide under the compute)."""
        x = kwargs["hidden_states"]
        n = x.size(0)
        with _preserved_rng():
            if x.device.type == "cuda":
                self._measured_forward(layer, kwargs, groups)
            acts, forward_s = self._measured_forward(layer, kwargs, groups)
        full, scaled = acts.host_bytes(0), acts.host_bytes(n) - acts.host_bytes(0)
        probe = self.pool.scratch(min(full + scaled, BANDWIDTH_PROBE_BYTES))
        # GPUs behind one host-link uplink time their copies together, as their layers copy
        gbps = measure_copy_gbps(
            self.engine, device=x.device, dst=probe, align=lambda: _start_together(layer)
        )
        del probe  # back to the budget before the layers' buffers are taken
        self.cost = LayerCost(
            full_bytes=full,
            tokenwise_bytes=scaled,
            forward_s=forward_s,
            copy_gbps=gbps,
            rounding_bytes=self._rounding_bytes(acts, n),
        )
        alpha = solve_alpha(
            self.cost,
            budget_bytes=self._skeleton_budget(layer),
            resident_layers=_resident_layers(layer),
        )
        self.alpha = _agree_min(alpha, layer)
        logger.info(
            "MEMO auto α = %.3f (layer forward %.1f ms, copy %.2f GB/s, %.1f MiB whole + "
            "%.1f MiB token-wise per layer)",
            self.alpha,
            forward_s * 1e3,
            gbps,
            full / 2**20,
            scaled / 2**20,
        )

    def _rounding_bytes(self, acts, tokens: int) -> int:
        """Bytes a layer's pinned host buffers may take beyond their sizes (a page each); 0
        unpinned, or for a record that does not count its buffers (chunked layers)."""
        count = getattr(acts, "host_buffer_count", None)
        if count is None or not self.pool.pin_memory:
            return 0
        return count(tokens) * PAGE_BYTES

    def _measured_forward(self, layer, kwargs: dict[str, Any], groups: int):
        """The layer's forward with every save measured (nothing offloaded); (its activations'
        record, seconds)."""
        return self.mode.measured_forward(self, layer, kwargs, groups=groups)

    def _skeleton_budget(self, layer) -> int:
        """Chunked: settle :attr:`skeletons` from :attr:`cost` and return the host budget the α
        rule sees, as if every layer's whole storages were on the host (the skeletons' bytes
        added back, since they stay on the device)."""
        offloaded, in_flight = stage_counts(layer)
        self.skeletons = self.mode.skeletons(
            self.cost, budget_bytes=self.budget_bytes, offloaded=offloaded, in_flight=in_flight
        )
        if self.skeletons:
            logger.info(
                "MEMO keeps the whole storages (%s each) of the last %d of %d offloaded layers "
                "on the device: the host budget of %s holds only the others'",
                format_bytes(self.cost.full_bytes),
                self.skeletons,
                offloaded,
                format_bytes(self.budget_bytes),
            )
        return self.budget_bytes + self.skeletons * in_flight * self.cost.full_bytes

    def check_budget(self, layer, acts: LayerActivations) -> None:
        """At the first offloaded layer: refuse to start what cannot fit the host budget."""
        if self._budget_checked:
            return
        self._budget_checked = True
        layers = _resident_layers(layer)
        if self.cost is None:
            self.cost = LayerCost(
                full_bytes=acts.host_bytes(0),
                tokenwise_bytes=acts.host_bytes(acts.tokens) - acts.host_bytes(0),
            )
            budget = self._skeleton_budget(layer)
        else:
            budget = self.budget_bytes + self.skeletons * stage_counts(layer)[1] * (
                self.cost.full_bytes
            )
        # as if every layer's whole storages were on the host, against the budget the
        # skeletons' device-resident bytes are added back to
        rounding = self._rounding_bytes(acts, acts.host_tokens)
        need = layers * (acts.host_bytes() + rounding)
        floor = layers * (acts.host_bytes(0) + self._rounding_bytes(acts, 0))
        logger.info(
            "MEMO α = %g: %d of %d tokens per block to host, %s per layer, up to %d layer "
            "activations held: %s of a %s host budget",
            self.alpha,
            acts.host_tokens,
            acts.tokens,
            format_bytes(acts.host_bytes()),
            layers,
            format_bytes(need - budget + self.budget_bytes),
            format_bytes(self.budget_bytes),
        )
        if floor > budget:
            raise HostMemoryError(
                f"MEMO needs at least {format_bytes(floor)} of host memory per process even at "
                f"α = 0 ({layers} layer activations of {format_bytes(acts.host_bytes(0))}), but "
                f"the budget is {format_bytes(self.budget_bytes)}; raise --memo-host-memory-gb, "
                "keep more layers on the device (--memo-keep-last-layers) or shard the sequence "
                "further (TP / CP / PP)"
            )
        if need > budget:
            raise HostMemoryError(
                f"MEMO at α = {self.alpha:g} needs {format_bytes(need)} of host memory per "
                f"process but the budget is {format_bytes(self.budget_bytes)}; lower --memo-alpha "
                f"(α = 0 needs {format_bytes(floor)}) or raise --memo-host-memory-gb"
            )

    # ---------------------------------------------------------------------------- metrics

    def take_metrics(self) -> dict[str, float | int]:
        """Per-iteration metrics since the last call; counters restart."""
        stats = self.stats.take()
        metrics: dict[str, float | int] = {
            "memo_alpha": self.alpha if self.alpha is not None else float("nan"),
            "host_offload_bytes": stats.d2h_bytes,
            "memo_d2h_bytes": stats.d2h_bytes,
            "memo_h2d_bytes": stats.h2d_bytes,
            "memo_recomputed_tokens": stats.recomputed_tokens,
            "memo_offloaded_layers": stats.offloaded_layers,
            "memo_host_pool_bytes": self.pool.allocated_bytes if self.pool else 0,
        }
        metrics.update(self.mode.metrics(self))
        wait_s = self.engine.take_wait_s() if self.engine is not None else None
        if wait_s is not None:
            metrics["memo_copy_wait_s"] = wait_s
        return metrics


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``6.4 KiB``: the largest unit that keeps the number >= 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _storage_bytes(tensors: list[Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _resident_layers(layer) -> int:
    """Offloaded layer activations this process may hold at once."""
    offloaded, in_flight = stage_counts(layer)
    return offloaded * in_flight


def _start_together(layer) -> None:
    """Line up the ranks that run this layer in lockstep (its TP and CP groups, and the data
    parallel replicas of its pipeline stage), so that their bandwidth probes overlap: ranks
    behind one PCIe switch then see the uplink shared, as their layers' copies will. Groups
    outside one pipeline stage are left alone (later stages reach their first layer later)."""
    pgs = layer.pg_collection
    for group in (pgs.tp, getattr(pgs, "dp_cp", None) or pgs.cp):
        if group is not None and group.size() > 1:
            all_reduce_values([0.0], group=group)


def _agree_min(alpha: float, layer) -> float:
    """The smallest α over the TP and CP groups: recompute passes gather over TP together."""
    for group in (layer.pg_collection.tp, layer.pg_collection.cp):
        if group is not None and group.size() > 1:
            (alpha,) = all_reduce_values([alpha], op=dist.ReduceOp.MIN, group=group)
    return alpha


def _shape_of(rope) -> tuple | None:
    if rope is None:
        return None
    if isinstance(rope, tuple):
        return tuple(tuple(r.shape) for r in rope)
    return tuple(rope.shape)


@contextlib.contextmanager
def _preserved_rng():
    """Run a pass that must not move any random stream (CPU, CUDA, megatron's tracker)."""
    cpu = torch.get_rng_state()
    gpu = gpu_rng_state()
    tracker = mrandom.get_cuda_rng_tracker()
    tracked = tracker.get_states() if tracker.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        set_gpu_rng_state(gpu)
        if tracked is not None:
            tracker.set_states(tracked)
