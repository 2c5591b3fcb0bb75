"""Small models the CPU tests build: shapes, their megatron-core configs, a GPT of them."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.mcore.gpt import ChunkedLossGPTModel
from memo_ext.mcore.init import init_weights_layout_independent
from memo_ext.mcore.specs import build_block_spec, build_layer_spec
from memo_ext.mcore.transformer_config import transformer_config
from memo_ext.shapes import ModelShape

GPT_SMALL = ModelShape(
    name="small",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    vocab_size=512,
    position_embedding_type="rope",
)
"""The estimator tests' GPT: LayerNorm, GeLU, biases, RoPE; sizes that trace in milliseconds."""

LLAMA_TINY = ModelShape(
    num_layers=2,
    hidden_size=48,
    num_attention_heads=6,
    num_query_groups=2,
    ffn_hidden_size=40,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
)
"""GQA (6 heads, 2 groups), SwiGLU, RMSNorm, no biases: the LLaMA-style layer."""


def cpu_config(shape: ModelShape, **fields) -> TransformerConfig:
    """megatron-core's config of ``shape`` for a test: fp32, no dropout, weights on the CPU;
    ``fields`` change any of it."""
    base = dict(hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    return transformer_config(shape, **{**base, **fields})


def build_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_positions: int,
    position_embedding_type: str = "rope",
    seed: int = 3,
    **rotary,
) -> ChunkedLossGPTModel:
    """One-process GPT of ``config`` (SDPA attention), weights drawn as the trainer draws them;
    ``rotary``: ``GPTModel``'s RoPE arguments (``memo_ext.mcore.rotary.rotary_arguments``)."""
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    model = ChunkedLossGPTModel(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=max_positions,
        transformer_layer_spec=build_block_spec(config=config, layer_spec=spec),
        position_embedding_type=position_embedding_type,
        **rotary,
    )
    init_weights_layout_independent(model, config=config, seed=seed, tp=1, tp_rank=0)
    return model


def ddp_wrapped(module: torch.nn.Module, config: TransformerConfig | None = None):
    """``module`` in megatron-core DDP (one bucket, fp32 gradient buffers), as the trainer hands
    its model to megatron's optimizer; ``config``: the model's, else a one-layer placeholder."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = config or getattr(module, "config", None) or cpu_config(GPT_SMALL)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    return DistributedDataParallel(config, ddp_config, module)
