"""A memory policy and an offload rule from outside ``memo_ext``, for ``--plugin``: importing this
module registers them, and nothing in the package names them. ``tests/dist/test_plugins.py``
copies it into a temporary folder under another name and runs every tool with it.

- ``toy-whole``, an offload rule: every tensor an offloaded MEMO layer saves goes to host
  memory whole (``--memo --memo-offload-rule toy-whole``; ``memo:rule=toy-whole`` compared).
- ``toy-mlp-recompute``, a memory policy with a flag of its own (``--toy-mlp-recompute``): each
  layer's MLP block keeps only its input and runs again in the backward (megatron-core's
  ``tensor_parallel.checkpoint`` around it). The trainer builds its layers, the
  estimator traces and prices the same layer, ``memo-memory-report`` shows its row and
  ``memo-compare`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memo_ext.errors import UsageError
from memo_ext.extension import Built, Extension, MetricKey, MetricSource
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.feature import Feature
from memo_ext.features.recompute.method import Recompute
from memo_ext.features.registry import register_feature
from memo_ext.memo.rules import OffloadRule, Placement, SavedTensor, register


@register
class Whole(OffloadRule):
    """Every saved tensor to host memory whole: nothing recomputed, everything copied."""

    name = "toy-whole"

    def place(self, saved: SavedTensor) -> Placement:
        return Placement.WHOLE


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """The toy memory policy's section of the run."""

    FLAG_PREFIX: ClassVar[str] = "toy"

    mlp_recompute: bool = False
    """Recompute each layer's MLP in the backward, keeping only its input."""

    def check_with(self, run) -> None:
        if self.mlp_recompute and run.memo.enabled:
            raise UsageError("--toy-mlp-recompute and --memo both rebuild the layers; drop one")


def recomputed_mlp(spec):
    """``spec`` (a transformer layer's) with its MLP block (norm, MLP, residual add) run under
    megatron-core's checkpoint: the layer's class is subclassed, its MLP left as it is (the
    layer gives an ``MLP`` of exactly that class its process group)."""
    from megatron.core import tensor_parallel

    base = spec.module

    class MlpRecomputedLayer(base):
        def _forward_mlp(self, hidden_states, *args, **kwargs):
            run = lambda h: base._forward_mlp(self, h, *args, **kwargs)  # noqa: E731
            return tensor_parallel.checkpoint(run, False, hidden_states)

    spec.module = MlpRecomputedLayer
    return spec


class MlpRecompute(Recompute):
    """The policy as the estimator prices it: Megatron's stage rule on its own traced layer."""

    name = "toy-mlp-recompute"
    replays_caching_allocator = False  # the replay builds megatron-core's own layers

    def selected_by(self, run) -> bool:
        return run.section("toy").mlp_recompute

    def layer_config(self, settings: None) -> dict:
        return {}

    def layer_spec(self, spec, config, settings: None):
        return recomputed_mlp(spec)


class MlpRecomputeHooks(Extension):
    """The policy in the trainer: its layers, and how many the model holds in each record."""

    metric_keys = (
        MetricKey(
            ("toy_mlp_recomputed_layers",),
            "int",
            "Layers whose MLP block runs again in the backward (the toy plugin's policy).",
        ),
    )

    @classmethod
    def enabled(cls, run) -> bool:
        return run.section("toy").mlp_recompute

    def layer_spec(self, run, spec, config):
        return recomputed_mlp(spec)

    def attach(self, built: Built) -> None:
        modules = built.model.modules()
        self.layers = sum(type(m).__name__ == "MlpRecomputedLayer" for m in modules)

    def metric_sources(self) -> list[MetricSource]:
        collect = lambda: {"toy_mlp_recomputed_layers": self.layers}  # noqa: E731
        return [MetricSource(collect, lambda r: f"{r['toy_mlp_recomputed_layers']} MLPs again")]


MLP_RECOMPUTE = MlpRecompute()
FEATURE = register_feature(
    Feature(
        name="toy",
        config=ToyConfig,
        title="toy memory policy (a plugin)",
        extension=MlpRecomputeHooks,
        methods=(MLP_RECOMPUTE,),
        compared=(
            ComparedMethod(MLP_RECOMPUTE.name, ("--toy-mlp-recompute",), estimator=MLP_RECOMPUTE),
        ),
    )
)
