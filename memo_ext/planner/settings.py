"""Settings of the memory planner."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memo_ext.planner.errors import PlannerInputError
from memo_ext.planner.solvers import SOLVERS, SolveOptions


@dataclass
class PlannerConfig:
    """How to turn a trace into a plan."""

    solver: str = "cpsat"
    """Backend: ``cpsat`` (default), ``canonical``, ``highs``, ``gurobi`` or ``heuristic``."""
    time_limit_s: float = 60.0
    """Wall-clock budget for the whole plan, seconds (both levels of a bi-level plan)."""
    alignment: int = 1
    """Every offset is a multiple of this many bytes (512 matches PyTorch's CUDA allocator)."""
    bilevel: bool = True
    """Plan identical layer passes once and the iteration over blocks; flat when the trace has
    no layer passes."""
    workers: int = 2
    """Threads a backend may use."""
    seed: int = 0
    """Random seed for backends that randomise their search."""
    levels: bool = True
    """Cut each problem along its flat levels and place the pieces before searching it whole
    (``memo_ext.planner.solvers.levels``)."""

    def solve_options(self, time_limit_s: float, hint: np.ndarray | None = None) -> SolveOptions:
        """The backend options of one solve with this configuration."""
        return SolveOptions(
            time_limit_s=time_limit_s,
            workers=self.workers,
            seed=self.seed,
            hint=hint,
            levels=self.levels,
        )

    def check(self) -> None:
        """Raises PlannerInputError (a ``UsageError``) with an actionable message."""
        if self.solver not in SOLVERS:
            raise PlannerInputError(
                f"--solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}"
            )
        if self.time_limit_s <= 0:
            raise PlannerInputError(f"--time-limit must be positive, got {self.time_limit_s}")
        if self.alignment < 1:
            raise PlannerInputError(
                f"--alignment must be a positive byte count, got {self.alignment}"
            )
        if self.workers < 1:
            raise PlannerInputError(f"workers must be at least 1, got {self.workers}")
