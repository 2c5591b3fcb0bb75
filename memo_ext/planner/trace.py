"""Allocation traces: the ``memo-trace/1`` file format, its checks and its lifetimes.

A trace is the sequence of tensor allocations and frees of a program, in program order::

    {"format": "memo-trace/1",
     "events": [{"op": "alloc", "id": "t0", "size": 4096, "name": "fc1", "phase": "fwd",
                 "layer": 3},
                {"op": "free", "id": "t0"}, ...]}

A tensor lives from its ``alloc`` event to its ``free`` event; a tensor never freed lives to the
end. Event ``k`` happens at time ``k``, so a free listed before an alloc lets the two tensors share
memory. ``name``, ``phase`` and ``layer`` are optional annotations; bi-level planning uses ``phase``
and ``layer`` to find the passes of identical transformer layers.

Files (this format, MiniMalloc CSV, PyTorch snapshots) are read and written by
``memo_ext.planner.trace_files``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from memo_ext.planner.errors import PlannerInputError

TRACE_FORMAT = "memo-trace/1"
MAX_BYTES = 2**62
"""The most bytes a trace's tensors may add up to: every offset and end of a placement then fits
a signed 64-bit integer with room to spare (sums of two stay below 2**63)."""


@dataclass(frozen=True)
class Alloc:
    """One allocation event."""

    id: str
    """Tensor id, unique within the trace."""
    size: int
    """Size in bytes (positive)."""
    name: str | None = None
    """Optional human-readable name (op or module that produced the tensor)."""
    phase: str | None = None
    """Optional phase tag, e.g. ``"fwd"``, ``"bwd"``, ``"embedding"``, ``"loss"``."""
    layer: int | None = None
    """Optional transformer-layer index of the pass that allocated the tensor."""


@dataclass(frozen=True)
class Free:
    """One release event."""

    id: str
    """Id of a tensor allocated earlier in the trace."""


Event = Alloc | Free


@dataclass
class Lifetimes:
    """The tensors of a trace as arrays, in allocation order.

    A tensor ``i`` is live over the half-open time interval ``[start[i], end[i])``, times being
    event indices; two tensors conflict exactly when their intervals intersect.
    """

    ids: list[str]
    """Tensor ids in allocation order."""
    sizes: np.ndarray
    """``[n]`` int64 sizes in bytes."""
    start: np.ndarray
    """``[n]`` int64 index of each tensor's alloc event."""
    end: np.ndarray
    """``[n]`` int64 index of each tensor's free event (number of events if never freed)."""


@dataclass
class Trace:
    """A checked sequence of allocation and free events (see the module docstring)."""

    events: list[Event]
    """Events in program order."""
    meta: dict = field(default_factory=dict)
    """Free-form description of where the trace came from (model, shapes, parallel sizes)."""

    def __post_init__(self) -> None:
        check_events(self.events)

    @property
    def allocs(self) -> list[Alloc]:
        """The alloc events, in order."""
        return [e for e in self.events if isinstance(e, Alloc)]

    def lifetimes(self) -> Lifetimes:
        """Returns each tensor's size and ``[alloc, free)`` event interval."""
        index = {}
        ids, sizes, start = [], [], []
        end = []
        for k, event in enumerate(self.events):
            if isinstance(event, Alloc):
                index[event.id] = len(ids)
                ids.append(event.id)
                sizes.append(event.size)
                start.append(k)
                end.append(len(self.events))
            else:
                end[index[event.id]] = k
        as_array = lambda xs: np.asarray(xs, dtype=np.int64)
        return Lifetimes(ids=ids, sizes=as_array(sizes), start=as_array(start), end=as_array(end))


def check_events(events: list[Event]) -> None:
    """Refuses duplicate ids, frees of unknown or freed ids and non-positive sizes.

    Raises:
        PlannerInputError: naming the first bad event by index and id.
    """
    live: set[str] = set()
    seen: set[str] = set()
    total = 0
    for k, event in enumerate(events):
        if isinstance(event, Alloc):
            if event.id in seen:
                raise PlannerInputError(f"event {k}: duplicate alloc of id {event.id!r}")
            if not isinstance(event.size, int) or isinstance(event.size, bool) or event.size <= 0:
                raise PlannerInputError(
                    f"event {k}: alloc of id {event.id!r} has size {event.size!r}; "
                    "sizes must be positive integers (bytes)"
                )
            seen.add(event.id)
            live.add(event.id)
            total += event.size
            if total > MAX_BYTES:
                raise PlannerInputError(
                    f"event {k}: the tensors up to id {event.id!r} add up to {total} bytes, more "
                    "than 2**62; no device holds that, and offsets would overflow 64 bits"
                )
        elif event.id in live:
            live.remove(event.id)
        elif event.id in seen:
            raise PlannerInputError(f"event {k}: double free of id {event.id!r}")
        else:
            raise PlannerInputError(f"event {k}: free of unknown id {event.id!r}")


def _event_from_dict(k: int, raw: object) -> Event:
    if not isinstance(raw, dict):
        raise PlannerInputError(f"event {k}: expected an object, got {type(raw).__name__}")
    op, event_id = raw.get("op"), raw.get("id")
    if not isinstance(event_id, (str, int)) or isinstance(event_id, bool):
        raise PlannerInputError(f"event {k}: missing or invalid 'id' ({event_id!r})")
    event_id = str(event_id)
    if op == "free":
        return Free(id=event_id)
    if op != "alloc":
        raise PlannerInputError(f"event {k} (id {event_id!r}): unknown op {op!r}")
    if "size" not in raw:
        raise PlannerInputError(f"event {k}: alloc of id {event_id!r} has no 'size'")
    layer = raw.get("layer")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
        raise PlannerInputError(f"event {k} (id {event_id!r}): 'layer' must be an integer")
    return Alloc(
        id=event_id, size=raw["size"], name=raw.get("name"), phase=raw.get("phase"), layer=layer
    )


def trace_from_dict(doc: object) -> Trace:
    """Builds a trace from a parsed ``memo-trace/1`` document.

    Raises:
        PlannerInputError: unknown format, malformed or inconsistent events.
    """
    if not isinstance(doc, dict):
        raise PlannerInputError("a trace must be a JSON object with 'format' and 'events'")
    if doc.get("format") != TRACE_FORMAT:
        raise PlannerInputError(
            f"unknown trace format {doc.get('format')!r}; expected {TRACE_FORMAT!r}"
        )
    raw_events = doc.get("events")
    if not isinstance(raw_events, list):
        raise PlannerInputError("the trace has no 'events' list")
    events = [_event_from_dict(k, raw) for k, raw in enumerate(raw_events)]
    return Trace(events=events, meta=dict(doc.get("meta") or {}))


def trace_to_dict(trace: Trace) -> dict:
    """Returns the ``memo-trace/1`` document of a trace (optional fields only when set)."""
    events = []
    for event in trace.events:
        if isinstance(event, Free):
            events.append({"op": "free", "id": event.id})
            continue
        raw = {"op": "alloc", "id": event.id, "size": event.size}
        for key in ("name", "phase", "layer"):
            if getattr(event, key) is not None:
                raw[key] = getattr(event, key)
        events.append(raw)
    doc = {"format": TRACE_FORMAT, "events": events}
    if trace.meta:
        doc["meta"] = trace.meta
    return doc


def trace_digest(trace: Trace) -> str:
    """Returns a short hash of the events (ids, sizes, order) to match plans to their trace."""
    digest = hashlib.sha256()
    for event in trace.events:
        if isinstance(event, Alloc):
            digest.update(f"a {event.id} {event.size}\n".encode())
        else:
            digest.update(f"f {event.id}\n".encode())
    return "sha256:" + digest.hexdigest()[:16]


def trace_from_intervals(
    buffers: list[tuple[str, int, int, int]], *, meta: dict | None = None
) -> Trace:
    """The trace of buffers ``(id, lower, upper, size)`` live over ``[lower, upper)``.

    Events go time point by time point, the frees of buffers ending at ``t`` before the allocs of
    buffers starting at ``t``, so two buffers conflict in the trace exactly when their intervals
    intersect. A zero-length buffer is allocated and freed at ``t`` after the other allocs there.

    Raises:
        PlannerInputError: duplicate ids, non-positive sizes.
    """
    frees_at: dict[int, list[str]] = {}
    allocs_at: dict[int, list[tuple[str, int, bool]]] = {}
    for buffer_id, lower, upper, size in buffers:
        allocs_at.setdefault(lower, []).append((buffer_id, size, lower == upper))
        if upper > lower:
            frees_at.setdefault(upper, []).append(buffer_id)
    events: list[Event] = []
    for t in sorted(set(frees_at) | set(allocs_at)):
        events.extend(Free(id=buffer_id) for buffer_id in frees_at.get(t, []))
        starting = allocs_at.get(t, [])
        events.extend(Alloc(id=buffer_id, size=size) for buffer_id, size, _ in starting)
        events.extend(Free(id=buffer_id) for buffer_id, _, empty in starting if empty)
    return Trace(events=events, meta=dict(meta or {}))
