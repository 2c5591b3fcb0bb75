"""The tools that read a model from flags take the training command as it is: the trainer's
flags they do not use are named and ignored; anything else is one sentence, exit 2."""

from __future__ import annotations

import pytest

from memo_ext.arguments import parse_tool_args
from memo_ext.commands import memory_report, plan_memory
from memo_ext.errors import UsageError

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_the_trainer_s_flags_are_ignored_by_name(capsys):
    trainer_only = ["--max-position-embeddings", "4096", "--lr", "1e-3", "--log-throughput"]
    argv = [*MODEL, "--seq-length", "128", *trainer_only, "--lr-decay-style=cosine"]
    args = parse_tool_args(memory_report.build_parser(), argv)
    assert getattr(args, "data.seq_length") == 128
    assert capsys.readouterr().err == (
        "memo-memory-report: ignoring the trainer's --max-position-embeddings, --lr, "
        "--log-throughput, --lr-decay-style\n"
    )


def test_megatron_lm_s_flags_that_the_trainer_takes_are_ignored_too(capsys):
    # scripts/gpt7b_*.sh run as written: a Megatron-LM flag the trainer accepts by translation
    argv = [*MODEL, "--no-create-attention-mask-in-dataloader", "--seq-length", "128"]
    args = parse_tool_args(memory_report.build_parser(), argv)
    assert getattr(args, "data.seq_length") == 128
    err = capsys.readouterr().err
    assert (
        err
        == "memo-memory-report: ignoring the trainer's --no-create-attention-mask-in-dataloader\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*MODEL, "--seq-length", "128", "--bogus", "3"], "unrecognized flag --bogus"),
        ([*MODEL, "--seq-length", "128", "9"], "unrecognized arguments: 9"),
        # a tool's own flag and the trainer's both count as suggestions
        ([*MODEL, "--seq-lenght", "128"], "--seq-lenght; did you mean --seq-length?"),
        ([*MODEL, "--seq-length", "128", "--lr-decay-stile", "x"], "did you mean --lr-decay-style"),
        (["--num-layers", "2"], "the following arguments are required"),
        ([*MODEL, "--seq-length", "many"], "argument --seq-length: invalid int value"),
    ],
)
def test_other_flags_are_one_sentence(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_tool_args(memory_report.build_parser(), argv)


def test_the_tools_report_it_as_exit_2_without_a_usage_dump(tmp_path, capsys):
    assert memory_report.main(["--num-layers", "2"]) == 2
    assert plan_memory.main(["--out", str(tmp_path / "p.json"), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 2


def test_estimate_json_is_alone_on_stdout(capsys):
    import json

    from memo_ext.commands import estimate

    argv = ["--model", "gpt-7b", "--gpus", "8", "--seq-length", "8192", "--method", "full"]
    assert estimate.main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)  # the whole of stdout is one JSON object
    assert record["seq_length"] == 8192
    assert "MFU" in err  # the table, on stderr
    assert estimate.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("MFU")  # without --json


def test_plan_memory_checks_its_plot_dependency_before_planning(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as Python knows
    argv = ["--model", "gpt-7b", "--seq-length", "1024", "--out", str(tmp_path / "p.json")]
    assert plan_memory.main([*argv, "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()  # stopped before planning


@pytest.mark.parametrize(
    "main, argv, suggested",
    [
        ("pretrain_gpt_memo", ["--num-layers", "2", "--hiden-size", "128"], "--hidden-size"),
        ("tools.estimate", ["--gpus", "8", "--seq-lenght", "4096"], "--seq-length"),
        ("tools.summarize_metrics", ["m.jsonl", "--require-los-drop", "1"], "--require-loss-drop"),
        ("tools.plan_memory", ["--out", "p.json", "--time-limt", "6"], "--time-limit"),
    ],
)
def test_a_misspelt_flag_is_named_with_the_closest_one(main, argv, suggested, capsys):
    # before argparse reports the required flag the misspelling leaves out
    import importlib

    try:
        status = importlib.import_module(main).main(argv)
    except SystemExit as stop:  # the tools whose parser exits itself
        status = stop.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert f"unrecognized flag {argv[-2]}; did you mean {suggested}?" in err
    assert "required" not in err and err.count("\n") == 0


def test_estimate_s_help_says_what_it_assumes_unless_told():
    from memo_ext.commands import estimate

    text = " ".join(estimate.build_parser().format_help().split())
    for assumed in (
        "(default: gpt-7b)",
        "GPUs in the job (default: 8)",
        "(default: a800-80g)",
        "GiB (default: 2048)",
        "none, full, selective, memo (default: memo)",
    ):
        assert assumed in text
