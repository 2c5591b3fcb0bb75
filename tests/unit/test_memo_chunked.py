"""Sub-sequence chunking (``--memo-chunk-tokens``) in one process: the chunked layer computes
megatron's layer, alone and under MEMO at every α.

Chunked and whole runs differ by rounding only: a weight's gradient sums over tokens chunk by
chunk, and the CPU BLAS takes another kernel for a row block that does not start on a multiple
of its block size. The layers run in float64 here, where that rounding is ~1e-16, so a relative
difference above 1e-12 is a mistake, not rounding (the float32 training runs are compared in
``tests/dist/test_memo_parity.py``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

from memo_ext.config import MemoConfig
from memo_ext.errors import UsageError
from memo_ext.mcore.chunked import ChunkedLayer, ChunkingError, chunk_bounds
from memo_ext.mcore.specs import build_layer_spec
from memo_ext.memo.alpha import HostMemoryError
from memo_ext.memo.policy import apply_memo, memo_runtime_of, memo_step_metrics
from tests.unit.test_memo_layer import (  # noqa: F401  (the fixture is used by name)
    SHAPES,
    make_config,
    megatron_one_process,
    run_stack,
)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> bool:
    return bool((a - b).norm() <= tol * b.norm())


def assert_close(ref, got):
    (o1, g1, p1), (o2, g2, p2) = ref, got
    assert close(o2, o1)
    assert close(g2, g1)
    assert p1.keys() == p2.keys()
    for name in p1:
        assert close(p2[name], p1[name]), name


def build(config, *, layers=1, memo: MemoConfig | None = None):
    """The plain stack, and the same weights under ``memo`` (or plain again)."""
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    ref = torch.nn.ModuleList(
        build_module(spec, config=config, layer_number=i + 1) for i in range(layers)
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    ref.double()
    if memo is None:
        return ref
    memo_spec = apply_memo(spec, memo, config)
    mem = torch.nn.ModuleList(
        build_module(memo_spec, config=config, layer_number=i + 1) for i in range(layers)
    )
    mem.double().load_state_dict(ref.state_dict())
    return ref, mem


def chunked_memo(alpha, chunk, keep_last=0):
    return MemoConfig(
        enabled=True,
        alpha=alpha,
        keep_last_layers=keep_last,
        host_memory_gb=1.0,
        chunk_tokens=chunk,
    )


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 8) == [(0, 3)]
    with pytest.raises(ValueError):
        chunk_bounds(3, 0)


@pytest.mark.parametrize("chunk", [4, 5, 13])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunked_layer_equals_megatron_layer(shape, chunk):
    config = make_config(**SHAPES[shape])
    layers = build(config)
    s = 13
    rope = (
        RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s).double() if "rope" in shape else None
    )
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(3)).double()
    ref = run_stack(layers, x0, rope)

    class Chunked(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, **kwargs):
            return ChunkedLayer(self.layer, kwargs, chunk).forward(kwargs["hidden_states"])

    for p in layers.parameters():
        p.grad = None
    got = run_stack(torch.nn.ModuleList([Chunked(layers[0])]), x0, rope)
    (o1, g1, p1), (o2, g2, p2) = ref, got
    assert close(o2, o1) and close(g2, g1)
    for name in p1:
        assert close(p2["0.layer." + name[2:]], p1[name]), name


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_memo_equals_plain(alpha, chunk):
    config = make_config(layers=3)
    ref, mem = build(config, layers=3, memo=chunked_memo(alpha, chunk, keep_last=1))
    s = 13
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s).double()
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(4)).double()
    for _ in range(2):  # the second iteration reuses the host buffers
        assert_close(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
        metrics = memo_step_metrics(mem)
        host_chunks = [stop <= int(alpha * s) for _, stop in chunk_bounds(s, chunk)]
        recomputed = sum(
            (stop - start) for (start, stop), h in zip(chunk_bounds(s, chunk), host_chunks) if not h
        )
        assert metrics["memo_offloaded_layers"] == 2
        assert metrics["memo_recomputed_tokens"] == 2 * recomputed * 2
        assert metrics["memo_h2d_bytes"] == metrics["host_offload_bytes"] > 0


def test_chunked_memo_holds_a_few_chunks_in_flight():
    """The copy sources in flight are bounded by chunks, not by whole layers."""
    config = make_config(layers=2)
    s, chunk = 32, 4
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s).double()
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(4)).double()
    whole = build(config, layers=2, memo=chunked_memo(1.0, None))[1]
    chunked = build(config, layers=2, memo=chunked_memo(1.0, chunk))[1]
    run_stack(whole, x0, rope)
    run_stack(chunked, x0, rope)
    assert memo_runtime_of(chunked).slot_bytes < memo_runtime_of(whole).slot_bytes


def test_chunking_refuses_packed_sequences():
    config = make_config()
    _, mem = build(config, memo=chunked_memo(1.0, 4))
    x = torch.randn(8, 1, 32, requires_grad=True)
    with pytest.raises(ChunkingError, match="packed"):
        mem[0](hidden_states=x, attention_mask=None, packed_seq_params=object())


def test_chunk_tokens_must_be_positive():
    with pytest.raises(UsageError, match="--memo-chunk-tokens"):
        chunked_memo(1.0, 0).check()
    with pytest.raises(UsageError, match="only applies with --memo"):
        MemoConfig(chunk_tokens=8).check()


def test_offloaded_layer_input_leaves_the_device():
    """Once a chunked layer's forward is done its input is on the host only: neither the
    autograd graph nor MEMO's bookkeeping keeps the device tensor alive."""
    config = make_config(layers=2)
    _, mem = build(config, layers=2, memo=chunked_memo(0.5, 4, keep_last=0))
    x = torch.randn(13, 2, 32, dtype=torch.float64, requires_grad=True)
    h0, _ = mem[0](hidden_states=x, attention_mask=None, rotary_pos_emb=None)
    storage = weakref.ref(h0.untyped_storage())
    h1, _ = mem[1](hidden_states=h0, attention_mask=None, rotary_pos_emb=None)
    del h0
    gc.collect()
    assert storage() is None
    h1.sum().backward()  # and the backward still has everything it needs
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_short_host_budget_keeps_the_last_skeletons_on_the_device():
    """When the host cannot hold every layer's whole storages, the last offloaded layers keep
    theirs on the device (fewest needed) and training is unchanged."""
    config = make_config(layers=4)
    s = 13
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s).double()
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(4)).double()
    roomy = build(config, layers=4, memo=chunked_memo(0.0, 5))[1]
    run_stack(roomy, x0, rope)
    full = memo_runtime_of(roomy).cost.full_bytes
    budget = int(2.5 * full)  # two and a half layers' whole storages of four
    memo = MemoConfig(enabled=True, alpha=0.0, host_memory_gb=budget / 2**30, chunk_tokens=5)
    ref, mem = build(config, layers=4, memo=memo)
    for _ in range(2):
        assert_close(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
        metrics = memo_step_metrics(mem)
        assert metrics["memo_device_skeletons"] == 2
        assert 0 < metrics["memo_host_pool_bytes"] <= budget
    # less than one layer's whole storages: refused as the first copy is asked for
    tiny = MemoConfig(enabled=True, alpha=0.0, host_memory_gb=full / 2 / 2**30, chunk_tokens=5)
    _, mem = build(config, layers=4, memo=tiny)
    with pytest.raises(HostMemoryError, match="raise --memo-host-memory-gb"):
        run_stack(mem, x0, rope)


def test_refuses_layers_it_cannot_chunk():
    from types import SimpleNamespace

    from megatron.core.transformer.identity_op import IdentityOp

    from memo_ext.mcore.chunked import check_chunkable

    config = make_config()
    layer = build(config)[0]
    check_chunkable(layer)  # megatron's GPT layer: fine
    odd = SimpleNamespace(
        config=SimpleNamespace(attention_output_gate=True),
        self_attention=layer.self_attention,
        mlp=torch.nn.Identity(),
        cross_attention=IdentityOp(),
    )
    with pytest.raises(ChunkingError, match="mixture of experts.*--attention-output-gate"):
        check_chunkable(odd)


def test_chunked_memo_in_bfloat16():
    """Two-byte elements through the byte-level host copies and views: chunked MEMO at α 0.5
    gives what the same chunked layers give without MEMO (both bf16, so compared exactly:
    recomputed chunks run the same kernels on the same shapes)."""
    config = make_config(layers=2)
    _, plain = build(config, layers=2, memo=chunked_memo(None, 4, keep_last=2))
    _, memo = build(config, layers=2, memo=chunked_memo(0.5, 4, keep_last=0))
    memo.load_state_dict(plain.state_dict())
    plain.bfloat16(), memo.bfloat16()
    s = 13
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    (o1, g1, p1), (o2, g2, p2) = run_stack(plain, x0, rope), run_stack(memo, x0, rope)
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name
    assert memo_step_metrics(memo)["memo_recomputed_tokens"] > 0
