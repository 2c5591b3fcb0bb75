"""Layer and block specs for GPT models built from megatron-core modules.

Every transformer layer of the project is built here. The local spec starts from a copy of
megatron-core's stock local spec and swaps in our norm (sequence-parallel aware) and our core
attention; the ``te`` backend uses megatron-core's transformer-engine spec unchanged.
A memory policy (MEMO) is applied to the returned spec by ``memo_ext.training.model``.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.mcore.attention import FlashAttention, SDPAttention
from memo_ext.mcore.norms import Norm

# TransformerConfig settings for the local layer spec: megatron's fused element-wise kernels
# come from apex / TE; the unfused paths are exact on every device and all the CPU supports.
LOCAL_KERNEL_SETTINGS = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


def build_layer_spec(*, config: TransformerConfig, attention_backend: str) -> ModuleSpec:
    """Spec of one GPT transformer layer for a concrete (resolved) attention backend."""
    if attention_backend == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec())
    layer = spec.submodules
    layer.input_layernorm = Norm
    layer.pre_mlp_layernorm = Norm
    core = FlashAttention if attention_backend == "flash" else SDPAttention
    layer.self_attention.submodules.core_attention = core
    return spec


def build_block_spec(
    *, config: TransformerConfig, layer_spec: ModuleSpec, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: its layers and our final norm."""
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    final_norm = Norm
    if layer_spec.submodules.input_layernorm is not Norm:  # te spec: TE's own norm
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=final_norm)
