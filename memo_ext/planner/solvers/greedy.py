"""Dependency-free greedy placement: fast, and the first incumbent of the exact backends.

Tensors are placed one by one in a chosen order; each goes into a gap between the tensors already
placed that are live at the same time. Several orders (by size, by size x lifetime, by lifetime)
and two gap rules (lowest gap, tightest gap) are tried and the lowest peak kept.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from memo_ext.planner.problem import DsaProblem, lower_bound, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.work import greedy_units

GREEDY_SHARE = 0.2
"""Fraction of a solve's work a greedy incumbent may take (it stops between orders)."""


def _gap_offset(lo: np.ndarray, hi: np.ndarray, size: int, best_fit: bool) -> int:
    """Offset for ``size`` bytes among occupied ``[lo, hi)`` ranges sorted by ``lo``."""
    if len(lo) == 0:
        return 0
    top = np.maximum.accumulate(hi)
    gap_start = np.concatenate([[0], top])
    gap_end = np.concatenate([lo, [np.iinfo(np.int64).max]])
    fits = np.nonzero(gap_end - gap_start >= size)[0]
    if not best_fit or len(fits) == 1:
        return int(gap_start[fits[0]])
    bounded = fits[:-1]
    # The tightest bounded gap wastes least; fall back to the top of the stack.
    k = bounded[np.argmin(gap_end[bounded] - gap_start[bounded])]
    return int(gap_start[k])


def place_in_order(
    problem: DsaProblem,
    order: np.ndarray,
    *,
    best_fit: bool = False,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """Places tensors in ``order``, each at the lowest (or tightest) gap that fits it.

    Args:
        offsets: optional partial placement to complete (``-1`` marks a tensor to place); the
            tensors it already places stay where they are.
    """
    if offsets is None:
        offsets = np.full(problem.n, -1, dtype=np.int64)
    offsets = np.array(offsets, dtype=np.int64)
    placed = offsets >= 0
    for i in order:
        live = placed & (problem.start < problem.end[i]) & (problem.end > problem.start[i])
        nb = np.nonzero(live)[0]
        nb = nb[np.argsort(offsets[nb], kind="stable")]
        lo = offsets[nb]
        offsets[i] = _gap_offset(lo, lo + problem.sizes[nb], int(problem.sizes[i]), best_fit)
        placed[i] = True
    return offsets


def greedy_orders(problem: DsaProblem) -> dict[str, np.ndarray]:
    """The orders tried by the greedy backend, by name."""
    length = problem.end - problem.start
    return {
        "size": np.lexsort((-length, -problem.sizes)),
        "area": np.lexsort((-problem.sizes, -problem.sizes * length)),
        "length": np.lexsort((-problem.sizes, -length)),
        "start": np.lexsort((-problem.sizes, problem.start)),
    }


def solve_greedy(problem: DsaProblem, options: SolveOptions | None = None) -> Solution:
    """Best of the greedy orders and gap rules; optimal only when it meets the lower bound.

    Each placement costs O(n²) on n tensors (seconds at 20,000): with ``options`` the orders
    stop when the work left is less than one more placement, the first one always placed.
    """
    clock = options.start() if options is not None else None
    cost = greedy_units(problem)
    best, best_name = None, ""
    tries = [
        (name, order, fit)
        for name, order in greedy_orders(problem).items()
        for fit in (False, True)
    ]
    for name, order, best_fit in tries:
        if best is not None and clock is not None and (clock.left() < cost or clock.overdue()):
            break
        offsets = place_in_order(problem, order, best_fit=best_fit)
        if clock is not None:
            clock.spend(cost)
        if best is None or peak_of(problem, offsets) < peak_of(problem, best):
            best, best_name = offsets, f"{name}/{'best' if best_fit else 'first'}-fit"
    peak = peak_of(problem, best)
    return Solution(
        offsets=best,
        peak=peak,
        optimal=peak == lower_bound(problem),
        solver="heuristic",
        details={"order": best_name},
    )


def mip_start(
    problem: DsaProblem, hint: np.ndarray | None, options: SolveOptions
) -> tuple[np.ndarray, int, int]:
    """Start of the big-M MIP backends: the better of the greedy placement (within
    ``GREEDY_SHARE`` of the solve's work) and ``hint``, with its peak (an upper bound) and the
    live-total lower bound."""
    clock = options.start()
    share = dataclasses.replace(options, clock=clock.share(GREEDY_SHARE * clock.left()))
    start = solve_greedy(problem, share).offsets
    if hint is not None and peak_of(problem, hint) < peak_of(problem, start):
        start = np.asarray(hint, dtype=np.int64)
    return start, peak_of(problem, start), lower_bound(problem)
