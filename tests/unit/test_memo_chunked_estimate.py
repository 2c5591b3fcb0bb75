"""Sub-sequence chunking in the estimator, the memory report and the run's resolution."""

from __future__ import annotations

import argparse

import pytest

from memo_ext.config import MemoConfig, parse_chunk_tokens
from memo_ext.estimate.cost_model import (
    Batch,
    Efficiency,
    estimate,
    matmul_shape_factor,
)
from memo_ext.estimate.measure import (
    chunked_layer_max_live_bytes,
    chunked_live_fit,
    layer_fit,
    trace_layer,
)
from memo_ext.features.memo.stage import auto_chunk_tokens
from memo_ext.features.registry import memory_method, traced
from memo_ext.hardware import DEVICES
from memo_ext.memo.alpha import HostMemoryError, LayerCost, skeleton_layers
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import MODELS
from tests.unit.test_estimate import BIG_HOST, SMALL_LLAMA

GPT_7B = MODELS["gpt-7b"]
TP8 = ParallelLayout(tp=8, sp=True, dp=1)


def test_chunk_tokens_flag_and_kept_layers_default():
    assert parse_chunk_tokens("auto") == "auto"
    assert parse_chunk_tokens("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_chunk_tokens("4k")
    assert MemoConfig(enabled=True).kept_layers == 2
    assert MemoConfig(enabled=True, chunk_tokens=512).kept_layers == 0
    assert MemoConfig(enabled=True, chunk_tokens=512, keep_last_layers=1).kept_layers == 1


@pytest.mark.slow
def test_chunked_figures_scale_exactly():
    """Traced at two lengths of whole chunks, a third length is predicted exactly."""
    layer = traced("memo-0.5@64")
    fit = layer_fit(SMALL_LLAMA, tp=2, sp=True, micro_batch_size=1, **layer)
    assert fit.t1 == 2 * 2048  # four chunks of 64 are fewer than the reference's 2048 tokens
    tokens = 3 * fit.t1
    direct = trace_layer(SMALL_LLAMA, tp=2, sp=True, tokens=tokens, micro_batch_size=1, **layer)
    assert fit.at(tokens) == direct
    live = chunked_live_fit(
        SMALL_LLAMA, tp=2, sp=True, micro_batch_size=1, alpha=1.0, chunk_tokens=64
    )
    direct = chunked_layer_max_live_bytes(
        SMALL_LLAMA, tp=2, sp=True, tokens=tokens, micro_batch_size=1, alpha=1.0, chunk_tokens=64
    )
    assert live.at(tokens) == direct


@pytest.mark.slow
def test_chunking_holds_less_than_whole_layers():
    """Per layer: copies in flight and the live set of one layer's passes are smaller, the host
    bytes about the same (whole storages, plus the chunks' copies of gathered rows under SP)."""
    whole = trace_layer(
        SMALL_LLAMA, tp=2, sp=True, tokens=8192, micro_batch_size=1, **traced("memo-1")
    )
    chunked = trace_layer(
        SMALL_LLAMA, tp=2, sp=True, tokens=8192, micro_batch_size=1, **traced("memo-1@256")
    )
    assert chunked.slot_bytes < whole.slot_bytes / 2
    assert whole.host_bytes <= chunked.host_bytes <= 1.25 * whole.host_bytes
    assert chunked.forward_matmul_flops == whole.forward_matmul_flops


def test_auto_chunk_is_the_smallest_within_the_slowdown():
    h100 = DEVICES["h100-80g"]
    chunk = auto_chunk_tokens(GPT_7B, TP8, Batch(), seq_length=1 << 20, device=h100)
    local = (1 << 20) // 8
    assert 256 <= chunk < local and chunk & (chunk - 1) == 0
    speed = lambda c: matmul_shape_factor(  # noqa: E731
        GPT_7B, TP8, Batch(), tokens=1 << 20, device=h100, eff=Efficiency(), chunk_tokens=c
    )
    assert speed(chunk) >= 0.97 * speed(None)
    assert speed(chunk // 2) < speed(chunk)
    # a short sequence has no chunk worth cutting: the whole local sequence
    assert auto_chunk_tokens(GPT_7B, TP8, Batch(), seq_length=4096, device=h100) == 512


@pytest.mark.slow
def test_estimator_chunked_peak_below_whole_layer_memo():
    """7B on 8 × A800 at 1M tokens (the paper's setting): chunked MEMO without kept layers
    peaks at least 30% below whole-layer MEMO as ``--memo`` runs it."""
    common = dict(
        model=GPT_7B,
        device=DEVICES["a800-80g"],
        layout=TP8,
        method=memory_method("memo"),
        seq_length=1 << 20,
        host_memory_bytes=BIG_HOST,
    )
    whole = estimate(**common, settings=MemoConfig(enabled=True, alpha=1.0))
    chunked = estimate(**common, settings=MemoConfig(enabled=True, alpha=1.0, chunk_tokens=4096))
    assert chunked.keep_last_layers == 0 and chunked.memo_chunk_tokens == 4096
    assert chunked.device_peak_bytes <= 0.7 * whole.device_peak_bytes
    assert chunked.mfu >= 0.98 * whole.mfu


def test_skeleton_layers_rule():
    cost = LayerCost(full_bytes=10, tokenwise_bytes=100)
    assert skeleton_layers(cost, budget_bytes=80, offloaded_layers=8) == 0
    assert skeleton_layers(cost, budget_bytes=79, offloaded_layers=8) == 1
    assert skeleton_layers(cost, budget_bytes=50, offloaded_layers=8) == 3
    assert skeleton_layers(cost, budget_bytes=50, offloaded_layers=4, in_flight=2) == 2
    with pytest.raises(HostMemoryError, match="not one layer's whole storages"):
        skeleton_layers(cost, budget_bytes=5, offloaded_layers=8)
