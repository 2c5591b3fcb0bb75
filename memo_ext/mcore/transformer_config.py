"""A model shape and a parallel layout as megatron-core's ``TransformerConfig``, and back.

:func:`transformer_config` is the one place a ``TransformerConfig`` is made from our types: the
trainer's (:func:`model_transformer_config`, with the fields the run's features set), the
estimator's and the planner's traces all come from it. :func:`traced_transformer_config` is the
variant for fake-tensor traces (bf16, no dropout, nothing initialised); :func:`model_shape_of`
reads a shape back from a config.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

from memo_ext.config import ModelConfig, TrainConfig
from memo_ext.device import on_gpu
from memo_ext.mcore.rotary import YarnTransformerConfig, yarn_fields
from memo_ext.mcore.specs import LOCAL_KERNEL_SETTINGS
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

TE_RECOMPUTE_ADVICE = r"If you are using transformer_engine as the transformer implementation"
"""The start of megatron-core's warning on a config that recomputes ``core_attn`` (selective
recomputation): advice for transformer-engine's fused attention, which a CPU run never builds."""


def transformer_config(
    shape: ModelShape, *, layout: ParallelLayout | None = None, **fields
) -> TransformerConfig:
    """megatron-core's config of ``shape`` in ``layout``; ``fields`` set any other field (or
    override one, as ``num_layers=1`` for a one-layer trace).

    The local layer spec's kernel settings (``LOCAL_KERNEL_SETTINGS``) apply unless overridden.
    With ``yarn_*`` fields the config is a :class:`~memo_ext.mcore.rotary.YarnTransformerConfig`.
    """
    layout = layout or ParallelLayout()
    sizes = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization=shape.normalization,
        gated_linear_unit=shape.swiglu,
        activation_func=_activation(shape),
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.qkv_bias,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
    )
    yarn = any(name.startswith("yarn_") for name in fields)
    config_class = YarnTransformerConfig if yarn else TransformerConfig
    with warnings.catch_warnings():
        if not on_gpu():
            warnings.filterwarnings("ignore", message=TE_RECOMPUTE_ADVICE)
        return config_class(**{**sizes, **LOCAL_KERNEL_SETTINGS, **fields})


def _activation(shape: ModelShape):
    if shape.swiglu:
        return F.silu
    return openai_gelu if shape.openai_gelu else F.gelu


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


def model_transformer_config(
    shape: ModelShape,
    model: ModelConfig,
    train: TrainConfig,
    *,
    layout: ParallelLayout,
    fused_cross_entropy: bool,
    **fields,
) -> TransformerConfig:
    """A fresh megatron-core config of a run's model (``shape`` and the ``model`` section) at the
    ``train`` section's precision, in ``layout``; ``fields`` are what the run's features set
    (recomputation, megatron-core's offloading: ``memo_ext.features.megatron``)."""
    return transformer_config(
        shape,
        layout=layout,
        layernorm_epsilon=model.norm_epsilon,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std,
        bf16=train.bf16,
        fp16=train.fp16,
        params_dtype=train.params_dtype,
        pipeline_dtype=train.params_dtype,
        # the loss is a mean over every real token of the global batch, however it is split
        calculate_per_token_loss=True,
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        cross_entropy_loss_fusion=fused_cross_entropy,
        # memo_ext.mcore.init redraws every weight after the model is built, independently
        # of the parallel layout. megatron's own draw still runs: with it off, its layers
        # also skip tagging weights as tensor-parallel, which gradient norms and checkpoints
        # need.
        use_cpu_initialization=not on_gpu(),
        perform_initialization=True,
        **(yarn_fields(model) if shape.position_embedding_type == "yarn" else {}),
        **fields,
    )


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
        openai_gelu=config.activation_func is openai_gelu,
        add_bias_linear=bool(config.add_bias_linear),
        # what the weights are: a QKV bias the linear layers' biases imply is not a flag of its own
        add_qkv_bias=bool(config.add_qkv_bias and not config.add_bias_linear),
        position_embedding_type=position_embedding_type,
        vocab_size=vocab_size,
    )
