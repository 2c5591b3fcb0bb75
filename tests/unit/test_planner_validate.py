"""The validator refuses every kind of broken plan."""

import numpy as np
import pytest

from memo_ext.planner import Alloc, Free, Plan, PlanValidationError, Trace, validate
from memo_ext.planner.trace import trace_digest

TRACE = Trace(
    events=[Alloc("a", 1000), Alloc("b", 600), Free("a"), Alloc("c", 1000), Free("b"), Free("c")]
)


def _plan(offsets, peak, alignment=1, bound=1600):
    return Plan(
        offsets=offsets,
        peak_bytes=peak,
        lower_bound_bytes=bound,
        alignment=alignment,
        trace_digest=trace_digest(TRACE),
    )


def test_good_plan_passes():
    # a and c never live together, so they share offset 0.
    validate(TRACE, _plan({"a": 0, "b": 1000, "c": 0}, 1600))


def test_overlap_of_live_tensors_is_caught():
    with pytest.raises(PlanValidationError, match="'a' and 'b' are live at the same time"):
        validate(TRACE, _plan({"a": 0, "b": 999, "c": 0}, 1599 + 1))


def test_missing_and_unknown_ids_are_caught():
    with pytest.raises(PlanValidationError, match="no offset for 1 tensor"):
        validate(TRACE, _plan({"a": 0, "b": 1000}, 1600))
    with pytest.raises(PlanValidationError, match="'z', not in the trace"):
        validate(TRACE, _plan({"a": 0, "b": 1000, "c": 0, "z": 0}, 1600))


def test_alignment_is_checked():
    with pytest.raises(PlanValidationError, match="not a multiple of 512"):
        validate(TRACE, _plan({"a": 0, "b": 1000, "c": 0}, 1600, alignment=512, bound=2048))
    # Aligned sizes: a and c take 1024 bytes, b 1024 as well.
    validate(TRACE, _plan({"a": 0, "b": 1024, "c": 0}, 2048, alignment=512, bound=2048))


def test_wrong_peak_and_bound_are_caught():
    with pytest.raises(PlanValidationError, match="says peak 1700"):
        validate(TRACE, _plan({"a": 0, "b": 1000, "c": 0}, 1700))
    with pytest.raises(PlanValidationError, match="says lower bound 1500"):
        validate(TRACE, _plan({"a": 0, "b": 1000, "c": 0}, 1600, bound=1500))


def test_plan_of_another_trace_is_caught():
    plan = _plan({"a": 0, "b": 1000, "c": 0}, 1600)
    plan.trace_digest = "sha256:0000"
    with pytest.raises(PlanValidationError, match="different trace"):
        validate(TRACE, plan)


@pytest.mark.parametrize("seed", range(20))
def test_sweep_finds_a_conflict_exactly_when_the_pairs_do(seed):
    # the sweep (validate's check) against every overlapping pair, on placements that are
    # valid, nearly valid and random
    from memo_ext.planner.problem import DsaProblem, find_conflicts, first_conflict
    from memo_ext.planner.solvers.greedy import solve_greedy

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    start = rng.integers(0, 40, n)
    problem = DsaProblem(
        sizes=rng.integers(1, 9, n), start=start, end=start + rng.integers(1, 20, n)
    )
    placed = solve_greedy(problem).offsets
    nudged = placed.copy()
    nudged[rng.integers(n)] += int(rng.integers(-3, 4))
    for offsets in (placed, nudged, rng.integers(0, 30, n)):
        pairs = {tuple(p) for p in find_conflicts(problem, offsets).tolist()}
        found = first_conflict(problem, offsets)
        assert (found is None) == (not pairs)
        assert found is None or found in pairs
