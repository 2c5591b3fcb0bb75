"""One-process training on CUDA: bf16 with megatron's optimizer, MFU and memory metrics."""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_pretrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARGS = [
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "1024", "--micro-batch-size", "2", "--train-iters", "20", "--lr", "1e-3",
    "--mock-data", "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def test_bf16_training_reports_mfu_and_memory(tmp_path):
    records = run_pretrain([*ARGS, "--bf16"], nproc=1, workdir=tmp_path, name="bf16")
    last = records[-1]
    assert last["loss"] < records[0]["loss"]
    assert 0 < last["mfu"] < 1
    assert last["mem_allocated_bytes"] > 0
    assert last["mem_reserved_bytes"] >= last["mem_allocated_bytes"]


def test_fp32_cuda_matches_its_recomputation(tmp_path):
    plain = run_pretrain(ARGS, nproc=1, workdir=tmp_path, name="plain")
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]  # fmt: skip
    recomputed = run_pretrain([*ARGS, *full], nproc=1, workdir=tmp_path, name="full")
    for a, b in zip(plain, recomputed):
        # CUDA kernels may pick other algorithms on the recompute pass: TF32-free fp32 noise only
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
