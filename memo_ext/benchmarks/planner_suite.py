"""The planner on MiniMalloc's public benchmark suite (real accelerator allocation problems).

Each CSV (``id,lower,upper,size`` or ``buffer,start,end,size``) is planned flat through the same
path as ``python -m tools.plan_memory --trace FILE --flat``; the plan is validated against the
trace. A file named ``X.<capacity>.csv`` is known to fit ``capacity`` bytes (the suite's
solutions), so ``peak / capacity - 1`` is the distance to a known-feasible (for this suite,
optimal) peak; the gap to the live-total lower bound is reported as well. Run from the
repository root with the suite's folder (``benchmarks/challenging`` of google/minimalloc):

    OMP_NUM_THREADS=1 python -m benchmarks.planner_suite path/to/challenging --work-limit 60 \\
        --json planner_suite.json

Each row carries a digest of the plan's offsets. ``--busy N`` keeps N processes spinning beside
the planner for the whole run: the digests then match those of a run without them (the plans
do not depend on load), only the seconds differ.

Each row also has the plan's CPU seconds (the process's, every thread) and the CPU seconds a work
unit cost on that file: a unit is meant to be about one CPU-second on an idle machine. The
one-off costs of a process (imports, loading or compiling the search loops) are measured before
the first file and printed apart, so they do not count against it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import time
from pathlib import Path

from memo_ext.flags import finite_float
from memo_ext.planner import PlannerConfig, load_trace, plan_trace
from memo_ext.planner.solvers.canonical import warm_up

CPU_PER_UNIT_TOLERANCE = 0.3
"""How far from one CPU-second a unit may cost on a file before the table flags it."""


def known_capacity(path: Path) -> int | None:
    """The capacity in a suite file name (``A.1048576.csv`` -> 1048576), if any."""
    parts = path.name.split(".")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


def measure(path: Path, *, solver: str, work_limit: float) -> dict:
    """Plans one file; returns its peak against the known capacity and the lower bound."""
    trace = load_trace(path)
    t0, cpu0 = time.perf_counter(), time.process_time()
    config = PlannerConfig(solver=solver, work_limit=work_limit, alignment=1, bilevel=False)
    plan = plan_trace(trace, config=config)
    cpu_s = time.process_time() - cpu0
    capacity = known_capacity(path)
    units = plan.extra["work_units"]
    return {
        "file": path.name,
        "buffers": len(trace.allocs),
        "lower_bound": plan.lower_bound_bytes,
        "capacity": capacity,
        "peak": plan.peak_bytes,
        "over_capacity": None if capacity is None else plan.peak_bytes / capacity - 1,
        "gap": plan.gap,
        "status": plan.status,
        "work_units": units,
        "deterministic": plan.extra["deterministic"],
        "digest": digest(plan.offsets),
        "time_s": round(time.perf_counter() - t0, 2),
        "cpu_s": round(cpu_s, 2),
        "cpu_s_per_unit": round(cpu_s / units, 2) if units > 0 else None,
    }


def start_up() -> float:
    """CPU seconds of a process's one-off costs: CP-SAT's import and the search loops loaded
    from numba's cache (or compiled, when it is empty)."""
    cpu0 = time.process_time()
    from ortools.sat.python import cp_model  # noqa: F401

    warm_up()
    return time.process_time() - cpu0


def digest(offsets: dict[str, int]) -> str:
    """A short digest of a plan's offsets (equal digests: the same placement)."""
    text = json.dumps(sorted(offsets.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _spin() -> None:
    while True:
        pass


def table(rows: list[dict]) -> list[str]:
    """One line per file."""
    lines = [
        f"{'file':<18} {'buffers':>7} {'lower bound':>12} {'capacity':>10} {'peak':>10} "
        f"{'vs capacity':>11} {'vs bound':>9} {'status':>8} {'work':>6} {'s':>6} {'CPU s':>6} "
        f"{'CPU s/unit':>10} {'digest':>12}"
    ]
    for r in rows:
        over = "-" if r["over_capacity"] is None else f"{r['over_capacity']:+.2%}"
        per_unit = "-" if r["cpu_s_per_unit"] is None else f"{r['cpu_s_per_unit']:.2f}"
        lines.append(
            f"{r['file']:<18} {r['buffers']:>7} {r['lower_bound']:>12} {r['capacity'] or '-':>10} "
            f"{r['peak']:>10} {over:>11} {r['gap']:>9.2%} {r['status']:>8} "
            f"{r['work_units']:>6.1f} {r['time_s']:>6.1f} {r['cpu_s']:>6.1f} {per_unit:>10} "
            f"{r['digest']:>12}"
        )
    known = [r["over_capacity"] for r in rows if r["over_capacity"] is not None]
    if known:
        at = sum(over <= 0 for over in known)
        lines.append(
            f"mean peak / capacity {1 + sum(known) / len(known):.4f}; {at} of {len(known)} at "
            f"the known capacity; {sum(r['time_s'] for r in rows):.0f} s in all"
        )
    lines += unit_summary(rows)
    return lines


def unit_summary(rows: list[dict]) -> list[str]:
    """What a work unit cost in CPU seconds across the files, and which files it missed by
    more than ``CPU_PER_UNIT_TOLERANCE``."""
    costs = {r["file"]: r["cpu_s_per_unit"] for r in rows if r["cpu_s_per_unit"] is not None}
    if not costs:
        return []
    off = [name for name, cost in costs.items() if abs(cost - 1) > CPU_PER_UNIT_TOLERANCE]
    line = (
        f"a work unit cost {min(costs.values()):.2f}-{max(costs.values()):.2f} CPU s; "
        f"{len(costs) - len(off)} of {len(costs)} files within "
        f"{CPU_PER_UNIT_TOLERANCE:.0%} of one"
    )
    return [line + (f" (not: {', '.join(off)})" if off else "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("paths", nargs="+", help="CSV files, or folders of them")
    parser.add_argument("--solver", default="cpsat")
    parser.add_argument("--work-limit", type=finite_float, default=60.0)
    parser.add_argument(
        "--busy", type=int, default=0, help="Processes kept spinning beside the planner."
    )
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
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    rows, start_cpu_s = [], 0.0
    try:
        start_cpu_s = start_up()
        print(f"start-up (imports, search loops): {start_cpu_s:.2f} CPU s", flush=True)
        for path in files:
            rows.append(measure(path, solver=args.solver, work_limit=args.work_limit))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    print("\n".join(table(rows)))
    result = {
        "solver": args.solver,
        "work_limit": args.work_limit,
        "busy": args.busy,
        "start_up_cpu_s": round(start_cpu_s, 2),
        "rows": rows,
    }
    with open(args.json, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
