"""Layout-independent initialisation: the same global weights whatever the TP / PP split."""

from __future__ import annotations

import torch

from memo_ext.mcore.init import _shard


class FakeParam:
    def __init__(self, partition_dim: int):
        self.tensor_model_parallel = True
        self.partition_dim = partition_dim


def test_column_and_row_shards_reassemble():
    full = torch.arange(24.0).reshape(6, 4)
    column = [
        _shard(full, FakeParam(0), name="x.weight", tp=3, tp_rank=r, gated=False) for r in range(3)
    ]
    row = [
        _shard(full, FakeParam(1), name="x.weight", tp=2, tp_rank=r, gated=False) for r in range(2)
    ]
    assert torch.equal(torch.cat(column, dim=0), full)
    assert torch.equal(torch.cat(row, dim=1), full)


def test_gated_fc1_keeps_gate_and_up_halves_together():
    ffn, h, tp = 6, 2, 3
    gate = torch.arange(ffn * h, dtype=torch.float32).reshape(ffn, h)
    up = -gate - 1
    full = torch.cat([gate, up])
    for r in range(tp):
        got = _shard(
            full,
            FakeParam(0),
            name="decoder.layers.0.mlp.linear_fc1.weight",
            tp=tp,
            tp_rank=r,
            gated=True,
        )
        rows = slice(r * ffn // tp, (r + 1) * ffn // tp)
        assert torch.equal(got, torch.cat([gate[rows], up[rows]]))
