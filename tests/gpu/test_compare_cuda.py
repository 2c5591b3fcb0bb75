"""What tools.compare_methods relies on from a GPU: out of memory under --memory-limit-gb is exit
status 3 with the bytes asked for, and the kernels it times give efficiencies a calibration can
hold."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memo_ext.estimate.calibration import kernel_calibration, measure_kernels
from memo_ext.hardware import cuda_device
from memo_ext.shapes import model_shape
from tests.launch import ROOT, cli, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train(*extra: str) -> subprocess.CompletedProcess:
    args = cli(
        num_layers=2,
        hidden_size=1024,
        num_attention_heads=8,
        seq_length=65536,
        micro_batch_size=1,
        train_iters=1,
        lr="1e-4",
        mock_data=True,
        position_embedding_type="rope",
    )
    cmd = [sys.executable, "-m", "memo_ext.launch", "--nproc-per-node", "1"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += [str(ROOT / "pretrain_gpt_memo.py"), *args, "--bf16", "--skip-preflight", *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_out_of_memory_under_a_limit_is_exit_status_3_with_the_bytes():
    proc = _train("--memory-limit-gb", "2")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "out of memory (tried to allocate" in last and "Traceback" not in last


def test_kernel_rates_make_a_calibration():
    device = cuda_device()
    assert device is not None, "this GPU is not in memo_ext.hardware.DEVICES"
    rates = measure_kernels(model_shape("gpt-7b"), device="cuda", tokens=4096, repeats=3)
    calibration = kernel_calibration(rates, device=device.name, peak_tflops=device.peak_tflops)
    calibration.check()
    # bf16 products of a 7B layer reach a real share of the data sheet's peak on any listed GPU
    assert 0.2 < rates.layer_matmul_tflops / device.peak_tflops <= 1.0
    assert rates.host_link_gbps > 5
