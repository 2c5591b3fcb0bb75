"""Memory plans: the ``memo-plan/1`` file format and the validator every plan goes through.

A plan gives every tensor of a trace a byte offset inside one region of ``peak_bytes``::

    {"format": "memo-plan/1", "peak_bytes": 6442450944, "lower_bound_bytes": 6442450944,
     "gap": 0.0, "offsets": {"t0": 0, "t1": 1073741824, ...}, "alignment": 512,
     "solver": "cpsat", "status": "optimal", "solve_s": 0.8, "trace_digest": "sha256:..."}

``peak_bytes`` is ``max(offset + align_up(size, alignment))``, the size of the region to reserve;
``lower_bound_bytes`` is the largest aligned total live at one time, so ``gap`` =
``peak / lower_bound - 1`` bounds how far the plan is from the optimum.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memo_ext.planner.errors import PlannerInputError, PlanValidationError
from memo_ext.planner.problem import first_conflict, lower_bound, peak_of, problem_from_trace
from memo_ext.planner.trace import MAX_BYTES, Trace, trace_digest

PLAN_FORMAT = "memo-plan/1"
PLAN_STATUSES = ("optimal", "feasible")


@dataclass
class Plan:
    """Byte offsets for every tensor of a trace, with how good they are."""

    offsets: dict[str, int]
    """Byte offset of every tensor id of the trace."""
    peak_bytes: int
    """Region size needed: ``max(offset + aligned size)``."""
    lower_bound_bytes: int
    """Largest aligned total live at one time (no plan can do better)."""
    alignment: int = 1
    """Every offset is a multiple of this many bytes."""
    solver: str = ""
    """Backend that produced the plan (``"bilevel:<backend>"`` for bi-level plans)."""
    status: str = "feasible"
    """``"optimal"`` when proven (peak equals the lower bound or the solver proved it)."""
    solve_s: float = 0.0
    """Wall time spent solving, seconds."""
    trace_digest: str = ""
    """Digest of the trace the plan was made for (see ``trace_digest``)."""
    extra: dict = field(default_factory=dict)
    """Further details (bi-level block sizes, per-level times, ...)."""

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound: ``peak / lower_bound - 1``."""
        return self.peak_bytes / self.lower_bound_bytes - 1.0 if self.lower_bound_bytes else 0.0


def plan_to_dict(plan: Plan) -> dict:
    """Returns the ``memo-plan/1`` document of a plan."""
    doc = {
        "format": PLAN_FORMAT,
        "peak_bytes": int(plan.peak_bytes),
        "lower_bound_bytes": int(plan.lower_bound_bytes),
        "gap": round(plan.gap, 6),
        "alignment": int(plan.alignment),
        "solver": plan.solver,
        "status": plan.status,
        "solve_s": round(plan.solve_s, 3),
        "trace_digest": plan.trace_digest,
        "offsets": {key: int(value) for key, value in plan.offsets.items()},
    }
    if plan.extra:
        doc["extra"] = plan.extra
    return doc


def _require_int(doc: dict, key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlannerInputError(f"plan field {key!r} must be a non-negative integer, got {value!r}")
    return value


def plan_from_dict(doc: object) -> Plan:
    """Builds a plan from a parsed ``memo-plan/1`` document.

    Raises:
        PlannerInputError: unknown format or malformed fields.
    """
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlannerInputError(f"unknown plan format {found!r}; expected {PLAN_FORMAT!r}")
    offsets = doc.get("offsets")
    if not isinstance(offsets, dict):
        raise PlannerInputError("the plan has no 'offsets' object")
    for key, value in offsets.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PlannerInputError(f"plan offset of id {key!r} is not a non-negative integer")
    return Plan(
        offsets=dict(offsets),
        peak_bytes=_require_int(doc, "peak_bytes"),
        lower_bound_bytes=_require_int(doc, "lower_bound_bytes"),
        alignment=max(_require_int(doc, "alignment"), 1),
        solver=str(doc.get("solver", "")),
        status=str(doc.get("status", "feasible")),
        solve_s=float(doc.get("solve_s", 0.0)),
        trace_digest=str(doc.get("trace_digest", "")),
        extra=dict(doc.get("extra") or {}),
    )


def save_plan(plan: Plan, path: str | Path) -> None:
    """Writes a plan as a ``memo-plan/1`` JSON file."""
    Path(path).write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")


def load_plan(path: str | Path) -> Plan:
    """Reads a ``memo-plan/1`` JSON file.

    Raises:
        PlannerInputError: missing file, malformed JSON or unknown format.
    """
    path = Path(path)
    if not path.is_file():
        raise PlannerInputError(f"plan file {str(path)!r} does not exist")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlannerInputError(f"plan file {str(path)!r} is not valid JSON ({err})") from None
    return plan_from_dict(doc)


def _check_ids(ids: list[str], plan: Plan) -> None:
    missing = [key for key in ids if key not in plan.offsets]
    if missing:
        raise PlanValidationError(
            f"the plan has no offset for {len(missing)} tensor(s), e.g. id {missing[0]!r}"
        )
    unknown = set(plan.offsets) - set(ids)
    if unknown:
        raise PlanValidationError(f"the plan places id {sorted(unknown)[0]!r}, not in the trace")


def validate(trace: Trace, plan: Plan) -> None:
    """Checks that a plan can serve its trace.

    Every tensor has an offset; offsets are multiples of the alignment; no two tensors live at
    the same time share a byte; ``peak_bytes`` equals the placement's peak and the lower bound is
    the trace's.

    Raises:
        PlanValidationError: naming the first violation.
    """
    ids, problem = problem_from_trace(trace, alignment=plan.alignment)
    _check_ids(ids, plan)
    raw = [plan.offsets[key] for key in ids]
    bad = [(key, o) for key, o in zip(ids, raw) if not 0 <= o <= MAX_BYTES]
    if bad:
        key, offset = bad[0]
        raise PlanValidationError(
            f"id {key!r} has offset {offset}, outside [0, 2**62] (offsets are byte positions in "
            "one region)"
        )
    offsets = np.asarray(raw, dtype=np.int64)
    misaligned = np.nonzero(offsets % plan.alignment)[0]
    if len(misaligned):
        i = misaligned[0]
        raise PlanValidationError(
            f"id {ids[i]!r} has offset {offsets[i]}, not a multiple of {plan.alignment}"
        )
    conflict = first_conflict(problem, offsets)
    if conflict is not None:
        i, j = conflict
        raise PlanValidationError(
            f"ids {ids[i]!r} and {ids[j]!r} are live at the same time but their bytes overlap "
            f"([{offsets[i]}, {offsets[i] + problem.sizes[i]}) and "
            f"[{offsets[j]}, {offsets[j] + problem.sizes[j]}))"
        )
    peak = peak_of(problem, offsets)
    if plan.peak_bytes != peak:
        raise PlanValidationError(
            f"the plan says peak {plan.peak_bytes} bytes, its offsets give {peak}"
        )
    bound = lower_bound(problem)
    if plan.lower_bound_bytes != bound:
        raise PlanValidationError(
            f"the plan says lower bound {plan.lower_bound_bytes} bytes, the trace gives {bound}"
        )
    if plan.trace_digest and plan.trace_digest != trace_digest(trace):
        raise PlanValidationError("the plan was made for a different trace (digest mismatch)")
