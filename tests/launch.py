"""Run ``pretrain_gpt_memo.py`` the way users do (torchrun) and read back its metrics.

Shared by the distributed tests: one call = one training job of ``nproc`` gloo processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(
    args: list[str], *, nproc: int, workdir: Path, name: str, timeout_s: int = 600
) -> list[dict]:
    """Train with ``args`` on ``nproc`` processes; return the metrics records.

    Raises:
        AssertionError: when the job fails, with its output for diagnosis.
    """
    metrics = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(ROOT / "pretrain_gpt_memo.py"), *args,
        "--metrics-file", str(metrics), "--log-interval", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def assert_same_curves(reference: list[dict], other: list[dict], *, rtol: float) -> None:
    """Loss and gradient norm agree at every logged iteration to ``rtol``."""
    assert [r["iteration"] for r in reference] == [o["iteration"] for o in other]
    for ref, got in zip(reference, other):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= rtol * abs(ref[key]), (
                f"iteration {ref['iteration']}: {key} {got[key]!r} vs reference {ref[key]!r}"
            )
