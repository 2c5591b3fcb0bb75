"""Estimator: presets, exact scaling, real-vs-fake bytes, α rule, search, CLI and preflight."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
import torch

from memo_ext.config import MemoConfig
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.estimate.cost_model import estimate
from memo_ext.estimate.measure import layer_fit, trace_layer
from memo_ext.estimate.search import find_max_seq_length
from memo_ext.features.registry import memory_method
from memo_ext.hardware import DEVICES, GIB
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import MODELS, ModelShape, model_shape
from tests.launch import cli, run_tool
from tests.models import GPT_SMALL

SMALL = GPT_SMALL
SMALL_LLAMA = replace(
    SMALL,
    name="small-llama",
    num_query_groups=2,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
)
BIG_HOST = 1 << 50


def test_presets_match_the_paper():
    assert (MODELS["gpt-7b"].num_layers, MODELS["gpt-7b"].hidden_size) == (32, 4096)
    assert (MODELS["gpt-65b"].num_layers, MODELS["gpt-65b"].num_attention_heads) == (80, 64)
    for name in ("gpt-7b", "gpt-13b", "gpt-30b", "gpt-65b"):
        assert MODELS[name].ffn_hidden_size == 4 * MODELS[name].hidden_size
        assert MODELS[name].vocab_size == 50257
    assert MODELS["llama-70b"].num_query_groups == 8 and MODELS["llama-70b"].swiglu
    assert DEVICES["a800-80g"].peak_tflops == 312.0 and DEVICES["a800-80g"].memory_bytes == 80 * GIB
    assert model_shape("gpt-7b", num_layers=4).num_layers == 4
    with pytest.raises(ValueError, match="--model"):
        model_shape("gpt-8b")


@pytest.mark.parametrize("model", [SMALL, SMALL_LLAMA])
@pytest.mark.parametrize("method", ["none", "full", "selective", "memo-0", "memo-1"])
def test_layer_figures_scale_exactly(model, method):
    # bytes and matmul FLOPs affine in the tokens, attention FLOPs quadratic: a third traced
    # length must equal the fit of two others exactly
    fit = layer_fit(model, tp=2, sp=True, micro_batch_size=1, method=method)
    traced = trace_layer(model, tp=2, sp=True, tokens=7 * fit.t1, micro_batch_size=1, method=method)
    assert fit.at(7 * fit.t1) == traced
    # linear through zero up to a few bytes of scalars (selective recompute saves one)
    assert abs(fit.low.saved_bytes * 2 - fit.high.saved_bytes) <= 64
    assert fit.low.input_bytes * 2 == fit.high.input_bytes


def _real_saved_bytes(model: ModelShape, tokens: int) -> int:
    """Unique storages autograd saves in a real fp32 forward of one layer on the CPU."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from memo_ext.mcore.specs import build_layer_spec
    from memo_ext.mcore.tracing import fake_process_groups, frozen_rng, tracing_environment
    from memo_ext.mcore.transformer_config import traced_transformer_config

    config = traced_transformer_config(model, fp32=True, num_layers=1)
    with fake_process_groups(tp=1, cp=1) as groups, tracing_environment(), frozen_rng():
        spec = build_layer_spec(config=config, attention_backend="sdpa")
        layer = TransformerLayer(config, spec.submodules, pg_collection=groups)
        x = torch.randn(tokens, 1, model.hidden_size, requires_grad=True)
        rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(tokens)
        excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        excluded.add(rope.untyped_storage().data_ptr())
        saved = {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in excluded:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, attention_mask=None, rotary_pos_emb=rope)
    return sum(saved.values())


@pytest.mark.parametrize("model", [SMALL, SMALL_LLAMA])
def test_estimated_bytes_equal_a_real_run(model):
    tokens = 96
    real = _real_saved_bytes(model, tokens)
    kw = dict(tp=1, sp=False, micro_batch_size=1, method="none", fp32=True)
    low, high = (trace_layer(model, tokens=t, **kw) for t in (32, 64))
    # the estimator's scaling rule (affine in tokens) applied from 32 and 64 tokens to 96
    estimated = high.saved_bytes + (high.saved_bytes - low.saved_bytes) * (tokens - 64) // 32
    # same layer, same kernels on fake and real tensors; 2% covers allocator-independent
    # rounding of tiny scalars (the bound the estimator promises)
    assert abs(estimated - real) <= 0.02 * real


def _est(method="memo", seq=1 << 20, host=2048 * GIB, **kw):
    return estimate(
        model=MODELS["gpt-7b"],
        device=DEVICES["a800-80g"],
        layout=ParallelLayout(tp=8, sp=True),
        method=memory_method(method),
        seq_length=seq,
        host_memory_bytes=host,
        **kw,
    )


def test_alpha_rule_edges():
    starved = _est(host=0)
    assert starved.alpha == 0.0 and not starved.fits_host and "host memory" in starved.notes[0]
    fast = replace(DEVICES["a800-80g"], host_link_gbps=1e6)
    ample = estimate(
        model=MODELS["gpt-7b"],
        device=fast,
        layout=ParallelLayout(tp=8, sp=True),
        method=memory_method("memo"),
        seq_length=1 << 16,
        host_memory_bytes=BIG_HOST,
    )
    assert ample.alpha == 1.0
    slow = replace(DEVICES["a800-80g"], host_link_gbps=1e-3)
    hidden = estimate(
        model=MODELS["gpt-7b"],
        device=slow,
        layout=ParallelLayout(tp=8, sp=True),
        method=memory_method("memo"),
        seq_length=1 << 16,
        host_memory_bytes=BIG_HOST,
    )
    assert hidden.alpha == 0.0
    mid = _est()
    assert 0.0 < mid.alpha < 1.0 and mid.host_bytes <= mid.host_budget_bytes


def test_methods_order_memory_as_expected():
    half = MemoConfig(enabled=True, alpha=0.5)
    none, full, memo = (_est(m, seq=1 << 17, settings=half) for m in ("none", "full", "memo"))
    assert full.activation_bytes < none.activation_bytes
    assert memo.activation_bytes < none.activation_bytes
    assert full.recompute_flops > memo.recompute_flops > 0 and none.recompute_flops == 0
    memo_fixed = _est(seq=1 << 17, settings=MemoConfig(enabled=True, alpha=1.0, keep_last_layers=2))
    assert memo_fixed.recompute_flops == 0


def test_search_is_monotone_in_gpus_and_memory():
    full = memory_method("full")
    kw = dict(model=SMALL, method=full, host_memory_bytes=BIG_HOST, granularity=256)
    small = replace(DEVICES["a800-80g"], memory_bytes=GIB // 4)
    a = find_max_seq_length(device=small, gpus=1, **kw)
    b = find_max_seq_length(device=small, gpus=2, **kw)
    c = find_max_seq_length(device=replace(small, memory_bytes=GIB // 2), gpus=1, **kw)
    assert a is not None and a.fits
    assert b.seq_length >= a.seq_length and c.seq_length >= a.seq_length
    over = estimate(
        model=SMALL,
        device=small,
        layout=ParallelLayout(**{k: a.layout[k] for k in ("tp", "cp", "pp", "dp", "sp")}),
        method=full,
        seq_length=a.seq_length + 2 * 256 * a.layout["cp"],
        host_memory_bytes=BIG_HOST,
    )
    assert not over.fits


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_tool("tools.estimate", *args)


@pytest.mark.slow
def test_cli_json_contract_and_bad_input():
    done = _cli(
        *cli(
            model="gpt-7b",
            gpus=8,
            gpu="a800-80g",
            host_memory_gb=2048,
            method="memo",
            seq_length=262144,
            tensor_model_parallel_size=8,
            sequence_parallel=True,
            json=True,
        ),
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    for key in (
        "method",
        "seq_length",
        "device_peak_bytes",
        "host_bytes",
        "alpha",
        "step_time_s",
        "mfu",
        "tp",
        "cp",
        "pp",
        "dp",
        "sp",
    ):
        assert key in record
    assert record["method"] == "memo" and record["tp"] == 8 and record["fits"]
    bad = _cli(*cli(model="gpt-7b", seq_length=1000, tensor_model_parallel_size=3))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert _cli("--gpu", "v100").returncode == 2


def _run_config(seq_length: int, *, memo: bool):
    from memo_ext.arguments import parse_args
    from memo_ext.training.resolve import resolve_run

    argv = cli(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=str(seq_length),
        max_position_embeddings=str(seq_length),
        position_embedding_type="rope",
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=1,
        lr="1e-4",
        mock_data=True,
        tensor_model_parallel_size=8,
        sequence_parallel=True,
    )
    if memo:
        argv += ["--memo", "--memo-host-memory-gb", "200"]
    run = parse_args(argv, world_size=8)
    return resolve_run(run, tokenizer=tokenizer_for(run.data))


def test_preflight_refuses_too_big_and_passes_small():
    from memo_ext.features.preflight import PreflightError, check_preflight, preflight

    device = DEVICES["a800-80g"]
    small = preflight(_run_config(8192, memo=False), device=device)
    assert small.checked and small.fits
    big = preflight(_run_config(1 << 20, memo=False), device=device)
    assert big.checked and not big.fits and "GiB" in big.message
    with pytest.raises(PreflightError, match="does not fit"):
        check_preflight(_run_config(1 << 21, memo=True), device=device)
    assert not preflight(_run_config(8192, memo=False)).checked  # no GPU, no device given


def test_the_host_line_is_for_a_method_that_keeps_activations_there():
    from memo_ext.commands.estimate import format_estimate

    memo = _est("memo", seq=1 << 14)
    full = _est("full", seq=1 << 14)
    assert "host memory" in format_estimate(memo) and memo.host_bytes > 0
    assert "host memory" not in format_estimate(full) and full.host_bytes == 0


@pytest.mark.slow
def test_the_search_for_the_longest_length_shows_its_progress_on_stderr_only():
    done = _cli(*cli(model="gpt-7b", gpus=8, method="memo", tensor_model_parallel_size=8,
                     sequence_parallel=True, json=True))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "layouts searched: 100%" in done.stderr.replace("\r", "\n")
    record = json.loads(done.stdout)  # stdout is the JSON alone
    assert record["seq_length"] > 0
