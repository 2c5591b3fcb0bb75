"""Reproduce the Megatron baseline comparisons: methods × sequence lengths, measured and predicted.

Each configuration (a method at a sequence length) trains for a few warm-up and measured steps
as its own torchrun job (``python -m memo_ext.launch``, synthetic tokens). Out of memory is a
result: the row says OOM and how many bytes the allocator was asked for; a job past
``--job-timeout-s`` is stopped and recorded. The estimator's prediction (step time, MFU, peak
memory) stands next to every measurement, and the per-layer figures traced on fake tensors
(activation bytes kept, host bytes, recompute FLOPs) next to those. Examples::

    # CPU: a tiny model at three lengths, and the longest each method trains at under a cap
    python -m tools.compare_methods --num-layers 8 --hidden-size 64 --num-attention-heads 4 \\
        --vocab-size 512 --micro-batch-size 8 --methods none full memo=0 \\
        --seq-lengths 256 512 1024 --find-max --granularity 256 --max-seq-length 4096 \\
        --memory-limit-gb 0.25 --out runs/compare_cpu

    # one 8-GPU node: the paper's 7B, Megatron full recomputation (TP 8, TP 4 × CP 2) and MEMO
    python -m tools.compare_methods --model gpt-7b --nproc-per-node 8 \\
        --methods full@tp8 full@tp4cp2 memo@tp8 --find-max --granularity 65536 \\
        --calibrate runs/compare_7b/calibration.json --out runs/compare_7b -- --bf16

Methods: ``none``, ``selective``, ``full`` (Megatron's), ``megatron-offload`` (megatron-core's
fine-grained activation offloading; CUDA and transformer-engine, else each of its rows says
``refused`` and no job starts), ``memo`` (α by the rule) or ``memo=A``, ``memo+plan`` (with the
planned allocator), each optionally ``@LAYOUT`` (``tp4cp2``: TP 4 with SP, CP 2, DP the rest).
Flags after ``--`` go to every job unchanged (``--bf16``, ``--attention-backend flash``, …).

Written to ``--out``: ``compare.json`` (every run's raw figures, the longest lengths found, the
calibration), ``compare.png`` (MFU against sequence length per method with each method's longest
marked; estimated against measured step time) and ``jobs/`` (each job's log and metrics).
Rerunning with the same ``--out`` skips finished configurations. ``--calibrate FILE`` times the
kernels, fits the estimator's efficiencies to the measured steps and writes them for
``tools.estimate --calibration FILE`` and the trainer's ``--calibration FILE``. Bad input: one
sentence, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")  # megatron-core's import-time notices about optional kernels

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from memo_ext.config import MemoConfig, ModelConfig  # noqa: E402
from memo_ext.config.network import resolve_attention_backend  # noqa: E402
from memo_ext.errors import UsageError  # noqa: E402
from memo_ext.estimate.calibration import (  # noqa: E402
    KernelRates,
    StepSample,
    apply_calibration,
    fit_efficiencies,
    fitted_calibration,
    kernel_calibration,
    measure_kernels,
)
from memo_ext.estimate.cost_model import Batch, Efficiency, EstimateError, estimate  # noqa: E402
from memo_ext.estimate.measure import trace_layer  # noqa: E402
from memo_ext.flags import add_flags, cli_fields, flag_name, overrides_from_flags  # noqa: E402
from memo_ext.hardware import (  # noqa: E402
    DEVICES,
    GIB,
    Calibration,
    DeviceSpec,
    available_host_memory_bytes,
    cuda_device,
    device_spec,
    read_calibration,
    write_calibration,
)
from memo_ext.parallel import LayoutError, ParallelLayout  # noqa: E402
from memo_ext.shapes import MODELS, ModelShape, model_shape  # noqa: E402
from tools.compare_report import format_summary, format_table, plot_comparison  # noqa: E402
from tools.memory_report import Setup, method_figures  # noqa: E402
from tools.method_jobs import (  # noqa: E402
    OK,
    OOM,
    REFUSED,
    ROOT,
    TIMEOUT,
    JobOutcome,
    Launch,
    Method,
    measured_figures,
    parse_method,
    run_job,
)

logger = logging.getLogger("compare_methods")
FORMAT = "memo-compare/1"
MODEL_FIELDS = tuple(f.name for f in cli_fields(ModelShape)) + ("vocab_size",)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence, exit 2
        print(f"compare_methods: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        description=__doc__.split("\n")[0],
        epilog="Flags after -- are passed to every training job unchanged.",
    )
    what = p.add_argument_group("what to compare")
    what.add_argument(
        "--methods",
        nargs="+",
        default=["none", "full", "memo"],
        help="METHOD[=ALPHA][@LAYOUT] each: none, selective, full, megatron-offload, memo (=A: "
        "fixed α, else auto), memo+plan; @tp4cp2 gives a method its own layout.",
    )
    what.add_argument("--seq-lengths", nargs="+", type=int, default=[], help="Lengths to run.")
    what.add_argument(
        "--find-max",
        action="store_true",
        help="Also search, by real runs, the longest length each method trains at (doubling "
        "from the longest known to train, then halving the gap down to --granularity).",
    )
    what.add_argument(
        "--granularity",
        type=int,
        default=None,
        help="--find-max's step, tokens (default: the smallest --seq-lengths, else 1024).",
    )
    what.add_argument(
        "--max-seq-length", type=int, default=1 << 22, help="--find-max stops here, tokens."
    )
    what.add_argument(
        "--find-max-start",
        type=int,
        default=None,
        help="--find-max's first length when no listed length trained (default: the "
        "estimator's longest on a GPU, else --granularity).",
    )
    _add_model_flags(p)
    _add_launch_flags(p)
    _add_device_flags(p)
    out = p.add_argument_group("output")
    out.add_argument("--out", default="runs/compare", help="Folder of the results (resumable).")
    out.add_argument("--no-plot", action="store_true", help="Skip compare.png.")
    out.add_argument(
        "--retry-errors",
        action="store_true",
        help="Rerun configurations that ended in an error (not OOM or timeout) last time.",
    )
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("model and batch (the trainer's flags)")
    group.add_argument(
        "--model", default=None, help=f"Preset ({', '.join(MODELS)}); the flags below override it."
    )
    add_flags(group, ModelShape, section="shape", overrides=True, only=MODEL_FIELDS)
    add_flags(group, ModelConfig, section="model", overrides=True, only=("loss_chunks",))
    group.add_argument("--micro-batch-size", type=int, default=1, help="Sequences per micro-batch.")
    group.add_argument(
        "--num-microbatches", type=int, default=1, help="Micro-batches per step and DP rank."
    )
    add_flags(group, MemoConfig, section="memo", only=("keep_last_layers",))
    group.add_argument("--warmup-steps", type=int, default=1, help="Steps before measuring.")
    group.add_argument("--measure-steps", type=int, default=2, help="Steps measured (median).")


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("launch")
    group.add_argument("--nproc-per-node", type=int, default=1, help="Processes per node.")
    group.add_argument("--nnodes", type=int, default=1, help="Nodes.")
    group.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (several nodes)."
    )
    group.add_argument(
        "--launcher-prefix",
        default="",
        help="Words before each job, e.g. 'srun --nodes 2 --ntasks-per-node 1' (one torchrun "
        "per node).",
    )
    add_flags(group, ParallelLayout, section="layout")
    group.add_argument(
        "--job-timeout-s", type=float, default=900, help="A job running longer is stopped."
    )
    group.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="Start no job after this many seconds; report what finished (a rerun goes on).",
    )
    group.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="The trainer's --memory-limit-gb for every job: out of memory past this many GiB "
        "(CUDA: device memory; CPU: growth of each process's data segment).",
    )


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("estimator")
    group.add_argument(
        "--gpu",
        default=None,
        help=f"Device preset for the predictions ({', '.join(DEVICES)}); default: the CUDA "
        "device, or this CPU measured.",
    )
    group.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="Host memory per node for the predictions, GiB (default: available now).",
    )
    group.add_argument(
        "--calibration", metavar="FILE", default=None, help="Predict with this calibration."
    )
    group.add_argument(
        "--calibrate",
        metavar="FILE",
        default=None,
        help="Time the kernels, fit the estimator's efficiencies to the measured steps and write "
        "them to FILE (memo-calibration/1).",
    )


# --- the comparison, resolved once --------------------------------------------------------


@dataclass
class Comparison:
    """Everything a comparison runs with, resolved and checked from the flags."""

    model: ModelShape
    methods: list[Method]
    layouts: dict[str, ParallelLayout]
    """Method label → its layout (DP included)."""
    seq_lengths: list[int]
    find_max: bool
    granularity: int
    max_seq_length: int
    find_max_start: int | None
    launch: Launch
    micro_batch_size: int
    num_microbatches: int
    keep_last_layers: int | None
    loss_chunks: int
    warmup_steps: int
    measure_steps: int
    timeout_s: float
    time_budget_s: float | None
    memory_limit_gb: float | None
    extra: list[str]
    out: Path
    device: DeviceSpec
    """The device the predictions are for (on CPU: this CPU, measured)."""
    cuda: bool
    host_memory_bytes: int
    efficiency: Efficiency
    kernels: KernelRates | None
    calibrate_path: Path | None
    retry_errors: bool
    notes: list[str] = field(default_factory=list)

    @property
    def fp32(self) -> bool:
        """The jobs train in fp32 (no --bf16 / --fp16 among the passed flags)."""
        return not ({"--bf16", "--fp16"} & set(self.extra))

    def signature(self) -> dict:
        """What makes two comparisons' runs interchangeable (not the methods or lengths)."""
        return {
            "model": dataclasses.asdict(self.model),
            "launch": [self.launch.nproc_per_node, self.launch.nnodes],
            "batch": [self.micro_batch_size, self.num_microbatches],
            "steps": [self.warmup_steps, self.measure_steps],
            "keep_last_layers": self.keep_last_layers,
            "loss_chunks": self.loss_chunks,
            "memory_limit_gb": self.memory_limit_gb,
            "extra": self.extra,
        }


def resolve(args: argparse.Namespace, extra: list[str]) -> Comparison:
    """The comparison the flags describe, every input checked before any job runs.

    Raises:
        UsageError: one sentence naming the flag to change.
    """
    model = _model(args)
    launch = Launch(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        prefix=tuple(shlex.split(args.launcher_prefix)),
    )
    launch.check()
    methods = [parse_method(text) for text in args.methods]
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--methods names a method twice: {' '.join(labels)}")
    if not args.seq_lengths and not args.find_max:
        raise UsageError("give --seq-lengths, --find-max or both")
    granularity = args.granularity
    if granularity is None:
        granularity = min(args.seq_lengths) if args.seq_lengths else 1024
    _check_counts(args, granularity)
    layouts = _layouts(args, methods, launch, model, [*args.seq_lengths, granularity])
    device, cuda, kernels, notes = _device(args, model, launch)
    extra, backend = _one_attention_backend(extra, methods)
    notes.append(f"attention: {backend} for every method (--attention-backend {backend})")
    efficiency = Efficiency(loss_chunks=getattr(args, "model.loss_chunks") or 1)
    if args.calibration:
        calibration = read_calibration(args.calibration)
        device, efficiency = apply_calibration(calibration, device=device, efficiency=efficiency)
    host = args.host_memory_gb * GIB if args.host_memory_gb else available_host_memory_bytes()
    return Comparison(
        model=model,
        methods=methods,
        layouts=layouts,
        seq_lengths=sorted(set(args.seq_lengths)),
        find_max=args.find_max,
        granularity=granularity,
        max_seq_length=args.max_seq_length,
        find_max_start=args.find_max_start,
        launch=launch,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        keep_last_layers=getattr(args, "memo.keep_last_layers"),
        loss_chunks=getattr(args, "model.loss_chunks") or 1,
        warmup_steps=args.warmup_steps,
        measure_steps=args.measure_steps,
        timeout_s=args.job_timeout_s,
        time_budget_s=args.time_budget_s,
        memory_limit_gb=args.memory_limit_gb,
        extra=extra,
        out=Path(args.out),
        device=device,
        cuda=cuda,
        host_memory_bytes=int(host),
        efficiency=efficiency,
        kernels=kernels,
        calibrate_path=Path(args.calibrate) if args.calibrate else None,
        retry_errors=args.retry_errors,
        notes=notes,
    )


def _one_attention_backend(extra: list[str], methods: list[Method]) -> tuple[list[str], str]:
    """The jobs' flags with one ``--attention-backend`` for every method, and that backend.

    Left to ``auto``, the baselines would take transformer-engine's attention where MEMO (which
    rebuilds layers from our core attention) takes flash-attn or SDPA, and the table would mix
    the kernels' difference into the methods'. The backend passed after ``--`` is used when
    given; else the one MEMO's ``auto`` picks on this machine.

    Raises:
        UsageError: transformer-engine's attention with a MEMO method among the methods.
    """
    given = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--attention-backend"]
    given += [a.split("=", 1)[1] for a in extra if a.startswith("--attention-backend=")]
    memo = any(m.is_memo for m in methods)
    if given:
        backend = given[-1]
        if backend == "te" and memo:
            raise UsageError(
                "--attention-backend te cannot run MEMO (its layers use our core attention); "
                "compare on --attention-backend flash or sdpa"
            )
        if backend != "auto":
            return extra, backend
    backend = resolve_attention_backend("auto", allow_te=not memo)
    rest = [a for i, a in enumerate(extra) if not _is_backend_flag(extra, i)]
    return [*rest, "--attention-backend", backend], backend


def _is_backend_flag(extra: list[str], i: int) -> bool:
    a = extra[i]
    return a.startswith("--attention-backend") or (i > 0 and extra[i - 1] == "--attention-backend")


def _model(args: argparse.Namespace) -> ModelShape:
    given = overrides_from_flags(ModelShape, args, section="shape", only=MODEL_FIELDS)
    if args.model is not None:
        model = model_shape(args.model, **given)
    else:
        required = ("num_layers", "hidden_size", "num_attention_heads")
        missing = [f"--{n.replace('_', '-')}" for n in required if n not in given]
        if missing:
            raise UsageError(f"give --model PRESET or the model's sizes ({', '.join(missing)})")
        given.setdefault("vocab_size", 50257)
        model = ModelShape(**given)
    model.check()
    if model.vocab_size < 2:
        raise UsageError(f"--vocab-size must be at least 2, got {model.vocab_size}")
    return model


def _check_counts(args: argparse.Namespace, granularity: int) -> None:
    counts = {
        "--granularity": granularity,
        "--max-seq-length": args.max_seq_length,
        "--micro-batch-size": args.micro_batch_size,
        "--num-microbatches": args.num_microbatches,
        "--warmup-steps": args.warmup_steps + 1,
        "--measure-steps": args.measure_steps,
        "--job-timeout-s": args.job_timeout_s,
        "--time-budget-s": args.time_budget_s or 1,
        "--memory-limit-gb": args.memory_limit_gb or 1,
    }
    for flag, value in counts.items():
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    for length in args.seq_lengths:
        if length < 2:
            raise UsageError(f"--seq-lengths must be at least 2 tokens each, got {length}")


def _layouts(args, methods, launch, model, lengths) -> dict[str, ParallelLayout]:
    default = ParallelLayout(
        tp=getattr(args, "layout.tp"),
        sp=getattr(args, "layout.sp"),
        pp=getattr(args, "layout.pp"),
        cp=getattr(args, "layout.cp"),
    )
    layouts = {}
    for method in methods:
        try:
            layout = method.resolve_layout(default, launch.world_size)
            for length in lengths:
                layout.check_fits(model, length)
        except LayoutError as err:
            raise UsageError(f"--methods {method.label}: {err}") from None
        layouts[method.label] = layout
    return layouts


def _device(args, model: ModelShape, launch: Launch):
    """(device for the predictions, CUDA?, kernel rates, notes). On CPU the kernels are timed
    here (the CPU's peak is its measured square-matrix rate); on CUDA only for --calibrate, in
    a process of its own so that this one never holds GPU memory while the jobs run."""
    cuda = torch.cuda.is_available()
    kernels, notes = None, []
    if not cuda:
        kernels = measure_kernels(model, device="cpu")
        memory = int(args.memory_limit_gb * GIB) if args.memory_limit_gb else None
        device = DeviceSpec(
            name="cpu",
            peak_tflops=kernels.square_matmul_tflops,
            memory_bytes=memory or available_host_memory_bytes(),
            host_link_gbps=kernels.host_link_gbps,
            nvlink_gbps=kernels.host_link_gbps / 2,
            internode_gbps=1.0,
            gpus_per_node=launch.nproc_per_node,
        )
        notes.append(
            "CPU: peak = measured fp32 square-matmul rate; the estimator models bf16 mixed "
            "precision, so its memory figures are not the fp32 CPU run's; measured peak "
            "memory is the process's resident set (interpreter and libraries included); "
            "MEMO's host copies live in the same memory a CPU cap counts"
        )
        return device, cuda, kernels, notes
    if args.calibrate:
        kernels = _kernels_in_subprocess(model)
    if args.gpu:
        device = device_spec(args.gpu)
    else:
        device = cuda_device()
        if device is None:
            raise UsageError(
                f"this GPU is not in the device table; give --gpu ({', '.join(DEVICES)})"
            )
    if args.memory_limit_gb:
        limit = int(args.memory_limit_gb * GIB)
        device = dataclasses.replace(device, memory_bytes=min(limit, device.memory_bytes))
    return device, cuda, kernels, notes


def _kernels_in_subprocess(model: ModelShape) -> KernelRates:
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure_kernels, model, device="cuda").result()


# --- one configuration --------------------------------------------------------------------


def model_flags(model: ModelShape) -> list[str]:
    """The trainer's flags for ``model`` (its vocabulary through ``NullTokenizer``, which adds
    one token for end-of-document)."""
    argv = []
    for f in cli_fields(ModelShape):
        value = getattr(model, f.name)
        if isinstance(value, bool):
            argv += [flag_name(f)] if value != f.default else []
        elif value is not None:
            argv += [flag_name(f), str(value)]
    return argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size - 1)]


def layout_flags(layout: ParallelLayout) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout.tp)]
    flags += ["--context-parallel-size", str(layout.cp)]
    flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    return flags + (["--sequence-parallel"] if layout.sp else [])


def job_argv(comp: Comparison, method: Method, seq: int, *, metrics: Path, job_id: str):
    """The command of one configuration's job."""
    layout = comp.layouts[method.label]
    argv = comp.launch.torchrun_argv(job_id=job_id) + [str(ROOT / "pretrain_gpt_memo.py")]
    argv += model_flags(comp.model) + layout_flags(layout) + method.trainer_flags()
    if method.is_memo and comp.keep_last_layers is not None:
        argv += ["--memo-keep-last-layers", str(comp.keep_last_layers)]
    batch = comp.micro_batch_size * layout.dp * comp.num_microbatches
    argv += ["--seq-length", str(seq), "--micro-batch-size", str(comp.micro_batch_size)]
    argv += ["--global-batch-size", str(batch), "--lr", "1e-4", "--mock-data"]
    argv += ["--train-iters", str(comp.warmup_steps + comp.measure_steps), "--log-interval", "1"]
    argv += ["--metrics-file", str(metrics), "--skip-preflight"]  # real runs decide what fits
    if comp.loss_chunks > 1:
        argv += ["--loss-chunks", str(comp.loss_chunks)]
    if not comp.cuda:  # MFU against the CPU's measured peak
        argv += ["--device-peak-tflops", f"{comp.device.peak_tflops:.6g}"]
    if comp.memory_limit_gb is not None:
        argv += ["--memory-limit-gb", f"{comp.memory_limit_gb:g}"]
    return argv + comp.extra


def run_key(comp: Comparison, method: Method, seq: int) -> str:
    layout = dataclasses.asdict(comp.layouts[method.label])
    text = json.dumps([comp.signature(), method.label, layout, seq], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predict(comp: Comparison, method: Method, seq: int, *, efficiency=None, device=None) -> dict:
    """The estimator's figures for one configuration (``error`` when it cannot estimate it)."""
    try:
        est = _estimate(comp, method, seq, efficiency=efficiency, device=device)
    except (EstimateError, UsageError) as err:
        return {"step_time_s": None, "mfu": None, "peak_memory_bytes": None, "error": str(err)}
    return {
        "step_time_s": est.step_time_s,
        "mfu": est.mfu,
        "peak_memory_bytes": est.device_peak_bytes,
        "fits": est.fits,
        "activation_bytes": est.activation_bytes,
        "host_bytes": est.host_bytes,
        "recompute_flops": est.recompute_flops,
        "alpha": est.alpha,
        "compute_s": est.compute_s,
        "exposed_comm_s": est.exposed_comm_s,
        "exposed_host_copy_s": est.exposed_host_copy_s,
    }


def _estimate(comp: Comparison, method: Method, seq: int, *, efficiency=None, device=None):
    return estimate(
        model=comp.model,
        device=device or comp.device,
        layout=comp.layouts[method.label],
        batch=Batch(
            micro_batch_size=comp.micro_batch_size,
            num_microbatches=comp.num_microbatches,
            distributed_optimizer="--use-distributed-optimizer" in comp.extra,
        ),
        method=method.estimator_method(),
        seq_length=seq,
        host_memory_bytes=comp.host_memory_bytes,
        memo=MemoConfig(enabled=True, alpha=method.alpha, keep_last_layers=comp.keep_last_layers),
        efficiency=efficiency or comp.efficiency,
    )


def traced_figures(comp: Comparison, method: Method, seq: int, alpha: float | None) -> dict:
    """Activation bytes kept, host bytes and recompute FLOPs of one iteration of one process,
    traced on fake tensors in the jobs' precision (``tools.memory_report``'s figures)."""
    layout = comp.layouts[method.label]
    if layout.cp > 1:
        return {"note": "context parallelism cannot be traced on fake tensors"}
    if method.name == "megatron-offload":
        return {"note": "megatron-core's offloading is not traced on fake tensors"}
    key = method.estimator_method()
    if method.is_memo:
        key = f"memo-{alpha if alpha is not None else 0.0:g}"
    setup = Setup(
        shape=comp.model,
        layout=layout,
        seq_length=seq,
        micro_batch_size=comp.micro_batch_size,
        micro_batches=comp.num_microbatches,
        fp32=comp.fp32,
        keep_last_layers=comp.keep_last_layers,
    )
    kw = dict(tp=layout.tp, sp=layout.sp, tokens=seq, micro_batch_size=comp.micro_batch_size)
    layers = {m: trace_layer(comp.model, method=m, fp32=comp.fp32, **kw) for m in {"none", key}}
    figures = dataclasses.asdict(method_figures(setup, layers)[key])
    return {**figures, "traced_as": key, "dtype": "fp32" if comp.fp32 else "bf16"}


# --- running the comparison ---------------------------------------------------------------


class Results:
    """``compare.json``: every run so far, saved after each one (so a stopped comparison
    resumes where it stopped)."""

    def __init__(self, comp: Comparison) -> None:
        self.path = comp.out / "compare.json"
        self.comp = comp
        self.runs: dict[str, dict] = {}
        self.searches: dict[str, dict] = {}
        self.calibration: dict | None = None
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(
                f"{self.path} cannot be read ({err}); remove it to start over"
            ) from None
        if data.get("format") != FORMAT or data.get("signature") != _jsonable(
            self.comp.signature()
        ):
            raise UsageError(
                f"{self.path} holds a comparison of another model, launch, step count or trainer "
                "flags; use another --out or remove it"
            )
        self.runs = {run["key"]: run for run in data.get("runs", [])}
        self.searches = data.get("find_max", {})
        self.calibration = data.get("calibration")

    def save(self) -> None:
        comp = self.comp
        data = {
            "format": FORMAT,
            "signature": _jsonable(comp.signature()),
            "methods": [m.label for m in comp.methods],
            "layouts": {k: dataclasses.asdict(v) for k, v in comp.layouts.items()},
            "device": dataclasses.asdict(comp.device),
            "efficiency": dataclasses.asdict(comp.efficiency),
            "kernels": dataclasses.asdict(comp.kernels) if comp.kernels else None,
            "notes": comp.notes,
            "runs": list(self.runs.values()),
            "find_max": self.searches,
            "calibration": self.calibration,
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def current(self) -> list[dict]:
        """Runs of this comparison's methods."""
        labels = {m.label for m in self.comp.methods}
        return [r for r in self.runs.values() if r["method"] in labels]


def _jsonable(value):
    return json.loads(json.dumps(value))


class BudgetSpent(Exception):
    """--time-budget-s has passed: no new job starts."""


class Runner:
    """Runs configurations once each, records them, and shows progress."""

    def __init__(self, comp: Comparison, results: Results, bar: tqdm) -> None:
        self.comp, self.results, self.bar = comp, results, bar
        self.deadline = time.monotonic() + (comp.time_budget_s or float("inf"))
        (comp.out / "jobs").mkdir(parents=True, exist_ok=True)

    def run(self, method: Method, seq: int) -> dict:
        """The record of ``method`` at ``seq`` tokens: from the file, else from a new job; for a
        method this machine cannot run, a ``refused`` record (decided anew on every invocation,
        so a machine that can run it does)."""
        key = run_key(self.comp, method, seq)
        if self.bar.n >= self.bar.total:  # a search's runs are not known in advance
            self.bar.total = self.bar.n + 1
        done = self.results.runs.get(key)
        retry = done is not None and (
            done["status"] == REFUSED or (self.comp.retry_errors and done["status"] == "error")
        )
        if done is not None and not retry:
            self.bar.update(1)
            return done
        refusal = method.refusal()
        if refusal is None and time.monotonic() > self.deadline:
            raise BudgetSpent
        if refusal is not None:
            record = self._record(method, seq, key, JobOutcome(REFUSED, None, 0.0, refusal))
        else:
            record = self._run_job(method, seq, key)
        self.results.runs[key] = record
        self.results.save()
        self.bar.update(1)
        tqdm.write(_one_line(record), file=sys.stderr)
        return record

    def _run_job(self, method: Method, seq: int, key: str) -> dict:
        comp = self.comp
        stem = f"{method.label.replace('@', '_at_').replace('=', '_').replace('+', 'p')}_{seq}"
        metrics, log = comp.out / "jobs" / f"{stem}.jsonl", comp.out / "jobs" / f"{stem}.log"
        argv = job_argv(comp, method, seq, metrics=metrics, job_id=f"compare-{key}")
        name = f"{method.label} @ {seq:,}"
        self.bar.set_postfix_str(name)
        live = sys.stderr.isatty()  # a log file gets the bar's own, rarer lines
        tick = lambda s: self.bar.set_postfix_str(f"{name}: {s:.0f} s", refresh=live)  # noqa: E731
        outcome = run_job(
            argv,
            log_path=log,
            metrics_path=metrics,
            timeout_s=comp.timeout_s,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            on_tick=tick,
        )
        return self._record(
            method, seq, key, outcome, log=str(log.relative_to(comp.out)), command=argv
        )

    def _record(
        self,
        method: Method,
        seq: int,
        key: str,
        outcome: JobOutcome,
        *,
        log: str | None = None,
        command: list[str] | None = None,
    ) -> dict:
        """The JSON record of one configuration: what ``outcome`` says, next to the estimate and
        the traced figures (``log`` and ``command`` are ``None`` where no job ran)."""
        comp = self.comp
        measured = measured_figures(outcome.records, warmup_steps=comp.warmup_steps)
        measured["peak_rss_bytes"] = outcome.peak_rss_bytes
        cuda_peak = measured.get("mem_allocated_bytes")
        if outcome.status == OK:  # a failed job's peak is that of its last moments, not a run's
            cpu_peak = outcome.peak_rss_bytes
            measured["peak_memory_bytes"] = cuda_peak if cuda_peak is not None else cpu_peak
            measured["peak_memory_source"] = "allocated" if cuda_peak is not None else "process RSS"
        predicted = predict(comp, method, seq)
        alpha = measured.get("memo_alpha") if outcome.status == OK else predicted.get("alpha")
        return {
            "key": key,
            "method": method.label,
            "seq_length": seq,
            "layout": dataclasses.asdict(comp.layouts[method.label]),
            "status": outcome.status,
            "exit_status": outcome.exit_status,
            "message": outcome.message,
            "requested_bytes": outcome.requested_bytes,
            "wall_s": outcome.wall_s,
            "measured": measured,
            "predicted": predicted,
            "deterministic": traced_figures(comp, method, seq, method.alpha or alpha),
            "log": log,
            "command": command,
        }


def _one_line(record: dict) -> str:
    status = record["status"]
    text = f"{record['method']} @ {record['seq_length']:,}: {status}"
    if status == OK:
        step = record["measured"]["step_time_s"]
        text += f", {step:.3g} s/step" if step is not None else ""
    elif record.get("message"):
        text += f" ({record['message'][-160:]})"
    return text


def find_longest(comp: Comparison, runner: Runner, method: Method) -> dict:
    """The longest length ``method`` trains at, by real runs over multiples of the granularity:
    from the longest known to train, double until one fails (out of memory or past the time
    limit), then halve the gap; a failure of another kind stops the search."""
    unit = comp.granularity
    lo, hi = _known_bounds(runner.results.current(), method.label)
    if lo is None and hi is None:
        seq = _round(comp.find_max_start or _predicted_longest(comp, method), unit)
        lo, hi, stop = _probe(runner, method, seq, lo, hi)
        if stop:
            return {"longest": None, "bound": stop}
    while True:
        if lo is None:
            seq = _round(hi // 2, unit)
            if seq >= hi:
                return {"longest": None, "bound": f"{hi:,} fails and nothing shorter to try"}
        elif hi is None:
            if lo >= comp.max_seq_length:
                return {"longest": lo, "bound": "reached --max-seq-length"}
            seq = min(_round(2 * lo, unit), comp.max_seq_length)
        else:
            if hi - lo <= unit:
                return {"longest": lo, "bound": f"{hi:,} does not train"}
            seq = max(_round((lo + hi) // 2, unit), lo + unit)
        lo, hi, stop = _probe(runner, method, seq, lo, hi)
        if stop:
            return {"longest": lo, "bound": stop}


def _probe(runner: Runner, method: Method, seq: int, lo, hi):
    record = runner.run(method, seq)
    if record["status"] == OK:
        return seq, hi, None
    if record["status"] in (OOM, TIMEOUT):
        return lo, seq, None
    return lo, hi, f"{seq:,} failed: {record['message']}"


def _known_bounds(runs: list[dict], label: str) -> tuple[int | None, int | None]:
    """(longest that trained, shortest above it that ran out of memory or time)."""
    mine = [r for r in runs if r["method"] == label]
    trained = [r["seq_length"] for r in mine if r["status"] == OK]
    lo = max(trained, default=None)
    failed = [
        r["seq_length"]
        for r in mine
        if r["status"] in (OOM, TIMEOUT) and (lo is None or r["seq_length"] > lo)
    ]
    return lo, min(failed, default=None)


def _round(seq: int, unit: int) -> int:
    return max(unit, seq // unit * unit)


def _predicted_longest(comp: Comparison, method: Method) -> int:
    """The estimator's longest fitting multiple of the granularity (on CPU, where it models
    another precision and memory than the run's: the granularity)."""
    unit = comp.granularity
    if not comp.cuda:
        return unit

    def fits(seq: int) -> bool:
        try:
            return _estimate(comp, method, seq).fits
        except (EstimateError, UsageError):
            return False

    seq = unit
    while fits(2 * seq) and 2 * seq <= comp.max_seq_length:
        seq *= 2
    return seq


# --- calibration --------------------------------------------------------------------------


def calibrate(comp: Comparison, results: Results) -> Calibration:
    """Kernels timed alone, then efficiencies fitted to every trained run's measured step."""
    kernels = comp.kernels or measure_kernels(comp.model, device="cpu")
    base = kernel_calibration(kernels, device=comp.device.name, peak_tflops=comp.device.peak_tflops)
    device = dataclasses.replace(comp.device, host_link_gbps=base.host_link_gbps)
    prior = dataclasses.replace(
        comp.efficiency, matmul=base.matmul_efficiency, attention=base.attention_efficiency
    )
    # a method the estimator does not model (megatron-offload) has no prediction to fit
    runs = [
        r
        for r in results.current()
        if r["status"] == OK and r["measured"]["step_time_s"] and r["predicted"]["step_time_s"]
    ]
    methods = {m.label: m for m in comp.methods}
    if not runs:
        return base
    efficiency = prior
    for _ in range(2):  # exposed copies depend on the layer time, hence on the efficiencies
        samples = [_sample(comp, methods[r["method"]], r, device, efficiency) for r in runs]
        fit = fit_efficiencies(samples, prior=prior)
        efficiency = dataclasses.replace(prior, matmul=fit.matmul, attention=fit.attention)
    calibration = fitted_calibration(fit, base=base, samples=samples)
    for run in runs:
        predicted = predict(
            comp, methods[run["method"]], run["seq_length"], efficiency=efficiency, device=device
        )
        measured = run["measured"]["step_time_s"]
        run["calibrated"] = {
            "step_time_s": predicted["step_time_s"],
            "mfu": predicted["mfu"],
            "step_time_error": predicted["step_time_s"] / measured - 1,
        }
    return calibration


def _sample(comp, method: Method, run: dict, device, efficiency) -> StepSample:
    seq = run["seq_length"]
    unit = dataclasses.replace(efficiency, matmul=1.0, attention=1.0)
    half = dataclasses.replace(efficiency, matmul=0.5, attention=1.0)
    at_one = _estimate(comp, method, seq, efficiency=unit, device=device)
    at_half = _estimate(comp, method, seq, efficiency=half, device=device)
    now = _estimate(comp, method, seq, efficiency=efficiency, device=device)
    matmul_s = at_half.compute_s - at_one.compute_s
    return StepSample(
        label=f"{method.label}@{seq}",
        measured_s=run["measured"]["step_time_s"],
        matmul_s=matmul_s,
        attention_s=at_one.compute_s - matmul_s,
        other_s=now.step_time_s - now.compute_s,
    )


def format_calibration(calibration: Calibration) -> str:
    lines = [
        f"calibration ({calibration.source}) of {calibration.device}: matmul efficiency "
        f"{calibration.matmul_efficiency:.3f}, attention efficiency "
        f"{calibration.attention_efficiency:.3f} of {calibration.peak_tflops:.4g} TFLOP/s, host "
        f"link {calibration.host_link_gbps:.1f} GB/s"
    ]
    fit = calibration.details.get("fit")
    if fit:
        within = "yes" if fit["max_abs_error"] <= 0.10 else "NO"
        lines.append(
            f"calibrated step-time error over {fit['runs']} runs: max "
            f"{100 * fit['max_abs_error']:.1f}% (within 10%: {within})"
        )
    return "\n".join(lines)


# --- entry point --------------------------------------------------------------------------


def compare(comp: Comparison) -> Results:
    """Runs the grid and the searches (each configuration at most once), then calibrates."""
    comp.out.mkdir(parents=True, exist_ok=True)
    results = Results(comp)
    grid = [(m, s) for m in comp.methods for s in comp.seq_lengths]
    # a terminal gets a live bar; a log file a line every 30 s at most
    every = 0.5 if sys.stderr.isatty() else 30
    with tqdm(
        total=len(grid), unit="job", desc="compare", file=sys.stderr, mininterval=every
    ) as bar:
        runner = Runner(comp, results, bar)
        try:
            for method, seq in grid:
                runner.run(method, seq)
            for method in comp.methods if comp.find_max else []:
                results.searches[method.label] = find_longest(comp, runner, method)
                results.save()
        except BudgetSpent:
            comp.notes.append("--time-budget-s spent: the rest was not run (rerun to go on)")
            for method in comp.methods if comp.find_max else []:
                if method.label not in results.searches:
                    known, _ = _known_bounds(results.current(), method.label)
                    results.searches[method.label] = {"longest": known, "bound": "not finished"}
    if comp.calibrate_path is not None:
        calibration = calibrate(comp, results)
        write_calibration(str(comp.calibrate_path), calibration)
        results.calibration = {"file": str(comp.calibrate_path), **dataclasses.asdict(calibration)}
        results.save()
    return results


def report(comp: Comparison, results: Results, *, plot: bool) -> None:
    """Table, summary and (unless told not to) the plot."""
    runs = results.current()
    labels = [m.label for m in comp.methods]
    print(format_table(runs))
    print()
    print(format_summary(runs, labels, results.searches))
    for note in comp.notes:
        print(f"note: {note}")
    if results.calibration:
        fields = {f.name for f in dataclasses.fields(Calibration)}
        saved = {k: v for k, v in results.calibration.items() if k in fields}
        print(format_calibration(Calibration(**saved)))
        print(f"calibration written to {results.calibration['file']}")
    print(f"results: {results.path}")
    if not plot:
        return
    path = comp.out / "compare.png"
    where = "CPU" if not comp.cuda else comp.device.name
    title = (
        f"{comp.model.name}: {comp.model.num_layers} layers, h {comp.model.hidden_size} on "
        f"{comp.launch.nnodes} × {comp.launch.nproc_per_node} {where}"
    )
    note = (
        "of the measured CPU matmul peak"
        if not comp.cuda
        else f"of {comp.device.peak_tflops:g} TFLOP/s"
    )
    try:
        plot_comparison(runs, labels, path, title=title, mfu_note=note)
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib, or the plots extra)")
        return
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(own)
    try:
        comp = resolve(args, extra)
        results = compare(comp)
    except UsageError as err:
        print(f"compare_methods: error: {err}", file=sys.stderr)
        return 2
    report(comp, results, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
