"""Summarise a metrics file (JSON Lines from ``--metrics-file``), optionally as a check.

    python -m tools.summarize_metrics runs/demo/metrics.jsonl --require-loss-drop 1.0

Prints the first and last logged loss, the median throughput and step time; with
``--require-loss-drop X`` exits 1 unless the loss fell by more than X nats.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from memo_ext.arguments import OneSentenceParser
from memo_ext.errors import UsageError
from memo_ext.flags import finite_float
from memo_ext.plugins import with_plugins
from memo_ext.training.metrics import read_metrics

PROG = "memo-summarize-metrics"
"""The installed command: its usage line and error prefix."""


def summarize(records: list[dict]) -> dict:
    """First / last loss, their drop, and median step time and throughput."""
    # the first logged step is dominated by one-time work: take medians over the rest
    steady = records[1:] or records
    return {
        "iterations": records[-1]["iteration"],
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "loss_drop": records[0]["loss"] - records[-1]["loss"],
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "steady_records": len(steady),
    }


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("metrics_file", type=Path)
    parser.add_argument("--require-loss-drop", type=finite_float, default=None, metavar="NATS")
    try:
        args = parser.parse_args(argv)
        records = read_metrics(args.metrics_file)
        missing = {"loss", "step_time_s", "tokens_per_s"} - set(records[0])
        if missing:
            raise UsageError(f"{args.metrics_file} records lack {', '.join(sorted(missing))}")
        s = summarize(records)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(
        f"{s['iterations']} iterations | loss {s['first_loss']:.3f} -> {s['last_loss']:.3f} "
        f"(-{s['loss_drop']:.3f} nats) | {s['median_tokens_per_s']:,.0f} tokens/s | "
        f"{s['median_step_time_s'] * 1e3:.0f} ms/step (medians of the {s['steady_records']} "
        f"logged steps after the first)"
    )
    if args.require_loss_drop is not None and not s["loss_drop"] > args.require_loss_drop:
        # "not >": a NaN loss (or drop) fails the check instead of passing it
        print(f"loss fell by {s['loss_drop']:.3f} nats, not more than {args.require_loss_drop}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
