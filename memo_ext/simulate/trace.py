"""What a simulated run leaves: the timeline of its steps as JSON, and a Chrome / Perfetto trace.

``timeline.json`` (format ``memo-timeline/1``) holds the rates the clock used and, per marked
step: its time, each stream's busy time and op count, the compute stream's kernel time by what
each kernel is priced as (matmul, attention, memory-bound), its idle time by what it
waited on (a copy, a collective, the host at a sync's call site, launches), the exposed copy
time, the host syncs by call site and the seconds the host waited at each, and the device's and
pinned host memory's peaks. ``trace.json`` (Chrome's trace event format; Perfetto and
``chrome://tracing`` open it) has one track per stream of the rank, every op as a slice, the
step ranges on the host's track.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from memo_ext.simulate.timing import Clock, StepFigures

TIMELINE_FORMAT = "memo-timeline/1"


def exposed_copy_s(figures: StepFigures) -> float:
    """Seconds the compute stream stood idle for host ↔ device copies: waits on a copy stream's
    event, and host syncs during which the host waited for copies."""
    return sum(s for why, s in figures.idle_s.items() if "to_host" in why or "to_device" in why)


def step_record(figures: StepFigures, *, compute_stream: int, kinds: dict[int, str]) -> dict:
    step_s = figures.end - figures.start
    busy = figures.busy_s.get(compute_stream, 0.0)
    name = lambda k: _stream_name(k, compute_stream, kinds)  # noqa: E731
    return {
        "name": figures.name,
        "step_s": step_s,
        "busy_s": {name(k): v for k, v in sorted(figures.busy_s.items())},
        "ops": {name(k): v for k, v in sorted(figures.ops.items())},
        "compute_by_kernel_s": dict(sorted(figures.compute_s.items(), key=lambda kv: -kv[1])),
        "compute_idle_s": max(0.0, step_s - busy),
        "compute_idle_by_cause_s": dict(sorted(figures.idle_s.items(), key=lambda kv: -kv[1])),
        "exposed_copy_s": exposed_copy_s(figures),
        "host_syncs": dict(sorted(figures.host_syncs.items(), key=lambda kv: -kv[1])),
        "host_sync_wait_s": dict(sorted(figures.host_sync_s.items(), key=lambda kv: -kv[1])),
        "peak_device_bytes": figures.peak_device_bytes,
    }


def timeline(clock: Clock, *, rank: int, memory: dict[str, int]) -> dict:
    """The run's timeline document (see the module docstring); ``memory``: the device's
    ``peak_device_bytes`` (the whole run), ``peak_pinned_host_bytes`` and
    ``device_capacity_bytes``."""
    steps = [
        step_record(f, compute_stream=clock.compute_stream, kinds=clock.kinds) for f in clock.steps
    ]
    measured = steps[1:] or steps  # the first step pays for first uses (plans, warm-ups)
    return {
        "format": TIMELINE_FORMAT,
        "rank": rank,
        "rates": clock.rates.describe(),
        "median_step_s": statistics.median(s["step_s"] for s in measured) if steps else None,
        **memory,
        "steps": steps,
    }


def chrome_trace(clock: Clock, *, rank: int) -> dict:
    """Chrome's trace event format: one thread per stream of process ``rank``, times in µs."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "host"}},
    ]
    for stream in sorted({i.stream for i in clock.intervals or []}):
        name = _stream_name(stream, clock.compute_stream, clock.kinds)
        events.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": stream, "args": {"name": name}}
        )
    for i in clock.intervals or []:
        events.append(
            {
                "ph": "X", "pid": rank, "tid": i.stream, "ts": i.start * 1e6,
                "dur": (i.end - i.start) * 1e6, "name": i.name, "cat": i.kind,
            }
        )  # fmt: skip
    for name, at, phase in clock.marks:
        events.append({"ph": phase, "pid": rank, "tid": 0, "ts": at * 1e6, "name": name})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(folder: Path, clock: Clock, *, rank: int, memory: dict[str, int]) -> None:
    """``timeline.json`` (rank 0) or ``timeline.rankN.json``, and the same for the trace."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = "" if rank == 0 else f".rank{rank}"
    document = timeline(clock, rank=rank, memory=memory)
    (folder / f"timeline{suffix}.json").write_text(json.dumps(document, indent=1) + "\n")
    if clock.intervals is not None:
        (folder / f"trace{suffix}.json").write_text(json.dumps(chrome_trace(clock, rank=rank)))


def _stream_name(stream: int, compute: int, kinds: dict[int, str] | None = None) -> str:
    """``compute`` for the default stream, else the stream's number and its latest work."""
    if stream == compute:
        return "compute"
    kind = (kinds or {}).get(stream)
    return f"stream {stream} ({kind})" if kind else f"stream {stream}"
