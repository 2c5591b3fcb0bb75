"""The planner on MiniMalloc's public benchmark suite (real accelerator allocation problems).

Each CSV (``id,lower,upper,size`` or ``buffer,start,end,size``) is planned flat through the same
path as ``python -m tools.plan_memory --trace FILE --flat``; the plan is validated against the
trace. A file named ``X.<capacity>.csv`` is known to fit ``capacity`` bytes (the suite's
solutions), so ``peak / capacity - 1`` is the distance to a known-feasible (for this suite,
optimal) peak; the gap to the live-total lower bound is reported as well. Run from the
repository root with the suite's folder (``benchmarks/asplos2024`` of google/minimalloc):

    OMP_NUM_THREADS=1 python -m benchmarks.planner_suite path/to/asplos2024 --time-limit 60 \\
        --json planner_suite.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from memo_ext.flags import finite_float
from memo_ext.planner import PlannerConfig, load_trace, plan_trace


def known_capacity(path: Path) -> int | None:
    """The capacity in a suite file name (``A.1048576.csv`` -> 1048576), if any."""
    parts = path.name.split(".")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


def measure(path: Path, *, solver: str, time_limit_s: float) -> dict:
    """Plans one file; returns its peak against the known capacity and the lower bound."""
    trace = load_trace(path)
    t0 = time.perf_counter()
    config = PlannerConfig(solver=solver, time_limit_s=time_limit_s, alignment=1, bilevel=False)
    plan = plan_trace(trace, config=config)
    capacity = known_capacity(path)
    return {
        "file": path.name,
        "buffers": len(trace.allocs),
        "lower_bound": plan.lower_bound_bytes,
        "capacity": capacity,
        "peak": plan.peak_bytes,
        "over_capacity": None if capacity is None else plan.peak_bytes / capacity - 1,
        "gap": plan.gap,
        "status": plan.status,
        "time_s": round(time.perf_counter() - t0, 2),
    }


def table(rows: list[dict]) -> list[str]:
    """One line per file."""
    lines = [
        f"{'file':<18} {'buffers':>7} {'lower bound':>12} {'capacity':>10} {'peak':>10} "
        f"{'vs capacity':>11} {'vs bound':>9} {'status':>8} {'s':>6}"
    ]
    for r in rows:
        over = "-" if r["over_capacity"] is None else f"{r['over_capacity']:+.2%}"
        lines.append(
            f"{r['file']:<18} {r['buffers']:>7} {r['lower_bound']:>12} {r['capacity'] or '-':>10} "
            f"{r['peak']:>10} {over:>11} {r['gap']:>9.2%} {r['status']:>8} {r['time_s']:>6.1f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("paths", nargs="+", help="CSV files, or folders of them")
    parser.add_argument("--solver", default="cpsat")
    parser.add_argument("--time-limit", type=finite_float, default=60.0)
    parser.add_argument("--json", default="planner_suite.json")
    args = parser.parse_args()
    files = []
    for name in args.paths:
        path = Path(name)
        if not path.exists():
            parser.error(f"{name} does not exist; give CSV files, or folders of them")
        files += sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files:
        parser.error("no CSV files found")
    rows = []
    for path in files:
        rows.append(measure(path, solver=args.solver, time_limit_s=args.time_limit))
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(table(rows)))
    with open(args.json, "w") as handle:
        json.dump({"solver": args.solver, "time_limit_s": args.time_limit, "rows": rows}, handle)


if __name__ == "__main__":
    main()
