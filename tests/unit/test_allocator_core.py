"""The allocator core (``memo_ext/allocator``) on the host backend, and torch's CPU tensors
through it.

Programs (allocs, frees, pass brackets) are replayed through the core while a plain-Python model
checks it: every block handed out is tested against every block still live (no two may share a
byte), and each pass request is decided again by the rules of ``memo_ext.allocator.core``'s
docstring (hit at the planned offset, or the named miss). Plans come from instances with a known
optimal packing and from a real megatron-core layer trace planned by ``memo_ext.planner``.
"""

from __future__ import annotations

import collections
import ctypes
import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from memo_ext.allocator import core as core_module
from memo_ext.allocator.core import (
    MISS_NAMES,
    STAT_NAMES,
    UNPLANNED,
    AllocatorCore,
    AllocatorCoreError,
    CoreBuildError,
    PlanRefused,
)
from memo_ext.errors import UsageError
from memo_ext.planner.packable import packable_instance

ALIGN = 512
FAKE_STREAM = 0x5000


def rounded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


@pytest.fixture
def core() -> AllocatorCore:
    core = AllocatorCore()
    core.shutdown()
    core.init("host")
    core.reset_stats()
    yield core
    core.shutdown()


# ---- programs and the reference model ---------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of a program."""

    op: str
    """``begin``, ``end``, ``alloc``, ``free`` or ``thread_alloc`` (an alloc by another thread)."""
    id: str = ""
    size: int = 0
    kind: int = 0
    stream: int = 0


@dataclass
class PassPlan:
    """The plan of one pass kind, as ``AllocatorCore.load_plan`` takes it."""

    sizes: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    alloc_at: list[int] = field(default_factory=list)
    free_at: list[int] = field(default_factory=list)


def build_program(events: list[tuple], offsets: dict[str, int]) -> tuple[list[Step], dict]:
    """Brackets the passes of ``events`` and derives each pass kind's plan.

    ``events`` are ``("alloc", id, size, kind | None)`` and ``("free", id)`` in program order.
    A pass runs from its first alloc to the next alloc of another kind (frees in between belong
    to it), as the planner's passes do; each kind appears in one pass.
    """
    ranges = []  # [kind, first, stop]
    for k, event in enumerate(events):
        if event[0] == "alloc" and not (ranges and ranges[-1][0] == event[3]):
            if ranges:
                ranges[-1][2] = k
            ranges.append([event[3], k, len(events)])
    freed_at = {event[1]: k for k, event in enumerate(events) if event[0] == "free"}
    starts = {first: (kind, stop) for kind, first, stop in ranges}
    steps, plans, open_kind = [], {}, None
    for k, event in enumerate(events):
        if k in starts:
            if open_kind is not None:
                steps.append(Step("end"))
            open_kind, stop = starts[k]
            if open_kind is not None:
                assert open_kind not in plans, "one pass per kind"
                steps.append(Step("begin", kind=open_kind))
                plans[open_kind] = _pass_plan(events[k:stop], k, stop, freed_at, offsets)
        if event[0] == "alloc":
            steps.append(Step("alloc", id=event[1], size=event[2]))
        else:
            steps.append(Step("free", id=event[1]))
    if open_kind is not None:
        steps.append(Step("end"))
    return steps, plans


def _pass_plan(events, first, stop, freed_at, offsets) -> PassPlan:
    plan = PassPlan()
    for k, event in enumerate(events, start=first):
        if event[0] != "alloc":
            continue
        free = freed_at.get(event[1], -1)
        plan.sizes.append(rounded(event[2]))
        plan.offsets.append(offsets[event[1]])
        plan.alloc_at.append(k)
        plan.free_at.append(free if free < stop else -1)
    return plan


def load_plans(core: AllocatorCore, plans: dict[int, PassPlan], arena_bytes: int) -> None:
    core.reserve_arena(arena_bytes)
    for kind, plan in plans.items():
        core.load_plan(kind, plan.sizes, plan.offsets, plan.alloc_at, plan.free_at, arena_bytes)


class LiveBlocks:
    """Every block handed out and not freed; refuses one that shares a byte with another."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}

    def add(self, ptr: int, size: int) -> None:
        for other, other_size in self.blocks.items():
            assert ptr + size <= other or other + other_size <= ptr, (
                f"block [{ptr:#x}, +{size}) overlaps live block [{other:#x}, +{other_size})"
            )
        self.blocks[ptr] = size

    def remove(self, ptr: int) -> None:
        del self.blocks[ptr]


class ReferenceServer:
    """The hit / miss rules of ``memo_ext.allocator.core``, written again in plain Python."""

    def __init__(self, plans: dict[int, PassPlan]) -> None:
        self.plans = plans
        self.arena_live: dict[str, tuple[int, int]] = {}  # id -> [start, end) in the arena
        self.arena_stream: int | None = None
        self.kind: int | None = None
        self.counts: collections.Counter = collections.Counter()

    def begin(self, kind: int) -> None:
        self.kind, self.ordinal, self.pass_stream = kind, 0, None

    def end(self) -> None:
        self.kind = None

    def request(self, id: str, size: int, stream: int, *, owner: bool = True) -> int | None:
        """The planned offset the request gets, or None (fallback)."""
        if self.kind is None:
            return None
        self.counts["requests"] += 1
        if not owner:
            self.counts["miss_thread"] += 1
            return None
        i, self.ordinal = self.ordinal, self.ordinal + 1
        if self.pass_stream is None:
            self.pass_stream = stream
        reason, offset = self._decide(i, rounded(size), stream)
        self.counts[reason] += 1
        if reason != "hits":
            return None
        self.arena_live[id] = (offset, offset + rounded(size))
        self.arena_stream = stream if self.arena_stream is None else self.arena_stream
        return offset

    def _decide(self, i: int, size: int, stream: int) -> tuple[str, int]:
        plan = self.plans.get(self.kind)
        if plan is None:
            return "miss_no_plan", 0
        if i >= len(plan.sizes):
            return "miss_extra", 0
        if size != plan.sizes[i]:
            return "miss_size", 0
        if stream != self.pass_stream or self.arena_stream not in (None, stream):
            return "miss_stream", 0
        start, end = plan.offsets[i], plan.offsets[i] + size
        if any(start < b and a < end for a, b in self.arena_live.values()):
            return "miss_overlap", 0
        return "hits", start

    def free(self, id: str) -> None:
        self.arena_live.pop(id, None)


def run_program(
    core: AllocatorCore, steps: list[Step], model: ReferenceServer, live: LiveBlocks
) -> dict[str, int]:
    """Replays ``steps``; asserts each block's place against ``model`` and ``live``; returns
    the block addresses still held (id -> address)."""
    base, held = core.arena_base(), {}
    for step in steps:
        if step.op == "begin":
            core.begin_pass(step.kind)
            model.begin(step.kind)
        elif step.op == "end":
            core.end_pass()
            model.end()
        elif step.op == "free":
            ptr = held.pop(step.id)
            live.remove(ptr)
            model.free(step.id)
            core.free(ptr)
        else:
            owner = step.op == "alloc"
            ptr = core.alloc(step.size, step.stream) if owner else _alloc_on_thread(core, step)
            live.add(ptr, rounded(step.size))
            held[step.id] = ptr
            offset = model.request(step.id, step.size, step.stream, owner=owner)
            expected = "fallback" if offset is None else base + offset
            got = ptr if base <= ptr < base + core.arena_bytes() else "fallback"
            assert got == expected, f"request {step.id}: got {got}, the rules say {expected}"
    return held


def _alloc_on_thread(core: AllocatorCore, step: Step) -> int:
    out = []
    thread = threading.Thread(target=lambda: out.append(core.alloc(step.size, step.stream)))
    thread.start()
    thread.join()
    return out[0]


def free_all(core: AllocatorCore, held: dict[str, int], live: LiveBlocks) -> None:
    for ptr in held.values():
        live.remove(ptr)
        core.free(ptr)
    held.clear()


def assert_counts(core: AllocatorCore, model: ReferenceServer) -> dict[str, int]:
    stats = core.stats()
    misses = sum(stats[name] for name in MISS_NAMES)
    assert stats["requests"] == stats["hits"] + misses + stats["unplanned"]
    for name in ("requests", "hits", *MISS_NAMES):
        assert stats[name] == model.counts[name], name
    return stats


# ---- instances with a known optimal packing ----------------------------------------------------


def packable_program(seed: int, *, pieces: int = 60, passes: int = 4) -> tuple:
    """A perfectly packed instance (live total = arena at every instant once allocs are in) cut
    into ``passes`` consecutive passes by time; sizes and offsets in 512-byte units."""
    duration, height = 200, 128  # 128 x 512 bytes: one 64 KiB arena, no rounding slack
    problem, units = packable_instance(
        num_buffers=pieces, seed=seed, duration=duration, height=height
    )
    events_at = collections.defaultdict(lambda: ([], []))
    for k in range(problem.n):
        size = int(problem.sizes[k]) * ALIGN
        events_at[int(problem.start[k])][1].append(("alloc", f"b{k}", size))
        events_at[int(problem.end[k])][0].append(("free", f"b{k}"))
    events = []
    for t in sorted(events_at):
        frees, allocs = events_at[t]
        kind = min(t * passes // duration, passes - 1)
        events += frees + [(*alloc, kind) for alloc in allocs]
    offsets = {f"b{k}": int(units[k]) * ALIGN for k in range(problem.n)}
    return events, offsets, height * ALIGN


@pytest.mark.parametrize("seed", range(5))
def test_a_perfect_packing_is_served_at_its_offsets_to_the_last_byte(core, seed):
    events, offsets, arena_bytes = packable_program(seed)
    steps, plans = build_program(events, offsets)
    load_plans(core, plans, arena_bytes)
    core.set_mode("serve")
    model, live, blocks0 = ReferenceServer(plans), LiveBlocks(), core.live_blocks()
    held = run_program(core, steps, model, live)
    stats = assert_counts(core, model)
    assert stats["hits"] == stats["requests"] == len(offsets)
    # The packing fills the arena exactly: an off-by-one in the overlap test would miss here.
    assert stats["arena_peak_live_bytes"] == arena_bytes == core.arena_bytes()
    free_all(core, held, live)
    assert core.stats()["arena_live_bytes"] == 0 and core.live_blocks() == blocks0


@pytest.mark.parametrize("seed", range(6))
def test_random_divergences_never_serve_over_live_data(core, seed):
    events, offsets, arena_bytes = packable_program(seed, pieces=80)
    steps, plans = build_program(events, offsets)
    rng = np.random.default_rng(seed)
    perturbed, late = [], []
    for k, step in enumerate(steps):
        roll = rng.random()
        if step.op == "alloc" and roll < 0.08:
            step = replace(step, size=step.size + ALIGN)  # a size change
        elif step.op == "alloc" and roll < 0.12:
            perturbed.append(Step("alloc", id=f"x{k}", size=step.size))  # an inserted request
        elif step.op == "alloc" and roll < 0.15:
            perturbed.append(Step("thread_alloc", id=f"t{k}", size=step.size))
        elif step.op == "alloc" and roll < 0.17:
            step = replace(step, stream=FAKE_STREAM)
        elif step.op == "free" and roll < 0.15:
            late.append(step)  # freed after everything else
            continue
        perturbed.append(step)
    load_plans(core, plans, arena_bytes)
    core.set_mode("serve")
    model, live = ReferenceServer(plans), LiveBlocks()
    held = run_program(core, perturbed + late, model, live)
    stats = assert_counts(core, model)
    assert stats["hits"] > 0 and sum(stats[name] for name in MISS_NAMES) > 0
    free_all(core, held, live)


def test_requests_outside_passes_and_without_a_plan(core):
    core.reserve_arena(1 << 16)
    core.set_mode("serve")
    outside = core.alloc(1000)
    core.begin_pass(3)  # no plan for kind 3
    inside = core.alloc(1000)
    core.end_pass()
    stats = core.stats()
    assert stats["requests"] == stats["miss_no_plan"] == 1
    assert stats["fallback_requests"] == 2
    core.free(outside)
    core.free(inside)


# ---- a real layer trace, planned by memo_ext.planner --------------------------------------------


@pytest.fixture(scope="module")
def layer_program():
    """Two megatron-core layers, forward and backward, planned flat with 512-byte alignment;
    passes fwd0, fwd1, bwd1, bwd0 are kinds 0-3."""
    from memo_ext.mcore.transformer_config import traced_transformer_config
    from memo_ext.parallel import ParallelLayout
    from memo_ext.planner import PlannerConfig, plan_flat
    from memo_ext.planner.capture import trace_transformer_layer
    from memo_ext.planner.trace import Alloc
    from memo_ext.shapes import model_shape

    shape = model_shape(
        "gpt-7b", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256
    )
    config = traced_transformer_config(shape, layout=ParallelLayout(tp=1, sp=False))
    trace = trace_transformer_layer(config=config, seq_length=96, micro_batch_size=1, num_layers=2)
    plan = plan_flat(trace, config=PlannerConfig(work_limit=20, alignment=ALIGN))
    kinds = {("fwd", 0): 0, ("fwd", 1): 1, ("bwd", 1): 2, ("bwd", 0): 3}
    events = [
        ("alloc", e.id, e.size, kinds[(e.phase, e.layer)])
        if isinstance(e, Alloc)
        else ("free", e.id)
        for e in trace.events
    ]
    steps, plans = build_program(events, plan.offsets)
    # Tensors the trace never frees (the input gradient) go at the end of the iteration.
    freed = {step.id for step in steps if step.op == "free"}
    steps += [Step("free", id=s.id) for s in steps if s.op == "alloc" and s.id not in freed]
    # The solver proves this small plan optimal: its peak is the most bytes ever live at once.
    assert len(plans) == 4 and plan.peak_bytes == plan.lower_bound_bytes
    return steps, plans, plan.peak_bytes


def _serve(core, steps, plans, arena_bytes, *, iterations: int = 1) -> ReferenceServer:
    load_plans(core, plans, arena_bytes)
    core.set_mode("serve")
    core.reset_stats()
    model, live = ReferenceServer(plans), LiveBlocks()
    for _ in range(iterations):
        held = run_program(core, steps, model, live)
        free_all(core, held, live)
    assert_counts(core, model)
    return model


def test_a_layer_trace_is_served_entirely_at_its_plan(core, layer_program):
    steps, plans, arena_bytes = layer_program
    requests = sum(step.op == "alloc" for step in steps)
    _serve(core, steps, plans, arena_bytes)
    first = core.stats()
    assert first["hits"] == first["requests"] == requests
    assert first["arena_peak_live_bytes"] == arena_bytes  # served at the optimum
    _serve(core, steps, plans, arena_bytes, iterations=2)
    again = core.stats()
    assert again["hits"] == again["requests"] == 2 * requests
    assert again["fallback_backend_allocs"] == first["fallback_backend_allocs"] == 0


def test_unplanned_requests_go_to_the_fallback_path_uncounted_as_misses(core):
    core.reserve_arena(4096)
    # block 1 outlives the pass: the plan leaves it to the fallback path
    core.load_plan(0, [1024, 512, 1024], [0, UNPLANNED, 1024], [0, 1, 2], [3, -1, 4], 2048)
    core.set_mode("serve")
    base = core.arena_base()
    for _ in range(2):
        core.begin_pass(0)
        a, kept, b = core.alloc(1000), core.alloc(512), core.alloc(1024)
        assert (a, b) == (base, base + 1024)
        assert not base <= kept < base + 4096
        core.free(a)
        core.free(b)
        core.end_pass()
        core.free(kept)
    stats = core.stats()
    assert (stats["hits"], stats["unplanned"], stats["unplanned_bytes"]) == (4, 2, 1024)
    assert stats["requests"] == 6 and not any(stats[name] for name in MISS_NAMES)
    # its size is still checked
    core.begin_pass(0)
    a, wrong = core.alloc(1024), core.alloc(1536)
    assert core.stats()["miss_size"] == 1
    core.free(a)
    core.free(wrong)
    core.end_pass()


def test_an_unplanned_block_takes_no_room_in_the_plan(core):
    core.reserve_arena(1024)
    # both live at once, same offset: fine, since block 1 is not in the arena
    core.load_plan(0, [1024, 1024], [0, UNPLANNED], [0, 1], [2, -1], 1024)


def _first_alloc(steps, kind: int, nth: int = 0) -> int:
    """Index in ``steps`` of the ``nth`` alloc of the pass of ``kind``."""
    begin = steps.index(Step("begin", kind=kind))
    allocs = [k for k in range(begin, len(steps)) if steps[k].op == "alloc"]
    return allocs[nth]


def test_a_size_change_misses_alone(core, layer_program):
    steps, plans, arena_bytes = layer_program
    steps = list(steps)
    k = _first_alloc(steps, kind=2, nth=3)
    steps[k] = replace(steps[k], size=steps[k].size + ALIGN)
    _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    assert stats["miss_size"] == 1 and stats["hits"] == stats["requests"] - 1


def test_requests_beyond_the_plan_miss_as_extra(core, layer_program):
    steps, plans, arena_bytes = layer_program
    steps = list(steps)
    end = steps.index(Step("end"), steps.index(Step("begin", kind=1)))
    steps[end:end] = [Step("alloc", id="extra0", size=4096), Step("alloc", id="extra1", size=64)]
    _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    assert stats["miss_extra"] == 2 and stats["hits"] == stats["requests"] - 2


def test_an_inserted_request_shifts_its_pass_but_never_overlaps(core, layer_program):
    steps, plans, arena_bytes = layer_program
    steps = list(steps)
    k = _first_alloc(steps, kind=0, nth=2)
    steps.insert(k, Step("alloc", id="inserted", size=steps[k].size))
    _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    # Requests after the insertion are one behind the plan: they miss (size) or, where sizes
    # agree, land on another request's slot, and only where no live block is.
    assert stats["hits"] < stats["requests"] - 1
    assert stats["miss_extra"] == 1  # the pass's last request has no planned slot


def test_a_late_free_makes_the_planned_range_miss_as_overlap(core, layer_program):
    steps, plans, arena_bytes = layer_program
    # A forward-0 tensor freed inside its pass whose bytes the plan gives to a later request.
    plan0 = plans[0]
    candidates = [
        i
        for i, free in enumerate(plan0.free_at)
        if free >= 0 and _reused_later(plans, 0, i, plan0.offsets[i], plan0.sizes[i])
    ]
    assert candidates, "the layer plan reuses no freed forward bytes"
    i = candidates[0]
    ids = [s.id for s in steps[steps.index(Step("begin", kind=0)) :] if s.op == "alloc"]
    late = Step("free", id=ids[i])
    steps = [s for s in steps if s != late] + [late]
    model = _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    assert stats["miss_overlap"] >= 1 and stats["miss_overlap"] == model.counts["miss_overlap"]
    assert stats["requests"] == stats["hits"] + stats["miss_overlap"]


def _reused_later(plans, kind, i, offset, size) -> bool:
    plan = plans[kind]
    later = [(o, s) for j, (o, s) in enumerate(zip(plan.offsets, plan.sizes)) if j > i] + [
        (o, s) for k in plans if k > kind for o, s in zip(plans[k].offsets, plans[k].sizes)
    ]
    return any(o < offset + size and offset < o + s for o, s in later)


def test_another_thread_misses_without_moving_the_pass(core, layer_program):
    steps, plans, arena_bytes = layer_program
    steps = list(steps)
    k = _first_alloc(steps, kind=3, nth=4)
    # Same size as the owner's next request: only the thread rule keeps it out of the arena.
    steps.insert(k, Step("thread_alloc", id="elsewhere", size=steps[k].size))
    _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    assert stats["miss_thread"] == 1 and stats["hits"] == stats["requests"] - 1


def test_another_stream_misses(core, layer_program):
    steps, plans, arena_bytes = layer_program
    steps = list(steps)
    k = _first_alloc(steps, kind=1, nth=5)
    steps[k] = replace(steps[k], stream=FAKE_STREAM)
    _serve(core, steps, plans, arena_bytes)
    stats = core.stats()
    assert stats["miss_stream"] == 1 and stats["hits"] == stats["requests"] - 1


def test_the_arena_serves_the_stream_of_its_first_hit(core):
    core.reserve_arena(1 << 16)
    core.load_plan(0, [512], [0], [0], [1], arena_bytes=512)
    core.set_mode("serve")
    for stream, hit in ((0, True), (FAKE_STREAM, False), (0, True)):
        # A block freed by work queued on one stream must not be handed to another.
        core.begin_pass(0)
        ptr = core.alloc(512, stream)
        core.end_pass()
        core.free(ptr)
        assert (ptr == core.arena_base()) == hit
    assert core.stats()["miss_stream"] == 1


# ---- plans refused on load ---------------------------------------------------------------------

GOOD = {"sizes": [512, 1024], "offsets": [0, 512], "alloc_at": [0, 1], "free_at": [-1, -1]}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"offsets": [100, 1024]}, "offset 100, which is not a multiple of 512"),
        ({"sizes": [1000, 1024]}, "size 1000 bytes, which is not a positive multiple"),
        ({"sizes": [0, 1024]}, "size 0 bytes"),
        ({"offsets": [0, 1536]}, "past the plan's arena of 2048 bytes"),
        ({"free_at": [0, -1]}, "freed after it is allocated"),
        ({"offsets": [0, 0]}, "blocks 0 and 1 are live at the same time and overlap"),
        ({"alloc_at": [1, 0]}, "blocks must be listed in request order"),
        ({"offsets": [-512, 512]}, "must be non-negative"),
        ({"free_at": [-1]}, "must have the same length"),
    ],
)
def test_a_bad_plan_is_refused_with_a_sentence(core, change, words):
    core.reserve_arena(1 << 16)
    with pytest.raises(PlanRefused, match=words) as refused:
        core.load_plan(0, **{**GOOD, **change}, arena_bytes=2048)
    assert isinstance(refused.value, UsageError) and "\n" not in str(refused.value)


def test_a_refused_plan_keeps_the_loaded_one(core):
    core.reserve_arena(1 << 16)
    core.load_plan(0, **GOOD, arena_bytes=2048)
    with pytest.raises(PlanRefused):
        core.load_plan(0, **{**GOOD, "offsets": [0, 0]}, arena_bytes=2048)
    core.set_mode("serve")
    core.begin_pass(0)
    ptrs = [core.alloc(512), core.alloc(1024)]
    core.end_pass()
    assert [p - core.arena_base() for p in ptrs] == [0, 512]
    for ptr in ptrs:
        core.free(ptr)


def test_reused_bytes_after_a_free_are_accepted(core):
    # Block 0 lives over events [0, 2); block 1 starts at event 2 on the same bytes.
    core.reserve_arena(1 << 16)
    core.load_plan(1, [1024, 1024], [0, 0], [0, 2], [2, -1], arena_bytes=1024)


def test_a_plan_larger_than_the_arena_is_refused(core):
    core.reserve_arena(1 << 16)
    with pytest.raises(PlanRefused, match="reserve the arena"):
        core.load_plan(0, **GOOD, arena_bytes=1 << 20)


# ---- record mode ---------------------------------------------------------------------------


def test_record_logs_the_owner_s_events_of_the_pass(core):
    before = core.alloc(700)
    core.set_mode("record")
    core.begin_pass(5)
    a, b = core.alloc(1000), core.alloc(10)
    other = _alloc_on_thread(core, Step("thread_alloc", size=4096))  # not the owner's
    core.free(a)
    core.free(before)  # allocated before the pass: not an event of it
    c = core.alloc(512)
    core.end_pass()
    core.free(b)  # after the pass: b is alive at the end
    assert core.recorded() == (
        5,
        [("alloc", 0, 1024), ("alloc", 1, 512), ("free", 0, 1024), ("alloc", 2, 512)],
    )
    stats = core.stats()
    assert stats["requests"] == 0 and stats["fallback_requests"] == 5
    # A pass in mode off leaves the log alone; the next recorded pass replaces it.
    core.set_mode("off")
    core.begin_pass(1)
    core.free(c)
    core.end_pass()
    assert core.recorded()[0] == 5
    core.set_mode("record")
    core.begin_pass(2)
    core.free(other)
    core.end_pass()
    assert core.recorded() == (2, [])


def test_passes_never_nest(core):
    core.begin_pass(0)
    with pytest.raises(AllocatorCoreError, match="still open"):
        core.begin_pass(1)
    core.end_pass()
    with pytest.raises(AllocatorCoreError, match="no pass open"):
        core.end_pass()
    with pytest.raises(AllocatorCoreError, match="out of range"):
        core.begin_pass(8)


# ---- the fallback cache and the arena ----------------------------------------------------------


def test_the_fallback_caches_exact_sizes_per_stream(core):
    live0 = core.stats()["fallback_live_bytes"]  # blocks other tests left alive, if any
    sizes = [100, 512, 5000, 70000]
    for _ in range(3):
        ptrs = [core.alloc(size) for size in sizes]
        for ptr in ptrs:
            core.free(ptr)
    stats = core.stats()
    # 100 and 512 both round to 512 but are live together: one backend call each per size.
    assert stats["fallback_backend_allocs"] == len(sizes)
    assert stats["fallback_cached_bytes"] == sum(map(rounded, sizes))
    assert stats["fallback_peak_bytes"] == live0 + stats["fallback_cached_bytes"]
    ptr = core.alloc(5000, FAKE_STREAM)  # a block cached for stream 0 is not reused
    assert core.stats()["fallback_backend_allocs"] == len(sizes) + 1
    core.free(ptr)
    core.release_cached()
    stats = core.stats()
    assert stats["fallback_cached_bytes"] == 0 and stats["fallback_live_bytes"] == live0
    core.free(core.alloc(100))
    assert core.stats()["fallback_backend_allocs"] == len(sizes) + 2


def test_the_pointer_table_keeps_thousands_of_blocks(core):
    # Enough blocks that the table grows several times and probe chains cross freed slots.
    rng = np.random.default_rng(0)
    blocks0, live0 = core.live_blocks(), core.stats()["fallback_live_bytes"]
    ptrs = [core.alloc(int(size)) for size in rng.integers(1, 4 * ALIGN, size=6000)]
    assert len(set(ptrs)) == len(ptrs) and core.live_blocks() == blocks0 + len(ptrs)
    for k, ptr in enumerate(rng.permutation(ptrs)):
        core.free(int(ptr))
        if k % 1000 == 0:  # every block still live must still be known
            assert core.live_blocks() == blocks0 + len(ptrs) - k - 1
    assert core.live_blocks() == blocks0 and core.stats()["fallback_live_bytes"] == live0


def test_reset_stats_restarts_counters_and_peaks(core):
    live0 = core.stats()["fallback_live_bytes"]
    keep, drop = core.alloc(2048), core.alloc(4096)
    core.free(drop)
    core.reset_stats()
    stats = core.stats()
    assert stats["fallback_peak_bytes"] == stats["fallback_live_bytes"] == live0 + 2048
    assert stats["fallback_requests"] == 0 and stats["fallback_cached_bytes"] == 4096
    core.free(keep)


def test_the_arena_grows_only_with_nothing_live_in_it(core):
    core.reserve_arena(1000)
    # exactly what a plan asks for (to the 512-byte block size), on a 64 KiB-aligned base
    assert core.arena_bytes() == 1024 and core.arena_base() % (1 << 16) == 0
    core.load_plan(0, [512], [0], [0], [-1], arena_bytes=512)
    core.set_mode("serve")
    core.begin_pass(0)
    ptr = core.alloc(512)
    core.end_pass()
    assert ptr == core.arena_base()
    with pytest.raises(AllocatorCoreError, match="cannot grow"):
        core.reserve_arena(1 << 20)
    core.free(ptr)
    core.reserve_arena(1 << 20)
    assert core.arena_bytes() == 1 << 20


def test_stat_names_match_the_core():
    assert AllocatorCore()._lib.memo_stats_count() == len(STAT_NAMES)


# ---- building and backends -----------------------------------------------------------------


def test_the_core_compiles_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setattr(core_module, "_built_library", lambda: None)
    monkeypatch.setattr(core_module, "_cache_dir", lambda: tmp_path)
    path = core_module.find_or_build_core()
    assert path.parent.parent == tmp_path and path.is_file()
    library = ctypes.CDLL(str(path))
    assert library.memo_abi_version() == core_module.ABI_VERSION
    assert f"memo-core-source:{core_module._source_digest()}".encode() in path.read_bytes()


def test_without_a_compiler_the_error_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(core_module, "_built_library", lambda: None)
    monkeypatch.setattr(core_module, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(core_module.shutil, "which", lambda name: None)
    with pytest.raises(CoreBuildError, match="no C compiler was found") as error:
        core_module.find_or_build_core()
    assert isinstance(error.value, UsageError)


def test_cuda_without_a_runtime_is_refused_with_a_sentence(core):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal needs a machine without")
    with pytest.raises(AllocatorCoreError, match="CUDA") as error:
        core.init("cuda")
    assert str(error.value).endswith(".") and core.backend() == "host"


FAKE_CUDART = r"""
#include <stdlib.h>
static long mallocs, frees, cleared;
int cudaMalloc(void **ptr, size_t n) {
    if (n > (1ul << 40)) return 2; /* cudaErrorMemoryAllocation */
    mallocs++;
    return posix_memalign(ptr, 512, n) ? 2 : 0;
}
int cudaGetLastError(void) { cleared++; return 0; }
int cudaFree(void *ptr) { frees++; free(ptr); return 0; }
int cudaGetDevice(int *device) { *device = 3; return 0; }
long fake_mallocs(void) { return mallocs; }
long fake_frees(void) { return frees; }
long fake_cleared(void) { return cleared; }
"""

CUDA_SCRIPT = r"""
import ctypes, json, sys
fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the process's cudaMalloc, as torch's
from memo_ext.allocator.core import AllocatorCore
core = AllocatorCore()
core.init("cuda")
core.reserve_arena(1 << 20)
core.load_plan(0, [1024, 2048], [0, 1024], [0, 1], [2, -1], arena_bytes=3072)
core.set_mode("serve")
mallocs, offsets = [], []
for step in range(4):
    outside = core.alloc(3000, stream=0x77)
    core.begin_pass(0)
    a, b, extra = core.alloc(1000, stream=0x77), core.alloc(2000, stream=0x77), core.alloc(9000)
    core.free(a)
    core.end_pass()
    for ptr in (b, extra, outside):
        core.free(ptr)
    offsets.append([a - core.arena_base(), b - core.arena_base()])
    mallocs.append(fake.fake_mallocs())
stats = core.stats()
core.release_cached()
try:
    core.alloc(1 << 41)
    refused = ""
except Exception as err:
    refused = str(err)
print(json.dumps({"mallocs": mallocs, "offsets": offsets, "stats": stats,
                  "frees": fake.fake_frees(), "refused": refused,
                  "cleared": fake.fake_cleared()}))
"""


def test_the_cuda_backend_calls_cudamalloc_only_until_the_cache_is_warm(tmp_path):
    """A stand-in libcudart (host memory behind cudaMalloc) in its own process: the core finds
    it through the process's symbols, as it finds torch's libcudart on a GPU."""
    source = tmp_path / "fake_cudart.c"
    source.write_text(FAKE_CUDART)
    library = tmp_path / "libfake_cudart.so"
    compiler = core_module._find_compiler()
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    result = subprocess.run(
        [sys.executable, "-c", CUDA_SCRIPT, str(library)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # The arena and the two fallback sizes (3000 on stream 0x77, 9000 on stream 0), once.
    assert out["mallocs"] == [3, 3, 3, 3]
    assert out["offsets"] == [[0, 1024]] * 4
    stats = out["stats"]
    assert stats["hits"] == 8 and stats["miss_extra"] == 4 and stats["requests"] == 12
    assert out["frees"] == 2  # release_cached handed the two cached blocks back
    # Out of device memory: an error sentence, and CUDA's error state cleared for torch.
    assert "could not allocate" in out["refused"] and out["cleared"] == 1


# ---- torch's CPU tensors through the core ------------------------------------------------------


@pytest.fixture
def shim(core):
    """The CPU shim, built (or taken from torch's extension cache) and installed."""
    torch = pytest.importorskip("torch")
    from memo_ext.allocator import cpu

    try:
        cpu.build_shim()
    except cpu.ShimBuildError as err:
        if "C++ compiler" in str(err):
            pytest.skip(f"no C++ compiler: {err}")
        raise
    cpu.install_cpu_allocator(core)
    try:
        yield torch
    finally:
        cpu.uninstall_cpu_allocator()


def test_torch_cpu_tensors_go_through_the_core(core, shim):
    torch = shim
    before = core.stats()["fallback_requests"]
    x = torch.empty(1000)
    assert core.stats()["fallback_requests"] == before + 1
    assert core.stats()["fallback_live_bytes"] >= rounded(4000)
    del x


def test_tensors_of_a_served_pass_live_at_their_planned_offsets(core, shim):
    torch = shim

    def program():
        a = torch.empty(1000)
        b = torch.empty(3000, dtype=torch.uint8)
        del a
        c = torch.empty(700, dtype=torch.float64)
        return b, c

    core.set_mode("record")
    core.begin_pass(0)
    kept = program()
    core.end_pass()
    del kept
    kind, events = core.recorded()
    assert [e[:2] for e in events] == [("alloc", 0), ("alloc", 1), ("free", 0), ("alloc", 2)]
    core.reserve_arena(1 << 16)
    # Block 0 is freed before block 2 is allocated, so they may share bytes.
    core.load_plan(0, [4096, 3072, 5632], [3072, 0, 3072], [0, 1, 3], [2, -1, -1], 8704)
    core.set_mode("serve")
    core.begin_pass(0)
    b, c = program()
    core.end_pass()
    assert b.data_ptr() - core.arena_base() == 0 and c.data_ptr() - core.arena_base() == 3072
    assert core.stats()["hits"] == 3
    del b, c
    assert core.stats()["arena_live_bytes"] == 0


def test_a_recorded_torch_step_planned_and_served_computes_the_same(core, shim):
    """Record an MLP's forward and backward, plan the log with the planner, serve it: every
    request hits and losses and gradients equal a run on torch's own allocator bit for bit."""
    torch = shim
    from memo_ext.allocator import cpu
    from memo_ext.planner import PlannerConfig, plan_flat
    from memo_ext.planner.trace import Alloc, Free, Trace

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=generator)
    w1 = torch.randn(32, 128, generator=generator, requires_grad=True)
    w2 = torch.randn(128, 32, generator=generator, requires_grad=True)

    def step():
        loss = torch.nn.functional.gelu(x @ w1).matmul(w2).square().mean()
        loss.backward()
        grads = (w1.grad.clone(), w2.grad.clone())
        w1.grad = w2.grad = None
        return loss.detach(), grads

    cpu.uninstall_cpu_allocator()
    reference = step()
    cpu.install_cpu_allocator(core)
    core.set_mode("record")
    core.begin_pass(4)
    step()
    core.end_pass()
    _, events = core.recorded()
    trace = Trace(
        [Alloc(f"r{i}", size) if t == "alloc" else Free(f"r{i}") for t, i, size in events]
    )
    plan = plan_flat(trace, config=PlannerConfig(work_limit=10, alignment=ALIGN))
    steps, plans = build_program(
        [(t, f"r{i}", size, 4) if t == "alloc" else (t, f"r{i}") for t, i, size in events],
        plan.offsets,
    )
    load_plans(core, plans, plan.peak_bytes)
    core.set_mode("serve")
    core.reset_stats()
    core.begin_pass(4)
    loss, grads = step()
    core.end_pass()
    stats = core.stats()
    assert stats["hits"] == stats["requests"] == len(plans[4].sizes) > 5
    base = core.arena_base()
    assert loss.data_ptr() - base in plans[4].offsets  # results live in the arena too
    assert torch.equal(loss, reference[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, reference[1]))


def test_without_a_cxx_compiler_the_shim_says_so(monkeypatch):
    from memo_ext.allocator import shim

    monkeypatch.setattr(shim, "_shim", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(shim.ShimBuildError, match="needs a C\\+\\+ compiler") as error:
        shim.build_shim()
    assert isinstance(error.value, UsageError)


def test_a_fork_while_another_thread_allocates_leaves_the_child_a_usable_core(core):
    """fork() copies one thread: the core's lock is held across it, so no thread can be inside
    the core at that moment and the child can allocate."""
    import os
    import time

    stop = threading.Event()

    def churn():
        while not stop.is_set():
            core.free(core.alloc(4096))

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:  # the child: allocate and leave at once, whatever happens
                try:
                    core.free(core.alloc(8192))
                    os._exit(0)
                finally:
                    os._exit(1)
            deadline = time.monotonic() + 10
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the child hung on the core's lock")
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        thread.join()
