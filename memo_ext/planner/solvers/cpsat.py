"""OR-Tools CP-SAT backend: ``AddNoOverlap2D`` over (lifetime x bytes) rectangles.

Lifetimes are fixed intervals on the time axis; offsets are integer variables on the memory axis;
the objective is the peak. The search starts from the canonical branch-and-bound incumbent
(hint and upper bound), and tensors with identical lifetimes and sizes are ordered by offset to
break their symmetry. When the incumbent already meets the lower bound no model is built.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from memo_ext.planner.problem import DsaProblem, lower_bound, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.canonical import solve_canonical

logger = logging.getLogger(__name__)


def _symmetric_groups(problem: DsaProblem) -> list[np.ndarray]:
    """Groups of tensors with the same start, end and size (interchangeable)."""
    keys = np.stack([problem.start, problem.end, problem.sizes], axis=1)
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    return [np.flatnonzero(inverse == g) for g in np.flatnonzero(counts > 1)]


def build_cpsat_model(problem: DsaProblem, *, upper: int, lower: int, hint: np.ndarray | None):
    """Returns ``(model, offset_vars, peak_var)`` for peaks in ``[lower, upper]``."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    peak = model.new_int_var(lower, upper, "peak")
    offsets, x_intervals, y_intervals = [], [], []
    for i in range(problem.n):
        size, start, end = (int(v[i]) for v in (problem.sizes, problem.start, problem.end))
        offset = model.new_int_var(0, upper - size, f"o{i}")
        offsets.append(offset)
        x_intervals.append(model.new_fixed_size_interval_var(start, end - start, f"t{i}"))
        y_intervals.append(model.new_fixed_size_interval_var(offset, size, f"m{i}"))
        model.add(offset + size <= peak)
    model.add_no_overlap_2d(x_intervals, y_intervals)
    for group in _symmetric_groups(problem):
        for a, b in zip(group[:-1], group[1:]):
            model.add(offsets[a] + int(problem.sizes[a]) <= offsets[b])
    if hint is not None:
        for var, value in zip(offsets, _symmetry_consistent(problem, hint)):
            model.add_hint(var, int(value))
        model.add_hint(peak, peak_of(problem, hint))
    model.minimize(peak)
    return model, offsets, peak


def _symmetry_consistent(problem: DsaProblem, offsets: np.ndarray) -> np.ndarray:
    """Reorders interchangeable tensors' offsets so the hint obeys the symmetry breaking."""
    offsets = np.asarray(offsets, dtype=np.int64).copy()
    for group in _symmetric_groups(problem):
        offsets[group] = np.sort(offsets[group])
    return offsets


def solve_cpsat_model(
    problem: DsaProblem, options: SolveOptions, *, bound: int, running: list | None = None
) -> Solution:
    """Runs CP-SAT alone (optionally from ``options.hint``) within the time limit.

    Args:
        running: when given, the ``CpSolver`` is appended to it so another thread can call
            ``stop_search()``.
    """
    from ortools.sat.python import cp_model

    entered = time.perf_counter()
    hint = options.hint
    upper = peak_of(problem, hint) if hint is not None else int(problem.sizes.sum())
    model, offset_vars, _ = build_cpsat_model(problem, upper=upper, lower=bound, hint=hint)
    solver = cp_model.CpSolver()
    # the model's construction (seconds on large traces) counts against the limit too
    left = options.time_limit_s - (time.perf_counter() - entered)
    solver.parameters.max_time_in_seconds = max(left, 0.01)
    solver.parameters.num_workers = max(options.workers, 1)
    solver.parameters.random_seed = options.seed
    if running is not None:
        running.append(solver)
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        offsets = np.asarray([solver.value(v) for v in offset_vars], dtype=np.int64)
        if hint is None or peak_of(problem, offsets) < peak_of(problem, hint):
            hint = offsets
    if hint is None:
        raise RuntimeError("CP-SAT found no placement within the time limit")
    best_bound = max(bound, int(np.ceil(solver.best_objective_bound - 1e-6)))
    return Solution(
        offsets=_symmetry_consistent(problem, hint),
        peak=peak_of(problem, hint),
        optimal=status == cp_model.OPTIMAL or peak_of(problem, hint) <= best_bound,
        solver="cpsat",
        details={"bound": best_bound, "cpsat_status": solver.status_name(status)},
    )


def solve_cpsat(problem: DsaProblem, options: SolveOptions | None = None) -> Solution:
    """Canonical branch and bound and CP-SAT side by side; the first proof stops both.

    A short canonical run gives CP-SAT its hint and upper bound (and often closes the instance
    at once). Then CP-SAT runs in a thread (it releases the GIL) with one worker fewer than
    asked, improving the incumbent, while the canonical search keeps restarting in this thread,
    aimed at the lower bound and just below its incumbent; whichever proves optimality stops
    the other, and the lower peak wins.
    """
    options = options or SolveOptions()
    t0 = time.perf_counter()
    quick = SolveOptions(
        time_limit_s=min(2.0, 0.1 * options.time_limit_s), seed=options.seed, hint=options.hint
    )
    first = solve_canonical(problem, quick)
    if first.optimal:
        return Solution(first.offsets, first.peak, True, "cpsat", {"canonical": first.details})
    left = options.time_limit_s - (time.perf_counter() - t0)
    bound = max(lower_bound(problem), first.details.get("bound", 0))
    cp_options = SolveOptions(
        time_limit_s=left,
        workers=max(options.workers - 1, 1),
        seed=options.seed,
        hint=first.offsets,
    )
    running: list = []
    results: dict = {}
    stop = threading.Event()

    def run_cpsat() -> None:
        results["cpsat"] = solve_cpsat_model(problem, cp_options, bound=bound, running=running)
        if results["cpsat"].optimal:
            stop.set()

    thread = threading.Thread(target=run_cpsat, daemon=True)
    thread.start()
    second = solve_canonical(
        problem,
        SolveOptions(time_limit_s=left, seed=options.seed + 1, hint=first.offsets),
        stop=stop,
        improve=True,
    )
    if running:  # the canonical search is done (proof or deadline): CP-SAT stops too
        running[0].stop_search()
    thread.join()
    best = min([second, results.get("cpsat", second)], key=lambda s: s.peak)
    details = {"canonical": second.details, "cpsat": results.get("cpsat", second).details}
    optimal = best.optimal or best.peak <= max(
        second.details.get("bound", 0), details["cpsat"].get("bound", 0)
    )
    return Solution(best.offsets, best.peak, optimal, "cpsat", details)
