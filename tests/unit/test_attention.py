"""SDPAttention against a hand-written causal softmax attention."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.mcore.attention import SDPAttention


def reference_attention(q, k, v):
    """q [s, b, np, d], k / v [s, b, ng, d] → [s, b, np·d], explicit causal softmax."""
    s, b, heads, d = q.shape
    groups = k.size(2)
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, heads * d)


def build(heads: int, groups: int, d: int) -> SDPAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)


@pytest.mark.parametrize(("s", "b", "heads", "groups", "d"), [(7, 2, 4, 4, 8), (13, 1, 6, 2, 5)])
def test_matches_reference_with_gqa(megatron_cpu, s, b, heads, groups, d):
    attn = build(heads, groups, d)
    q = torch.randn(s, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, groups, d, dtype=torch.float64, requires_grad=True)
    out = attn(q, k, v, None)
    expected = reference_attention(q, k, v)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_packed_sequences_do_not_see_each_other(megatron_cpu):
    heads, groups, d = 4, 2, 6
    attn = build(heads, groups, d)
    lengths = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    t = sum(lengths)
    q = torch.randn(t, heads, d, dtype=torch.float64)
    k = torch.randn(t, groups, d, dtype=torch.float64)
    v = torch.randn(t, groups, d, dtype=torch.float64)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, heads * d)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = reference_attention(*(x[start:end].unsqueeze(1) for x in (q, k, v)))
        torch.testing.assert_close(out[start:end], alone.squeeze(1))
    # changing the second sequence leaves the others untouched
    k2 = k.clone()
    k2[5] += 10.0
    out2 = attn(q, k2, v, None, packed_seq_params=params)
    torch.testing.assert_close(out2[:5], out[:5])
    torch.testing.assert_close(out2[6:], out[6:])


def test_rejects_non_causal_masks(megatron_cpu):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="causal attention only"):
        SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.no_mask)
