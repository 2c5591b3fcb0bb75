"""``memo-compare`` end to end on CPU, as a user runs it (the installed command, from a folder
outside the repository): none, full and MEMO on a tiny model
at three lengths and the longest under a memory cap, real torchrun jobs, an out-of-memory run
recorded as a row, a JSON file with predicted and measured figures, a plot, a calibration, and a
second invocation that reruns nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memo_ext.hardware import read_calibration

pytestmark = [pytest.mark.dist, pytest.mark.launch, pytest.mark.slow]

# 8 thin layers and 64 sequences: activations large next to the FLOPs, so one cap separates the
# methods. With this cap (growth of each process's data segment, RLIMIT_DATA) no recomputation
# trains 128 tokens but not 256 (measured here: it needs about 0.18 and 0.28 GiB), full
# recomputation and MEMO at α 0 (the last layer offloaded too) train 256 in about 0.1 GiB.
ARGS = [
    *("--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2"),
    *("--vocab-size", "128", "--micro-batch-size", "64", "--memo-keep-last-layers", "0"),
    *("--methods", "none", "full", "memo:alpha=0", "--seq-lengths", "64", "128", "256"),
    *("--find-max", "--granularity", "128", "--max-seq-length", "256"),
    *("--memory-limit-gb", "0.23", "--measure-steps", "1", "--job-timeout-s", "300"),
]


def _compare(out, *extra: str) -> subprocess.CompletedProcess:
    command = Path(sys.executable).with_name("memo-compare")
    cmd = [str(command), *ARGS, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    elsewhere = out.parent  # not the repository: the jobs' trainer is the installed one
    assert not (elsewhere / "pretrain_gpt_memo.py").exists()
    return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)


def test_compare_methods_on_cpu(tmp_path):
    out, calibration = tmp_path / "cmp", tmp_path / "calibration.json"
    proc = _compare(out, "--calibrate", str(calibration))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    data = json.loads((out / "compare.json").read_text())
    runs = {(r["method"], r["seq_length"]): r for r in data["runs"]}
    assert set(runs) == {(m, s) for m in ("none", "full", "memo:alpha=0") for s in (64, 128, 256)}

    oom = runs[("none", 256)]
    assert (oom["status"], oom["exit_status"]) == ("oom", 3)
    assert oom["requested_bytes"] > 0 and "out of memory" in oom["message"]
    for key in [("none", 128), ("full", 256), ("memo:alpha=0", 256)]:
        assert runs[key]["status"] == "ok", runs[key]["message"]
    assert _row(proc.stdout, "none", "256")[:3] == ["none", "256", "OOM"]  # a row, no traceback

    for run in data["runs"]:  # predicted and measured side by side, for every run
        assert run["predicted"]["step_time_s"] > 0 and "peak_memory_bytes" in run["predicted"]
        assert {"step_time_s", "mfu", "peak_rss_bytes"} <= set(run["measured"])
        assert run["deterministic"]["dtype"] == "fp32"
        if run["status"] == "ok":
            assert run["measured"]["step_time_s"] > 0 and run["measured"]["mfu"] > 0
            assert run["calibrated"]["step_time_s"] > 0
    # "peak mem meas" is the allocator's peak from a run's metrics, which CPU runs do not record:
    # no process's resident set (imported libraries and all) stands in for it
    assert all(run["measured"].get("peak_memory_bytes") is None for run in data["runs"])
    assert "CPU runs record none" in proc.stdout
    # MEMO's host bytes: what the run copied equals what the fake-tensor trace says it copies
    memo = runs[("memo:alpha=0", 128)]
    assert memo["measured"]["host_offload_bytes"] == memo["deterministic"]["host_bytes"] > 0
    assert data["find_max"]["none"] == {"longest": 128, "bound": "256 does not train"}
    assert data["find_max"]["full"]["longest"] == 256

    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert read_calibration(str(calibration)).source == "fit"

    logs = {p: p.stat().st_mtime_ns for p in (out / "jobs").glob("*.log")}
    again = _compare(out)  # resumed: every configuration is on file, no job runs
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in (out / "jobs").glob("*.log")} == logs
    assert _row(again.stdout, "none", "256") == _row(proc.stdout, "none", "256")
    assert json.loads((out / "compare.json").read_text())["calibration"]["source"] == "fit"


def _row(table: str, method: str, seq: str) -> list[str]:
    return next(r for r in map(str.split, table.splitlines()) if r[:2] == [method, seq])
