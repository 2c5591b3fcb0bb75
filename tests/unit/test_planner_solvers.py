"""Every backend reaches the optimum on instances whose optimum is known by construction."""

import importlib.util
from itertools import permutations

import numpy as np
import pytest

from memo_ext.planner import SolverUnavailableError
from memo_ext.planner.packable import packable_instance
from memo_ext.planner.problem import DsaProblem, find_conflicts, lower_bound, peak_of
from memo_ext.planner.solvers import SOLVERS, SolveOptions, solve_dsa
from memo_ext.planner.solvers.greedy import place_in_order

EXACT = ["cpsat", "canonical", "highs"]
HAS_GUROBI = importlib.util.find_spec("gurobipy") is not None


def _check(problem, solution, optimum):
    assert len(find_conflicts(problem, solution.offsets)) == 0
    assert peak_of(problem, solution.offsets) == solution.peak == optimum
    assert solution.optimal


@pytest.mark.parametrize("solver", EXACT + (["gurobi"] if HAS_GUROBI else []))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_backends_pack_a_cut_rectangle(solver, seed):
    # 10 pieces of a 40 x 4096 rectangle: the optimum is the rectangle's height.
    problem, _ = packable_instance(num_buffers=10, seed=seed, duration=40, height=4096)
    solution = solve_dsa(problem, solver=solver, options=SolveOptions(time_limit_s=20))
    _check(problem, solution, 4096)


def _brute_force_optimum(problem: DsaProblem) -> int:
    """Lowest peak over first-fit placements of every order (exact for tiny instances: any
    placement pushed down is the first-fit placement of its order by offset)."""
    return min(
        peak_of(problem, place_in_order(problem, np.array(order)))
        for order in permutations(range(problem.n))
    )


@pytest.fixture(scope="module")
def random_instances():
    """Random 6-tensor instances with their optimum found by brute force."""
    rng = np.random.default_rng(7)
    found = []
    for _ in range(4):
        start = rng.integers(0, 6, 6)
        problem = DsaProblem(
            sizes=rng.integers(1, 9, 6), start=start, end=start + rng.integers(1, 5, 6)
        )
        found.append((problem, _brute_force_optimum(problem)))
    return found


@pytest.mark.parametrize("solver", EXACT + (["gurobi"] if HAS_GUROBI else []))
def test_exact_backends_match_brute_force(solver, random_instances):
    for problem, optimum in random_instances:
        solution = solve_dsa(problem, solver=solver, options=SolveOptions(time_limit_s=10))
        _check(problem, solution, optimum)


def test_heuristic_packs_a_staircase_and_stays_valid():
    # Nested lifetimes sized so that largest-first is optimal: 8 + 4 + 2 + 1.
    problem = DsaProblem(
        sizes=np.array([1, 2, 4, 8]), start=np.array([3, 2, 1, 0]), end=np.array([5, 6, 7, 8])
    )
    solution = solve_dsa(problem, solver="heuristic")
    _check(problem, solution, 15)
    hard, _ = packable_instance(num_buffers=60, seed=0)
    rough = solve_dsa(hard, solver="heuristic")
    assert len(find_conflicts(hard, rough.offsets)) == 0 and rough.peak >= lower_bound(hard)


def test_canonical_closes_a_packable_instance_of_60():
    problem, _ = packable_instance(num_buffers=60, seed=3)
    solution = solve_dsa(problem, solver="canonical", options=SolveOptions(time_limit_s=30))
    _check(problem, solution, 1 << 20)


@pytest.mark.skipif(HAS_GUROBI, reason="checks the message shown when gurobipy is absent")
def test_gurobi_without_gurobipy_says_what_to_do():
    problem, _ = packable_instance(num_buffers=6, seed=0)
    with pytest.raises(SolverUnavailableError, match="pip install gurobipy"):
        solve_dsa(problem, solver="gurobi")


def test_unknown_solver_is_refused():
    with pytest.raises(ValueError, match="unknown solver"):
        solve_dsa(packable_instance(num_buffers=3)[0], solver="magic")
    assert set(SOLVERS) == {"cpsat", "canonical", "highs", "gurobi", "heuristic"}


def _sections_fit_reference(search, unplaced, usable, capacity):
    """Spatial inference by plain loops: in every section, each unplaced tensor's usable offset
    plus the sizes of the section's tensors that can go no lower must fit the capacity."""
    sections, sizes = search.sections, search.problem.sizes
    for s in range(len(sections.total)):
        here = [k for k, i in enumerate(unplaced) if sections.lo[i] <= s < sections.hi[i]]
        for k in here:
            above = sum(sizes[unplaced[j]] for j in here if usable[j] >= usable[k])
            if usable[k] + above > capacity:
                return False
    return True


def test_spatial_inference_matches_a_loop_reference():
    from memo_ext.planner.solvers.canonical import CanonicalSearch

    rng = np.random.default_rng(3)
    verdicts = set()
    for seed in range(40):
        problem, _ = packable_instance(num_buffers=25, seed=seed, duration=30, height=64)
        search = CanonicalSearch(problem=problem, deadline=float("inf"))
        search.capacity = 64 + int(rng.integers(0, 8))
        unplaced = np.sort(rng.choice(problem.n, int(rng.integers(1, problem.n)), replace=False))
        usable = rng.integers(0, 24, len(unplaced))
        # The search keeps the total size of the unplaced tensors live in each section.
        sections = search.sections
        search.total = np.zeros(len(sections.total), dtype=np.int64)
        for i in unplaced:
            search.total[sections.lo[i] : sections.hi[i]] += problem.sizes[i]
        fast = search._sections_fit(unplaced, usable, 0, len(search.total))
        assert fast == _sections_fit_reference(search, unplaced, usable, search.capacity)
        verdicts.add(fast)
    assert verdicts == {True, False}  # both outcomes exercised


def test_luby_sequence_matches_its_definition():
    from memo_ext.planner.solvers.canonical import luby

    # The sequence as published: 1 1 2 1 1 2 4 1 1 2 1 1 2 4 8 ...
    head = [1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2, 4, 8, 1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2]
    assert [luby(i) for i in range(1, len(head) + 1)] == head
    assert luby(2**10 - 1) == 2**9


def test_time_reversal_keeps_every_conflict():
    from memo_ext.planner.problem import overlap_pairs
    from memo_ext.planner.solvers.canonical import time_reversed

    problem, offsets = packable_instance(num_buffers=80, seed=5)
    backwards = time_reversed(problem)
    pairs = {tuple(p) for p in overlap_pairs(problem)}
    assert pairs == {tuple(p) for p in overlap_pairs(backwards)} and pairs
    assert len(find_conflicts(backwards, offsets)) == 0


def test_greedy_completes_a_partial_placement_around_it():
    problem, offsets = packable_instance(num_buffers=40, seed=2)
    partial = np.where(np.arange(problem.n) % 3 == 0, offsets, -1)
    left = np.flatnonzero(partial < 0)
    done = place_in_order(problem, left[np.argsort(-problem.sizes[left])], offsets=partial)
    kept = partial >= 0
    assert (done[kept] == offsets[kept]).all() and (done >= 0).all()
    assert len(find_conflicts(problem, done)) == 0


def test_canonical_run_with_fixed_tensors_places_the_rest_above_them():
    from memo_ext.planner.solvers.canonical import CanonicalSearch, preorder

    problem, offsets = packable_instance(num_buffers=12, seed=1, duration=20, height=256)
    search = CanonicalSearch(problem=problem, deadline=float("inf"))
    # Keep the tensors of the known packing that sit on the floor; the rest must fit above.
    fixed = np.where(offsets == 0, 0, -1)
    rank = preorder(search.sections, problem.sizes.astype(float))
    found = search.run(capacity=256, rank=rank, node_limit=100_000, fixed=fixed)
    assert found is not None and (found[offsets == 0] == 0).all()
    assert len(find_conflicts(problem, found)) == 0 and peak_of(problem, found) <= 256
