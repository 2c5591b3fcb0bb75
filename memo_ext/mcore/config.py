"""A model shape and a parallel layout as megatron-core's ``TransformerConfig``, and back.

:func:`transformer_config` is the one place a ``TransformerConfig`` is made from our types: the
trainer's (through ``RunConfig.transformer``), the estimator's and the planner's traces all come
from it. :func:`traced_transformer_config` is the variant for fake-tensor traces (bf16, no
dropout, nothing initialised); :func:`model_shape_of` reads a shape back from a config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.mcore.specs import LOCAL_KERNEL_SETTINGS
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape


def transformer_config(
    shape: ModelShape, *, layout: ParallelLayout | None = None, **fields
) -> TransformerConfig:
    """megatron-core's config of ``shape`` in ``layout``; ``fields`` set any other field (or
    override one, as ``num_layers=1`` for a one-layer trace).

    The local layer spec's kernel settings (``LOCAL_KERNEL_SETTINGS``) apply unless overridden.
    """
    layout = layout or ParallelLayout()
    sizes = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization=shape.normalization,
        gated_linear_unit=shape.swiglu,
        activation_func=F.silu if shape.swiglu else F.gelu,
        add_bias_linear=shape.add_bias_linear,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
    )
    return TransformerConfig(**{**sizes, **LOCAL_KERNEL_SETTINGS, **fields})


def traced_transformer_config(
    shape: ModelShape, *, layout: ParallelLayout | None = None, fp32: bool = False, **fields
) -> TransformerConfig:
    """The config fake-tensor traces use: bf16 (``fp32`` for float32), no dropout, weights on
    the CPU and not initialised (fake weights have no values to draw)."""
    dtype = torch.float32 if fp32 else torch.bfloat16
    base = dict(
        bf16=not fp32,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    return transformer_config(shape, layout=layout, **{**base, **fields})


def model_shape_of(
    config: TransformerConfig,
    *,
    vocab_size: int = 0,
    position_embedding_type: str = "learned_absolute",
    name: str = "custom",
) -> ModelShape:
    """The shape of a model megatron-core builds from ``config`` (which carries neither the
    vocabulary nor the position embedding)."""
    return ModelShape(
        name=name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        normalization=config.normalization,
        swiglu=bool(config.gated_linear_unit),
        add_bias_linear=bool(config.add_bias_linear),
        position_embedding_type=position_embedding_type,
        vocab_size=vocab_size,
    )
