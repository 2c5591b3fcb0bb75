"""The planner's clock: search work counted, not timed, so that a plan does not depend on load.

Every limit of the planner is a number of *work units*. A unit is about one second of one core
of the machine the constants below were fitted on (a 2-core x86 server, on MiniMalloc's
challenging suite and on perfectly packable instances; within 30-40% of the measured time on
each). Work is what the searches count as they go:

* a greedy placement of ``n`` tensors: ``n`` gap searches over the tensors live with each
  (``greedy_units``);
* a canonical search node: the node itself plus the members, sections and neighbours it scans
  (the kernel's ``WORK`` counter);
* an exact-cover node likewise (the cover kernel's count);
* CP-SAT: its own deterministic time (``max_deterministic_time``, one worker: with more it
  overshoots by a batch), plus an estimate of its presolve by the model's size.

Every decision of the planner (how many nodes a run may visit, whether a stage runs, which
result is kept) reads these counts, so the same trace and settings give the same plan on a busy
machine and an idle one, only later. A deadline stays as a safety net, counted in the process's
CPU time (``time.process_time``: every thread, so the searches run side by side count together,
as their work does) and not on the wall clock: a machine that is slow because it is shared
gives the process fewer CPU-seconds per second, not many more per unit of work (what sharing a
core's caches costs), so a net well above the work limit is met on neither. A search past it
stops where it is, the plan is still valid, and ``WorkClock.cut`` says it was cut (the plan
records ``deterministic: false``).
Backends whose own limits are wall-clock (CP-SAT's ``max_time_in_seconds``, Gurobi's
``TimeLimit``) are not given them; ``WorkClock.watching`` stops them instead.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from memo_ext.planner.problem import DsaProblem, overlap_count

GREEDY_UNITS_PER_TENSOR = 10e-6
"""A greedy placement: per tensor placed (Python overhead of one gap search)."""
GREEDY_UNITS_PER_PAIR = 2.2e-9
"""A greedy placement: per (tensor, tensor) pair (the live mask of each placement)."""
GREEDY_UNITS_PER_OVERLAP = 38e-9
"""A greedy placement: per pair of tensors live at the same time (sorted and searched for a
gap). The three fit 11 problems of 150-6,000 tensors within 20%."""
SEARCH_SETUP_UNITS_PER_OVERLAP = 2.3e-7
"""Building a canonical search's state (sections, neighbour lists, cover lists), per pair of
tensors live at the same time (0.23 s at a million pairs)."""
NODE_UNITS = 2.5e-6
"""A node of the canonical or exact-cover search."""
SCAN_UNITS = 0.83e-9
"""An entry a canonical node scans (member, section or neighbour; the kernel's ``WORK``)."""
COVER_SCAN_UNITS = 1.2e-9
"""An entry an exact-cover node scans (section entry or neighbour)."""
UNITS_PER_DETERMINISTIC_SECOND = 3.0
"""Work units per unit of CP-SAT's deterministic time (measured: 2.6 with two interleaved
workers, 3.4 with one, on MiniMalloc's instance G)."""
MODEL_UNITS_PER_TENSOR = 50e-6
"""Building a CP-SAT model, per tensor (the Python loop that declares its variables)."""
CPSAT_SETUP_UNITS_PER_TENSOR = 6e-3
"""CP-SAT's presolve and loading of a placement model, per tensor: seconds its deterministic
time does not see (measured 1.6-13 s on models of 200-3,000 tensors; a rough fit)."""
WATCH_EVERY_S = 0.05
"""How often ``WorkClock.watching`` reads the CPU clock while a backend runs (seconds)."""


def charge_cpsat(clock: WorkClock, solver, *, finished: bool) -> None:
    """Charges a CP-SAT solve (``solver``, a ``CpSolver`` after ``solve``) to ``clock``: its
    deterministic time. One that stopped short of its deterministic limit without ``finished``
    (optimal, or proven infeasible) was stopped by the safety net, which marks the tree as cut."""
    used, limit = solver.deterministic_time, solver.parameters.max_deterministic_time
    clock.spend(min(used * UNITS_PER_DETERMINISTIC_SECOND, clock.left()))
    if not finished and used < limit:
        clock.overdue()


def greedy_units(problem: DsaProblem) -> float:
    """Work of one greedy placement of ``problem``'s tensors."""
    n = problem.n
    return (
        n * GREEDY_UNITS_PER_TENSOR
        + n * n * GREEDY_UNITS_PER_PAIR
        + overlap_count(problem) * GREEDY_UNITS_PER_OVERLAP
    )


@dataclass
class WorkClock:
    """A budget of work units, shared down a tree of stages, with a CPU-time safety net.

    ``share`` hands a stage part of what is left; what the stage spends is charged to every
    clock above it. ``left`` is the only thing a decision may read. ``overdue`` reads the CPU
    clock: a search checks it between steps and stops when it is true, which marks the whole
    tree as ``cut``.
    """

    limit: float
    """Work units this clock may spend."""
    deadline: float = math.inf
    """Reading of ``cpu`` past which searching stops whatever the work left."""
    spent: float = 0.0
    """Work units spent so far (by this clock and the stages it shared to)."""
    parent: WorkClock | None = None
    """The clock this one was shared from (its spending is charged there too)."""
    net_cut: bool = False
    """Set on the root when the deadline stopped a search (read it through ``cut``)."""
    cpu: Callable[[], float] = field(default=time.process_time, repr=False)
    """The clock the deadline is read on: the process's CPU seconds (tests inject their own)."""

    @classmethod
    def start(
        cls,
        work_limit: float,
        time_limit_s: float = math.inf,
        cpu: Callable[[], float] = time.process_time,
    ) -> WorkClock:
        """A root clock: ``work_limit`` units, a deadline once the process has spent
        ``time_limit_s`` more CPU seconds."""
        return cls(limit=work_limit, deadline=cpu() + time_limit_s, cpu=cpu)

    def left(self) -> float:
        """Work units still to spend (never negative)."""
        return max(self.limit - self.spent, 0.0)

    def spend(self, units: float) -> None:
        """Charges ``units`` to this clock and every clock above it."""
        clock: WorkClock | None = self
        while clock is not None:
            clock.spent += units
            clock = clock.parent

    def share(self, units: float, *, floor: float = 0.0) -> WorkClock:
        """A clock for a stage: ``units`` of what is left, charged to this one (at least
        ``floor`` units, past this clock's limit if need be)."""
        units = max(min(units, self.left()), floor, 0.0)
        return WorkClock(limit=units, deadline=self.deadline, parent=self, cpu=self.cpu)

    def detached(self, units: float) -> WorkClock:
        """A clock for a stage run beside others (in a thread): ``units`` of what is left,
        charged here only by ``absorb``, in an order that does not depend on the threads."""
        units = max(min(units, self.left()), 0.0)
        return WorkClock(limit=units, deadline=self.deadline, cpu=self.cpu)

    def absorb(self, stage: WorkClock) -> None:
        """Charges a detached stage's work (and its cut, if the deadline stopped it)."""
        self.spend(stage.spent)
        if stage.net_cut:
            self.root.net_cut = True

    @property
    def root(self) -> WorkClock:
        clock = self
        while clock.parent is not None:
            clock = clock.parent
        return clock

    @property
    def cut(self) -> bool:
        """Whether the safety net stopped a search anywhere under the root."""
        return self.root.net_cut

    def overdue(self) -> bool:
        """Past the CPU-time deadline (the safety net); marks the tree as cut when so."""
        if self.cpu() <= self.deadline:
            return False
        self.root.net_cut = True
        return True

    def exhausted(self) -> bool:
        """No work left, or past the deadline."""
        return self.left() <= 0 or self.overdue()

    def seconds_left(self) -> float:
        """CPU seconds to the deadline (HiGHS reads them as its wall-clock time limit: it takes
        no other kind)."""
        return max(self.deadline - self.cpu(), 0.0)

    @contextmanager
    def watching(self, stop: Callable[[], None], every_s: float = WATCH_EVERY_S) -> Iterator[None]:
        """Runs the body with the safety net enforced on a backend that takes no CPU-time limit:
        a thread reads the clock every ``every_s`` seconds and, once it is overdue, calls
        ``stop`` (thread-safe, e.g. ``CpSolver.stop_search``) at every reading until the body
        ends, since a stop that comes before the backend starts is not kept. Nothing runs
        without a deadline."""
        if math.isinf(self.deadline):
            yield
            return
        done = threading.Event()

        def watch() -> None:
            while not done.wait(every_s):
                if self.overdue():
                    stop()

        thread = threading.Thread(target=watch, name="work-clock-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
