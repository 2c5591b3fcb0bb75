"""Megatron's recomputation, and none, as the methods the estimator prices, the search tries
and the comparisons run."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from memo_ext.estimate.cost_model import backward_flops, layer_figures, layer_time
from memo_ext.estimate.stage import LayerTime, MemoryMethod, Stage, StageContext
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.recompute.config import RecomputeConfig

if TYPE_CHECKING:
    from memo_ext.config import RunConfig


class Recompute(MemoryMethod):
    """Every layer's activations on the device; the backward re-runs what the granularity
    dropped. ``name`` is also the traced method (``memo_ext.estimate.fits``) and the value of
    ``--recompute-granularity`` (none: not given)."""

    forward_passes: ClassVar[int] = 1
    """Forward passes per layer and micro-batch (full recomputation runs the forward again)."""
    holds_again: ClassVar[bool] = False
    """Whether the layer being recomputed holds its whole saved set again at the peak."""

    def price(self, ctx: StageContext) -> Stage:
        traced = None if self.plain else self
        fig = layer_figures(ctx.model, ctx.layout, ctx.batch, tokens=ctx.tokens, method=traced)
        stored = ctx.in_flight * ctx.stage_layers * fig.saved_bytes
        again = ctx.none.saved_bytes if self.holds_again else 0
        time = LayerTime()
        time.add(layer_time(fig, ctx, forward_passes=self.forward_passes), ctx.stage_layers)
        return Stage(
            stored=stored,
            peak_activations=max(stored + ctx.loss_transient, stored + again + ctx.layer_transient),
            time=time,
            recompute_flops=ctx.stage_layers * (backward_flops(fig) - backward_flops(ctx.none)),
        )

    def selected_by(self, run: RunConfig) -> bool:
        return run.recompute.granularity == self.name

    def layer_config(self, settings: None) -> dict:
        """Megatron's recomputation of every layer at this granularity."""
        return RecomputeConfig.of_layout(self.name).megatron_fields()


class NoRecompute(Recompute):
    """No recomputation: every layer keeps its saved set until its backward. A run selects it
    when it selects no other method (``memo_ext.features.memory_method_of``)."""

    name = "none"
    plain = True

    def selected_by(self, run: RunConfig) -> bool:
        return False

    def layer_config(self, settings: None) -> dict:
        return {}


class FullRecompute(Recompute):
    """Megatron's full recomputation (uniform, one layer per group): each layer keeps its input
    and runs its forward again in the backward, communication included."""

    name = "full"
    forward_passes = 2
    holds_again = True

    def replay_layers(self, settings: None) -> tuple[dict, bool]:
        """Replayed as megatron-core's checkpoint of each layer, its config left plain."""
        return {}, True


class SelectiveRecompute(Recompute):
    """Megatron's selective recomputation: the core attention's inner products recomputed."""

    name = "selective"


NO_RECOMPUTE, FULL, SELECTIVE = NoRecompute(), FullRecompute(), SelectiveRecompute()

METHODS: tuple[Recompute, ...] = (NO_RECOMPUTE, FULL, SELECTIVE)
"""The granularities, as the estimator prices them."""

COMPARED: tuple[ComparedMethod, ...] = (
    ComparedMethod(NO_RECOMPUTE.name, estimator=NO_RECOMPUTE),
    ComparedMethod(
        SELECTIVE.name, ("--recompute-granularity", SELECTIVE.name), estimator=SELECTIVE
    ),
    ComparedMethod(
        FULL.name,
        ("--recompute-granularity", FULL.name, "--recompute-method", "uniform")
        + ("--recompute-num-layers", "1"),
        estimator=FULL,
    ),
)
"""No recomputation, Megatron's selective and full recomputation, as comparisons run them."""


def recompute_method(granularity: str | None) -> Recompute:
    """The method of a ``--recompute-granularity`` value (``None``: no recomputation)."""
    name = granularity or NoRecompute.name
    for method in METHODS:
        if method.name == name:
            return method
    raise ValueError(f"no recomputation method is called {granularity!r}")
