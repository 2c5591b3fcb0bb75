"""The dynamic storage allocation (DSA) problem behind a trace, and its lower bound.

Given tensors with sizes and fixed lifetimes, choose byte offsets so that no two tensors that are
live at the same time overlap, minimising the peak ``max(offset + size)``. Sizes are rounded up to
the alignment, which makes every offset built from sums of sizes aligned and loses nothing: an
aligned neighbour of a tensor of size ``s`` can never start before ``align_up(s)`` bytes above it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from math import gcd

import numpy as np

from memo_ext.planner.trace import Trace


def align_up(size: int | np.ndarray, alignment: int) -> int | np.ndarray:
    """Rounds ``size`` up to a multiple of ``alignment``."""
    return -(-size // alignment) * alignment


@dataclass
class DsaProblem:
    """Tensors with sizes and half-open lifetimes ``[start, end)``; sizes already aligned."""

    sizes: np.ndarray
    """``[n]`` int64 aligned sizes (bytes, or any unit)."""
    start: np.ndarray
    """``[n]`` int64 first time the tensor is live."""
    end: np.ndarray
    """``[n]`` int64 first time the tensor is no longer live (``end > start``)."""

    @property
    def n(self) -> int:
        """Number of tensors."""
        return len(self.sizes)

    def subproblem(self, index: np.ndarray) -> DsaProblem:
        """The problem restricted to the tensors ``index``."""
        return DsaProblem(sizes=self.sizes[index], start=self.start[index], end=self.end[index])


def problem_from_trace(trace: Trace, *, alignment: int = 1) -> tuple[list[str], DsaProblem]:
    """Returns the trace's tensor ids and its DSA problem with sizes rounded to ``alignment``."""
    if alignment < 1:
        raise ValueError(f"alignment must be a positive number of bytes, got {alignment}")
    life = trace.lifetimes()
    # A tensor freed right after its alloc still occupies its bytes for that instant.
    end = np.maximum(life.end, life.start + 1)
    problem = DsaProblem(sizes=align_up(life.sizes, alignment), start=life.start, end=end)
    return life.ids, problem


def live_totals(problem: DsaProblem) -> tuple[np.ndarray, np.ndarray]:
    """Returns the distinct start times and the total size live at each of them.

    The live total only grows at a start time, so its maximum over these points is its maximum
    over all time.
    """
    times = np.unique(problem.start)
    delta_times = np.concatenate([problem.start, problem.end])
    deltas = np.concatenate([problem.sizes, -problem.sizes])
    order = np.argsort(delta_times, kind="stable")
    sorted_times = delta_times[order]
    running = np.cumsum(deltas[order])
    # Live total at time t = sum of all deltas at times <= t.
    last = np.searchsorted(sorted_times, times, side="right") - 1
    return times, running[last]


def lower_bound(problem: DsaProblem) -> int:
    """The largest total size live at one time: no plan can peak below it."""
    if problem.n == 0:
        return 0
    return int(live_totals(problem)[1].max())


def compress_times(problem: DsaProblem) -> DsaProblem:
    """The same problem on the fewest distinct times: every overlap kept, none added.

    List every end and start by time, ends first on ties (lifetimes are half-open). Cut the
    list before each end that follows a start: each piece, some ends then some starts, becomes
    one time. A tensor's end comes after its start in the list, and within a piece ends come
    first, so it still ends after it starts; and ``s_i < e_j`` holds exactly when ``i``'s start
    is listed before ``j``'s end, which the pieces keep. So a placement of one problem is a
    placement of the other. What changes: in a trace, where every event has its own time,
    frees and the allocs that follow them fall on one time, as they do in the program.
    """
    times = np.concatenate([problem.end, problem.start])
    is_start = np.concatenate([np.zeros(problem.n, dtype=bool), np.ones(problem.n, dtype=bool)])
    order = np.lexsort((is_start, times))
    listed = is_start[order]
    piece = np.empty(2 * problem.n, dtype=np.int64)
    piece[order] = np.cumsum(np.concatenate([[False], ~listed[1:] & listed[:-1]]))
    return DsaProblem(sizes=problem.sizes, start=piece[problem.n :], end=piece[: problem.n])


def peak_of(problem: DsaProblem, offsets: np.ndarray) -> int:
    """Peak ``max(offset + size)`` of a placement (0 for an empty problem)."""
    if problem.n == 0:
        return 0
    return int((np.asarray(offsets, dtype=np.int64) + problem.sizes).max())


def size_unit(problem: DsaProblem) -> int:
    """Greatest common divisor of the sizes: solvers can work in these units."""
    unit = 0
    for size in np.unique(problem.sizes):
        unit = gcd(unit, int(size))
    return max(unit, 1)


def overlap_pairs(problem: DsaProblem) -> np.ndarray:
    """Returns the ``[p, 2]`` pairs ``i < j`` of tensors whose lifetimes intersect."""
    order = np.argsort(problem.start, kind="stable")
    start, end = problem.start[order], problem.end[order]
    first = np.arange(problem.n) + 1
    # Sorted by start, tensor a overlaps exactly the tensors a+1 .. b_end-1 that start before
    # it ends.
    b_end = np.searchsorted(start, end, side="left")
    counts = np.maximum(b_end - first, 0)
    a = np.repeat(np.arange(problem.n), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    i, j = order[a], order[a + 1 + within]
    return np.stack([np.minimum(i, j), np.maximum(i, j)], axis=1).astype(np.int64)


def overlap_count(problem: DsaProblem) -> int:
    """How many pairs of tensors are live at the same time (``len(overlap_pairs)``), in
    O(n log n): tensor ``i`` meets every tensor starting before its end, less those that ended
    by its start."""
    starts, ends = np.sort(problem.start), np.sort(problem.end)
    meets = np.searchsorted(starts, problem.end, side="left") - np.searchsorted(
        ends, problem.start, side="right"
    )
    return int((meets.sum() - problem.n) // 2)


def find_conflicts(problem: DsaProblem, offsets: np.ndarray) -> np.ndarray:
    """Returns the ``[c, 2]`` pairs of tensors live at the same time whose byte ranges overlap."""
    offsets = np.asarray(offsets, dtype=np.int64)
    pairs = overlap_pairs(problem)
    i, j = pairs[:, 0], pairs[:, 1]
    clash = (offsets[i] < offsets[j] + problem.sizes[j]) & (
        offsets[j] < offsets[i] + problem.sizes[i]
    )
    return pairs[clash]


def first_conflict(problem: DsaProblem, offsets: np.ndarray) -> tuple[int, int] | None:
    """A pair of tensors live at the same time whose byte ranges overlap, or ``None``.

    A sweep over time: O(n log n) plus a list insertion per tensor, where :func:`find_conflicts`
    enumerates every pair of overlapping lifetimes (tens of millions in a dense trace). While no
    conflict is found the live ranges are disjoint, so a new range overlaps one of them exactly
    when it overlaps its neighbour below or above in offset order.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    # frees (kind 0) before allocations (kind 1) at one instant: [start, end) lifetimes
    lives = [i for i in range(problem.n) if problem.start[i] < problem.end[i]]
    events = sorted(
        [(int(problem.end[i]), 0, i) for i in lives]
        + [(int(problem.start[i]), 1, i) for i in lives]
    )
    live: list[tuple[int, int]] = []  # (offset, tensor), sorted
    for _, kind, i in events:
        key = (int(offsets[i]), i)
        if kind == 0:
            del live[bisect.bisect_left(live, key)]
            continue
        at = bisect.bisect_left(live, key)
        low, high = int(offsets[i]), int(offsets[i]) + int(problem.sizes[i])
        if at > 0:
            below = live[at - 1][1]
            if offsets[below] + problem.sizes[below] > low:
                return min(below, i), max(below, i)
        if at < len(live) and live[at][0] < high:
            return min(live[at][1], i), max(live[at][1], i)
        live.insert(at, key)
    return None


def time_components(problem: DsaProblem) -> list[np.ndarray]:
    """Splits tensors into groups separated by instants where nothing crosses.

    Groups never conflict with each other, so each can be placed on its own from offset 0.
    """
    if problem.n == 0:
        return []
    order = np.argsort(problem.start, kind="stable")
    reach = np.maximum.accumulate(problem.end[order])
    # A new group starts where the next tensor begins at or after everything before has ended.
    breaks = np.nonzero(problem.start[order][1:] >= reach[:-1])[0] + 1
    return [np.sort(group) for group in np.split(order, breaks)]
