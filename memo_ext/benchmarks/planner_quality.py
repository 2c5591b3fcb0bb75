"""How far each planner backend lands from the optimum on perfectly packable instances.

Instances come from ``memo_ext.planner.packable`` (a rectangle cut into pieces, so the optimum
is the lower bound); the gap is ``peak / optimum - 1``. Run from the repository root:

    OMP_NUM_THREADS=1 python -m benchmarks.planner_quality --sizes 60 200 400 --seeds 8 \\
        --work-limit 60 --solvers heuristic canonical cpsat --json planner_quality.json

Seeds are ``first-seed .. first-seed + seeds - 1``; the table gives the mean and the worst gap
per backend and size, since the exact backends' run times are heavy-tailed and one hard draw
matters more than the mean. ``--no-levels`` measures the backends searching each instance
whole; ``--duration`` sets the rectangle's time steps (fewer, and more tensors share their
start and end times).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np

from memo_ext.flags import finite_float
from memo_ext.planner.packable import packable_instance
from memo_ext.planner.problem import find_conflicts, lower_bound
from memo_ext.planner.solvers import SolveOptions, solve_dsa


def measure(
    *,
    solver: str,
    size: int,
    seed: int,
    work_limit: float,
    levels: bool = True,
    duration: int = 1000,
) -> dict:
    """Solves one instance; returns its gap, time and whether the optimum was proven."""
    problem, _ = packable_instance(num_buffers=size, seed=seed, duration=duration)
    t0 = time.perf_counter()
    options = SolveOptions(work_limit=work_limit, levels=levels)
    solution = solve_dsa(problem, solver=solver, options=options)
    elapsed = time.perf_counter() - t0
    assert len(find_conflicts(problem, solution.offsets)) == 0
    return {
        "solver": solver,
        "buffers": size,
        "seed": seed,
        "gap": solution.peak / lower_bound(problem) - 1,
        "time_s": round(elapsed, 2),
        "optimal": bool(solution.optimal),
        "levels": levels,
        "duration": duration,
    }


def summarise(rows: list[dict]) -> list[str]:
    """One table line per (solver, size): mean and worst gap, solved count, mean time."""
    lines = [
        f"{'solver':<10} {'buffers':>7} {'mean gap':>9} {'max gap':>8} {'optimal':>8} {'mean s':>7}"
    ]
    keys = sorted({(r["solver"], r["buffers"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for solver, size in keys:
        group = [r for r in rows if r["solver"] == solver and r["buffers"] == size]
        gaps = np.array([r["gap"] for r in group])
        solved = sum(r["optimal"] for r in group)
        lines.append(
            f"{solver:<10} {size:>7} {gaps.mean():>9.2%} {gaps.max():>8.2%} "
            f"{solved:>4}/{len(group):<3} {np.mean([r['time_s'] for r in group]):>7.1f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--sizes", type=int, nargs="+", default=[60, 200, 400])
    parser.add_argument("--seeds", type=int, default=8, help="number of seeds per size")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--work-limit", type=finite_float, default=60.0)
    default = ["heuristic", "canonical", "cpsat", "highs"]
    if importlib.util.find_spec("gurobipy"):
        default.append("gurobi")
    parser.add_argument("--solvers", nargs="+", default=default)
    parser.add_argument(
        "--duration",
        type=int,
        default=1000,
        help="Time steps of the cut rectangle (default 1000); fewer make more tensors share "
        "their start and end times.",
    )
    parser.add_argument(
        "--no-levels",
        action="store_true",
        help="Search every instance whole, without the level-by-level attempt first.",
    )
    parser.add_argument("--json", default="planner_quality.json")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for solver in args.solvers:
                row = measure(
                    solver=solver,
                    size=size,
                    seed=seed,
                    work_limit=args.work_limit,
                    levels=not args.no_levels,
                    duration=args.duration,
                )
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    print("\n".join(summarise(rows)))
    with open(args.json, "w") as handle:
        summary = {
            "work_limit": args.work_limit,
            "levels": not args.no_levels,
            "duration": args.duration,
            "rows": rows,
        }
        json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
