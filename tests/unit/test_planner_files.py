"""Trace and plan files: round trips, MiniMalloc CSV input and refusal of bad input."""

import json

import numpy as np
import pytest

from memo_ext.planner import (
    Alloc,
    Free,
    Plan,
    PlannerInputError,
    Trace,
    load_plan,
    load_trace,
    save_plan,
    save_trace,
    trace_from_dict,
)
from memo_ext.planner.problem import overlap_pairs, problem_from_trace


def _trace() -> Trace:
    return Trace(
        events=[
            Alloc("a", 100, name="fc1", phase="fwd", layer=0),
            Alloc("b", 50),
            Free("a"),
            Alloc("c", 70, phase="bwd", layer=0),
            Free("c"),
        ],
        meta={"model": "toy"},
    )


def test_trace_round_trip(tmp_path):
    path = tmp_path / "t.json"
    save_trace(_trace(), path)
    assert load_trace(path) == _trace()


def test_plan_round_trip(tmp_path):
    plan = Plan(
        offsets={"a": 0, "b": 512},
        peak_bytes=1024,
        lower_bound_bytes=1024,
        alignment=512,
        solver="cpsat",
        status="optimal",
        solve_s=0.5,
        trace_digest="sha256:x",
        extra={"mode": "flat"},
    )
    path = tmp_path / "p.json"
    save_plan(plan, path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "memo-plan/1" and doc["gap"] == 0.0
    loaded = load_plan(path)
    assert (
        loaded.offsets == plan.offsets and loaded.peak_bytes == 1024 and loaded.extra == plan.extra
    )


def test_free_before_alloc_lets_tensors_share():
    _, problem = problem_from_trace(_trace())
    # a is freed before c is allocated, so only (a, b) and (b, c) overlap in time.
    assert sorted(map(tuple, overlap_pairs(problem).tolist())) == [(0, 1), (1, 2)]


def _doc(*events):
    return {"format": "memo-trace/1", "events": list(events)}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"format": "memo-trace/2", "events": []}, "unknown trace format"),
        (_doc({"op": "free", "id": "x"}), "event 0: free of unknown id 'x'"),
        (
            _doc(
                {"op": "alloc", "id": "x", "size": 4},
                {"op": "free", "id": "x"},
                {"op": "free", "id": "x"},
            ),
            "event 2: double free of id 'x'",
        ),
        (
            _doc({"op": "alloc", "id": "x", "size": 4}, {"op": "alloc", "id": "x", "size": 4}),
            "event 1: duplicate alloc of id 'x'",
        ),
        (_doc({"op": "alloc", "id": "x", "size": 0}), "event 0: alloc of id 'x' has size 0"),
        (_doc({"op": "alloc", "id": "x", "size": -3}), "event 0: alloc of id 'x' has size -3"),
        (_doc({"op": "alloc", "id": "x", "size": 1.5}), "has size 1.5"),
        (_doc({"op": "move", "id": "x"}), "event 0 (id 'x'): unknown op 'move'"),
        ([], "must be a JSON object"),
    ],
)
def test_bad_traces_are_refused_naming_the_event(doc, message):
    with pytest.raises(PlannerInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trace_from_dict(doc)


def test_malformed_json_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "memo-trace/1", "events": [')
    with pytest.raises(PlannerInputError, match="not valid JSON"):
        load_trace(path)


def test_minimalloc_csv_intervals_become_events(tmp_path):
    path = tmp_path / "input.csv"
    path.write_text("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n")
    trace = load_trace(path)
    ids, problem = problem_from_trace(trace)
    pairs = {tuple(sorted((ids[i], ids[j]))) for i, j in overlap_pairs(problem)}
    # [lower, upper) intervals: b1 ends at 3 where b2 starts, so they do not conflict.
    expected = {("b1", "b3"), ("b1", "b5"), ("b2", "b3"), ("b2", "b5"), ("b3", "b5"), ("b4", "b5")}
    assert pairs == expected
    assert np.array_equal(problem.sizes, [4, 4, 4, 4, 4])


def test_csv_with_bad_row_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,lower,upper,size\nb1,0,x,4\n")
    with pytest.raises(PlannerInputError, match="CSV line 2"):
        load_trace(path)
