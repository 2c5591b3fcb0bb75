"""Megatron-LM's schedule flags: sample-based training, warm-up fraction, WSD, weight-decay
increase, batch ramp-up and decoupled LR, checked against Megatron-LM's formulas written out
here independently (and megatron-core's own parameter groups)."""

from __future__ import annotations

import math

import pytest

from memo_ext.arguments import parse_args
from memo_ext.errors import UsageError
from memo_ext.training.optimizer import (
    build_lr_scheduler,
    build_optimizer,
    lr_for_logging,
    schedule_steps,
)
from tests.launch import cli
from tests.models import ddp_wrapped

MODEL = cli(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    seq_length=128,
    micro_batch_size=2,
    lr="1e-3",
    mock_data=True,
)
"""SMALL_GPT without a training length."""


def parse(*extra: str, world_size: int = 1):
    return parse_args([*MODEL, *extra], world_size=world_size)


def megatron_train_iters(train_samples: int, gbs: int, ramp: tuple[int, int, int] | None):
    """Megatron-LM's ``update_train_iters`` written out: (steps, batch of each step)."""
    if ramp is None:
        return [gbs] * (train_samples // gbs)
    start, incr, ramp_samples = ramp
    per_increment = ramp_samples / ((gbs - start) // incr)
    batches, consumed = [], 0
    while consumed <= ramp_samples and consumed <= train_samples:
        batches.append(start + int(consumed / per_increment) * incr)
        consumed += batches[-1]
    if train_samples > consumed:
        batches += [gbs] * ((train_samples - consumed) // gbs)
    return batches


def megatron_lr(n: float, *, lr, min_lr, warmup, decay, style, wsd=None, wsd_style=None):
    """Megatron-LM's rate after ``n`` scheduler steps (warm-up from 0), written out."""
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if style == "constant":
        return lr
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: hold, then anneal over the last ``wsd`` steps
        anneal = (n - (decay - wsd)) / wsd
        coeff = (
            1.0
            if n <= decay - wsd
            else {"linear": 1.0 - anneal, "minus_sqrt": 1.0 - anneal**0.5}[wsd_style]
        )
    return min_lr + coeff * (lr - min_lr)


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        ([], 1, "give exactly one of --train-iters"),
        (cli(train_iters=4, train_samples=8), 1, "give exactly one of --train-iters"),
        (cli(train_samples=8, lr_warmup_iters=2), 1, "--lr-warmup-iters count optimizer steps"),
        (
            cli(train_samples=8, lr_decay_iters=6, lr_wsd_decay_iters=2),
            1,
            "--lr-decay-iters, --lr-wsd-decay-iters count optimizer steps",
        ),
        (cli(train_iters=4, lr_decay_samples=8), 1, "--lr-decay-samples count samples"),
        (cli(train_iters=4, lr_warmup_samples=2), 1, "need --train-samples instead"),
        (cli(train_iters=4, rampup_batch_size=[2, 2, 8]), 1, "--rampup-batch-size count samples"),
        (
            cli(train_iters=4, lr_warmup_iters=1, lr_warmup_fraction=0.1),
            1,
            "--lr-warmup-fraction and --lr-warmup-iters are exclusive",
        ),
        (
            cli(train_samples=8, lr_warmup_samples=1, lr_warmup_fraction=0.1),
            1,
            "--lr-warmup-fraction and --lr-warmup-samples are exclusive",
        ),
        (cli(train_iters=4, lr_warmup_fraction=1.0), 1, "--lr-warmup-fraction must be in [0, 1)"),
        (cli(train_samples=8, lr_warmup_samples=9), 1, "--lr-warmup-samples 9 must be in [0,"),
        (
            cli(train_samples=8, lr_warmup_samples=4, lr_decay_samples=4),
            1,
            "--lr-decay-samples 4 must be larger than --lr-warmup-samples 4",
        ),
        (cli(train_samples=1, global_batch_size=2), 1, "less than one global batch (2)"),
        (cli(train_iters=4, lr_decay_style="WSD"), 1, "needs --lr-wsd-decay-iters"),
        (cli(train_samples=8, lr_decay_style="WSD"), 1, "needs --lr-wsd-decay-samples"),
        (cli(train_iters=4, lr_wsd_decay_iters=2), 1, "apply only with --lr-decay-style WSD"),
        (
            cli(train_iters=4, lr_wsd_decay_style="linear"),
            1,
            "apply only with --lr-decay-style WSD",
        ),
        (
            cli(train_iters=4, start_weight_decay=0.0, end_weight_decay=0.1),
            1,
            "need --weight-decay-incr-style linear or cosine",
        ),
        (
            cli(train_iters=4, weight_decay_incr_style="linear", start_weight_decay=0.1),
            1,
            "needs --start-weight-decay and --end-weight-decay",
        ),
        (
            cli(
                train_iters=4,
                weight_decay_incr_style="cosine",
                start_weight_decay=0.2,
                end_weight_decay=0.1,
            ),
            1,
            "only increases it",
        ),
        (cli(train_iters=4, decoupled_min_lr=1e-4), 1, "--decoupled-min-lr applies only with"),
        (
            cli(train_iters=4, decoupled_lr=1e-4, decoupled_min_lr=2e-4),
            1,
            "need 0 <= --decoupled-min-lr <= --decoupled-lr",
        ),
        (
            cli(train_iters=4, decoupled_lr=1e-4, min_lr=5e-4),
            1,
            "--decoupled-min-lr defaults to --min-lr",
        ),
        (
            cli(train_samples=40, global_batch_size=8, rampup_batch_size=[2, 2]),
            1,
            "takes three positive numbers, START INCR SAMPLES, got 2 2",
        ),
        (
            cli(train_samples=40, global_batch_size=8, rampup_batch_size=[8, 2, 16]),
            1,
            "must climb from START 8 to --global-batch-size 8",
        ),
        (
            cli(train_samples=40, global_batch_size=8, rampup_batch_size=[2, 4, 16]),
            1,
            "8 - 2 a multiple of 4",
        ),
        (
            cli(train_samples=40, global_batch_size=8, rampup_batch_size=[2, 2, 16]),
            2,
            "START 2 and INCR 2 must be multiples of --micro-batch-size × DP = 2×2",
        ),
        (
            cli(train_samples=40, micro_batch_size=1, global_batch_size=8)
            + cli(rampup_batch_size=[2, 2, 16], variable_seq_lengths=True),
            1,
            "--variable-seq-lengths does not support --rampup-batch-size",
        ),
        (
            cli(train_samples=40, micro_batch_size=1, global_batch_size=8)
            + cli(rampup_batch_size=[2, 2, 16], variable_seq_lengths=True, hotspa=True),
            2,
            "--variable-seq-lengths does not support --rampup-batch-size",
        ),
    ],
)
def test_megatron_schedule_flags_are_refused_in_one_sentence(extra, world_size, message):
    with pytest.raises(UsageError) as err:
        parse(*extra, world_size=world_size)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("train_samples", "gbs", "ramp"),
    [
        (40, 6, None),  # a partial last batch is dropped
        (40, 6, (2, 2, 12)),
        (50, 8, (2, 2, 20)),  # ramp samples not a multiple of any batch
        (10, 6, (2, 2, 30)),  # the run ends inside the ramp
        (64, 16, (4, 4, 60)),
    ],
)
def test_train_iters_derived_from_samples_as_megatron_lm(train_samples, gbs, ramp):
    flags = cli(train_samples=train_samples, global_batch_size=gbs)
    if ramp:
        flags += cli(rampup_batch_size=list(ramp))
    train = parse(*flags).train
    batches = megatron_train_iters(train_samples, gbs, ramp)
    assert train.train_iters == len(batches) and train.iters_from_samples
    assert train.total_train_samples == max(train_samples, sum(batches))


def test_ramp_steps_by_hand():
    # START 2, INCR 2, 12 samples to reach 6: 2 increments of 6 samples each; the batch is
    # 2 below 6 consumed samples, 4 below 12, 6 from the first step that starts past 12
    train = parse(*cli(train_samples=40, global_batch_size=6, rampup_batch_size=[2, 2, 12])).train
    assert megatron_train_iters(40, 6, (2, 2, 12)) == [2, 2, 2, 4, 4, 6, 6, 6, 6]
    assert (train.train_iters, train.total_train_samples) == (9, 40)


def test_a_parsed_sample_based_run_passes_its_checks_again():
    run = parse(*cli(train_samples=40, global_batch_size=6, rampup_batch_size=[2, 2, 12]))
    run.check()  # train_iters was filled in, --train-samples was given: still one of them
    assert run.train.sample_based and run.num_microbatches == 3


def test_iteration_based_run_is_unchanged():
    train = parse(*cli(train_iters=10)).train
    assert (train.train_iters, train.sample_based, train.iters_from_samples) == (10, False, False)
    assert train.total_train_samples == 10 * 2
    steps = schedule_steps(train)
    assert (steps.warmup, steps.decay, steps.weight_decay, steps.wsd_anneal) == (0, 10, 10, None)


# ---------------------------------------------------------------------------------------------
# the schedule megatron-core's scheduler follows
# ---------------------------------------------------------------------------------------------


class _Groups:
    """What OptimizerParamScheduler needs of an optimizer."""

    def __init__(self):
        self.param_groups = [{"default_config": True}]


def _rates(train, counts: list[int]) -> list[float]:
    """The scheduler's rate after each of ``counts`` (cumulative scheduler steps)."""
    groups = _Groups()
    scheduler = build_lr_scheduler(optimizer=groups, train=train)
    rates, done = [], 0
    for count in counts:
        scheduler.step(increment=count - done)
        done = count
        rates.append(groups.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_sample_based_warmup_fraction_follows_megatron(style):
    train = parse(
        *cli(
            train_samples=44,
            global_batch_size=4,
            lr_decay_samples=40,
            lr_warmup_fraction=0.3,
            lr_decay_style=style,
            min_lr="1e-4",
        )
    ).train
    steps = schedule_steps(train)
    assert (steps.warmup, steps.decay, steps.weight_decay) == (pytest.approx(12.0), 40, 44)
    counts = [4 * k for k in range(12)]  # samples before each of the 11 steps, and after
    expected = [
        megatron_lr(n, lr=1e-3, min_lr=1e-4, warmup=0.3 * 40, decay=40, style=style) for n in counts
    ]
    # both sides evaluate the same float expressions in the same order
    assert _rates(train, counts) == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    ("unit_flags", "counts", "scale"),
    [
        (cli(train_iters=20, lr_warmup_iters=2, lr_wsd_decay_iters=5), list(range(22)), 1),
        (
            cli(train_samples=80, global_batch_size=4, lr_warmup_samples=8)
            + cli(lr_wsd_decay_samples=20),
            [4 * k for k in range(22)],
            4,
        ),
    ],
    ids=["iterations", "samples"],
)
@pytest.mark.parametrize("wsd_style", ["linear", "minus_sqrt"])
def test_wsd_holds_then_anneals(unit_flags, counts, scale, wsd_style):
    train = parse(
        *unit_flags, *cli(lr_decay_style="WSD", lr_wsd_decay_style=wsd_style, min_lr="1e-4")
    ).train
    expected = [
        megatron_lr(
            n,
            lr=1e-3,
            min_lr=1e-4,
            warmup=2 * scale,
            decay=20 * scale,
            style="WSD",
            wsd=5 * scale,
            wsd_style=wsd_style,
        )
        for n in counts
    ]
    rates = _rates(train, counts)
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)
    assert rates[10] == pytest.approx(1e-3) and rates[20] == pytest.approx(1e-4)  # hold, end


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_grows_from_start_to_end(style):
    train = parse(
        *cli(train_samples=40, global_batch_size=4, weight_decay_incr_style=style),
        *cli(start_weight_decay=0.0, end_weight_decay=0.1),
    ).train
    groups = _Groups()
    groups.param_groups.append({"wd_mult": 0.0})
    scheduler = build_lr_scheduler(optimizer=groups, train=train)
    seen = []
    for _ in range(10):
        seen.append(
            (groups.param_groups[0]["weight_decay"], groups.param_groups[1]["weight_decay"])
        )
        scheduler.step(increment=4)
    for k, (decayed, skipped) in enumerate(seen):
        ratio = 4 * k / 40
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        assert decayed == pytest.approx(0.1 * coeff, rel=1e-12, abs=1e-15)
        assert skipped == 0.0  # biases and norms are never decayed


# ---------------------------------------------------------------------------------------------
# decoupled learning rate
# ---------------------------------------------------------------------------------------------


def _tiny_gpt():
    from tests.models import LLAMA_TINY, build_gpt, cpu_config

    return build_gpt(cpu_config(LLAMA_TINY), vocab_size=64, max_positions=16)


def test_decoupled_lr_groups_are_the_embedding_and_output_weights(megatron_cpu):
    model = ddp_wrapped(_tiny_gpt())
    train = parse(
        *cli(train_iters=10, lr_warmup_iters=2, decoupled_lr="3e-3", decoupled_min_lr="3e-4")
    ).train
    groups = build_optimizer(model_chunks=[model], train=train, bf16=False, fp16=False).param_groups
    decoupled = [g for g in groups if g.get("max_lr") == 3e-3]
    names = {id(p): n for n, p in model.module.named_parameters()}
    assert sorted(names[id(p)] for g in decoupled for p in g["params"]) == [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ]
    assert all(g["min_lr"] == 3e-4 and not g["default_config"] for g in decoupled)
    assert all(g["max_lr"] == 1e-3 for g in groups if g not in decoupled)


def test_decoupled_lr_follows_the_schedule_with_its_own_peak(megatron_cpu):
    model = ddp_wrapped(_tiny_gpt())
    train = parse(
        *cli(train_iters=10, lr_warmup_iters=2, decoupled_lr="3e-3", decoupled_min_lr="3e-4")
    ).train
    optimizer = build_optimizer(model_chunks=[model], train=train, bf16=False, fp16=False)
    scheduler = build_lr_scheduler(optimizer=optimizer, train=train)
    decoupled = next(g for g in optimizer.param_groups if not g["default_config"])
    for n in range(12):
        base = megatron_lr(n, lr=1e-3, min_lr=0.0, warmup=2, decay=10, style="linear")
        own = megatron_lr(n, lr=3e-3, min_lr=3e-4, warmup=2, decay=10, style="linear")
        assert lr_for_logging(optimizer.param_groups) == pytest.approx(base, rel=1e-12, abs=0)
        assert decoupled["lr"] == pytest.approx(own, rel=1e-12, abs=0)
        scheduler.step(increment=1)


def test_a_checkpoint_past_the_derived_steps_is_refused(tmp_path):
    from memo_ext.training.control import check_resumable

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("11\n")
    run = parse(*cli(train_samples=40, global_batch_size=4, load=tmp_path))
    with pytest.raises(UsageError) as err:
        check_resumable(run)
    assert "at iteration 11, past the 10 steps of --train-samples 40" in str(err.value)
    assert "raise --train-samples" in str(err.value)


# ---- --step-batch-size-schedule (Megatron-LM's step-wise global batch) -----------------------


def test_step_schedule_parses_token_thresholds():
    from memo_ext.config.train import batch_at, parse_step_schedule

    schedule = parse_step_schedule("0:768 250B:1536 0.5T:3072")
    assert schedule == ((0, 768), (250 * 10**9, 1536), (5 * 10**11, 3072))
    # seq 2048: 250B tokens are 122,070,312.5 samples
    assert batch_at(schedule, 122_070_312, 2048) == 768
    assert batch_at(schedule, 122_070_313, 2048) == 1536
    for bad, words in (
        ("10:2 20:4", "first threshold must be 0"),
        ("0:2 5K:4 3K:8", "thresholds must increase"),
        ("0:2 x", "THRESHOLD:BATCH"),
        ("0:0", "batch >= 1"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_step_schedule(bad)


def test_step_schedule_derives_steps_and_the_global_batch():
    # seq 128: the batch becomes 4 once 1K tokens are trained (after 8 samples: 1,024 tokens)
    run = parse(*cli(train_samples=20, step_batch_size_schedule="0:2 1K:4", micro_batch_size=1))
    assert run.train.global_batch_size == 4  # the largest batch
    assert run.train.train_iters == 7  # 2, 2, 2, 2 (8 samples), then 4, 4, 4 (20)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(train_iters=5), "need --train-samples instead of --train-iters"),
        (dict(train_samples=20, rampup_batch_size=[2, 2, 8]), "give one"),
        (dict(train_samples=20, global_batch_size=2), "differs from the largest batch"),
        (dict(train_samples=20, micro_batch_size=3), "not divisible by --micro-batch-size"),
        (dict(train_samples=20, step_batch_size_schedule="1:2"), "first threshold must be 0"),
    ],
)
def test_step_schedule_refusals_are_one_sentence(extra, message):
    flags = {"step_batch_size_schedule": "0:2 1K:4", "micro_batch_size": 1, **extra}
    with pytest.raises(UsageError, match=message) as err:
        parse(*cli(**flags))
    assert "\n" not in str(err.value)
