"""--variable-seq-lengths through the trainer: packed whole documents, exact across layouts."""

from __future__ import annotations

import pytest

from tests.launch import assert_same_curves, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist

ARGS = cli(
    num_layers=2,
    hidden_size=36,
    num_attention_heads=6,
    group_query_attention=True,
    num_query_groups=2,
    seq_length=52,
    micro_batch_size=1,
    global_batch_size=6,
    train_iters=4,
    lr="2e-3",
    mock_data=True,
    position_embedding_type="rope",
    swiglu=True,
    normalization="RMSNorm",
    variable_seq_lengths=True,
    seed=5,
)


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_run(ARGS, nproc=1, cache_dir=reference_runs)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--context-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["dp2", "tp2-sp", "cp2", "pp2"],
)
def test_packed_documents_match_one_process(reference, tmp_path, flags):
    curves = run_pretrain(ARGS + flags, nproc=2, workdir=tmp_path, name="two")
    # rows are dealt to DP ranks or split over TP / CP / PP: fp32 summation order only
    assert_same_curves(reference, curves, rtol=1e-5)


def test_resume_continues_the_document_order(reference, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    run_pretrain(
        ARGS + ["--save", str(save), "--exit-interval", "2"], nproc=1, workdir=tmp_path, name="tail"
    )
    curves = run_pretrain(ARGS + ["--load", str(save)], nproc=1, workdir=tmp_path, name="tail")
    assert_same_curves(reference, curves, rtol=1e-6)
