"""Settings of the memory planner."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memo_ext.planner.errors import PlannerInputError
from memo_ext.planner.solvers import SOLVERS, SolveOptions
from memo_ext.planner.solvers.work import WorkClock

SAFETY_FACTOR, SAFETY_MARGIN_S = 10.0, 10.0
"""The default safety net: this many CPU seconds per work unit, plus this many. A work unit is
about a CPU-second, so the net is met only where the work counts miss about nine tenths of what
a search costs, on a busy machine as on an idle one (the net counts CPU time)."""


def safety_net_s(work_limit: float) -> float:
    """The default safety net of a plan with ``work_limit`` work units (CPU seconds)."""
    return SAFETY_FACTOR * work_limit + SAFETY_MARGIN_S


@dataclass
class PlannerConfig:
    """How to turn a trace into a plan."""

    solver: str = "cpsat"
    """Backend: ``cpsat`` (default), ``canonical``, ``highs``, ``gurobi`` or ``heuristic``."""
    work_limit: float = 60.0
    """Search work for the whole plan (both levels of a bi-level plan), in work units of about
    a second of one core each (``memo_ext.planner.solvers.work``): the same trace and settings
    give the same plan however busy the machine is."""
    time_limit_s: float | None = None
    """Safety net, seconds of the process's CPU time: a search still running past it stops
    where it is (the plan is valid, and records that it was cut). Default:
    ``safety_net_s(work_limit)``."""
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

    def start_clock(self) -> WorkClock:
        """The clock of one plan: the work limit, and the safety net from now."""
        limit_s = (
            self.time_limit_s if self.time_limit_s is not None else safety_net_s(self.work_limit)
        )
        return WorkClock.start(self.work_limit, limit_s)

    def solve_options(self, clock: WorkClock, hint: np.ndarray | None = None) -> SolveOptions:
        """The backend options of one solve with this configuration, charged to ``clock``."""
        return SolveOptions(
            clock=clock,
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
        if not self.work_limit > 0:
            raise PlannerInputError(f"--work-limit must be positive, got {self.work_limit}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise PlannerInputError(f"--time-limit must be positive, got {self.time_limit_s}")
        if self.alignment < 1:
            raise PlannerInputError(
                f"--alignment must be a positive byte count, got {self.alignment}"
            )
        if self.workers < 1:
            raise PlannerInputError(f"workers must be at least 1, got {self.workers}")
