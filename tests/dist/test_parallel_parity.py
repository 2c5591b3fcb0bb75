"""TP + SP, CP, PP and DP runs over gloo give the one-process losses and gradient norms.

Each case trains the same model on the same global batches (mock data, fp32, no dropout) as a
single process does. Weights are drawn independently of the layout, so the runs start equal;
what remains is summation order inside collectives and sliced matmuls, hence the tolerance.
"""

from __future__ import annotations

import pytest

from tests.launch import SMALL_LLAMA, assert_same_curves, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist

# Reductions over TP / CP shards add the same numbers in another order: fp32 rounding only.
RTOL = 1e-5

SHAPES = {
    # GQA, RoPE, RMSNorm, SwiGLU, no biases, odd FFN width
    "llama": SMALL_LLAMA + cli(num_layers=2, untie_embeddings_and_output_weights=True),
    # GPT-2 style: LayerNorm, GeLU, biases, learned positions, tied embeddings
    "gpt": cli(
        num_layers=4,
        hidden_size=40,
        num_attention_heads=4,
        seq_length=36,
        max_position_embeddings=40,
    ),
}

COMMON = cli(
    micro_batch_size=2,
    global_batch_size=8,
    train_iters=3,
    lr="2e-3",
    lr_warmup_iters=1,
    mock_data=True,
    seed=7,
    hidden_dropout=0,
    attention_dropout=0,
    clip_grad="0.5",
)

LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
}


@pytest.fixture(scope="module")
def references(reference_runs):
    return {
        shape: reference_run(args + COMMON, nproc=1, cache_dir=reference_runs)
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
    flags = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--pipeline-model-parallel-size",
        "2",
    ]
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
        "full": cli(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        "selective": ["--recompute-granularity", "selective"],
    }.items():
        curves = run_pretrain(SHAPES["gpt"] + COMMON + flags, nproc=1, workdir=tmp_path, name=name)
        assert_same_curves(references["gpt"], curves, rtol=1e-6)
