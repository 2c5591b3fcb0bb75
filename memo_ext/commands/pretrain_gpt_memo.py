"""GPT pretraining on megatron-core with MEMO and HotSPa.

Launch with torchrun (here through ``memo_ext.launch``, which ends a failed run with its one
sentence) and Megatron-style flags, for example on 2 CPU processes::

    python -m memo_ext.launch --nproc-per-node 2 pretrain_gpt_memo.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 1e-3 \
        --tensor-model-parallel-size 2 --sequence-parallel --mock-data \
        --metrics-file runs/example/metrics.jsonl

``python pretrain_gpt_memo.py --help`` lists every flag.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from memo_ext import plugins
from memo_ext.arguments import parse_args
from memo_ext.errors import REPORTS_ERRORS, ReportedError, UsageError, out_of_memory


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    # megatron-core logs every dataset config and index build at INFO
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # the planner's stage lines are for memo-plan-memory's long plans; in a run, each pass plan
    # is one line of --memo-allocator plan's own
    logging.getLogger("memo_ext.planner.solvers").setLevel(logging.WARNING)


def _tell_torchrun(message: str) -> None:
    """Under torchrun, put the sentence in the failure summary torchrun prints last (its error
    file, read as a plain message) instead of its "To enable traceback see ..." line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        # the layout torch's own error handler writes: torchrun shows "py_callstack" and can
        # record the exit code in it
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)


def _print_once(err: ReportedError) -> None:
    """Bad input is the same on every rank (the same flags and files): rank 0 says it. Other
    failures can be one rank's own (its memory, its disk): each rank that fails says so. Under
    ``python -m memo_ext.launch`` the launcher says it, once."""
    if os.environ.get(REPORTS_ERRORS):  # memo_ext.launch prints the error file's sentence
        return
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(err, UsageError):
        if rank == 0 or rank >= world:  # a rank outside the world has no rank 0 to speak for it
            print(f"pretrain_gpt_memo.py: error: {err}", file=sys.stderr)
        return
    where = f" (rank {rank})" if world > 1 else ""
    print(f"pretrain_gpt_memo.py: error{where}: {err}", file=sys.stderr)


class Interrupted(ReportedError):
    """Ctrl-C without ``--exit-signal-handler``: the run stops where it is."""

    exit_status = 128 + signal.SIGINT


def _interrupted(run) -> str:
    from memo_ext.training.checkpoint import latest_iteration

    save = run.checkpoint.save
    latest = latest_iteration(Path(save)) if save and Path(save).is_dir() else None
    kept = (
        f"the latest complete checkpoint is iteration {latest} in {save} (a save being "
        "written is discarded)"
        if latest is not None
        else "no checkpoint was saved"
    )
    return f"interrupted (Ctrl-C); {kept}; with --exit-signal-handler a signal saves first"


def _train_reporting_oom(argv: list[str] | None):
    """Train; an allocator's out-of-memory error becomes :class:`OutOfMemory` (one sentence with
    the bytes asked for, exit status 3): too big for this machine is a result, not a bug."""
    run = parse_args(plugins.load(sys.argv[1:] if argv is None else argv))
    if int(os.environ.get("RANK", "0")) == 0:  # the imports below take seconds, more when loaded
        logging.getLogger("pretrain_gpt_memo").info(
            "flags checked; loading megatron-core and building the run on %d process(es)",
            run.world_size,
        )
    # imported once the flags are good: --help and a wrong flag answer without megatron-core
    from memo_ext.training.loop import train

    interrupt = _InterruptSeen.install()
    try:
        return train(run)
    except ReportedError:
        raise
    except Exception as err:  # noqa: BLE001 - an allocation failure, however a library wraps it
        if interrupt.seen:  # a collective whose peer Ctrl-C stopped first, a save's writer
            raise Interrupted(_interrupted(run)) from None
        oom = out_of_memory(err, capped=run.preflight.memory_limit_gb is not None)
        if oom is None:
            raise
        raise oom from None
    except BaseException as err:
        if _is_interrupt(err):
            raise Interrupted(_interrupted(run)) from None
        raise
    finally:
        interrupt.uninstall()


class _InterruptSeen:
    """Python's own SIGINT behaviour (``KeyboardInterrupt``), remembering that it came. A
    terminal's Ctrl-C reaches every rank at once, but one rank may be inside a collective or a
    save's writes when its peer stops: it then fails with the library's error ("Connection
    closed by peer"), not the interrupt, and that error is the interrupt's consequence.
    ``--exit-signal-handler`` puts its own handler over this one while training."""

    def __init__(self, previous) -> None:
        self.seen = False
        self.previous = previous

    @classmethod
    def install(cls) -> _InterruptSeen:
        previous = signal.getsignal(signal.SIGINT)
        seen = cls(previous)
        main = threading.current_thread() is threading.main_thread()  # signals go there only
        if main and previous is signal.default_int_handler:  # not ignored, not someone else's
            signal.signal(signal.SIGINT, seen._on_interrupt)
        return seen

    def _on_interrupt(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def uninstall(self) -> None:
        if signal.getsignal(signal.SIGINT) == self._on_interrupt:
            signal.signal(signal.SIGINT, self.previous)


def _is_interrupt(err: BaseException) -> bool:
    """Ctrl-C, as raised or as a library wrapped it: torch.distributed.checkpoint catches every
    exception of a save's writes and raises a ``CheckpointException`` holding them."""
    if isinstance(err, KeyboardInterrupt):
        return True
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        wrapped = [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
        return any(isinstance(inner, KeyboardInterrupt) for inner in wrapped)
    return False


def main(argv: list[str] | None = None) -> int:
    _configure_logging()
    try:
        summary = _train_reporting_oom(argv)
    except ReportedError as err:  # bad input (2), out of memory (3), a failure it explains (1)
        _print_once(err)
        _tell_torchrun(str(err))
        return err.exit_status
    if int(os.environ.get("RANK", "0")) == 0 and summary.losses:
        logging.getLogger("pretrain_gpt_memo").info(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
