"""One-process training on CUDA: bf16 with megatron's optimizer, MFU and memory metrics."""

from __future__ import annotations

import pytest
import torch

from tests.launch import GPU_LLAMA, cli, launch_pretrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARGS = GPU_LLAMA + cli(num_layers=2, seq_length=1024, micro_batch_size=2, train_iters=20)


def test_bf16_training_reports_mfu_and_memory(tmp_path):
    records = launch_pretrain([*ARGS, "--bf16"], nproc=1, workdir=tmp_path, name="bf16")
    last = records[-1]
    assert last["loss"] < records[0]["loss"]
    assert 0 < last["mfu"] < 1
    assert last["mem_allocated_bytes"] > 0
    assert last["mem_reserved_bytes"] >= last["mem_allocated_bytes"]


def test_fp32_cuda_matches_its_recomputation(tmp_path):
    plain = launch_pretrain(ARGS, nproc=1, workdir=tmp_path, name="plain")
    full = cli(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recomputed = launch_pretrain([*ARGS, *full], nproc=1, workdir=tmp_path, name="full")
    for a, b in zip(plain, recomputed):
        # CUDA kernels may pick other algorithms on the recompute pass: TF32-free fp32 noise only
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])


def test_a_checkpoint_saved_on_cuda_resumes_the_run(tmp_path):
    # the save writes CUDA tensors from writer threads and gathers checksums over NCCL; the load
    # verifies every checksum and goes on from the saved iteration
    args = GPU_LLAMA + cli(num_layers=2, seq_length=1024, micro_batch_size=2, train_iters=4)
    save = ["--bf16", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    first = launch_pretrain([*args, *save, "--exit-interval", "2"], nproc=1, workdir=tmp_path,
                            name="first")  # fmt: skip
    assert [r["iteration"] for r in first] == [1, 2]
    assert (tmp_path / "ckpt" / "iter_0000002" / "manifest.json").is_file()
    resumed = launch_pretrain([*args, *save, "--load", str(tmp_path / "ckpt")], nproc=1,
                              workdir=tmp_path, name="resumed")  # fmt: skip
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert resumed[0]["consumed_samples"] == 3 * first[0]["global_batch_size"]
    assert abs(resumed[0]["loss"] - first[-1]["loss"]) < 0.5
