"""From a trace to a validated plan: flat planning and MEMO's bi-level planning.

Flat planning solves one DSA problem over every tensor of the trace.

Bi-level planning uses the ``phase`` / ``layer`` tags of the allocs. A *pass* is the stretch of
events of one layer's forward (or backward): from its first alloc to the next alloc of anything
else. A pass's *transient* tensors are allocated and freed inside it. Level 1 packs the transient
tensors of each distinct pass once (passes of identical layers have the same signature and share
the solution); level 2 replaces each pass by one block, as large as its level-1 peak and live over
the whole pass, and packs the blocks with every other tensor (skeletal activations, embedding and
loss tensors). A transient tensor's offset is its block's offset plus its level-1 offset.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from memo_ext.planner.plan import Plan, validate
from memo_ext.planner.problem import DsaProblem, lower_bound, peak_of, problem_from_trace
from memo_ext.planner.settings import PlannerConfig
from memo_ext.planner.solvers import solve_dsa
from memo_ext.planner.solvers.work import WorkClock
from memo_ext.planner.trace import Alloc, Trace, trace_digest

logger = logging.getLogger(__name__)

LAYER_PHASES = ("fwd", "bwd")
FLAT_REFINE_MAX_TENSORS = 5000
"""Bi-level plans of traces up to this size are refined by a flat solve from the bi-level
placement when they are above the lower bound (blocks are conservative: a pass's block is
reserved for the whole pass). A 32-layer MEMO iteration (2,804 tensors) is planned flat at its
lower bound in about a second, where its bi-level plan is 1% above."""


@dataclass
class LayerPass:
    """One layer's forward or backward inside a trace."""

    phase: str
    """``"fwd"`` or ``"bwd"``."""
    layer: int
    """Layer index."""
    first: int
    """Index of the pass's first event."""
    stop: int
    """One past its last event (the next alloc of anything else)."""
    transient: np.ndarray
    """Indices (into the trace's lifetimes) of tensors allocated and freed inside the pass."""
    signature: tuple
    """Sizes and relative alloc / free times of the transient tensors: equal for identical
    layers."""


def _pass_ranges(trace: Trace) -> list[tuple[str, int, int, int]] | None:
    """``(phase, layer, first, stop)`` per pass; None when passes interleave."""
    ranges: list[list] = []
    for k, event in enumerate(trace.events):
        if not isinstance(event, Alloc):
            continue
        tag = (event.phase, event.layer) if event.phase in LAYER_PHASES else None
        if ranges and ranges[-1][0] == tag:
            ranges[-1][2] = k
            continue
        if ranges:
            ranges[-1][3] = k
        ranges.append([tag, k, k, len(trace.events)])
    passes = [(tag[0], tag[1], first, stop) for tag, first, _, stop in ranges if tag is not None]
    tags = [(phase, layer) for phase, layer, _, _ in passes]
    if len(set(tags)) != len(tags) or any(layer is None for _, layer, _, _ in passes):
        return None
    return passes


def find_layer_passes(trace: Trace, start: np.ndarray, end: np.ndarray) -> list[LayerPass]:
    """The layer passes of a trace (empty when it has none or they interleave)."""
    ranges = _pass_ranges(trace)
    if not ranges:
        return []
    sizes = problem_from_trace(trace)[1].sizes
    passes = []
    for phase, layer, first, stop in ranges:
        inside = np.flatnonzero((start >= first) & (start < stop) & (end <= stop))
        signature = tuple(
            (int(start[i] - first), int(end[i] - first), int(sizes[i])) for i in inside
        )
        passes.append(LayerPass(phase, layer, first, stop, inside, signature))
    return passes


LEVEL1_SHARE = 0.3
"""Share of a bi-level plan's work for its level 1 (the distinct passes, equal parts)."""
REFINE_FLOOR_UNITS = 0.5
"""Work the flat refinement of a bi-level plan gets even when level 2 spent the rest."""


def _make_plan(
    trace: Trace,
    ids: list[str],
    offsets: np.ndarray,
    config: PlannerConfig,
    clock: WorkClock,
    **fields,
) -> Plan:
    _, problem = problem_from_trace(trace, alignment=config.alignment)
    fields["extra"] = {
        **fields.get("extra", {}),
        "work_limit": config.work_limit,
        "work_units": round(clock.spent, 3),
        "deterministic": not clock.cut,
    }
    if clock.cut:
        logger.warning(
            "the safety net (CPU seconds) stopped the planner's search with %.1f of %.1f work "
            "units spent: the plan is valid, but may differ from one the whole work limit "
            "makes (raise --time-limit, or lower --work-limit)",
            clock.spent,
            config.work_limit,
        )
    peak, bound = peak_of(problem, offsets), lower_bound(problem)
    plan = Plan(
        offsets={key: int(offset) for key, offset in zip(ids, offsets)},
        peak_bytes=peak,
        lower_bound_bytes=bound,
        alignment=config.alignment,
        trace_digest=trace_digest(trace),
        **fields,
    )
    if peak == bound:
        plan.status = "optimal"
    validate(trace, plan)
    return plan


def plan_flat(trace: Trace, *, config: PlannerConfig, clock: WorkClock | None = None) -> Plan:
    """Plans every tensor of the trace in one DSA problem, and validates the plan."""
    t0 = time.perf_counter()
    clock = clock or config.start_clock()
    ids, problem = problem_from_trace(trace, alignment=config.alignment)
    solution = solve_dsa(problem, solver=config.solver, options=config.solve_options(clock))
    return _make_plan(
        trace,
        ids,
        solution.offsets,
        config,
        clock,
        solver=config.solver,
        status="optimal" if solution.optimal else "feasible",
        solve_s=time.perf_counter() - t0,
        extra={"mode": "flat", "tensors": problem.n},
    )


def _solve_level1(
    problem: DsaProblem, passes: list[LayerPass], config: PlannerConfig, clock: WorkClock
) -> dict[tuple, tuple[np.ndarray, int, bool]]:
    """Inner offsets, block size and optimality for each distinct pass signature."""
    distinct = {}
    for layer_pass in passes:
        distinct.setdefault(layer_pass.signature, layer_pass)
    solved = {}
    for k, (signature, layer_pass) in enumerate(distinct.items()):
        sub = problem.subproblem(layer_pass.transient)
        options = config.solve_options(clock.share(clock.left() / (len(distinct) - k)))
        result = solve_dsa(sub, solver=config.solver, options=options)
        solved[signature] = (result.offsets, result.peak, result.optimal)
        logger.info(
            "level 1: %s pass %d/%d, %d tensors, block %d bytes (lower bound %d)",
            layer_pass.phase,
            k + 1,
            len(distinct),
            sub.n,
            result.peak,
            lower_bound(sub),
        )
    return solved


def plan_bilevel(trace: Trace, *, config: PlannerConfig) -> Plan:
    """Plans a layered trace in two levels (see the module docstring); flat without passes."""
    t0 = time.perf_counter()
    clock = config.start_clock()
    ids, problem = problem_from_trace(trace, alignment=config.alignment)
    passes = find_layer_passes(trace, problem.start, problem.end)
    if not passes:
        logger.info("no layer passes in the trace: planning it flat")
        return plan_flat(trace, config=config, clock=clock)
    inner = _solve_level1(problem, passes, config, clock.share(LEVEL1_SHARE * clock.left()))
    level1_s = time.perf_counter() - t0
    in_block = np.zeros(problem.n, dtype=bool)
    for layer_pass in passes:
        in_block[layer_pass.transient] = True
    rest = np.flatnonzero(~in_block)
    blocks = [inner[p.signature][1] for p in passes]
    level2 = DsaProblem(
        sizes=np.concatenate([problem.sizes[rest], blocks]).astype(np.int64),
        start=np.concatenate([problem.start[rest], [p.first for p in passes]]).astype(np.int64),
        end=np.concatenate([problem.end[rest], [p.stop for p in passes]]).astype(np.int64),
    )
    options = config.solve_options(clock.share(clock.left(), floor=0.1))
    outer = solve_dsa(level2, solver=config.solver, options=options)
    offsets = np.zeros(problem.n, dtype=np.int64)
    offsets[rest] = outer.offsets[: len(rest)]
    for k, layer_pass in enumerate(passes):
        block_offset = outer.offsets[len(rest) + k]
        offsets[layer_pass.transient] = block_offset + inner[layer_pass.signature][0]
    extra = {
        "mode": "bilevel",
        "tensors": problem.n,
        "passes": len(passes),
        "distinct_passes": len(inner),
        "level1_s": round(level1_s, 3),
        "level2_tensors": level2.n,
        "level2_peak_bytes": int(outer.peak),
        "block_bytes": {f"{p.phase}:{p.layer}": int(b) for p, b in zip(passes, blocks)},
    }
    if problem.n <= FLAT_REFINE_MAX_TENSORS and peak_of(problem, offsets) > lower_bound(problem):
        refine = clock.share(clock.left(), floor=REFINE_FLOOR_UNITS)
        offsets = _refine_flat(problem, offsets, config, refine)
        extra["refined_flat"] = True
    return _make_plan(
        trace,
        ids,
        offsets,
        config,
        clock,
        solver=f"bilevel:{config.solver}",
        status="feasible",
        solve_s=time.perf_counter() - t0,
        extra=extra,
    )


def _refine_flat(
    problem: DsaProblem, offsets: np.ndarray, config: PlannerConfig, clock: WorkClock
) -> np.ndarray:
    """A flat solve started from the bi-level placement; keeps whichever peak is lower."""
    options = config.solve_options(clock, hint=offsets)
    flat = solve_dsa(problem, solver=config.solver, options=options)
    return flat.offsets if flat.peak < peak_of(problem, offsets) else offsets


def plan_trace(trace: Trace, *, config: PlannerConfig | None = None) -> Plan:
    """Plans a trace (bi-level when ``config.bilevel`` and the trace has layer passes)."""
    config = config or PlannerConfig()
    config.check()
    if config.bilevel:
        return plan_bilevel(trace, config=config)
    return plan_flat(trace, config=config)
