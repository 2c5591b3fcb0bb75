"""Evaluation, TensorBoard, and what a diverging run does (stop with a pointer, or skip)."""

from __future__ import annotations

import math
import os

import pytest

from tests.launch import assert_same_curves, cli, free_port, run_job, run_pretrain, train_fails

pytestmark = pytest.mark.dist

MODEL = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=24,
    micro_batch_size=2,
    global_batch_size=4,
    lr="1e-3",
    mock_data=True,
    train_iters=6,
)


def test_evaluation_reports_and_leaves_training_alone(tmp_path):
    plain = run_pretrain(MODEL, nproc=1, workdir=tmp_path, name="plain")
    tb = tmp_path / "tb"
    evaluated = run_pretrain(
        MODEL + cli(eval_interval=3, eval_iters=2, tensorboard_dir=str(tb)),
        nproc=1,
        workdir=tmp_path,
        name="eval",
    )
    # validation batches come from their own split and iterator: training is unchanged
    assert_same_curves(plain, evaluated, rtol=0.0)
    with_val = {r["iteration"]: r for r in evaluated if "val_loss" in r}
    assert sorted(with_val) == [3, 6]
    for record in with_val.values():
        assert math.isclose(record["val_ppl"], math.exp(record["val_loss"]))
    assert with_val[6]["val_loss"] < with_val[3]["val_loss"]  # it is learning the mock data

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"train/loss", "train/grad_norm", "train/lr", "val/val_loss"} <= set(
        events.Tags()["scalars"]
    )
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([r["loss"] for r in evaluated])


@pytest.mark.parametrize(
    "precision", [[], ["--bf16", "--use-distributed-optimizer"]], ids=["fp32", "bf16"]
)
def test_divergence_stops_with_a_pointer_to_the_last_checkpoint(tmp_path, precision):
    save = tmp_path / "ckpt"
    save.mkdir()
    # step 1 sees the initial weights; its update with an absurd rate makes step 2's loss NaN
    args = [*MODEL, *cli(lr="1e30", clip_grad=0, save=str(save), save_interval=1), *precision]
    last = train_fails(args, status=1)
    assert "iteration 2: loss nan" in last
    # iteration 1's checkpoint holds the weights step 2 diverged from: not a good one
    assert last.endswith(
        f"the latest checkpoint in {save}, iteration 1, holds the weights this step diverged "
        "from, and no earlier one was kept: start again with a lower --lr"
    )


def test_skip_iterations_with_nan_keeps_going(tmp_path):
    records = run_pretrain(
        MODEL + ["--lr", "1e30", "--clip-grad", "0", "--skip-iterations-with-nan"],
        nproc=1,
        workdir=tmp_path,
        name="skip",
    )
    assert records[-1]["iteration"] == 6
    assert records[-1]["skipped_iterations"] >= 1


def test_exit_duration_saves_and_stops(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    records = run_pretrain(
        MODEL + cli(train_iters=1000, save=str(save), exit_duration_in_mins="1e-6"),
        nproc=1,
        workdir=tmp_path,
        name="duration",
    )
    assert records[-1]["iteration"] == 1  # the first step already outlasts the budget
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_preflight_refuses_a_run_that_cannot_fit_before_building_it(tmp_path):
    big = cli(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=131072,
        micro_batch_size=1,
        train_iters=1,
        lr="1e-4",
        mock_data=True,
        position_embedding_type="rope",
        preflight_device="a100-80g",
    )
    last = train_fails(big, status=2)
    assert "this run does not fit: device peak" in last and "--skip-preflight" in last
    # a small model passes the same check and trains
    records = run_pretrain(
        MODEL + ["--train-iters", "1", "--preflight-device", "a100-80g"],
        nproc=1,
        workdir=tmp_path,
        name="fits",
    )
    assert records[-1]["iteration"] == 1


def two_runs_job(argv: list[str]) -> int:
    """A job of the tests' worker pool: trains twice in this process (``argv``: the second
    run's rendezvous port, then the flags) and fails unless the second run leaves no more
    threads or open files behind than the first (a run's process groups hold both until its
    objects are collected)."""
    import sys

    from pretrain_gpt_memo import main

    second_port, *flags = argv
    held = []
    for port in (os.environ["MASTER_PORT"], second_port):
        os.environ["MASTER_PORT"] = port  # a new rendezvous, as a new launch would have
        if status := main(flags):
            return status
        held.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
    if any(second > first for first, second in zip(*held)):
        print(f"(threads, open files) after each run: {held}", file=sys.stderr)
        return 1
    return 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_second_run_in_the_same_process_holds_no_more_threads(tmp_path):
    args = MODEL + cli(train_iters=2, tensor_model_parallel_size=2)
    job = run_job(
        [str(free_port()), *args],
        nproc=2,
        entry="tests.dist.test_training_features:two_runs_job",
        timeout_s=300,
    )
    assert job.status == 0, job.describe()
