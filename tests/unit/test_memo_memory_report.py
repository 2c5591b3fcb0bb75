"""``tools/memory_report.py`` on a small model: the figures keep the relations they must keep."""

from __future__ import annotations

import json

import pytest

from tests.launch import cli, run_tool

LAYERS, H, S, TP, B = 6, 64, 256, 2, 2


@pytest.mark.slow
def test_memory_report_relations():
    proc = run_tool(
        "tools.memory_report",
        *cli(
            num_layers=str(LAYERS),
            hidden_size=str(H),
            num_attention_heads=4,
            seq_length=str(S),
            micro_batch_size=str(B),
            tensor_model_parallel_size=str(TP),
            sequence_parallel=True,
            normalization="RMSNorm",
            swiglu=True,
            disable_bias_linear=True,
            position_embedding_type="rope",
            memo_chunk_tokens="32",
            json=True,
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    methods = json.loads(proc.stdout.strip().splitlines()[-1])["methods"]
    assert set(methods) == {
        "none",
        "full",
        "selective",
        "memo-0",
        "memo-0.5",
        "memo-1",
        "memo-chunked-0",
        "memo-chunked-1",
    }
    none, full = methods["none"], methods["full"]
    # full recomputation keeps each layer's input, [s/tp, b, h] fp32, and recomputes everything
    assert full["device_activation_bytes"] == LAYERS * (S // TP) * B * H * 4
    assert none["recompute_flops"] == 0 and none["host_bytes"] == 0
    per_layer = none["device_activation_bytes"] // LAYERS
    for alpha in ("0", "0.5", "1"):
        memo = methods[f"memo-{alpha}"]
        # the two kept layers take the ping-pong slots' place: at any α the device holds two
        # layers' sets when the forward ends (it was two kept layers plus two slots)
        assert memo["device_activation_bytes"] <= 2 * per_layer
        assert memo["recompute_flops"] < full["recompute_flops"]
    assert methods["memo-1"]["recompute_flops"] == 0
    host = [methods[f"memo-{a}"]["host_bytes"] for a in ("0", "0.5", "1")]
    assert 0 < host[0] < host[1] < host[2]
    assert host[2] - host[1] == host[1] - host[0]  # linear in α
    recompute = [methods[f"memo-{a}"]["recompute_flops"] for a in ("0", "0.5")]
    assert recompute[1] * 2 == recompute[0]  # half the tokens, half the token-local FLOPs
    # chunked (4 chunks of 32 of the 128 local tokens, no kept layer, so 6 offloaded layers to
    # whole-layer MEMO's 4): the device holds the copies in flight, well under one layer's set;
    # per offloaded layer about whole-layer MEMO's host bytes (plus the chunks' own copies of
    # the attention output's gathered rows under SP)
    for alpha in ("0", "1"):
        chunked, memo = methods[f"memo-chunked-{alpha}"], methods[f"memo-{alpha}"]
        assert 0 < chunked["device_activation_bytes"] < per_layer / 2
        per_chunked, per_memo = chunked["host_bytes"] / LAYERS, memo["host_bytes"] / (LAYERS - 2)
        assert per_memo <= per_chunked <= 1.25 * per_memo
    assert methods["memo-chunked-1"]["recompute_flops"] == 0
    assert methods["memo-chunked-0"]["recompute_flops"] > 0
