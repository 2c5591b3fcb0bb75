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
* a tensor the order forbids at its minimum offset must be lifted onto a neighbour placed
  later, so it can go no lower than the lowest top such a neighbour can reach; with no unplaced
  neighbour left it can never be placed and the node fails (MiniMalloc's *hatless pruning*,
  tightened);
* the time axis is cut into sections (between consecutive event times); a node is cut off when,
  in some section, the floor (top of what is placed there, and at least the current offset) plus
  the sizes of the unplaced tensors live there exceeds the capacity (*spatial inference*);
* a residual state (tensors left, their minimum offsets, what the order still allows) that
  failed once is remembered and never searched again at the same capacity.

The search loop is compiled with numba (``canonical_kernel``); this module schedules its runs.

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
import time
from dataclasses import dataclass, field

import numpy as np

import memo_ext.planner.solvers.canonical_kernel as kernel
from memo_ext.planner.problem import DsaProblem, lower_bound, overlap_pairs, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.cover_kernel import cover_kernel
from memo_ext.planner.solvers.greedy import (
    GREEDY_SHARE,
    greedy_orders,
    place_in_order,
    solve_greedy,
)
from memo_ext.planner.solvers.work import (
    COVER_SCAN_UNITS,
    NODE_UNITS,
    SCAN_UNITS,
    SEARCH_SETUP_UNITS_PER_OVERLAP,
    WorkClock,
    greedy_units,
)

logger = logging.getLogger(__name__)


class _Deadline(Exception):
    """The search's work is spent (or the CPU-time safety net reached)."""


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


def _rank_of(order: np.ndarray) -> np.ndarray:
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


def preorder(sections: _Sections, key: np.ndarray) -> np.ndarray:
    """Rank of each tensor: by start section, then by decreasing ``key`` (a *sweep* order).

    Tensors at the same offset never share a time step, so their placement order is free; going
    left to right in time makes a skipped tensor leave a hole that spatial inference sees at once.
    """
    return _rank_of(np.lexsort((-key, sections.lo)))


def preorders(problem: DsaProblem, sections: _Sections, rng: np.random.Generator) -> list:
    """Tie-breaking orders to rotate through: fixed ones first, then random mixtures.

    Two families, since each solves instances the other does not: *sweeps* (left to right in
    time, see ``preorder``) and *crowded first*, MiniMalloc's static orders (by the largest
    section total the tensor takes part in, its lifetime and its area, in three priorities).
    """
    feats = _features(problem, sections)
    size, length, span, crowd, area = feats.T
    sweeps = [preorder(sections, key) for key in (area, crowd, size, span)]
    crowded = [
        _rank_of(np.lexsort((-c, -b, -a)))
        for a, b, c in ((crowd, area, length), (length, area, crowd), (crowd, length, area))
    ]
    ranks = [r for pair in zip(sweeps, crowded + [None]) for r in pair if r is not None]
    while True:
        yield from ranks
        weights = rng.dirichlet(np.ones(feats.shape[1]))
        key = (feats @ weights) * (1 + 0.1 * rng.random(problem.n))
        ranks = [preorder(sections, key), _rank_of(np.argsort(-key, kind="stable"))]


def cover_orders(problem: DsaProblem, rng: np.random.Generator):
    """Candidate orders for the exact-cover search: largest first, then noisy variants of it."""
    yield _rank_of(np.argsort(-problem.sizes, kind="stable"))
    while True:
        yield _rank_of(np.argsort(-problem.sizes * (1 + 0.3 * rng.random(problem.n))))


_REPORT_EVERY_S = 10.0
"""A long search logs its incumbent's gap this often (seconds; the log only)."""
PROBE_NODE_TENSORS = 1_000_000
"""Nodes × tensors of a search's first run, before its cost per node is known (no limit on
problems below a few hundred tensors, whose node budgets are smaller)."""

_TABLE_SLOTS = 1 << 21
"""Slots of a failed-state table (32 MiB); it is emptied when half full."""


@dataclass
class CanonicalSearch:
    """Depth-first search over canonical placements of one problem (see the module docstring).

    The search itself is the compiled kernel of ``canonical_kernel``; this class holds its
    arrays, keeps the failed-state tables of the two latest capacities (runs alternate between
    the lower bound and the incumbent) and charges each run's counted work to its clock, which
    cuts the next run's node budget to what is left.
    """

    problem: DsaProblem
    """The tensors to place (sizes in any unit)."""
    clock: WorkClock
    """Where the runs' work is charged; a run starts only with work left."""
    sections: _Sections = field(init=False)
    nodes: int = 0
    """Nodes visited over all runs."""
    run_nodes: int = 0
    """Nodes visited by the last run."""
    complete: bool = False
    """The last run exhausted its tree (so its capacity is infeasible)."""
    deepest: int = 0
    """Tensors placed in the deepest partial placement of the last run."""
    deepest_offsets: np.ndarray = field(init=False)
    """That placement (``-1``: not placed)."""

    def __post_init__(self) -> None:
        n = self.problem.n
        self.sections = build_sections(self.problem)
        num_sections = len(self.sections.total)
        pairs = overlap_pairs(self.problem)
        self.clock.spend(SEARCH_SETUP_UNITS_PER_OVERLAP * len(pairs))
        both = np.concatenate([pairs, pairs[:, ::-1]])
        both = both[np.argsort(both[:, 0], kind="stable")]
        nb_ptr = np.searchsorted(both[:, 0], np.arange(n + 1)).astype(np.int64)
        self._graph = (
            self.problem.sizes.astype(np.int64),
            self.sections.lo.astype(np.int64),
            self.sections.hi.astype(np.int64),
            nb_ptr,
            np.ascontiguousarray(both[:, 1], dtype=np.int64),
        )
        # crossings[s]: tensors live across the boundary between sections s and s + 1.
        diff = np.zeros(num_sections + 1, dtype=np.int64)
        np.add.at(diff, self.sections.lo, 1)
        np.add.at(diff, self.sections.hi - 1, -1)
        self._base_crossings = np.cumsum(diff)[:-1]
        # The tensors live in each section (CSR), for the exact-cover search: one (tensor,
        # section) entry per section a tensor spans, sorted by section.
        spans = self.sections.hi - self.sections.lo
        tensor = np.repeat(np.arange(n, dtype=np.int64), spans)
        section = np.repeat(self.sections.lo - np.cumsum(spans) + spans, spans) + np.arange(
            len(tensor)
        )
        by_section = np.argsort(section, kind="stable")
        self._live_idx = tensor[by_section]
        self._live_ptr = np.searchsorted(section[by_section], np.arange(num_sections + 1))
        # Nodes and work units of the runs so far, per kind: the cost of a node.
        self._spent = {"canonical": [0, 0.0], "cover": [0, 0.0]}
        self._base_total = self.sections.total.astype(np.int64)
        self._state = kernel.new_state(n, num_sections, len(both) + 1)
        self._tables: dict[tuple[str, int], tuple] = {}
        self.deepest_offsets = np.full(n, -1, dtype=np.int64)

    def _tables_for(self, capacity: int, kind: str = "canonical") -> tuple:
        """The failed-state table of one search kind (``canonical`` or ``cover``, whose states
        differ) at ``capacity``; tables of the two latest capacities of each kind are kept."""
        if (kind, capacity) not in self._tables:
            if sum(k == kind for k, _ in self._tables) >= 2:
                self._tables.pop(next(key for key in self._tables if key[0] == kind))
            # Small problems get a smaller table; no run of theirs comes near filling it.
            slots = min(_TABLE_SLOTS, max(1 << 16, 1 << (4096 * self.problem.n).bit_length()))
            tables = (
                np.zeros(slots, np.uint64),
                np.zeros(slots, np.uint64),
                np.zeros(1, np.uint64),
            )
            self._tables[kind, capacity] = tables
        return self._tables[kind, capacity]

    def _node_budget(self, node_limit: int, kind: str) -> int:
        """``node_limit`` cut to what the clock's work left pays for at the cost per node of
        earlier runs of the same kind; raises ``_Deadline`` when no work is left."""
        if self.clock.exhausted():
            raise _Deadline
        nodes, units = self._spent[kind]
        left = self.clock.left()
        if not np.isfinite(left):
            return node_limit
        if nodes:
            node_limit = min(node_limit, max(64, int(left * nodes / max(units, 1e-12))))
        else:
            # no cost measured yet, and a node costs work in proportion to the tensors: a first
            # run on a large problem is kept short, so that it measures the cost instead of
            # running far past the work left
            node_limit = min(node_limit, max(64, PROBE_NODE_TENSORS // self.problem.n))
        return node_limit

    def _charge(self, kind: str, nodes: int, scanned: int) -> None:
        units = NODE_UNITS * nodes + (COVER_SCAN_UNITS if kind == "cover" else SCAN_UNITS) * scanned
        self._spent[kind][0] += nodes
        self._spent[kind][1] += units
        self.clock.spend(units)

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
            unless tensors were fixed) or the node budget ran out (``self.complete`` False).

        Raises:
            _Deadline: when the work is spent (checked before the run; the run's node budget
                is cut to what the work left pays for at the cost per node seen so far).
        """
        node_limit = self._node_budget(node_limit, "canonical")
        if fixed is None:
            fixed = np.full(self.problem.n, -1, dtype=np.int64)
        graph = (*self._graph, np.asarray(rank, dtype=np.int64))
        t0 = time.perf_counter()
        first_call = not kernel.run_kernel.signatures
        outcome = kernel.run_kernel(
            int(capacity),
            int(node_limit),
            np.asarray(fixed, dtype=np.int64),
            self._base_total,
            self._base_crossings,
            graph,
            self._state,
            self._tables_for(int(capacity)),
        )
        elapsed = time.perf_counter() - t0
        counters = self._state[kernel.COUNTERS]
        self.run_nodes = int(counters[kernel.NODES])
        self.nodes += self.run_nodes
        self._charge("canonical", self.run_nodes, int(counters[kernel.WORK]))
        if first_call and elapsed > 1.0:
            # a process's first call compiles, or loads numba's cache (make install fills it)
            logger.debug(
                "first call of the canonical search loop: %.0f s (compiled or loaded)", elapsed
            )
        self.deepest = int(counters[kernel.DEEPEST])
        self.deepest_offsets = self._state[kernel.DEEPEST_OFFSETS].copy()
        self.complete = outcome == kernel.FAILED and not (fixed >= 0).any()
        if outcome == kernel.FOUND:
            return self._state[kernel.OFFSETS].copy()
        return None

    def full_at(self, capacity: int) -> bool:
        """Whether every section's tensors add up to exactly ``capacity`` (so a placement within
        it is an exact cover, and ``cover`` applies)."""
        return bool((self.sections.total == capacity).all())

    def cover(self, *, capacity: int, rank: np.ndarray, node_limit: int) -> np.ndarray | None:
        """Exact-cover search (``cover_kernel``) at ``capacity``; only for ``full_at(capacity)``.
        States that failed in earlier cover runs at the same capacity are not searched again.

        Sets ``complete``, ``deepest`` and ``deepest_offsets`` like ``run``.

        Raises:
            _Deadline: as ``run``.
        """
        assert self.full_at(capacity)
        node_limit = self._node_budget(node_limit, "cover")
        outcome, nodes, offsets, depth, scanned = cover_kernel(
            int(capacity),
            int(node_limit),
            *self._graph,
            self._live_ptr,
            self._live_idx,
            np.asarray(rank, dtype=np.int64),
            self._tables_for(int(capacity), "cover"),
        )
        self._charge("cover", int(nodes), int(scanned))
        self.run_nodes = int(nodes)
        self.nodes += self.run_nodes
        self.complete = outcome == kernel.FAILED
        if outcome == kernel.FOUND:
            return offsets
        self.deepest, self.deepest_offsets = int(depth), offsets
        return None

    def cover_node_ratio(self) -> float:
        """Cover nodes per canonical node of the same work, as counted so far (0.1 before)."""
        (canonical_nodes, canonical_units), (cover_nodes, cover_units) = (
            self._spent["canonical"],
            self._spent["cover"],
        )
        if not canonical_nodes or not cover_nodes:
            return 0.1
        return (cover_nodes / cover_units) / (canonical_nodes / canonical_units)

    def complete_deepest(self) -> np.ndarray:
        """The most complete placement of the last run, finished greedily above the rest.

        A run aimed at a tight capacity packs the bottom of the region densely before it gets
        stuck; stacking the tensors it did not reach on top is often far better than a greedy
        placement from scratch. With less work left than one placement (each costs O(n²)) only
        the first greedy order runs.
        """
        partial = self.deepest_offsets
        left = np.flatnonzero(partial < 0)
        best, best_peak = partial, None
        cost = greedy_units(self.problem)
        for order in greedy_orders(self.problem.subproblem(left)).values():
            for best_fit in (False, True):
                if best_peak is not None and (self.clock.left() < cost or self.clock.overdue()):
                    return best
                offsets = place_in_order(
                    self.problem, left[order], best_fit=best_fit, offsets=partial
                )
                self.clock.spend(cost)
                peak = peak_of(self.problem, offsets)
                if best_peak is None or peak < best_peak:
                    best, best_peak = offsets, peak
        return best


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
    # Their own random stream, so that the canonical runs see the same preorders either way.
    cover_rng = np.random.default_rng(seed + 1_000_003)
    covers = [cover_orders(search.problem, cover_rng) for search in searches]
    best_peak = peak_of(problem, best)
    base_nodes, runs, rounds, record = 4 * problem.n + 64, 0, 0, 0
    node_limit = base_nodes
    search = searches[0]
    started = last_report = time.perf_counter()
    try:
        while best_peak > bound:
            if time.perf_counter() - last_report >= _REPORT_EVERY_S:
                last_report = time.perf_counter()
                logger.info(
                    "canonical search: %.2f%% above the lower bound after %.0f s (%d nodes)",
                    100 * (best_peak / bound - 1),
                    last_report - started,
                    sum(s.nodes for s in searches),
                )
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
            if search.full_at(bound) and best_peak > bound:
                # Every section full at the bound: also try to cover it exactly, for as long as
                # the canonical run took (a cover node costs more). Its deepest partial covers
                # reach far deeper than the canonical ones on such problems.
                limit = max(64, int(node_limit * search.cover_node_ratio()))
                offsets = search.cover(capacity=bound, rank=next(covers[k]), node_limit=limit)
                runs += 1
                if offsets is None and search.complete:
                    bound += 1
                else:
                    if offsets is None:
                        offsets, record = _finish_partial(
                            search, ranks[k], best_peak, record, node_limit=base_nodes
                        )
                    if peak_of(problem, offsets) < best_peak:
                        best, best_peak = offsets, peak_of(problem, offsets)
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
    problem: DsaProblem, options: SolveOptions | None = None, *, improve: bool = True
) -> Solution:
    """Minimises the peak by canonical branch and bound, from a greedy incumbent.

    Args:
        problem: the tensors to place.
        options: work limit (or clock), seed and optional hint.
        improve: also aim just below the incumbent; without it every run aims at the lower
            bound (when another solver takes care of improving the incumbent).
    """
    options = options or SolveOptions()
    clock = options.start()
    greedy = SolveOptions(clock=clock.share(GREEDY_SHARE * clock.left()))
    best = solve_greedy(problem, greedy).offsets
    if options.hint is not None and peak_of(problem, options.hint) < peak_of(problem, best):
        best = np.asarray(options.hint, dtype=np.int64)
    bound = lower_bound(problem)
    searches = []
    for p in (problem, time_reversed(problem)):
        if clock.exhausted():  # building a search costs O(n · times) itself
            break
        searches.append(CanonicalSearch(problem=p, clock=clock))
    if not searches:
        peak = peak_of(problem, best)
        return Solution(best, peak, peak == bound, "canonical", {"bound": int(bound)})
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


def warm_up() -> None:
    """Compiles the search loops into numba's cache (``make install`` calls it), so that the
    first plan does not spend its time limit compiling. The cache is per user and source
    (``kernel_cache``): every checkout of the same kernels loads what this compiled."""
    problem = DsaProblem(
        sizes=np.array([2, 1, 1]), start=np.array([0, 0, 1]), end=np.array([2, 1, 2])
    )
    search = CanonicalSearch(problem=problem, clock=WorkClock(limit=float("inf")))
    search.run(capacity=3, rank=np.arange(problem.n), node_limit=100)
    search.cover(capacity=3, rank=np.arange(problem.n), node_limit=100)
