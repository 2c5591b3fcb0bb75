"""Placing a problem level by level: cutting it where its live total allows, before searching.

Many problems are stacks of flat levels: a set of tensors whose live total is the same at every
instant of the span, with the rest resting on it. Perfectly packable problems are built that
way, and so are iterations of a training step (weights below, each layer's activations above).
A branch and bound over the whole problem does not see these levels and can lose itself far
from the optimum; cut along them, a few hundred tensors fall apart into pieces of a handful.

The cuts, applied recursively:

* **time components**: tensors that never meet an instant crossed by no tensor are
  independent (exact);
* **floors**: a tensor live over its component's whole span goes to the bottom (exact: every
  other tensor of the component lies wholly below or above it, so swapping it below those
  under it keeps the placement valid);
* **levels**: the smallest set of tensors whose live total is constant over the span, found by
  CP-SAT, goes below the rest. This is a guess: it loses nothing when the set packs into its
  constant height and the rest into what is left, which the recursion checks.

``solve_by_levels`` returns a placement only when every piece fits its share of the target,
so a placement it returns meets the target; otherwise it returns None and the caller searches
the whole problem as before. Leaves (pieces no cut splits) go to a solver the caller passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from memo_ext.planner.problem import DsaProblem, compress_times, lower_bound, time_components
from memo_ext.planner.solvers.work import (
    MODEL_UNITS_PER_TENSOR,
    UNITS_PER_DETERMINISTIC_SECOND,
    WorkClock,
    charge_cpsat,
)

logger = logging.getLogger(__name__)

LeafSolver = Callable[[DsaProblem, int, WorkClock], np.ndarray]
"""``(problem, capacity, clock) -> offsets``: a placement of a piece no cut splits, within the
work of ``clock``."""

LEVEL_UNITS = 1.0
"""Work one level search may take at most."""


class _Miss(Exception):
    """A piece did not fit its share of the target, or the work ran out."""


MAX_TABLE_SIDE = 16
"""Tensors starting (or ending) at one time up to which that time's balanced subsets are listed."""
MAX_TABLE_ROWS = 4096
"""Balanced subsets listed at one time at most (identical sizes multiply them)."""


def _subset_sums(sizes: list[int]) -> np.ndarray:
    """The sum of every subset of ``sizes``, at index ``m`` for the subset of the set bits of m."""
    sums = np.zeros(1, dtype=np.int64)
    for size in sizes:
        sums = np.concatenate([sums, sums + size])
    return sums


def balanced_subsets(gained: list[int], lost: list[int], *, limit: int) -> np.ndarray | None:
    """Every choice among tensors starting (``gained``) and ending (``lost``) at one time whose
    chosen sizes balance, as 0/1 rows over ``gained + lost``; None if there are over ``limit``.

    Each side's subset sums are listed (meet in the middle) and equal sums are paired.
    """
    if max(len(gained), len(lost)) > MAX_TABLE_SIDE:
        return None
    up, down = _subset_sums(gained), _subset_sums(lost)
    up_order, down_order = np.argsort(up, kind="stable"), np.argsort(down, kind="stable")
    up_sorted, down_sorted = up[up_order], down[down_order]
    common = np.intersect1d(up_sorted, down_sorted)
    up_lo, up_hi = (np.searchsorted(up_sorted, common, side=side) for side in ("left", "right"))
    down_lo, down_hi = (
        np.searchsorted(down_sorted, common, side=side) for side in ("left", "right")
    )
    if int(((up_hi - up_lo) * (down_hi - down_lo)).sum()) > limit:
        return None
    rows = [
        np.stack(np.meshgrid(up_order[a:b], down_order[c:d])).reshape(2, -1).T
        for a, b, c, d in zip(up_lo, up_hi, down_lo, down_hi)
    ]
    masks = np.concatenate(rows)
    bits_up = (masks[:, :1] >> np.arange(len(gained))) & 1
    bits_down = (masks[:, 1:] >> np.arange(len(lost))) & 1
    return np.concatenate([bits_up, bits_down], axis=1)


def find_level(
    problem: DsaProblem, *, clock: WorkClock | None = None, seed: int = 0
) -> np.ndarray | None:
    """The smallest proper subset whose live total is the same at every instant of the span.

    The live total of a subset is constant exactly when, at every event time after the first,
    the sizes of its tensors that start there equal the sizes of those that end there: one
    sparse equality per event time, over one boolean per tensor. Equalities over many large
    sizes are subset-sum problems that CP-SAT's propagation barely prunes, so where few tensors
    start and end, the balanced choices are also listed as a table constraint
    (``balanced_subsets``); with them a level of a 400-tensor problem is found in a fraction
    of a second where the equalities alone found none in 20 s.

    Args:
        problem: tensors forming one time component.
        clock: CP-SAT's work (its deterministic time; ``LEVEL_UNITS`` when absent); the smallest
            subset found by then is returned.
        seed: CP-SAT's random seed.

    Returns:
        A boolean mask with at least one tensor and not all of them, or None when there is no
        such subset (or none was found in time).
    """
    from ortools.sat.python import cp_model

    n = problem.n
    if n < 2:
        return None
    model = cp_model.CpModel()
    chosen = [model.new_bool_var(f"x{i}") for i in range(n)]
    first, last = int(problem.start.min()), int(problem.end.max())
    height = model.new_int_var(1, max(lower_bound(problem) - 1, 1), "height")
    sizes = problem.sizes.tolist()
    starting: dict[int, list[int]] = {}
    ending: dict[int, list[int]] = {}
    for i, (t0, t1) in enumerate(zip(problem.start.tolist(), problem.end.tolist())):
        starting.setdefault(t0, []).append(i)
        ending.setdefault(t1, []).append(i)
    for t in sorted(set(starting) | set(ending)):
        if t == last:
            continue
        gained, lost = starting.get(t, []), ending.get(t, [])
        change = sum(sizes[i] * chosen[i] for i in gained) - sum(sizes[i] * chosen[i] for i in lost)
        model.add(change == (height if t == first else 0))
        if t == first:
            continue
        table = balanced_subsets(
            [sizes[i] for i in gained], [sizes[i] for i in lost], limit=MAX_TABLE_ROWS
        )
        if table is not None:
            model.add_allowed_assignments([chosen[i] for i in gained + lost], table.tolist())
    model.add(sum(chosen) <= n - 1)
    model.minimize(sum(chosen))
    clock = clock or WorkClock.start(LEVEL_UNITS)
    clock.spend(MODEL_UNITS_PER_TENSOR * n)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(
        clock.left() / UNITS_PER_DETERMINISTIC_SECOND, 0.01
    )
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    with clock.watching(solver.stop_search):  # the safety net, in CPU time
        status = solver.solve(model)
    charge_cpsat(clock, solver, finished=status in (cp_model.OPTIMAL, cp_model.INFEASIBLE))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return np.asarray([solver.value(x) for x in chosen], dtype=bool)


def solve_by_levels(
    problem: DsaProblem,
    leaf: LeafSolver,
    *,
    capacity: int,
    clock: WorkClock,
    seed: int = 0,
) -> np.ndarray | None:
    """A placement within ``capacity`` built level by level, or None.

    Args:
        problem: the tensors to place.
        leaf: places a piece no cut splits within a capacity and a clock (it may return a
            placement above the capacity; the piece then counts as a miss).
        capacity: the peak every piece must fit under (usually the lower bound).
        clock: the work of the whole attempt.
        seed: seed of the level searches.

    Returns:
        Offsets with peak at most ``capacity``, or None when some piece missed its share or the
        work ran out.
    """
    # In a trace, a free and the alloc after it are one event apart; on one time they can
    # replace each other in a level.
    problem = compress_times(problem)
    stats = {"levels": 0, "leaves": 0, "largest_leaf": 0}

    def place(index: np.ndarray, room: int) -> np.ndarray:
        """Offsets (relative) of ``problem``'s tensors ``index`` within ``room`` bytes."""
        offsets = np.zeros(len(index), dtype=np.int64)
        sub = problem.subproblem(index)
        for component in time_components(sub):
            start, end = sub.start[component], sub.end[component]
            floor = (start == start.min()) & (end == end.max())
            if not floor.any():
                offsets[component] = place_level(index[component], room)
                continue
            below = np.cumsum(sub.sizes[component[floor]])
            if below[-1] > room:
                raise _Miss
            offsets[component[floor]] = below - sub.sizes[component[floor]]
            rest = component[~floor]
            if len(rest):
                offsets[rest] = below[-1] + place(index[rest], room - int(below[-1]))
        return offsets

    def place_level(index: np.ndarray, room: int) -> np.ndarray:
        """One time component with no floor: a level below the rest, or a leaf."""
        sub = problem.subproblem(index)
        if lower_bound(sub) > room:
            raise _Miss
        if clock.exhausted():
            raise _Miss
        level = find_level(sub, clock=clock.share(LEVEL_UNITS), seed=seed)
        if level is not None:
            stats["levels"] += 1
            height = lower_bound(sub.subproblem(np.flatnonzero(level)))
            offsets = np.zeros(len(index), dtype=np.int64)
            offsets[level] = place(index[level], height)
            offsets[~level] = height + place(index[~level], room - height)
            return offsets
        stats["leaves"] += 1
        stats["largest_leaf"] = max(stats["largest_leaf"], len(index))
        left = clock.left()
        offsets = leaf(sub, room, clock.share(max(min(left, 0.1), left * len(index) / problem.n)))
        if (offsets + sub.sizes).max() > room:
            raise _Miss
        return offsets

    try:
        offsets = place(np.arange(problem.n), capacity)
    except _Miss:
        logger.debug("levels: no placement within %d (%s)", capacity, stats)
        return None
    logger.debug("levels: placement within %d (%s)", capacity, stats)
    return offsets
