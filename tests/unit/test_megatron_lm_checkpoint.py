"""Megatron-LM's checkpoints in this trainer's terms (``memo_ext.training.checkpoint.megatron_lm``)
and the flags that choose what a load takes: the model a checkpoint's ``args`` describe (as
Megatron-LM's ``validate_args`` completes them), its LR schedule in steps, the padded vocabulary a
run adopts, and the checks of --finetune / --pretrained-checkpoint / --no-load-* / --no-save-optim.
The loads themselves run in ``tests/dist/test_checkpoint_finetune.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from memo_ext.arguments import parse_args
from memo_ext.errors import UsageError
from memo_ext.training.checkpoint import WEIGHTS_ONLY, LoadScope, checkpoint_source
from memo_ext.training.checkpoint import megatron_lm as megatron_lm
from tests.launch import SMALL_GPT

HERE = Path("ckpt/iter_0000010")


def llama_args(**changes) -> argparse.Namespace:
    """Megatron-LM's ``args`` of a Llama-style run as its parser leaves them (unset sizes None)."""
    fields = dict(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=None,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=None,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=8,
        global_batch_size=16,
        rampup_batch_size=None,
    )
    return argparse.Namespace(**{**fields, **changes})


def test_the_model_of_megatron_lm_args_is_completed_as_megatron_lm_does():
    identity = megatron_lm.model_identity(llama_args(), embedding_rows=32768)
    assert identity == {
        "num_layers": 4,
        "hidden_size": 256,
        "ffn_hidden_size": 640,  # int(4h · 2/3 / 64) · 64 with --swiglu
        "num_attention_heads": 8,
        "num_query_groups": 2,
        "kv_channels": 32,
        "normalization": "RMSNorm",
        "layernorm_zero_centered_gamma": False,
        "activation": "silu",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "qkv_bias": False,
        "position_embedding_type": "rope",
        "padded_vocab_size": 32768,
        "tied_embeddings": False,
    }
    # --num-query-groups counts only with --group-query-attention; GeLU MLPs are 4h wide; its
    # megatron-core GPT runs the exact GeLU whatever --openai-gelu says (a legacy-model flag)
    plain = megatron_lm.model_identity(
        llama_args(group_query_attention=False, swiglu=False, openai_gelu=True),
        embedding_rows=None,
    )
    assert plain["num_query_groups"] == 8 and plain["ffn_hidden_size"] == 1024
    assert (plain["activation"], plain["gated_linear_unit"]) == ("gelu", False)
    assert "padded_vocab_size" not in plain


@pytest.mark.parametrize("qkv_flag", [True, False])
def test_a_qkv_bias_is_what_the_weights_have_not_how_it_was_asked_for(qkv_flag):
    """Megatron-LM's validate_args sets add_qkv_bias whenever the linear layers have biases
    (its default GPT): the QKV projection has a bias either way, and so does the record."""
    biased = megatron_lm.model_identity(
        llama_args(add_bias_linear=True, add_qkv_bias=qkv_flag), embedding_rows=None
    )
    assert biased["qkv_bias"] is True
    qwen = megatron_lm.model_identity(llama_args(add_qkv_bias=True), embedding_rows=None)
    assert qwen["qkv_bias"] is True and qwen["add_bias_linear"] is False


def common(**scheduler) -> dict:
    state = dict(num_steps=160, lr_warmup_steps=32, lr_decay_steps=320, wd_incr_steps=320)
    return {"args": llama_args(), "iteration": 10, "opt_param_scheduler": {**state, **scheduler}}


def test_a_schedule_in_samples_is_continued_in_steps_at_a_constant_batch():
    steps = megatron_lm.schedule_state(common(max_lr=3e-4), counts_samples=False, directory=HERE)
    assert steps == dict(
        num_steps=10, lr_warmup_steps=2, lr_decay_steps=20, wd_incr_steps=20, max_lr=3e-4
    )
    samples = megatron_lm.schedule_state(common(), counts_samples=True, directory=HERE)
    assert samples["num_steps"] == 160  # a --train-samples run counts samples too
    ramp = common()
    ramp["args"].rampup_batch_size = ["4", "4", "64"]
    for saved in (ramp, common(num_steps=161)):
        with pytest.raises(UsageError, match="cannot continue; resume it with --train-samples"):
            megatron_lm.schedule_state(saved, counts_samples=False, directory=HERE)


def test_the_padded_vocabulary_of_a_megatron_lm_checkpoint_is_adopted_or_refused():
    saved = {"args": llama_args(tensor_model_parallel_size=2)}
    # GPT-2's 50257 tokens: Megatron-LM at TP 2 pads to 50432 rows, this trainer to 50304
    rows = megatron_lm.adopted_padded_vocab(
        saved, embedding_rows=50432, vocab_size=50257, tp_sizes=[1, 4], directory=HERE
    )
    assert rows == 50432
    with pytest.raises(UsageError, match="padding of this tokenizer's 32000 tokens is 32000"):
        megatron_lm.adopted_padded_vocab(
            saved, embedding_rows=50432, vocab_size=32000, tp_sizes=[1], directory=HERE
        )
    with pytest.raises(UsageError, match="do not split over --tensor-model-parallel-size 3"):
        megatron_lm.adopted_padded_vocab(
            saved, embedding_rows=50432, vocab_size=50257, tp_sizes=[3], directory=HERE
        )


def parse(*extra: str):
    return parse_args([*SMALL_GPT, *extra], world_size=1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--finetune"], "--finetune takes the weights of --load DIR or --pretrained-checkpoint"),
        (["--no-load-optim"], "apply when a checkpoint is loaded; add --load DIR"),
        (["--no-load-rng"], "apply when a checkpoint is loaded; add --load DIR"),
        (["--no-save-optim"], "--no-save-optim applies to the checkpoints of --save DIR"),
        (["--pretrained-checkpoint", "/nonexistent"], "is not a directory"),
    ],
)
def test_load_flags_without_a_checkpoint_are_refused(extra, message):
    with pytest.raises(UsageError, match=message):
        parse(*extra)


def test_the_flags_choose_what_a_load_takes(tmp_path):
    load, pretrained = tmp_path / "load", tmp_path / "pretrained"
    for root in (load, pretrained):
        root.mkdir()
    (pretrained / "latest_checkpointed_iteration.txt").write_text("100")
    resume = checkpoint_source(parse("--load", str(load), "--no-load-rng").checkpoint)
    assert resume.scope == LoadScope(rng=False) and resume.root == load
    finetune = parse("--load", str(pretrained), "--finetune", "--no-load-optim").checkpoint
    assert checkpoint_source(finetune).scope == WEIGHTS_ONLY
    # --pretrained-checkpoint while --load holds none; --load once it holds one
    both = parse("--load", str(load), "--pretrained-checkpoint", str(pretrained)).checkpoint
    assert checkpoint_source(both).root == pretrained
    assert checkpoint_source(both).scope == WEIGHTS_ONLY
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    assert checkpoint_source(both).root == load
    assert checkpoint_source(both).scope == LoadScope()
    (load / "latest_checkpointed_iteration.txt").unlink()
    (load / "iter_0000003").mkdir()  # checkpoints without a tracker are not skipped unseen
    with pytest.raises(UsageError, match="holds checkpoints"):
        checkpoint_source(both)


def test_a_load_scope_says_what_it_left_out_in_one_phrase():
    assert LoadScope().describe() == ""
    assert WEIGHTS_ONLY.describe() == "; its weights only"
    assert LoadScope(optimizer=False).describe() == "; fresh: optimizer and LR schedule"


@pytest.mark.parametrize("layout", ["legacy", "zarr"])
def test_megatron_lm_formats_this_trainer_does_not_read_are_named_with_their_conversion(
    tmp_path, layout
):
    import json as _json

    from memo_ext.training.checkpoint import CheckpointError, verify_checkpoint

    directory = tmp_path / "iter_0000010"
    if layout == "legacy":
        (directory / "mp_rank_00").mkdir(parents=True)
        torch.save({"iteration": 10}, directory / "mp_rank_00" / "model_optim_rng.pt")
        expected = ("in the legacy torch format (mp_rank_00/...)", "--ckpt-format torch ")
    else:
        directory.mkdir()
        metadata = {"sharded_backend": "zarr", "sharded_backend_version": 1}
        (directory / "metadata.json").write_text(_json.dumps(metadata))
        expected = ("in megatron-core's zarr format", "--ckpt-format torch_dist ")
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(directory)
    message = str(caught.value)
    assert (
        f"{directory} is a Megatron-LM checkpoint {expected[0]}, which is not supported" in message
    )
    assert f"--load {tmp_path} {expected[1]}--ckpt-convert-format torch_dist" in message
