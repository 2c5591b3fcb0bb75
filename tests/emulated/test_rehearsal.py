"""Dress rehearsal: the GPU scripts run whole, as a user starts them, on the emulated device
(``python -m memo_ext.simulate.run``): every Python process they start has the GPU, ``nvidia-smi``
answers for it. Values are fake; what is checked is that every stage reaches its end and writes
its files, with nothing crashing, hanging, misplacing a tensor or breaking an ordering rule."""

from __future__ import annotations

import json
import os
import re
import socket
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
RUNS = {
    "step_full": "full_recompute", "step_memo": "memo_auto", "step_memo_chunked": "memo_chunked",
    "step_memo_plan": "memo_plan",
}  # fmt: skip
"""The training run of each step stage (its name in 30_steps.*)."""
COMPARE_FILES = {"40_compare.txt", "40_compare.json", "40_calibration.json"}
FILES = {
    "stages.txt", "10_install.log", "20_gpu_tests.log", "30_steps.txt", "30_steps.jsonl",
    *COMPARE_FILES,
}  # fmt: skip
REHEARSAL_BUDGET_S = 3 * 360
"""The rehearsal's BUDGET_S: TIME_SCALE (3) × the GPU's 6 minutes."""
UNFINISHED = re.compile(r"ran \d+s, cut at its \d+s limit|skipped: \d+s left, it needs \d+s")
"""What a stage the machine's load left unfinished reports (load, not a defect)."""


def on_the_device(
    tmp_path, *command: str, gpus: int = 1, statuses: tuple[int, ...] = (0,), **env: str
) -> tuple[int, str]:
    """Runs ``command`` under ``python -m memo_ext.simulate.run``: its exit status (one of
    ``statuses``) and output."""
    base = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    base.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore", **env)
    done = subprocess.run(
        [sys.executable, "-m", "memo_ext.simulate.run", "--gpus", str(gpus), "--", *command],
        cwd=ROOT, env=base, capture_output=True, text=True, timeout=REHEARSAL_BUDGET_S + 120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode in statuses, output[-6000:]
    return done.returncode, output


def test_gpu_check_reaches_the_end_of_every_stage(tmp_path):
    """Every stage runs to exit 0, and its files say what it did. The rehearsal's times are
    3 × a GPU's, room for a busy 2-core machine; a machine slower still may leave a stage cut at
    its limit or skipped for time: it must say so (and the check exit 3, listing it as
    INCOMPLETE), and what finished is still checked. A stage that crashes exits non-zero and
    fails this test (the check exits 4)."""
    out, work = tmp_path / "out", tmp_path / "work"
    status, _ = on_the_device(
        tmp_path, "bash", "scripts/gpu_check.sh", OUT=str(out), WORK=str(work), REHEARSAL="1",
        statuses=(0, 3),
    )  # fmt: skip
    stages = (out / "stages.txt").read_text()
    assert "NVIDIA H100 80GB HBM3" in stages and "MEMO host budget" in stages
    reports = dict(
        line.split(": ", 1) for line in stages.splitlines() if line.split(":")[0] in STAGES
    )
    assert list(reports) == STAGES, stages
    finished = [name for name in STAGES if reports[name].endswith(", exit 0")]
    unfinished = [name for name in STAGES if name not in finished]
    for name in unfinished:
        assert UNFINISHED.fullmatch(reports[name]), stages
    incomplete = [line for line in stages.splitlines() if line.startswith("gpu_check: INCOMP")]
    if unfinished:
        # "ran 80s, cut at its 75s limit" is listed as "cut at its 75s limit"
        why = {name: re.sub(r"^ran \d+s, ", "", reports[name]) for name in unfinished}
        listed = ", ".join(f"{name} ({why[name]})" for name in unfinished)
        assert status == 3 and incomplete == [f"gpu_check: INCOMPLETE: {listed}"], stages
    else:
        assert status == 0 and incomplete == [], stages
    assert "FAILED" not in stages

    expected = FILES if "compare" in finished else FILES - COMPARE_FILES
    assert {p.name for p in out.iterdir()} == expected  # at most 8 files come back
    runs = {}
    for line in (out / "30_steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        runs.setdefault(record["run"], []).append(record["iteration"])
    steps = (out / "30_steps.txt").read_text()
    for stage, run in RUNS.items():
        if stage in finished:
            assert runs.pop(run) == [1, 2, 3]
            assert "Traceback" not in (work / f"{run}.log").read_text()
        elif reports[stage].startswith("ran "):  # cut: its line in 30_steps.txt says so
            assert f"[{run}] cut at its " in steps
    cut = {RUNS[stage] for stage in unfinished if stage in RUNS}
    assert set(runs) <= cut  # no records of a run that did not start
    if "compare" in finished:
        compare = json.loads((out / "40_compare.json").read_text())
        assert {r["method"] for r in compare["runs"]} == {"full", "memo"}
        assert all(
            r["status"] == "ok" and r["predicted"].get("error") is None for r in compare["runs"]
        )
        calibration = json.loads((out / "40_calibration.json").read_text())
        assert calibration["format"] == "memo-calibration/1"
        assert calibration["device"] == "h100-80g"


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


SLURM = ROOT / "tests" / "emulated" / "slurm"
"""Stand-in ``srun`` (one task per node, all on this machine) and ``scontrol``."""
SHRUNK = [
    "--methods", "full@tp2cp2", "memo@tp2cp2", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--vocab-size", "512", "--loss-chunks", "2",
    "--memo-keep-last-layers", "1", "--seq-lengths", "512", "--granularity", "512",
    "--max-seq-length", "512", "--job-timeout-s", "600",
]  # fmt: skip
"""The 13B on 16 GPUs of the script, shrunk to 2 layers of width 64 on 2 × 2 GPUs."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_compare_multinode_trains_on_two_nodes_and_a_resubmission_resumes(tmp_path):
    """``scripts/compare_multinode.sbatch`` started as SLURM starts it, on this machine: the
    stand-in ``srun`` runs one torchrun per node (2 nodes × 2 emulated GPUs, c10d rendezvous on
    the first node's address). The first submission's time budget ends after its first job (full
    recomputation); the resubmission, another job id, finds the results where the first left
    them (the script's default folder under the submission's) and runs only MEMO, then the
    search's end and the calibration."""
    out = tmp_path / "runs" / "compare_multinode"
    env = dict(
        PATH=os.pathsep.join([str(SLURM), str(Path(sys.executable).parent), os.environ["PATH"]]),
        SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="2",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", PORT=str(_free_port()),
    )  # fmt: skip
    script = ("bash", str(ROOT / "scripts" / "compare_multinode.sbatch"), *SHRUNK)
    _, first = on_the_device(
        tmp_path, *script, "--time-budget-s", "1", gpus=2, SLURM_JOB_ID="101", **env
    )
    results = json.loads((out / "compare.json").read_text())
    assert [(r["method"], r["status"]) for r in results["runs"]] == [("full@tp2cp2", "ok")], first
    assert results["find_max"]["full@tp2cp2"]["bound"] == "not finished"
    command = results["runs"][0]["command"]
    assert command[:7] == ["srun", "--nodes", "2", "--ntasks-per-node", "1",
                           "--kill-on-bad-exit=1", sys.executable], command  # fmt: skip
    assert command[command.index("--nnodes") + 1] == "2"
    assert command[command.index("--rdzv-endpoint") + 1] == f"127.0.0.1:{env['PORT']}"
    full_log = out / results["runs"][0]["log"]
    assert "world 4 = TP 2 × CP 2 × PP 1 × DP 1 + SP" in full_log.read_text()
    written = full_log.stat().st_mtime_ns

    _, second = on_the_device(tmp_path, *script, gpus=2, SLURM_JOB_ID="102", **env)
    results = json.loads((out / "compare.json").read_text())
    runs = {r["method"]: r for r in results["runs"]}
    assert {m: r["status"] for m, r in runs.items()} == {"full@tp2cp2": "ok", "memo@tp2cp2": "ok"}
    assert "memo@tp2cp2 @ 512: ok" in second and "full@tp2cp2 @ 512: ok" not in second, second
    assert full_log.stat().st_mtime_ns == written  # the finished job did not run again
    assert "world 4 = TP 2 × CP 2" in (out / runs["memo@tp2cp2"]["log"]).read_text()
    assert runs["memo@tp2cp2"]["measured"]["memo_alpha"] is not None
    for search in results["find_max"].values():
        assert search["longest"] == 512, results["find_max"]
    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["format"] == "memo-calibration/1" and calibration["device"] == "h100-80g"
