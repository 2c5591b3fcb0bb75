"""The estimator's stage protocol: how a memory method prices the busiest pipeline stage.

``memo_ext.estimate.cost_model.estimate`` works out what every configuration shares (model
states, the plain layer's figures and time, the transients, the host budget), hands it to the
method as a :class:`StageContext`, and turns the :class:`Stage` the method returns into step
time, MFU and the device peak. The estimator names no method: no recomputation, Megatron's full
and selective recomputation and MEMO are :class:`MemoryMethod` subclasses of their features
(``memo_ext.features``), which also say which runs select them and what a search tries.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from memo_ext.estimate.fits import LayerFigures
from memo_ext.hardware import DeviceSpec
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

if TYPE_CHECKING:
    from memo_ext.config import RunConfig


@dataclass
class LayerTime:
    """One layer's forward + backward for one micro-batch: compute, exposed communication and
    exposed host copies, seconds; ``forward_s`` is its forward alone."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    copy_s: float = 0.0
    forward_s: float = 0.0

    def add(self, other: LayerTime, times: int = 1) -> None:
        self.compute_s += times * other.compute_s
        self.comm_s += times * other.comm_s
        self.copy_s += times * other.copy_s


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where a layer runs: one configuration's model, layout, batch, device and efficiencies,
    and the tokens of one sequence on a process (``s / cp``)."""

    model: ModelShape
    layout: ParallelLayout
    batch: Any
    """``memo_ext.estimate.cost_model.Batch``."""
    device: DeviceSpec
    eff: Any
    """``memo_ext.estimate.cost_model.Efficiency``."""
    tokens: int


@dataclass(frozen=True, kw_only=True)
class StageContext(Place):
    """What every method's stage is priced from (one configuration, one process)."""

    none: LayerFigures
    """The layer without any method."""
    layer_transient: float
    """One layer's forward + backward working set."""
    loss_transient: float
    """The output end's (norm, output layer, loss) working set."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once."""
    stage_layers: int
    host_budget: int
    """Host bytes a process may use."""
    settings: Any = None
    """The method's own settings (MEMO: its ``MemoConfig``); ``None``: its defaults."""
    plain: LayerTime | None = None
    """The plain layer's time."""


@dataclass
class Stage:
    """The busiest pipeline stage's activations and time under one method."""

    stored: float
    """Activations stored when the forward ends."""
    peak_activations: float
    time: LayerTime
    recompute_flops: float
    """Per micro-batch."""
    alpha: float | None = None
    keep: int | None = None
    device_skeletons: int = 0
    """Offloaded layers before the kept ones whose whole storages stay on the device for want of
    host memory (chunked MEMO)."""
    chunk_tokens: int | None = None
    host_bytes: int = 0
    fits_host: bool = True
    notes: list[str] = field(default_factory=list)


class MemoryMethod(abc.ABC):
    """A way to hold a stage's activations, as the estimator prices it."""

    name: ClassVar[str]
    """What ``memo-estimate --method``, the preflight and the estimates call it."""
    replays_caching_allocator: ClassVar[bool] = True
    """Whether its device memory is PyTorch's caching allocator's (``--caching-allocator-replay``
    prices fragmentation); ``False`` for a method that plans its memory."""
    uses_host_memory: ClassVar[bool] = False
    """Whether it keeps activations in host memory (the preflight then reports them)."""
    plain: ClassVar[bool] = False
    """Whether its layer is the plain one (the estimator's baseline, traced once for all)."""
    suggestion: ClassVar[str | None] = None
    """What the preflight tells a run that does not fit to try, when this method with its
    default settings would make it fit (``add --memo``); ``None``: never suggested."""

    @abc.abstractmethod
    def price(self, ctx: StageContext) -> Stage:
        """The stage's activations, time and recompute FLOPs under this method."""

    @abc.abstractmethod
    def selected_by(self, run: RunConfig) -> bool:
        """Whether ``run``'s flags select this method."""

    def settings_of(self, run: RunConfig) -> Any:
        """This method's settings in ``run`` (:attr:`StageContext.settings`)."""
        return None

    def search_settings(self, space: Any) -> list[Any]:
        """The settings a search for the longest length tries (``memo_ext.estimate.search``)."""
        return [None]

    # --- memo-memory-report's rows: one traced layer each, scaled to the stage

    def report_rows(self, *, chunk_tokens: int) -> list[tuple[str, Any]]:
        """(row name, settings of its traced layer) per row of ``memo-memory-report``
        (``chunk_tokens``: the chunk of a chunked row)."""
        return [(self.name, None)]

    def report_stage(
        self,
        fig: LayerFigures,
        plain: LayerFigures,
        settings: Any,
        *,
        stage_layers: int,
        in_flight: int,
        keep_last_layers: int | None,
    ) -> tuple[int, int, int]:
        """(device activation bytes, host bytes, layers recomputed) of the stage whose layers
        are ``fig`` (``plain``: the plain layer's figures), ``in_flight`` micro-batches held."""
        return in_flight * stage_layers * fig.saved_bytes, 0, stage_layers

    def report_note(
        self, *, stage_layers: int, keep_last_layers: int | None, chunk_tokens: int
    ) -> str | None:
        """What the report's header says of this method's rows (``None``: nothing)."""
        return None

    # --- the layer it builds: traced on fake tensors (memo_ext.estimate.measure), replayed
    # through the caching allocator (memo_ext.estimate.fragmentation). ``settings`` are a
    # hashable value (the tracer caches by method and settings).

    def traced_settings(self, text: str | None) -> Any:
        """The settings of a traced layer named ``NAME-TEXT`` in reports (``memo-0.5``), or
        ``NAME`` alone (``text`` ``None``); :meth:`traced_name`'s inverse.

        Raises:
            ValueError: for text this method does not read.
        """
        if text is not None:
            raise ValueError(f"{self.name} takes no settings, got {self.name}-{text}")
        return None

    def traced_name(self, settings: Any) -> str:
        """How reports name this method's layer with ``settings``."""
        return self.name

    def layer_config(self, settings: Any) -> dict[str, Any]:
        """megatron-core ``TransformerConfig`` fields of a layer under this method."""
        return {}

    def layer_spec(self, spec: Any, config: Any, settings: Any) -> Any:
        """The layer's ``ModuleSpec`` under this method (``spec``: the plain layer's)."""
        return spec

    def trace_granule(self, settings: Any) -> int | None:
        """Local tokens the traced lengths must be a multiple of (MEMO's chunk), if any."""
        return None

    def replay_layers(self, settings: Any) -> tuple[dict[str, Any], bool]:
        """(config fields, whether megatron-core's checkpoint wraps each layer) of the stage the
        caching-allocator replay traces."""
        return self.layer_config(settings), False
