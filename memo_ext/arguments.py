"""Megatron-style command-line flags → a checked :class:`~memo_ext.config.RunConfig`.

The flags are generated from the config dataclasses (``memo_ext.flags``), one argument group per
section; flag names follow Megatron-LM wherever Megatron has the concept, so launch scripts carry
over. :func:`parse_args` fills the defaults that depend on other flags (global batch, position
table, DP size), then runs every check before any process group, model or dataset exists: the
flags' (``RunConfig.check``), then the files they name (``memo_ext.data.input_files``). A bad value
fails with one sentence (:class:`~memo_ext.errors.UsageError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from memo_ext import config as c
from memo_ext import plugins
from memo_ext.config.train import parse_step_schedule
from memo_ext.data.input_files import check_inputs
from memo_ext.errors import UsageError
from memo_ext.features.feature import BUILT_IN, PLUGIN_FEATURES
from memo_ext.flags import (
    FlagHelpFormatter,
    SpellCheckedParser,
    add_flags,
    from_flags,
    unknown_flag_message,
)
from memo_ext.megatron_lm.translate import lookup, translate
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

logger = logging.getLogger(__name__)

SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("shape", ModelShape, "model"),
    ("model", c.ModelConfig, "model"),
    ("train", c.TrainConfig, "training"),
    ("cleanup", c.CleanupConfig, "training"),
    ("layout", ParallelLayout, "parallelism"),
    ("distributed", c.DistributedConfig, "parallelism"),
    *((feature.name, feature.config, feature.title) for feature in BUILT_IN),
    ("data", c.DataConfig, "data"),
    ("logging", c.LoggingConfig, "logging"),
    ("profile", c.ProfileConfig, "profiling"),
    ("evaluation", c.EvaluationConfig, "evaluation"),
    ("checkpoint", c.CheckpointConfig, "checkpointing"),
    ("preflight", c.PreflightConfig, "preflight"),
)
"""(RunConfig field, its dataclass, argument group), in the order ``--help`` lists them."""


def _sections() -> list[tuple[str, type, str]]:
    """:data:`SECTIONS`, then the sections of the features plugins registered."""
    return [*SECTIONS, *((f.name, f.config, f.title) for f in PLUGIN_FEATURES)]


class OneSentenceParser(SpellCheckedParser):
    """argparse, with its errors as one-sentence :class:`UsageError` (no usage dump) and a
    misspelt flag named with the closest one; the trainer's parser and the tools'."""

    def error(self, message: str):
        raise UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """The full flag set of ``pretrain_gpt_memo.py``."""
    parser = OneSentenceParser(
        description="GPT pretraining on megatron-core with MEMO and HotSPa.",
        formatter_class=FlagHelpFormatter,
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, cls, title in _sections():
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        add_flags(group, cls, section=section)
    plugins.add_flag(parser.add_argument_group("plugins"))
    return parser


def parse_args(
    argv: Sequence[str] | None = None, *, world_size: int | None = None, notices: bool = True
) -> c.RunConfig:
    """Parse and check flags; ``world_size`` defaults to torchrun's ``WORLD_SIZE``; without
    ``notices`` the notes on Megatron-LM flags are not logged (flags a tool wrote, not a user).

    A command line written for Megatron-LM's ``pretrain_gpt.py`` is translated first
    (``memo_ext.megatron_lm``): every Megatron-LM flag is ours, accepted, mapped onto ours, or
    refused by name, all refused flags in one message.

    Raises:
        UsageError: for any invalid value or combination, in one sentence.
    """
    parser = build_parser()
    translation = translate(
        list(sys.argv[1:] if argv is None else argv), ours=parser._option_string_actions
    )
    translation.check()
    for notice in translation.notices if notices else ():
        logger.info("Megatron-LM flag %s", notice)
    args = parser.parse_args(translation.argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    sections = {name: from_flags(cls, args, section=name) for name, cls, _ in SECTIONS}
    plugin_sections = tuple(
        (f.name, from_flags(f.config, args, section=f.name)) for f in PLUGIN_FEATURES
    )
    data = sections["data"]
    if data.vocab_file and data.merge_file and "--tokenizer-type" not in translation.argv:
        sections["data"] = dataclasses.replace(data, tokenizer_type="GPT2BPETokenizer")
    if getattr(args, "layout.sp") and sections["layout"].tp == 1:
        logger.warning("--sequence-parallel has no effect with TP = 1; turning it off")
    sections["layout"] = sections["layout"].with_world(world_size)
    run = c.RunConfig(
        **_with_derived_defaults(sections), plugin_sections=plugin_sections, world_size=world_size
    )
    run.check()
    data = check_inputs(
        run.data, evaluation=run.evaluation.enabled, calibration=run.preflight.calibration
    )
    run = dataclasses.replace(run, data=data)
    # a sample-based run's optimizer steps, derived once: every reader of train_iters sees them
    run = dataclasses.replace(run, train=run.train.with_derived_iters())
    if run.hotspa.enabled:
        hotspa = run.hotspa.parsed(
            seq_length=run.data.seq_length, world_size=world_size, shape=run.shape
        )
        run = dataclasses.replace(run, hotspa=hotspa)
    return run


def _with_derived_defaults(sections: dict) -> dict:
    """Defaults that depend on other flags: the global batch (mbs × DP, or the largest batch of
    --step-batch-size-schedule) and the position table (--seq-length)."""
    train, model, layout = sections["train"], sections["model"], sections["layout"]
    train = dataclasses.replace(train, seq_length_for_schedule=sections["data"].seq_length)
    if train.global_batch_size is None and train.step_batch_size_schedule is not None:
        try:
            schedule = parse_step_schedule(train.step_batch_size_schedule)
        except ValueError:
            schedule = None  # TrainConfig.check says what is wrong
        if schedule:
            train = dataclasses.replace(train, global_batch_size=max(b for _, b in schedule))
    sections["train"] = train
    if train.global_batch_size is None:
        gbs = train.micro_batch_size * layout.dp
        sections["train"] = dataclasses.replace(train, global_batch_size=gbs)
    if model.max_position_embeddings is None:
        seq = sections["data"].seq_length
        sections["model"] = dataclasses.replace(model, max_position_embeddings=seq)
    return sections


def parse_tool_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser``'s arguments from a command line that may also carry the trainer's flags: a
    tool that reads the model from flags takes the training command as it is, and says (under
    its ``prog``) which of the trainer's flags it ignores. Flags that are neither the tool's nor
    the trainer's are an error (argparse's, through ``parser``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer = build_parser()._option_string_actions
    known = [*parser._option_string_actions, *trainer]
    argv, megatron_lm = _without_megatron_lm_flags(argv, known)
    for token in argv:  # before argparse reports a required flag a misspelling left out
        name = token.partition("=")[0]
        if name.startswith("--") and name not in known:
            parser.error(unknown_flag_message(name, known))
    args, extra = parser.parse_known_args(argv)
    ignored, unknown, i = [], [], 0
    while i < len(extra):
        name, eq, _ = extra[i].partition("=")
        action = trainer.get(name)
        if action is None or not name.startswith("--"):
            unknown.append(extra[i])
            i += 1
            continue
        ignored.append(name)
        i += 1
        if not eq and action.nargs != 0:  # its values follow it
            while i < len(extra) and not extra[i].startswith("--"):
                i += 1
                if action.nargs is None:
                    break
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ignored += megatron_lm
    if ignored:
        print(
            f"{parser.prog}: ignoring the trainer's {', '.join(dict.fromkeys(ignored))}",
            file=sys.stderr,
        )
    return args


def _without_megatron_lm_flags(
    argv: list[str], known: Sequence[str]
) -> tuple[list[str], list[str]]:
    """``argv`` without the flags of Megatron-LM's ``pretrain_gpt.py`` that are neither the
    tool's nor the trainer's (``--no-create-attention-mask-in-dataloader`` in a script written
    for both programs), and those flags' names."""
    kept: list[str] = []
    dropped: list[str] = []
    skipping = False  # the values after a dropped flag, up to the next flag
    for token in argv:
        if token.startswith("--") or token == "-h":
            name = token.partition("=")[0]
            skipping = name not in known and lookup(name) is not None
            if skipping:
                dropped.append(name)
                continue
        elif skipping:
            continue
        kept.append(token)
    return kept, dropped
