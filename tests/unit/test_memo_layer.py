"""MEMO on megatron-core layers in one process: outputs and gradients equal the plain layers'.

The reference is the same layer built from the unmodified spec with the same weights. Every
comparison is exact: MEMO rebuilds each saved tensor bit for bit (host copies, and a recompute
pass whose token slices go through the same kernels as the forward; none of this model's ops
reduce over tokens outside attention, which is never re-run).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

from memo_ext.config import MemoConfig
from memo_ext.errors import UsageError
from memo_ext.mcore.compat import cpu_compat, seed_cpu_rng_tracker
from memo_ext.mcore.specs import build_layer_spec
from memo_ext.memo.alpha import HostMemoryError
from memo_ext.memo.policy import apply_memo, memo_step_metrics
from memo_ext.shapes import ModelShape
from tests.models import cpu_config


@pytest.fixture(scope="module", autouse=True)
def megatron_one_process(tmp_path_factory):
    """A 1-process gloo world with megatron's parallel state, CUDA-isms redirected."""
    store = tmp_path_factory.mktemp("pg") / "store"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    with cpu_compat():
        parallel_state.initialize_model_parallel(1, 1)
        seed_cpu_rng_tracker(seed=1, tp_rank=0)
        yield
        parallel_state.destroy_model_parallel()
    if owns:
        dist.destroy_process_group()


def make_config(*, rms=True, swiglu=True, bias=False, groups=2, layers=1, attn_dropout=0.0):
    shape = ModelShape(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        ffn_hidden_size=48,
        normalization="RMSNorm" if rms else "LayerNorm",
        swiglu=swiglu,
        add_bias_linear=bias,
    )
    return cpu_config(shape, attention_dropout=attn_dropout)


def build_pair(config, *, alpha, keep_last=0, layers=1):
    """Plain and MEMO layer stacks with identical (randomised, non-trivial) weights."""
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    memo = MemoConfig(enabled=True, alpha=alpha, keep_last_layers=keep_last, host_memory_gb=1.0)
    memo_spec = apply_memo(spec, memo, config)
    ref = torch.nn.ModuleList(
        build_module(spec, config=config, layer_number=i + 1) for i in range(layers)
    )
    mem = torch.nn.ModuleList(
        build_module(memo_spec, config=config, layer_number=i + 1) for i in range(layers)
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():  # norm gains of 1 and zero biases would hide mistakes
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    mem.load_state_dict(ref.state_dict())
    return ref, mem


def run_stack(layers, x0, rope, *, seed=0):
    """Forward through the stack, backward of a weighted sum; (output, input grad, param grads)."""
    torch.manual_seed(seed)
    seed_cpu_rng_tracker(seed=seed, tp_rank=0)  # attention dropout draws from the tracker
    x = x0.clone().requires_grad_(True)
    h = x
    for layer in layers:
        h, _ = layer(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
    weights = torch.linspace(-1.0, 1.0, h.numel()).view_as(h)
    (h * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in layers.named_parameters()}
    return h.detach(), x.grad, grads


def assert_same(ref_result, memo_result):
    (o1, g1, p1), (o2, g2, p2) = ref_result, memo_result
    assert torch.equal(o1, o2)
    assert torch.equal(g1, g2)
    assert p1.keys() == p2.keys()
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name


SHAPES = {
    "rms-swiglu-gqa-rope": dict(rms=True, swiglu=True, bias=False, groups=2),
    "layernorm-gelu-bias": dict(rms=False, swiglu=False, bias=True, groups=4),
    "rms-gelu-bias-mqa": dict(rms=True, swiglu=False, bias=True, groups=1),
    "layernorm-swiglu-gqa": dict(rms=False, swiglu=True, bias=False, groups=2),
}


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_single_layer_parity(shape, alpha):
    config = make_config(**SHAPES[shape])
    ref, mem = build_pair(config, alpha=alpha)
    s = 12
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s) if "rope" in shape else None
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(3))
    assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
    metrics = memo_step_metrics(mem)
    host_tokens = int(alpha * s)
    assert metrics["memo_recomputed_tokens"] == (s - host_tokens) * 2
    assert metrics["memo_h2d_bytes"] == metrics["host_offload_bytes"] > 0


@pytest.mark.parametrize("alpha, s", [(0.45, 11), (0.7, 13), (0.15, 13)])
def test_uneven_alpha_parity(alpha, s):
    """α · s not an integer: floor(α · s) tokens go to the host, the rest are recomputed."""
    config = make_config()
    ref, mem = build_pair(config, alpha=alpha)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 3, 32, generator=torch.Generator().manual_seed(4))
    assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
    assert memo_step_metrics(mem)["memo_recomputed_tokens"] == (s - int(alpha * s)) * 3


def test_tiny_recompute_slice_is_close():
    """One dropped token of 3 sequences: the recompute's matrix products have 3 rows, for which
    the CPU BLAS takes another kernel than for the forward's 21 rows and sums in another order,
    so the last bits may differ (from 4 rows on, row slices reproduce the full product exactly)."""
    config = make_config()
    ref, mem = build_pair(config, alpha=0.99)
    s = 7
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 3, 32, generator=torch.Generator().manual_seed(4))
    (o1, g1, p1), (o2, g2, p2) = run_stack(ref, x0, rope), run_stack(mem, x0, rope)
    assert torch.equal(o1, o2)  # the forward itself is untouched
    # elementwise, cancellation can make a last-bit difference large relative to a small element;
    # compare whole tensors by relative norm
    for a, b in [(g1, g2), *((p1[n], p2[n]) for n in p1)]:
        assert (a - b).norm() <= 1e-6 * a.norm()


def test_stack_with_kept_layers_and_prefetch():
    """Four layers, the last kept on the device: the others prefetch one another in backward."""
    config = make_config(layers=4)
    ref, mem = build_pair(config, alpha=0.4, keep_last=1, layers=4)
    s = 10
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(5))
    assert [layer.memo_offloads for layer in mem] == [True, True, True, False]
    for _ in range(2):  # the second iteration reuses the host buffers
        assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
        metrics = memo_step_metrics(mem)
        assert metrics["memo_offloaded_layers"] == 3
        assert metrics["memo_recomputed_tokens"] == 3 * (s - 4) * 2
    assert metrics["memo_host_pool_bytes"] == metrics["host_offload_bytes"]


def test_attention_dropout_parity():
    """Attention is never re-run, so its dropout masks are the forward's own."""
    config = make_config(attn_dropout=0.3)
    ref, mem = build_pair(config, alpha=0.5)
    s = 8
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(6))
    assert_same(run_stack(ref, x0, rope, seed=11), run_stack(mem, x0, rope, seed=11))


def test_eval_and_no_grad_skip_memo():
    config = make_config()
    ref, mem = build_pair(config, alpha=0.5)
    x0 = torch.randn(6, 2, 32)
    with torch.no_grad():
        out_ref, _ = ref[0](hidden_states=x0, attention_mask=None)
        out_mem, _ = mem[0](hidden_states=x0, attention_mask=None)
    assert torch.equal(out_ref, out_mem)
    assert memo_step_metrics(mem)["memo_offloaded_layers"] == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_dropout=0.1), "hidden-dropout"),
        (dict(recompute_granularity="selective"), "recompute-granularity"),
    ],
)
def test_refuses_what_it_cannot_honour(change, message):
    config = make_config()
    for key, value in change.items():
        setattr(config, key, value)
    spec = build_layer_spec(config=make_config(), attention_backend="sdpa")
    with pytest.raises(UsageError, match=message):
        apply_memo(spec, MemoConfig(enabled=True, alpha=0.5), config)


def _build_with(memo: MemoConfig, config=None):
    config = config or make_config()
    spec = apply_memo(build_layer_spec(config=config, attention_backend="sdpa"), memo, config)
    return torch.nn.ModuleList([build_module(spec, config=config, layer_number=1)])


@pytest.mark.parametrize(
    "alpha, message",
    [
        (0.0, r"needs at least 6.38 KiB .* even at α = 0"),
        (1.0, r"at α = 1 needs .* lower --memo-alpha"),
    ],
)
def test_host_budget_refused_before_any_copy(alpha, message):
    # one layer at α = 0 holds 6.5 KB on the host (see test_memo_accounting's hand count)
    budget_gb = 1e-6 if alpha == 0.0 else 8e-6
    mem = _build_with(
        MemoConfig(enabled=True, alpha=alpha, keep_last_layers=0, host_memory_gb=budget_gb)
    )
    x = torch.randn(12, 2, 32, requires_grad=True)
    with pytest.raises(HostMemoryError, match=message):
        mem[0](hidden_states=x, attention_mask=None)
    assert mem[0].memo_runtime.pool.allocated_bytes == 0


def test_auto_alpha_is_solved_once_and_exact():
    config = make_config()
    ref, _ = build_pair(config, alpha=0.0)
    mem = _build_with(MemoConfig(enabled=True, alpha=None, keep_last_layers=0), config)
    mem.load_state_dict(ref.state_dict())
    s = 12
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(8))
    assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
    runtime = mem[0].memo_runtime
    assert 0.0 <= runtime.alpha <= 1.0
    assert runtime.cost.forward_s > 0 and runtime.cost.copy_gbps > 0
    assert memo_step_metrics(mem)["memo_alpha"] == runtime.alpha


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_v_is_rebuilt_alone_not_with_its_fused_buffer(alpha, monkeypatch):
    """With RoPE, q and k are new tensors and V stays a view of the fused QKV output, alone on
    it: its backward gets V rebuilt by itself (V's bytes), not the whole fused buffer (three
    times V's bytes under MHA), with the same gradients."""
    from memo_ext.memo.activations import LayerActivations

    def whole_fused_buffer(self, st, key):
        raise AssertionError("V was rebuilt with its whole fused QKV buffer")

    monkeypatch.setattr(LayerActivations, "_input_storage", whole_fused_buffer)
    config = make_config(**SHAPES["rms-swiglu-gqa-rope"])
    ref, mem = build_pair(config, alpha=alpha)
    s = 12
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(s)
    x0 = torch.randn(s, 2, 32, generator=torch.Generator().manual_seed(3))
    assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))
