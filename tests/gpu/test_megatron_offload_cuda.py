"""megatron-core's fine-grained activation offloading on CUDA, with the flags of
``tools.compare_methods --methods megatron-offload``: the losses of the plain run, and a lower
device peak. Skipped without CUDA or transformer-engine, which megatron-core's offloading needs
(the CPU tier checks the refusal: tests/unit/test_megatron_offload.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from memo_ext.features.megatron_offload.method import MEGATRON_OFFLOAD_FLAGS
from tests.launch import GPU_LLAMA, cli, launch_pretrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="megatron-core's activation offloading needs transformer-engine",
    ),
]

# [s, b, h] = 4096 × 2 × 256 = 2M elements: above megatron-core's 1M-element floor for offloading,
# so the modules' saved inputs and the attention's q / k / v / output leave the device
ARGS = GPU_LLAMA + cli(num_layers=4, seq_length=4096, micro_batch_size=2, train_iters=4)


@pytest.mark.parametrize("backend", ["sdpa", "te"])
def test_offloaded_run_has_the_plain_losses_and_a_lower_peak(tmp_path, backend):
    args = [*ARGS, "--attention-backend", backend]
    plain = launch_pretrain(args, nproc=1, workdir=tmp_path, name=f"plain_{backend}")
    offload = launch_pretrain(
        [*args, *MEGATRON_OFFLOAD_FLAGS], nproc=1, workdir=tmp_path, name=f"offload_{backend}"
    )
    assert len(offload) == len(plain) == 4
    for a, b in zip(plain, offload):
        # the copies to host and back are exact; two runs may still pick other fp32 kernel
        # algorithms (and atomics in attention's backward): noise far below the loss's change
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    # each record's peak is its own step's; the first step is megatron-core's warm-up, in which
    # it records the offload groups (it offloads in that step too)
    offload_peak = max(r["mem_allocated_bytes"] for r in offload[1:])
    plain_peak = min(r["mem_allocated_bytes"] for r in plain[1:])
    assert offload_peak < plain_peak, (offload_peak, plain_peak)
