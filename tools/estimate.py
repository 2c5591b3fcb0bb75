"""Memory, step time and MFU of GPT training at any scale, and the longest sequence that fits.

Answers "what is the longest sequence this model trains at on my machines, with which settings,
and how fast?" on a laptop: per-layer bytes and FLOPs are measured on fake tensors
(``memo_ext.estimate``) and scaled to the layout. Examples::

    python -m tools.estimate --model gpt-7b --gpus 8 --gpu a800-80g --host-memory-gb 2048 \\
        --method memo --seq-length 1048576 --tensor-model-parallel-size 8 --sequence-parallel
    python -m tools.estimate --model gpt-7b --gpus 8 --gpu a800-80g --host-memory-gb 2048 \\
        --method full --find-max-seq-length --json

With ``--json`` the last line printed is one JSON object. Bad input exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence, exit 2
        print(f"estimate: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from memo_ext.estimate.model import METHODS
    from memo_ext.estimate.presets import DEVICES, MODELS

    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-7b", help=f"Preset: {', '.join(MODELS)}.")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the job.")
    p.add_argument("--gpu", default="a800-80g", help=f"Device preset: {', '.join(DEVICES)}.")
    p.add_argument("--host-memory-gb", type=float, default=2048, help="Host memory per node, GiB.")
    p.add_argument("--method", choices=METHODS, default="memo", help="Memory method.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--seq-length", type=int, help="Estimate this sequence length.")
    what.add_argument("--find-max-seq-length", action="store_true", help="Search the longest.")
    p.add_argument("--granularity", type=int, default=4096, help="Search step / (2·CP), tokens.")
    p.add_argument("--json", action="store_true", help="End with one JSON line.")
    _add_model_overrides(p)
    _add_parallel_flags(p)
    _add_device_overrides(p)
    return p


def _add_model_overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model overrides (Megatron flags)")
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--vocab-size"):  # fmt: skip
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default=None)


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism and batch (Megatron flags; unset = searched)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--num-microbatches", type=int, default=1, help="Per step and DP rank.")
    g.add_argument(
        "--use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Shard optimizer state over DP.",
    )
    g.add_argument("--memo-alpha", default="auto", help="MEMO α in [0, 1], or auto (the rule).")
    g.add_argument("--memo-keep-last-layers", type=int, default=None, help="Default 2 (searched).")


def _add_device_overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device and efficiency overrides")
    g.add_argument("--device-peak-tflops", type=float, default=None)
    g.add_argument("--device-memory-gb", type=float, default=None, help="GiB.")
    g.add_argument("--host-link-gbps", type=float, default=None, help="Device<->host, GB/s.")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="Collective bus bw, GB/s.")
    g.add_argument("--internode-gbps", type=float, default=None, help="Per GPU, GB/s.")
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--matmul-efficiency", type=float, default=None)
    g.add_argument("--attention-efficiency", type=float, default=None)
    g.add_argument("--memory-headroom", type=float, default=None, help="Fraction kept free.")
    g.add_argument("--memo-host-share", type=float, default=None, help="Host share for MEMO.")
    g.add_argument(
        "--loss-chunks", type=int, default=None, help="The trainer's --loss-chunks (default 1)."
    )


def _inputs(args: argparse.Namespace):
    """(model, device, base layout, search space, efficiency) from validated flags."""
    from memo_ext.estimate.model import Efficiency, EstimateError, Layout
    from memo_ext.estimate.presets import GIB, device_spec, model_shape
    from memo_ext.estimate.search import SearchSpace

    model = model_shape(
        args.model,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=args.vocab_size,
        swiglu=args.swiglu,
        normalization=args.normalization,
        add_bias_linear=False if args.disable_bias_linear else None,
        position_embedding_type=args.position_embedding_type,
    )
    mem = args.device_memory_gb
    device = device_spec(
        args.gpu,
        peak_tflops=args.device_peak_tflops,
        memory_bytes=int(mem * GIB) if mem is not None else None,
        host_link_gbps=args.host_link_gbps,
        nvlink_gbps=args.nvlink_gbps,
        internode_gbps=args.internode_gbps,
        gpus_per_node=args.gpus_per_node,
    )
    _check_positive(args)
    alpha = None if args.memo_alpha == "auto" else _alpha(args.memo_alpha)
    defaults = Efficiency()
    efficiency = Efficiency(
        matmul=_pick(args.matmul_efficiency, defaults.matmul),
        attention=_pick(args.attention_efficiency, defaults.attention),
        headroom=_pick(args.memory_headroom, defaults.headroom),
        host_share=_pick(args.memo_host_share, defaults.host_share),
        loss_chunks=_pick(args.loss_chunks, defaults.loss_chunks),
    )
    base = Layout(
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        distributed_optimizer=args.use_distributed_optimizer,
    )
    space = SearchSpace(
        tp=args.tensor_model_parallel_size,
        cp=args.context_parallel_size,
        pp=args.pipeline_model_parallel_size,
        sp=args.sequence_parallel,
        keep_last_layers=args.memo_keep_last_layers,
        alpha=alpha,
    )
    if args.gpus % (space.pp * (space.tp or 1) * (space.cp or 1)):
        raise EstimateError(
            f"--gpus {args.gpus} must be a multiple of TP × CP × PP = "
            f"{space.pp * (space.tp or 1) * (space.cp or 1)}"
        )
    return model, device, base, space, efficiency


def _pick(value, default):
    return default if value is None else value


def _alpha(text: str) -> float:
    from memo_ext.estimate.model import EstimateError

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise EstimateError(f"--memo-alpha must be in [0, 1] or 'auto', got {text}")
    return value


def _check_positive(args: argparse.Namespace) -> None:
    from memo_ext.estimate.model import EstimateError

    for flag in ("gpus", "micro_batch_size", "num_microbatches", "pipeline_model_parallel_size",
                 "granularity", "host_memory_gb"):  # fmt: skip
        if getattr(args, flag) <= 0:
            name = "--" + flag.replace("_", "-")
            raise EstimateError(f"{name} must be positive, got {getattr(args, flag)}")
    fractions = ("matmul_efficiency", "attention_efficiency", "memory_headroom", "memo_host_share")
    for flag in fractions:
        value = getattr(args, flag)
        if value is not None and not 0.0 < value <= 1.0 and flag != "memory_headroom":
            raise EstimateError(f"--{flag.replace('_', '-')} must be in (0, 1], got {value}")
        if flag == "memory_headroom" and value is not None and not 0.0 <= value < 1.0:
            raise EstimateError(f"--memory-headroom must be in [0, 1), got {value}")
    if args.loss_chunks is not None and args.loss_chunks < 1:
        raise EstimateError(f"--loss-chunks must be at least 1, got {args.loss_chunks}")


def best_at_length(*, model, device, gpus, method, seq_length, host_memory_bytes, space, base,
                   efficiency):  # fmt: skip
    """The fastest fitting configuration at ``seq_length`` (else the one with the least memory)."""
    from memo_ext.estimate.model import EstimateError, estimate
    from memo_ext.estimate.search import _memo_options, candidate_layouts

    results = []
    for layout in candidate_layouts(model, device, gpus=gpus, space=space, base=base):
        for memo in _memo_options(space, method):
            try:
                results.append(
                    estimate(
                        model=model,
                        device=device,
                        layout=layout,
                        method=method,
                        seq_length=seq_length,
                        host_memory_bytes=host_memory_bytes,
                        memo=memo,
                        efficiency=efficiency,
                    )  # fmt: skip
                )
            except EstimateError:
                continue
    if not results:
        # no candidate accepts this length: let the user's own layout explain why
        from memo_ext.estimate.model import Layout, check_layout

        check_layout(model, Layout(tp=space.tp or 1, cp=space.cp or 1, pp=space.pp,
                                   sp=bool(space.sp)), seq_length=seq_length)  # fmt: skip
        raise EstimateError(f"no parallel layout of {gpus} GPUs accepts --seq-length {seq_length}")
    fitting = [r for r in results if r.fits]
    if fitting:
        return max(fitting, key=lambda r: r.mfu)
    return min(results, key=lambda r: r.device_peak_bytes)


def format_estimate(est) -> str:
    gib = 2**30
    lay = est.layout
    rows = [
        (
            "model / GPU",
            f"{est.model} on {lay['tp'] * lay['cp'] * lay['pp'] * lay['dp']} × {est.gpu}",
        ),
        (
            "method",
            est.method
            + (
                f" (α = {est.alpha:.3f}, keep last {est.keep_last_layers})"
                if est.method == "memo"
                else ""
            ),
        ),  # fmt: skip
        ("sequence length", f"{est.seq_length:,} tokens"),
        (
            "layout",
            f"TP {lay['tp']}{' + SP' if lay['sp'] else ''}, CP {lay['cp']}, "
            f"PP {lay['pp']}, DP {lay['dp']}, micro-batch {lay['micro_batch_size']} × "
            f"{lay['num_microbatches']}",
        ),  # fmt: skip
        ("model states", f"{est.model_state_bytes / gib:.2f} GiB"),
        ("stored activations", f"{est.activation_bytes / gib:.2f} GiB"),
        ("transient at peak", f"{est.transient_bytes / gib:.2f} GiB"),
        (
            "device peak",
            f"{est.device_peak_bytes / gib:.2f} GiB of {est.device_usable_bytes / gib:.2f}"
            f" usable ({'fits' if est.fits_device else 'does NOT fit'})",
        ),  # fmt: skip
        (
            "host (MEMO)",
            f"{est.host_bytes / gib:.2f} GiB of {est.host_budget_bytes / gib:.2f} "
            f"per GPU ({'fits' if est.fits_host else 'does NOT fit'})",
        ),  # fmt: skip
        (
            "step time",
            f"{est.step_time_s:.2f} s (compute {est.compute_s:.2f}, exposed comm "
            f"{est.exposed_comm_s:.2f}, exposed host copies {est.exposed_host_copy_s:.2f})",
        ),  # fmt: skip
        ("throughput", f"{est.tokens_per_s:,.0f} tokens/s"),
        ("MFU", f"{100 * est.mfu:.1f}%"),
    ]
    lines = [f"{k:<20} {v}" for k, v in rows]
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def json_record(est, *, searched: bool) -> dict:
    record = est.to_json()
    record.update(record.pop("layout"))
    if searched:
        record["max_seq_length"] = est.seq_length
    return record


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    args = build_parser().parse_args(argv)
    from memo_ext.estimate.model import EstimateError
    from memo_ext.estimate.presets import GIB
    from memo_ext.estimate.search import find_max_seq_length

    try:
        model, device, base, space, efficiency = _inputs(args)
        common = dict(model=model, device=device, gpus=args.gpus, method=args.method,
                      host_memory_bytes=int(args.host_memory_gb * GIB), space=space, base=base,
                      efficiency=efficiency)  # fmt: skip
        if args.seq_length is not None:
            est = best_at_length(seq_length=args.seq_length, **common)
        else:
            est = find_max_seq_length(granularity=args.granularity, **common)
    except (EstimateError, ValueError) as err:
        print(f"estimate: error: {err}", file=sys.stderr)
        return 2
    searched = args.seq_length is None
    if est is None:
        print(f"no layout of {args.gpus} × {device.name} fits {model.name} with --method "
              f"{args.method} even at {2 * args.granularity} tokens")  # fmt: skip
        if args.json:
            print(json.dumps({"method": args.method, "max_seq_length": None, "fits": False}))
        return 0
    if searched:
        print(f"longest sequence that fits: {est.seq_length:,} tokens")
    print(format_estimate(est))
    if args.json:
        print(json.dumps(json_record(est, searched=searched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
