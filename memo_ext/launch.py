"""torchrun, ending with a failed worker's own error and exit status.

torchrun answers any failed worker with exit status 1 and a traceback of its own launcher, so
a script cannot tell bad input (the trainer exits 2) from a crash, and the one-sentence error
scrolls away. This runs torchrun itself, with every torchrun flag, and on a failure prints the
first failed rank's message last and exits with that rank's status (128 + the signal number
for a killed rank, as a shell would)::

    python -m memo_ext.launch --nproc-per-node 8 pretrain_gpt_memo.py --num-layers 32 ...
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main as torchrun_main

from memo_ext.errors import REPORTS_ERRORS


def exit_status(exitcode: int) -> int:
    """The shell's status for a worker's exit code (negative: killed by that signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode or 1


def _reported(failure) -> str | None:
    """The sentence a worker wrote to its error file, if it wrote one."""
    if not os.path.isfile(failure.error_file):
        return None
    message = failure.message
    return message.get("message") if isinstance(message, dict) else message


def main(argv: list[str] | None = None) -> int:
    # torchrun logs each worker it stops and each failure with its own timestamps; the one line
    # this prints at the end says which rank failed and why
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="memo_launch_") as scratch:
        # where torchrun copies the failed worker's error file (else it logs an error that it
        # has none); each worker gets its own file from torchrun either way
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(scratch, "error.json"))
        os.environ[REPORTS_ERRORS] = "1"  # the workers leave their sentence to this line
        try:
            torchrun_main(argv)
        except ChildFailedError as err:
            return _report(err)
    return 0


def first_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed of its own accord: torchrun stops the other ranks with SIGTERM as
    soon as it sees one fail, and a rank it stopped can be seen at the same poll as the one
    that failed (bad input fails every rank at once), so exits with a status come first, then
    deaths by a signal other than torchrun's, each in the order torchrun saw them."""

    def order(rank: int) -> tuple[int, float]:
        failure = err.failures[rank]
        stopped = failure.exitcode == -signal.SIGTERM
        return (0 if failure.exitcode > 0 else 2 if stopped else 1), failure.timestamp

    rank = min(err.failures, key=order)
    return rank, err.failures[rank]


def _report(err: ChildFailedError) -> int:
    rank, failure = first_failure(err)
    detail = _reported(failure)
    if detail is None:
        if failure.exitcode < 0:
            detail = f"killed by {failure.signal_name()}"
        else:
            detail = f"exit status {failure.exitcode}; its output above says why"
    print(f"{os.path.basename(err.name)}: rank {rank} failed: {detail}", file=sys.stderr)
    return exit_status(failure.exitcode)


if __name__ == "__main__":
    sys.exit(main())
