"""The planner on a real CUDA step: PyTorch's allocator history as a trace. Skipped without
CUDA."""

import pytest
import torch

from memo_ext.planner import PlannerConfig, plan_trace
from memo_ext.planner.cuda_history import trace_cuda_step
from memo_ext.planner.problem import lower_bound, problem_from_trace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_real_cuda_step_is_traced_and_its_peak_matches_the_allocator():
    layer = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)

    def step():
        layer(x).float().pow(2).mean().backward()

    step()  # warm up: gradients and cuBLAS workspaces exist before the traced step
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trace = trace_cuda_step(step)
    peak = torch.cuda.max_memory_allocated() - before
    # The history logs what was asked for; the caching allocator counts its blocks, each
    # request rounded up to 512 bytes (the reused blocks of a warmed-up step are split to size).
    _, problem = problem_from_trace(trace, alignment=512)
    assert len(trace.allocs) > 5
    # The largest total live in the trace is what the allocator saw at its peak (unless blocks
    # from before the step were freed during it, which the history cannot size).
    if trace.meta["frees_before_history"] == 0:
        assert lower_bound(problem) == peak
    else:
        assert lower_bound(problem) >= peak
    plan = plan_trace(trace, config=PlannerConfig(work_limit=10, alignment=512))
    assert plan.peak_bytes == lower_bound(problem)
