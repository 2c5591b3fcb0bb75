"""HiGHS MIP backend: the big-M model of MEMO's planner.

Variables: an offset ``o_i`` per tensor, the peak ``M``, and for every pair of tensors whose
lifetimes overlap a binary ``z_ij`` (1 when ``i`` sits below ``j``)::

    o_i + s_i <= o_j + U (1 - z_ij)        o_j + s_j <= o_i + U z_ij        o_i + s_i <= M

with ``U`` the incumbent's peak (a valid big-M: no offset exceeds it). Minimise ``M``. The greedy
placement is passed as the starting solution. HiGHS takes no deterministic work limit, so it runs
for the work left read as seconds: unlike the other backends, its plans depend on load.
"""

from __future__ import annotations

import numpy as np

from memo_ext.planner.problem import DsaProblem, find_conflicts, overlap_pairs, peak_of
from memo_ext.planner.solvers.base import Solution, SolveOptions
from memo_ext.planner.solvers.greedy import mip_start


def _start_values(problem: DsaProblem, pairs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    below = (offsets[pairs[:, 0]] < offsets[pairs[:, 1]]).astype(float)
    return np.concatenate([offsets.astype(float), [float(peak_of(problem, offsets))], below])


def solve_highs(problem: DsaProblem, options: SolveOptions | None = None) -> Solution:
    """Solves the big-M MIP with HiGHS from the greedy (or hinted) placement."""
    import highspy

    options = options or SolveOptions()
    clock = options.start()
    start, upper, bound = mip_start(problem, options.hint, options)
    if upper == bound:
        return Solution(start, upper, True, "highs", {"bound": bound})
    pairs = overlap_pairs(problem)
    n, p = problem.n, len(pairs)
    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # HiGHS has no deterministic work limit: its (wall-clock) time limit is the work left, read
    # as seconds, or the CPU seconds left to the safety net when fewer
    h.setOptionValue("time_limit", float(max(min(clock.left(), clock.seconds_left()), 0.01)))
    h.setOptionValue("threads", int(max(options.workers, 1)))
    h.setOptionValue("random_seed", int(options.seed))
    sizes = problem.sizes.astype(float)
    # Columns: offsets 0..n-1, peak n, pair binaries n+1..n+p.
    lower = np.concatenate([np.zeros(n), [bound], np.zeros(p)])
    upper_b = np.concatenate([upper - sizes, [upper], np.ones(p)])
    cost = np.concatenate([np.zeros(n), [1.0], np.zeros(p)])
    h.addVars(n + 1 + p, lower, upper_b)
    h.changeColsCost(n + 1 + p, np.arange(n + 1 + p, dtype=np.int32), cost)
    h.changeColsIntegrality(
        p, np.arange(n + 1, n + 1 + p, dtype=np.int32), np.full(p, highspy.HighsVarType.kInteger)
    )
    for i in range(n):  # o_i - M <= -s_i
        h.addRow(-inf, -sizes[i], 2, np.array([i, n], dtype=np.int32), np.array([1.0, -1.0]))
    big = float(upper)
    for k, (i, j) in enumerate(pairs):
        z = n + 1 + k
        idx = np.array([i, j, z], dtype=np.int32)
        # o_i - o_j + U z <= U - s_i   and   o_j - o_i - U z <= -s_j
        h.addRow(-inf, big - sizes[i], 3, idx, np.array([1.0, -1.0, big]))
        h.addRow(-inf, -sizes[j], 3, idx, np.array([-1.0, 1.0, -big]))
    solution = highspy.HighsSolution()
    solution.col_value = list(_start_values(problem, pairs, start))
    solution.value_valid = True
    h.setSolution(solution)
    h.run()
    clock.spend(clock.left())
    best = start
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value[:n])
    if len(values) == n and info.primal_solution_status == 2:
        offsets = np.rint(values).astype(np.int64)
        if not len(find_conflicts(problem, offsets)) and peak_of(problem, offsets) < upper:
            best = offsets
    dual = int(np.ceil(info.mip_dual_bound - 1e-6)) if np.isfinite(info.mip_dual_bound) else bound
    best_bound = max(bound, dual)
    peak = peak_of(problem, best)
    return Solution(best, peak, peak <= best_bound, "highs", {"bound": best_bound})
