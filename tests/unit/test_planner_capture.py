"""Traces of megatron-core layers under fake tensors, and their plans."""

import contextlib

import pytest
import torch

from memo_ext.mcore.specs import build_layer_spec
from memo_ext.mcore.transformer_config import traced_transformer_config
from memo_ext.memo.policy import memo_trace_options
from memo_ext.parallel import ParallelLayout
from memo_ext.planner import PlannerConfig, plan_bilevel, plan_flat, validate
from memo_ext.planner.capture import trace_transformer_layer
from memo_ext.planner.planning import find_layer_passes
from memo_ext.planner.problem import lower_bound, problem_from_trace
from memo_ext.planner.trace import Alloc, Free
from memo_ext.shapes import model_shape

SMALL = model_shape(
    "gpt-7b", num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256
)


def small_config(*, cp: int = 1):
    return traced_transformer_config(SMALL, layout=ParallelLayout(tp=2, sp=True, cp=cp))


@pytest.fixture(scope="module")
def tp2_config():
    return small_config()


def test_layer_trace_shapes_follow_tp_and_sp(tp2_config):
    trace = trace_transformer_layer(config=tp2_config, seq_length=256, micro_batch_size=2)
    sizes = {event.size for event in trace.allocs}
    # bf16 [s, b, 3h/tp] qkv output and the SP all-gathered [s, b, h] input.
    assert 256 * 2 * 3 * 64 // 2 * 2 in sizes
    assert 256 * 2 * 64 * 2 in sizes
    freed = {event.id for event in trace.events if isinstance(event, Free)}
    kept = [event for event in trace.allocs if event.id not in freed]
    # Weight gradients are released after accumulation; what stays is megatron's global
    # sequence-parallel gather buffer and the gradient of the layer input.
    assert len(kept) <= 2
    assert {event.phase for event in trace.allocs} == {"fwd", "bwd"}


def test_layer_plan_reaches_its_lower_bound(tp2_config):
    trace = trace_transformer_layer(config=tp2_config, seq_length=256, micro_batch_size=2)
    plan = plan_flat(trace, config=PlannerConfig(work_limit=20, alignment=512))
    validate(trace, plan)
    assert plan.peak_bytes == plan.lower_bound_bytes and plan.status == "optimal"


def test_bilevel_plan_of_an_iteration_validates(tp2_config):
    trace = trace_transformer_layer(
        config=tp2_config, seq_length=256, micro_batch_size=1, num_layers=4, vocab_size=1000
    )
    phases = {event.phase for event in trace.allocs}
    assert {"embedding", "fwd", "loss", "bwd"} <= phases
    ids, problem = problem_from_trace(trace, alignment=512)
    passes = find_layer_passes(trace, problem.start, problem.end)
    assert len(passes) == 8
    # Identical middle layers share one level-1 solution.
    assert len({p.signature for p in passes}) < len(passes)
    plan = plan_bilevel(trace, config=PlannerConfig(work_limit=20, alignment=512))
    validate(trace, plan)
    assert plan.extra["mode"] == "bilevel" and plan.peak_bytes >= lower_bound(problem)
    assert set(plan.offsets) == set(ids)


def test_a_saved_tensor_policy_shows_in_the_trace(tp2_config):
    def copying_policy():
        # Stand-in for an offloading policy: every saved tensor is copied when packed.
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)

    plain = trace_transformer_layer(config=tp2_config, seq_length=128, micro_batch_size=1)
    hooked = trace_transformer_layer(
        config=tp2_config, seq_length=128, micro_batch_size=1, context=copying_policy
    )
    assert len(hooked.allocs) > len(plain.allocs)
    assert isinstance(hooked.events[0], Alloc)
    assert contextlib  # the context argument takes any context-manager factory


def test_memo_policy_traces_hold_less_than_plain_layers(tp2_config):
    kwargs = dict(config=tp2_config, seq_length=256, micro_batch_size=1, num_layers=4)
    plain = trace_transformer_layer(**kwargs, vocab_size=1000)
    _, plain_problem = problem_from_trace(plain)
    for alpha in (0.0, 1.0):
        spec = build_layer_spec(config=tp2_config, attention_backend="sdpa")
        options = memo_trace_options(tp2_config, spec, alpha=alpha)
        memo = trace_transformer_layer(**kwargs, vocab_size=1000, **options)
        assert memo.meta["memo_alpha"] == alpha
        # Fetches and recomputation show as allocations of their own ...
        assert len(memo.allocs) > len(plain.allocs)
        # ... and four layers' activations are no longer held at once.
        _, problem = problem_from_trace(memo)
        assert lower_bound(problem) < lower_bound(plain_problem)
        plan = plan_bilevel(memo, config=PlannerConfig(work_limit=20, alignment=512))
        validate(memo, plan)


def test_forgotten_storages_leave_no_events():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.planner.capture import AllocationRecorder

    with FakeTensorMode(), AllocationRecorder() as recorder:
        device = torch.ones(4)
        host = torch.ones(8)
        del device
        recorder.forget({host.untyped_storage()._cdata})
    assert [type(event) for event in recorder.events] == [Alloc, Free]
    assert recorder.events[0].size == 16


def test_context_parallel_traces_the_ranks_share_of_the_tokens():
    def trace(cp, seq_length):
        return trace_transformer_layer(
            config=small_config(cp=cp), seq_length=seq_length, micro_batch_size=1, vocab_size=1000
        )

    sharded, local = trace(2, 512), trace(1, 256)
    assert sharded.meta["context_parallel_size"] == 2
    assert [event.size for event in sharded.allocs] == [event.size for event in local.allocs]
