"""Every float flag takes finite numbers only: ``nan`` passes any range check written as
``x <= 0`` and ``inf`` trains into a loss of nan far from the flag that caused it. The flags are
found by walking the parsers, not listed, so a new float flag is covered as it is added."""

from __future__ import annotations

import argparse
import importlib

import pytest

from memo_ext.arguments import build_parser, parse_args
from memo_ext.data.datasets import parse_blend
from memo_ext.errors import UsageError
from memo_ext.flags import finite_float

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--mock-data", "--train-iters", "2", "--micro-batch-size", "1",
    "--lr", "1e-3",
]  # fmt: skip

TOOLS = [
    "memo_ext.commands.estimate",
    "memo_ext.commands.memory_report",
    "memo_ext.commands.plan_memory",
    "memo_ext.commands.compare_methods",
    "memo_ext.commands.compare_metrics",
    "memo_ext.commands.summarize_metrics",
    "memo_ext.commands.preprocess_data",
    "memo_ext.commands.demo_corpus",
    "tools.flag_reference",
    "tools.megatron_flags",
    "memo_ext.benchmarks.hotspa_strategies",
    "memo_ext.benchmarks.memo_chunking",
    "memo_ext.benchmarks.planner_quality",
    "memo_ext.benchmarks.planner_suite",
    "memo_ext.benchmarks.planner_fragmentation",
    "memo_ext.benchmarks.planned_allocator",
    "memo_ext.benchmarks.paper_table",
]


def _float_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of every action that reads a number with a fraction."""
    flags = []
    for action in parser._actions:
        reads = action.type
        if reads in (float, finite_float) and action.option_strings:
            flags.append(action.option_strings[-1])
    return flags


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {"pretrain_gpt_memo": build_parser()}
    for name in TOOLS:
        module = importlib.import_module(name)
        build = getattr(module, "build_parser", None)
        if build is not None:
            parsers[name] = build()
    return parsers


def test_no_parser_reads_a_plain_float():
    """``type=float`` accepts nan and inf; ``finite_float`` is the one reader of floats."""
    plain = [
        f"{name} {action.option_strings[-1]}"
        for name, parser in _parsers().items()
        for action in parser._actions
        if action.type is float
    ]
    assert plain == []


def test_the_trainer_has_float_flags_to_check():
    assert len(_float_flags(build_parser())) >= 20


@pytest.mark.parametrize("flag", _float_flags(build_parser()))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "1e39", "-4e38", "1e-50"])
def test_every_float_flag_of_the_trainer_refuses_non_finite_values(flag, value):
    # 1e39 is finite in Python, inf in the float32 tensor a flag often lands in
    with pytest.raises(UsageError, match=f"argument {flag}: must be a finite number"):
        parse_args([*BASE, flag, value], world_size=1)


@pytest.mark.parametrize(
    "name, flag",
    [(name, flag) for name, parser in _parsers().items() if name != "pretrain_gpt_memo"
     for flag in _float_flags(parser)],
)  # fmt: skip
def test_every_float_flag_of_the_tools_refuses_nan(name, flag, capsys):
    parser = _parsers()[name]
    try:
        parser.parse_args([flag, "nan"])
    except SystemExit as stop:  # argparse's own error: status 2, the reason on stderr
        assert stop.code == 2
        message = capsys.readouterr().err
    except UsageError as err:  # the tools that report argparse's errors as one sentence
        message = str(err)
    else:
        pytest.fail(f"{name} accepted {flag} nan")
    assert f"argument {flag}: must be a finite number, got 'nan'" in message


def test_float32s_extremes_are_taken():
    assert finite_float("3.4e38") == 3.4e38 and finite_float("-1.5e-45") == -1.5e-45
    assert finite_float("0") == 0.0 and finite_float("-0.0") == 0.0


def test_the_trainer_reports_a_learning_rate_float32_cannot_hold_in_one_sentence():
    from tests.launch import train_fails

    line = train_fails([*BASE, "--lr", "1e39"], status=2)
    assert "argument --lr: must be a finite number within float32's range" in line


def test_memo_alpha_refuses_nan():
    with pytest.raises(UsageError, match="--memo-alpha: must be a number in"):
        parse_args([*BASE, "--memo", "--memo-alpha", "nan"], world_size=1)


@pytest.mark.parametrize("weight", ["nan", "inf"])
def test_a_blend_weight_must_be_finite(weight):
    with pytest.raises(ValueError, match="weights must be finite"):
        parse_blend([weight, "a", "1", "b"])


def test_a_negative_value_is_a_value_not_a_flag():
    """``--lr -1e-3`` reaches the learning rate's own check (argparse alone would read
    ``-1e-3`` as a flag and say the value is missing)."""
    with pytest.raises(UsageError, match=r"--seed must be in \[0, 2\*\*32\).*got -1"):
        parse_args([*BASE, "--seed", "-1"], world_size=1)
    with pytest.raises(UsageError, match="--lr"):
        parse_args([*BASE, "--lr", "-1e-3"], world_size=1)


@pytest.mark.parametrize(
    "flags, message",
    [
        # the anneal would start before the warm-up ends
        (
            ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "15", "--lr-warmup-iters", "10"],
            "--lr-wsd-decay-iters 15 is longer than the decay span after the warm-up",
        ),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30"], "--lr-wsd-decay-iters 30"),
        # W&B's run settings without a project would be dropped without a word
        (["--wandb-exp-name", "x"], "--wandb-exp-name applies only with --wandb-project"),
        (["--wandb-entity", "team"], "--wandb-entity applies only with --wandb-project"),
    ],
)
def test_settings_that_would_be_ignored_are_refused(flags, message):
    # 20 iterations: a 30-iteration anneal cannot fit, nor 15 after a 10-iteration warm-up
    with pytest.raises(UsageError, match=message):
        parse_args([*BASE, "--train-iters", "20", *flags], world_size=1)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--train-iters", "99999999999999999999"], "--train-iters 99999999999999999999 makes"),
        (["--eval-interval", "1", "--eval-iters", str(2**62)], f"--eval-iters {2**62} makes"),
    ],
)
def test_counts_past_64_bits_are_refused_before_any_index_is_built(flags, named):
    with pytest.raises(UsageError, match=f"{named} .* past the 64-bit counts"):
        parse_args([*BASE, *flags], world_size=1)


def test_a_sample_index_larger_than_the_machine_is_refused_before_it_is_built(monkeypatch):
    """megatron-core builds the index of every sample of the run before the first step: a count
    within 64 bits whose index outgrows the free memory (it would swap for hours, or be killed)
    is refused with the bytes; a count that fits passes."""
    import memo_ext.config.run as run_module

    monkeypatch.setattr(run_module, "available_host_memory_bytes", lambda: 2**30)
    steps = 2**30 // run_module.INDEX_BYTES_PER_SAMPLE  # one sample per step (BASE's batch)
    parse_args([*BASE, "--train-iters", str(steps // 2)], world_size=1)
    with pytest.raises(UsageError, match=r"indexes every one .* the 1 GiB this machine has free"):
        parse_args([*BASE, "--train-iters", str(steps * 2)], world_size=1)
