"""GPT model presets of the MEMO paper, as megatron ``TransformerConfig`` objects for tracing."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPTPreset:
    """Sizes of one GPT model (GeLU MLP, LayerNorm, biases)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Attention heads."""
    ffn_hidden_size: int
    """MLP width (4h)."""
    vocab_size: int = 50257
    """GPT-2 vocabulary."""


MODEL_PRESETS = {
    "gpt-7b": GPTPreset(32, 4096, 32, 16384),
    "gpt-13b": GPTPreset(40, 5120, 40, 20480),
    "gpt-30b": GPTPreset(48, 7168, 56, 28672),
    "gpt-65b": GPTPreset(80, 8192, 64, 32768),
}


def gpt_config(
    preset: GPTPreset | str,
    *,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    context_parallel_size: int = 1,
    **overrides,
):
    """Megatron ``TransformerConfig`` of a preset (bf16, no dropout) for the given layout.

    Args:
        preset: a ``GPTPreset`` or a key of ``MODEL_PRESETS``.
        tensor_model_parallel_size: TP degree.
        sequence_parallel: shard the sequence across TP ranks outside the TP regions.
        context_parallel_size: CP degree.
        overrides: any further ``TransformerConfig`` field (e.g. ``hidden_size``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if isinstance(preset, str):
        preset = MODEL_PRESETS[preset]
    fields = {
        "num_layers": preset.num_layers,
        "hidden_size": preset.hidden_size,
        "num_attention_heads": preset.num_attention_heads,
        "ffn_hidden_size": preset.ffn_hidden_size,
        "normalization": "LayerNorm",
        "add_bias_linear": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "use_cpu_initialization": True,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "sequence_parallel": sequence_parallel and tensor_model_parallel_size > 1,
        "context_parallel_size": context_parallel_size,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)
