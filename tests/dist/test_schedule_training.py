"""Megatron-LM's sample-based schedules in real training runs: the rate and the global batch of
every logged step follow Megatron-LM's formulas (written out here), also across a resume."""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import TINY_LLAMA, cli, run_pretrain

pytestmark = pytest.mark.dist

MODEL = TINY_LLAMA + cli(lr="2e-3", min_lr="1e-4")


def cosine_lr(n: float, *, warmup: float, decay: float) -> float:
    """Megatron-LM's cosine schedule after ``n`` samples (warm-up from 0, lr 2e-3 → 1e-4)."""
    if n <= warmup:
        return 2e-3 * n / warmup
    if n > decay:
        return 1e-4
    ratio = (n - warmup) / (decay - warmup)
    return 1e-4 + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (2e-3 - 1e-4)


def test_sample_based_run_with_warmup_fraction(tmp_path):
    flags = cli(
        global_batch_size=4,
        train_samples=46,  # 11 whole batches; the last 2 samples are dropped
        lr_decay_samples=40,
        lr_warmup_fraction=0.3,
        lr_decay_style="cosine",
        decoupled_lr="5e-3",  # the embedding / output layer's: not the logged rate
        weight_decay_incr_style="linear",
        start_weight_decay=0.0,
        end_weight_decay=0.1,
    )
    records = run_pretrain(MODEL + flags, nproc=1, workdir=tmp_path, name="samples")
    assert [r["iteration"] for r in records] == list(range(1, 12))
    for r in records:
        before = 4 * (r["iteration"] - 1)  # samples the scheduler has counted before the step
        assert (r["global_batch_size"], r["consumed_samples"]) == (4, before + 4)
        expected = cosine_lr(before, warmup=0.3 * 40, decay=40)
        assert r["lr"] == pytest.approx(expected, rel=1e-12, abs=0), r["iteration"]


def ramp_batches(train_samples: int, gbs: int, start: int, incr: int, ramp: int) -> list[int]:
    """Each step's global batch under Megatron-LM's ramp-up, written out."""
    per_increment = ramp / ((gbs - start) // incr)
    batches, consumed = [], 0
    while consumed <= ramp and consumed <= train_samples:
        batches.append(start + int(consumed / per_increment) * incr)
        consumed += batches[-1]
    return batches + [gbs] * ((train_samples - consumed) // gbs)


def test_rampup_run_grows_the_batch_and_resumes_on_schedule(tmp_path):
    save = tmp_path / "ckpt"
    common = MODEL + cli(
        global_batch_size=6,
        rampup_batch_size=[2, 2, 12],
        train_samples=40,
        lr_warmup_samples=8,
        lr_decay_style="cosine",
        save=save,
    )
    head = run_pretrain(common + cli(exit_interval=4), nproc=1, workdir=tmp_path, name="head")
    assert head[-1]["iteration"] == 4
    # as Megatron-LM: a checkpoint when the batch first grows (before step 4), and at the exit
    assert (save / "iter_0000003").is_dir() and (save / "iter_0000004").is_dir()
    # the tail appends to the head's records, marked: a resumed run keeps them, a fresh one not
    marked = [json.dumps({**r, "head": True}) + "\n" for r in head]
    (tmp_path / "tail.jsonl").write_text("".join(marked))
    records = run_pretrain(
        common + cli(load=save), nproc=1, workdir=tmp_path, name="tail", own_keys=("head",)
    )
    assert [r["iteration"] for r in records if r.get("head")] == [1, 2, 3, 4]

    batches = ramp_batches(40, 6, start=2, incr=2, ramp=12)
    assert batches == [2, 2, 2, 4, 4, 6, 6, 6, 6]  # by hand: 2 below 6 samples, 4 below 12
    assert [r["iteration"] for r in records] == list(range(1, len(batches) + 1))
    consumed = 0
    for r, batch in zip(records, batches, strict=True):
        expected = cosine_lr(consumed, warmup=8, decay=40)
        consumed += batch
        assert (r["global_batch_size"], r["consumed_samples"]) == (batch, consumed)
        assert r["lr"] == pytest.approx(expected, rel=1e-12, abs=0), r["iteration"]
