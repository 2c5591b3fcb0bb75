"""The GPU side of the program's smaller device decisions, each on the emulated device: what
the trainer and the tools do on a GPU that the training runs of the other files do not reach."""

from __future__ import annotations

import logging

import pytest
import torch

from memo_ext.errors import UsageError


def test_a_cuda_step_is_traced_from_the_allocator_history(cuda):
    from memo_ext.planner.cuda_history import trace_cuda_step
    from memo_ext.planner.trace import Alloc, Free

    w = torch.randn(64, 64, device="cuda", requires_grad=True)

    def step():
        (w @ w).relu().sum().backward()

    trace = trace_cuda_step(step)
    allocs = [e for e in trace.events if isinstance(e, Alloc)]
    frees = {e.id for e in trace.events if isinstance(e, Free)}
    assert allocs and frees <= {a.id for a in allocs}
    assert any(a.size == 64 * 64 * 4 for a in allocs)  # the product, in float32


def test_a_gpu_outside_the_table_has_no_preset_and_no_peak(cuda, monkeypatch, caplog):
    from memo_ext.hardware import cuda_device, device_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert cuda_device() is None
    with caplog.at_level(logging.WARNING):
        assert device_peak_tflops() is None
    assert "pass --device-peak-tflops" in caplog.text
    assert device_peak_tflops(123.0) == 123.0


def test_the_cpu_redirection_refuses_a_gpu_machine(cuda):
    from memo_ext.mcore.compat import cpu_compat

    with pytest.raises(RuntimeError, match="for machines without CUDA"), cpu_compat():
        pass


def test_megatron_lms_fused_attention_is_transformer_engines_on_a_gpu(cuda, monkeypatch):
    from memo_ext.megatron_lm import handling

    monkeypatch.setattr(handling, "installed", lambda module: module == "transformer_engine")
    assert handling._attention_backend(["fused"], None) == ["--attention-backend", "te"]
    assert handling._attention_backend(["local"], None) == ["--attention-backend", "sdpa"]


def test_the_planned_allocator_refuses_expandable_segments_on_a_gpu(cuda, monkeypatch):
    from memo_ext.arguments import parse_args
    from tests.emulated.test_training import TINY

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(UsageError, match="expandable_segments cannot apply"):
        parse_args([*TINY, "--memo", "--memo-allocator", "plan", "--memo-keep-last-layers", "1"])


def test_emptying_the_cache_reaches_the_gpu(cuda, monkeypatch):
    from memo_ext import device

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    device.empty_cache()
    assert emptied == [True]


def test_megatron_lms_save_reads_the_real_cuda_rng_state_on_a_gpu(cuda):
    # the checkpoint benchmark stands in an empty CUDA RNG state for Megatron-LM's save on a CPU
    # only; on a GPU the save reads the device's own
    from memo_ext.benchmarks.checkpoint_save import _cuda_rng_state_on_cpu

    original = torch.cuda.get_rng_state
    with _cuda_rng_state_on_cpu():
        assert torch.cuda.get_rng_state is original  # on a CPU: the empty state's stand-in


def test_retrieval_prompt_rows_are_pinned_for_their_asynchronous_copy(cuda):
    # the step copies a row over with non_blocking=True: from pageable memory CUDA would copy
    # it synchronously, so the row must be page-locked
    import types

    import numpy as np

    from memo_ext.training.retrieval import _row

    sample = types.SimpleNamespace(
        batch=lambda: {"tokens": np.arange(7, dtype=np.int64)[None], "mask": np.ones((1, 7))}
    )
    row = _row(sample)
    assert all(tensor.device.type == "cpu" and tensor.is_pinned() for tensor in row.values())
    assert row["tokens"].tolist() == [list(range(7))]
