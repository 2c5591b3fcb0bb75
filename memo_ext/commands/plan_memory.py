"""Plan the activation memory of a training iteration offline, from a trace or a model.

From a trace file (``memo-trace/1`` JSON, or a MiniMalloc CSV ``id,lower,upper,size``)::

    python -m tools.plan_memory --trace layer.trace.json --out layer.plan.json --work-limit 60

From a model (traces one iteration under fake tensors, then plans it bi-level)::

    python -m tools.plan_memory --model gpt-7b --seq-length 1048576 --micro-batch-size 1 \\
        --tensor-model-parallel-size 8 --sequence-parallel --out 7b-1m.plan.json \\
        --save-trace 7b-1m.trace.json --compare-allocator --plot 7b-1m.png

Solvers: ``cpsat`` (default), ``canonical``, ``highs``, ``gurobi`` (needs a licence),
``heuristic``. The search is limited by ``--work-limit``, work counted rather than timed, so the
same trace and flags give the same plan on a busy machine as on an idle one (except with
``highs``, which takes only a time limit); ``--time-limit`` is a safety net in CPU seconds of
this process, so a slow or shared machine still gives the same plan. Prints
the plan's peak, the lower bound, the gap between them, the work spent and the time taken; exits
with status 2 and one sentence on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from memo_ext.arguments import OneSentenceParser, parse_tool_args
from memo_ext.config import DataConfig, TrainConfig, installed
from memo_ext.errors import UsageError
from memo_ext.flags import add_flags, finite_float, flag_values, overrides_from_flags
from memo_ext.parallel import ParallelLayout
from memo_ext.planner import PlannerConfig, load_trace, plan_trace, save_plan, save_trace
from memo_ext.planner.solvers import SOLVERS
from memo_ext.plugins import with_plugins
from memo_ext.shapes import MODELS, ModelShape, model_shape

logger = logging.getLogger("plan_memory")
GIB = float(1 << 30)
LAYOUT_FIELDS = ("tp", "sp", "cp")


PROG = "memo-plan-memory"
"""The installed command: its usage line and error prefix."""


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags (Megatron-LM's names for the model)."""
    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    source = parser.add_argument_group("input (one of)")
    source.add_argument(
        "--trace",
        help="memo-trace/1 JSON file, MiniMalloc CSV (*.csv), or a PyTorch memory snapshot with "
        "allocator history (*.pickle, *.pkl; CUDA device 0).",
    )
    source.add_argument("--model", choices=sorted(MODELS), help="Trace this model preset.")
    parser.add_argument("--out", required=True, help="Where to write the memo-plan/1 JSON.")
    parser.add_argument("--solver", default="cpsat", choices=sorted(SOLVERS))
    parser.add_argument(
        "--work-limit",
        type=finite_float,
        default=60.0,
        help="Search work, in work units of about a second of one core each (default 60); the "
        "same trace and flags give the same plan however busy the machine is.",
    )
    parser.add_argument(
        "--time-limit",
        type=finite_float,
        default=None,
        help="Safety net in CPU seconds of this process (default 10 per work unit, plus 10): a "
        "search still running then stops where it is, and the plan records that it was cut.",
    )
    parser.add_argument(
        "--alignment",
        type=int,
        default=None,
        help="Offset alignment in bytes (default: the one a trace saved by --save-trace "
        "records, else 1 for --trace, 512 for --model).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--bilevel",
        dest="bilevel",
        action="store_true",
        default=True,
        help="Plan layer passes once, then the iteration (default).",
    )
    mode.add_argument(
        "--flat", dest="bilevel", action="store_false", help="Plan every tensor in one problem."
    )
    parser.add_argument(
        "--no-levels",
        dest="levels",
        action="store_false",
        help="Search each problem whole, without first cutting it along its flat levels.",
    )
    parser.add_argument("--workers", type=int, default=2, help="Solver threads (default 2).")
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_argument_group("model (with --model; unset: the preset's)")
    add_flags(model, DataConfig, section="data", only=("seq_length",), overrides=True)
    add_flags(model, TrainConfig, section="train", only=("micro_batch_size",), overrides=True)
    add_flags(model, ParallelLayout, section="layout", only=LAYOUT_FIELDS)
    add_flags(model, ModelShape, section="shape", overrides=True)
    model.add_argument(
        "--memo-alpha",
        type=finite_float,
        default=None,
        help="Trace the layers under MEMO with this alpha in [0, 1] (default: without MEMO).",
    )
    model.add_argument(
        "--memo-chunk-tokens",
        type=int,
        default=None,
        help="With --memo-alpha: run the MEMO layers by sub-sequence chunks of this many local "
        "tokens (default: whole).",
    )
    model.add_argument("--save-trace", help="Also write the captured trace here.")
    report = parser.add_argument_group("fragmentation report")
    report.add_argument(
        "--compare-allocator",
        action="store_true",
        help="Replay the trace through a model of PyTorch's caching allocator.",
    )
    report.add_argument("--plot", help="PNG of both layouts (needs matplotlib).")
    return parser


def _seq_length(args: argparse.Namespace) -> int | None:
    return getattr(args, "data.seq_length")


def _check_args(args: argparse.Namespace) -> None:
    if args.plot and not installed("matplotlib"):  # before minutes of planning, not after
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or the plots extra)")
    if (args.trace is None) == (args.model is None):
        raise UsageError("give exactly one of --trace FILE or --model NAME")
    if args.model is not None and not _seq_length(args):
        raise UsageError("--model needs --seq-length (tokens per sequence)")
    if not args.work_limit > 0:
        raise UsageError(f"--work-limit must be positive, got {args.work_limit}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise UsageError(f"--time-limit must be positive, got {args.time_limit}")
    if args.memo_alpha is not None and (args.model is None or not 0 <= args.memo_alpha <= 1):
        raise UsageError("--memo-alpha needs --model and a value in [0, 1]")
    if args.memo_chunk_tokens is not None and (
        args.memo_alpha is None or args.memo_chunk_tokens < 1
    ):
        raise UsageError("--memo-chunk-tokens needs --memo-alpha and a positive token count")


def _trace_model(args: argparse.Namespace):
    # the tracer builds megatron-core layers: imported here, so --help answers at once
    from memo_ext.mcore.specs import build_layer_spec
    from memo_ext.mcore.transformer_config import traced_transformer_config
    from memo_ext.memo.policy import memo_trace_options
    from memo_ext.planner.capture import trace_transformer_layer

    shape = model_shape(args.model, **overrides_from_flags(ModelShape, args, section="shape"))
    shape.check()
    layout = ParallelLayout(
        **flag_values(ParallelLayout, args, section="layout", only=LAYOUT_FIELDS)
    )
    seq_length = _seq_length(args)
    layout.check_fits(shape, seq_length)  # before megatron-core's own asserts
    config = traced_transformer_config(shape, layout=layout)
    micro_batch_size = getattr(args, "train.micro_batch_size") or 1
    logger.info("tracing %s (%d layers) at %d tokens", args.model, shape.num_layers, seq_length)
    options = {}
    if args.memo_alpha is not None:
        spec = build_layer_spec(config=config, attention_backend="sdpa")
        options = memo_trace_options(
            config, spec, alpha=args.memo_alpha, chunk_tokens=args.memo_chunk_tokens
        )
    try:
        return trace_transformer_layer(
            config=config,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            num_layers=shape.num_layers,
            vocab_size=shape.vocab_size,
            **options,
        )
    except RuntimeError as err:
        raise UsageError(f"tracing the model failed ({str(err).splitlines()[0]})") from None


def _report_allocator(trace, plan, args: argparse.Namespace) -> None:
    from memo_ext.planner.caching_allocator import replay_caching_allocator

    replay = replay_caching_allocator(trace)
    print(
        f"caching allocator: reserved {replay.reserved_peak_bytes / GIB:.3f} GiB, "
        f"allocated {replay.allocated_peak_bytes / GIB:.3f} GiB; "
        f"plan {plan.peak_bytes / GIB:.3f} GiB "
        f"({1 - plan.peak_bytes / replay.reserved_peak_bytes:.1%} less reserved)"
    )
    if args.plot:
        from memo_ext.planner.plot import plot_layouts

        plot_layouts(trace=trace, plan=plan, replay=replay, path=args.plot)
        print(f"picture: {args.plot}")


def _alignment(args: argparse.Namespace, trace) -> int:
    """--alignment, else the one a trace saved by --save-trace records, else 512 for a traced
    model (the caching allocator's granularity, which the planned allocator keeps) and 1 for
    other trace files.

    Raises:
        UsageError: a recorded alignment that is not a positive byte count.
    """
    if args.alignment is not None:
        return args.alignment
    recorded = trace.meta.get("alignment")
    if recorded is None:
        return 1 if args.trace else 512
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 1:
        raise UsageError(
            f"{args.trace} records alignment {recorded!r}, not a positive byte count; give "
            "--alignment BYTES"
        )
    return recorded


def run(args: argparse.Namespace) -> None:
    """Loads or captures the trace, plans it, writes and reports the plan."""
    _check_args(args)
    t0, cpu0 = time.perf_counter(), time.process_time()
    trace = load_trace(args.trace) if args.trace else _trace_model(args)
    alignment = _alignment(args, trace)
    if args.save_trace:
        # the trace keeps the alignment it is planned at: planned again from its file, it
        # gives this plan, not one of its sizes unrounded
        trace.meta["alignment"] = alignment
        save_trace(trace, args.save_trace)
    time_limit_s = None
    if args.time_limit is not None:
        # a margin for building the problem, validating and writing the plan
        time_limit_s = max(0.9 * args.time_limit - (time.process_time() - cpu0), 0.5)
    config = PlannerConfig(
        solver=args.solver,
        work_limit=args.work_limit,
        time_limit_s=time_limit_s,
        alignment=alignment,
        bilevel=args.bilevel,
        workers=args.workers,
        seed=args.seed,
        levels=args.levels,
    )
    config.check()
    logger.info(
        "planning %d tensors with %s (%s, %g work units)",
        len(trace.allocs),
        args.solver,
        "bi-level" if args.bilevel else "flat",
        args.work_limit,
    )
    plan = plan_trace(trace, config=config)
    save_plan(plan, args.out)
    print(
        f"peak {plan.peak_bytes} bytes ({plan.peak_bytes / GIB:.3f} GiB), lower bound "
        f"{plan.lower_bound_bytes} bytes, gap {plan.gap:.2%}, {plan.status}, solver "
        f"{plan.solver}, {plan.extra['work_units']:.1f} work units and {plan.solve_s:.2f} s "
        f"solving, {time.perf_counter() - t0:.2f} s total"
    )
    print(f"plan: {args.out}")
    if args.compare_allocator or args.plot:
        _report_allocator(trace, plan, args)


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        args = parse_tool_args(build_parser(), argv)
        run(args)
    except (UsageError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
