"""What every solver backend takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SolveOptions:
    """Knobs shared by all backends."""

    time_limit_s: float = 60.0
    """Wall-clock budget for the whole solve, seconds."""
    workers: int = 2
    """Threads a backend may use (CP-SAT workers, HiGHS / Gurobi threads)."""
    seed: int = 0
    """Random seed for backends that randomise their search."""
    hint: np.ndarray | None = None
    """Optional known placement (offsets, problem units) to start from."""
    levels: bool = True
    """Cut a problem along its flat levels and place the pieces one by one before searching
    it whole (``solve_dsa``; see ``levels``)."""


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
