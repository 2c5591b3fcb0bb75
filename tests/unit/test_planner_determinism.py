"""Plans do not depend on the machine's load: the planner counts work, it does not time it."""

import logging
import multiprocessing
import threading
import time

import numpy as np
import pytest

from memo_ext.planner import PlannerConfig, plan_trace, validate
from memo_ext.planner.packable import packable_instance
from memo_ext.planner.solvers import greedy
from memo_ext.planner.solvers.work import WorkClock
from memo_ext.planner.trace import trace_from_intervals


def _hard_trace():
    """A 200-piece rectangle whose pieces share few times: neither the levels nor a short
    search close it, so the work limit is what ends the search."""
    problem, _ = packable_instance(num_buffers=200, seed=1, duration=30)
    return trace_from_intervals(
        [
            (f"b{i}", int(s), int(e), int(z))
            for i, (s, e, z) in enumerate(zip(problem.start, problem.end, problem.sizes))
        ]
    )


CONFIG = {"work_limit": 1.5, "bilevel": False, "alignment": 1}


@pytest.fixture(scope="module")
def quiet_plan():
    trace = _hard_trace()
    plan = plan_trace(trace, config=PlannerConfig(**CONFIG))
    # the work limit, not a proof, ended it: the case the wall clock used to decide
    assert plan.status != "optimal"
    assert plan.extra["deterministic"] and 1.5 <= plan.extra["work_units"] < 2.5
    return trace, plan


def _spin():
    while True:
        pass


def test_a_busy_machine_gets_the_same_plan(quiet_plan):
    trace, quiet = quiet_plan
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(3)]
    for spinner in spinners:
        spinner.start()
    try:
        busy = plan_trace(trace, config=PlannerConfig(**CONFIG))
    finally:
        for spinner in spinners:
            spinner.kill()
    assert busy.offsets == quiet.offsets
    assert busy.extra["work_units"] == quiet.extra["work_units"]
    assert busy.extra["deterministic"]


def test_stalls_anywhere_in_the_search_change_nothing(quiet_plan, monkeypatch):
    # every greedy placement (in every stage: incumbents, completions of partial placements)
    # made slow at random, as a loaded machine makes it
    import time

    trace, quiet = quiet_plan
    rng = np.random.default_rng(0)
    place = greedy.place_in_order

    def stalled(*args, **kwargs):
        time.sleep(float(rng.uniform(0, 0.02)))
        return place(*args, **kwargs)

    for module in ("greedy", "canonical"):
        monkeypatch.setattr(f"memo_ext.planner.solvers.{module}.place_in_order", stalled)
    assert plan_trace(trace, config=PlannerConfig(**CONFIG)).offsets == quiet.offsets


def test_one_worker_or_two_make_the_same_plan(quiet_plan):
    trace, quiet = quiet_plan
    for workers in (1, 3):
        plan = plan_trace(trace, config=PlannerConfig(**CONFIG, workers=workers))
        assert plan.offsets == quiet.offsets


def test_the_safety_net_cuts_the_search_and_says_so(caplog):
    trace = _hard_trace()
    # searched whole (the levels close it with this much work), and for longer than allowed
    config = PlannerConfig(**{**CONFIG, "work_limit": 600.0}, time_limit_s=0.5, levels=False)
    with caplog.at_level(logging.WARNING, logger="memo_ext.planner.planning"):
        plan = plan_trace(trace, config=config)
    validate(trace, plan)
    assert plan.extra["deterministic"] is False
    assert plan.extra["work_units"] < 600
    assert any("safety net" in r.getMessage() for r in caplog.records)


def test_work_clocks_share_what_is_left_and_charge_upwards():
    root = WorkClock.start(10.0)
    stage = root.share(4.0)
    stage.spend(1.5)
    assert (stage.left(), root.left()) == (2.5, 8.5)
    assert root.share(100.0).limit == 8.5  # never more than is left
    assert root.share(0.0, floor=0.5).limit == 0.5  # unless a floor is asked for
    side = root.detached(3.0)
    side.spend(2.0)
    assert root.left() == 8.5  # a detached stage is charged only when absorbed
    root.absorb(side)
    assert root.left() == 6.5 and not root.cut
    late = WorkClock.start(10.0, time_limit_s=-1.0)
    child = late.share(5.0)
    assert child.exhausted() and late.cut and child.cut
    root.absorb(_cut_clock())
    assert root.cut


def _cut_clock() -> WorkClock:
    clock = WorkClock.start(1.0, time_limit_s=-1.0)
    assert clock.overdue()
    return clock


def test_a_cpsat_solve_stopped_by_the_safety_net_marks_the_plan_cut():
    from types import SimpleNamespace

    from memo_ext.planner.solvers.work import UNITS_PER_DETERMINISTIC_SECOND, charge_cpsat

    def solver(used):
        limits = SimpleNamespace(max_deterministic_time=1.0)
        return SimpleNamespace(deterministic_time=used, parameters=limits)

    # stopped short of its deterministic limit, past the deadline, not finished: the safety net
    late = WorkClock.start(10.0, time_limit_s=-1.0)
    charge_cpsat(late, solver(0.25), finished=False)
    assert late.cut and late.spent == 0.25 * UNITS_PER_DETERMINISTIC_SECOND
    # a proof, or a solve that used its whole limit, says nothing of the wall clock
    for used, finished in ((0.25, True), (1.0, False)):
        clock = WorkClock.start(10.0, time_limit_s=-1.0)
        charge_cpsat(clock, solver(used), finished=finished)
        assert not clock.cut
    # before the deadline nothing is cut whatever stopped it
    early = WorkClock.start(10.0)
    charge_cpsat(early, solver(0.25), finished=False)
    assert not early.cut


class _FakeCpu:
    """A CPU clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_safety_net_reads_the_cpu_clock_of_every_stage():
    cpu = _FakeCpu()
    root = WorkClock.start(10.0, time_limit_s=2.0, cpu=cpu)
    stage, side = root.share(5.0), root.detached(3.0)
    cpu.now = 1.5
    assert not stage.exhausted() and not side.overdue() and root.seconds_left() == 0.5
    cpu.now = 2.5  # the stages read the root's clock: past the deadline for all of them
    assert side.overdue() and not root.cut  # a detached stage's cut waits for ``absorb``
    assert stage.exhausted() and root.cut and root.seconds_left() == 0.0
    root.absorb(side)
    assert root.cut


def test_the_safety_net_counts_cpu_seconds_not_seconds_waited():
    clock = WorkClock.start(1.0, time_limit_s=0.2)  # the default clock: this process's CPU
    time.sleep(0.5)  # a machine busy elsewhere: time passes, this process gets no CPU
    assert not clock.overdue() and not clock.cut
    end = time.process_time() + 0.3
    while time.process_time() < end:  # the process itself computing
        pass
    assert clock.overdue() and clock.cut


def test_a_watched_backend_is_stopped_once_the_cpu_clock_is_past_the_deadline():
    cpu = _FakeCpu()
    clock = WorkClock.start(10.0, time_limit_s=1.0, cpu=cpu)
    stops = []
    with clock.watching(lambda: stops.append(cpu.now), every_s=0.001):
        time.sleep(0.05)  # the backend running, the clock short of the deadline
        assert not stops
        cpu.now = 2.0
        deadline = time.monotonic() + 10
        while len(stops) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    # stopped, and again at each reading while the body ran (a stop before a backend starts
    # is lost); none after it
    count = len(stops)
    assert count >= 2 and clock.cut
    time.sleep(0.02)
    assert len(stops) == count
    # no deadline, no watcher thread
    threads = threading.active_count()
    with WorkClock.start(10.0).watching(lambda: stops.append(-1.0), every_s=0.001):
        assert threading.active_count() == threads


def test_cpsat_is_stopped_by_the_cpu_safety_net_not_a_wall_clock_limit(monkeypatch):
    from ortools.sat.python import cp_model

    from memo_ext.planner.problem import peak_of
    from memo_ext.planner.solvers.base import SolveOptions
    from memo_ext.planner.solvers.cpsat import solve_cpsat_model

    problem, _ = packable_instance(num_buffers=200, seed=1, duration=30)
    hint = greedy.solve_greedy(problem).offsets
    cpu = _FakeCpu()
    clock = WorkClock.start(30.0, time_limit_s=1.0, cpu=cpu)
    wall_limits = []
    real_solve = cp_model.CpSolver.solve

    def solve(self, model, *args, **kwargs):
        # the CPU clock passes the deadline while CP-SAT runs
        wall_limits.append(self.parameters.max_time_in_seconds)
        threading.Timer(0.2, lambda: setattr(cpu, "now", 5.0)).start()
        return real_solve(self, model, *args, **kwargs)

    monkeypatch.setattr(cp_model.CpSolver, "solve", solve)
    result = solve_cpsat_model(problem, SolveOptions(clock=clock, hint=hint), bound=0)
    assert wall_limits == [float("inf")]  # CP-SAT's default: no wall-clock limit
    assert clock.cut and result.details["cpsat_status"] != "OPTIMAL"
    # stopped long before its deterministic limit (about 30 units' worth)
    assert clock.spent < 0.5 * 30.0
    assert peak_of(problem, result.offsets) <= peak_of(problem, hint)
