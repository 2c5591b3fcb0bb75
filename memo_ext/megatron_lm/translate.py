"""A command line written for Megatron-LM's ``pretrain_gpt.py`` → one for this trainer.

:func:`translate` runs before argparse sees the command line. It walks the flags in order, each
with the values that follow it, and keeps our own flags as they are (rewriting Megatron-LM's
spellings of their values, :data:`~.handling.VALUE_MAPS`); Megatron-LM's other flags are kept
out of argparse's way: dropped (``same``, ``no effect``: with a notice for the latter),
rewritten (``mapped``), or collected as refused. :meth:`Translation.check` then raises one
:class:`~memo_ext.errors.UsageError` that names every refused flag with its reason, so a user
fixes a script in one go. Flags unknown to both programs are left to argparse.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from memo_ext.errors import UsageError
from memo_ext.megatron_lm.flag_table import MegatronFlag, megatron_flags
from memo_ext.megatron_lm.handling import (
    LATER_FLAGS,
    VALUE_MAPS,
    VALUE_REASONS,
    Handling,
    NoEffectHere,
    Refuse,
    handling_of,
)


@dataclass(frozen=True)
class Refusal:
    """A flag (with its value where the value is what is refused) and why it cannot run."""

    flag: str
    reason: str


@dataclass
class Translation:
    """Our command line, what to tell the user about it, and what cannot run."""

    argv: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    """One line per flag accepted without effect or mapped onto ours."""
    refusals: list[Refusal] = field(default_factory=list)
    ambiguities: list[str] = field(default_factory=list)
    """Flags that would build another model here than in Megatron-LM: one sentence each, saying
    which flag to add."""

    def check(self) -> None:
        """Raise one :class:`UsageError` naming every refused flag and every ambiguity, if any."""
        lines = list(self.ambiguities)
        if self.refusals:
            count = len(self.refusals)
            head = f"{count} Megatron-LM flag{'s' if count > 1 else ''} cannot run here"
            lines.append(f"{head}; drop {'them' if count > 1 else 'it'}:")
            lines += [f"  {r.flag}: {r.reason}." for r in self.refusals]
        if lines:
            raise UsageError("\n".join(lines))


def lookup(name: str) -> MegatronFlag | None:
    """Megatron-LM's flag of this spelling (including flags newer than the list's commit)."""
    return megatron_flags().get(name) or LATER_FLAGS.get(name)


def split_flags(argv: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(tokens before the first flag, [(flag, the values that follow it)]).

    ``--flag=value`` counts as the flag followed by ``value``. A value is any token that does not
    start with ``--`` (so ``-1`` is a value) other than ``-h``.
    """
    leading: list[str] = []
    groups: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--") or token == "-h":
            name, eq, inline = token.partition("=")
            groups.append((name, [inline] if eq else []))
        elif groups:
            groups[-1][1].append(token)
        else:
            leading.append(token)
    return leading, groups


def translate(argv: list[str], *, ours: Mapping[str, argparse.Action]) -> Translation:
    """Translate ``argv``; ``ours`` maps each of this trainer's option strings to its action."""
    leading, groups = split_flags(argv)
    given = {name: values for name, values in groups}
    out = Translation(argv=list(leading))
    for name, values in groups:
        if name in ours:
            _ours(out, name, values, ours[name], given)
        elif (flag := lookup(name)) is not None:
            _megatron(out, flag, name, values, given, ours)
        else:  # neither ours nor Megatron-LM's: argparse reports it
            out.argv += [name, *values]
    _check_same_model(out, given)
    return out


def _check_same_model(out: Translation, given: Mapping[str, list[str]]) -> None:
    """Flags that Megatron-LM reads otherwise than they read alone: refused unless the flag
    that settles it is there, so one script builds one model in both programs."""
    if "--num-query-groups" in given and "--group-query-attention" not in given:
        groups = " ".join(given["--num-query-groups"])
        out.ambiguities.append(
            f"--num-query-groups {groups} needs --group-query-attention: Megatron-LM reads the "
            "number only with that switch (without it its model has one key/value head per "
            "query head); add --group-query-attention for grouped-query attention, or drop "
            "--num-query-groups for full multi-head attention."
        )


def _ours(
    out: Translation,
    name: str,
    values: list[str],
    action: argparse.Action,
    given: Mapping[str, list[str]],
) -> None:
    flag = lookup(name)
    megatron_choices = flag.choices if flag is not None and isinstance(flag.choices, tuple) else ()
    if name in VALUE_MAPS and len(values) == 1 and _needs_value_map(name, values[0], action):
        mapping = VALUE_MAPS[name]
        rewritten = mapping.rewrite(values, given)
        out.argv += rewritten
        out.notices.append(f"{name} {values[0]} → {' '.join(rewritten)}: {mapping.note}")
        return
    if (
        action.choices
        and len(values) == 1
        and values[0] not in action.choices
        and values[0] in megatron_choices
    ):
        reason = VALUE_REASONS.get(name, "not implemented here")
        # one line for the value: a flag that goes with it (--tokenizer-model with a refused
        # --tokenizer-type) is ours and is not refused, so it gets no line of its own
        out.refusals.append(Refusal(f"{name} {values[0]}", reason))
        return
    if action.nargs is None and len(values) == 1 and values[0].startswith("-"):
        # ``--lr -1e-3``: argparse reads a token starting with "-" as a flag unless it is glued
        out.argv.append(f"{name}={values[0]}")
        return
    out.argv += [name, *values]


def _needs_value_map(name: str, value: str, action: argparse.Action) -> bool:
    """A value spelled Megatron-LM's way that ours spells otherwise (``flash`` and ``auto`` are
    both programs' spellings and stay ours: flash attention on a machine without CUDA is refused
    in one sentence, as a precision flag is)."""
    return value not in (action.choices or ())


def _megatron(
    out: Translation,
    flag: MegatronFlag,
    name: str,
    values: list[str],
    given: Mapping[str, list[str]],
    ours: Mapping[str, argparse.Action],
) -> None:
    if flag.name in ours:  # another spelling of one of our flags
        out.argv += [flag.name, *values]
        return
    handling = handling_of(flag)
    stray: list[str] = []
    if flag.is_switch and values:  # not this flag's: argparse reports them as unrecognized
        values, stray = [], values
    elif not flag.is_switch and not values and flag.nargs != "*":
        out.refusals.append(Refusal(name, "expects a value"))
        return
    if handling is None:
        out.refusals.append(Refusal(name, "not supported here"))
    elif handling.status == "refused":
        if not flag.is_default(values):
            out.refusals.append(Refusal(name, handling.note))
    elif handling.status == "same":
        _same(out, flag, name, values, handling)
    elif handling.status == "mapped":
        try:
            rewritten = handling.rewrite(values, given)
        except Refuse as err:
            out.refusals.append(Refusal(name, str(err)))
            return
        except NoEffectHere as err:
            out.notices.append(f"{name} has no effect on this machine: {err}")
        else:
            out.argv += rewritten
            target = f" → {' '.join(rewritten)}" if rewritten else ""
            out.notices.append(f"{name}{target}: {handling.note}")
    else:  # no effect
        out.notices.append(f"{name} has no effect here: {handling.note}")
    out.argv += stray


def _same(
    out: Translation, flag: MegatronFlag, name: str, values: list[str], handling: Handling
) -> None:
    if handling.values is None or all(v in handling.values for v in values):
        return
    if flag.is_default(values):
        return
    out.refusals.append(Refusal(f"{name} {' '.join(values)}", handling.otherwise))
