"""A run's megatron-core ``TransformerConfig``: its model's, from ``memo_ext.mcore``, with the
fields the features megatron-core runs itself set (its recomputation, its offloading)."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.config import RecomputeConfig, RunConfig
from memo_ext.device import on_gpu
from memo_ext.mcore.transformer_config import model_transformer_config
from memo_ext.parallel import ParallelLayout


def run_transformer_config(
    run: RunConfig,
    layout: ParallelLayout | None = None,
    *,
    recompute: str | None = None,
    global_groups: bool = True,
) -> TransformerConfig:
    """A fresh megatron-core config of ``run``'s model in ``layout`` (default: the run's), with
    ``recompute`` (``none``, ``selective``, ``full``: every layer) in place of the run's
    recomputation when given (HotSPa's per-layout choice). ``global_groups=False``: the run
    builds models in layouts of its own (``Extension.own_layouts``), so megatron-core's fused
    loss, which reads the global groups, is left off."""
    recomputation = run.recompute if recompute is None else RecomputeConfig.of_layout(recompute)
    return model_transformer_config(
        run.shape,
        run.model,
        run.train,
        layout=layout or run.layout,
        fused_cross_entropy=run.model.cross_entropy_loss_fusion and on_gpu() and global_groups,
        **recomputation.megatron_fields(),
        **run.offload.megatron_fields(),
    )
