"""A run's megatron-core ``TransformerConfig``: its model's, from ``memo_ext.mcore``, with the
fields the features megatron-core runs itself set (its recomputation, its offloading)."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.config import RecomputeConfig, RunConfig
from memo_ext.mcore.transformer_config import model_transformer_config
from memo_ext.parallel import ParallelLayout


def run_transformer_config(
    run: RunConfig, layout: ParallelLayout | None = None, *, recompute: str | None = None
) -> TransformerConfig:
    """A fresh megatron-core config of ``run``'s model in ``layout`` (default: the run's), with
    ``recompute`` (``none``, ``selective``, ``full``: every layer) in place of the run's
    recomputation when given (HotSPa's per-layout choice)."""
    recomputation = run.recompute if recompute is None else RecomputeConfig.of_layout(recompute)
    return model_transformer_config(
        run.shape,
        run.model,
        run.train,
        layout=layout or run.layout,
        fused_cross_entropy=run.fused_cross_entropy,
        **recomputation.megatron_fields(),
        **run.offload.megatron_fields(),
    )
