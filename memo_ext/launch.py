"""torchrun, ending with a failed worker's own error and exit status.

torchrun answers any failed worker with exit status 1 and a traceback of its own launcher, so
a script cannot tell bad input (the trainer exits 2) from a crash, and the one-sentence error
scrolls away. This runs torchrun itself, with every torchrun flag, and on a failure prints the
first failed rank's message last and exits with that rank's status (128 + the signal number
for a killed rank, as a shell would)::

    python -m memo_ext.launch --nproc-per-node 8 pretrain_gpt_memo.py --num-layers 32 ...

Stopped itself by SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C), torchrun forwards the
signal to the workers, waits for them, and raises; this exits 0 when every worker then exited 0
(with ``--exit-signal-handler`` each saves a checkpoint first), else 128 + the signal number, in
one line instead of torchrun's traceback (the workers' own sentence where they left one: Ctrl-C
names the latest complete checkpoint): a requeue script can tell a clean stop from a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun_main

from memo_ext.errors import REPORTS_ERRORS

PROG = "memo-launch"
"""The installed command: its usage line and error prefix."""


def exit_status(exitcode: int) -> int:
    """The shell's status for a worker's exit code (negative: killed by that signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode or 1


def _reported(failure) -> str | None:
    """The sentence a worker wrote to its error file, if it wrote one."""
    if not os.path.isfile(failure.error_file):
        return None
    message = failure.message
    return message.get("message") if isinstance(message, dict) else message


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (its flags, --help and errors), named as the installed command."""
    parser = get_args_parser()
    parser.prog = PROG
    return parser


def check_arguments(argv: list[str] | None) -> str | None:
    """What torchrun would trip over with an assertion or a traceback (a process count below
    one), as one sentence; None when there is nothing to say."""
    args = build_parser().parse_args(argv)
    nproc = str(args.nproc_per_node)
    if re.fullmatch(r"-?[0-9]+", nproc) and int(nproc) < 1:
        return f"--nproc-per-node {nproc}: a node runs at least one process"
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return f"--master-port {args.master_port} is not a port (1-65535)"
    host = args.master_addr if args.rdzv_backend == "static" else args.rdzv_endpoint
    host = host.rsplit(":", 1)[0] if host and args.rdzv_backend != "static" else host
    if host:  # one node too: c10d would retry the name lookup until it is killed
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError) as err:
            reason = err.strerror if isinstance(err, socket.gaierror) else str(err)
            flag = "--master-addr" if args.rdzv_backend == "static" else "--rdzv-endpoint"
            which = ("this machine's (127.0.0.1)" if str(args.nnodes) in ("1", "1:1")
                     else "the first node's host name")  # fmt: skip
            return f"{flag} {host} does not resolve ({reason}); give {which}"
    return None


def main(argv: list[str] | None = None) -> int:
    problem = check_arguments(argv)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    with _environment_restored():  # a caller's later processes must not inherit it
        return _launch(argv)


@contextlib.contextmanager
def _environment_restored() -> Iterator[None]:
    """The environment as it was on entry, again on exit: this and torchrun set variables for
    the workers (the error file, the signals to forward) that a process calling ``main`` and
    starting others afterwards must not pass on."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launch(argv: list[str] | None) -> int:
    # torchrun logs each worker it stops and each failure with its own timestamps; the one line
    # this prints at the end says which rank failed and why
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="memo_launch_") as scratch:
        # where torchrun copies the failed worker's error file (else it logs an error that it
        # has none); each worker gets its own file from torchrun either way
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(scratch, "error.json"))
        os.environ[REPORTS_ERRORS] = "1"  # the workers leave their sentence to this line
        stopped: dict[int, int | None] = {}
        said: dict[int, str] = {}
        try:
            with _recording_stopped_workers(stopped, said):
                torchrun_main(argv)
        except ChildFailedError as err:
            return _report(err)
        except SignalException as err:
            return _stopped_by(signal.Signals(err.sigval), stopped, said)
        except (DistNetworkError, DistStoreError) as err:  # the launcher's own rendezvous
            print(f"{PROG}: error: {_store_failure(err)}", file=sys.stderr)
            return 1
    return 0


def _store_failure(err: Exception) -> str:
    text = str(err)
    port = re.search(r"port: (\d+)", text)
    if "EADDRINUSE" in text and port:
        return (
            f"port {port.group(1)} is in use on this machine (another run?); give another "
            "--master-port"
        )
    joined = re.search(r"Timed out after (\d+) seconds waiting for clients. (\d+)/(\d+)", text)
    if joined:
        waited, came, nodes = joined.groups()
        return (
            f"the rendezvous waited {waited} s and {came} of {nodes} nodes joined: start every "
            "node with the same --master-addr, --master-port and --nnodes (the deadline: "
            "--rdzv-conf timeout=SECONDS)"
        )
    return f"the rendezvous failed: {text.strip().splitlines()[0]}"


@contextlib.contextmanager
def _recording_stopped_workers(
    statuses: dict[int, int | None], said: dict[int, str] | None = None
) -> Iterator[None]:
    """Record each worker's exit code, and into ``said`` the sentence each worker that failed
    wrote to its error file (the trainer's "interrupted (Ctrl-C); the latest complete checkpoint
    is ..."), when torchrun's agent shuts its workers down (on a signal, after forwarding it):
    the agent keeps them to itself and raises. torch's agent internals
    (``LocalElasticAgent._shutdown``, ``SubprocessContext.subprocess_handlers`` and
    ``error_files``) are checked by ``tests/unit/test_launch.py``. The agent's arguments are
    passed on as given: its signature differs between torch releases (2.11 takes
    ``death_sig``, 2.13 a ``timeout`` too)."""
    shutdown = LocalElasticAgent._shutdown

    def recording(agent, *args, **kwargs):
        shutdown(agent, *args, **kwargs)
        handlers = getattr(agent._pcontext, "subprocess_handlers", None) or {}
        statuses.update({rank: h.proc.returncode for rank, h in handlers.items()})
        files = getattr(agent._pcontext, "error_files", None) or {}
        if said is not None:
            for rank, code in statuses.items():
                sentence = _error_file_sentence(files.get(rank)) if code else None
                if sentence:
                    said[rank] = sentence

    LocalElasticAgent._shutdown = recording
    try:
        yield
    finally:
        LocalElasticAgent._shutdown = shutdown


def _error_file_sentence(path: str | None) -> str | None:
    """The message of a worker's error file (the layout torch's error handler and the
    trainer write), or ``None`` without one."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            message = json.load(f).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    message = message.get("message") if isinstance(message, dict) else message
    return message if isinstance(message, str) else None


def _stopped_by(
    sig: signal.Signals, statuses: dict[int, int | None], said: dict[int, str] | None = None
) -> int:
    """The exit status after a signal stopped the launch: 0 when every worker exited 0. A
    worker that stopped with a sentence of its own (the trainer interrupted by Ctrl-C names
    its latest checkpoint) is quoted, once: each rank says the same."""
    if statuses and all(code == 0 for code in statuses.values()):
        print(f"stopped by {sig.name}: every rank exited cleanly", file=sys.stderr)
        return 0
    failed = sorted(rank for rank, code in statuses.items() if code != 0)
    sentences = [said[rank] for rank in failed if said and rank in said]
    if sentences:
        print(f"stopped by {sig.name}: {sentences[0]}", file=sys.stderr)
        return 128 + sig.value
    ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    detail = f"{ranks} did not exit cleanly" if failed else "no rank ran"
    print(f"stopped by {sig.name}: {detail}", file=sys.stderr)
    return 128 + sig.value


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
