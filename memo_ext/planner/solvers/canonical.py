"""Branch and bound over canonical placements (the technique of MiniMalloc, ASPLOS'23).

Any placement can be pushed down until every tensor rests on offset 0 or on the top of a tensor
live at the same time. Listing such a placement by increasing offset, each tensor sits at its
*minimum offset*: the highest top among the tensors already placed that are live with it. The
search therefore only chooses an order: at each node it places one unplaced tensor at its
minimum offset, and

* offsets never decrease along a branch (ties broken by a fixed preorder), so every placement is
  reached once (*canonical solutions*);
* a tensor whose minimum offset is at or above the lowest possible top of another unplaced
  tensor is skipped: that other tensor could always be slid under it (*dominance*);
* the time axis is cut into sections (between consecutive event times); a node is cut off when,
  in some section, the floor (top of what is placed there, and at least the current offset) plus
  the sizes of the unplaced tensors live there exceeds the capacity (*spatial inference*). A
  ``[sections, most live]`` table of the tensors live in each section keeps this check to a few
  small numpy operations per node.

Each run is a decision search for one capacity (the lower bound, or just below the incumbent).
Depth-first search can lose itself in one subtree, so runs are restarted with Luby-sequence
node budgets and rotating preorders, alternating between the problem and its time reversal; a
run that ends without a leaf and within its budget proves its capacity infeasible and raises the
lower bound. A run that fails still packed the bottom of the region densely: its deepest partial
placement, completed greedily or by a search of the remaining tensors above it, is often a
better incumbent than the greedy one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from memo_ext.planner.problem import DsaProblem, lower_bound, overlap_pairs, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.greedy import greedy_orders, place_in_order, solve_greedy

logger = logging.getLogger(__name__)

_NO_FLOOR = np.iinfo(np.int64).max
"""Floor marker of a placed tensor or of padding (never the lowest usable offset)."""


class _NodeLimit(Exception):
    """The run used its node budget."""


class _Deadline(Exception):
    """The wall-clock budget is spent."""


@dataclass
class _Sections:
    """Elementary time sections and which ones each tensor covers."""

    lo: np.ndarray
    """``[n]`` first section covered by each tensor."""
    hi: np.ndarray
    """``[n]`` one past the last section covered."""
    total: np.ndarray
    """``[S]`` total size of all tensors live in each section."""


def build_sections(problem: DsaProblem) -> _Sections:
    """Cuts time at every start and end; tensor ``i`` covers sections ``lo[i] .. hi[i] - 1``."""
    times = np.unique(np.concatenate([problem.start, problem.end]))
    lo = np.searchsorted(times, problem.start)
    hi = np.searchsorted(times, problem.end)
    diff = np.zeros(len(times), dtype=np.int64)
    np.add.at(diff, lo, problem.sizes)
    np.add.at(diff, hi, -problem.sizes)
    return _Sections(lo=lo, hi=hi, total=np.cumsum(diff)[:-1])


def live_matrix(sections: _Sections, n: int) -> np.ndarray:
    """``[S, K]`` the tensors live in each section, padded with ``n`` (K: most live at once)."""
    num_sections = len(sections.total)
    counts = np.zeros(num_sections + 1, dtype=np.int64)
    np.add.at(counts, sections.lo, 1)
    np.add.at(counts, sections.hi, -1)
    live = np.full((num_sections, max(int(np.cumsum(counts).max()), 1)), n, dtype=np.int64)
    fill = np.zeros(num_sections, dtype=np.int64)
    for i in np.argsort(sections.lo, kind="stable"):
        span = np.arange(sections.lo[i], sections.hi[i])
        live[span, fill[span]] = i
        fill[span] += 1
    return live


def _features(problem: DsaProblem, sections: _Sections) -> np.ndarray:
    """``[n, 5]`` normalised size, lifetime, sections spanned, crowding and area."""
    length = (problem.end - problem.start).astype(float)
    span = (sections.hi - sections.lo).astype(float)
    # Largest section total the tensor takes part in: how crowded its lifetime is.
    crowd = np.array(
        [sections.total[lo:hi].max() for lo, hi in zip(sections.lo, sections.hi)], dtype=float
    )
    feats = np.stack([problem.sizes.astype(float), length, span, crowd, length * problem.sizes], 1)
    return feats / np.maximum(feats.max(axis=0), 1)


def preorder(sections: _Sections, key: np.ndarray) -> np.ndarray:
    """Rank of each tensor: by start section, then by decreasing ``key``.

    Tensors at the same offset never share a time step, so their placement order is free; going
    left to right in time makes a skipped tensor leave a hole that spatial inference sees at once.
    """
    order = np.lexsort((-key, sections.lo))
    rank = np.empty(len(key), dtype=np.int64)
    rank[order] = np.arange(len(key))
    return rank


def preorders(problem: DsaProblem, sections: _Sections, rng: np.random.Generator) -> list:
    """Fixed tie-breaking keys first (area, crowding, size, span), then random mixtures."""
    feats = _features(problem, sections)
    keys = [feats[:, 4], feats[:, 3], feats[:, 0], feats[:, 2]]
    ranks = [preorder(sections, key) for key in keys]
    while True:
        yield from ranks
        weights = rng.dirichlet(np.ones(feats.shape[1]))
        noise = 1 + 0.1 * rng.random(problem.n)
        ranks = [preorder(sections, (feats @ weights) * noise)]


@dataclass
class CanonicalSearch:
    """Depth-first search over canonical placements of one problem (see the module docstring)."""

    problem: DsaProblem
    """The tensors to place (sizes in any unit)."""
    deadline: float
    """``time.perf_counter()`` value at which searching stops."""
    stop: threading.Event | None = None
    """Set by another thread to stop the search early."""
    sections: _Sections = field(init=False)
    neighbours: list[np.ndarray] = field(init=False)
    nodes: int = 0
    """Nodes visited over all runs."""
    failed: set = field(default_factory=set)
    """Residual states known to have no placement within the current capacity."""
    failed_by_capacity: dict = field(default_factory=dict)
    """``failed`` of the latest capacities searched."""

    def __post_init__(self) -> None:
        self.sections = build_sections(self.problem)
        pairs = overlap_pairs(self.problem)
        both = np.concatenate([pairs, pairs[:, ::-1]])
        both = both[np.argsort(both[:, 0], kind="stable")]
        splits = np.searchsorted(both[:, 0], np.arange(1, self.problem.n))
        self.neighbours = np.split(both[:, 1], splits)
        # crossings[s]: tensors live across the boundary between sections s and s + 1.
        diff = np.zeros(len(self.sections.total) + 1, dtype=np.int64)
        np.add.at(diff, self.sections.lo, 1)
        np.add.at(diff, self.sections.hi - 1, -1)
        self.base_crossings = np.cumsum(diff)[:-1]
        self.live = live_matrix(self.sections, self.problem.n)
        n = self.problem.n
        # Scratch arrays indexed by tensor, with entry n for the padding of ``live``: reset after
        # every use so that a node allocates nothing of size n.
        self._sizes_ext = np.append(self.problem.sizes, 0)
        self._usable_ext = np.full(n + 1, -1, dtype=np.int64)
        self._floor_ext = np.full(n + 1, _NO_FLOOR, dtype=np.int64)
        self._rank_ext = np.full(n + 1, n + 1, dtype=np.int64)
        self._order_ext = np.full(n + 2, n, dtype=np.int64)
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * self.problem.n + 1000))

    def run(
        self,
        *,
        capacity: int,
        rank: np.ndarray,
        node_limit: int,
        fixed: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Looks for a placement with peak <= ``capacity``.

        Args:
            fixed: optional offsets of tensors to keep where they are (``-1``: free); the
                others are searched above them. A run with fixed tensors proves nothing about
                the whole problem.

        Returns:
            The offsets found, or None when the tree holds none (``self.complete`` is then True
            unless tensors were fixed)
            or the node budget ran out (``self.complete`` False).

        Raises:
            _Deadline: when the wall-clock budget ran out.
        """
        n = self.problem.n
        # Failed states are only failures for their capacity; keep the sets of the two latest
        # capacities, since runs alternate between the lower bound and the incumbent.
        if capacity not in self.failed_by_capacity:
            if len(self.failed_by_capacity) >= 2:
                self.failed_by_capacity.pop(next(iter(self.failed_by_capacity)))
            self.failed_by_capacity[capacity] = set()
        self.failed = self.failed_by_capacity[capacity]
        if len(self.failed) > 2_000_000:
            self.failed.clear()
        self.capacity, self.rank, self.node_budget = capacity, rank, node_limit
        self.min_off = np.zeros(n, dtype=np.int64)
        self.offsets = np.full(n, -1, dtype=np.int64)
        self.placed = np.zeros(n, dtype=bool)
        self.total = self.sections.total.copy()
        self.crossings = self.base_crossings.copy()
        self.stack: list[tuple] = []
        self.complete = False
        self.deepest, self.deepest_offsets = 0, self.offsets.copy()
        if fixed is not None:
            for c in np.flatnonzero(fixed >= 0):
                self._place(c, int(fixed[c]))
        try:
            found = self._search(np.arange(n), 0, len(self.total), -1, -1)
        except _NodeLimit:
            return None
        self.complete = not found and fixed is None
        return self.offsets.copy() if found else None

    def complete_deepest(self) -> np.ndarray:
        """The most complete placement of the last run, finished greedily above the rest.

        A run aimed at a tight capacity packs the bottom of the region densely before it gets
        stuck; stacking the tensors it did not reach on top is often far better than a greedy
        placement from scratch.
        """
        partial = self.deepest_offsets
        left = np.flatnonzero(partial < 0)
        best, best_peak = partial, None
        for order in greedy_orders(self.problem.subproblem(left)).values():
            for best_fit in (False, True):
                offsets = place_in_order(
                    self.problem, left[order], best_fit=best_fit, offsets=partial
                )
                peak = peak_of(self.problem, offsets)
                if best_peak is None or peak < best_peak:
                    best, best_peak = offsets, peak
        return best

    def _search(
        self, members: np.ndarray, s_lo: int, s_hi: int, last_off: int, last_rank: int
    ) -> bool:
        """Places the unplaced tensors of ``members`` (living in sections ``[s_lo, s_hi)``)."""
        self.nodes += 1
        self.node_budget -= 1
        if self.node_budget < 0:
            raise _NodeLimit
        if self.nodes % 64 == 0 and (
            time.perf_counter() > self.deadline or (self.stop is not None and self.stop.is_set())
        ):
            raise _Deadline
        unplaced = members[~self.placed[members]]
        if len(unplaced) == 0:
            return True
        sizes = self.problem.sizes
        mo = self.min_off[unplaced]
        # Tensors the canonical order forbids at their minimum offset go at least one unit up.
        allowed = (mo > last_off) | ((mo == last_off) & (self.rank[unplaced] > last_rank))
        # The residual problem depends only on what is left, where it can go and which tensors
        # the order still allows at ``last_off``; a state that failed once fails again (the same
        # partition is often revisited unchanged while the search backtracks elsewhere). Naming
        # the allowed tensors rather than the last rank keeps the key valid across preorders.
        key = (s_lo, last_off, unplaced.tobytes(), mo.tobytes(), allowed.tobytes())
        if key in self.failed:
            return False
        usable = np.where(allowed, mo, last_off + 1)
        if not self._sections_fit(unplaced, usable, s_lo, s_hi):
            self.failed.add(key)
            return False
        min_height = (mo + sizes[unplaced]).min()
        # Whatever is placed next sits at or below every later offset, so the fullest section
        # must still fit above it: offset + total[s] <= capacity.
        highest = self.capacity - self.total[s_lo:s_hi].max()
        ok = allowed & (mo < min_height) & (mo <= highest)
        cands = unplaced[ok]
        for c in cands[np.lexsort((self.rank[cands], self.min_off[cands]))]:
            off = int(self.min_off[c])
            mark = len(self.stack)
            self._place(c, off)
            cuts = self._new_cuts(c, s_lo, s_hi)
            if len(cuts) == 0:
                found = self._search(unplaced, s_lo, s_hi, off, int(self.rank[c]))
            else:
                found = self._search_parts(unplaced, [s_lo, *cuts, s_hi])
            if found:
                return True
            self._undo_to(mark)
        self.failed.add(key)
        return False

    def _sections_fit(self, unplaced: np.ndarray, usable: np.ndarray, s_lo: int, s_hi: int) -> bool:
        """Spatial inference, section by section.

        A tensor that can go no lower than ``u`` shares the bytes above ``u`` with every tensor
        of its section that can go no lower either: ``u`` plus their sizes must fit the capacity.
        The lowest ``u`` of a section with everything left there (its floor plus its remaining
        total) is checked first: it is cheap and cuts most nodes.
        """
        live = self.live[s_lo:s_hi]  # [S', K] tensors live in each section, n-padded
        floor_ext = self._floor_ext
        floor_ext[unplaced] = usable
        floor = np.minimum(floor_ext[live].min(axis=1), self.capacity)
        floor_ext[unplaced] = _NO_FLOOR
        if (floor + self.total[s_lo:s_hi]).max() > self.capacity:
            return False
        # Rank the unplaced tensors by decreasing usable offset once; sorting each section's
        # ranks then lists its tensors in that order (placed ones and padding last, size 0).
        order = unplaced[np.argsort(-usable, kind="stable")]
        rank_ext, order_ext, usable_ext = self._rank_ext, self._order_ext, self._usable_ext
        rank_ext[order] = np.arange(len(order))
        order_ext[: len(order)] = order
        usable_ext[unplaced] = usable
        by_usable = order_ext[np.sort(rank_ext[live], axis=1)]
        need = usable_ext[by_usable] + np.cumsum(self._sizes_ext[by_usable], axis=1)
        rank_ext[order] = len(rank_ext)
        order_ext[: len(order)] = len(rank_ext) - 1
        usable_ext[unplaced] = -1
        return bool(need.max() <= self.capacity)

    def _new_cuts(self, c: int, s_lo: int, s_hi: int) -> np.ndarray:
        """Section boundaries inside ``[s_lo, s_hi)`` that no unplaced tensor crosses any more."""
        lo, hi = self.sections.lo[c], self.sections.hi[c]
        cuts = np.flatnonzero(self.crossings[lo : hi - 1] == 0) + lo + 1
        return cuts[(cuts > s_lo) & (cuts < s_hi)]

    def _search_parts(self, unplaced: np.ndarray, bounds: list[int]) -> bool:
        """Solves independent time partitions one after another; all must succeed.

        The partitions share no unplaced tensor and no section, so each restarts the canonical
        order at offset 0. On failure the caller undoes every placement made here.
        """
        rest = unplaced[~self.placed[unplaced]]
        lo, hi = self.sections.lo[rest], self.sections.hi[rest]
        for a, b in zip(bounds[:-1], bounds[1:]):
            part = rest[(lo < b) & (hi > a)]
            if len(part) and not self._search(part, a, b, -1, -1):
                return False
        return True

    def _place(self, c: int, off: int) -> None:
        size = self.problem.sizes[c]
        top = off + size
        nb = self.neighbours[c]
        raised = nb[(self.min_off[nb] < top) & ~self.placed[nb]]
        self.stack.append((c, raised, self.min_off[raised]))
        self.min_off[raised] = top
        lo, hi = self.sections.lo[c], self.sections.hi[c]
        self.total[lo:hi] -= size
        self.crossings[lo : hi - 1] -= 1
        self.placed[c] = True
        self.offsets[c] = off
        if len(self.stack) > self.deepest:
            self.deepest, self.deepest_offsets = len(self.stack), self.offsets.copy()

    def _undo_to(self, mark: int) -> None:
        """Reverts placements, latest first, until ``mark`` remain."""
        while len(self.stack) > mark:
            c, raised, old_min = self.stack.pop()
            lo, hi = self.sections.lo[c], self.sections.hi[c]
            self.total[lo:hi] += self.problem.sizes[c]
            self.crossings[lo : hi - 1] += 1
            self.min_off[raised] = old_min
            self.placed[c] = False
            self.offsets[c] = -1


def time_reversed(problem: DsaProblem) -> DsaProblem:
    """The problem played backwards: the same conflicts, so the same placements are valid.

    The canonical search sweeps time left to right; on the reversed problem it makes other
    early decisions, and its run time on an instance is often very different.
    """
    horizon = int(problem.end.max())
    return DsaProblem(sizes=problem.sizes, start=horizon - problem.end, end=horizon - problem.start)


def luby(i: int) -> int:
    """The ``i``-th term (from 1) of the Luby sequence 1, 1, 2, 1, 1, 2, 4, 1, 1, 2, ...

    Restarting with run lengths proportional to it is within a log factor of the best fixed
    cutoff for any heavy-tailed run-time distribution (Luby, Sinclair and Zuckerman, 1993).
    """
    k = i.bit_length()  # the smallest k with 2**k - 1 >= i
    if i == (1 << k) - 1:
        return 1 << (k - 1)
    return luby(i - (1 << (k - 1)) + 1)


def _finish_partial(
    search: CanonicalSearch, ranks, best_peak: int, record: int, *, node_limit: int
) -> tuple[np.ndarray, int]:
    """A full placement from the deepest partial placement of the run that just failed.

    The partial is completed greedily; when it is the deepest seen so far (``record`` tensors),
    the tensors it leaves are also searched above it, aiming just below the incumbent.

    Returns:
        The better completion and the new record depth.
    """
    partial, depth = search.deepest_offsets, search.deepest
    offsets = search.complete_deepest()
    if depth > record and peak_of(search.problem, offsets) >= best_peak:
        found = search.run(
            capacity=best_peak - 1, rank=next(ranks), node_limit=node_limit, fixed=partial
        )
        if found is not None:
            offsets = found
    return offsets, max(record, depth)


def _schedule(
    problem: DsaProblem,
    searches: list[CanonicalSearch],
    best: np.ndarray,
    bound: int,
    *,
    seed: int,
    improve: bool,
) -> tuple:
    """Many short decision runs (their run times are heavy-tailed), with rotating preorders.

    Each round aims at the lower bound (tightest pruning; the optimum on packable instances)
    and, with ``improve``, a little (1/16 of the gap) below the incumbent. Rounds alternate
    between the searches (the problem forwards and backwards in time). A run that ends without
    a placement and without hitting its node budget proves its target infeasible. The budget
    doubles every few rounds so that proofs become possible.
    """
    rng = np.random.default_rng(seed)
    ranks = [preorders(search.problem, search.sections, rng) for search in searches]
    best_peak = peak_of(problem, best)
    base_nodes, runs, rounds, record = 4 * problem.n + 64, 0, 0, 0
    node_limit = base_nodes
    search = searches[0]
    try:
        while best_peak > bound:
            k = rounds % len(searches)
            search = searches[k]
            # Just below the incumbent a placement is usually easy to find: steady progress.
            targets = {bound, best_peak - 1 - (best_peak - bound) // 16} if improve else {bound}
            for target in sorted(targets):
                if target >= best_peak:
                    continue
                offsets = search.run(capacity=target, rank=next(ranks[k]), node_limit=node_limit)
                runs += 1
                complete = search.complete  # before any run above a partial placement
                if offsets is None and not complete:
                    offsets, record = _finish_partial(
                        search, ranks[k], best_peak, record, node_limit=base_nodes
                    )
                if offsets is not None and peak_of(problem, offsets) < best_peak:
                    best, best_peak = offsets, peak_of(problem, offsets)
                    logger.debug("canonical: peak %d after %d nodes", best_peak, search.nodes)
                elif complete:
                    bound = target + 1
            rounds += 1
            node_limit = base_nodes * luby(rounds // len(searches) + 1)
    except _Deadline:
        # The interrupted run's partial placement may still beat the incumbent.
        offsets = search.complete_deepest()
        if peak_of(problem, offsets) < best_peak:
            best, best_peak = offsets, peak_of(problem, offsets)
    nodes = sum(search.nodes for search in searches)
    details = {"runs": runs, "nodes": nodes, "node_limit": node_limit}
    return best, bound, best_peak <= bound, details


def solve_canonical(
    problem: DsaProblem,
    options: SolveOptions | None = None,
    *,
    stop: threading.Event | None = None,
    improve: bool = True,
) -> Solution:
    """Minimises the peak by canonical branch and bound, from a greedy incumbent.

    Args:
        problem: the tensors to place.
        options: time limit, seed and optional hint.
        stop: optional event another thread sets to end the search early.
        improve: also aim just below the incumbent; without it every run aims at the lower
            bound (when another solver takes care of improving the incumbent).
    """
    options = options or SolveOptions()
    deadline = time.perf_counter() + options.time_limit_s
    best = solve_greedy(problem).offsets
    if options.hint is not None and peak_of(problem, options.hint) < peak_of(problem, best):
        best = np.asarray(options.hint, dtype=np.int64)
    bound = lower_bound(problem)
    searches = [
        CanonicalSearch(problem=p, deadline=deadline, stop=stop)
        for p in (problem, time_reversed(problem))
    ]
    best, bound, proven, details = _schedule(
        problem, searches, best, bound, seed=options.seed, improve=improve
    )
    details["bound"] = int(bound)
    return Solution(
        offsets=best,
        peak=peak_of(problem, best),
        optimal=proven,
        solver="canonical",
        details=details,
    )
