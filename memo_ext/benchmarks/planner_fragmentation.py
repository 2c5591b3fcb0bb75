"""Fragmentation the static plan removes: PyTorch's caching allocator versus the planned peak.

Traces the 7B GPT (h 4096, 32 heads, ffn 16384) under fake tensors at 128K-1M tokens, with the
given TP / SP layout, for one layer (forward + backward) and for a whole iteration (embedding,
32 layers, loss), plans each (bi-level for the iteration), and replays the same trace through
the caching-allocator model. Run from the repository root:

    python -m benchmarks.planner_fragmentation --tensor-model-parallel-size 8 \\
        --sequence-parallel --json planner_fragmentation.json --plot-dir .

``--memo-alpha A [B ...]`` adds rows with the layers under MEMO at each α (host buffers are
host memory and not in the traces; fetches and recomputation are).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from memo_ext.flags import finite_float
from memo_ext.mcore.specs import build_layer_spec
from memo_ext.mcore.transformer_config import traced_transformer_config
from memo_ext.memo.policy import memo_trace_options
from memo_ext.parallel import ParallelLayout
from memo_ext.planner import PlannerConfig, plan_trace
from memo_ext.planner.caching_allocator import replay_caching_allocator
from memo_ext.planner.capture import trace_transformer_layer
from memo_ext.shapes import MODELS

GIB = float(1 << 30)


def measure(
    *,
    config,
    tokens: int,
    scope: str,
    work_limit: float,
    plot_dir: str | None,
    memo_alpha: float | None = None,
) -> dict:
    """Traces, plans and replays one case; returns its row."""
    model = MODELS["gpt-7b"]
    layers, vocab = (1, None) if scope == "layer" else (model.num_layers, model.vocab_size)
    options = {}
    if memo_alpha is not None:
        spec = build_layer_spec(config=config, attention_backend="sdpa")
        options = memo_trace_options(config, spec, alpha=memo_alpha)
    trace = trace_transformer_layer(
        config=config,
        seq_length=tokens,
        micro_batch_size=1,
        num_layers=layers,
        vocab_size=vocab,
        **options,
    )
    method = "plain" if memo_alpha is None else f"memo-{memo_alpha:g}"
    t0 = time.perf_counter()
    plan = plan_trace(trace, config=PlannerConfig(work_limit=work_limit, alignment=512))
    plan_s = time.perf_counter() - t0
    replay = replay_caching_allocator(trace)
    if plot_dir:
        from memo_ext.planner.plot import plot_layouts

        plot_layouts(
            trace=trace,
            plan=plan,
            replay=replay,
            path=f"{plot_dir}/planner_fragmentation_{method}_{scope}_{tokens // 1024}k.png",
        )
    return {
        "tokens": tokens,
        "scope": scope,
        "method": method,
        "tensors": len(trace.allocs),
        "lower_bound_gib": plan.lower_bound_bytes / GIB,
        "plan_gib": plan.peak_bytes / GIB,
        "plan_gap": plan.gap,
        "allocated_peak_gib": replay.allocated_peak_bytes / GIB,
        "reserved_peak_gib": replay.reserved_peak_bytes / GIB,
        "reserved_over_plan": replay.reserved_peak_bytes / plan.peak_bytes - 1,
        "plan_s": round(plan_s, 2),
        "status": plan.status,
    }


def table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| tokens | scope | method | tensors | lower bound GiB | plan GiB | gap "
        "| caching allocated GiB | caching reserved GiB | reserved / plan | plan s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens'] // 1024}K | {r['scope']} | {r['method']} | {r['tensors']} | "
            f"{r['lower_bound_gib']:.2f} | {r['plan_gib']:.2f} | {r['plan_gap']:.2%} | "
            f"{r['allocated_peak_gib']:.2f} | {r['reserved_peak_gib']:.2f} | "
            f"{r['reserved_over_plan']:+.1%} | {r['plan_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1 << 17, 1 << 18, 1 << 19, 1 << 20]
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, default=8)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--work-limit", type=finite_float, default=30.0)
    parser.add_argument("--json", default="planner_fragmentation.json")
    parser.add_argument("--plot-dir", default=None, help="Write PNG pictures here (matplotlib).")
    parser.add_argument(
        "--memo-alpha",
        type=finite_float,
        nargs="*",
        default=[],
        help="Also trace the layers under MEMO at each of these alphas.",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    layout = ParallelLayout(tp=args.tensor_model_parallel_size, sp=args.sequence_parallel)
    config = traced_transformer_config(MODELS["gpt-7b"], layout=layout)
    rows = []
    for tokens in args.tokens:
        for memo_alpha in [None, *args.memo_alpha]:
            for scope in ("layer", "iteration"):
                row = measure(
                    config=config,
                    tokens=tokens,
                    scope=scope,
                    work_limit=args.work_limit,
                    plot_dir=args.plot_dir,
                    memo_alpha=memo_alpha,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    with open(args.json, "w") as handle:
        json.dump(
            {"tp": args.tensor_model_parallel_size, "sp": args.sequence_parallel, "rows": rows},
            handle,
            indent=1,
        )


if __name__ == "__main__":
    main()
