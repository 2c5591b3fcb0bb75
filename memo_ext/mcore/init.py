"""Weight initialisation that does not depend on the parallel layout.

megatron-core initialises each process's shard from a running RNG, so a model built under
PP = 2, or with a gated MLP under TP = 2, starts from different weights than the same model in
one process. Here every parameter is drawn whole from a generator seeded by (seed, the
parameter's global name) and this process keeps its shard, cut exactly as megatron-core's
tensor-parallel layers cut it. One-process, TP, PP and CP runs then start identical, which is
what parity tests and re-sharding (HotSPa, checkpoints into other layouts) rely on.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

# Output projections of each residual branch get std / sqrt(2 · layers), as megatron does.
_SCALED_OUTPUTS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name → name in the whole (unpipelined) model.

    Layer indices become global (``decoder.layers.3`` on the second of two 4-layer stages is
    ``decoder.layers.7``), and a pipeline's copy of the tied output weight is named after the
    word embedding it mirrors.
    """
    prefixes = {}
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            local = name.rsplit(".", 1)
            prefixes[name + "."] = f"{local[0]}.{module.layer_number - 1}."
    names = {}
    for name, _ in model.named_parameters():
        global_name = name
        for local, glob in prefixes.items():
            if name.startswith(local):
                global_name = glob + name[len(local) :]
                break
        if global_name.endswith("output_layer.weight") and getattr(
            model, "share_embeddings_and_output_weights", False
        ):
            global_name = global_name.replace(
                "output_layer.weight", "embedding.word_embeddings.weight"
            )
        names[name] = global_name
    return names


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _is_norm(global_name: str) -> bool:
    """Norm parameters: ``input_layernorm.weight``, or TE's fused ``layer_norm_weight``."""
    return any("norm" in part for part in global_name.split(".")[-2:])


def _std_for(global_name: str, config: TransformerConfig) -> float | None:
    """Normal std for a weight matrix / embedding, or None for norms and biases."""
    if _is_norm(global_name) or global_name.endswith("bias"):
        return None
    if global_name.endswith(_SCALED_OUTPUTS):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def _full_shape(param: torch.nn.Parameter, tp: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


Segment = tuple[int, int, int]
"""``(start in the full tensor, length, start in the shard)`` along the partition dimension."""


def tp_segments(param, *, name: str, tp: int, tp_rank: int, gated: bool, full_size=None):
    """Which part of the full parameter this TP rank holds: ``(dim, segments)``.

    Replicated parameters hold all of dim 0; a gated fc1 holds ``[gate_r; up_r]`` (each rank
    keeps its slice of both halves, as megatron-core's layers cut it); the rest hold one
    contiguous ``1 / tp`` of their partition dimension. Sizes come from ``param``'s (local)
    shape, or from ``full_size`` (the full tensor's size along that dimension) when given.
    """
    parallel = getattr(param, "tensor_model_parallel", False)
    dim = param.partition_dim if parallel else 0
    if full_size is None:
        full_size = param.shape[dim] * (tp if parallel else 1)
    if not parallel or tp == 1:
        return dim, [(0, full_size, 0)]
    n = full_size // tp
    if gated and name.endswith(_GATED):
        half = n // 2  # this rank's slice of each half
        return dim, [(tp_rank * half, half, 0), (tp * half + tp_rank * half, half, half)]
    return dim, [(tp_rank * n, n, 0)]


def _shard(full: torch.Tensor, param, *, name: str, tp: int, tp_rank: int, gated: bool):
    """This TP rank's slice of ``full``, laid out as megatron-core's layers hold it."""
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else 0
    dim, segments = tp_segments(
        param, name=name, tp=tp, tp_rank=tp_rank, gated=gated, full_size=full.shape[dim]
    )
    return torch.cat([full.narrow(dim, start, length) for start, length, _ in segments], dim=dim)


@torch.no_grad()
def init_weights_layout_independent(
    model: torch.nn.Module, *, config: TransformerConfig, seed: int, tp: int, tp_rank: int
) -> None:
    """Re-initialise every parameter of ``model`` (one pipeline stage, one TP shard)."""
    names = global_parameter_names(model)
    for name, param in model.named_parameters():
        global_name = names[name]
        std = _std_for(global_name, config)
        if std is None:
            # a norm's gain is 1; zero-centred gains (--apply-layernorm-1p) store γ − 1
            is_gain = _is_norm(global_name) and global_name.endswith("weight")
            param.fill_(1.0 if is_gain and not config.layernorm_zero_centered_gamma else 0.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(_seed_for(seed, global_name))
        full = torch.empty(_full_shape(param, tp), dtype=torch.float32, device=param.device)
        full.normal_(0.0, std, generator=generator)
        shard = _shard(
            full, param, name=global_name, tp=tp, tp_rank=tp_rank, gated=config.gated_linear_unit
        )
        param.copy_(shard)
