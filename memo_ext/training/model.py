"""Build the GPT model of this pipeline stage and wrap it for data parallelism.

The layer spec comes from ``memo_ext.mcore.specs``; the run's extensions
(``Extension.layer_spec``: MEMO's token-wise offload) change it there, and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from memo_ext.config import RunConfig
from memo_ext.config.network import resolve_attention_backend
from memo_ext.extension import Extension
from memo_ext.features.extensions import own_layouts
from memo_ext.mcore.gpt import ChunkedLossGPTModel
from memo_ext.mcore.init import init_weights_layout_independent
from memo_ext.mcore.rotary import rotary_arguments
from memo_ext.mcore.specs import build_block_spec, build_layer_spec

logger = logging.getLogger(__name__)


def build_gpt_model(
    *,
    run: RunConfig,
    config,
    device: torch.device,
    pg_collection=None,
    extensions: Sequence[Extension] = (),
) -> ChunkedLossGPTModel:
    """The bare ``GPTModel`` of this process's pipeline stage, on ``device``.

    ``config`` is the model's own ``TransformerConfig`` (``run_transformer_config(run, layout)``);
    with ``pg_collection`` the model runs in another layout than megatron's global one (HotSPa's
    bucket layouts), by default in megatron's global groups. Each of ``extensions`` applies
    its layer spec, in order.
    """
    if pg_collection is None:
        first, last = (
            parallel_state.is_pipeline_first_stage(),
            parallel_state.is_pipeline_last_stage(),
        )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    else:
        pp = pg_collection.pp
        first, last = pp.rank() == 0, pp.rank() == pp.size() - 1
        tp_rank = pg_collection.tp.rank()
    model_cfg = run.model
    rebuilt = any(extension.rebuilds_layers for extension in extensions)
    backend = resolve_attention_backend(model_cfg.attention_backend, allow_te=not rebuilt)
    layer_spec = build_layer_spec(config=config, attention_backend=backend)
    for extension in extensions:
        layer_spec = extension.layer_spec(run, layer_spec, config)
    block_spec = build_block_spec(config=config, layer_spec=layer_spec)
    model = ChunkedLossGPTModel(
        loss_chunks=model_cfg.loss_chunks,
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=model_cfg.padded_vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        position_embedding_type=run.shape.position_embedding_type,
        **rotary_arguments(model_cfg),
        pg_collection=pg_collection,
    )
    model = model.to(device)
    init_weights_layout_independent(
        model,
        config=config,
        seed=run.train.seed,
        tp=config.tensor_model_parallel_size,
        tp_rank=tp_rank,
    )
    return model


def wrap_for_data_parallel(
    *,
    model: torch.nn.Module,
    run: RunConfig,
    config,
    pg_collection=None,
    distributed_optimizer: bool | None = None,
) -> DistributedDataParallel:
    """megatron-core DDP: contiguous fp32 gradient buffers reduced over DP × CP.

    ``config`` is the model's ``TransformerConfig``. With the distributed optimizer the
    reduction is a reduce-scatter (each rank keeps its shard); ``distributed_optimizer=False``
    forces a full all-reduce (HotSPa's bucket layouts, whose gradients every holder must have
    whole).
    """
    if distributed_optimizer is None:
        distributed_optimizer = run.train.use_distributed_optimizer
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    overlap = data_parallel_overlap(run)
    gather = overlap and distributed_optimizer and run.distributed.overlap_param_gather
    ddp_config = DistributedDataParallelConfig(
        # Megatron-LM: fp32 gradient buffers unless --grad-reduce-in-bf16 (with fp32 weights
        # the buffers are fp32 either way)
        grad_reduce_in_fp32=not run.distributed.grad_reduce_in_bf16,
        overlap_grad_reduce=overlap,
        overlap_param_gather=gather,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=run.distributed.ddp_bucket_size,
    )
    return DistributedDataParallel(config, ddp_config, model, pg_collection=pg_collection)


def data_parallel_overlap(run: RunConfig) -> bool:
    """--overlap-grad-reduce, except under a feature that builds models in layouts of its own
    (HotSPa reduces each layout's gradients itself once all its buckets have run)."""
    return run.distributed.overlap_grad_reduce and own_layouts(run) is None


@contextmanager
def params_in_sync(model: torch.nn.Module) -> Iterator[None]:
    """Every rank's weights whole while the block runs.

    With --overlap-param-gather the distributed optimizer's updated shards reach the other DP
    ranks only in the next forward pass (its pre-hooks gather them); a checkpoint or a weight
    norm taken in between would read stale shards. As Megatron-LM before a save: gather them now
    with the hooks off, and turn the hooks back on after.
    """
    if not getattr(model, "use_forward_hook", False):
        yield
        return
    model.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        model.enable_forward_pre_hook()


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters held by this process (its TP / PP shard)."""
    return sum(p.numel() for p in model.parameters())
