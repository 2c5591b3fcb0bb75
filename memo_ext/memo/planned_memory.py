"""``--memo-allocator plan``: MEMO's layer passes served at their planned addresses.

The allocator core (``memo_ext.allocator``) is installed before the first tensor of the run
(the CUDA pluggable allocator on a GPU, the c10 CPU-allocator shim on CPU), so every request of
the process goes through it. :class:`PlannedMemory` drives it over the passes MEMO's runtime
reports (``MemoRuntime.passes``: one offloaded layer's forward; one layer's backward with its
recompute, until the next pass begins or the step ends):

1. the first step of the process warms up (α is solved, the host pool and the transfer engine
   are built);
2. its step :data:`RECORD_ITERATION` records the request sequence of every pass. Passes with
   the same sequence of request sizes share a *kind*, planned from the latest free of each
   request over all its passes; each pass of a step remembers its kind by position (the first
   and last backward passes of a step can differ from the middle ones);
3. each kind's sequence is planned by the planner (its default backend within
   ``--memo-plan-work-limit`` work units, so a busy machine makes the same plan; checked by the
   planner's validator and again by the core when loaded); plans are cached on disk by a digest
   of the sequence and the run's shapes (one file per rank), so a restart plans nothing;
4. from then on the i-th request of a pass is served at arena base + its planned offset, or by
   the core's fallback path on any divergence (counted by reason; see ``memo_ext.allocator``).

What is planned: the *transients* of a pass, every tensor allocated and freed inside it. A
tensor that outlives its pass (the layer's output, the device sources of MEMO's in-flight
copies, prefetched host data, tensors kept for the backward at α < 1) is left to the core's
exact-size caching path (``unplanned``): planning it would put it in the arena that the next
pass's plan reuses from offset 0. docs/memo.md gives the measured consequence.

Frees whose timing varies (a block another thread still holds a little longer, say; on CUDA,
NCCL and autograd's device thread) make the next planned request over its bytes miss. The core
names the block that was in the way (``AllocatorCore.take_late``); at the end of the step its
kind is planned again with that block living to the end of its pass (or, when it outlived the
pass, left to the caching path). Lifetimes only grow, so a few steps settle every such block,
at the cost of a somewhat larger arena.

A kind whose passes keep missing (more than :data:`MISS_TOLERANCE` of its requests in two
consecutive steps) is recorded and planned once more; if it still misses, it falls back for
good, with a warning that names the dominant reason.

Planning is one-off work inside a training step: its seconds are counted apart
(:attr:`PlannedMemory.planning_s`, the metrics' ``plan_time_s``) and left out of the step's
measured time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memo_ext import device
from memo_ext.allocator.core import MISS_NAMES, UNPLANNED, AllocatorCore
from memo_ext.device import clock
from memo_ext.errors import UsageError
from memo_ext.files import writable_folder
from memo_ext.planner.plan import validate
from memo_ext.planner.planning import plan_trace
from memo_ext.planner.settings import PlannerConfig
from memo_ext.planner.trace import Alloc, Free, Trace

logger = logging.getLogger(__name__)

RECORD_ITERATION = 2
"""The step of this process whose passes are recorded (the first one warms up)."""
MAX_KINDS = 8
"""Distinct pass sequences the core can hold plans for."""
MISS_TOLERANCE = 0.01
"""Share of a kind's requests that may miss in a step before it counts as missing."""
OWN_MISSES = tuple(name for name in MISS_NAMES if name != "miss_thread")
"""Misses of a pass's own requests; ``miss_thread`` counts other threads' requests made while a
pass is open (a collective's worker thread, say), which are no part of its sequence."""
ALIGNMENT = 512
"""Plan offsets and sizes are multiples of this (the core's and PyTorch's rounding)."""


@dataclass
class KindPlan:
    """One planned pass sequence, as the core receives it."""

    sizes: list[int]
    offsets: list[int]
    """Arena offset per request, :data:`UNPLANNED` for the ones left to the fallback path."""
    alloc_at: list[int]
    free_at: list[int]
    peak_bytes: int
    """Arena bytes the plan needs (the planner's peak of the transients)."""
    status: str = ""
    """The planner's verdict (``optimal`` / ``feasible``)."""

    def to_json(self) -> dict:
        return {
            "format": "memo-pass-plan/1",
            "sizes": self.sizes,
            "offsets": [-1 if o == UNPLANNED else o for o in self.offsets],
            "alloc_at": self.alloc_at,
            "free_at": self.free_at,
            "peak_bytes": self.peak_bytes,
            "status": self.status,
        }

    @classmethod
    def from_json(cls, doc: object, record: PassRecord) -> KindPlan:
        """The plan a cache file holds for ``record``, checked as the planner's own result is:
        the right requests in the right order, offsets aligned, no two live blocks sharing a
        byte, inside its arena. A damaged file must never reach the core as a plan.

        Raises:
            ValueError: naming what is wrong with it.
        """
        if not isinstance(doc, dict) or doc.get("format") != "memo-pass-plan/1":
            raise ValueError("not a memo-pass-plan/1 document")
        fresh = _schedule(record)
        n = len(record.sizes)
        for name in ("sizes", "offsets", "alloc_at", "free_at"):
            values = doc.get(name)
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"{name} is not a list of {n} entries")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError(f"{name} holds something other than whole numbers")
        if doc["sizes"] != list(record.sizes) or doc["alloc_at"] != fresh.alloc_at:
            raise ValueError("its requests are not those of the recorded pass")
        if doc["free_at"] != fresh.free_at:
            raise ValueError("its frees are not those of the recorded pass")
        peak = doc.get("peak_bytes")
        if not isinstance(peak, int) or isinstance(peak, bool) or peak < 0:
            raise ValueError("peak_bytes is not a whole number of bytes")
        offsets = [UNPLANNED if o == -1 else o for o in doc["offsets"]]
        placed = [(i, o) for i, o in enumerate(offsets) if o != UNPLANNED]
        for i, o in placed:
            if o < 0 or o % ALIGNMENT or o + record.sizes[i] > peak or record.ends[i] < 0:
                raise ValueError(f"request {i} is placed at {o}, outside its arena or alignment")
        _check_no_overlap(record, fresh, placed)
        return cls(
            sizes=list(record.sizes),
            offsets=offsets,
            alloc_at=fresh.alloc_at,
            free_at=fresh.free_at,
            peak_bytes=peak,
            status=str(doc.get("status", "")),
        )


def _check_no_overlap(record: PassRecord, schedule: _Schedule, placed) -> None:
    """No two placed requests live at the same time share a byte (a sweep over the events)."""
    live: dict[int, tuple[int, int]] = {}
    events = sorted(
        [(schedule.alloc_at[i], 1, i) for i, _ in placed]
        + [(schedule.free_at[i], 0, i) for i, _ in placed]
    )
    where = dict(placed)
    for _, is_alloc, i in events:
        if not is_alloc:
            live.pop(i, None)
            continue
        start, end = where[i], where[i] + record.sizes[i]
        for j, (a, b) in live.items():
            if start < b and a < end:
                raise ValueError(f"requests {j} and {i} are live together in the same bytes")
        live[i] = (start, end)


def _usable_cache(cache_dir: str | Path | None) -> Path | None:
    """The plan cache folder, or None (plans made again in every run, said once) when it
    cannot be written."""
    if not cache_dir:
        return None
    try:
        return writable_folder(Path(cache_dir), what="the pass plan cache")
    except UsageError as err:
        logger.warning("%s; pass plans are made again in every run", err)
        return None


@dataclass(frozen=True)
class PassRecord:
    """One recorded pass in allocation time: request ``i`` has size ``sizes[i]`` and is freed
    before request ``ends[i]`` (``len(sizes)``: before the pass ends; -1: it outlives the pass).
    """

    sizes: tuple[int, ...]
    ends: tuple[int, ...]

    @classmethod
    def from_events(cls, events: list[tuple[str, int, int]]) -> PassRecord:
        """From the core's log: ``(op, request index, rounded size)`` in order. A block that
        another thread frees (a collective's worker dropping its buffer) is freed at a time of
        that thread's: it is left to the caching path like one that outlives the pass."""
        sizes: list[int] = []
        ends: dict[int, int] = {}
        for op, index, size in events:
            if op == "alloc":
                sizes.append(size)
            elif op == "free":
                ends[index] = len(sizes)  # freed after this many requests
        return cls(tuple(sizes), tuple(ends.get(i, -1) for i in range(len(sizes))))

    def merged(self, other: PassRecord) -> PassRecord:
        """Lifetimes that hold for both: a request that outlives either pass outlives; one
        freed at different points (released by another thread, a collective's worker say, at
        a time of its own) lives to the end of the pass; the others keep their common end."""
        n = len(self.sizes)
        ends = tuple(
            -1 if -1 in (a, b) else a if a == b else n
            for a, b in zip(self.ends, other.ends, strict=True)
        )
        return PassRecord(self.sizes, ends)

    def extended(self, late: dict[int, bool]) -> PassRecord:
        """Lifetimes of requests freed later than recorded: request ``i`` of ``late`` lives to
        the pass's end, or (``late[i]`` true: it outlived the pass) is left to the caching
        path."""
        n = len(self.sizes)
        ends = list(self.ends)
        for i, outlived in late.items():
            if 0 <= i < n and ends[i] != -1:
                ends[i] = -1 if outlived else n
        return PassRecord(self.sizes, tuple(ends))


def sequence_digest(sizes: tuple[int, ...], shape_key: str) -> str:
    """Digest of a pass's request sizes, in order, and the run's shapes: passes with the same
    digest share a plan (their frees may come in another order: other threads release some
    blocks, e.g. a collective's buffers, at times of their own)."""
    digest = hashlib.sha256(shape_key.encode())
    digest.update(",".join(map(str, sizes)).encode())
    return digest.hexdigest()[:24]


def plan_sequence(
    record: PassRecord,
    *,
    work_limit: float,
    time_limit_s: float | None = None,
    solver: str = "cpsat",
) -> KindPlan:
    """Plan the transients of a pass (the requests freed inside it) with the memory planner.

    Raises:
        PlanValidationError: when the planner's result does not validate (never served).
    """
    n = len(record.sizes)
    schedule = _schedule(record)
    transient = set(i for i in range(n) if record.ends[i] >= 0)
    offsets = [UNPLANNED] * n
    peak, status = 0, "optimal"
    if transient:
        trace = Trace([e for e in schedule.events if int(e.id) in transient])
        config = PlannerConfig(
            solver=solver,
            work_limit=work_limit,
            time_limit_s=time_limit_s,
            alignment=ALIGNMENT,
            bilevel=False,
        )
        plan = plan_trace(trace, config=config)
        validate(trace, plan)
        for key, offset in plan.offsets.items():
            offsets[int(key)] = int(offset)
        peak, status = int(plan.peak_bytes), plan.status
    return KindPlan(
        sizes=list(record.sizes),
        offsets=offsets,
        alloc_at=schedule.alloc_at,
        free_at=schedule.free_at,
        peak_bytes=_align(peak),
        status=status,
    )


@dataclass(frozen=True)
class _Schedule:
    """A recorded pass as the planner's events: each request's allocation and free positions
    (``free_at`` -1 for a request that outlives the pass)."""

    events: list
    alloc_at: list[int]
    free_at: list[int]


def _schedule(record: PassRecord) -> _Schedule:
    n = len(record.sizes)
    frees_before: dict[int, list[int]] = {}
    for i in range(n):
        if record.ends[i] >= 0:
            frees_before.setdefault(record.ends[i], []).append(i)
    events: list[Alloc | Free] = []
    alloc_at, free_at = [0] * n, [-1] * n
    for t in range(n + 1):
        for i in frees_before.get(t, ()):
            free_at[i] = len(events)
            events.append(Free(str(i)))
        if t < n:
            alloc_at[t] = len(events)
            events.append(Alloc(str(t), record.sizes[t]))
    return _Schedule(events=events, alloc_at=alloc_at, free_at=free_at)


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass
class _KindState:
    digest: str
    record: PassRecord | None = None
    """Every recording of the kind so far, merged (what its plan was made from)."""
    plan: KindPlan | None = None
    missing_steps: int = 0
    replanned: bool = False
    given_up: bool = False
    requests: int = 0
    misses: Counter = field(default_factory=Counter)


class PlannedMemory:
    """Record → plan → serve over MEMO's layer passes (see the module docstring)."""

    def __init__(
        self,
        core: AllocatorCore,
        *,
        shape_key: str,
        cache_dir: str | Path | None,
        work_limit: float,
        time_limit_s: float | None = None,
        rank: int = 0,
    ):
        self.core = core
        self.rank = rank
        """Plans are cached per rank: a rank's lifetimes depend on its own threads' timing."""
        self.shape_key = shape_key
        self.cache_dir = _usable_cache(cache_dir)
        self.step = 0
        """Steps this process has begun (a resumed run counts from its first step, too)."""
        self.kinds: list[_KindState] = []
        self.kind_at: list[int | None] = []
        """Kind of the n-th pass of a step (``None``: no plan for it)."""
        self.recording: set[int] = set()
        """Kinds whose passes record in this step (all of them in the recording step)."""
        self.replans = 0
        self.planning_s = 0.0
        """Seconds this step spent planning (and loading plans): no part of training."""
        self._ordinal = 0
        self._open: int | None = None
        self._limits = {"work_limit": work_limit, "time_limit_s": time_limit_s}
        self._open_stats: dict[str, int] | None = None
        self._recorded_now: list[tuple[int, str, list]] = []
        self._step_stats: dict[str, int] = {}
        core.take_late()  # the process-wide core may name blocks of plans before this one

    # --------------------------------------------------------------------------- passes

    @property
    def serving(self) -> bool:
        return self.step > RECORD_ITERATION

    def begin_pass(self, name: str) -> None:
        self._close()
        ordinal = self._ordinal
        self._ordinal += 1
        if self.step < RECORD_ITERATION:
            return
        kind = self.kind_at[ordinal] if ordinal < len(self.kind_at) else None
        record = self.step == RECORD_ITERATION or (kind is not None and kind in self.recording)
        if not record and (kind is None or self.kinds[kind].given_up):
            return  # no plan for this pass: its requests take the caching path
        self.core.set_mode("record" if record else "serve")
        self.core.begin_pass(0 if record else kind)
        self._open = ordinal
        self._open_stats = self.core.stats() if not record else None

    def end_pass(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._open is None:
            return
        ordinal, self._open = self._open, None
        self.core.end_pass()
        if self._open_stats is None:  # a recorded pass
            _, events = self.core.recorded()
            record = PassRecord.from_events(events)
            digest = sequence_digest(record.sizes, self.shape_key)
            self._recorded_now.append((ordinal, digest, record))
            return
        kind = self.kind_at[ordinal] if ordinal < len(self.kind_at) else None
        after = self.core.stats()
        if kind is not None:
            state = self.kinds[kind]
            state.requests += after["requests"] - self._open_stats["requests"]
            state.requests -= after["miss_thread"] - self._open_stats["miss_thread"]
            for name in OWN_MISSES:
                state.misses[name] += after[name] - self._open_stats[name]

    # ----------------------------------------------------------------------------- steps

    def begin_step(self, iteration: int) -> None:
        """``iteration`` is the run's; passes are recorded in this process's second step
        whatever it is (a resumed run starts past RECORD_ITERATION)."""
        self.step += 1
        self._ordinal = 0
        self._recorded_now = []
        self.planning_s = 0.0
        for state in self.kinds:
            state.requests, state.misses = 0, Counter()
        self.core.reset_stats()

    def end_step(self) -> None:
        """Close the open pass; plan what this step recorded; watch misses."""
        self._close()
        self.core.set_mode("off")
        self._step_stats = self.core.stats()
        if self.step == RECORD_ITERATION:
            with self._planning():
                self._learn_kinds()
        elif self.recording:
            with self._planning():
                self._replan()
        elif self.serving:
            self._absorb_late_frees()
            self._watch_misses()

    def end_evaluation(self) -> None:
        """Hand the fallback path's cached blocks back to the backend. An evaluation's requests
        (lengths of their own: other sizes) all take that path, whose free lists keep blocks by
        exact size: kept, each evaluation length would hold its blocks until the device ran out.
        The training step's own blocks come back from the backend once, then stay cached."""
        self.core.release_cached()

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Adds the block's wall time to :attr:`planning_s`. The device finishes the step's
        queued work first: planning then adds to the step's time instead of overlapping it, so
        leaving it out leaves the training's own time intact."""
        device.synchronize()
        start = clock()
        try:
            yield
        finally:
            self.planning_s += clock() - start

    def _learn_kinds(self) -> None:
        by_digest: dict[str, int] = {}
        self.kind_at = []
        sequences: dict[str, PassRecord] = {}
        for _, digest, record in self._recorded_now:
            if digest in sequences:
                sequences[digest] = sequences[digest].merged(record)
            elif len(by_digest) < MAX_KINDS:
                by_digest[digest] = len(by_digest)
                sequences[digest] = record
            self.kind_at.append(by_digest.get(digest))
        if len(set(d for _, d, _ in self._recorded_now)) > MAX_KINDS:
            logger.warning(
                "--memo-allocator plan: more than %d distinct layer passes per step; the others "
                "use the caching path",
                MAX_KINDS,
            )
        self.kinds = [_KindState(digest=d, record=sequences[d]) for d in by_digest]
        for digest, kind in by_digest.items():
            self.kinds[kind].plan = self._plan(digest, sequences[digest])
        self._load_all()

    def _plan(self, digest: str, record: PassRecord) -> KindPlan:
        path = self._path(digest)
        if path is not None and path.is_file():
            try:
                plan = KindPlan.from_json(json.loads(path.read_text()), record)
                logger.info("--memo-allocator plan: pass plan %s from %s", digest, path)
                return plan
            except (OSError, ValueError) as err:  # json's errors are ValueErrors
                logger.warning("ignoring the damaged pass plan %s (%s); planning again", path, err)
        plan = plan_sequence(record, **self._limits)
        planned = sum(o != UNPLANNED for o in plan.offsets)
        logger.info(
            "--memo-allocator plan: pass %s planned: %d of %d requests in an arena of %.2f MiB "
            "(%s)",
            digest,
            planned,
            len(plan.offsets),
            plan.peak_bytes / 2**20,
            plan.status,
        )
        self._save(digest, plan)
        return plan

    def _path(self, digest: str) -> Path | None:
        return self.cache_dir / f"{digest}-rank{self.rank}.json" if self.cache_dir else None

    def _save(self, digest: str, plan: KindPlan) -> None:
        path = self._path(digest)
        if path is None:
            return
        text = json.dumps(plan.to_json())
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            # a kind planned again after a late free may get the plan it had: the file stays
            if path.is_file() and path.read_bytes() == text.encode():
                return
            tmp.write_text(text)
            tmp.replace(path)
        except OSError as err:  # a cache: the run goes on, the next one plans again
            logger.warning("cannot keep the pass plan in %s (%s)", path, err.strerror or err)
            tmp.unlink(missing_ok=True)

    def _load_all(self) -> None:
        plans = [s.plan for s in self.kinds if s.plan is not None and not s.given_up]
        arena = max((p.peak_bytes for p in plans), default=0)
        if arena > self.core.arena_bytes():
            self.core.reserve_arena(arena)
        for kind, state in enumerate(self.kinds):
            if state.plan is not None and not state.given_up:
                p = state.plan
                self.core.load_plan(kind, p.sizes, p.offsets, p.alloc_at, p.free_at, p.peak_bytes)

    def _watch_misses(self) -> None:
        for kind, state in enumerate(self.kinds):
            if state.given_up or not state.requests:
                continue
            misses = sum(state.misses.values())
            if misses > MISS_TOLERANCE * state.requests:
                state.missing_steps += 1
            else:
                state.missing_steps = 0
            if state.missing_steps < 2:
                continue
            reason = state.misses.most_common(1)[0][0]
            if not state.replanned:
                state.replanned = True
                state.missing_steps = 0
                self.recording.add(kind)
                logger.warning(
                    "--memo-allocator plan: pass kind %d missed %d of %d requests (mostly %s); "
                    "recording it again",
                    kind,
                    misses,
                    state.requests,
                    reason,
                )
            else:
                state.given_up = True
                self.core.drop_plan(kind)
                logger.warning(
                    "--memo-allocator plan: pass kind %d still misses %d of %d requests after "
                    "a re-plan (mostly %s); it uses the caching path from now on",
                    kind,
                    misses,
                    state.requests,
                    reason,
                )

    def _absorb_late_frees(self) -> None:
        """Plan again each kind whose blocks were freed later than planned (module docstring)."""
        late: dict[int, dict[int, bool]] = defaultdict(dict)
        for kind, index, outlived in self.core.take_late():
            late[kind][index] = late[kind].get(index, False) or outlived
        changed = False
        for kind, blocks in late.items():
            state = self.kinds[kind] if 0 <= kind < len(self.kinds) else None
            if state is None or state.given_up or state.record is None:
                continue
            record = state.record.extended(blocks)
            if record == state.record:
                continue
            state.record = record
            with self._planning():
                state.plan = plan_sequence(record, **self._limits)
                self._save(state.digest, state.plan)
            self.replans += 1
            changed = True
            logger.info(
                "--memo-allocator plan: pass kind %d planned again: %d blocks were freed later "
                "than planned (arena %.2f MiB)",
                kind,
                len(blocks),
                state.plan.peak_bytes / 2**20,
            )
        if changed:
            with self._planning():
                self._load_all()

    def _replan(self) -> None:
        """Plan each re-recorded kind again from the lifetimes of all its passes this step."""
        merged: dict[int, PassRecord] = {}
        digests: dict[int, str] = {}
        for ordinal, digest, record in self._recorded_now:
            kind = self.kind_at[ordinal] if ordinal < len(self.kind_at) else None
            if kind not in self.recording:
                continue
            if kind not in merged:
                merged[kind], digests[kind] = record, digest
            elif digests[kind] == digest:
                merged[kind] = merged[kind].merged(record)
        for kind, record in merged.items():
            digest = digests[kind]
            state = self.kinds[kind]
            if state.digest == digest and state.record is not None:
                record = state.record.merged(record)  # the lifetimes of both recordings
            state.digest, state.record = digest, record
            state.plan = plan_sequence(record, **self._limits)
            self._save(digest, state.plan)
            self.replans += 1
        self.recording = set()
        self._load_all()

    # --------------------------------------------------------------------------- metrics

    def step_metrics(self) -> dict[str, float | int]:
        """This step's figures (the core's statistics since the step began)."""
        s = self._step_stats
        misses = sum(s.get(name, 0) for name in OWN_MISSES)
        judged = s.get("hits", 0) + misses
        metrics: dict[str, float | int] = {
            "plan_requests": s.get("requests", 0) - s.get("miss_thread", 0),
            "plan_hits": s.get("hits", 0),
            "plan_hit_bytes": s.get("hit_bytes", 0),
            "plan_misses": misses,
            "plan_unplanned_bytes": s.get("unplanned_bytes", 0),
            "plan_arena_bytes": s.get("arena_bytes", 0),
            "plan_arena_peak_bytes": s.get("arena_peak_live_bytes", 0),
            "plan_fallback_peak_bytes": s.get("fallback_peak_bytes", 0),
            "plan_replans": self.replans,
            "plan_time_s": self.planning_s,
        }
        for name in MISS_NAMES:
            metrics[f"plan_{name}"] = s.get(name, 0)
        if judged:
            metrics["plan_hit_ratio"] = s["hits"] / judged
        return metrics

    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes through the core in the last step: the arena's peak live
        bytes plus the fallback path's (their sum bounds the joint peak from above), and what
        is held from the backend (the arena, and fallback blocks live or cached)."""
        s = self._step_stats or self.core.stats()
        allocated = s["arena_peak_live_bytes"] + s["fallback_peak_bytes"]
        reserved = s["arena_bytes"] + s["fallback_live_bytes"] + s["fallback_cached_bytes"]
        return allocated, reserved


def format_plan_metrics(metrics: dict) -> str:
    if "plan_hit_ratio" not in metrics:
        return ""
    return (
        f"plan hits {metrics['plan_hit_ratio']:.3f} ({metrics['plan_misses']} misses), arena "
        f"{metrics['plan_arena_bytes'] / 2**20:.1f} MiB, fallback peak "
        f"{metrics['plan_fallback_peak_bytes'] / 2**20:.1f} MiB"
    )


def install_allocator(core: AllocatorCore) -> None:
    """Route this process's allocations through the core, before the first tensor of the run:
    the CUDA pluggable allocator on a GPU, the c10 CPU-allocator shim otherwise."""
    if device.on_gpu():
        from memo_ext.allocator.cuda import install_cuda_allocator

        install_cuda_allocator(core)
    else:
        from memo_ext.allocator.cpu import install_cpu_allocator

        core.init("host")
        install_cpu_allocator(core)


def shape_key(run) -> str:
    """What a recorded sequence depends on besides the code: shapes, layout, MEMO's settings
    (not where the cache is: a cache copied or shared into another folder is read there),
    dtype."""
    parts = {
        "shape": repr(run.shape),
        "seq": run.data.seq_length,
        "mbs": run.train.micro_batch_size,
        "layout": run.layout.describe(),
        "memo": repr(dataclasses.replace(run.memo, plan_cache=None)),
        "dtype": str(run.train.params_dtype),
        "device": device.compute_device().type,
        "torch": torch.__version__,
    }
    return json.dumps(parts, sort_keys=True)


__all__ = [
    "PlannedMemory",
    "KindPlan",
    "plan_sequence",
    "sequence_digest",
    "install_allocator",
    "format_plan_metrics",
    "shape_key",
]
