"""TP + SP, CP, PP and DP runs over gloo give the one-process losses and gradient norms.

Each case trains the same model on the same global batches (mock data, fp32, no dropout) as a
single process does. Weights are drawn independently of the layout, so the runs start equal;
what remains is summation order inside collectives and sliced matmuls, hence the tolerance.
"""

from __future__ import annotations

import pytest

from tests.launch import assert_same_curves, run_pretrain

pytestmark = pytest.mark.dist

# Reductions over TP / CP shards add the same numbers in another order: fp32 rounding only.
RTOL = 1e-5

SHAPES = {
    # GQA, RoPE, RMSNorm, SwiGLU, no biases, odd FFN width
    "llama": [
        "--num-layers", "2", "--hidden-size", "48", "--ffn-hidden-size", "70",
        "--num-attention-heads", "6", "--num-query-groups", "2", "--seq-length", "44",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    ],
    # GPT-2 style: LayerNorm, GeLU, biases, learned positions, tied embeddings
    "gpt": [
        "--num-layers", "4", "--hidden-size", "40", "--num-attention-heads", "4",
        "--seq-length", "36", "--max-position-embeddings", "40",
    ],
}  # fmt: skip

COMMON = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
    "--lr", "2e-3", "--lr-warmup-iters", "1", "--mock-data", "--seed", "7",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.5",
]  # fmt: skip

LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    return {
        shape: run_pretrain(args + COMMON, nproc=1, workdir=workdir, name=shape)
        for shape, args in SHAPES.items()
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_layout_matches_one_process(shape, layout, references, tmp_path):
    nproc, flags = LAYOUTS[layout]
    curves = run_pretrain(
        SHAPES[shape] + COMMON + flags, nproc=nproc, workdir=tmp_path, name=layout
    )
    assert_same_curves(references[shape], curves, rtol=RTOL)


def test_four_processes_tp2_pp2(references, tmp_path):
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--pipeline-model-parallel-size", "2"]  # fmt: skip
    curves = run_pretrain(SHAPES["gpt"] + COMMON + flags, nproc=4, workdir=tmp_path, name="tp2pp2")
    assert_same_curves(references["gpt"], curves, rtol=RTOL)


def test_four_processes_cp2_dp2(references, tmp_path):
    flags = ["--context-parallel-size", "2"]
    curves = run_pretrain(
        SHAPES["llama"] + COMMON + flags, nproc=4, workdir=tmp_path, name="cp2dp2"
    )
    assert_same_curves(references["llama"], curves, rtol=RTOL)


def test_chunked_loss_under_tp_sp(references, tmp_path):
    """--loss-chunks slices the SP-gathered sequence; the curves are the one-process ones."""
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--loss-chunks", "3"]
    curves = run_pretrain(SHAPES["llama"] + COMMON + flags, nproc=2, workdir=tmp_path, name="lc")
    assert_same_curves(references["llama"], curves, rtol=RTOL)


def test_recompute_baselines_match_no_recompute(references, tmp_path):
    """Megatron's full and selective recomputation change memory, never the numbers."""
    for name, flags in {
        "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"],
        "selective": ["--recompute-granularity", "selective"],
    }.items():  # fmt: skip
        curves = run_pretrain(SHAPES["gpt"] + COMMON + flags, nproc=1, workdir=tmp_path, name=name)
        assert_same_curves(references["gpt"], curves, rtol=1e-6)
