"""``memo_ext.benchmarks.memo_chunking``: on a small layer, chunking lowers one MEMO layer's peak
and its growth with the sequence length, and the fit and tables describe the measured rows."""

from __future__ import annotations

import pytest

from memo_ext.benchmarks.memo_chunking import fit, fit_table, measure, table
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

SHAPE = ModelShape(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)


@pytest.fixture(scope="module")
def rows():
    return measure(
        SHAPE, layout=ParallelLayout(tp=1), tokens=[2048, 4096], chunks=[None, 256], alpha=1.0
    )


def test_chunking_lowers_the_peak_and_its_slope(rows):
    peak = {(r["chunk_tokens"], r["tokens"]): r["peak_bytes"] for r in rows}
    assert peak[256, 4096] < peak[None, 4096]
    fits = {f["chunk_tokens"]: f for f in fit(rows)}
    assert fits[256]["slope_bytes_per_token"] < fits[None]["slope_bytes_per_token"]
    # Both layers' peaks grow with the sequence: the whole-sequence tensors stay whole.
    assert fits[256]["slope_bytes_per_token"] > 0
    assert peak[256, 2048] < peak[256, 4096]


def test_rows_fit_and_tables_agree(rows):
    assert [(r["chunk_tokens"], r["tokens"], r["chunks"]) for r in rows] == [
        (None, 2048, 1),
        (None, 4096, 1),
        (256, 2048, 8),
        (256, 4096, 16),
    ]
    for f in fit(rows):
        for r in rows:
            if r["chunk_tokens"] == f["chunk_tokens"]:
                line = f["slope_bytes_per_token"] * r["tokens"] + f["intercept_bytes"]
                assert line == pytest.approx(r["peak_bytes"])  # two points: on the line
    printed = table(rows)
    assert printed.splitlines()[0] == "| chunk (local tokens) | 2K | 4K |"
    assert f"| 256 | {rows[2]['peak_gib']:.3f} | {rows[3]['peak_gib']:.3f} |" in printed
    assert "| whole |" in fit_table(fit(rows))
