"""When a run stops early: ``--exit-interval``, ``--exit-duration-in-mins``, and signals.

A scheduler's SIGTERM may reach one rank before the others, and clocks drift, so the decision
is made together: at every step boundary each rank contributes what it saw to one all-reduce,
and all ranks stop (after saving) at the same iteration.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import torch.distributed as dist

from memo_ext.collectives import all_reduce_values
from memo_ext.config import CheckpointConfig

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopConditions:
    """Context manager that installs the signal handlers (if asked) and answers ``reason``."""

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.start = time.monotonic()
        self.signal_received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopConditions:
        if self.config.exit_signal_handler:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only note it: the step in flight finishes, then every rank saves together
        self.signal_received = signum
        logger.warning(
            "received %s; saving and exiting at the next step boundary", signal.Signals(signum).name
        )

    def reason(self, iteration: int) -> str | None:
        """Why the run should stop after ``iteration`` (the same answer on every rank)."""
        c = self.config
        if c.exit_interval and iteration % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if not (c.exit_signal_handler or c.exit_duration_in_mins):
            return None
        minutes = (time.monotonic() - self.start) / 60.0
        signalled, minutes = all_reduce_values(
            [float(self.signal_received is not None), minutes], op=dist.ReduceOp.MAX
        )
        if signalled > 0:
            return "signal received"
        if c.exit_duration_in_mins and minutes >= c.exit_duration_in_mins:
            return f"--exit-duration-in-mins {c.exit_duration_in_mins}"
        return None
