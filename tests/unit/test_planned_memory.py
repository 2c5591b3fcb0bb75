"""--memo-allocator plan's driver over a real allocator core: record, plan, serve, re-plan."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from memo_ext.allocator.core import UNPLANNED, AllocatorCore
from memo_ext.features.memo.extension import Memo
from memo_ext.memo.planned_memory import (
    RECORD_ITERATION,
    KindPlan,
    PassRecord,
    PlannedMemory,
    plan_sequence,
    sequence_digest,
)

FORWARD = [("a", 4096), ("a", 8192), ("f", 0), ("a", 4096), ("f", 1), ("keep", 2048), ("f", 2)]
"""A pass as a program: allocate (size), free the n-th allocation of the pass, or allocate a
block that outlives the pass."""


@pytest.fixture
def core():
    core = AllocatorCore()
    core.init("host")
    yield core
    core.shutdown()


def run_pass(core: AllocatorCore, memory: PlannedMemory, program, *, late: int | None = None):
    """One pass of ``program``; returns (pointers by allocation, blocks that outlive it)."""
    memory.begin_pass("forward")
    pointers, kept = [], []
    for op, value in program:
        if op in ("a", "keep"):
            pointers.append(core.alloc(value))
            if op == "keep":
                kept.append(pointers[-1])
        elif value != late:
            core.free(pointers[value])
    memory.end_pass()
    if late is not None:  # freed after the pass: it is still live when the next one starts
        kept.append(pointers[late])
    return pointers, kept


def run_step(core, memory, iteration, *, passes=3, late=None, program=FORWARD):
    """One training step of ``passes`` passes; a pass's outliving blocks are freed once the
    next pass has ended."""
    memory.begin_step(iteration)
    results, previous = [], []
    for _ in range(passes):
        pointers, kept = run_pass(core, memory, program, late=late)
        for ptr in previous:
            core.free(ptr)
        results.append(pointers)
        previous = kept
    memory.end_step()
    for ptr in previous:
        core.free(ptr)
    return results


def test_pass_record_reads_lifetimes_in_allocation_time():
    events = [("alloc", 0, 512), ("alloc", 1, 1024), ("free", 0, 512), ("alloc", 2, 512)]
    record = PassRecord.from_events(events)
    assert record.sizes == (512, 1024, 512)
    assert record.ends == (2, -1, -1)  # block 0 is freed after two requests; 1 and 2 outlive
    later = PassRecord((512, 1024, 512), (3, -1, 3))
    # freed at two points: to the end of the pass; outliving once: outliving
    assert record.merged(later).ends == (3, -1, -1)
    assert PassRecord((512, 512), (1, 2)).merged(PassRecord((512, 512), (1, 1))).ends == (1, 2)


def test_plan_sequence_places_transients_and_leaves_the_rest():
    record = PassRecord((4096, 8192, 4096, 2048), (2, 3, 4, -1))
    plan = plan_sequence(record, work_limit=5)
    assert plan.offsets[3] == UNPLANNED
    # 0 and 1 overlap in time, 1 and 2 too; 0 and 2 do not: 12 KiB is optimal
    assert plan.peak_bytes == 12288
    a, b, c = plan.offsets[:3]
    assert a + 4096 <= b or b + 8192 <= a
    assert c + 4096 <= b or b + 8192 <= c


def test_digest_depends_on_sizes_and_shapes_only():
    assert sequence_digest((512, 1024), "x") == sequence_digest((512, 1024), "x")
    assert sequence_digest((512, 1024), "x") != sequence_digest((1024, 512), "x")
    assert sequence_digest((512, 1024), "x") != sequence_digest((512, 1024), "y")


def test_record_then_serve_every_transient_at_its_offset(core, tmp_path):
    memory = PlannedMemory(core, shape_key="t", cache_dir=tmp_path, work_limit=5)
    for iteration in range(1, RECORD_ITERATION + 1):
        run_step(core, memory, iteration)
    plan = memory.kinds[0].plan
    assert memory.kind_at == [0, 0, 0]
    steps = [run_step(core, memory, it) for it in (3, 4)]
    base = core.arena_base()
    for pointers in (p for step in steps for p in step):
        planned = [base + o for o in plan.offsets if o != UNPLANNED]
        assert [pointers[i] for i in (0, 1, 2)] == planned
        assert not base <= pointers[3] < base + core.arena_bytes()  # outlives: not in the arena
    metrics = memory.step_metrics()
    assert metrics["plan_hit_ratio"] == 1.0
    assert metrics["plan_hits"] == 9 and metrics["plan_misses"] == 0
    assert metrics["plan_arena_bytes"] == plan.peak_bytes == 12288
    assert metrics["plan_unplanned_bytes"] == 3 * 2048
    # the plan is on disk, keyed by the digest, and a new run reads it instead of planning
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    assert KindPlan.from_json(json.loads(files[0].read_text()), memory.kinds[0].record) == plan


def test_a_cached_plan_is_reused(core, tmp_path, caplog):
    for _ in range(2):
        memory = PlannedMemory(core, shape_key="t", cache_dir=tmp_path, work_limit=5)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for iteration in range(1, RECORD_ITERATION + 1):
                run_step(core, memory, iteration)
    assert "from " + str(tmp_path) in caplog.text


def test_a_late_free_is_planned_again_and_a_divergence_gives_up(core, caplog):
    memory = PlannedMemory(core, shape_key="t", cache_dir=None, work_limit=5)
    for iteration in range(1, RECORD_ITERATION + 1):
        run_step(core, memory, iteration)
    caplog.set_level(logging.INFO)
    # from now on block 1 is freed only after the pass: the next pass's range for it is taken;
    # the core names the block, and the kind is planned again with it outliving its pass
    run_step(core, memory, 3, late=1)
    assert memory.step_metrics()["plan_miss_overlap"] > 0
    assert memory.replans == 1 and memory.kinds[0].plan.offsets[1] == UNPLANNED
    assert "1 blocks were freed later than planned" in caplog.text
    for iteration in (4, 5):
        run_step(core, memory, iteration, late=1)
        assert memory.step_metrics()["plan_misses"] == 0
    # a divergence the plan cannot absorb (another size): recorded again, then given up
    grown = [("a", 8192), *FORWARD[1:]]
    for iteration in (6, 7):
        run_step(core, memory, iteration, late=1, program=grown)
        assert memory.step_metrics()["plan_miss_size"] == 3
    assert "recording it again" in caplog.text and memory.recording == {0}
    run_step(core, memory, 8, late=1)  # recorded with the old program
    for iteration in (9, 10):
        run_step(core, memory, iteration, late=1, program=grown)
    assert memory.kinds[0].given_up and "from now on" in caplog.text
    run_step(core, memory, 11, late=1, program=grown)
    assert memory.step_metrics()["plan_requests"] == 0  # the caching path only


def test_blocks_freed_late_within_their_pass_live_to_its_end(core):
    """A late free inside the pass: the block is planned to the end of its pass, not left to
    the caching path."""
    record = PassRecord((4096, 8192, 4096), (1, 3, 3))
    assert record.extended({0: False}).ends == (3, 3, 3)
    assert record.extended({0: True}).ends == (-1, 3, 3)
    assert PassRecord((512,), (-1,)).extended({0: False}).ends == (-1,)  # outliving stays


def test_a_resumed_run_records_its_own_second_step(core):
    memory = PlannedMemory(core, shape_key="t", cache_dir=None, work_limit=5)
    for iteration in (41, 42, 43):  # a run resumed from iteration 40
        run_step(core, memory, iteration)
    assert memory.kinds and memory.step_metrics()["plan_hit_ratio"] == 1.0


def test_blocks_freed_by_another_thread_are_left_to_the_caching_path(core):
    import threading

    core.reserve_arena(0)
    core.set_mode("record")
    core.begin_pass(0)
    own, shared = core.alloc(4096), core.alloc(4096)
    worker = threading.Thread(target=core.free, args=(shared,))  # a collective's worker
    worker.start()
    worker.join()
    core.free(own)
    core.end_pass()
    _, events = core.recorded()
    assert [op for op, _, _ in events] == ["alloc", "alloc", "free_other", "free"]
    record = PassRecord.from_events(events)
    assert record.ends == (2, -1)
    assert plan_sequence(record, work_limit=5).offsets[1] == UNPLANNED


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--memo-allocator", "plan"], "--memo-allocator only applies with --memo; add --memo"),
        (
            ["--memo", "--memo-allocator", "plan", "--variable-seq-lengths"],
            "packed documents (--variable-seq-lengths, --hotspa) change it every step",
        ),
        (["--memo", "--memo-plan-time-limit", "0"], "--memo-plan-time-limit must be positive"),
        (["--memo", "--memo-plan-work-limit", "0"], "--memo-plan-work-limit must be positive"),
        (["--memo-plan-work-limit", "5"], "--memo-plan-work-limit only applies with --memo"),
    ],
)
def test_the_planned_allocator_refuses_in_one_sentence(extra, message):
    from memo_ext.arguments import parse_args
    from memo_ext.errors import UsageError
    from tests.launch import SMALL_GPT

    argv = [*SMALL_GPT, "--micro-batch-size", "1", *extra]
    with pytest.raises(UsageError) as err:
        parse_args(argv, world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def _cached_plan(core, tmp_path):
    memory = PlannedMemory(core, shape_key="t", cache_dir=tmp_path, work_limit=5)
    for iteration in range(1, RECORD_ITERATION + 1):
        run_step(core, memory, iteration)
    (path,) = tmp_path.glob("*.json")
    return path, memory.kinds[0].plan, memory.kinds[0].record


def _damaged(doc: dict, damage: str) -> dict:
    doc = json.loads(json.dumps(doc))
    placed = [i for i, o in enumerate(doc["offsets"]) if o >= 0]
    if damage == "strings":
        doc["offsets"] = [str(o) for o in doc["offsets"]]
    elif damage == "overlap":  # two blocks live together put at the same bytes
        for i in placed:
            doc["offsets"][i] = 0
    elif damage == "misaligned":
        doc["offsets"][placed[0]] += 8
    elif damage == "outside":
        doc["offsets"][placed[0]] = doc["peak_bytes"]
    elif damage == "short":
        doc["offsets"] = doc["offsets"][:-1]
    elif damage == "other sizes":
        doc["sizes"][0] *= 2
    elif damage == "a list":
        doc = [doc]
    return doc


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("strings", "offsets holds something other than whole numbers"),
        ("overlap", "are live together in the same bytes"),
        ("misaligned", "outside its arena or alignment"),
        ("outside", "outside its arena or alignment"),
        ("short", "offsets is not a list of 4 entries"),
        ("other sizes", "its requests are not those of the recorded pass"),
        ("a list", "not a memo-pass-plan/1 document"),
    ],
)
def test_a_damaged_cached_plan_is_refused_and_planned_again(core, tmp_path, damage, reason):
    path, plan, record = _cached_plan(core, tmp_path)
    with pytest.raises(ValueError, match=reason):
        KindPlan.from_json(_damaged(plan.to_json(), damage), record)


def test_a_run_meeting_a_damaged_plan_file_plans_again_and_serves(core, tmp_path, caplog):
    path, plan, _ = _cached_plan(core, tmp_path)
    path.write_text(json.dumps(_damaged(plan.to_json(), "overlap")))
    memory = PlannedMemory(core, shape_key="t", cache_dir=tmp_path, work_limit=5)
    with caplog.at_level(logging.WARNING):
        for iteration in range(1, RECORD_ITERATION + 2):
            run_step(core, memory, iteration)
    assert f"ignoring the damaged pass plan {path}" in caplog.text
    assert memory.kinds[0].plan == plan
    assert memory.step_metrics()["plan_hit_ratio"] == 1.0
    assert json.loads(path.read_text()) == plan.to_json()  # the damaged file is replaced


def test_an_unwritable_plan_cache_is_said_once_and_the_run_plans_without_it(core, tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        memory = PlannedMemory(core, shape_key="t", cache_dir=blocked / "plans", work_limit=5)
        for iteration in range(1, RECORD_ITERATION + 2):
            run_step(core, memory, iteration)
    assert memory.cache_dir is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"the pass plan cache {blocked / 'plans'} cannot be written")
    assert line.endswith("pass plans are made again in every run")
    assert memory.step_metrics()["plan_hit_ratio"] == 1.0


def test_an_evaluation_hands_its_fallback_blocks_back(core):
    """An evaluation at lengths of its own asks for sizes no step asks for; the exact-size
    cache would keep each length's blocks until the device ran out. After it, they go back."""
    memory = PlannedMemory(core, shape_key="t", cache_dir=None, work_limit=5)
    for iteration in range(1, RECORD_ITERATION + 2):
        run_step(core, memory, iteration)
    trained = core.stats()["fallback_cached_bytes"]
    assert trained > 0  # the step's blocks that outlive their passes, cached for the next
    for tokens in (3, 5, 7):  # three retrieval lengths, odd sizes (rounded up to 512 bytes)
        blocks = [core.alloc(tokens * 1000), core.alloc(tokens * 3000 + 1)]
        for ptr in blocks:
            core.free(ptr)
    assert core.stats()["fallback_cached_bytes"] > trained
    Memo.end_evaluation(types.SimpleNamespace(planned=memory))  # the extension's hook
    assert core.stats()["fallback_cached_bytes"] == 0
    run_step(core, memory, RECORD_ITERATION + 2)  # training goes on, served as before
    metrics = memory.step_metrics()
    assert metrics["plan_hit_ratio"] == 1.0 and metrics["plan_misses"] == 0


def test_the_trainer_ends_each_evaluation_at_the_extensions():
    from memo_ext.training.evaluation import evaluate

    ended = []
    extension = types.SimpleNamespace(end_evaluation=lambda: ended.append("ended"))
    session = types.SimpleNamespace(
        model=torch.nn.Linear(2, 2), valid_batches=None, retrieval=[], extensions=[extension]
    )
    evaluate(session)
    assert ended == ["ended"] and session.model.training


def test_a_plan_cache_keys_on_the_run_not_on_its_own_folder(tmp_path):
    """Plans copied or shared into another --memo-plan-cache folder are read there: the key
    holds the shapes and MEMO's settings, not the folder's path."""
    from memo_ext.arguments import parse_args
    from memo_ext.memo.planned_memory import shape_key

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
            "--train-iters", "1", "--memo", "--memo-keep-last-layers", "1", "--memo-allocator",
            "plan"]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    here, there = (
        shape_key(parse_args([*base, "--memo-plan-cache", str(tmp_path / d)], world_size=1))
        for d in ("a", "b")
    )
    assert here == there
    other = shape_key(parse_args([*base, "--memo-alpha", "0.5"], world_size=1))
    assert other != here
