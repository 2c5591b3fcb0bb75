"""A checkpoint's model identity is the run's ``ModelShape`` as megatron-core built it: the
record read off a built model equals :func:`identity_of` of the shape the flags parse to, for
every kind of model the trainer builds, and its keys and values stay those earlier manifests
recorded (a checkpoint written before still loads). A resume that does not fit its checkpoint
is told every misfit at once, each with the flag that fixes it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memo_ext.errors import UsageError
from memo_ext.hf.checkpoint import build_model
from memo_ext.training.checkpoint import MANIFEST, MODEL_FLAGS_FILE, TRACKER
from memo_ext.training.checkpoint.identity import identity_of, model_identity
from memo_ext.training.control import check_resumable

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
MODELS = {
    "gpt": [],
    "openai-gelu": ["--openai-gelu"],
    "llama-gqa-untied": [
        *LLAMA,
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
    ],
    "qwen2": [*LLAMA, "--add-qkv-bias", "--position-embedding-type", "rope"],
    "head-dim-ffn-1p": ["--kv-channels", "32", "--ffn-hidden-size", "100", "--apply-layernorm-1p"],
    "yarn": ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"],
}


@pytest.mark.parametrize("flags", MODELS.values(), ids=MODELS.keys())
def test_the_identity_is_the_runs_shape(flags, megatron_cpu):
    run, model = build_model([*BASE, *flags], vocab_size=1000)
    expected = identity_of(
        run.shape,
        zero_centred_norms=run.model.apply_layernorm_1p,
        embedding_rows=run.model.padded_vocab_size,
        tied=not run.model.untie_embeddings_and_output_weights,
    )
    assert model_identity(model) == expected


def test_the_record_keeps_the_manifests_format(megatron_cpu):
    # a Llama-like model with GQA, as every earlier manifest spells it (key order included)
    _, model = build_model([*BASE, *MODELS["llama-gqa-untied"]], vocab_size=1000)
    assert list(model_identity(model).items()) == [
        ("num_layers", 2),
        ("hidden_size", 64),
        ("ffn_hidden_size", 128),
        ("num_attention_heads", 4),
        ("num_query_groups", 2),
        ("kv_channels", 16),
        ("normalization", "RMSNorm"),
        ("layernorm_zero_centered_gamma", False),
        ("activation", "silu"),
        ("gated_linear_unit", True),
        ("add_bias_linear", False),
        ("qkv_bias", False),
        ("position_embedding_type", "rope"),
        ("padded_vocab_size", 1024),
        ("tied_embeddings", False),
    ]


# what earlier manifests recorded for the facts the Llama record above does not show
SPELT = {
    "gpt": {"activation": "gelu", "add_bias_linear": True, "qkv_bias": True},
    "openai-gelu": {"activation": "openai_gelu", "position_embedding_type": "learned_absolute"},
    "qwen2": {"add_bias_linear": False, "qkv_bias": True, "tied_embeddings": True},
    "head-dim-ffn-1p": {
        "kv_channels": 32,
        "ffn_hidden_size": 100,
        "layernorm_zero_centered_gamma": True,
    },
    "yarn": {"position_embedding_type": "rope"},
}


@pytest.mark.parametrize("name", SPELT)
def test_each_fact_is_spelt_as_the_manifests_spell_it(name, megatron_cpu):
    _, model = build_model([*BASE, *MODELS[name]], vocab_size=1000)
    record = model_identity(model)
    assert {key: record[key] for key in SPELT[name]} == SPELT[name]


def _checkpoint_of(flags: list[str], folder, *, iteration: int) -> None:
    """A folder as a save leaves it, its weights left out: the tracker, the manifest's model
    record (read off the built model) and ``model_flags.txt``."""
    _, model = build_model([*BASE, *flags], vocab_size=1000)
    directory = folder / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    (directory / MANIFEST).write_text(json.dumps({"model": model_identity(model)}))
    (folder / TRACKER).write_text(f"{iteration}\n")
    (folder / MODEL_FLAGS_FILE).write_text(" ".join([*BASE, *flags]) + "\n")


def _resume_problem(flags: list[str], folder) -> str:
    run, _ = build_model([*BASE, *flags], vocab_size=1000)  # --train-iters 1
    run = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, load=folder))
    with pytest.raises(UsageError) as caught:
        check_resumable(run)
    return str(caught.value)


def test_a_resume_names_every_misfit_at_once(tmp_path, megatron_cpu):
    # past --train-iters and another hidden size: both in one message, not one per attempt
    _checkpoint_of(MODELS["qwen2"], tmp_path, iteration=3)
    wider = [*MODELS["qwen2"], "--hidden-size", "128"]
    message = _resume_problem(wider, tmp_path)
    assert f"--load {tmp_path} does not fit this run on 2 counts" in message
    assert (
        "(1) the checkpoint in" in message and "is at iteration 3, past --train-iters 1" in message
    )
    assert "(2) the checkpoint in" in message and "hidden_size 64 there, 128 here" in message
    assert f"({tmp_path / MODEL_FLAGS_FILE} lists them)" in message


def test_a_qkv_bias_the_linear_biases_bring_is_not_a_flag_to_drop(tmp_path, megatron_cpu):
    # a Llama checkpoint resumed without --disable-bias-linear: the run's QKV bias comes from
    # its linear layers' biases, so the fix is that flag, not an --add-qkv-bias never given
    _checkpoint_of(MODELS["llama-gqa-untied"], tmp_path, iteration=1)
    without = [flag for flag in MODELS["llama-gqa-untied"] if flag != "--disable-bias-linear"]
    message = _resume_problem(without, tmp_path)
    assert "add_bias_linear False there, True here (give --disable-bias-linear)" in message
    assert "qkv_bias False there, True here (give --disable-bias-linear)" in message
    assert "--add-qkv-bias" not in message
    # where the run gave --add-qkv-bias itself, dropping it is the fix
    message = _resume_problem([*MODELS["llama-gqa-untied"], "--add-qkv-bias"], tmp_path)
    assert "qkv_bias False there, True here (drop --add-qkv-bias)" in message
