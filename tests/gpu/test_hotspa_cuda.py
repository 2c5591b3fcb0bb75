"""HotSPa on CUDA with NCCL: weights and gradients switched between layouts on 2+ GPUs give
the losses of one GPU without HotSPa. Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from tests.launch import assert_same_curves, cli, launch_pretrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

ARGS = cli(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    seq_length=256,
    micro_batch_size=1,
    global_batch_size=16,
    train_iters=3,
    lr="2e-3",
    mock_data=True,
    variable_seq_lengths=True,
    attention_backend="sdpa",
    seed=3,
)


@pytest.mark.parametrize("strategies", ["dp2;tp2;pp2", "dp2;cp2;tp2"])
def test_switching_on_two_gpus_matches_one_gpu(tmp_path, strategies):
    reference = launch_pretrain(ARGS, nproc=1, workdir=tmp_path, name="one")
    curves = launch_pretrain(
        ARGS + ["--hotspa", "--hotspa-buckets", "64,128,256", "--hotspa-strategies", strategies],
        nproc=2,
        workdir=tmp_path,
        name="hot",
    )
    # fp32 on GPU: kernels and reduction orders differ from one GPU, well within 1e-4
    assert_same_curves(reference, curves, rtol=1e-4)
    assert sum(r["hotspa_weight_switch_bytes"] + r["hotspa_grad_switch_bytes"] for r in curves)
