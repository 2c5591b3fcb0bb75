"""Training jobs in gloo worker processes started once per test session.

A job is one call of an entry point (``pretrain_gpt_memo.main`` by default) on ``nproc`` ranks.
Under torchrun every job pays for new processes and for importing torch, megatron-core and the
trainer on each rank (about 5 s of CPU a rank here). The :class:`WorkerPool` starts its workers
once (spawned, as torchrun would, never forked) and runs each job in place: worker ``i`` is
rank ``i``, given the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT`` of a fresh port...), with its standard output
and error captured at the file-descriptor level. ``train()`` makes and destroys its process
groups and megatron's parallel state itself, as megatron-core's own unit tests re-create groups
inside running ranks, so the next job starts from the same state a new process would.

What a new process gives and a reused one would not, the pool restores or refuses:

- the environment, the working directory, ``sys.argv`` and ``sys.path`` are put back after
  every job, and modules imported from a job's own ``PYTHONPATH`` entries are forgotten;
- a job that leaves process-wide state behind by design (``--memo-allocator plan`` installs
  torch's CPU allocator for the life of the process) passes ``fresh_after=True``, and its
  workers are replaced once it ends;
- when one rank fails and the others do not finish (they wait in a collective for it, as under
  torchrun, which would kill them), the waiting workers are killed and replaced, and so are the
  workers of a job that outlives its timeout.

What only a real launch shows (torchrun's exit statuses and error file, signals, the shell
scripts) is tested with real launches: the ``launch`` marker.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_ENTRY = "pretrain_gpt_memo:main"
PRELOAD = ("tests.workers", "pretrain_gpt_memo")
"""Imported once by the server the workers are forked from: the cost a torchrun job pays on
every rank."""
FAILURE_GRACE_S = 20.0
"""After a rank fails, how long the other ranks get to finish (a bad flag fails every rank at
once) before they are taken to be waiting for the failed one, and replaced."""


@dataclass
class RankResult:
    """One rank's exit status and captured output."""

    status: int
    stdout: str = ""
    stderr: str = ""


@dataclass
class JobResult:
    """What a job's ranks returned, rank 0 first."""

    ranks: list[RankResult] = field(default_factory=list)

    @property
    def status(self) -> int:
        """The first non-zero rank status, else 0 (torchrun's rule is the same)."""
        return next((r.status for r in self.ranks if r.status != 0), 0)

    @property
    def stderr(self) -> str:
        """Standard error of the first failed rank, else of rank 0."""
        return next((r.stderr for r in self.ranks if r.status != 0), self.ranks[0].stderr)

    @property
    def stdout(self) -> str:
        return self.ranks[0].stdout

    def describe(self) -> str:
        parts = []
        for rank, r in enumerate(self.ranks):
            output = r.stdout[-2000:] + r.stderr[-5000:]
            parts.append(f"--- rank {rank}: status {r.status}\n{output}")
        return "\n".join(parts)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind
    to 0) is one it may hand again to any outgoing connection (a rank's to its store, say)
    before the job binds it, and the job then finds it taken."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 20_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class WorkerPool:
    """``size`` spawned worker processes that run jobs of up to ``size`` ranks in place."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        # workers are forked from a server process that imported the trainer once (a new
        # worker, at the start or to replace one, costs a fork, not an import), never from
        # this process (its pytest state and threads are not a trainer's)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(PRELOAD))
        self._workers: list[tuple[multiprocessing.Process, Connection] | None] = [None] * size
        self.jobs = 0
        self.replaced = 0

    def _start(self, rank: int) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(child,), name=f"test-rank-{rank}"
        )  # not a daemon: ranks start data-loader processes of their own
        process.start()
        child.close()
        self._workers[rank] = (process, parent)

    def _worker(self, rank: int) -> tuple[multiprocessing.Process, Connection]:
        if self._workers[rank] is None or not self._workers[rank][0].is_alive():
            self._start(rank)
        return self._workers[rank]

    def _replace(self, rank: int) -> None:
        worker = self._workers[rank]
        if worker is not None:
            process, conn = worker
            _kill_tree(process)
            conn.close()
            self.replaced += 1
        self._workers[rank] = None

    def warm(self, nproc: int | None = None) -> None:
        """Start the first ``nproc`` workers now (their imports overlap with other work)."""
        for rank in range(nproc or self.size):
            self._worker(rank)

    def run(
        self,
        argv: list[str],
        *,
        nproc: int = 1,
        entry: str = DEFAULT_ENTRY,
        env: dict[str, str] | None = None,
        timeout_s: float = 600,
        fresh_after: bool = False,
    ) -> JobResult:
        """Run ``entry(argv)`` on ranks ``0 .. nproc - 1``; their statuses and output.

        ``entry``: ``"module:function"``; the function takes the argument list and returns an
        exit status (or raises ``SystemExit``), as a ``main`` run by ``python -m`` would.
        ``env``: the job's environment, to which the torchrun variables are added (a launch
        from this process would inherit ``os.environ``: pass it); ``PYTHONPATH`` entries are
        also put on ``sys.path`` for the job.
        """
        if not 1 <= nproc <= self.size:
            raise ValueError(f"jobs of 1 to {self.size} ranks, not {nproc}")
        self.jobs += 1
        port = free_port()
        conns = {}
        for rank in range(nproc):
            _, conn = self._worker(rank)
            job_env = {
                **(env or {}),
                **_torchrun_env(rank=rank, nproc=nproc, port=port),
            }
            conn.send({"argv": list(argv), "entry": entry, "env": job_env})
            conns[conn] = rank
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout_s
        while conns:
            remaining = deadline - time.monotonic()
            if any(r.status != 0 for r in results.values()):
                remaining = min(remaining, FAILURE_GRACE_S)
            ready = wait(list(conns), timeout=max(0.0, remaining))
            if not ready:
                break
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    results[rank] = RankResult(**conn.recv())
                except (EOFError, OSError):  # the worker died (a signal, os._exit)
                    process = self._workers[rank][0]
                    process.join(5)
                    results[rank] = RankResult(status=_status_of(process.exitcode))
                    self._replace(rank)
        for rank in conns.values():  # still running: hung, or waiting for a failed rank
            self._replace(rank)
            timed_out = time.monotonic() >= deadline
            why = f"timed out after {timeout_s:.0f} s" if timed_out else "waited for a failed rank"
            results[rank] = RankResult(status=124 if timed_out else -9, stderr=why)
        if fresh_after:
            for rank in range(nproc):
                self._replace(rank)
                self.replaced -= 1  # asked for, not a failure
        return JobResult([results[rank] for rank in range(nproc)])

    def close(self) -> None:
        for rank, worker in enumerate(self._workers):
            if worker is None:
                continue
            process, conn = worker
            descendants = _descendants(process)
            with contextlib.suppress(OSError):
                conn.send(None)
            process.join(5)
            _kill_tree(process, descendants)
            self._workers[rank] = None


def _descendants(process: multiprocessing.Process) -> list[psutil.Process]:
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_tree(process: multiprocessing.Process, descendants=None) -> None:
    """Kill a worker and what it started (data-loader processes, the server process of the
    queue megatron's checkpoint writer spawns), which a killed worker would leave running."""
    for child in [*(descendants or _descendants(process))]:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if process.is_alive():
        process.kill()
    process.join(10)


def _torchrun_env(*, rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun sets for rank ``rank`` of a one-node job of ``nproc`` processes."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def _status_of(exitcode: int | None) -> int:
    """A shell's status for a process's exit code (negative: killed by that signal)."""
    if exitcode is None:
        return 1
    return 128 - exitcode if exitcode < 0 else exitcode


# --- inside a worker -------------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """A worker's life: import the trainer once, then run jobs until told to stop."""
    _die_with_parent()
    # a process torchrun starts has Python's default start method (fork on Linux); a spawned
    # child inherits "spawn", and data-loader processes would import the trainer anew
    multiprocessing.set_start_method("fork", force=True)
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    import warnings

    warnings.simplefilter("ignore")
    for module in PRELOAD:
        importlib.import_module(module)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        result = _run_job(**job)
        # what a process exit would free: a finished job's objects in reference cycles still
        # hold their process groups' sockets and threads (about 50 threads a job here)
        gc.collect()
        conn.send(result)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the test process ends, however it ends."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_job(*, argv: list[str], entry: str, env: dict[str, str]) -> dict:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    before = set(sys.modules)
    job_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = job_path
    module_name, function_name = entry.split(":")
    sys.argv = [module_name.replace(".", "/") + ".py", *argv]
    with _captured() as output:
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            status = function(list(argv))
        except SystemExit as stop:
            status = stop.code
        except BaseException:  # what an uncaught exception does to a process: traceback, 1
            traceback.print_exc()
            status = 1
    if not isinstance(status, int):  # sys.exit("message") prints it and exits 1
        if status is not None:
            output.stderr += f"{status}\n"
        status = 0 if status is None else 1
    os.environ.clear()
    os.environ.update(saved_env)
    os.chdir(saved_cwd)
    sys.argv, sys.path[:] = saved_argv, saved_path
    if job_path:  # modules the job imported from its own path (a stand-in package)
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if any(origin.startswith(p) for p in job_path):
                del sys.modules[name]
    return {"status": status, "stdout": output.stdout, "stderr": output.stderr}


@dataclass
class _Output:
    stdout: str = ""
    stderr: str = ""


@contextlib.contextmanager
def _captured() -> Iterator[_Output]:
    """File descriptors 1 and 2 into temporary files for the block (C code's output too)."""
    output = _Output()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = []
        for fd, f in ((1, out), (2, err)):
            _flush()
            saved.append(os.dup(fd))
            os.dup2(f.fileno(), fd)
        try:
            yield output
        finally:
            _flush()
            for fd, original in zip((1, 2), saved):
                os.dup2(original, fd)
                os.close(original)
            out.seek(0)
            err.seek(0)
            output.stdout = out.read().decode(errors="replace")
            output.stderr = err.read().decode(errors="replace") + output.stderr


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


_POOL: list[WorkerPool] = []


def pool() -> WorkerPool:
    """This test process's pool, started on first use (``tests/conftest.py`` closes it)."""
    if not _POOL:
        _POOL.append(WorkerPool())
    return _POOL[0]


def close_pool() -> None:
    while _POOL:
        _POOL.pop().close()
