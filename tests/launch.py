"""Run ``pretrain_gpt_memo.py`` the way users do (torchrun) and read back its metrics.

Shared by the distributed tests: one call = one training job of ``nproc`` gloo processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from memo_ext.training.metrics import curve_differences, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def cli(**flags: object) -> list[str]:
    """Command-line arguments from keywords, in order: ``cli(num_layers=4, mock_data=True)`` is
    ``["--num-layers", "4", "--mock-data"]`` (``True``: a bare switch; a list: several values)."""
    argv: list[str] = []
    for name, value in flags.items():
        argv.append("--" + name.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            argv += [str(v) for v in value]
        elif value is not True:
            argv.append(str(value))
    return argv


SMALL_GPT = cli(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    seq_length=128,
    micro_batch_size=2,
    train_iters=10,
    lr="1e-3",
    mock_data=True,
)
"""A small GPT on mock data: the flags the argument tests start from."""

TINY_LLAMA = cli(
    num_layers=2,
    hidden_size=36,
    ffn_hidden_size=50,
    num_attention_heads=6,
    num_query_groups=2,
    seq_length=28,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    micro_batch_size=2,
    mock_data=True,
    seed=11,
)
"""A LLaMA-style layer (GQA, RoPE, RMSNorm, SwiGLU, no biases) small enough for many runs; the
tests add the schedule."""

GPU_LLAMA = cli(
    hidden_size=256,
    num_attention_heads=4,
    lr="1e-3",
    mock_data=True,
    position_embedding_type="rope",
    swiglu=True,
    normalization="RMSNorm",
    attention_dropout=0,
    hidden_dropout=0,
)
"""The GPU tests' LLaMA-style model, wide enough for real kernels; each test adds the layers,
sequence, batch and steps it needs."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(
    args: list[str],
    *,
    nproc: int,
    workdir: Path,
    name: str,
    timeout_s: int = 600,
    module: str | None = None,
) -> list[dict]:
    """Train with ``args`` on ``nproc`` processes; return the metrics records.

    ``module``: a module to run instead of ``pretrain_gpt_memo.py`` (``python -m`` style, from
    the repository root), for tests that patch the trainer before calling its ``main``.

    Raises:
        AssertionError: when the job fails, with its output for diagnosis.
    """
    metrics = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *(["--module", module] if module else [str(ROOT / "pretrain_gpt_memo.py")]),
        *args,
        "--metrics-file",
        str(metrics),
        "--log-interval",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_metrics(metrics)


def assert_same_curves(reference: list[dict], other: list[dict], *, rtol: float) -> None:
    """Loss and gradient norm agree at every logged iteration to ``rtol``
    (``tools/compare_metrics.py``'s rule)."""
    differences = curve_differences(reference, other, rtol=rtol)
    assert not differences, "\n".join(differences)
