"""A loss that blows up while staying finite: the run says, when the loss rises far above its
best and at every save made during the rise, which checkpoint is the last one saved before it."""

from __future__ import annotations

import logging

from memo_ext.training.control import LossWatch


def watched(losses, *, saves=(), save_dir="ckpt", saved_at=None):
    watch = LossWatch(save_dir=save_dir, saved_at=saved_at)
    for iteration, loss in enumerate(losses, start=1):
        watch.step(iteration, loss)
        if iteration in saves:
            watch.saved(iteration)
    return watch


def test_a_rise_names_the_last_checkpoint_saved_before_it(caplog):
    caplog.set_level(logging.INFO, logger="memo_ext.training.control")
    # best 3.0 at step 3; 4.9 is within the margin (1.5), 6.2 is far above it
    watch = watched([5.0, 4.0, 3.0, 3.4, 6.2, 5.9, 6.4], saves={2, 4, 6})
    assert watch.good_save == 4 and watch.rose_at == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("iteration 5: the loss 6.2000 is far above its best, 3.0000 at")
    assert "the last checkpoint saved before the rise is iteration 4 in ckpt" in lines[0]
    assert lines[1].startswith("saved iteration 6 during the rise: ")
    assert watch.closing_note().startswith("at the end: the loss 6.4000 is far above")


def test_noise_within_the_margin_says_nothing_and_every_save_is_good(caplog):
    caplog.set_level(logging.INFO, logger="memo_ext.training.control")
    watch = watched([4.0, 3.5, 4.4, 3.2, 3.9, 3.1], saves={2, 3, 4, 6})
    assert caplog.records == [] and watch.closing_note() is None
    assert watch.good_save == 6


def test_the_loss_counts_as_back_only_within_half_the_margin(caplog):
    # best 2.0, margin 1.0: 3.4 is no longer "far", but not back either (2.5 is)
    watch = watched([2.0, 3.5, 3.4, 2.4], saves={3, 4})
    assert watch.rose_at is None and watch.good_save == 4
    watch = watched([2.0, 3.5, 3.4], saves={3})
    assert watch.rose_at == 2 and watch.good_save is None
    assert "no checkpoint was saved before the rise" in watch.closing_note()


def test_a_resumed_runs_checkpoint_is_the_good_one_until_it_saves_again():
    watch = watched([3.0, 9.0], saved_at=100)
    assert "the last checkpoint saved before the rise is iteration 100" in watch.closing_note()


def test_non_finite_losses_are_left_to_check_finite():
    watch = watched([3.0, float("nan"), float("inf"), 3.1])
    assert watch.rose_at is None and watch.best == 3.0


def test_the_checkpoint_a_divergence_points_at_resumes_to_a_finite_loss(tmp_path):
    """Step N's NaN came from the weights saved after step N - 1: the hint names an earlier
    checkpoint, and how to resume from it, or says there is none."""
    from types import SimpleNamespace

    from memo_ext.training.control import _last_good_checkpoint_hint

    save = tmp_path / "ckpt"
    run = SimpleNamespace(checkpoint=SimpleNamespace(save=str(save), load=None))
    assert "no checkpoint was saved" in _last_good_checkpoint_hint(run, 5)
    for k in (2, 4):
        (save / f"iter_{k:07d}").mkdir(parents=True)
        (save / f"iter_{k:07d}" / "manifest.json").write_text("{}")
    (save / "iter_0000005.tmp").mkdir()  # a save being written is no checkpoint
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert _last_good_checkpoint_hint(run, 6) == (
        f"the last good checkpoint is iteration 4 in {save} (resume with --load {save}, e.g. "
        "with a lower --lr)"
    )
    hint = _last_good_checkpoint_hint(run, 5)
    assert hint.startswith(f"the latest checkpoint in {save}, iteration 4, holds the weights")
    assert f"the last good one is iteration 2 (resume from it: write 2 to {save}/" in hint
    assert "no earlier one was kept" in _last_good_checkpoint_hint(run, 3)
