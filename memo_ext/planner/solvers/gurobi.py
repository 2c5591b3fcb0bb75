"""Gurobi backend (optional): the same big-M model as the HiGHS backend.

``gurobipy`` is imported only when this backend is chosen. pip's ``gurobipy`` carries a
size-limited licence (2,000 variables / constraints, about 100 tensors); bigger plans need a
user's licence.
"""

from __future__ import annotations

import numpy as np

from memo_ext.planner.errors import SolverUnavailableError
from memo_ext.planner.problem import DsaProblem, find_conflicts, overlap_pairs, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.greedy import mip_start


def import_gurobi():
    """Returns the gurobipy module, or raises SolverUnavailableError saying how to get it."""
    try:
        import gurobipy
    except ImportError:
        raise SolverUnavailableError(
            "the gurobi solver needs gurobipy and a Gurobi licence: pip install gurobipy "
            "(or choose --solver cpsat)"
        ) from None
    return gurobipy


def solve_gurobi(problem: DsaProblem, options: SolveOptions | None = None) -> Solution:
    """Solves the big-M MIP with Gurobi from the greedy (or hinted) placement."""
    gp = import_gurobi()
    options = options or SolveOptions()
    clock = options.start()
    start, upper, bound = mip_start(problem, options.hint, options)
    if upper == bound:
        return Solution(start, upper, True, "gurobi", {"bound": bound})
    try:
        env = gp.Env(params={"OutputFlag": 0})
        model = gp.Model(env=env)
    except gp.GurobiError as err:
        raise SolverUnavailableError(f"Gurobi could not start ({err}); check the licence") from None
    # Gurobi's work units are deterministic and, like ours, about a second each
    model.Params.WorkLimit = max(clock.left(), 0.01)
    model.Params.Threads = max(options.workers, 1)
    model.Params.Seed = options.seed
    sizes = [int(s) for s in problem.sizes]
    o = [model.addVar(lb=0, ub=upper - s, vtype=gp.GRB.INTEGER) for s in sizes]
    peak = model.addVar(lb=bound, ub=upper, vtype=gp.GRB.INTEGER)
    for i, s in enumerate(sizes):
        model.addConstr(o[i] + s <= peak)
        o[i].Start = int(start[i])
    peak.Start = upper
    for i, j in overlap_pairs(problem):
        z = model.addVar(vtype=gp.GRB.BINARY)
        z.Start = float(start[i] < start[j])
        model.addConstr(o[i] + sizes[i] <= o[j] + upper * (1 - z))
        model.addConstr(o[j] + sizes[j] <= o[i] + upper * z)
    model.setObjective(peak, gp.GRB.MINIMIZE)
    try:
        with clock.watching(model.terminate):  # the safety net (TimeLimit is wall-clock)
            model.optimize()
    except gp.GurobiError as err:
        raise SolverUnavailableError(
            f"Gurobi failed ({err}); the licence may be too small"
        ) from None
    clock.spend(min(float(model.Work), clock.left()))
    best = start
    if model.SolCount:
        offsets = np.rint([v.X for v in o]).astype(np.int64)
        if not len(find_conflicts(problem, offsets)) and peak_of(problem, offsets) < upper:
            best = offsets
    best_bound = max(bound, int(np.ceil(model.ObjBound - 1e-6)))
    peak_value = peak_of(problem, best)
    return Solution(best, peak_value, peak_value <= best_bound, "gurobi", {"bound": best_bound})
