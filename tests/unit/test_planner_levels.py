"""Cutting a problem along its flat levels: sound cuts, and placements that meet the target."""

import numpy as np
import pytest

from memo_ext.planner.packable import packable_instance
from memo_ext.planner.problem import (
    DsaProblem,
    compress_times,
    find_conflicts,
    lower_bound,
    overlap_pairs,
    peak_of,
)
from memo_ext.planner.solvers import SolveOptions, solve_dsa
from memo_ext.planner.solvers.canonical import solve_canonical
from memo_ext.planner.solvers.greedy import solve_greedy
from memo_ext.planner.solvers.levels import balanced_subsets, find_level, solve_by_levels
from memo_ext.planner.solvers.work import WorkClock


def _greedy_leaf(piece, room, clock):
    return solve_greedy(piece).offsets


def _exact_leaf(piece, room, clock):
    return solve_canonical(piece, SolveOptions(clock=clock.share(1.0, floor=1.0))).offsets


def _constant_live_total(problem: DsaProblem) -> bool:
    """The live total is the same at every event time of the span (ends included)."""
    times = np.unique(np.concatenate([problem.start, problem.end]))[:-1]
    live = (problem.start <= times[:, None]) & (times[:, None] < problem.end)
    totals = live @ problem.sizes
    return bool((totals == totals[0]).all())


def test_find_level_returns_the_smallest_flat_subset():
    # A 2-tensor level (0 then 1, 3 bytes) under a 3-tensor one (2, 3, 4; 5 bytes), plus a
    # 1-byte tensor live throughout that is a level on its own.
    problem = DsaProblem(
        sizes=np.array([3, 3, 5, 5, 5, 1]),
        start=np.array([0, 4, 0, 3, 7, 0]),
        end=np.array([4, 10, 3, 7, 10, 10]),
    )
    level = find_level(problem)
    assert level is not None and level.sum() == 1 and level[5]
    rest = problem.subproblem(np.arange(5))
    level = find_level(rest)
    assert level is not None and level.tolist() == [True, True, False, False, False]


def test_balanced_subsets_lists_every_choice_that_balances():
    rows = balanced_subsets([3, 5], [8, 3], limit=100)
    # Nothing; 3 for 3; 3 + 5 for 8.
    assert sorted(map(tuple, rows.tolist())) == [(0, 0, 0, 0), (1, 0, 0, 1), (1, 1, 1, 0)]
    # Identical sizes multiply the choices: 4 + 4 alike balance in C(8, 4) = 70 ways.
    assert len(balanced_subsets([2] * 4, [2] * 4, limit=70)) == 70
    assert balanced_subsets([2] * 4, [2] * 4, limit=69) is None
    assert balanced_subsets([1] * 17, [17], limit=10**6) is None  # too many to list


def test_find_level_where_many_tensors_share_their_times():
    # 400 pieces over 60 times: the equalities alone found no level here in 20 s.
    problem, _ = packable_instance(num_buffers=400, seed=5, duration=60)
    level = find_level(compress_times(problem), clock=WorkClock.start(10))
    assert level is not None
    assert _constant_live_total(problem.subproblem(np.flatnonzero(level)))


def test_find_level_says_none_when_no_subset_is_flat():
    # Each tensor alone leaves an instant with nothing of it; together they are everything.
    problem = DsaProblem(sizes=np.array([1, 2]), start=np.array([0, 1]), end=np.array([2, 3]))
    assert find_level(problem) is None
    assert find_level(problem.subproblem(np.array([0]))) is None


@pytest.mark.slow
@pytest.mark.parametrize("size", [30, 120])
def test_levels_pack_cut_rectangles_at_their_height(size):
    for seed in range(25):
        problem, _ = packable_instance(num_buffers=size, seed=seed)
        offsets = solve_by_levels(
            problem, _exact_leaf, capacity=lower_bound(problem), clock=WorkClock.start(30)
        )
        assert offsets is not None, f"seed {seed}"
        assert len(find_conflicts(problem, offsets)) == 0
        assert peak_of(problem, offsets) == lower_bound(problem)


def test_levels_found_along_the_way_are_flat():
    problem, _ = packable_instance(num_buffers=80, seed=4)
    seen = []

    def leaf(piece, room, clock):
        seen.append(piece)
        return _exact_leaf(piece, room, clock)

    assert (
        solve_by_levels(problem, leaf, capacity=lower_bound(problem), clock=WorkClock.start(30))
        is not None
    )
    # Leaves are small: the cuts did the work.
    assert max((piece.n for piece in seen), default=0) < problem.n // 4
    level = find_level(problem)
    assert level is not None
    assert _constant_live_total(problem.subproblem(np.flatnonzero(level)))
    assert _constant_live_total(problem.subproblem(np.flatnonzero(~level)))


def test_floors_go_to_the_bottom_and_time_components_start_at_zero():
    # Tensor 0 spans everything: the floor. Above it two components that never meet.
    problem = DsaProblem(
        sizes=np.array([4, 2, 3, 1]), start=np.array([0, 0, 5, 5]), end=np.array([10, 5, 10, 10])
    )
    calls = []

    def leaf(piece, room, clock):
        calls.append(piece.n)
        return _greedy_leaf(piece, room, clock)

    offsets = solve_by_levels(problem, leaf, capacity=8, clock=WorkClock.start(10))
    assert offsets.tolist() == [0, 4, 4, 7]
    assert calls == []  # every piece was a floor


def test_a_leaf_above_its_room_is_a_miss():
    # One component, no floor, no flat subset: a leaf. A leaf placing its tensors apart misses.
    problem = DsaProblem(
        sizes=np.array([1, 2, 3]), start=np.array([0, 1, 2]), end=np.array([2, 3, 4])
    )

    def apart(piece, room, clock):
        return np.arange(piece.n) * 4

    assert solve_by_levels(problem, apart, capacity=3, clock=WorkClock.start(5)) is None
    offsets = solve_by_levels(problem, _greedy_leaf, capacity=5, clock=WorkClock.start(5))
    assert offsets is not None and peak_of(problem, offsets) == 5
    # Below the lower bound nothing is tried.
    assert solve_by_levels(problem, _greedy_leaf, capacity=4, clock=WorkClock.start(5)) is None


def test_no_work_means_no_placement():
    problem, _ = packable_instance(num_buffers=40, seed=0)
    assert solve_by_levels(problem, _exact_leaf, capacity=1 << 20, clock=WorkClock.start(0)) is None


def test_solve_dsa_closes_a_hard_draw_through_its_levels():
    # Searched whole, this draw ends 12-17% above its optimum after 60 s.
    problem, _ = packable_instance(num_buffers=400, seed=18)
    solution = solve_dsa(problem, options=SolveOptions(work_limit=30))
    assert solution.optimal and solution.peak == lower_bound(problem)
    assert solution.details["levels"] == [True]
    assert len(find_conflicts(problem, solution.offsets)) == 0


def test_solve_dsa_without_levels_searches_whole():
    problem, _ = packable_instance(num_buffers=40, seed=1)
    solution = solve_dsa(problem, options=SolveOptions(work_limit=10, levels=False))
    assert "levels" not in solution.details
    assert len(find_conflicts(problem, solution.offsets)) == 0


def test_compressed_times_keep_every_overlap():
    rng = np.random.default_rng(3)
    for _ in range(50):
        start = rng.integers(0, 40, 30)
        problem = DsaProblem(
            sizes=rng.integers(1, 9, 30), start=start, end=start + rng.integers(1, 12, 30)
        )
        compressed = compress_times(problem)
        pairs = {tuple(sorted(pair)) for pair in overlap_pairs(problem).tolist()}
        assert {tuple(sorted(pair)) for pair in overlap_pairs(compressed).tolist()} == pairs
        assert lower_bound(compressed) == lower_bound(problem)
        times = np.unique(np.concatenate([problem.start, problem.end]))
        assert len(np.unique(np.concatenate([compressed.start, compressed.end]))) <= len(times)
    # Trace-like times (one event per time): frees 2, 3 then allocs 4, 5 become one time.
    trace_like = DsaProblem(
        sizes=np.array([4, 4, 2, 6]), start=np.array([0, 1, 4, 5]), end=np.array([2, 3, 6, 7])
    )
    compressed = compress_times(trace_like)
    assert compressed.start.tolist() == [0, 0, 1, 1] and compressed.end.tolist() == [1, 1, 2, 2]
