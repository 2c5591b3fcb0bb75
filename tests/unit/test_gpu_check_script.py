"""``scripts/gpu_check.sh`` on a machine without a GPU (one sentence, nothing run, no files), and
its stage runner sourced: what a stage cut at its limit, skipped for time or failed reports, and
the exit status that says so. The whole check on the emulated GPU:
``tests/emulated/test_rehearsal.py``."""

from __future__ import annotations

import os
import re
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


# the script's functions sourced (nothing of the check runs), stage times unscaled, the steps
# made a sleep: a stage's report, the cut run's line in 30_steps.txt, the closing lines and status
STAGE_RUNNER = """
source scripts/gpu_check.sh
OUT=$1 WORK=$1 TIME_SCALE=1 DEADLINE=$((SECONDS + 60))
: > "$OUT/stages.txt"
: > "$OUT/30_steps.txt"
step() { sleep 30; }
export -f step
stage passing 1 5 true
"""


def _stages(tmp_path, commands: str) -> tuple[int, list[str], str]:
    """``commands`` after the stage runner above, then ``finish``: the status, the lines of
    stages.txt (a stage's seconds written ``Ns``: they depend on the machine's load),
    30_steps.txt."""
    done = subprocess.run(
        ["bash", "-c", STAGE_RUNNER + commands + "\nfinish", "runner", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = (tmp_path / "stages.txt").read_text()
    lines = re.sub(r"(ran|skipped:) \d+s", r"\1 Ns", text).splitlines()
    return done.returncode, lines, (tmp_path / "30_steps.txt").read_text()


@pytest.mark.launch
def test_every_stage_that_ran_and_passed_exits_0(tmp_path):
    status, lines, _ = _stages(tmp_path, 'STAGES="passing" stage left_out 1 5 false')
    assert status == 0
    assert lines == ["passing: ran Ns, exit 0", "left_out: skipped: not in STAGES"]


@pytest.mark.launch
@pytest.mark.slow
def test_a_cut_or_skipped_stage_is_told_and_the_check_exits_3(tmp_path):
    """The cuts of the rehearsal that exited 0: SIGINT at the limit (timeout's 124), SIGKILL
    10 s later for a stage that outlives it (137, where "exit 137" was printed), a training run
    cut before it wrote its lines, a stage left no time."""
    status, lines, steps = _stages(
        tmp_path,
        "stage interrupted 1 2 sleep 30\n"
        "stage stubborn 1 2 bash -c 'trap \"\" INT; sleep 30'\n"
        "step_stage step_memo memo_auto 1 2 --memo\n"
        "stage compare 200 5 true\n",
    )
    assert status == 3
    cut = "cut at its 2s limit"
    skipped = "skipped: Ns left, it needs 200s"
    assert lines == [
        "passing: ran Ns, exit 0",
        f"interrupted: ran Ns, {cut}",
        f"stubborn: ran Ns, {cut}",
        f"step_memo: ran Ns, {cut}",
        f"compare: {skipped}",
        f"gpu_check: INCOMPLETE: interrupted ({cut}), stubborn ({cut}), step_memo ({cut}), "
        f"compare ({skipped})",
    ]
    assert steps == f"[memo_auto] {cut}: no summary (the log so far: {tmp_path}/memo_auto.log)\n"


@pytest.mark.launch
def test_a_failed_stage_is_told_and_the_check_exits_4(tmp_path):
    """A failure outranks a cut: 4 whether or not a stage was also cut or skipped."""
    status, lines, _ = _stages(
        tmp_path, "stage failing 1 5 bash -c 'exit 7'\nstage compare 200 5 true\n"
    )
    assert status == 4
    assert lines == [
        "passing: ran Ns, exit 0",
        "failing: ran Ns, exit 7",
        "compare: skipped: Ns left, it needs 200s",
        "gpu_check: INCOMPLETE: compare (skipped: Ns left, it needs 200s)",
        "gpu_check: FAILED: failing (exit 7)",
    ]
