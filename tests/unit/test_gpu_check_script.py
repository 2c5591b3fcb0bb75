"""``scripts/gpu_check.sh`` on a machine without a GPU: one sentence, nothing run, no files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.launch
def test_without_a_gpu_the_check_stops_at_once(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "WORK": str(tmp_path / "w")}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"gpu_check: no CUDA GPU is visible to {sys.executable}'s torch (a CUDA build of torch "
        "and a GPU are needed); nothing was run"
    ]
    assert not out.exists()
