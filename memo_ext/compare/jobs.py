"""One configuration of a comparison (``memo-compare``) as one torchrun job, and what came of it.

A :class:`Method` is what a comparison varies (a method of ``memo_ext.features.registry.COMPARED``:
Megatron's recomputation, megatron-core's offloading, MEMO, …, each its feature's), how it is
spelled on the command line (``memo:alpha=0.25@tp4cp2``), optionally in its own layout;
:func:`run_job` runs one job with a time limit and returns a :class:`JobOutcome`, in which an
out-of-memory failure is a result (``oom``, with the bytes the allocator was asked for) and a job
past its limit is stopped and recorded (``timeout``). A method this machine cannot run
(:meth:`Method.refusal`) is a result too (``refused``), and no job starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memo_ext.errors import OutOfMemory, UsageError, out_of_memory
from memo_ext.features.compared import ComparedMethod, Settings
from memo_ext.features.registry import COMPARED, compared_method
from memo_ext.features.spelling import GRAMMAR, parse_spelling, spell
from memo_ext.parallel import ParallelLayout, parse_layout


@dataclass(frozen=True)
class Method:
    """One method of a comparison, with its settings, optionally in its own parallel layout."""

    name: str
    """A method of ``memo_ext.features.registry.COMPARED``."""
    settings: Settings = ()
    """Its ``KEY=VALUE`` settings, each checked and in its one spelling (``alpha=0.5``)."""
    layout: str | None = None
    """A layout such as ``tp4cp2`` (SP on with TP > 1), or ``None`` for the comparison's."""

    @property
    def spec(self) -> ComparedMethod:
        """What the method's feature says of it (``memo_ext.features.registry.COMPARED``)."""
        return compared_method(self.name)

    @property
    def label(self) -> str:
        """The spelling that names this method in tables, plots and the JSON file."""
        return spell(self.name, self.settings, self.layout)

    def trainer_flags(self, keep_last_layers: int | None = None) -> list[str]:
        """The trainer's flags that select this method (with the comparison's kept last layers
        where the method keeps layers)."""
        return self.spec.trainer_flags(dict(self.settings), keep_last_layers=keep_last_layers)

    def refusal(self) -> str | None:
        """Why this machine cannot run the method (one sentence), or ``None``: asked on every
        invocation, so a comparison resumed on a machine that can run it runs it."""
        return self.spec.refusal()

    def resolve_layout(self, default: ParallelLayout, world_size: int) -> ParallelLayout:
        """This method's layout: its own, or ``default`` with DP the rest of the world."""
        if self.layout is None:
            return default.with_world(world_size)
        return parse_layout(self.layout, world_size)


def parse_method(text: str, *, notice: Callable[[str], None] | None = None) -> Method:
    """``NAME[:KEY=VALUE,...][@LAYOUT]`` (:mod:`memo_ext.features.spelling`): ``memo``,
    ``memo:alpha=0.5,rule=tokenwise``, ``full@tp8``, ``memo+plan:alpha=auto@tp4cp2``; the
    method checks its own settings. The old ``memo=0.5`` is read, with one line to ``notice``
    (default: standard error).

    Raises:
        UsageError: for an unknown method, a setting it does not take or cannot read.
    """
    spelling = parse_spelling(text, flag="--methods")
    spec = compared_method(spelling.name)
    if spec is None:
        raise UsageError(
            f"--methods: {text!r}: no method {spelling.name!r}; one of "
            f"{', '.join(m.name for m in COMPARED)} ({GRAMMAR}, e.g. memo:alpha=0.5@tp4cp2)"
        )
    if spelling.notice:
        (notice or _to_stderr)(spelling.notice)
    settings = spec.parse_settings(spelling.settings, text=text.strip())
    return Method(name=spelling.name, settings=settings, layout=spelling.layout)


def methods_help() -> str:
    """``--methods``' help: the grammar, the registered methods, and the settings they take."""
    takers: dict[tuple, list[str]] = {}
    for spec in COMPARED:
        if spec.settings_help:
            takers.setdefault(tuple(spec.settings_help.items()), []).append(spec.name)
    settings = "".join(
        f" {' and '.join(names)} take " + "; ".join(f"{k}: {v}" for k, v in keys) + "."
        for keys, names in takers.items()
    )
    return (
        f"{GRAMMAR} each, e.g. memo:alpha=0.5@tp4cp2 (@LAYOUT gives a method its own layout, SP "
        f"on with TP > 1). Methods: {', '.join(m.name for m in COMPARED)}.{settings}"
    )


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


# --- the job's command line -------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How each job is started: torchrun's process counts, and the rendezvous for several
    nodes (each node runs torchrun; ``prefix`` such as ``srun`` starts one per node)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous when ``nnodes`` > 1."""
    prefix: tuple[str, ...] = ()
    """Command words put before each job (``srun --ntasks-per-node 1 ...``)."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def check(self) -> None:
        """Raises UsageError for counts below 1 or several nodes without a rendezvous."""
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise UsageError("--nproc-per-node and --nnodes must be at least 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the first node)")

    def torchrun_argv(self, *, job_id: str) -> list[str]:
        """``python -m memo_ext.launch`` (torchrun that ends with the failed rank's sentence and
        exit status) with this launch's flags."""
        argv = [*self.prefix, sys.executable, "-m", "memo_ext.launch"]
        argv += ["--nproc-per-node", str(self.nproc_per_node)]
        if self.nnodes == 1:
            return argv + ["--standalone"]
        return argv + [
            "--nnodes",
            str(self.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            str(self.rdzv_endpoint),
            "--rdzv-id",
            job_id,
        ]


# --- running one job --------------------------------------------------------------------------

OK, OOM, TIMEOUT, ERROR, REFUSED = "ok", "oom", "timeout", "error", "refused"
"""A job's status: trained, out of memory (device memory, or MEMO's host budget), stopped at its
time limit, failed otherwise; or the method cannot run on this machine and no job started."""

_OUR_OOM = re.compile(r"tried to allocate (\d+) bytes")
# the sentences of MEMO's HostMemoryError (memo_ext.memo.alpha / runtime / transfer), exit status 2
_HOST_MEMORY = re.compile(r"\bof host memory\b|\bthe host budget\b")
_RAISED = re.compile(r"\b[A-Z]\w*(Error|Exception): .*$")


@dataclass
class JobOutcome:
    """How one job ended."""

    status: str
    exit_status: int | None
    wall_s: float
    message: str = ""
    """The failed rank's sentence, or the last line of the output."""
    requested_bytes: int | None = None
    """``oom``: the allocation that failed."""
    peak_rss_bytes: int | None = None
    """Largest resident set of the launcher and its processes on this node (ru_maxrss)."""
    records: list[dict] = field(default_factory=list)
    """The job's metrics records."""


def run_job(
    argv: list[str],
    *,
    log_path: Path,
    metrics_path: Path,
    timeout_s: float,
    env: dict[str, str],
    on_tick: Callable[[float], None] = lambda elapsed: None,
) -> JobOutcome:
    """Runs ``argv`` (output to ``log_path``) until it ends or ``timeout_s`` passes.

    A job past its limit gets SIGTERM (torchrun then stops its workers), and SIGKILL for it and
    every process it started that is still there 20 s later. ``on_tick`` is called about twice a
    second with the seconds elapsed (a progress display).
    """
    metrics_path.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        status, usage, timed_out = _wait(proc, timeout_s=timeout_s, start=start, on_tick=on_tick)
    wall_s = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status) if status is not None else None
    outcome = _classify(code, log_path.read_text(errors="replace"), timed_out=timed_out)
    outcome.wall_s = wall_s
    outcome.peak_rss_bytes = usage.ru_maxrss * 1024 if usage is not None else None
    if outcome.status == OK:
        outcome.records = _read_records(metrics_path)
        if not outcome.records:
            outcome.status, outcome.message = ERROR, "the job wrote no metrics"
    return outcome


def _wait(proc: subprocess.Popen, *, timeout_s: float, start: float, on_tick):
    """(wait status, resource usage of it and its waited-for descendants, timed out?)."""
    deadline = start + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            return status, usage, False
        if time.monotonic() > deadline:
            break
        on_tick(time.monotonic() - start)
        time.sleep(0.5)
    family = _descendants(proc.pid)
    _signal(proc.pid, signal.SIGTERM)
    grace = time.monotonic() + 20
    while time.monotonic() < grace:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.5)
    else:
        _signal(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for child in family:  # workers in sessions of their own that torchrun left behind
        _signal(child, signal.SIGKILL)
    return status, usage, True


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _descendants(root: int) -> list[int]:
    """Processes below ``root`` now (Linux ``/proc``), deepest last."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _classify(code: int | None, output: str, *, timed_out: bool) -> JobOutcome:
    """The outcome an exit status and the job's output say."""
    lines = [line for line in output.splitlines() if line.strip()]
    failed = [line for line in lines if " failed: " in line or ": error: " in line]
    message = (failed or lines or [""])[-1].strip()
    raised = [line for line in lines if _RAISED.search(line)]
    if raised and "its output above says why" in message:  # a traceback: its last line says
        message = f"{message}: {_RAISED.search(raised[-1]).group(0)}"
    if timed_out:
        return JobOutcome(TIMEOUT, code, 0.0, message="stopped at the time limit")
    if code == 0:
        return JobOutcome(OK, code, 0.0)
    requested = _requested_bytes(output)
    if code == OutOfMemory.exit_status or requested is not None or "out of memory" in message:
        return JobOutcome(OOM, code, 0.0, message=message, requested_bytes=requested)
    if code == UsageError.exit_status and _HOST_MEMORY.search(message):
        # MEMO refused the length for its host budget: a result like out of device memory (a
        # shorter sequence needs less), not bad input
        return JobOutcome(OOM, code, 0.0, message=message)
    return JobOutcome(ERROR, code, 0.0, message=message)


def _requested_bytes(output: str) -> int | None:
    """The size of the failed allocation, from the trainer's sentence or torch's own error."""
    ours = _OUR_OOM.findall(output)
    if ours:
        return int(ours[-1])
    for line in reversed(output.splitlines()):
        if "out of memory" in line.lower() or "can't allocate memory" in line:
            oom = out_of_memory(RuntimeError(line))
            if oom is not None and oom.requested_bytes is not None:
                return oom.requested_bytes
    return None


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured_figures(records: list[dict], *, warmup_steps: int) -> dict:
    """Medians over the measured steps (those after ``warmup_steps``), peaks, and MEMO's
    per-step figures of the last step."""
    steps = [r for r in records if r.get("iteration", 0) > warmup_steps] or records[-1:]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key: str) -> int | None:
        values = [r[key] for r in steps if r.get(key) is not None]
        return max(values) if values else None

    last = steps[-1] if steps else {}
    return {
        "steps": len(steps),
        "step_time_s": median("step_time_s"),
        "tokens_per_s": median("tokens_per_s"),
        "tflops_per_device": median("tflops_per_device"),
        "mfu": median("mfu"),
        "mem_allocated_bytes": peak("mem_allocated_bytes"),
        "mem_reserved_bytes": peak("mem_reserved_bytes"),
        "host_offload_bytes": last.get("host_offload_bytes"),
        "memo_alpha": last.get("memo_alpha"),
        "memo_recomputed_tokens": last.get("memo_recomputed_tokens"),
        "loss": last.get("loss"),
    }
