"""Solver backends for the DSA problem, behind one function.

``solve_dsa(problem, solver=..., options=...)`` works in the problem's units: it divides sizes
by their common divisor, splits the tensors into groups that never meet in time, solves each
group with the chosen backend (a group the greedy already packs at its lower bound is done),
and stacks nothing: groups never conflict, so each starts at offset 0. Before the backend
searches a whole group, the group is cut along its flat levels (``levels``) and the pieces
placed one by one; when that meets the lower bound the group is done.

Every limit is work counted in work units (``work``), not seconds: a plan does not depend on
how busy the machine is. ``options.time_limit_s`` is only a safety net, in CPU seconds.

Backends:
    cpsat: canonical branch and bound, then OR-Tools CP-SAT from its incumbent beside more of
        the canonical search (default).
    canonical: canonical branch and bound alone (MiniMalloc-style, compiled with numba).
    highs: big-M MIP in HiGHS (its limit is the work left read as seconds: HiGHS has no work
        limit, so its plans depend on load).
    gurobi: big-M MIP in Gurobi (needs gurobipy and a licence).
    heuristic: greedy best-fit over several orders (no dependencies, milliseconds).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from memo_ext.planner.problem import DsaProblem, lower_bound, peak_of, size_unit, time_components
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.canonical import solve_canonical
from memo_ext.planner.solvers.cpsat import solve_cpsat
from memo_ext.planner.solvers.greedy import GREEDY_SHARE, solve_greedy
from memo_ext.planner.solvers.gurobi import import_gurobi, solve_gurobi
from memo_ext.planner.solvers.highs import solve_highs
from memo_ext.planner.solvers.levels import solve_by_levels
from memo_ext.planner.solvers.work import WorkClock, greedy_units

logger = logging.getLogger(__name__)

SOLVERS: dict[str, Callable[[DsaProblem, SolveOptions], Solution]] = {
    "cpsat": solve_cpsat,
    "canonical": solve_canonical,
    "highs": solve_highs,
    "gurobi": solve_gurobi,
    "heuristic": solve_greedy,
}

__all__ = ["SOLVERS", "Solution", "SolveOptions", "solve_dsa"]

LEVELS_SHARE = 0.25
"""Fraction of a group's work the level-by-level attempt may spend before the backend."""
PLACEMENTS_PER_STAGE = 3
"""The level-by-level stage runs only with work for this many greedy placements of its group:
it places the group at least once whatever its share, which at 20,000 tensors takes seconds."""
BACKEND_PLACEMENTS = 12
"""The backend runs only with work for this many placements: before its work limit starts to
bind it places the group and builds its search state (the canonical search's sections, forwards
and backwards in time), together about that much work, which its limit cannot interrupt."""


def _scaled(problem: DsaProblem, unit: int) -> DsaProblem:
    return DsaProblem(sizes=problem.sizes // unit, start=problem.start, end=problem.end)


def _solve_groups(
    problem: DsaProblem, groups: list[np.ndarray], solver: str, options: SolveOptions
) -> tuple[np.ndarray, bool, dict]:
    """Greedy on every group, then the backend on groups above the overall lower bound, all
    within the solve's work (the greedy pass takes at most ``GREEDY_SHARE`` of it, or all of it
    for the heuristic backend)."""
    clock = options.start()
    started = time.perf_counter()
    greedy = clock.share(clock.left() * (1.0 if solver == "heuristic" else GREEDY_SHARE))
    offsets = np.zeros(problem.n, dtype=np.int64)
    target = lower_bound(problem)
    hard = []
    for k, group in enumerate(groups):
        sub = problem.subproblem(group)
        share = greedy.share(greedy.left() / (len(groups) - k))
        first = solve_greedy(sub, SolveOptions(clock=share))
        offsets[group] = first.offsets
        if first.peak > target:
            hard.append(group)
    proven = not hard
    details: dict = {"groups": len(groups), "hard_groups": len(hard)}
    _log_progress("greedy", offsets, problem, target, clock, started)
    if solver == "heuristic" or not hard:
        return offsets, proven or peak_of(problem, offsets) == target, details
    proven = True
    backend = SOLVERS[solver]
    for k, group in enumerate(sorted(hard, key=len)):
        share = clock.left() / (len(hard) - k)
        sub = problem.subproblem(group)
        placement = greedy_units(sub)
        # every stage places the group at least once and the exact backends build search
        # state of about that cost: with less work than that the group keeps its greedy
        # placement, so the work limit holds
        if share < BACKEND_PLACEMENTS * placement or clock.overdue():
            details["out_of_work"] = details.get("out_of_work", 0) + 1
            proven = False
            continue
        stage = clock.share(share)
        if options.levels and LEVELS_SHARE * share >= PLACEMENTS_PER_STAGE * placement:
            placed = _solve_levels(
                sub, backend, options, capacity=target, clock=stage.share(LEVELS_SHARE * share)
            )
            details.setdefault("levels", []).append(placed is not None)
            if placed is not None:
                offsets[group] = placed
                continue
        hint = offsets[group] if options.hint is None else options.hint[group]
        result = backend(sub, dataclasses.replace(options, clock=stage, hint=hint))
        if peak_of(sub, result.offsets) <= peak_of(sub, offsets[group]):
            offsets[group] = result.offsets
        proven &= result.optimal or result.peak <= target
        details.setdefault("backend", []).append(result.details)
        _log_progress(f"group {k + 1} of {len(hard)}", offsets, problem, target, clock, started)
    return offsets, proven or peak_of(problem, offsets) == target, details


def _log_progress(stage, offsets, problem, target, clock, started) -> None:
    """One line per stage of a long plan (INFO; every stage of a large one is seconds long)."""
    logger.info(
        "%s: %d tensors, %.2f%% above the lower bound, %.1f of %.0f work units (%.1f s)",
        stage,
        problem.n,
        100 * (peak_of(problem, offsets) / max(target, 1) - 1),
        clock.spent,
        clock.limit,
        time.perf_counter() - started,
    )


def _solve_levels(
    problem: DsaProblem,
    backend: Callable[[DsaProblem, SolveOptions], Solution],
    options: SolveOptions,
    *,
    capacity: int,
    clock: WorkClock,
) -> np.ndarray | None:
    """Level by level within ``capacity``; each leaf by greedy, then by the backend."""

    def leaf(piece: DsaProblem, room: int, leaf_clock: WorkClock) -> np.ndarray:
        greedy = SolveOptions(clock=leaf_clock.share(GREEDY_SHARE * leaf_clock.left()))
        first = solve_greedy(piece, greedy)
        if first.peak <= room:
            return first.offsets
        piece_options = dataclasses.replace(
            options, clock=leaf_clock, hint=first.offsets, levels=False
        )
        return backend(piece, piece_options).offsets

    return solve_by_levels(problem, leaf, capacity=capacity, clock=clock, seed=options.seed)


def solve_dsa(
    problem: DsaProblem, *, solver: str = "cpsat", options: SolveOptions | None = None
) -> Solution:
    """Places every tensor of ``problem`` with the chosen backend.

    Args:
        problem: tensors with aligned sizes and lifetimes.
        solver: one of ``SOLVERS``.
        options: work limit, CPU-time safety net, workers, seed and optional hint (offsets
            in problem units).

    Returns:
        Offsets in the problem's units, the peak and whether it is proven optimal; its details
        hold the work spent (``work_units``) and, when the safety net stopped a search,
        ``safety_net_cut``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if solver == "gurobi":
        import_gurobi()  # fail now, with what to do, rather than after the greedy pass
    options = options or SolveOptions()
    if problem.n == 0:
        return Solution(np.zeros(0, dtype=np.int64), 0, True, solver)
    unit = size_unit(problem)
    scaled = _scaled(problem, unit)
    hint = None if options.hint is None else np.asarray(options.hint, dtype=np.int64)
    if hint is not None and not (hint % unit).any():
        hint = hint // unit
    else:
        hint = None  # A hint off the size grid cannot be expressed in the scaled units.
    clock = options.start()
    options = dataclasses.replace(options, hint=hint, clock=clock)
    offsets, proven, details = _solve_groups(scaled, time_components(scaled), solver, options)
    offsets = offsets * unit
    peak = peak_of(problem, offsets)
    details["work_units"] = round(clock.spent, 3)
    if clock.cut:
        details["safety_net_cut"] = True
    logger.debug("%s: peak %d (lower bound %d)", solver, peak, lower_bound(problem))
    return Solution(offsets, peak, proven or peak == lower_bound(problem), solver, details)
