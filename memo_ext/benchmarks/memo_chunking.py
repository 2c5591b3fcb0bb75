"""Peak device memory of one MEMO layer against sub-sequence chunk size and sequence length.

Traces one transformer layer's forward and backward under MEMO at a fixed α on fake tensors
(nothing is allocated), whole (no chunking) and with ``--memo-chunk-tokens`` N for each N, at
each sequence length, and takes the planner's lower bound of the trace: the largest total bytes
live at one time, which no allocator can go below. MEMO's host buffers are host memory and are
not in the trace; its fetches and recomputation are. The layer input is pre-existing and not
counted; the layer output, the output gradient and every gradient the layer makes are.

The live total at any one moment of the trace is affine in the sequence length s, so the peak is
the largest of a set of affine functions: piecewise affine, and affine from the length on where
one moment stays the peak. Per chunk size the benchmark fits the line through the two longest
lengths: its slope (bytes per token of s, per process) is what the whole-sequence tensors cost
(attention's q / k / v / output and their gradients, the layer output, its gradient), its
intercept what does not grow with s (the chunk's transients). Run from the repository root:

    python -m benchmarks.memo_chunking --json memo_chunking.json --plot memo_chunking.png

Defaults: the paper's 7B GPT, TP 8 + SP, α = 1, 128K-2M tokens, chunks of 1024, 4096 and 16384
local tokens (local: after SP, s / TP). 2M is there because with 16384-token chunks the peak
reaches its whole-sequence regime only at 1M; one run takes about half a minute on one core.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

from tqdm import tqdm

from memo_ext.flags import finite_float
from memo_ext.mcore.specs import build_layer_spec
from memo_ext.mcore.transformer_config import traced_transformer_config
from memo_ext.memo.policy import memo_trace_options
from memo_ext.parallel import ParallelLayout
from memo_ext.planner.capture import trace_transformer_layer
from memo_ext.planner.problem import lower_bound, problem_from_trace
from memo_ext.shapes import MODELS, ModelShape

GIB = float(1 << 30)
MIB = float(1 << 20)
DEFAULT_TOKENS = [1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21]
DEFAULT_CHUNKS = [1024, 4096, 16384]


def layer_peak_bytes(
    shape: ModelShape,
    *,
    layout: ParallelLayout,
    tokens: int,
    chunk_tokens: int | None,
    alpha: float = 1.0,
    micro_batch_size: int = 1,
) -> tuple[int, int]:
    """Largest total live over one MEMO layer's forward and backward, and the trace's tensor count.

    ``chunk_tokens`` is ``--memo-chunk-tokens`` (local tokens per chunk), ``None`` for no
    chunking; ``tokens`` is the global sequence length.
    """
    config = traced_transformer_config(shape, layout=layout, num_layers=1)
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    options = memo_trace_options(config, spec, alpha=alpha, chunk_tokens=chunk_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = trace_transformer_layer(
            config=config, seq_length=tokens, micro_batch_size=micro_batch_size, **options
        )
    _, problem = problem_from_trace(trace)
    return int(lower_bound(problem)), problem.n


def local_tokens(layout: ParallelLayout, tokens: int) -> int:
    """Tokens of one sequence a process holds outside attention (s / TP under SP)."""
    return tokens // (layout.cp * (layout.tp if layout.sp else 1))


def measure(
    shape: ModelShape,
    *,
    layout: ParallelLayout,
    tokens: list[int],
    chunks: list[int | None],
    alpha: float = 1.0,
    micro_batch_size: int = 1,
    verbose: bool = False,
    progress: bool = False,
) -> list[dict]:
    """One row per (chunk size, length): the peak live bytes of one layer forward + backward;
    ``progress``: a bar on stderr over the traces (seconds each, minutes for the longest)."""
    rows = []
    cells = [(chunk, s) for chunk in chunks for s in tokens]
    for chunk, s in tqdm(cells, desc="layers traced", unit="trace", disable=not progress):
        t0 = time.perf_counter()
        peak, tensors = layer_peak_bytes(
            shape,
            layout=layout,
            tokens=s,
            chunk_tokens=chunk,
            alpha=alpha,
            micro_batch_size=micro_batch_size,
        )
        local = local_tokens(layout, s)
        row = {
            "chunk_tokens": chunk,
            "tokens": s,
            "local_tokens": local,
            "chunks": 1 if chunk is None else -(-local // chunk),
            "peak_bytes": peak,
            "peak_gib": peak / GIB,
            "tensors": tensors,
            "trace_s": round(time.perf_counter() - t0, 2),
        }
        rows.append(row)
        if verbose:
            print(json.dumps(row), flush=True)
    return rows


def fit(rows: list[dict]) -> list[dict]:
    """Per chunk size, the line through its two longest lengths: ``peak = slope · s + intercept``.

    ``affine_from`` is the shortest length from which every measured peak lies on the line (to
    a byte per token); below it another moment of the trace is the peak and the point lies above
    the line. Chunk sizes measured at fewer than two lengths get no fit.
    """
    fits = []
    for chunk in dict.fromkeys(r["chunk_tokens"] for r in rows):
        points = sorted((r["tokens"], r["peak_bytes"]) for r in rows if r["chunk_tokens"] == chunk)
        if len(points) < 2:
            continue
        (s1, p1), (s2, p2) = points[-2:]
        slope = (p2 - p1) / (s2 - s1)
        intercept = p2 - slope * s2
        above = {s: p - (slope * s + intercept) for s, p in points}
        affine_from = s2
        for s, _ in reversed(points):
            if abs(above[s]) > s:  # more than a byte per token off the line
                break
            affine_from = s
        fits.append(
            {
                "chunk_tokens": chunk,
                "slope_bytes_per_token": slope,
                "intercept_bytes": intercept,
                "intercept_gib": intercept / GIB,
                "fit_tokens": [s1, s2],
                "affine_from_tokens": affine_from,
                "above_fit_gib": {str(s): d / GIB for s, d in above.items()},
            }
        )
    return fits


def _chunk_label(chunk: int | None) -> str:
    return "whole" if chunk is None else str(chunk)


def _tokens_label(tokens: int) -> str:
    if tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    if tokens % (1 << 10) == 0:
        return f"{tokens >> 10}K"
    return str(tokens)


def table(rows: list[dict]) -> str:
    """Markdown table: one row per chunk size, the peak GiB at each length."""
    lengths = sorted(dict.fromkeys(r["tokens"] for r in rows))
    peaks = {(r["chunk_tokens"], r["tokens"]): r["peak_gib"] for r in rows}
    lines = [
        "| chunk (local tokens) | " + " | ".join(_tokens_label(s) for s in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for chunk in dict.fromkeys(r["chunk_tokens"] for r in rows):
        cells = [f"{peaks[chunk, s]:.3f}" if (chunk, s) in peaks else "-" for s in lengths]
        lines.append(f"| {_chunk_label(chunk)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_table(fits: list[dict]) -> str:
    """Markdown table of the fits."""
    lines = [
        "| chunk (local tokens) | slope B/token | intercept MiB | fitted on | affine from |",
        "|---|---:|---:|---|---|",
    ]
    for f in fits:
        lo, hi = f["fit_tokens"]
        lines.append(
            f"| {_chunk_label(f['chunk_tokens'])} | {f['slope_bytes_per_token']:.1f} | "
            f"{f['intercept_bytes'] / MIB:.1f} | {_tokens_label(lo)}, {_tokens_label(hi)} | "
            f"{_tokens_label(f['affine_from_tokens'])} |"
        )
    return "\n".join(lines)


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (or the project's 'plots' extra)"
        ) from None
    return plt


def plot(rows: list[dict], fits: list[dict], path: str, *, title: str) -> None:
    """Peak GiB against sequence length, one line per chunk size, its fit dotted, to PNG ``path``.

    Raises:
        RuntimeError: when matplotlib is not installed.
    """
    plt = _import_pyplot()
    lines = {f["chunk_tokens"]: f for f in fits}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for chunk in dict.fromkeys(r["chunk_tokens"] for r in rows):
        points = sorted((r["tokens"], r["peak_gib"]) for r in rows if r["chunk_tokens"] == chunk)
        xs = [s / (1 << 20) for s, _ in points]
        label = "no chunking" if chunk is None else f"chunks of {chunk} local tokens"
        (drawn,) = ax.plot(xs, [p for _, p in points], marker="o", label=label)
        if chunk in lines:
            f = lines[chunk]
            ends = [points[0][0], points[-1][0]]
            ax.plot(
                [s / (1 << 20) for s in ends],
                [(f["slope_bytes_per_token"] * s + f["intercept_bytes"]) / GIB for s in ends],
                linestyle=":",
                color=drawn.get_color(),
                linewidth=1,
            )
    ax.set_xlabel("sequence length (M tokens)")
    ax.set_ylabel("peak live GiB per process")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parse_chunk(text: str) -> int | None:
    if text in ("whole", "none"):
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a chunk size must be >= 1 or 'whole', got {text}")
    return value


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="gpt-7b", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument(
        "--chunk-tokens",
        type=_parse_chunk,
        nargs="+",
        default=DEFAULT_CHUNKS,
        help="Local tokens per chunk; the unchunked layer ('whole') is always measured too.",
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, default=8)
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--memo-alpha", type=finite_float, default=1.0)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--json", default=None, help="Write every figure here.")
    parser.add_argument("--plot", default=None, help="Write a PNG here (matplotlib).")
    parser.add_argument("--verbose", action="store_true", help="Print each row as it comes.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shape = MODELS[args.model]
    layout = ParallelLayout(tp=args.tensor_model_parallel_size, sp=args.sequence_parallel)
    chunks = [None, *(c for c in dict.fromkeys(args.chunk_tokens) if c is not None)]
    t0 = time.perf_counter()
    rows = measure(
        shape,
        layout=layout,
        tokens=sorted(set(args.tokens)),
        chunks=chunks,
        alpha=args.memo_alpha,
        micro_batch_size=args.micro_batch_size,
        verbose=args.verbose,
        progress=not args.verbose,
    )
    fits = fit(rows)
    sp = " + SP" if layout.sp else ""
    title = (
        f"{args.model}, one MEMO layer (α = {args.memo_alpha:g}) forward + backward, "
        f"TP {layout.tp}{sp}, micro-batch {args.micro_batch_size}"
    )
    print(f"Peak live GiB per process: {title}")
    print(table(rows))
    print()
    print("Fit peak = slope · s + intercept through the two longest lengths:")
    print(fit_table(fits))
    print(f"({time.perf_counter() - t0:.0f} s)")
    result = {
        "model": args.model,
        "tp": layout.tp,
        "sp": layout.sp,
        "memo_alpha": args.memo_alpha,
        "micro_batch_size": args.micro_batch_size,
        "rows": rows,
        "fits": fits,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    if args.plot:
        plot(rows, fits, args.plot, title=title)
    return result


if __name__ == "__main__":
    main()
