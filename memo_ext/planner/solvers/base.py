"""What every solver backend takes and returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from memo_ext.planner.solvers.work import WorkClock


@dataclass
class SolveOptions:
    """Knobs shared by all backends."""

    work_limit: float = 60.0
    """Search work for the whole solve, in work units (about a second each; see ``work``)."""
    time_limit_s: float = math.inf
    """Safety net, seconds of the process's CPU time: a search still running past it stops
    where it is (``work``)."""
    workers: int = 2
    """Threads a backend may use (CP-SAT workers, HiGHS / Gurobi threads)."""
    seed: int = 0
    """Random seed for backends that randomise their search."""
    hint: np.ndarray | None = None
    """Optional known placement (offsets, problem units) to start from."""
    levels: bool = True
    """Cut a problem along its flat levels and place the pieces one by one before searching
    it whole (``solve_dsa``; see ``levels``)."""
    clock: WorkClock | None = None
    """The clock a stage charges its work to (``solve_dsa`` shares one to each stage); when
    absent, ``start`` makes one from the two limits."""

    def start(self) -> WorkClock:
        """The clock of this solve."""
        if self.clock is not None:
            return self.clock
        return WorkClock.start(self.work_limit, self.time_limit_s)


@dataclass
class Solution:
    """A placement returned by a backend, in the problem's size units."""

    offsets: np.ndarray
    """``[n]`` int64 offsets."""
    peak: int
    """``max(offset + size)``."""
    optimal: bool
    """True when the backend proved no smaller peak exists."""
    solver: str
    """Backend name."""
    details: dict = field(default_factory=dict)
    """Backend-specific figures (nodes, restarts, bound)."""
