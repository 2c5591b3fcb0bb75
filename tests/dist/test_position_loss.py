"""Validation loss by token position through the trainer: the same figures on one process as
under DP, TP, CP and PP (each token counted once). --variable-seq-lengths refuses
--eval-interval for now; positions within packed documents are covered by the unit tests."""

from __future__ import annotations

import pytest

from tests.launch import cli, run_pretrain

pytestmark = pytest.mark.dist

MODEL = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=64,
    micro_batch_size=2,
    global_batch_size=4,
    lr="1e-3",
    mock_data=True,
    train_iters=2,
    eval_interval=2,
    eval_iters=2,
    eval_position_min_tokens=8,
    position_embedding_type="rope",
)
BUCKETS = ["0-7", "8-15", "16-31", "32-63"]


def _evaluation(records: list[dict]) -> dict:
    (record,) = [r for r in records if "val_loss" in r]
    return record


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("position_loss")
    return _evaluation(run_pretrain(MODEL, nproc=1, workdir=workdir, name="one"))


def test_buckets_average_back_to_the_validation_loss(one_process):
    by_position = one_process["val_loss_by_position"]
    assert list(by_position) == BUCKETS
    # mock rows are full and every token has a label: a bucket's tokens are its width × rows
    widths = [8, 8, 16, 32]
    mean = sum(w * by_position[b] for w, b in zip(widths, BUCKETS)) / sum(widths)
    # val_loss sums each micro-batch's losses in float32, the buckets in float64
    assert mean == pytest.approx(one_process["val_loss"], rel=1e-6)


TWO_PROCESSES = pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--tensor-model-parallel-size", "2"],
        ["--context-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["dp2", "tp2", "cp2", "pp2"],
)


def _assert_same_figures(got: dict, expected: dict) -> None:
    # other reduction orders (DP / CP sums, TP partial matmuls) after two training steps
    assert got["val_loss_by_position"] == pytest.approx(expected["val_loss_by_position"], rel=1e-5)
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


@TWO_PROCESSES
def test_two_processes_give_the_one_process_figures(one_process, flags, tmp_path):
    got = _evaluation(run_pretrain(MODEL + flags, nproc=2, workdir=tmp_path, name="two"))
    # CP: each rank holds two non-adjacent chunks; a missing "32-63" would mean local positions
    assert list(got["val_loss_by_position"]) == BUCKETS
    _assert_same_figures(got, one_process)
