"""Megatron-LM's logging, data-loader, memory, profiling and W&B flags in real training runs
(torchrun, gloo, CPU): what they write, and that they leave the losses alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

from memo_ext.data.tokenizers import ByteTokenizer
from memo_ext.shapes import ModelShape
from tests.launch import assert_same_curves, cli, run_pretrain
from tests.models import build_gpt, cpu_config
from tests.unit.test_megatron_run_flags import FAKE_WANDB

pytestmark = pytest.mark.dist

SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
MODEL = cli(
    **SHAPE,
    seq_length=24,
    micro_batch_size=2,
    global_batch_size=4,
    mock_data=True,
    train_iters=3,
    untie_embeddings_and_output_weights=True,
)
PADDED_VOCAB = 384  # the byte tokenizer's 257 ids, padded to a multiple of 128
FROZEN = cli(lr="1e-30")
"""A rate whose Adam updates (about 1e-30 per element) round away in fp32: the weights stay
as initialised, so their norm can be computed here from a model built alike."""


def initial_params_norm() -> float:
    """The trainer's initial weights (seed 1234, drawn as it draws them), normed in one flat
    float64 vector: the reference for --log-params-norm."""
    shape = ModelShape(**SHAPE, vocab_size=PADDED_VOCAB)
    model = build_gpt(
        cpu_config(shape),
        vocab_size=PADDED_VOCAB,
        max_positions=24,
        position_embedding_type="learned_absolute",
        seed=1234,
    )
    return torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm().item()


def test_logging_profiling_and_wandb_flags_in_one_run(tmp_path, monkeypatch, megatron_cpu):
    tb, wandb_log = tmp_path / "tb", tmp_path / "wandb_calls.jsonl"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(FAKE_WANDB), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("FAKE_WANDB_LOG", str(wandb_log))
    flags = cli(
        log_params_norm=True,
        log_num_zeros_in_grad=True,
        log_throughput=True,
        profile=True,
        use_pytorch_profiler=True,
        profile_step_start=2,
        profile_step_end=3,
        tensorboard_dir=str(tb),
        manual_gc=True,
        manual_gc_interval=1,
        empty_unused_memory_level=2,
        num_workers=1,
        wandb_project="memo-tests",
        wandb_exp_name="flags",
        wandb_save_dir=str(tmp_path / "wandb"),
        # CUDA-only: a notice on CPU, never a failure
        overlap_grad_reduce=True,
        cross_entropy_loss_fusion=True,
        grad_reduce_in_bf16=True,
    )
    records = run_pretrain(MODEL + FROZEN + flags, nproc=1, workdir=tmp_path, name="flags")
    assert [r["iteration"] for r in records] == [1, 2, 3]

    # the profiled window: iteration 2 (iteration 1 warmed the profiler up)
    trace = tb / "rank0_iter2-2.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert sum(n.startswith("ProfilerStep#") for n in names) == 1

    # params norm: the untouched initial weights, computed here independently; float64 sums in
    # another order, so equal to rounding
    expected = initial_params_norm()
    assert [r["params_norm"] for r in records] == pytest.approx([expected] * 3, rel=1e-9)
    # zeros in the gradient: at least the input-embedding rows no token of the batch uses
    # (the padding rows past the tokenizer's ids, and more)
    unused_rows = PADDED_VOCAB - ByteTokenizer().vocab_size
    assert all(r["num_zeros_in_grad"] >= unused_rows * 32 for r in records)
    assert all(r["tflops_per_device"] > 0 for r in records)

    # W&B received the metrics file's records, at their iterations
    calls = [json.loads(line) for line in wandb_log.read_text().splitlines()]
    init, *logs, finish = calls
    assert init["kwargs"]["project"] == "memo-tests" and init["kwargs"]["name"] == "flags"
    assert init["kwargs"]["dir"] == str(tmp_path / "wandb")
    assert init["kwargs"]["config"]["logging"]["log_params_norm"] is True
    assert [c["step"] for c in logs] == [1, 2, 3]
    for call, record in zip(logs, records):
        assert call["values"] == {k: v for k, v in record.items() if k != "iteration"}
    assert finish == {"call": "finish"}


def test_params_norm_counts_each_weight_once_under_tensor_parallelism(tmp_path, megatron_cpu):
    records = run_pretrain(
        MODEL + FROZEN + cli(log_params_norm=True, tensor_model_parallel_size=2),
        nproc=2,
        workdir=tmp_path,
        name="tp2",
    )
    assert records[-1]["params_norm"] == pytest.approx(initial_params_norm(), rel=1e-9)


def test_loader_mask_and_norm_parametrisation_leave_the_losses_alone(tmp_path):
    trained = MODEL + cli(lr="1e-3", train_iters=4)
    # Megatron-LM's defaults: an attention mask in the batches, 2 loader processes
    reference = run_pretrain(
        trained + cli(create_attention_mask_in_dataloader=True),
        nproc=1,
        workdir=tmp_path,
        name="ref",
    )
    plain = run_pretrain(
        trained + cli(no_create_attention_mask_in_dataloader=True, num_workers=0),
        nproc=1,
        workdir=tmp_path,
        name="plain",
    )
    assert_same_curves(reference, plain, rtol=0.0)
    centred = run_pretrain(
        trained + cli(apply_layernorm_1p=True), nproc=1, workdir=tmp_path, name="1p"
    )
    # the first step's model is the same function of the same weights: equal to the last bit
    assert centred[0]["loss"] == reference[0]["loss"]
    assert centred[0]["grad_norm"] == reference[0]["grad_norm"]
    # then γ − 1 is updated instead of γ: (γ − 1 − u) + 1 rounds unlike γ − u in fp32
    assert_same_curves(reference, centred, rtol=1e-5)
