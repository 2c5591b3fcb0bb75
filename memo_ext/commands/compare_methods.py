"""Reproduce the Megatron baseline comparisons: methods × sequence lengths, measured and predicted.

Each configuration (a method at a sequence length) trains for a few warm-up and measured steps
as its own torchrun job (``python -m memo_ext.launch``, synthetic tokens). Out of memory is a
result: the row says OOM and how many bytes the allocator was asked for; a job past
``--job-timeout-s`` is stopped and recorded. The estimator's prediction (step time, MFU, peak
memory) stands next to every measurement, and the per-layer figures traced on fake tensors
(activation bytes kept, host bytes, recompute FLOPs) next to those. Examples::

    # CPU: a tiny model at three lengths, and the longest each method trains at under a cap
    python -m tools.compare_methods --num-layers 8 --hidden-size 64 --num-attention-heads 4 \\
        --vocab-size 512 --micro-batch-size 8 --methods none full memo:alpha=0 \\
        --seq-lengths 256 512 1024 --find-max --granularity 256 --max-seq-length 4096 \\
        --memory-limit-gb 0.25 --out runs/compare_cpu

    # one 8-GPU node: the paper's 7B, Megatron full recomputation (TP 8, TP 4 × CP 2) and MEMO
    python -m tools.compare_methods --model gpt-7b --nproc-per-node 8 \\
        --methods full@tp8 full@tp4cp2 memo@tp8 --find-max --granularity 65536 \\
        --loss-chunks 16 --calibrate runs/compare_7b/calibration.json --out runs/compare_7b \\
        -- --bf16

Methods: ``none``, ``selective``, ``full`` (Megatron's), ``megatron-offload`` (megatron-core's
fine-grained activation offloading; CUDA and transformer-engine, else each of its rows says
``refused`` and no job starts), ``memo`` (α by the rule) or ``memo:alpha=A,rule=NAME``,
``memo+plan`` (with the planned allocator), each optionally ``@LAYOUT`` (``tp4cp2``: TP 4 with
SP, CP 2, DP the rest). A plugin's methods (``--plugin``) join the list.
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
import logging
import os
import shlex
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")  # megatron-core's import-time notices about optional kernels

from tqdm import tqdm  # noqa: E402

from memo_ext.compare.calibration import calibrate, format_calibration  # noqa: E402
from memo_ext.compare.comparison import Comparison  # noqa: E402
from memo_ext.compare.jobs import (  # noqa: E402
    Launch,
    Method,
    methods_help,
    parse_method,
)
from memo_ext.compare.report import format_summary, format_table, plot_comparison  # noqa: E402
from memo_ext.compare.runs import BudgetSpent, Results, Runner  # noqa: E402
from memo_ext.compare.search import find_longest, known_bounds  # noqa: E402
from memo_ext.config import MemoConfig, ModelConfig  # noqa: E402
from memo_ext.config.network import resolve_attention_backend  # noqa: E402
from memo_ext.device import on_gpu  # noqa: E402
from memo_ext.errors import UsageError  # noqa: E402
from memo_ext.estimate.calibration import (  # noqa: E402
    KernelRates,
    apply_calibration,
    measure_kernels,
)
from memo_ext.estimate.cost_model import Efficiency  # noqa: E402
from memo_ext.flags import (  # noqa: E402
    SpellCheckedParser,
    add_flags,
    cli_fields,
    finite_float,
    overrides_from_flags,
)
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
from memo_ext.plugins import add_flag, with_plugins  # noqa: E402
from memo_ext.shapes import MODELS, ModelShape, model_shape  # noqa: E402

MODEL_FIELDS = tuple(f.name for f in cli_fields(ModelShape)) + ("vocab_size",)


PROG = "memo-compare"
"""The installed command: its usage line and error prefix."""


class _Parser(SpellCheckedParser):
    def error(self, message: str) -> None:  # one sentence, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog="Flags after -- are passed to every training job unchanged.",
        allow_abbrev=False,
    )
    what = p.add_argument_group("what to compare")
    what.add_argument(
        "--methods",
        nargs="+",
        default=["none", "full", "memo"],
        help=methods_help(),
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
    add_flag(p)
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
        "--job-timeout-s", type=finite_float, default=900, help="A job running longer is stopped."
    )
    group.add_argument(
        "--time-budget-s",
        type=finite_float,
        default=None,
        help="Start no job after this many seconds; report what finished (a rerun goes on).",
    )
    group.add_argument(
        "--memory-limit-gb",
        type=finite_float,
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
        type=finite_float,
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
    memo = any(m.spec.core_attention_only for m in methods)
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
    """Each method's layout, checked against the model and the lengths, and the method against
    its stages (MEMO: a layer left to offload), before any job runs."""
    keep = getattr(args, "memo.keep_last_layers")
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
        try:
            stages = model.num_layers // layout.pp
            method.spec.check(dict(method.settings), stage_layers=stages, keep_last_layers=keep)
        except UsageError as err:
            raise UsageError(f"--methods {method.label}: {err}") from None
        layouts[method.label] = layout
    return layouts


def _device(args, model: ModelShape, launch: Launch):
    """(device for the predictions, CUDA?, kernel rates, notes). On CPU the kernels are timed
    here (the CPU's peak is its measured square-matrix rate); on CUDA only for --calibrate, in
    a process of its own so that this one never holds GPU memory while the jobs run."""
    cuda = on_gpu()
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
            gpus_per_host_link=1,  # a memory copy of the host: nothing shared to model
            numa_nodes=1,
        )
        notes.append(
            "CPU: peak = measured fp32 square-matmul rate; the estimator models bf16 mixed "
            "precision, so its memory figures are not the fp32 CPU run's; a CPU run records "
            "no allocator peak; MEMO's host copies live in the same memory a CPU cap counts"
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
                    known, _ = known_bounds(results.current(), method.label)
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
    if not any(run["measured"].get("peak_memory_bytes") for run in runs):
        print(
            "(peak mem meas: the device allocator's peak from each run's metrics; CPU runs "
            "record none)"
        )
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


@with_plugins(PROG)
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
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    report(comp, results, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
