"""MEMO's two ways of running an offloaded layer, behind one interface: whole
(:class:`WholeLayers`) or by sub-sequence chunks (:class:`Chunks`, ``--memo-chunk-tokens``).

A mode is what the runtime runs a layer's forward through (``MemoRuntime``), and what the
estimator prices a pipeline stage by (``memo_ext.estimate.cost_model``): the copies each keeps
in flight, the layers that keep their whole storages on the device, what a backward prefetches,
and hence a stage's device bytes (:meth:`LayerMode.stage_bytes`). Each rule is written once,
here; :func:`layer_mode` picks the mode of a chunk size.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from memo_ext.device import clock
from memo_ext.memo.alpha import LayerCost, skeleton_layers, slots_after_forward

if TYPE_CHECKING:
    import torch

PROBE_TOKENS = 1
"""Tokens a whole layer's forward runs on to learn the shapes it saves (α strictly between 0
and 1, ``MemoRuntime.probe``)."""


class MemoRuntime(Protocol):
    """What a mode runs a layer with: the runtime's activations, copies and budget
    (``memo_ext.memo.runtime.MemoRuntime``)."""

    skeletons: int

    def activations(self, layer, kwargs: dict[str, Any], **options): ...

    def chunked(self, layer, kwargs: dict[str, Any], **options): ...

    def probe(self, layer, kwargs: dict[str, Any], groups: int): ...

    def offload(self, acts, pairs) -> None: ...

    def check_budget(self, layer, acts) -> None: ...

    def track(self, acts) -> None: ...


@dataclass(frozen=True)
class StageBytes:
    """One pipeline stage's per-layer device figures under MEMO, traced or measured
    (``memo_ext.estimate.measure``), for :meth:`LayerMode.stage_bytes`."""

    keep: int
    """Layers at the end of the stage that keep their activations on the device."""
    offloaded: int
    """Layers of the stage that offload."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once (1F1B: ``pp - pp_rank``)."""
    kept_saved_bytes: int
    """A kept layer's saved tensors (one micro-batch)."""
    saved_bytes: int
    """What an offloaded layer leaves on the device until its backward."""
    slot_bytes: int
    """Device bytes the copies in flight pin (whole: one ping-pong slot; chunked: the batches
    in flight together)."""
    whole_host_bytes: int
    """An offloaded layer's whole storages (its host set at α = 0)."""
    skeleton_bytes: int
    """Chunked: whole storages kept on the device for want of host memory."""
    layer_transient_bytes: int
    """A layer's forward / backward transient (whole)."""
    live_bytes: int
    """Chunked: one offloaded layer's forward + backward live set, traced."""
    loss_transient_bytes: int
    """The loss's transient."""

    @property
    def resident(self) -> int:
        """Offloaded layer activations held at once."""
        return self.offloaded * self.in_flight

    @property
    def kept_bytes(self) -> int:
        return self.in_flight * self.keep * self.kept_saved_bytes


class LayerMode(abc.ABC):
    """How MEMO runs an offloaded layer (see the module docstring)."""

    chunk_tokens: int | None = None

    def check_layer(self, layer) -> None:
        """Refuse a layer this mode cannot run."""
        return None  # an optional hook: nothing by default

    @abc.abstractmethod
    def kept_forward(self, layer, kwargs: dict[str, Any]):
        """A kept layer's forward (its activations stay on the device)."""

    @abc.abstractmethod
    def offloaded_forward(
        self, runtime: MemoRuntime, layer, kwargs: dict[str, Any], *, host_tokens: int, groups: int
    ):
        """An offloaded layer's forward, its copies issued; what the layer returns."""

    @abc.abstractmethod
    def measured_forward(self, runtime: MemoRuntime, layer, kwargs: dict[str, Any], *, groups: int):
        """The layer's forward with every save measured, nothing offloaded: (its activations,
        seconds)."""

    def skeletons(
        self, cost: LayerCost, *, budget_bytes: int, offloaded: int, in_flight: int
    ) -> int:
        """Offloaded layers at the end of the stage that keep their whole storages on the
        device so that the others' fit the host budget."""
        return 0

    def metrics(self, runtime: MemoRuntime) -> dict[str, int]:
        """The mode's own per-step figures."""
        return {}

    @abc.abstractmethod
    def stage_bytes(self, b: StageBytes) -> tuple[int, int]:
        """(device bytes the stage holds when its forward ends, its activation peak)."""


class WholeLayers(LayerMode):
    """Every offloaded layer runs whole; its copies go out under the ping-pong rule: at most
    :data:`COPY_SLOTS` layers' copies in flight, the oldest waited for first."""

    COPY_SLOTS = 2

    def kept_forward(self, layer, kwargs):
        return layer.forward_plain(**kwargs)

    def offloaded_forward(self, runtime, layer, kwargs, *, host_tokens, groups):
        n = kwargs["hidden_states"].size(0)
        if 0 < host_tokens < n and kwargs.get("packed_seq_params") is not None:
            raise ValueError(
                "MEMO with 0 < --memo-alpha < 1 does not support packed sequences yet; "
                "use --memo-alpha 0 or 1"
            )
        probe = runtime.probe(layer, kwargs, groups) if 0 < host_tokens < n else None
        acts = runtime.activations(
            layer, kwargs, host_tokens=host_tokens, groups=groups, probe=probe
        )
        with acts.capturing():
            out = layer.forward_plain(**kwargs)
        runtime.check_budget(layer, acts)
        runtime.offload(acts, acts.end_forward())
        return out

    def measured_forward(self, runtime, layer, kwargs, *, groups):
        x = kwargs["hidden_states"]
        n = x.size(0)
        probe = runtime.probe(layer, kwargs, groups) if n > PROBE_TOKENS else None
        acts = runtime.activations(
            layer, kwargs, host_tokens=n, groups=groups, probe=probe, measure_only=True
        )
        with acts.capturing():
            seconds = _timed(x.device, lambda: layer.forward_plain(**kwargs))
        acts.end_forward()
        return acts, seconds

    def stage_bytes(self, b):
        # the kept layers take the ping-pong slots' place (``slots_after_forward``); while the
        # offloaded layers run, two slots of copy sources may be in flight
        slots = slots_after_forward(offloaded=b.resident, kept=b.keep)
        stored = b.kept_bytes + b.resident * b.saved_bytes + slots * b.slot_bytes
        during = b.resident * b.saved_bytes + min(self.COPY_SLOTS, b.resident) * b.slot_bytes
        # backward of an offloaded layer: its restored set plus the next one's prefetched set
        restored = (2 * b.kept_saved_bytes if b.offloaded else 0) + (b.in_flight - 1) * b.keep * (
            b.kept_saved_bytes
        )
        layer_t = b.layer_transient_bytes
        peak = max(
            stored + b.loss_transient_bytes, stored + layer_t, restored + layer_t, during + layer_t
        )
        return stored, peak


class Chunks(LayerMode):
    """Every layer runs its token-local work by sub-sequence chunks of ``chunk_tokens`` local
    tokens (``memo_ext.mcore.chunked``); an offloaded layer's copies go out in batches (one per
    chunk's phase, one for its whole storages), at most :data:`COPIES_IN_FLIGHT` in flight;
    the stage's last offloaded layers keep their whole storages on the device when the host
    budget cannot hold every layer's (the skeletons)."""

    COPIES_IN_FLIGHT = 4

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    # megatron-core's layers, imported by the runtime's calls only: the estimator reads these
    # modes' sizes without megatron-core (the tools' --help imports none)
    def check_layer(self, layer) -> None:
        from memo_ext.mcore.chunked import check_chunkable

        check_chunkable(layer)

    def kept_forward(self, layer, kwargs):
        from memo_ext.mcore.chunked import ChunkedLayer

        return ChunkedLayer(layer, kwargs, self.chunk_tokens).forward(kwargs["hidden_states"])

    def offloaded_forward(self, runtime, layer, kwargs, *, host_tokens, groups):
        offloaded = stage_counts(layer)[0]
        skeleton = runtime.skeletons > 0 and layer.memo_index >= offloaded - runtime.skeletons
        acts = runtime.chunked(layer, kwargs, host_tokens=host_tokens, skeleton_on_device=skeleton)
        out = acts.run()
        runtime.check_budget(layer, acts)
        runtime.track(acts)
        return out

    def measured_forward(self, runtime, layer, kwargs, *, groups):
        x = kwargs["hidden_states"]
        acts = runtime.chunked(layer, kwargs, host_tokens=x.size(0), measure_only=True)
        return acts, _timed(x.device, acts.run)

    def skeletons(self, cost, *, budget_bytes, offloaded, in_flight):
        return skeleton_layers(
            cost, budget_bytes=budget_bytes, offloaded_layers=offloaded, in_flight=in_flight
        )

    def metrics(self, runtime):
        return {"memo_device_skeletons": runtime.skeletons}

    def stage_bytes(self, b):
        # a few chunks' copies in flight, whatever the layer count; one offloaded layer's
        # forward + backward live set is traced whole (its restored data included); its
        # backward also holds the next layer's prefetched whole storages (its α = 0 host set);
        # a kept layer's backward is priced as an offloaded layer's (conservative)
        stored = (
            b.kept_bytes
            + b.resident * b.saved_bytes
            + b.skeleton_bytes
            + (b.slot_bytes if b.resident else 0)
        )
        prefetch = b.whole_host_bytes if b.offloaded else 0
        restored = (b.in_flight - 1) * b.keep * b.kept_saved_bytes + prefetch + b.skeleton_bytes
        peak = max(stored + b.loss_transient_bytes, stored + b.live_bytes, restored + b.live_bytes)
        return stored, peak


def stage_counts(layer) -> tuple[int, int]:
    """(the stage's offloaded layers, the micro-batches in flight: ``pp - pp_rank`` under
    1F1B)."""
    offloaded = max(0, layer.memo_stage_layers - layer.memo_runtime.config.kept_layers)
    pp = layer.pg_collection.pp
    in_flight = pp.size() - pp.rank() if pp is not None else 1
    return offloaded, in_flight


def layer_mode(chunk_tokens: int | None) -> LayerMode:
    """The mode of ``--memo-chunk-tokens`` (settled; ``None``: whole layers)."""
    return WholeLayers() if chunk_tokens is None else Chunks(chunk_tokens)


def _timed(device: torch.device, run) -> float:
    """Seconds ``run()`` takes, the device synchronised before and after."""
    import torch  # here: the estimator reads the modes' byte rules without loading torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    start = clock()
    run()
    sync(device)
    return clock() - start


__all__ = [
    "PROBE_TOKENS",
    "Chunks",
    "LayerMode",
    "StageBytes",
    "WholeLayers",
    "layer_mode",
    "stage_counts",
]
