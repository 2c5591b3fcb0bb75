"""Model and device presets of the estimator, every figure overridable from the command line.

GPT models are the MEMO paper's (GeLU, 4h MLP, LayerNorm, biases, vocabulary 50257) and come from
the planner's table (``memo_ext.planner.models.MODEL_PRESETS``); the Llama shapes (RMSNorm,
SwiGLU, no biases, GQA for 70B) are kept here because the planner has none. All presets use RoPE:
a learned position table at 1M tokens would alone hold 4B parameters for a 7B model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memo_ext.planner.models import MODEL_PRESETS as GPT_PRESETS
from memo_ext.training.metrics import DEVICE_PEAK_TFLOPS

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """One decoder-only transformer, in megatron-core's terms."""

    name: str
    """Preset name (or ``custom``)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int
    """MLP width (per branch for SwiGLU)."""
    vocab_size: int
    """Tokenizer vocabulary before padding."""
    num_query_groups: int | None = None
    """Key / value heads (GQA); ``None`` = one per query head."""
    swiglu: bool = False
    """Gated SiLU MLP (three matrices) instead of GeLU (two)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``."""
    add_bias_linear: bool = True
    """Biases in the linear layers."""
    position_embedding_type: str = "rope"
    """``rope`` or ``learned_absolute`` (a ``[seq_length, h]`` table, not TP-sharded)."""


def _gpt(name: str) -> ModelShape:
    p = GPT_PRESETS[name]
    return ModelShape(
        name=name,
        num_layers=p.num_layers,
        hidden_size=p.hidden_size,
        num_attention_heads=p.num_attention_heads,
        ffn_hidden_size=p.ffn_hidden_size,
        vocab_size=p.vocab_size,
    )


def _llama(name, layers, hidden, heads, ffn, groups=None) -> ModelShape:
    # Llama 1 / 2 shapes (Touvron et al. 2023, table 1 / 2 of the Llama 2 paper): 32k vocabulary
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=32000,
        num_query_groups=groups,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
    )


MODELS: dict[str, ModelShape] = {
    **{name: _gpt(name) for name in GPT_PRESETS},
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, groups=8),
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the links around it (bandwidths achieved, not nominal)."""

    name: str
    """Preset name (or ``custom``)."""
    peak_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    memory_bytes: int
    """Device memory capacity."""
    host_link_gbps: float
    """Achieved device ↔ host copy bandwidth per GPU and direction, GB/s (1e9 bytes)."""
    nvlink_gbps: float
    """Achieved collective bus bandwidth inside a node, GB/s (NCCL ``busbw``)."""
    internode_gbps: float
    """Achieved network bandwidth per GPU between nodes, GB/s."""
    gpus_per_node: int = 8
    """GPUs sharing one node (one NVLink domain and one host memory)."""


# Sources and assumptions, per figure:
# - peak: NVIDIA data sheets, dense bf16 (A100 / A800 312, H100 / H200 SXM 989 TFLOP/s), the table
#   the training metrics use (memo_ext.training.metrics.DEVICE_PEAK_TFLOPS).
# - memory: data sheets; "80 GB" parts have 80 GiB of HBM (81,920 MiB reported by nvidia-smi for
#   A100 / A800; H100 reports 81,559 MiB); H200 reports 143,771 MiB.
# - host link: PCIe Gen4 x16 is 32 GB/s per direction nominal, about 25 GB/s achieved with pinned
#   memory (A100 / A800); Gen5 x16 is 64 GB/s nominal, about 50 GB/s achieved (H100 / H200).
#   Assumption: one x16 link per GPU, not shared (on boards where two GPUs share a PCIe switch
#   uplink, halve it with --host-link-gbps).
# - NVLink: per-direction NVLink bandwidth (A100 300, A800 200, H100 / H200 450 GB/s) times about
#   0.8, what NCCL's all-gather / reduce-scatter bus bandwidth reaches on 8 GPUs.
# - network: assumption of one 200 Gb/s NIC per GPU (HDR InfiniBand, ~22 GB/s achieved) for
#   A100 / A800 and one 400 Gb/s NIC per GPU (NDR, ~45 GB/s achieved) for H100 / H200.
DEVICES: dict[str, DeviceSpec] = {
    "a100-80g": DeviceSpec("a100-80g", DEVICE_PEAK_TFLOPS["A100"], 80 * GIB, 25.0, 240.0, 22.0),
    "a800-80g": DeviceSpec("a800-80g", DEVICE_PEAK_TFLOPS["A800"], 80 * GIB, 25.0, 160.0, 22.0),
    "h100-80g": DeviceSpec(
        "h100-80g", DEVICE_PEAK_TFLOPS["H100"], 81559 * 2**20, 50.0, 360.0, 45.0
    ),
    "h200-141g": DeviceSpec(
        "h200-141g", DEVICE_PEAK_TFLOPS["H200"], 143771 * 2**20, 50.0, 360.0, 45.0
    ),
}


def model_shape(name: str, **overrides) -> ModelShape:
    """A preset with fields replaced by the non-``None`` ``overrides``.

    Raises:
        ValueError: for an unknown preset name.
    """
    if name not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(MODELS[name], **changes)


def device_spec(name: str, **overrides) -> DeviceSpec:
    """A device preset with fields replaced by the non-``None`` ``overrides``.

    Raises:
        ValueError: for an unknown device name.
    """
    if name not in DEVICES:
        raise ValueError(f"--gpu must be one of {', '.join(DEVICES)}, got {name!r}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(DEVICES[name], **changes)


def transformer_config(model: ModelShape, *, tp: int = 1, sp: bool = False, **overrides):
    """megatron-core ``TransformerConfig`` (bf16, no dropout) of ``model`` at TP ``tp``."""
    import torch.nn.functional as F

    from memo_ext.mcore.specs import LOCAL_KERNEL_SETTINGS
    from memo_ext.planner.models import GPTPreset, gpt_config

    preset = GPTPreset(
        model.num_layers,
        model.hidden_size,
        model.num_attention_heads,
        model.ffn_hidden_size,
        model.vocab_size,
    )
    fields = dict(
        normalization=model.normalization,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        num_query_groups=model.num_query_groups,
        perform_initialization=False,
        **LOCAL_KERNEL_SETTINGS,
    )
    fields.update(overrides)
    return gpt_config(preset, tensor_model_parallel_size=tp, sequence_parallel=sp, **fields)
