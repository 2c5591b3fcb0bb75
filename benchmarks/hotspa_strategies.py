"""HotSPa against the best static layout, predicted: a GPT on 8 and 16 GPUs at 32K context.

For each length distribution (the demo corpus's documents in ByteTokenizer tokens, and a
Pareto draw), the expected packed rows per bucket and step are measured by packing the first
global batches; then the estimator's cost model predicts one step of

- **static**: every document packed into ``--seq-length`` rows, in the best single layout;
- **HotSPa**: each bucket in its best layout, weights and gradients switched (``switch``);
- **dynamic CP**: each bucket keeps home's TP and PP and only the CP degree changes.

Predicted, not measured: on CPU the figures come from the estimator (``docs/estimate.md``), which
also prices the switches (working copy bytes over NVLink / the network). Run from the
repository root:

    python -m benchmarks.hotspa_strategies --json hotspa_strategies.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math

import numpy as np

from memo_ext.config import parse_buckets
from memo_ext.data.demo_corpus import select_stdlib_files
from memo_ext.hardware import DEVICES, device_spec
from memo_ext.hotspa.auto import StrategyError, bucket_statistics, choose_strategies
from memo_ext.shapes import MODELS, model_shape


class LengthSource:
    """A document source whose documents have given lengths (their tokens do not matter)."""

    def __init__(self, lengths) -> None:
        self.lengths = [int(n) for n in lengths]

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, index: int) -> np.ndarray:
        return np.zeros(self.lengths[index], dtype=np.int64)


def demo_corpus_lengths() -> list[int]:
    """The demo corpus's documents: the standard library's sources, in bytes plus end-of-doc."""
    return [path.stat().st_size + 1 for path in select_stdlib_files()]


def pareto_lengths(n: int, *, seed: int, scale: int = 512, alpha: float = 1.1) -> list[int]:
    """``scale · (1 + Pareto(alpha))`` tokens: most documents short, a heavy tail of long ones."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.ceil(scale * (1 + rng.pareto(alpha, size=n)))]


def summarize(lengths: list[int], seq_length: int) -> dict:
    cut = np.minimum(np.asarray(lengths), seq_length)
    return {
        "documents": len(lengths),
        "median_tokens": int(np.median(cut)),
        "p99_tokens": int(np.percentile(cut, 99)),
        "at_cap": float(np.mean(cut == seq_length)),
    }


def compare(*, model, device, gpus: int, lengths, buckets, seq_length, gbs, seed) -> list[dict]:
    """Static, HotSPa and dynamic CP for one distribution and GPU count."""
    source = LengthSource(lengths)
    static = bucket_statistics(source, bounds=[seq_length], global_batch_size=gbs, seed=seed)
    stats = bucket_statistics(source, bounds=buckets, global_batch_size=gbs, seed=seed)
    out = []
    cases = [
        ("static", [seq_length], static, "switch"),
        ("hotspa", buckets, stats, "switch"),
        ("dynamic-cp", buckets, stats, "dynamic-cp"),
    ]
    for name, bounds, bucket_stats, mode in cases:
        r = [b.rows for b in bucket_stats]
        try:
            plan = choose_strategies(
                model=model,
                device=device,
                bounds=bounds,
                rows=r,
                world_size=gpus,
                mode=mode,
                attention_fractions=[b.attention_fraction for b in bucket_stats],
            )
        except StrategyError as err:
            out.append({"strategy": name, "gpus": gpus, "error": str(err)})
            continue
        out.append(
            {
                "strategy": name,
                "gpus": gpus,
                "layouts": ";".join(layout.name for layout in plan.layouts),
                "rows_per_step": [round(x, 2) for x in r],
                "step_s": plan.step_s,
                "switch_s": plan.switch_s,
                "switch_share": plan.switch_s / plan.step_s,
                "peak_gib": max(c.peak_bytes for c in plan.choices) / 2**30,
            }
        )
    static = out[0].get("step_s")
    for row in out:
        if static and "step_s" in row:
            row["speedup_vs_static"] = static / row["step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-7b", choices=sorted(MODELS))
    parser.add_argument("--device", default="h100-80g", choices=sorted(DEVICES))
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--hotspa-buckets", default="4096,8192,16384,32768")
    parser.add_argument("--global-batch-size", type=int, default=256, help="Documents per step.")
    parser.add_argument("--pareto-documents", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="Write the rows here.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model, device = model_shape(args.model), device_spec(args.device)
    buckets = parse_buckets(args.hotspa_buckets, seq_length=args.seq_length)
    distributions = {
        "demo-corpus": demo_corpus_lengths(),
        "pareto": pareto_lengths(args.pareto_documents, seed=args.seed),
    }
    results = {
        "model": args.model,
        "device": args.device,
        "seq_length": args.seq_length,
        "buckets": list(buckets),
        "global_batch_size": args.global_batch_size,
        "distributions": {},
        "rows": [],
    }
    for name, lengths in distributions.items():
        results["distributions"][name] = summarize(lengths, args.seq_length)
        for gpus in args.gpus:
            for row in compare(
                model=model,
                device=device,
                gpus=gpus,
                lengths=lengths,
                buckets=buckets,
                seq_length=args.seq_length,
                gbs=args.global_batch_size,
                seed=args.seed,
            ):
                results["rows"].append({"distribution": name, **row})
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def print_table(results: dict) -> None:
    print(
        f"{results['model']} on {results['device']}, {results['seq_length']} tokens, "
        f"{results['global_batch_size']} documents per step, buckets "
        f"{','.join(map(str, results['buckets']))}"
    )
    for name, d in results["distributions"].items():
        print(
            f"  {name}: {d['documents']} documents, median {d['median_tokens']} tokens, "
            f"p99 {d['p99_tokens']}, {d['at_cap']:.1%} cut at the context"
        )
    header = (
        "| distribution | GPUs | strategy | layouts (short → home) | step (s) | "
        "vs static | switch share |"
    )
    print(header)
    print("|" + "---|" * 7)
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['distribution']} | {r['gpus']} | {r['strategy']} | {r['error']} |")
            continue
        print(
            f"| {r['distribution']} | {r['gpus']} | {r['strategy']} | {r['layouts']} | "
            f"{r['step_s']:.2f} | {r.get('speedup_vs_static', math.nan):.2f}× | "
            f"{r['switch_share']:.1%} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
