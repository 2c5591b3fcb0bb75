"""Traces from PyTorch's CUDA allocator history, converted from logged entries (a real step on
CUDA: tests/gpu/test_planner_cuda.py)."""

import pickle

import pytest

from memo_ext.planner import PlannerConfig, PlannerInputError, load_trace, plan_trace
from memo_ext.planner.cuda_history import trace_from_cuda_snapshot
from memo_ext.planner.problem import lower_bound, problem_from_trace
from memo_ext.planner.trace import Alloc, Free


def _entry(action, addr, size=512, frames=None):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames or []}


def _history():
    frames = [
        {"filename": "??", "line": 0, "name": "c10::alloc"},
        {"filename": "/x/model.py", "line": 12, "name": "forward"},
    ]
    return [
        _entry("segment_alloc", 0x1000, 1 << 21),
        _entry("alloc", 0x1000, 1024, frames),
        _entry("free_requested", 0x9000),  # a block allocated before the history started
        _entry("alloc", 0x1400, 512),
        _entry("free_requested", 0x1000),
        _entry("free_completed", 0x1000),
        _entry("alloc", 0x1000, 2048),  # the same address again: a new tensor
        _entry("free_completed", 0x1400),  # released without a logged request
        _entry("snapshot", 0),
    ]


def test_history_becomes_a_trace_in_program_order():
    trace = trace_from_cuda_snapshot({"segments": [], "device_traces": [[], _history()]}, device=1)
    assert trace.events == [
        Alloc(id="b0", size=1024, name="forward (model.py:12)"),
        Alloc(id="b1", size=512),
        Free(id="b0"),
        Alloc(id="b3", size=2048),
        Free(id="b1"),
    ]
    assert trace.meta["frees_before_history"] == 1
    _, problem = problem_from_trace(trace)
    # b0 and b1 together (1536), then b1 and b3 together (2560); b3 lives to the end.
    assert lower_bound(problem) == 2560
    assert problem.end[2] == len(trace.events)


def test_bad_snapshots_are_refused():
    with pytest.raises(PlannerInputError, match="_record_memory_history"):
        trace_from_cuda_snapshot({"segments": []})
    with pytest.raises(PlannerInputError, match="no device 3"):
        trace_from_cuda_snapshot({"device_traces": [[]]}, device=3)
    twice = [_entry("alloc", 0x1000), _entry("alloc", 0x1000)]
    with pytest.raises(PlannerInputError, match="entry 1: alloc at 0x1000 while block 'b0'"):
        trace_from_cuda_snapshot({"device_traces": [twice]})


def test_a_pickled_snapshot_is_planned_like_any_trace(tmp_path):
    path = tmp_path / "step.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [_history()]}))
    trace = load_trace(path)
    assert trace.meta["path"] == str(path) and len(trace.allocs) == 3
    plan = plan_trace(trace, config=PlannerConfig(work_limit=5, alignment=512))
    assert plan.peak_bytes == 2560 and plan.status == "optimal"
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    with pytest.raises(PlannerInputError, match="not a pickled memory snapshot"):
        load_trace(tmp_path / "junk.pkl")


def test_tracing_a_step_without_cuda_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available; tests/gpu/test_planner_cuda.py traces a real step")
    from memo_ext.planner.cuda_history import trace_cuda_step

    with pytest.raises(RuntimeError, match="needs CUDA"):
        trace_cuda_step(lambda: None)
