"""The tools that read a model from flags take the training command as it is: the trainer's
flags they do not use are named and ignored; anything else is one sentence, exit 2."""

from __future__ import annotations

import logging

import pytest

from memo_ext.arguments import parse_tool_args
from memo_ext.errors import UsageError
from tools import memory_report, plan_memory

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_the_trainer_s_flags_are_ignored_by_name(caplog):
    trainer_only = ["--max-position-embeddings", "4096", "--lr", "1e-3", "--log-throughput"]
    argv = [*MODEL, "--seq-length", "128", *trainer_only, "--lr-decay-style=cosine"]
    with caplog.at_level(logging.WARNING):
        args = parse_tool_args(memory_report.build_parser(), argv, tool="memory_report")
    assert getattr(args, "data.seq_length") == 128
    assert (
        "memory_report: ignoring the trainer's --max-position-embeddings, --lr, "
        "--log-throughput, --lr-decay-style" in caplog.text
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*MODEL, "--seq-length", "128", "--bogus", "3"], "unrecognized arguments: --bogus 3"),
        (["--num-layers", "2"], "the following arguments are required"),
        ([*MODEL, "--seq-length", "many"], "argument --seq-length: invalid int value"),
    ],
)
def test_other_flags_are_one_sentence(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_tool_args(memory_report.build_parser(), argv, tool="memory_report")


def test_the_tools_report_it_as_exit_2_without_a_usage_dump(tmp_path, capsys):
    assert memory_report.main(["--num-layers", "2"]) == 2
    assert plan_memory.main(["--out", str(tmp_path / "p.json"), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 2
