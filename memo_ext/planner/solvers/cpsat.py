"""OR-Tools CP-SAT backend: ``AddNoOverlap2D`` over (lifetime x bytes) rectangles.

Lifetimes are fixed intervals on the time axis; offsets are integer variables on the memory axis;
the objective is the peak. The search starts from the canonical branch-and-bound incumbent
(hint and upper bound), and tensors with identical lifetimes and sizes are ordered by offset to
break their symmetry. When the incumbent already meets the lower bound no model is built.

CP-SAT is limited by its deterministic time, not by seconds, and runs one worker (its parallel
portfolio shares solutions as they come, and its interleaved mode overshoots the limit by whole
batches): its result depends on the model and the seed, not on how busy the machine is. It gets
no ``max_time_in_seconds``, which is wall-clock: the planner's CPU-time safety net stops it
through ``stop_search`` instead (``WorkClock.watching``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np

from memo_ext.planner.problem import DsaProblem, lower_bound, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.canonical import solve_canonical
from memo_ext.planner.solvers.work import (
    CPSAT_SETUP_UNITS_PER_TENSOR,
    MODEL_UNITS_PER_TENSOR,
    UNITS_PER_DETERMINISTIC_SECOND,
    charge_cpsat,
)

logger = logging.getLogger(__name__)

QUICK_SHARE, QUICK_UNITS = 0.1, 2.0
"""The first canonical run gets this share of the work, at most this many units."""
CPSAT_SHARE = 0.5
"""CP-SAT's share of the work left after the first canonical run; the second gets the rest.
CP-SAT runs only when its share pays for its setup (``setup_units``) twice."""


def setup_units(problem: DsaProblem) -> float:
    """Work of building a placement model and of CP-SAT's presolve of it."""
    return (MODEL_UNITS_PER_TENSOR + CPSAT_SETUP_UNITS_PER_TENSOR) * problem.n


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


def solve_cpsat_model(problem: DsaProblem, options: SolveOptions, *, bound: int) -> Solution:
    """Runs CP-SAT alone (optionally from ``options.hint``) within the solve's work."""
    from ortools.sat.python import cp_model

    clock = options.start()
    hint = options.hint
    upper = peak_of(problem, hint) if hint is not None else int(problem.sizes.sum())
    model, offset_vars, _ = build_cpsat_model(problem, upper=upper, lower=bound, hint=hint)
    clock.spend(setup_units(problem))
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(
        clock.left() / UNITS_PER_DETERMINISTIC_SECOND, 0.01
    )
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = options.seed
    with clock.watching(solver.stop_search):  # the safety net
        status = solver.solve(model)
    charge_cpsat(clock, solver, finished=status in (cp_model.OPTIMAL, cp_model.INFEASIBLE))
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        offsets = np.asarray([solver.value(v) for v in offset_vars], dtype=np.int64)
        if hint is None or peak_of(problem, offsets) < peak_of(problem, hint):
            hint = offsets
    if hint is None:
        raise RuntimeError("CP-SAT found no placement within its work limit")
    best_bound = max(bound, int(np.ceil(solver.best_objective_bound - 1e-6)))
    return Solution(
        offsets=_symmetry_consistent(problem, hint),
        peak=peak_of(problem, hint),
        optimal=status == cp_model.OPTIMAL or peak_of(problem, hint) <= best_bound,
        solver="cpsat",
        details={"bound": best_bound, "cpsat_status": solver.status_name(status)},
    )


def solve_cpsat(problem: DsaProblem, options: SolveOptions | None = None) -> Solution:
    """Canonical branch and bound, then CP-SAT and the canonical search again, side by side.

    A short canonical run gives CP-SAT its hint and upper bound (and often closes the instance
    at once). Then CP-SAT gets ``CPSAT_SHARE`` of the work left (when that pays for its setup),
    improving the incumbent and raising the lower bound, and the canonical search gets the
    rest, aimed at the lower bound and just below the incumbent; with two workers or more they
    run in two threads. Each stops at its own proof or at its own work limit, never at the
    other's, so the placement kept (the lower peak, CP-SAT's on a tie) is the same whether they
    ran side by side or one after the other, and however long either took in seconds.
    """
    options = options or SolveOptions()
    clock = options.start()
    quick = dataclasses.replace(
        options, clock=clock.share(min(QUICK_UNITS, QUICK_SHARE * clock.left()))
    )
    first = solve_canonical(problem, quick)
    details = {"canonical": first.details}
    if first.optimal or clock.exhausted():
        return Solution(first.offsets, first.peak, first.optimal, "cpsat", details)
    bound = max(lower_bound(problem), first.details.get("bound", 0))
    cp_units = CPSAT_SHARE * clock.left()
    if cp_units < 2 * setup_units(problem):
        cp_units = 0.0
    cp_clock, canonical_clock = clock.detached(cp_units), clock.detached(clock.left() - cp_units)
    results: dict[str, Solution] = {}

    def run_cpsat() -> None:
        cp_options = dataclasses.replace(options, clock=cp_clock, hint=first.offsets)
        results["cpsat"] = solve_cpsat_model(problem, cp_options, bound=bound)

    thread = None
    if cp_units and options.workers > 1:
        thread = threading.Thread(target=run_cpsat, name="cpsat", daemon=True)
        thread.start()
    elif cp_units:
        run_cpsat()
    canonical_options = dataclasses.replace(
        options, clock=canonical_clock, seed=options.seed + 1, hint=first.offsets
    )
    second = solve_canonical(problem, canonical_options)
    if thread is not None:
        thread.join()
    clock.absorb(cp_clock)
    clock.absorb(canonical_clock)
    details["canonical_after"] = second.details
    best = second
    if "cpsat" in results:
        details["cpsat"] = results["cpsat"].details
        bound = max(bound, results["cpsat"].details["bound"])
        if results["cpsat"].peak <= second.peak:
            best = results["cpsat"]
    bound = max(bound, second.details.get("bound", 0))
    return Solution(best.offsets, best.peak, best.optimal or best.peak <= bound, "cpsat", details)
