"""``pretrain_gpt_memo.py --memo`` trains exactly like the same run without MEMO.

Each case launches the same job twice, with and without ``--memo``, in the same parallel layout
(one process, TP + SP, CP, PP over gloo), and compares the metrics files. MEMO rebuilds every
saved tensor bit for bit; its recompute passes run the token-local part of each layer on a token
slice, whose matrix products match the full ones row for row on this CPU from 4 rows on (every
case here recomputes at least 4 rows), so the curves are compared exactly.

With ``--memo-chunk-tokens`` (a chunk size that divides no case's local tokens) a weight's
gradient is summed over tokens chunk by chunk, and a chunk's rows may start off the CPU BLAS's
row blocks (another kernel, another summation order): losses and gradient norms then match
within 1e-6 relative, rounding apart.
"""

from __future__ import annotations

import pytest

from tests.launch import SMALL_LLAMA, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist

LLAMA = SMALL_LLAMA + cli(num_layers=3)
GPT = cli(num_layers=4, hidden_size=40, num_attention_heads=4, seq_length=36)
COMMON = cli(
    micro_batch_size=2,
    global_batch_size=4,
    train_iters=3,
    lr="2e-3",
    mock_data=True,
    seed=5,
    hidden_dropout=0,
    attention_dropout=0,
)

CASES = {
    # name: (processes, model and layout flags, MEMO flags)
    "one-process": (1, LLAMA, ["--memo-alpha", "0.3", "--memo-keep-last-layers", "0"]),
    "tp2-sp": (
        2,
        [*LLAMA, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--memo-alpha", "0.45", "--memo-keep-last-layers", "1"],
    ),
    "cp2": (2, [*GPT, "--context-parallel-size", "2"], ["--memo-alpha", "0.6"]),
    "pp2": (
        2,
        [*GPT, "--pipeline-model-parallel-size", "2"],
        ["--memo-alpha", "0", "--memo-keep-last-layers", "1"],
    ),
}


CHUNKED = {
    # case: MEMO flags with chunking; local tokens 44, 22, 18 and 36 (stage 0 of 2)
    "one-process": ["--memo-alpha", "0.5", "--memo-keep-last-layers", "1"],
    "tp2-sp": ["--memo-alpha", "0.45", "--memo-keep-last-layers", "1"],
    "cp2": ["--memo-alpha", "0.6"],
    "pp2": ["--memo-alpha", "0.3", "--memo-keep-last-layers", "1"],
}
CHUNK_TOKENS = "7"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_runs):
    """Each case's (plain, memo) or with ``chunked`` (plain, chunked memo) metrics, trained
    once per module (the plain runs once per session)."""
    cache: dict[tuple[str, bool], list[dict]] = {}

    def launch(case: str, chunked: bool) -> list[dict]:
        nproc, flags, memo_flags = CASES[case]
        workdir = tmp_path_factory.mktemp(case)
        if chunked:
            memo_flags = [*CHUNKED[case], "--memo-chunk-tokens", CHUNK_TOKENS]
        args = [*flags, *COMMON, "--memo", *memo_flags]
        return run_pretrain(args, nproc=nproc, workdir=workdir, name="memo")

    def get(case: str, *, chunked: bool = False) -> tuple[list[dict], list[dict]]:
        if (case, None) not in cache:
            nproc, flags, _ = CASES[case]
            cache[case, None] = reference_run(flags + COMMON, nproc=nproc, cache_dir=reference_runs)
        if (case, chunked) not in cache:
            cache[case, chunked] = launch(case, chunked)
        return cache[case, None], cache[case, chunked]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_memo_matches_plain_run(case, runs):
    plain, memo = runs(case)
    assert [r["iteration"] for r in plain] == [r["iteration"] for r in memo] == [1, 2, 3]
    for a, b in zip(plain, memo):
        assert b["loss"] == a["loss"], f"iteration {a['iteration']}: loss"
        assert b["grad_norm"] == a["grad_norm"], f"iteration {a['iteration']}: grad norm"


@pytest.mark.parametrize("case", list(CHUNKED))
def test_chunked_memo_matches_plain_run(case, runs):
    plain, memo = runs(case, chunked=True)
    assert [r["iteration"] for r in plain] == [r["iteration"] for r in memo] == [1, 2, 3]
    for a, b in zip(plain, memo):
        for key in ("loss", "grad_norm"):
            assert abs(b[key] - a[key]) <= 1e-6 * abs(a[key]), f"iteration {a['iteration']}: {key}"
    assert all(r["memo_recomputed_tokens"] > 0 for r in memo)


def test_metrics_file_reports_memo(runs):
    _, memo = runs("one-process")
    for record in memo:
        assert record["memo_alpha"] == 0.3
        assert record["host_offload_bytes"] > 0
        assert record["memo_h2d_bytes"] == record["host_offload_bytes"]
        # 3 layers, 44 tokens, 2 sequences per micro-batch, 2 micro-batches: 31 tokens recomputed
        assert record["memo_recomputed_tokens"] == 3 * (44 - 13) * 2 * 2
