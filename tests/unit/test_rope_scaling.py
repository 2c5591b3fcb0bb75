"""RoPE for context extension (``--use-rope-scaling``, ``--rotary-seq-len-interpolation-factor``,
``--position-embedding-type yarn``): the flags reach megatron-core's own tables, change the model,
and every path of this project that applies or slices RoPE itself rotates with the scaled table.

Whole training runs (MEMO, chunked MEMO, CP 2, TP 2 + SP, HotSPa against one process) are in
``tests/dist/test_rope_scaling_parity.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.spec_utils import build_module

from memo_ext.arguments import build_parser, parse_args
from memo_ext.config import MemoConfig
from memo_ext.data.packing import pack_documents
from memo_ext.errors import UsageError
from memo_ext.estimate.measure import trace_layer
from memo_ext.features.megatron import run_transformer_config
from memo_ext.mcore.chunked import ChunkedLayer
from memo_ext.mcore.groups import build_process_groups
from memo_ext.mcore.rotary import YarnTransformerConfig, rotary_arguments, yarn_fields
from memo_ext.mcore.specs import build_layer_spec
from memo_ext.megatron_lm.translate import translate
from memo_ext.memo.policy import apply_memo
from memo_ext.shapes import ModelShape
from memo_ext.training.checkpoint.identity import model_identity as _model_identity
from memo_ext.training.model import build_gpt_model
from tests.launch import cli
from tests.models import build_gpt, cpu_config
from tests.unit.test_hotspa_packing import VOCAB, alone, packed, random_documents

MODEL = cli(
    num_layers=2,
    hidden_size=48,
    ffn_hidden_size=40,
    num_attention_heads=6,
    group_query_attention=True,
    num_query_groups=2,
    seq_length=32,
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    micro_batch_size=2,
    train_iters=1,
    lr="1e-3",
    mock_data=True,
    seed=5,
)
"""Head dim 8: channels of wavelength 2π, 63, 628 and 6283 positions at base 10000."""

SCALINGS = {
    # base 10000: the last channel (6283 positions) lies in Llama 3.1's blended band
    "llama3.1": cli(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=4),
    "interpolation": cli(position_embedding_type="rope", rotary_seq_len_interpolation_factor=2.5),
    # a 16-token original context, so that the 32-token sequence is an extension
    "yarn": cli(
        position_embedding_type="yarn",
        rotary_scaling_factor=4,
        yarn_original_max_position_embeddings=16,
        mscale="0.8",
        mscale_all_dim="0.3",
    ),
}
TOKENS = 32


def run_of(*extra: str):
    run = parse_args([*MODEL, *extra], world_size=1)
    return dataclasses.replace(run, model=dataclasses.replace(run.model, padded_vocab_size=VOCAB))


def build(run):
    """The trainer's model of ``run``: its config and its GPT, as ``memo_ext.training`` builds
    them (weights drawn from the run's seed, independent of the RoPE settings)."""
    config = run_transformer_config(run)
    return config, build_gpt_model(run=run, config=config, device=torch.device("cpu"))


def table(embedding, tokens: int = TOKENS) -> torch.Tensor:
    out = embedding(tokens)
    return out[0] if isinstance(out, tuple) else out  # YaRN's module returns (table, factor)


# ---------------------------------------------------------------------------------------------
# flags and their checks
# ---------------------------------------------------------------------------------------------


def test_flags_are_megatron_lms_spellings():
    ours = build_parser()._option_string_actions
    for name in (
        "--use-rope-scaling",
        "--rope-scaling-factor",
        "--rotary-seq-len-interpolation-factor",
        "--rotary-scaling-factor",
        "--yarn-original-max-position-embeddings",
        "--yarn-beta-fast",
        "--yarn-beta-slow",
        "--yarn-correction-range-round-to-int",
        "--no-yarn-correction-range-round-to-int",
        "--mscale",
        "--mscale-all-dim",
    ):
        assert name in ours, name
    assert "yarn" in ours["--position-embedding-type"].choices
    assert ours["--rope-scaling-factor"].default == 8.0  # Megatron-LM's default


def test_flags_reach_the_configs():
    run = run_of(
        *SCALINGS["yarn"], "--yarn-beta-fast", "16", "--no-yarn-correction-range-round-to-int"
    )
    config = run_transformer_config(run)
    assert isinstance(config, YarnTransformerConfig)
    assert yarn_fields(run.model) == {
        name: getattr(config, name) for name in yarn_fields(run.model)
    }
    assert (config.yarn_rotary_scaling_factor, config.yarn_beta_fast) == (4.0, 16.0)
    assert config.yarn_correction_range_round_to_int is False
    # only a YaRN model's config carries the YaRN fields: megatron's attention scales q and k
    # whenever they are there
    for name in ("llama3.1", "interpolation"):
        assert not hasattr(run_transformer_config(run_of(*SCALINGS[name])), "yarn_mscale")
    assert rotary_arguments(run_of(*SCALINGS["llama3.1"]).model) == dict(
        rotary_base=10000,
        rope_scaling=True,
        rope_scaling_factor=4.0,
        seq_len_interpolation_factor=None,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--use-rope-scaling"], "--use-rope-scaling needs rotary positions"),
        (["--rotary-scaling-factor", "4"], "--rotary-scaling-factor needs rotary positions"),
        (
            ["--position-embedding-type", "rope", "--rotary-scaling-factor", "4"],
            "--rotary-scaling-factor is a YaRN setting",
        ),
        (
            ["--position-embedding-type", "rope", "--no-yarn-correction-range-round-to-int"],
            "--no-yarn-correction-range-round-to-int is a YaRN setting",
        ),
        (
            ["--position-embedding-type", "yarn", "--use-rope-scaling"],
            "YaRN ignores --use-rope-scaling",
        ),
        (
            ["--position-embedding-type", "yarn", "--rotary-seq-len-interpolation-factor", "2"],
            "YaRN ignores --rotary-seq-len-interpolation-factor",
        ),
        (
            ["--position-embedding-type", "rope", "--rope-scaling-factor", "4"],
            "--rope-scaling-factor needs --use-rope-scaling",
        ),
        (
            [
                "--position-embedding-type",
                "rope",
                "--use-rope-scaling",
                "--rope-scaling-factor",
                "0",
            ],
            "--rope-scaling-factor must be at least 1",
        ),
        (
            ["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "-2"],
            "--rotary-seq-len-interpolation-factor must be at least 1",
        ),
        (
            ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"],
            "--rotary-scaling-factor must be at least 1",
        ),
        (
            ["--position-embedding-type", "yarn", "--yarn-beta-slow", "40"],
            "--yarn-beta-slow 40.0 must be positive and below --yarn-beta-fast 32.0",
        ),
        (
            ["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "0"],
            "--yarn-original-max-position-embeddings must be at least 1",
        ),
        (["--position-embedding-type", "yarn", "--mscale", "-1"], "--mscale must be at least 0"),
    ],
)
def test_bad_settings_fail_in_one_sentence(extra, message):
    with pytest.raises(UsageError, match=message):
        parse_args([*MODEL, *extra], world_size=1)


def test_yarn_original_context_must_split_over_cp():
    argv = [*MODEL, *SCALINGS["yarn"], "--yarn-original-max-position-embeddings", "18"]
    with pytest.raises(UsageError, match="divisible by 2 × --context-parallel-size = 4"):
        parse_args([*argv, "--context-parallel-size", "2"], world_size=2)
    parse_args(argv, world_size=1)


def test_megatron_lm_rope_type_yarn_points_to_the_position_embedding_flag():
    ours = build_parser()._option_string_actions
    refusals = translate(["--rope-type", "yarn"], ours=ours).refusals
    assert [r.flag for r in refusals] == ["--rope-type yarn"]
    assert "--position-embedding-type yarn" in refusals[0].reason
    assert not translate(["--position-embedding-type", "yarn"], ours=ours).refusals


# ---------------------------------------------------------------------------------------------
# the tables are megatron-core's, and they follow their rules
# ---------------------------------------------------------------------------------------------


def megatron_reference(name: str):
    """megatron-core's own module for the settings of ``SCALINGS[name]``, built directly."""
    if name == "llama3.1":
        return RotaryEmbedding(
            8, 1.0, rope_scaling=True, rope_scaling_factor=4.0, use_cpu_initialization=True
        )
    if name == "interpolation":
        return RotaryEmbedding(
            8, 1.0, seq_len_interpolation_factor=2.5, use_cpu_initialization=True
        )
    return YarnRotaryEmbedding(
        8,
        scaling_factor=4.0,
        original_max_position_embeddings=16,
        mscale=0.8,
        mscale_all_dim=0.3,
        use_cpu_initialization=True,
    )


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_models_table_is_megatron_cores(megatron_cpu, name):
    config, model = build(run_of(*SCALINGS[name]))
    reference = megatron_reference(name)
    assert type(model.rotary_pos_emb) is type(reference)
    assert torch.equal(table(model.rotary_pos_emb), table(reference))
    factor = _yarn_get_concentration_factor_from_config(config)
    if name == "yarn":
        # what megatron's attention multiplies q and k by: YaRN's 0.1·mscale·ln s + 1 ratio
        assert factor == reference(TOKENS)[1]
        assert factor == pytest.approx((0.08 * math.log(4) + 1) / (0.03 * math.log(4) + 1))
    else:
        assert factor == 1.0


def test_tables_follow_their_rules(megatron_cpu):
    """Each rule checked by hand against plain RoPE's frequencies 10000^(-k/4), k = 0..3."""
    plain = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    positions = torch.arange(TOKENS, dtype=torch.float64)

    def angles(name):  # [positions, channels]: each frequency once
        return table(megatron_reference(name))[:, 0, 0, :4].double()

    # linear interpolation: position p is read as p / 2.5
    expected = torch.outer(positions / 2.5, plain)
    torch.testing.assert_close(angles("interpolation"), expected, rtol=1e-6, atol=1e-6)
    # Llama 3.1: wavelengths under 8192 / 4 positions kept, over 8192 divided by the factor,
    # between (here the last channel, 6283 positions) blended by 8192 / wavelength
    wavelength = 2 * math.pi / plain[3]
    blend = (8192 / wavelength - 1) / (4 - 1)
    scaled = torch.cat([plain[:3], ((1 - blend) / 4 + blend) * plain[3:]])
    torch.testing.assert_close(
        angles("llama3.1"), torch.outer(positions, scaled), rtol=1e-6, atol=0
    )
    # YaRN: channel d turns 16 / wavelength times over the original 16 tokens; the blend runs
    # over channel indices from floor(8·ln(16 / (32·2π)) / (2·ln 10000)) = -2 (clamped to 0) to
    # ceil(8·ln(16 / (1·2π)) / (2·ln 10000)) = 1: channel 0 is kept, channels 1-3 divided by 4
    scaled = torch.cat([plain[:1], plain[1:] / 4])
    torch.testing.assert_close(angles("yarn"), torch.outer(positions, scaled), rtol=1e-6, atol=0)


def sharp_logits(*flags: str) -> torch.Tensor:
    """Logits of the trainer's model of ``flags`` on a fixed batch, its QKV weights × 30: at the
    initial std of 0.02 the attention scores are ~0 and barely depend on the positions."""
    tokens = torch.randint(1, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(TOKENS).expand(2, TOKENS)
    _, model = build(run_of(*flags))
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.weight.mul_(30)
        return model(tokens, positions, None)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_each_scaling_changes_the_logits(megatron_cpu, name):
    plain = sharp_logits("--position-embedding-type", "rope")
    # the RoPE settings change no weight: any difference is the table's (and YaRN's factor);
    # Llama 3.1 changes only the slowest channel of this head dim (6e-2 here), the others ~1
    difference = (sharp_logits(*SCALINGS[name]) - plain).abs().max() / plain.abs().max()
    assert difference > 1e-2, difference.item()


def test_yarn_at_factor_one_is_plain_rope(megatron_cpu):
    """The control of the test above: YaRN's path with s = 1 computes RoPE's logits."""
    plain = sharp_logits("--position-embedding-type", "rope")
    yarn = sharp_logits("--position-embedding-type", "yarn")
    # YaRN blends two equal frequency vectors, x·(1 - m) + x·m: at most an ulp from x
    torch.testing.assert_close(yarn, plain, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# every path of ours that applies or slices RoPE: MEMO, chunked layers, packed rows, estimator
# ---------------------------------------------------------------------------------------------


def layer_setup(name: str, dtype: torch.dtype):
    """A layer config of ``SCALINGS[name]``, the table its model would hand the layers, and a
    layer input ``[13, 2, h]``, in ``dtype``."""
    run = run_of(*SCALINGS[name])
    fields = yarn_fields(run.model) if name == "yarn" else {}
    config = cpu_config(dataclasses.replace(run.shape, num_layers=2), **fields)
    x0 = torch.randn(13, 2, 48, generator=torch.Generator().manual_seed(3), dtype=dtype)
    return config, table(megatron_reference(name), 13).to(dtype), x0


def stack(config, *, memo: MemoConfig | None = None, dtype=torch.float32):
    """Two layers of ``config`` (under ``memo``), with the same random weights every time."""
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    if memo is not None:
        spec = apply_memo(spec, memo, config)
    layers = torch.nn.ModuleList(
        build_module(spec, config=config, layer_number=i + 1) for i in range(2)
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layers.parameters():  # norm gains of 1 would hide a mistake
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return layers.to(dtype)


class Chunked(torch.nn.Module):
    """A layer run by ``ChunkedLayer`` in chunks of 5 tokens."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, **kwargs):
        return ChunkedLayer(self.layer, kwargs, 5).forward(kwargs["hidden_states"])


def forward_backward(layers, x0, rope):
    """[output, input gradient, every parameter's gradient] of a weighted sum of the output."""
    x = x0.clone().requires_grad_(True)
    h = x
    for layer in layers:
        h, _ = layer(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
    (h * torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)).sum().backward()
    return [h.detach(), x.grad, *(p.grad for p in layers.parameters())]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_memo_layers_rotate_with_the_scaled_table(megatron_cpu, name):
    config, rope, x0 = layer_setup(name, torch.float32)
    reference = forward_backward(stack(config), x0, rope)
    memo = MemoConfig(enabled=True, alpha=0.3, keep_last_layers=0, host_memory_gb=1.0)
    # the recompute slices the table by tokens; in float32 its products match the forward's row
    # for row from 4 rows on (tests/unit/test_memo_layer.py), so every tensor is rebuilt exactly
    got = forward_backward(stack(config, memo=memo), x0, rope)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_chunked_layers_rotate_with_the_scaled_table(megatron_cpu, name):
    config, rope, x0 = layer_setup(name, torch.float64)
    reference = forward_backward(stack(config, dtype=torch.float64), x0, rope)
    chunked = torch.nn.ModuleList(Chunked(layer) for layer in stack(config, dtype=torch.float64))
    # chunks: another row count per product, and weight gradients summed chunk by chunk;
    # in float64 that rounding is ~1e-16, so 1e-12 leaves no room for a wrong rotation
    for a, b in zip(forward_backward(chunked, x0, rope), reference):
        assert (a - b).norm() <= 1e-12 * b.norm()
    memo = MemoConfig(
        enabled=True, alpha=0.5, keep_last_layers=0, host_memory_gb=1.0, chunk_tokens=4
    )
    got = forward_backward(stack(config, memo=memo, dtype=torch.float64), x0, rope)
    for a, b in zip(got, reference):
        assert (a - b).norm() <= 1e-12 * b.norm()


def test_a_wrong_factor_would_be_seen(megatron_cpu):
    """The control of the test above: a chunked layer whose config lacks YaRN's factor rotates
    differently, so the comparison there can fail."""
    config, rope, x0 = layer_setup("yarn", torch.float64)
    plain = cpu_config(dataclasses.replace(run_of().shape, num_layers=2))
    reference = forward_backward(stack(config, dtype=torch.float64), x0, rope)
    chunked = torch.nn.ModuleList(Chunked(layer) for layer in stack(plain, dtype=torch.float64))
    out = forward_backward(chunked, x0, rope)[0]
    assert (out - reference[0]).norm() > 1e-6 * reference[0].norm()


@pytest.mark.parametrize("name", list(SCALINGS))
def test_packed_documents_match_running_alone(megatron_cpu, name):
    """Packed rows restart RoPE positions per document in megatron's ``thd`` path: each
    document gets the scaled rotation it gets alone."""
    run = run_of(*SCALINGS[name])
    fields = yarn_fields(run.model) if name == "yarn" else {}
    config = cpu_config(run.shape, **fields)
    model = build_gpt(
        config,
        vocab_size=VOCAB,
        max_positions=TOKENS,
        position_embedding_type=run.shape.position_embedding_type,
        **rotary_arguments(run.model),
    )
    docs = random_documents(np.random.default_rng(4), [9, 2, 13, 5])
    (row,) = pack_documents(docs, row_tokens=TOKENS)
    with torch.no_grad():
        losses = packed(model, row)
        for k, doc in enumerate(docs[i] for i in row.document_ids):  # packed longest first
            start = int(row.cu_seqlens[k])
            # a row of several documents vs one document: other matrix shapes, fp32 last bits
            torch.testing.assert_close(
                losses[start : start + len(doc) - 1], alone(model, doc), rtol=1e-5, atol=1e-5
            )


def test_estimator_traces_yarn_as_rope():
    """The estimator's shape knows YaRN only as rotary positions: the scaled table has plain
    RoPE's tensors, so its bytes and FLOPs are RoPE's (and not those of a model without RoPE)."""
    shapes = {
        kind: ModelShape(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=48,
            position_embedding_type=kind,
        )
        for kind in ("rope", "yarn", "learned_absolute")
    }
    figures = {
        kind: trace_layer(shape, tp=1, sp=False, tokens=64, micro_batch_size=1)
        for kind, shape in shapes.items()
    }
    assert figures["yarn"] == figures["rope"] != figures["learned_absolute"]


@pytest.mark.parametrize("kind", ["rope", "yarn"])
def test_rotary_module_takes_the_models_cp_group(megatron_cpu, kind):
    """With explicit groups (HotSPa's layouts) the table is cut for the model's own CP ranks:
    megatron-core hands RoPE's module the model's CP group but builds YaRN's without one."""
    run = run_of("--position-embedding-type", kind)
    groups = build_process_groups(run.layout)
    model = build_gpt_model(
        run=run,
        config=run_transformer_config(run),
        device=torch.device("cpu"),
        pg_collection=groups,
    )
    assert groups.cp is not parallel_state.get_context_parallel_group()
    assert model.rotary_pos_emb.cp_group is groups.cp


def test_a_rope_checkpoint_is_the_model_a_yarn_run_extends(megatron_cpu):
    # the weights are the same: a checkpoint records the identity of a RoPE model for both, so a
    # RoPE model's checkpoint loads into its YaRN extension
    identities = {
        name: _model_identity(build(run_of(*flags))[1])
        for name, flags in (("rope", SCALINGS["interpolation"][:2]), ("yarn", SCALINGS["yarn"]))
    }
    assert identities["rope"] == identities["yarn"]
    assert identities["yarn"]["position_embedding_type"] == "rope"
