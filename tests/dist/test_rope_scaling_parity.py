"""RoPE scaled for context extension trains alike under MEMO and across parallel layouts.

For each scaling (Llama 3.1's, linear position interpolation, YaRN) the same fp32 job runs with
MEMO (whole layers, then sub-sequence chunks), under CP 2 and under TP 2 + SP on two gloo
processes, and, with packed documents, under HotSPa's layouts; each is compared with one plain
process. Every path applies the table the model computed (sliced per chunk, per recompute
slice, per CP rank, per packed document) and YaRN's attention factor from the config, so the
curves match as they do with plain RoPE (``test_memo_parity.py``, ``test_parallel_parity.py``,
``test_hotspa_training.py``).
"""

from __future__ import annotations

import pytest

from tests.dist.test_hotspa_training import pareto_texts, preprocess
from tests.launch import assert_same_curves, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist

LLAMA = cli(
    num_layers=2,
    hidden_size=48,
    ffn_hidden_size=70,
    num_attention_heads=6,
    group_query_attention=True,
    num_query_groups=2,
    seq_length=44,
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
)
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
SCALINGS = {
    # head dim 8 at Llama 3's base: one channel kept, one blended, one divided by the factor
    "llama3.1": cli(
        position_embedding_type="rope",
        rotary_base=500000,
        use_rope_scaling=True,
        rope_scaling_factor=4,
    ),
    "interpolation": cli(position_embedding_type="rope", rotary_seq_len_interpolation_factor=3),
    # a 16-token original context stretched 4 times, with a non-trivial attention factor
    "yarn": cli(
        position_embedding_type="yarn",
        rotary_scaling_factor=4,
        yarn_original_max_position_embeddings=16,
        mscale="0.8",
        mscale_all_dim="0.2",
    ),
}
VARIANTS = {
    # name: (processes, flags, relative tolerance of loss and gradient norm)
    # MEMO rebuilds every saved tensor bit for bit (see test_memo_parity.py)
    "memo": (1, ["--memo", "--memo-alpha", "0.3", "--memo-keep-last-layers", "0"], 0.0),
    # chunks of 7 of 44 tokens: weight gradients summed chunk by chunk, other BLAS row blocks
    "memo-chunked": (
        1,
        [
            "--memo",
            "--memo-alpha",
            "0.5",
            "--memo-keep-last-layers",
            "0",
            "--memo-chunk-tokens",
            "7",
        ],
        1e-6,
    ),
    # reductions over the ranks' shards add the same numbers in another order
    "cp2": (2, ["--context-parallel-size", "2"], 1e-5),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_scaled_rope_matches_one_plain_process(scaling, variant, reference_runs, tmp_path):
    flags = LLAMA + SCALINGS[scaling] + COMMON
    reference = reference_run(flags, nproc=1, cache_dir=reference_runs)
    nproc, extra, rtol = VARIANTS[variant]
    curves = run_pretrain(flags + extra, nproc=nproc, workdir=tmp_path, name=variant)
    assert [r["iteration"] for r in curves] == [1, 2, 3]
    assert_same_curves(reference, curves, rtol=rtol)


def test_scalings_train_differently(reference_runs):
    """The control: each scaling's curve differs from plain RoPE's, so the comparisons above
    compare scaled models."""
    plain = reference_run(
        LLAMA + cli(position_embedding_type="rope") + COMMON, cache_dir=reference_runs
    )
    for name, flags in SCALINGS.items():
        curve = reference_run(LLAMA + flags + COMMON, cache_dir=reference_runs)
        assert curve[-1]["loss"] != plain[-1]["loss"], name


HOTSPA_MODEL = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    swiglu=True,
    normalization="RMSNorm",
    micro_batch_size=1,
    lr="2e-3",
    tokenizer_type="ByteTokenizer",
    variable_seq_lengths=True,
    seed=3,
    seq_length=128,
    global_batch_size=8,
    train_iters=3,
)


@pytest.mark.parametrize("scaling", ["interpolation", "yarn"])
def test_hotspa_layouts_match_one_process(scaling, tmp_path):
    """Packed documents (positions restart per document) in buckets under DP, TP and CP
    layouts on two processes, against one process packing the same documents."""
    data = preprocess(tmp_path, pareto_texts(48, seed=1), "pareto")
    flags = HOTSPA_MODEL + SCALINGS[scaling] + cli(data_path=data)
    reference = run_pretrain(flags, nproc=1, workdir=tmp_path, name="one")
    hotspa = ["--hotspa", "--hotspa-buckets", "32,64,128", "--hotspa-strategies", "dp2;tp2;cp2"]
    curves = run_pretrain(flags + hotspa, nproc=2, workdir=tmp_path, name="hotspa")
    # buckets regroup the documents: the same tokens' terms summed in another order
    assert_same_curves(reference, curves, rtol=1e-4)
