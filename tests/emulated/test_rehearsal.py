"""Dress rehearsal: the GPU scripts run whole, as a user starts them, on the emulated device
(``python -m memo_ext.simulate.run``): every Python process they start has the GPU, ``nvidia-smi``
answers for it. Values are fake; what is checked is that every stage reaches its end and writes
its files, with nothing crashing, hanging, misplacing a tensor or breaking an ordering rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch
ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    "install", "gpu_tests", "launch_tests", "step_full", "step_memo", "step_memo_chunked",
    "step_memo_plan", "compare",
]  # fmt: skip
FILES = {
    "stages.txt", "10_install.log", "20_gpu_tests.log", "30_steps.txt", "30_steps.jsonl",
    "40_compare.txt", "40_compare.json", "40_calibration.json",
}  # fmt: skip


def on_the_device(tmp_path, *command: str, gpus: int = 1, **env: str) -> str:
    """Runs ``command`` under ``python -m memo_ext.simulate.run``; its output (it must exit 0)."""
    base = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    base.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore", **env)
    done = subprocess.run(
        [sys.executable, "-m", "memo_ext.simulate.run", "--gpus", str(gpus), "--", *command],
        cwd=ROOT, env=base, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def test_gpu_check_reaches_the_end_of_every_stage(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    on_the_device(
        tmp_path, "bash", "scripts/gpu_check.sh", OUT=str(out), WORK=str(work), REHEARSAL="1"
    )
    assert {p.name for p in out.iterdir()} == FILES  # at most 8 files come back
    stages = (out / "stages.txt").read_text()
    assert "NVIDIA H100 80GB HBM3" in stages and "MEMO host budget" in stages
    for name in STAGES:
        assert f"{name}: ran " in stages and f"{name}: ran" in stages, stages
    ran = [line for line in stages.splitlines() if ": ran " in line]
    assert [line.split(":")[0] for line in ran] == STAGES
    assert all(line.endswith("exit 0") for line in ran), stages
    runs = {}
    for line in (out / "30_steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        runs.setdefault(record["run"], []).append(record["iteration"])
    assert runs == {name: [1, 2, 3] for name in ("full_recompute", "memo_auto", "memo_chunked",
                                                 "memo_plan")}  # fmt: skip
    compare = json.loads((out / "40_compare.json").read_text())
    assert {r["method"] for r in compare["runs"]} == {"full", "memo"}
    assert all(r["status"] == "ok" and r["predicted"].get("error") is None for r in compare["runs"])
    calibration = json.loads((out / "40_calibration.json").read_text())
    assert calibration["format"] == "memo-calibration/1" and calibration["device"] == "h100-80g"
    logs = "".join(p.read_text() for p in work.glob("*.log"))
    assert "Traceback" not in logs


def test_gpu_check_runs_the_stages_it_is_given_alone(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    on_the_device(
        tmp_path, "bash", "scripts/gpu_check.sh", OUT=str(out), WORK=str(work), REHEARSAL="1",
        STAGES="install",
    )  # fmt: skip
    lines = [line for line in (out / "stages.txt").read_text().splitlines() if ": " in line]
    ran = [line.split(":")[0] for line in lines if ": ran " in line]
    skipped = [line.split(":")[0] for line in lines if line.endswith(": skipped: not in STAGES")]
    assert ran == ["install"] and skipped == STAGES[1:]


def test_the_7b_comparison_runs_on_two_gpus(tmp_path):
    """scripts/compare_7b_8gpu.sh shrunk by its own arguments: 2 GPUs, a tiny model, two
    methods under TP 2 + SP, two lengths, the longest-length search and the calibration."""
    out = tmp_path / "compare"
    on_the_device(
        tmp_path, "bash", "scripts/compare_7b_8gpu.sh", "--nproc-per-node", "2",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "512", "--loss-chunks", "2", "--memo-keep-last-layers", "1",
        "--methods", "full@tp2", "memo@tp2",
        "--seq-lengths", "512", "1024", "--granularity", "512", "--max-seq-length", "1024",
        "--job-timeout-s", "300", gpus=2, OUT=str(out),
    )  # fmt: skip
    compare = json.loads((out / "compare.json").read_text())
    runs = {(r["method"], r["seq_length"]): r for r in compare["runs"]}
    assert set(runs) == {(m, s) for m in ("full@tp2", "memo@tp2") for s in (512, 1024)}
    for record in runs.values():
        assert record["status"] == "ok", record["message"]
        assert record["layout"]["tp"] == 2 and record["layout"]["sp"]
        assert record["predicted"].get("error") is None, record["predicted"]
        assert "--loss-chunks" in record["command"]
    assert json.loads((out / "calibration.json").read_text())["device"] == "h100-80g"
