"""The canonical search written plainly over numpy arrays: the reference the compiled kernel
(``memo_ext.planner.solvers.canonical_kernel``) must match node for node."""

from __future__ import annotations

import numpy as np

from memo_ext.planner.problem import DsaProblem, overlap_pairs
from memo_ext.planner.solvers.canonical import build_sections


class OutOfNodes(Exception):
    pass


class ReferenceSearch:
    """Depth-first search over canonical placements with a set of failed residual states."""

    def __init__(self, problem: DsaProblem):
        self.problem = problem
        self.sections = build_sections(problem)
        pairs = overlap_pairs(problem)
        self.neighbours = [[] for _ in range(problem.n)]
        for i, j in pairs:
            self.neighbours[i].append(j)
            self.neighbours[j].append(i)
        self.failed: dict[int, set] = {}
        self.cuts = {"stranded": 0, "lifted": 0}
        """Over all runs: nodes cut because a forbidden tensor had no neighbour left to lift it,
        and forbidden tensors whose usable offset a neighbour lifted above ``last_off + 1``."""

    def run(self, *, capacity: int, rank: np.ndarray, node_limit: int, fixed=None):
        """Returns ``(offsets or None, outcome, nodes)``; outcome: found, failed, out of nodes."""
        n = self.problem.n
        self.capacity, self.rank, self.budget, self.nodes = capacity, rank, node_limit, 0
        self.seen = self.failed.setdefault(capacity, set())
        self.min_off = np.zeros(n, dtype=np.int64)
        self.offsets = np.full(n, -1, dtype=np.int64)
        self.placed = np.zeros(n, dtype=bool)
        self.total = self.sections.total.copy()
        # crossings[s]: unplaced tensors live across the boundary between sections s and s + 1.
        self.crossings = np.zeros(len(self.total), dtype=np.int64)
        for i in range(n):
            self.crossings[self.sections.lo[i] : self.sections.hi[i] - 1] += 1
        self.stack = []
        if fixed is not None:
            for c in np.flatnonzero(fixed >= 0):
                self._place(c, int(fixed[c]))
        try:
            found = self._search(np.arange(n), 0, len(self.total), -1, -1)
        except OutOfNodes:
            return None, "out of nodes", self.nodes
        return (self.offsets.copy(), "found", self.nodes) if found else (None, "failed", self.nodes)

    def sections_fit(self, unplaced, usable, s_lo, s_hi) -> bool:
        lo, hi, sizes = self.sections.lo, self.sections.hi, self.problem.sizes
        for s in range(s_lo, s_hi):
            here = [k for k, i in enumerate(unplaced) if lo[i] <= s < hi[i]]
            floor = min([self.capacity, *(usable[k] for k in here)])
            if floor + self.total[s] > self.capacity:
                return False
            for k in here:
                above = sum(sizes[unplaced[j]] for j in here if usable[j] >= usable[k])
                if usable[k] + above > self.capacity:
                    return False
        return True

    def _search(self, members, s_lo, s_hi, last_off, last_rank) -> bool:
        self.nodes += 1
        self.budget -= 1
        if self.budget < 0:
            raise OutOfNodes
        unplaced = members[~self.placed[members]]
        if len(unplaced) == 0:
            return True
        sizes = self.problem.sizes
        mo = self.min_off[unplaced]
        allowed = (mo > last_off) | ((mo == last_off) & (self.rank[unplaced] > last_rank))
        key = (s_lo, last_off, unplaced.tobytes(), mo.tobytes(), allowed.tobytes())
        if key in self.seen:
            return False
        usable = mo.copy()
        for k in np.flatnonzero(~allowed):
            # A forbidden tensor must rest on an unplaced neighbour placed at or above last_off.
            lifts = [
                max(self.min_off[j], last_off) + sizes[j]
                for j in self.neighbours[unplaced[k]]
                if not self.placed[j]
            ]
            if not lifts:
                self.cuts["stranded"] += 1
                self.seen.add(key)
                return False
            self.cuts["lifted"] += min(lifts) > last_off + 1
            usable[k] = max(min(lifts), last_off + 1)
        if not self.sections_fit(unplaced, usable, s_lo, s_hi):
            self.seen.add(key)
            return False
        min_height = (mo + sizes[unplaced]).min()
        highest = self.capacity - self.total[s_lo:s_hi].max()
        cands = unplaced[allowed & (mo < min_height) & (mo <= highest)]
        for c in cands[np.lexsort((self.rank[cands], self.min_off[cands]))]:
            off = int(self.min_off[c])
            mark = len(self.stack)
            self._place(c, off)
            lo, hi = self.sections.lo[c], self.sections.hi[c]
            cuts = np.flatnonzero(self.crossings[lo : hi - 1] == 0) + lo + 1
            cuts = cuts[(cuts > s_lo) & (cuts < s_hi)]
            if len(cuts) == 0:
                found = self._search(unplaced, s_lo, s_hi, off, int(self.rank[c]))
            else:
                found = self._search_parts(unplaced, [s_lo, *cuts, s_hi])
            if found:
                return True
            while len(self.stack) > mark:
                self._unplace()
        self.seen.add(key)
        return False

    def _search_parts(self, unplaced, bounds) -> bool:
        rest = unplaced[~self.placed[unplaced]]
        lo, hi = self.sections.lo[rest], self.sections.hi[rest]
        for a, b in zip(bounds[:-1], bounds[1:]):
            part = rest[(lo < b) & (hi > a)]
            if len(part) and not self._search(part, a, b, -1, -1):
                return False
        return True

    def _place(self, c, off) -> None:
        size = self.problem.sizes[c]
        nb = np.asarray(self.neighbours[c], dtype=np.int64)
        raised = nb[(self.min_off[nb] < off + size) & ~self.placed[nb]]
        self.stack.append((c, raised, self.min_off[raised]))
        self.min_off[raised] = off + size
        lo, hi = self.sections.lo[c], self.sections.hi[c]
        self.total[lo:hi] -= size
        self.crossings[lo : hi - 1] -= 1
        self.placed[c] = True
        self.offsets[c] = off

    def _unplace(self) -> None:
        c, raised, old_min = self.stack.pop()
        lo, hi = self.sections.lo[c], self.sections.hi[c]
        self.total[lo:hi] += self.problem.sizes[c]
        self.crossings[lo : hi - 1] += 1
        self.min_off[raised] = old_min
        self.placed[c] = False
        self.offsets[c] = -1
