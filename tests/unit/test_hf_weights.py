"""The Hugging Face converter's bookkeeping without models: megatron's fused QKV layout, and HF
configs → trainer flags (refusing what the trainer cannot express). Needs no ``transformers``."""

from __future__ import annotations

import pytest
import torch

from memo_ext.errors import UsageError
from memo_ext.hf.weights import fuse_qkv, split_qkv, trainer_flags


def test_fused_qkv_is_megatrons_per_group_layout():
    heads, groups, d = 6, 2, 3
    q = torch.arange(heads * d).float()  # head i holds values [i·d, (i+1)·d)
    k, v = -1 - torch.arange(groups * d).float(), 100 + torch.arange(groups * d).float()
    fused = fuse_qkv(q, k, v, groups=groups).reshape(groups, -1, d)
    # group 0: query heads 0, 1, 2, then key head 0, then value head 0
    assert torch.equal(fused[0, :3].flatten(), q[: 3 * d])
    assert torch.equal(fused[0, 3], k[:d]) and torch.equal(fused[0, 4], v[:d])
    assert torch.equal(fused[1, 3], k[d:]) and torch.equal(fused[1, 4], v[d:])
    back = split_qkv(fused.flatten(), heads=heads, groups=groups)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def _config(**changes) -> dict:
    base = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 48,
        "intermediate_size": 40,
        "num_attention_heads": 6,
        "vocab_size": 123,
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gemma"}, "model_type is 'gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not converted"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
            "megatron-core's fixed Llama 3.1 settings",
        ),
        ({"rope_theta": 10000.5}, "not a whole number"),
    ],
)
def test_models_the_trainer_cannot_express_are_refused(changes, message):
    with pytest.raises(UsageError, match=message):
        trainer_flags(_config(**changes))


def test_head_dim_other_than_hidden_over_heads_is_kv_channels():
    flags = trainer_flags(_config(head_dim=16))
    assert flags[flags.index("--kv-channels") + 1] == "16"
    assert "--kv-channels" not in trainer_flags(_config())


def test_rope_settings_read_alike_in_both_config_spellings():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0}
    # transformers 4 writes rope_theta / rope_scaling, transformers 5 one rope_parameters dict
    old = trainer_flags(_config(rope_theta=500000.0, rope_scaling=scaling))
    new = trainer_flags(_config(rope_parameters={"rope_theta": 500000.0, **scaling}))
    assert old == new
    assert " ".join(new).endswith(
        "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 32.0 "
        "--max-position-embeddings 2048 --make-vocab-size-divisible-by 128 "
        "--untie-embeddings-and-output-weights"
    )
    assert "--use-rope-scaling" not in trainer_flags(
        _config(rope_parameters={"rope_type": "default"})
    )


def test_qwen2_and_gpt2_flags():
    qwen2 = trainer_flags(_config(model_type="qwen2", tie_word_embeddings=True))
    assert "--add-qkv-bias" in qwen2 and "--untie-embeddings-and-output-weights" not in qwen2
    gpt2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 6, "vocab_size": 123}
    flags = " ".join(trainer_flags(gpt2))
    assert "--normalization LayerNorm" in flags and "--openai-gelu" in flags
    assert "--position-embedding-type learned_absolute --max-position-embeddings 1024" in flags
    assert "--ffn-hidden-size 192" in flags and "--disable-bias-linear" not in flags
    with pytest.raises(UsageError, match="gelu_new"):
        trainer_flags({**gpt2, "activation_function": "relu"})


def test_openai_gelu_is_the_gelu_mlps_activation_only():
    from memo_ext.shapes import ModelShape

    shape = ModelShape(num_layers=1, hidden_size=48, num_attention_heads=6, openai_gelu=True)
    shape.check()
    with pytest.raises(UsageError, match="--openai-gelu"):
        ModelShape(
            num_layers=1, hidden_size=48, num_attention_heads=6, openai_gelu=True, swiglu=True
        ).check()


_GPT2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 6, "vocab_size": 123}


@pytest.mark.parametrize(
    "config",
    [
        _config(),
        _config(head_dim=16, num_key_value_heads=2),
        _config(model_type="mistral", num_key_value_heads=3),
        _config(model_type="qwen2", tie_word_embeddings=True),
        _GPT2,
        {**_GPT2, "n_inner": 40},
    ],
    ids=["llama", "llama-head-dim", "mistral", "qwen2", "gpt2", "gpt2-n-inner"],
)
def test_the_hf_model_is_the_shape_the_trainer_builds_from_its_flags(config):
    # one description: the converter's shape of config.json (which its tensor links read) is the
    # ModelShape the trainer parses from the flags the converter writes, field for field
    import dataclasses

    from memo_ext.arguments import parse_args
    from memo_ext.hf.checkpoint import _RUN_STUB
    from memo_ext.hf.weights import hf_model

    model = hf_model(config)
    run = parse_args(
        [*trainer_flags(config), *_RUN_STUB, "--seq-length", "8"], world_size=1, notices=False
    )
    assert dataclasses.replace(run.shape, vocab_size=config["vocab_size"]) == model.shape
    untied = run.model.untie_embeddings_and_output_weights
    assert model.tied is not untied
