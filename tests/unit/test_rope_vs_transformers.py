"""RoPE scaling against ``transformers``' own rotary code: the trainer's model built from our flags
(``--use-rope-scaling``, ``--rotary-seq-len-interpolation-factor``, ``--position-embedding-type
yarn``) rotates by the angles, and scales q and k by the factor, that
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` ('llama3', 'linear', 'yarn') and
``LlamaRotaryEmbedding`` give a ``LlamaConfig`` of the same settings.

``tests/unit/test_rope_scaling.py`` checks that the tables are megatron-core's and follow their
rules by hand; this file is the independent reference that a Hugging Face model (the converter's
Llama 3.1 import, or a model trained here and exported) rotates the same way.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/unit/test_rope_vs_transformers.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (  # noqa: E402
    _yarn_get_concentration_factor_from_config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from memo_ext.arguments import parse_args  # noqa: E402
from memo_ext.features.megatron import run_transformer_config  # noqa: E402
from memo_ext.training.model import build_gpt_model  # noqa: E402
from tests.launch import cli  # noqa: E402

POSITIONS = 2048
"""Table length: Llama 3.1's bands and YaRN's ramp sit in the frequencies, not the positions, so
a table this long already turns every channel through angles up to 2048 × its frequency."""
ROTATED_POSITIONS = 64
"""Positions of the rotated query (see :func:`test_rotated_query_equals_transformers`)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One RoPE setting spelled both ways."""

    name: str
    head_dim: int
    base: int
    flags: list[str]
    """Our (Megatron-LM's) flags."""
    rope_parameters: dict
    """transformers 5's ``LlamaConfig.rope_parameters`` (``rope_theta`` added from ``base``)."""
    max_position_embeddings: int = 4096
    """The HF config's context: only its validation warnings read it for these types."""


def llama3(head_dim: int, base: int, factor: float) -> Case:
    # megatron-core fixes Llama 3.1's other settings (1, 4, 8192): only the factor is a flag
    return Case(
        f"llama3-d{head_dim}-b{base}-x{factor:g}",
        head_dim,
        base,
        cli(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=factor),
        dict(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=int(8192 * factor),
    )


def linear(head_dim: int, base: int, factor: float) -> Case:
    return Case(
        f"linear-d{head_dim}-b{base}-x{factor:g}",
        head_dim,
        base,
        cli(position_embedding_type="rope", rotary_seq_len_interpolation_factor=factor),
        dict(rope_type="linear", factor=factor),
    )


def yarn(
    head_dim: int,
    base: int,
    factor: float,
    *,
    original: int,
    mscale: float = 1.0,
    mscale_all_dim: float = 0.0,
    betas: tuple[float, float] = (32.0, 1.0),
    truncate: bool = True,
) -> Case:
    flags = cli(
        position_embedding_type="yarn",
        rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=betas[0],
        yarn_beta_slow=betas[1],
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    if not truncate:
        flags.append("--no-yarn-correction-range-round-to-int")
    parameters = dict(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=betas[0],
        beta_slow=betas[1],
        truncate=truncate,
    )
    # transformers leaves mscale / mscale_all_dim out of the factor unless both are non-zero
    # (see test_yarn_mscale_without_mscale_all_dim_differs_by_design): give them only then
    if mscale and mscale_all_dim:
        parameters.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    else:
        assert mscale == 1.0, "transformers' factor would ignore this --mscale"
    tail = f"m{mscale:g}-{mscale_all_dim:g}-b{betas[0]:g}-{betas[1]:g}{'' if truncate else '-real'}"
    return Case(
        f"yarn-d{head_dim}-b{base}-x{factor:g}-o{original}-{tail}",
        head_dim,
        base,
        flags,
        parameters,
        max_position_embeddings=int(original * factor),
    )


CASES = [
    # base 10000, head dim 8: channel wavelengths 6, 63, 628, 6283 (the last in Llama's blend)
    llama3(8, 10000, 4.0),
    # Llama 3.1 / 3.2 as released: every channel band at head dim 64 and 128
    llama3(64, 500000, 8.0),
    llama3(128, 500000, 8.0),
    llama3(128, 500000, 32.0),
    linear(8, 10000, 2.5),
    linear(64, 10000, 4.0),
    linear(128, 1000000, 8.0),
    # YaRN's defaults (mscale 1, mscale_all_dim 0: factor 0.1·ln s + 1 on both sides)
    yarn(8, 10000, 4.0, original=16),
    yarn(64, 10000, 4.0, original=4096),
    yarn(128, 1000000, 8.0, original=2048),
    # a blend over fractional channels, other betas, and both mscale coefficients
    yarn(64, 10000, 4.0, original=256, truncate=False),
    yarn(64, 10000, 16.0, original=512, betas=(16.0, 2.0)),
    yarn(128, 10000, 4.0, original=1024, mscale=0.8, mscale_all_dim=0.3),
    # DeepSeek-V3's settings (rope head dim 64, s = 40, equal coefficients: factor 1)
    yarn(64, 10000, 40.0, original=4096, mscale=1.0, mscale_all_dim=1.0),
    yarn(64, 10000, 40.0, original=4096, mscale=0.707, mscale_all_dim=0.707, truncate=False),
]


def our_rope(case: Case) -> tuple[torch.Tensor, float, object]:
    """The trainer's model of ``case.flags`` (one layer, 2 heads of ``case.head_dim``): its
    angle table [POSITIONS, 1, 1, head_dim], the factor its attention multiplies q and k by, and
    its config."""
    run = parse_args(
        [
            *cli(
                num_layers=1,
                hidden_size=2 * case.head_dim,
                num_attention_heads=2,
                ffn_hidden_size=16,
                seq_length=POSITIONS,
                rotary_base=case.base,
                micro_batch_size=1,
                train_iters=1,
                lr="1e-3",
                mock_data=True,
            ),
            *case.flags,
        ],
        world_size=1,
    )
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, padded_vocab_size=128))
    config = run_transformer_config(run)
    model = build_gpt_model(run=run, config=config, device=torch.device("cpu"))
    out = model.rotary_pos_emb(POSITIONS)
    angles = out[0] if isinstance(out, tuple) else out  # YaRN's module returns (table, factor)
    return angles, _yarn_get_concentration_factor_from_config(config), config


def hf_config(case: Case):
    return transformers.LlamaConfig(
        hidden_size=2 * case.head_dim,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=case.head_dim,
        max_position_embeddings=case.max_position_embeddings,
        rope_parameters={**case.rope_parameters, "rope_theta": float(case.base)},
    )


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_angles_and_factor_equal_transformers(megatron_cpu, case):
    ours, factor, _ = our_rope(case)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[case.rope_parameters["rope_type"]](
        hf_config(case), "cpu"
    )
    assert inv_freq.shape == (case.head_dim // 2,)
    # megatron's table repeats the angles over the two halves of the head (rotate-half layout),
    # as transformers' cat((freqs, freqs)): [POSITIONS, head_dim / 2] each
    half = case.head_dim // 2
    assert torch.equal(ours[:, 0, 0, :half], ours[:, 0, 0, half:])
    # Linear interpolation: megatron multiplies the positions by 1 / factor, transformers divides
    # the frequencies by the factor; the angle p · inv_freq / factor is the quantity both rotate
    # by. Llama 3.1 and YaRN: the same frequencies times p. fp32 both sides, each angle a product
    # of the same fp32 numbers (linear: one rounding apart): 1e-6 relative, position 0 is 0.
    # Seen: bit-equal, but for linear interpolation at head dim 8 (1.8e-7)
    expected = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(ours[:, 0, 0, :half], expected, rtol=1e-6, atol=0)
    # megatron's attention multiplies q and k by the concentration factor ("mscale"),
    # transformers multiplies cos and sin by attention_factor: the same product q·cos, k·cos
    assert factor == pytest.approx(attention_factor, rel=1e-12)
    if case.rope_parameters["rope_type"] != "yarn":
        assert factor == 1.0


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_rotated_query_equals_transformers(megatron_cpu, case):
    """What attention sees: a query rotated by megatron's ``apply_rotary_pos_emb`` with the
    model's table and factor, and by transformers' Llama with its ``LlamaRotaryEmbedding``."""
    ours, factor, config = our_rope(case)
    s = ROTATED_POSITIONS
    # [s, b, n, d]: megatron's layout of a query
    q = torch.randn(s, 2, 3, case.head_dim, generator=torch.Generator().manual_seed(5))
    rotated = apply_rotary_pos_emb(q, ours[:s], config, mscale=factor)
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_config(case))
    positions = torch.arange(s).expand(2, s)
    cos, sin = rotary(q, positions)  # [b, s, d], attention_factor applied
    q_hf = q.permute(1, 2, 0, 3)  # [b, n, s, d]
    expected, _ = modeling_llama.apply_rotary_pos_emb(q_hf, q_hf, cos, sin)
    # equal angles (previous test) and the same rotate-half formula: bit-equal here but for
    # linear interpolation, whose angles (up to 64 / 2.5 rad) may differ by a rounding (up to
    # 2e-6 rad), and cos and sin with them; 7e-7 seen
    torch.testing.assert_close(rotated, expected.permute(2, 0, 1, 3), rtol=1e-6, atol=4e-6)


def test_yarn_mscale_without_mscale_all_dim_differs_by_design(megatron_cpu):
    """A known disagreement, kept in view: YaRN's factor with ``--mscale m`` and
    ``--mscale-all-dim 0`` (Megatron-LM's default).

    megatron-core, as DeepSeek-V2's reference code, takes (0.1·m·ln s + 1) / (0.1·0·ln s + 1) =
    0.1·m·ln s + 1; transformers uses the ratio only when both coefficients are non-zero and
    otherwise 0.1·ln s + 1, so it ignores m. The two agree for m = 1 (the default), and for
    both coefficients non-zero. A YaRN model moved between the two with m ≠ 1 and no
    mscale_all_dim rotates by the same angles but scales q·k differently; the converter refuses
    YaRN models (``memo_ext/hf/weights.py``), so no import or export carries this.
    """
    s, m = 4.0, 0.8
    case = yarn(64, 10000, s, original=16)
    case = dataclasses.replace(case, flags=[*case.flags, "--mscale", str(m)])  # last one wins
    angles, ours, _ = our_rope(case)
    config = hf_config(case)
    config.rope_parameters.update(mscale=m, mscale_all_dim=0.0)
    inv_freq, theirs = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(angles[1, 0, 0, :32], inv_freq)  # the same angles
    assert ours == pytest.approx(0.1 * m * math.log(s) + 1, rel=1e-12)  # 1.1109
    assert theirs == pytest.approx(0.1 * math.log(s) + 1, rel=1e-12)  # 1.1386
