"""What ``--memo-allocator plan`` serves in real training, and what the caching allocator would
have reserved for the same passes.

Trains a small GPT under MEMO on this machine (CPU: the c10 shim routes every allocation through
the allocator core; CUDA: the pluggable allocator) at each α, with the planned allocator, and
reports per step (from the metrics file, iteration 3 on):

- the bytes of the offloaded layers' passes served from the plan (``plan_hit_bytes``) and those
  the plan leaves to the caching path because they outlive their pass (``plan_unplanned_bytes``:
  layer outputs, MEMO's copy sources, prefetched host data, tokens kept for the backward);
- the hit ratio, the arena (= the largest pass plan's peak) and the fallback path's peak;

and per recorded pass kind (from the plan files): the plan's peak against the peak of PyTorch's
caching allocator replayed over the same transients (``memo_ext.planner.caching_allocator``), the
fragmentation the arena removes. Every figure is a byte count, the same on every run. From the
repository root:

    python -m benchmarks.planned_allocator --json planned_allocator.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from memo_ext.planner.caching_allocator import replay_caching_allocator
from memo_ext.planner.trace import Alloc, Free, Trace

MIB = float(1 << 20)
MODEL = [
    *("--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "8"),
    *("--seq-length", "512", "--micro-batch-size", "1", "--global-batch-size", "2"),
    *("--train-iters", "5", "--lr", "1e-3", "--mock-data", "--swiglu"),
    *("--normalization", "RMSNorm", "--position-embedding-type", "rope"),
]


def pass_trace(doc: dict) -> Trace:
    """The transients of one ``memo-pass-plan/1`` document as a trace (event order kept)."""
    events: list[tuple[int, Alloc | Free]] = []
    for i, (size, offset, at, free) in enumerate(
        zip(doc["sizes"], doc["offsets"], doc["alloc_at"], doc["free_at"], strict=True)
    ):
        if offset < 0:  # left to the caching path
            continue
        events += [(at, Alloc(str(i), size)), (free, Free(str(i)))]
    return Trace([event for _, event in sorted(events, key=lambda pair: pair[0])])


def run(alpha: str, workdir: Path) -> dict:
    cache, metrics = workdir / f"plans-{alpha}", workdir / f"metrics-{alpha}.jsonl"
    cmd = [
        sys.executable,
        *("-m", "memo_ext.commands.pretrain_gpt_memo"),
        *MODEL,
        *("--memo", "--memo-alpha", alpha, "--memo-allocator", "plan"),
        *("--memo-plan-cache", str(cache), "--metrics-file", str(metrics), "--log-interval", "1"),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    served = [r for r in records if r["iteration"] >= 3]
    last = served[-1]
    kinds = []
    for path in sorted(cache.glob("*-rank0.json")):
        doc = json.loads(path.read_text())
        replay = replay_caching_allocator(pass_trace(doc))
        kinds.append(
            {
                "requests": len(doc["sizes"]),
                "planned": sum(o >= 0 for o in doc["offsets"]),
                "plan_peak_bytes": doc["peak_bytes"],
                "caching_reserved_bytes": replay.reserved_peak_bytes,
                "caching_allocated_bytes": replay.allocated_peak_bytes,
            }
        )
    return {
        "alpha": alpha,
        "hit_ratio_min": min(r["plan_hit_ratio"] for r in served),
        "hit_bytes": last["plan_hit_bytes"],
        "unplanned_bytes": last["plan_unplanned_bytes"],
        "arena_bytes": last["plan_arena_bytes"],
        "fallback_peak_bytes": last["plan_fallback_peak_bytes"],
        "kinds": kinds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--alpha", nargs="+", default=["0", "0.5", "1"], help="MEMO α values.")
    parser.add_argument("--json", help="Write the rows here.")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for alpha in args.alpha:
            print(f"α = {alpha}: training ...", file=sys.stderr, flush=True)
            rows.append(run(alpha, Path(tmp)))
    print(
        f"{'α':>4} {'hit ratio':>9} {'planned MiB':>11} {'unplanned MiB':>13} "
        f"{'arena MiB':>9} {'fallback MiB':>12}"
    )
    for r in rows:
        print(
            f"{r['alpha']:>4} {r['hit_ratio_min']:>9.4f} {r['hit_bytes'] / MIB:>11.2f} "
            f"{r['unplanned_bytes'] / MIB:>13.2f} {r['arena_bytes'] / MIB:>9.2f} "
            f"{r['fallback_peak_bytes'] / MIB:>12.2f}"
        )
    print(
        f"\n{'α':>4} {'requests':>8} {'planned':>7} {'plan MiB':>9} {'caching MiB':>11} {'+%':>6}"
    )
    for r in rows:
        for k in r["kinds"]:
            extra = k["caching_reserved_bytes"] / max(k["plan_peak_bytes"], 1) - 1
            print(
                f"{r['alpha']:>4} {k['requests']:>8} {k['planned']:>7} "
                f"{k['plan_peak_bytes'] / MIB:>9.2f} {k['caching_reserved_bytes'] / MIB:>11.2f} "
                f"{100 * extra:>6.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
