"""Flags generated from the config dataclasses: one source for names, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from memo_ext.arguments import SECTIONS, build_parser, parse_args
from memo_ext.config import HotSPaConfig, MemoConfig, TrainConfig
from memo_ext.features.megatron import run_transformer_config
from memo_ext.flags import add_flags, cli_fields, field_docs, flag_name, overrides_from_flags
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape
from tests.launch import cli, run_tool

REQUIRED = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=64,
    micro_batch_size=1,
    train_iters=1,
    lr="0.1",
    mock_data=True,
)


def test_defaults_come_from_the_dataclasses():
    run = parse_args(REQUIRED, world_size=1)
    given = {("data", "mock_data"), ("train", "train_iters")}
    derived = given | {
        ("train", "global_batch_size"),
        ("model", "max_position_embeddings"),
        ("data", "split"),  # the default, settled by parse_args
    }
    for section, cls, _ in SECTIONS:
        value = getattr(run, section)
        for f in cli_fields(cls):
            if (section, f.name) in derived or f.default is dataclasses.MISSING:
                continue  # given, required, or filled from other flags
            assert getattr(value, f.name) == f.default, (section, f.name)


def test_every_flag_once_with_its_docstring_as_help():
    parser = build_parser()
    names = [name for a in parser._actions for name in a.option_strings if a.dest != "help"]
    assert len(names) == len(set(names))
    for _, cls, _ in SECTIONS:
        docs = field_docs(cls)
        for f in cli_fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_flag_spellings():
    fields = {f.name: f for f in dataclasses.fields(ParallelLayout)}
    assert flag_name(fields["tp"]) == "--tensor-model-parallel-size"
    memo = {f.name: f for f in dataclasses.fields(MemoConfig)}
    assert flag_name(memo["alpha"], prefix="memo") == "--memo-alpha"
    assert flag_name(memo["enabled"], prefix="memo") == "--memo"
    hot = {f.name: f for f in dataclasses.fields(HotSPaConfig)}
    assert flag_name(hot["backfill"], prefix="hotspa") == "--no-hotspa-backfill"
    shape = {f.name: f for f in dataclasses.fields(ModelShape)}
    assert flag_name(shape["add_bias_linear"]) == "--disable-bias-linear"


def test_switches_and_negatable_flags():
    run = parse_args(
        [*REQUIRED, "--disable-bias-linear", "--no-check-for-nan-in-loss-and-grad"], world_size=1
    )
    assert (
        run.shape.add_bias_linear is False and run_transformer_config(run).add_bias_linear is False
    )
    assert run.train.check_for_nan_in_loss_and_grad is False
    assert parse_args(REQUIRED, world_size=1).train.check_for_nan_in_loss_and_grad is True


def test_override_mode_returns_only_what_was_given():
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelShape, section="shape", overrides=True)
    add_flags(
        parser,
        TrainConfig,
        section="train",
        overrides=True,
        only=("micro_batch_size", "use_distributed_optimizer"),
    )
    args = parser.parse_args(
        ["--num-layers", "3", "--disable-bias-linear", "--no-use-distributed-optimizer"]
    )
    assert overrides_from_flags(ModelShape, args, section="shape") == {
        "num_layers": 3,
        "add_bias_linear": False,
    }
    only = ("micro_batch_size", "use_distributed_optimizer")
    assert overrides_from_flags(TrainConfig, args, section="train", only=only) == {
        "use_distributed_optimizer": False
    }


def test_unknown_metadata_is_refused():
    @dataclasses.dataclass
    class Bad:
        x: int = dataclasses.field(default=1, metadata={"flags": "--x"})
        """A typo'd metadata key."""

    with pytest.raises(TypeError, match="unknown flag metadata"):
        add_flags(argparse.ArgumentParser(), Bad, section="bad")


def _compare(tmp_path, reference: list[dict], other: list[dict], *extra: str):
    paths = []
    for name, records in (("a", reference), ("b", other)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(str(path))
    return run_tool("tools.compare_metrics", *paths, *extra)


@pytest.mark.slow
def test_compare_metrics_tool(tmp_path):
    run = [{"iteration": i, "loss": 5.0 - i, "grad_norm": 1.0 + i} for i in (1, 2, 3)]
    assert _compare(tmp_path, run, run).returncode == 0
    close = [{**r, "loss": r["loss"] * (1 + 1e-7)} for r in run]
    assert _compare(tmp_path, run, close, "--rtol", "1e-6").returncode == 0
    off = [*run[:2], {**run[2], "grad_norm": 4.5}]
    result = _compare(tmp_path, run, off, "--rtol", "1e-3")
    assert result.returncode == 1 and "iteration 3: grad_norm 4.5 vs reference 4.0" in result.stdout
    nan = [*run[:2], {**run[2], "loss": float("nan")}]
    assert _compare(tmp_path, run, nan).returncode == 1
    assert _compare(tmp_path, run, run[:2]).returncode == 1  # other iterations logged
    missing = run_tool("tools.compare_metrics", "nope.jsonl", "nope.jsonl")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_help_describes_each_switch_by_what_it_does():
    from memo_ext.arguments import build_parser

    entries: dict[str, str] = {}  # each option's help entry, on one line
    for line in build_parser().format_help().splitlines():
        if line.startswith("  -"):
            name, _, rest = line.strip().partition(" ")
            entries[name] = rest
        elif entries and line.startswith("    "):
            entries[name] += " " + line
    entries = {name: " ".join(text.split()) for name, text in entries.items()}
    # a switch is off unless given: no "(default: True)" under a flag that turns something off
    for flag in ("--disable-bias-linear", "--no-load-optim", "--skip-preflight", "--swiglu"):
        assert "(default:" not in entries[flag], (flag, entries[flag])
    assert entries["--no-load-optim"].startswith(
        "By default, on load, restore the optimizer's moments and the LR schedule; this flag "
        "starts both afresh"
    )
    assert entries["--disable-bias-linear"] == (
        "By default, biases in the linear layers; this flag drops them."
    )
    # value flags keep their defaults
    assert entries["--seed"] == "SEED Seed for weights, dropout and data order. (default: 1234)"
