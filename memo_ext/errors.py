"""The two exception bases every entry point reports without a traceback.

An error that derives from :class:`ReportedError` carries a message that is the whole story: what
went wrong and what to do. ``pretrain_gpt_memo.py`` and the tools print it as one line and exit
with its ``exit_status``. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ReportedError(Exception):
    """A failure the user can act on (a corrupt checkpoint, a diverged run): exit status 1."""

    exit_status = 1


class UsageError(ReportedError, ValueError):
    """A flag, file or setting that cannot run; the message says what to change (exit status 2).

    Raised before any expensive work wherever the problem can be seen that early.
    """

    exit_status = 2
