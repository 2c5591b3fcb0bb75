"""Training jobs for the tests, and reading back their metrics.

:func:`run_pretrain` runs one job of ``nproc`` gloo ranks in the session's worker pool
(:mod:`tests.workers`: processes started once, jobs run in place); :func:`reference_run` trains
a reference once per session for every test that compares against it; :func:`launch_pretrain`
launches a real ``torchrun``, for what only a launch shows.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from memo_ext.training.metrics import curve_differences, read_metrics
from tests.workers import DEFAULT_ENTRY, JobResult, free_port, pool

ROOT = Path(__file__).resolve().parents[1]


def cli(**flags: object) -> list[str]:
    """Command-line arguments from keywords, in order: ``cli(num_layers=4, mock_data=True)`` is
    ``["--num-layers", "4", "--mock-data"]`` (``True``: a bare switch; a list: several values)."""
    argv: list[str] = []
    for name, value in flags.items():
        argv.append("--" + name.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            argv += [str(v) for v in value]
        elif value is not True:
            argv.append(str(value))
    return argv


SMALL_GPT = cli(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    seq_length=128,
    micro_batch_size=2,
    train_iters=10,
    lr="1e-3",
    mock_data=True,
)
"""A small GPT on mock data: the flags the argument tests start from."""

TINY_LLAMA = cli(
    num_layers=2,
    hidden_size=36,
    ffn_hidden_size=50,
    num_attention_heads=6,
    group_query_attention=True,
    num_query_groups=2,
    seq_length=28,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    micro_batch_size=2,
    mock_data=True,
    seed=11,
)
"""A LLaMA-style layer (GQA, RoPE, RMSNorm, SwiGLU, no biases) small enough for many runs; the
tests add the schedule."""

SMALL_LLAMA = cli(
    hidden_size=48,
    ffn_hidden_size=70,  # an odd width: no kernel's favourite
    num_attention_heads=6,
    group_query_attention=True,
    num_query_groups=2,
    seq_length=44,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
)
"""The parity tests' LLaMA-style model (GQA, RoPE, RMSNorm, SwiGLU, no biases); each test adds
its layer count."""

GPU_LLAMA = cli(
    hidden_size=256,
    num_attention_heads=4,
    lr="1e-3",
    mock_data=True,
    position_embedding_type="rope",
    swiglu=True,
    normalization="RMSNorm",
    attention_dropout=0,
    hidden_dropout=0,
)
"""The GPU tests' LLaMA-style model, wide enough for real kernels; each test adds the layers,
sequence, batch and steps it needs."""


def run_pretrain(
    args: list[str],
    *,
    nproc: int,
    workdir: Path,
    name: str,
    timeout_s: int = 600,
    module: str | None = None,
    own_keys: tuple[str, ...] = (),
) -> list[dict]:
    """Train with ``args`` on ``nproc`` ranks of the session's worker pool; the metrics records,
    each checked against the documented keys (:func:`documented`).

    ``module``: a module whose ``main(argv)`` runs instead of ``pretrain_gpt_memo.main``, for
    tests that patch the trainer first (it must undo its patches when it returns); the keys it
    adds to a record are its ``METRIC_KEYS``. ``own_keys``: keys the test itself wrote into the
    metrics file before the run appended to it.

    Raises:
        AssertionError: when the job fails, with every rank's output for diagnosis.
    """
    metrics = workdir / f"{name}.jsonl"
    result = run_job(
        [*args, "--metrics-file", str(metrics), "--log-interval", "1"],
        nproc=nproc,
        module=module,
        timeout_s=timeout_s,
    )
    assert result.status == 0, f"{name} failed:\n{result.describe()}"
    extra = getattr(importlib.import_module(module), "METRIC_KEYS", ()) if module else ()
    return documented(read_metrics(metrics), extra=extra, own_keys=own_keys)


def documented(
    records: list[dict], *, extra: tuple = (), own_keys: tuple[str, ...] = ()
) -> list[dict]:
    """``records``, once every key of each is found documented with its type (docs/metrics.md's
    metrics table, ``memo_ext.training.metric_keys``; ``extra``: the ``MetricKey`` of a
    test's own extension), ``own_keys`` aside."""
    from memo_ext.training.metric_keys import undocumented

    for record in records:
        kept = {k: v for k, v in record.items() if k not in own_keys}
        problems = undocumented(kept, extra)
        assert not problems, f"iteration {record.get('iteration')}: {'; '.join(problems)}"
    return records


def run_job(
    args: list[str],
    *,
    nproc: int = 1,
    module: str | None = None,
    entry: str = DEFAULT_ENTRY,
    timeout_s: float = 600,
) -> JobResult:
    """``pretrain_gpt_memo.py args`` (or ``module``'s ``main``, or ``entry``:
    ``"module:function"``) on ``nproc`` ranks of the pool, whatever its outcome: each rank's
    status and output. The job sees this process's environment, as a launch from here would.

    A job with ``--memo-allocator plan`` installs torch's CPU allocator for the rest of its
    process, as on a GPU: its workers are replaced after it.
    """
    if module:
        entry = f"{module}:main"
    return pool().run(
        args,
        nproc=nproc,
        entry=entry,
        env=dict(os.environ),
        timeout_s=timeout_s,
        fresh_after=_plans_memory(args),
    )


def train_fails(args: list[str], *, status: int, nproc: int = 1) -> str:
    """A job that must end with exit ``status``: the last line its failed rank wrote to stderr.

    Raises:
        AssertionError: on another status, or a traceback.
    """
    result = run_job(args, nproc=nproc)
    assert result.status == status, f"status {result.status}, not {status}:\n{result.describe()}"
    if status != 1:
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


TORCHRUN_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


def alone_env(**changes: str) -> dict[str, str]:
    """This process's environment for a trainer started as a plain one-process command: without
    the torchrun variables a test worker may hold (its own world's port, taken), on a free port."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    return {**env, "MASTER_PORT": str(free_port()), **changes}


def run_tool(module: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m module args`` (a tool with a ``main(argv)``) as a one-process job of the pool:
    its exit status, standard output and error as ``subprocess.run`` would give them."""
    job = pool().run(
        list(args), nproc=1, entry=f"{module}:main", env=dict(os.environ), timeout_s=timeout_s
    )
    (rank,) = job.ranks
    return subprocess.CompletedProcess([module, *args], rank.status, rank.stdout, rank.stderr)


def _plans_memory(args: list[str]) -> bool:
    return any(a == "--memo-allocator" and b == "plan" for a, b in zip(args, args[1:]))


_REFERENCE_LOCK = "references.lock"


def reference_run(args: list[str], *, nproc: int = 1, cache_dir: Path) -> list[dict]:
    """The metrics of ``args`` on ``nproc`` ranks, trained once per test session and shared by
    every test (and every pytest-xdist worker) that asks for the same run.

    ``cache_dir``: the session's shared folder (the ``reference_runs`` fixture). Arguments that
    name files must name the same files for two tests to share a run.
    """
    key = hashlib.sha256(json.dumps([nproc, list(map(str, args))]).encode()).hexdigest()[:20]
    metrics = cache_dir / f"{key}.jsonl"
    with FileLock(str(cache_dir / _REFERENCE_LOCK)):
        if not metrics.exists():
            run_pretrain(args, nproc=nproc, workdir=cache_dir, name=f"{key}.partial")
            (cache_dir / f"{key}.partial.jsonl").replace(metrics)
    return read_metrics(metrics)


def launch_pretrain(
    args: list[str],
    *,
    nproc: int,
    workdir: Path,
    name: str,
    timeout_s: int = 600,
) -> list[dict]:
    """Train with ``args`` under a real ``torchrun`` of ``nproc`` processes (the ``launch``
    tests: what only a launch shows, and GPU runs); return the metrics records.

    Raises:
        AssertionError: when the job fails, with its output for diagnosis.
    """
    metrics = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(ROOT / "pretrain_gpt_memo.py"),
        *args,
        "--metrics-file",
        str(metrics),
        "--log-interval",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return documented(read_metrics(metrics))


def assert_same_curves(reference: list[dict], other: list[dict], *, rtol: float) -> None:
    """Loss and gradient norm agree at every logged iteration to ``rtol``
    (``tools/compare_metrics.py``'s rule)."""
    differences = curve_differences(reference, other, rtol=rtol)
    assert not differences, "\n".join(differences)


def unserved_steps(records: list[dict]) -> list[tuple[int, float]]:
    """The served steps (iteration 3 on: steps 1 and 2 record and plan) whose planned requests
    missed, as ``(iteration, hit ratio)``, apart from what the design allows: a block freed
    later than its plan says (another thread's timing) makes the next planned request over its
    bytes miss, counted as an overlap, and its kind is planned again at that step's end with
    the block living to the end of its pass (``plan_replans`` grows). Such a step may dip below
    0.99; any other miss, or a dip without a re-plan, is reported."""
    found = []
    for before, record in zip(records, records[1:]):
        ratio = record.get("plan_hit_ratio")
        if record["iteration"] < 3 or (ratio is not None and ratio >= 0.99):
            continue
        replanned = record["plan_replans"] > before["plan_replans"]
        if ratio is None or not (
            replanned and record["plan_misses"] == record["plan_miss_overlap"]
        ):
            found.append((record["iteration"], ratio))
    return found
