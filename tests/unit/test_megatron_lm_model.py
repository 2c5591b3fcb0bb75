"""Same flags, same model as Megatron-LM: what its ``validate_args`` and
``core_transformer_config_from_args`` (``megatron/training/arguments.py`` at ``core_v0.16.1``)
derive from a GPT's model flags, derived here the same way.

The rules are restated from Megatron-LM's source in :func:`megatron_lm_fields` (line numbers of
that file at the tag), and every case compares them with the megatron-core ``TransformerConfig``
and ``GPTModel`` arguments this trainer builds from the same flags. The cases are Megatron-LM's
argument defaults and the model flags of its own example scripts (``examples/gpt3``,
``examples/llama``, ``examples/inference/llama_mistral``), at small sizes where the size does not
change a rule.
"""

from __future__ import annotations

import shlex

import pytest
import torch.nn.functional as F

from memo_ext.arguments import parse_args
from memo_ext.features.megatron import run_transformer_config

BASE = "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --train-iters 1"
BASE += " --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000"

CASES = {
    # the argument defaults: GeLU MLP of 4h, biases (QKV's too), LayerNorm, learned positions
    "defaults": "--num-layers 2 --hidden-size 64 --num-attention-heads 4",
    # SwiGLU without its width: two thirds of 4h, down to a multiple of 64
    "swiglu-default-width": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --swiglu",
    "swiglu-7b-width": "--num-layers 1 --hidden-size 4096 --num-attention-heads 32 --swiglu",
    "swiglu-odd-width": "--num-layers 1 --hidden-size 320 --num-attention-heads 5 --swiglu",
    # examples/gpt3/train_gpt3_175b_distributed.sh, its model flags at small sizes
    "gpt3-example": "--num-layers 2 --hidden-size 96 --num-attention-heads 8 "
    "--init-method-std 0.006",
    # examples/llama/train_llama3_8b_h100_fp8.sh (a LayerNorm with 1p, not RMSNorm)
    "llama3-8b-example": "--num-layers 2 --hidden-size 256 --ffn-hidden-size 896 "
    "--num-attention-heads 8 --group-query-attention --num-query-groups 2 --kv-channels 32 "
    "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --swiglu "
    "--init-method-std 0.0134 --apply-layernorm-1p --untie-embeddings-and-output-weights "
    "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0",
    # examples/inference/llama_mistral/run_text_generation_llama3.sh
    "llama3-inference-example": "--disable-bias-linear --normalization RMSNorm "
    "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --rotary-percent 1.0 --rotary-base 500000 "
    "--use-rotary-position-embeddings --swiglu --num-layers 2 --hidden-size 128 "
    "--ffn-hidden-size 448 --num-attention-heads 8",
    # a Llama 2 shape without its width (Megatron-LM's SwiGLU default, not Llama's 11008)
    "llama2-default-width": "--normalization RMSNorm --swiglu --disable-bias-linear "
    "--position-embedding-type rope --num-layers 1 --hidden-size 4096 --num-attention-heads 32 "
    "--norm-epsilon 1e-5",
    # Qwen2: no linear biases but the QKV's
    "qkv-bias-only": "--num-layers 1 --hidden-size 64 --num-attention-heads 4 "
    "--disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6",
    # --group-query-attention alone: Megatron-LM's --num-query-groups default, 1
    "gqa-default-groups": "--num-layers 1 --hidden-size 64 --num-attention-heads 4 "
    "--group-query-attention",
}


def _flags(text: str) -> dict[str, str | bool]:
    words, flags = shlex.split(text), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = (
                words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
            )
            flags[word[2:].replace("-", "_")] = value
    return flags


def megatron_lm_fields(text: str) -> dict:
    """Megatron-LM's model of ``text``'s flags, as its own code derives it."""
    a = _flags(text)
    h, heads = int(a["hidden_size"]), int(a["num_attention_heads"])
    swiglu = bool(a.get("swiglu"))
    # validate_args, arguments.py:802-811: an unset FFN width is 4h, with --swiglu two thirds
    # of it down to a multiple of 64 (in floating point)
    ffn = int(a["ffn_hidden_size"]) if "ffn_hidden_size" in a else (
        int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
    )  # fmt: skip
    linear_bias = not a.get("disable_bias_linear")
    gqa = bool(a.get("group_query_attention"))
    return {
        "num_layers": int(a["num_layers"]),
        "hidden_size": h,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        # arguments.py:1348-1351: groups only with --group-query-attention (its flag's default
        # 1), else None, which TransformerConfig fills with the heads
        "num_query_groups": int(a.get("num_query_groups", 1)) if gqa else heads,
        # validate_args, :813-815: h / heads when unset
        "kv_channels": int(a.get("kv_channels", h // heads)),
        "normalization": a.get("normalization", "LayerNorm"),
        "layernorm_epsilon": float(a.get("norm_epsilon", 1e-5)),
        # --apply-layernorm-1p is TransformerConfig's layernorm_zero_centered_gamma
        "layernorm_zero_centered_gamma": bool(a.get("apply_layernorm_1p")),
        # :1332-1335: --swiglu is a gated SiLU; the default activation is the exact GeLU
        "gated_linear_unit": swiglu,
        "activation_func": F.silu if swiglu else F.gelu,
        "add_bias_linear": linear_bias,
        # validate_args, :968-970: the linear layers' biases imply the QKV's
        "add_qkv_bias": bool(a.get("add_qkv_bias")) or linear_bias,
        "init_method_std": float(a.get("init_method_std", 0.02)),
        # GPTModel's own arguments (gpt_builders.py)
        "position_embedding_type": "rope"
        if a.get("use_rotary_position_embeddings")
        else a.get("position_embedding_type", "learned_absolute"),
        "share_embeddings_and_output_weights": not a.get("untie_embeddings_and_output_weights"),
        "rotary_base": int(a.get("rotary_base", 10000)),
    }


def our_fields(text: str) -> dict:
    run = parse_args(shlex.split(f"{text} {BASE}"))
    config = run_transformer_config(run)
    fields = {
        name: getattr(config, name) for name in megatron_lm_fields(text) if hasattr(config, name)
    }
    fields["position_embedding_type"] = run.shape.position_embedding_type
    fields[
        "share_embeddings_and_output_weights"
    ] = not run.model.untie_embeddings_and_output_weights
    fields["rotary_base"] = run.model.rotary_base
    return fields


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_flags_build_megatron_lms_model(case):
    expected, ours = megatron_lm_fields(CASES[case]), our_fields(CASES[case])
    assert ours == expected


def test_the_swiglu_width_rule_at_a_few_widths():
    """int(4h · 2/3 / 64) · 64: 128 at h 64 (not 4h = 256), 10880 at h 4096 (Llama's 11008 is
    always given explicitly)."""
    widths = {64: 128, 4096: 10880, 5120: 13632, 8192: 21824}
    for h, width in widths.items():
        text = f"--num-layers 1 --hidden-size {h} --num-attention-heads 8 --swiglu"
        assert our_fields(text)["ffn_hidden_size"] == width
