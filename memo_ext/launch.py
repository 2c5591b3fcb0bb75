"""torchrun, ending with a failed worker's own error and exit status.

torchrun answers any failed worker with exit status 1 and a traceback of its own launcher, so
a script cannot tell bad input (the trainer exits 2) from a crash, and the one-sentence error
scrolls away. This runs torchrun itself, with every torchrun flag, and on a failure prints the
first failed rank's message last and exits with that rank's status (128 + the signal number
for a killed rank, as a shell would)::

    python -m memo_ext.launch --nproc-per-node 8 pretrain_gpt_memo.py --num-layers 32 ...
"""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


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
    with tempfile.TemporaryDirectory(prefix="memo_launch_") as scratch:
        # where torchrun copies the failed worker's error file (else it logs an error that it
        # has none); each worker gets its own file from torchrun either way
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(scratch, "error.json"))
        try:
            torchrun_main(argv)
        except ChildFailedError as err:
            return _report(err)
    return 0


def _report(err: ChildFailedError) -> int:
    rank, failure = err.get_first_failure()
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
