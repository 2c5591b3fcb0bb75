"""How a memory or parallelism feature plugs into the trainer: one :class:`Extension` per
feature, registered once in ``memo_ext.features.extensions``.

The trainer (``memo_ext.training.loop``) names no feature. It asks the registry for the
extensions a run enables and calls their hooks at fixed points of a run:

1. :meth:`~Extension.setup`, before the run's first tensor (a process-wide allocator);
2. :meth:`~Extension.resolve` (before any process group): settle the feature's open choices in
   the run config (``auto`` values) for the device the run plans for, and
   :meth:`~Extension.preflight_skip_reason`;
3. :meth:`~Extension.layer_spec`, while the model is built (a layer that runs the feature);
4. :meth:`~Extension.attach`, once the model and optimizer exist (state of its own, hooks);
5. per step :meth:`~Extension.begin_step`, optionally :meth:`~Extension.forward_backward` (an
   extension that runs the step's passes itself), :meth:`~Extension.end_backward`, the
   figures of :meth:`~Extension.metric_sources`, and :meth:`~Extension.excluded_time_s` (one-off
   work of the feature that the step's measured time leaves out);
6. :meth:`~Extension.close` when the run ends, failed or not.

Every hook does nothing by default, so an extension overrides only what it needs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from memo_ext.config import RunConfig
    from memo_ext.hardware import DeviceSpec


@dataclass(frozen=True)
class MetricKey:
    """Keys of the metrics file (one row of docs/metrics.md's table): their type and meaning.
    Every key a logged record holds is one of these, written where the feature or the part of
    the trainer that collects it is (``memo_ext.training.metric_keys`` gathers them)."""

    names: tuple[str, ...]
    type: str
    """``int``, ``float``, ``str``, ``list[int]``, ``dict[str, float]`` or ``object`` (any JSON
    object), optionally ``| null``."""
    meaning: str

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (as read back from JSON) has this key's type."""
        kinds = self.type.split(" | ")
        if value is None:
            return "null" in kinds
        if isinstance(value, bool):
            return False
        if isinstance(value, list):
            return "list[int]" in kinds and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )
        if isinstance(value, dict):
            return (
                "object" in kinds
                or "dict[str, float]" in kinds
                and all(
                    isinstance(k, str) and isinstance(v, (int, float)) for k, v in value.items()
                )
            )
        if isinstance(value, int):
            return "int" in kinds or "float" in kinds
        if isinstance(value, float):
            return "float" in kinds
        return isinstance(value, str) and "str" in kinds


@dataclass(frozen=True)
class MetricSource:
    """A feature's per-step figures: ``collect`` is called once per step (its counters cover that
    step) and its dict joins the logged record; ``describe`` renders it for the console."""

    collect: Callable[[], dict]
    describe: Callable[[dict], str]


@dataclass(frozen=True)
class PlanningTarget:
    """The device a run's ``auto`` choices and its preflight plan for, decided once.

    ``device`` is the given ``--preflight-device``, else the CUDA device's preset, else ``None``
    (nothing known to check against); ``planned`` is that device, or the fallback preset where
    none is known, with ``--calibration`` and ``--memory-limit-gb`` applied, and ``efficiency``
    the estimator's efficiencies under the same calibration.
    """

    device: DeviceSpec | None
    planned: DeviceSpec
    efficiency: Any
    """``memo_ext.estimate.model.Efficiency``."""


@dataclass(frozen=True)
class ResolveContext:
    """What :meth:`Extension.resolve` may read besides the run."""

    tokenizer: Any
    target: PlanningTarget
    documents: Callable[[], Any]
    """The run's whole documents (``memo_ext.data.documents.DocumentSource``), opened on call."""


@dataclass(frozen=True)
class Built:
    """What the trainer has built when extensions attach (:meth:`Extension.attach`)."""

    run: RunConfig
    ctx: Any
    """``memo_ext.training.initialize.ParallelContext``."""
    model: torch.nn.Module
    """The home model, wrapped for data parallelism."""
    optimizer: Any
    config: Any
    """The home model's own megatron-core ``TransformerConfig``."""
    build_model: Callable[..., torch.nn.Module]
    """``build_model(config=..., pg_collection=...)``: another model of the run, wrapped for data
    parallelism without the distributed optimizer, with every extension's layer spec."""


@dataclass(frozen=True)
class StepLoss:
    """One global batch's outcome on this process."""

    pair: torch.Tensor
    """(loss sum, tokens with a label) of the global batch, the same on every rank."""
    document_lengths: list[int]
    """Packed documents: the lengths this process's FLOPs are counted from (empty otherwise)."""
    flops_shared_by: int
    """Processes that share those documents' FLOPs."""


class Extension(abc.ABC):
    """A feature of the trainer. Subclass it, override the hooks the feature needs, and add the
    class to ``memo_ext.features.extensions.FEATURES`` (or call its ``register``).

    An extension is made from the run as parsed (``self.run``), before the run is resolved; the
    resolved run reaches the hooks that need it as an argument (:meth:`layer_spec`,
    :meth:`batches`, :meth:`attach`).
    """

    name: ClassVar[str] = "extension"
    flag: ClassVar[str] = ""
    """The flag that turns it on (``--hotspa``), as the trainer's notices name it."""
    own_layouts: ClassVar[bool] = False
    """Builds models in process layouts of its own, with explicit process groups (HotSPa's
    buckets): megatron-core's overlapped gradient reduce and parameter gather, and its fused
    loss, which read the global groups, are left off (the trainer says so once)."""
    replaces_allocator: bool = False
    """Serves the process's device memory itself (:meth:`setup`): torch's memory cap cannot
    apply."""
    rebuilds_layers: bool = False
    """Its layer spec rebuilds layers from their modules (transformer-engine's fused layer
    cannot be used)."""
    finalizes_gradients: bool = False
    """Reduces gradients itself: megatron-core's schedules must not finalize them."""
    metric_keys: ClassVar[tuple[MetricKey, ...]] = ()
    """The keys its :meth:`metric_sources` add to a logged record, documented (docs/metrics.md's
    metrics table is made from them)."""

    @classmethod
    @abc.abstractmethod
    def enabled(cls, run: RunConfig) -> bool:
        """Whether ``run`` turns the feature on (every feature says)."""

    def __init__(self, run: RunConfig):
        self.run = run

    def setup(self) -> None:
        """Before the run's first tensor (and before it is resolved)."""
        return None  # an optional hook: nothing by default

    def resolve(self, run: RunConfig, context: ResolveContext) -> RunConfig:
        """``run`` with this feature's open choices settled (every rank gets the same)."""
        return run

    def preflight_skip_reason(self, run: RunConfig) -> str | None:
        """Why the memory preflight cannot judge ``run``, or ``None`` when it can."""
        return None

    def model_tp_sizes(self, run: RunConfig) -> tuple[int, ...]:
        """TP sizes of the models it builds beside the home one (the vocabulary is padded so
        that every one divides it); ``run`` is resolved."""
        return ()

    def layer_spec(self, run: RunConfig, spec: Any, config: Any) -> Any:
        """The transformer layer spec with the feature applied (``config``: the model's
        ``TransformerConfig``)."""
        return spec

    def attach(self, built: Built) -> None:
        """The model and optimizer exist; keep what the feature needs of them."""
        return None  # an optional hook: nothing by default

    def batches(
        self, run: RunConfig, documents: Any, *, rank: int, consumed_documents: int
    ) -> Iterator | None:
        """Per step, the packed batches of this process (``--variable-seq-lengths``), when the
        feature groups documents its own way; ``None`` for the trainer's packing."""
        return None

    def metric_sources(self) -> list[MetricSource]:
        """Per-step figures for the log and the metrics file."""
        return []

    def begin_step(self, iteration: int) -> None:
        """Before the step's forward passes."""
        return None  # an optional hook: nothing by default

    def forward_backward(self, batches: Iterator, forward_step: Callable) -> StepLoss | None:
        """Run a training step's passes in place of megatron-core's schedule, or ``None`` to
        leave them to it."""
        return None

    def end_backward(self) -> None:
        """After the step's last backward, before the optimizer."""
        return None  # an optional hook: nothing by default

    def end_evaluation(self) -> None:
        """After an evaluation (validation loss, retrieval), before training goes on."""
        return None  # an optional hook: nothing by default

    def excluded_time_s(self) -> float:
        """Seconds of the step just run that the feature spent on one-off work of its own
        (planning, say), to be left out of the step's measured time, throughput and MFU; the
        feature reports them among its own figures."""
        return 0.0

    def memory(self) -> tuple[int, int] | None:
        """(allocated, reserved) device bytes of the step when the feature serves them."""
        return None

    def close(self) -> None:
        """The run ends (also on failure)."""
        return None  # an optional hook: nothing by default
