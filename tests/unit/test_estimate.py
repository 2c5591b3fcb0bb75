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
from memo_ext.features.registry import memory_method, traced
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
    layer = traced(method)  # the registered method that builds it, with its settings
    fit = layer_fit(model, tp=2, sp=True, micro_batch_size=1, **layer)
    traced_at = trace_layer(model, tp=2, sp=True, tokens=7 * fit.t1, micro_batch_size=1, **layer)
    assert fit.at(7 * fit.t1) == traced_at
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
    kw = dict(tp=1, sp=False, micro_batch_size=1, fp32=True)
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
    found = f"longest sequence that fits: {record['seq_length']:,} tokens, at a predicted "
    assert f"{found}{record['step_time_s']:.2f} s per step" in done.stderr


def test_llama3_presets_are_meta_s_shapes_with_an_output_layer_of_their_own():
    from memo_ext.estimate.cost_model import params_per_gpu

    sizes = lambda m: (  # noqa: E731
        m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
        m.vocab_size,
    )  # fmt: skip
    assert sizes(MODELS["llama3-8b"]) == (32, 4096, 32, 8, 14336, 128256)
    assert sizes(MODELS["llama3-70b"]) == (80, 8192, 64, 8, 28672, 128256)
    for name in ("llama3-8b", "llama3-70b"):
        shape = MODELS[name]
        assert shape.swiglu and shape.normalization == "RMSNorm" and shape.rotary
        assert not shape.add_bias_linear and shape.untie_embeddings_and_output_weights
    # Meta's count for Llama 3 8B, 8,030,261,248, by hand: 32 layers of q / o (h²), k / v
    # (h × 8 groups × 128), the SwiGLU MLP (3 × h × 14336) and two norms, then the embedding
    # and the output layer (128256 × h each) and the final norm
    h = 4096
    layer = 2 * h * h + 2 * h * 8 * 128 + 3 * h * 14336 + 2 * h
    assert 32 * layer + 2 * 128256 * h + h == 8_030_261_248
    model = MODELS["llama3-8b"]
    figures = layer_fit(model, tp=1, sp=False, micro_batch_size=1).at(4096)
    one = ParallelLayout()
    params = params_per_gpu(model, one, figures, 4096)
    # the estimator counts a LayerNorm's bias in the final norm: h more than RMSNorm has
    assert params == 8_030_261_248 + h
    tied = replace(model, untie_embeddings_and_output_weights=False)
    assert params - params_per_gpu(tied, one, figures, 4096) == 128256 * h
    # under PP each stage holds one end either way
    pp2 = ParallelLayout(pp=2)
    assert params_per_gpu(model, pp2, figures, 4096) == params_per_gpu(tied, pp2, figures, 4096)


def test_the_docs_list_the_presets_help_offers():
    import re
    from pathlib import Path

    from memo_ext.commands.estimate import build_parser

    docs = (Path(__file__).resolve().parents[2] / "docs" / "estimate.md").read_text()
    start = docs.index("- Models (`--model`)")
    bullet = docs[start : docs.index("\n- ", start)]
    assert re.findall(r"`((?:gpt|llama)[\w-]*)`", bullet) == list(MODELS)
    text = " ".join(build_parser().format_help().split())
    assert f"model flags below: {', '.join(MODELS)} (default: gpt-7b)" in text


def test_memo_s_line_says_which_layers_stay_on_the_device_in_one_way():
    """--memo-keep-last-layers (layers MEMO leaves alone) and chunked MEMO's device skeletons
    (offloaded layers that keep their storages for want of host memory) read as one phrase:
    never "keep last 0" beside "the last 2 offloaded layers kept"."""
    from memo_ext.commands.estimate import format_estimate, memo_layers

    assert memo_layers(keep=0, skeletons=0) == "every layer offloaded"
    assert memo_layers(keep=2, skeletons=0) == "the last 2 layers not offloaded"
    held = "kept whole on the device for want of host memory"
    assert memo_layers(keep=0, skeletons=3) == f"the last 3 layers {held}"
    assert memo_layers(keep=1, skeletons=3) == (
        f"the last 1 layers not offloaded, the 3 before them {held}"
    )
    # 16 GiB of host memory holds a few of the 32 layers' whole storages at 128K tokens
    chunk = MemoConfig(enabled=True, chunk_tokens=4096)
    chunked = _est(seq=1 << 17, host=16 * GIB, settings=chunk)
    assert chunked.keep_last_layers == 0 and chunked.memo_device_skeletons > 0
    text = format_estimate(chunked)
    (method,) = [line for line in text.splitlines() if line.startswith("method")]
    assert f"the last {chunked.memo_device_skeletons} layers {held}" in method
    assert "keep last" not in text and "offloaded layers kept" not in text


def test_the_longest_length_is_quoted_with_its_step_time():
    from memo_ext.commands.estimate import headline

    est = _est(seq=1 << 14)
    assert headline(est) == (
        f"longest sequence that fits: 16,384 tokens, at a predicted {est.step_time_s:.2f} s per "
        f"step ({est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%)"
    )


def test_tracing_leaves_the_excepthook_as_it_was():
    """torch's init_process_group wraps sys.excepthook (a "[rank0]: " prefix per line) and
    never unwraps it: a process that traces many times (a benchmark, a search) got one prefix
    per trace on every line of a later traceback."""
    import sys

    from memo_ext.mcore.tracing import fake_parallel_state, fake_process_groups

    hook = sys.excepthook
    for _ in range(2):
        with fake_process_groups(tp=2, cp=1):
            pass
        with fake_parallel_state(2):
            pass
    assert sys.excepthook is hook
