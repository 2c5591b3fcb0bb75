"""Exceptions raised by the memory planner.

Every error the planner raises for bad user input is a ``PlannerInputError`` whose message names
what is wrong and where (event index and tensor id for traces), so command-line tools can print it
as one sentence without a traceback. All three are usage errors (``memo_ext.errors``).
"""

from memo_ext.errors import UsageError


class PlannerInputError(UsageError):
    """A trace, plan or instance file that cannot be used (malformed, unknown format, bad event)."""


class PlanValidationError(UsageError):
    """A plan that does not fit its trace: overlapping live tensors, missing ids, bad alignment."""


class SolverUnavailableError(UsageError):
    """A solver backend whose package or licence is not available on this machine."""
