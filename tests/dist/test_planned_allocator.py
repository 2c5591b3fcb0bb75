"""--memo --memo-allocator plan trains exactly like --memo, with transients at planned offsets.

On CPU the allocator core serves every allocation of the process through the c10 shim, so the
whole path (record, plan, serve, fall back, statistics) runs here as it does on a GPU.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.launch import cli, reference_run, run_pretrain, unserved_steps

MODEL = cli(
    num_layers=5,
    hidden_size=96,
    num_attention_heads=6,
    seq_length=96,
    micro_batch_size=1,
    global_batch_size=4,
    train_iters=6,
    lr="1e-3",
    mock_data=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    memo=True,
    memo_alpha=0.5,
)

LAYOUTS = {
    "one process": (1, []),
    "DP 2": (2, []),
    "TP 2 + SP": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "chunked": (1, ["--memo-chunk-tokens", "40"]),
}


def _plan_peaks(cache) -> list[int]:
    """Rank 0's plans (the metrics file is rank 0's)."""
    return [json.loads(p.read_text())["peak_bytes"] for p in cache.glob("*-rank0.json")]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_planned_allocator_is_exact_and_serves_the_plan(layout, tmp_path, reference_runs):
    nproc, extra = LAYOUTS[layout]
    cache = tmp_path / "plans"
    plain = reference_run([*MODEL, *extra], nproc=nproc, cache_dir=reference_runs)
    planned_flags = [*MODEL, *extra, "--memo-allocator", "plan", "--memo-plan-cache", str(cache)]
    planned = run_pretrain(planned_flags, nproc=nproc, workdir=tmp_path, name="planned")
    for a, b in zip(plain, planned, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["iteration"]
    served = [r for r in planned if r["iteration"] >= 3]
    assert served and unserved_steps(planned) == []
    assert all(r["plan_miss_size"] == r["plan_miss_extra"] == 0 for r in served)
    # the arena is the largest plan's peak (a kind planned again for a late free may grow it),
    # and memory is reported through the core; a record gives the arena its step ran with, and
    # a kind planned again at the end of the last step (its plan_replans counts it) grows the
    # arena only for a step that does not come
    arenas = [r["plan_arena_bytes"] for r in served]
    assert arenas == sorted(arenas)
    if len(served) > 1 and served[-1]["plan_replans"] > served[-2]["plan_replans"]:
        assert arenas[-1] <= max(_plan_peaks(cache))
    else:
        assert arenas[-1] == max(_plan_peaks(cache))
    assert all(r["mem_reserved_bytes"] >= r["plan_arena_bytes"] for r in served)
    # a restart (new processes: the planned run's workers are replaced after it) finds its
    # plans on disk and plans nothing anew: every file is the one saved,
    # untouched, unless a late free in the restart planned its kind again (new content)
    saved = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in cache.glob("*.json")}
    again = run_pretrain(planned_flags, nproc=nproc, workdir=tmp_path, name="again")
    assert set(cache.glob("*.json")) == set(saved)
    for path, (content, stamp) in saved.items():
        assert path.read_bytes() != content or path.stat().st_mtime_ns == stamp, path.name
    assert [r["loss"] for r in again] == [r["loss"] for r in planned]


PLANNING_S = 2.0
"""How long each pass plan takes in :func:`main`'s jobs: far longer than a step of MODEL."""


def main(argv: list[str]) -> int:
    """The trainer with every pass plan taking :data:`PLANNING_S` longer (for this job only)."""
    from memo_ext.memo import planned_memory
    from pretrain_gpt_memo import main as pretrain_main

    plan_sequence = planned_memory.plan_sequence

    def slow_plan_sequence(*args, **kwargs):
        time.sleep(PLANNING_S)
        return plan_sequence(*args, **kwargs)

    planned_memory.plan_sequence = slow_plan_sequence
    try:
        return pretrain_main(argv)
    finally:
        planned_memory.plan_sequence = plan_sequence


def test_planning_is_left_out_of_the_step_time(tmp_path):
    """The step that records and plans reports its planning as plan_time_s; its step time,
    throughput and MFU are its training's alone."""
    flags = [*MODEL, "--train-iters", "3", "--memo-allocator", "plan"]
    flags += ["--memo-plan-cache", str(tmp_path / "plans")]  # empty: every kind is planned
    records = run_pretrain(
        flags, nproc=1, workdir=tmp_path, name="slow", module="tests.dist.test_planned_allocator"
    )
    planning = {r["iteration"]: r["plan_time_s"] for r in records}
    assert planning[1] == 0 and planning[2] >= PLANNING_S, planning
    for r in records:
        # a step of MODEL takes a fraction of a second; a step that kept its planning would
        # take PLANNING_S per pass kind longer
        assert r["step_time_s"] < PLANNING_S, (r["iteration"], r["step_time_s"], planning)
        # MODEL's global batch (4 sequences of 96 tokens) over that time
        assert r["tokens_per_s"] == pytest.approx(4 * 96 / r["step_time_s"])


def test_a_planned_run_logs_one_line_per_pass_plan_and_no_planner_stage_lines(tmp_path):
    import subprocess
    import sys

    from tests.launch import ROOT, alone_env

    flags = [*MODEL, "--train-iters", "3", "--memo-allocator", "plan"]
    flags += ["--memo-plan-cache", str(tmp_path / "plans")]
    run = subprocess.run(
        [sys.executable, "pretrain_gpt_memo.py", *flags], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env=alone_env(),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--memo-allocator plan: pass " in run.stderr
    assert "above the lower bound" not in run.stderr  # the planner's own stage lines
