"""Memory planner: allocation traces, DSA solvers, bi-level plans and their validation.

Typical use::

    from memo_ext.planner import PlannerConfig, load_trace, plan_trace, save_plan
    trace = load_trace("layer.trace.json")
    plan = plan_trace(trace, config=PlannerConfig(solver="cpsat", work_limit=60))
    save_plan(plan, "layer.plan.json")

Modules:
    trace: the ``memo-trace/1`` format and tensor lifetimes.
    trace_files: trace files in (JSON, MiniMalloc CSV, PyTorch snapshots) and out.
    plan: the ``memo-plan/1`` format and ``validate``.
    problem: the DSA problem behind a trace and its lower bound.
    solvers: backends (cpsat, canonical, highs, gurobi, heuristic) behind ``solve_dsa``.
    planning: flat and bi-level planning of a trace.
    capture: traces of megatron-core layers under fake tensors, from a layer spec.
    cuda_history: traces of a real CUDA step, from PyTorch's allocator history.
    caching_allocator: replay of a trace through a model of PyTorch's CUDA caching allocator.
    packable: perfectly packable instances with a known optimum.
"""

from memo_ext.planner.errors import PlannerInputError, PlanValidationError, SolverUnavailableError
from memo_ext.planner.plan import Plan, load_plan, plan_from_dict, plan_to_dict, save_plan, validate
from memo_ext.planner.planning import plan_bilevel, plan_flat, plan_trace
from memo_ext.planner.settings import PlannerConfig
from memo_ext.planner.trace import Alloc, Free, Trace, trace_from_dict, trace_to_dict
from memo_ext.planner.trace_files import load_trace, save_trace, trace_from_minimalloc_csv

__all__ = [
    "Alloc",
    "Free",
    "Plan",
    "PlanValidationError",
    "PlannerConfig",
    "PlannerInputError",
    "SolverUnavailableError",
    "Trace",
    "load_plan",
    "load_trace",
    "plan_bilevel",
    "plan_flat",
    "plan_from_dict",
    "plan_to_dict",
    "plan_trace",
    "save_plan",
    "save_trace",
    "trace_from_dict",
    "trace_from_minimalloc_csv",
    "trace_to_dict",
    "validate",
]
