"""The validator refuses every kind of broken plan."""

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
