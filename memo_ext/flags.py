"""Command-line flags generated from frozen config dataclasses.

Every flag of the trainer and of the tools is a field of a dataclass, and only there:

- its spelling is the field's name (``micro_batch_size`` → ``--micro-batch-size``, after the
  section's flag prefix, ``alpha`` of MEMO → ``--memo-alpha``) unless ``metadata["flag"]`` spells it
  (``--tensor-model-parallel-size``);
- its help is the docstring under the field, its default the field's default, and a field with
  no default is a required flag;
- its type sets how the text is read: ``int``, ``float`` (finite: ``nan`` and ``inf`` are
  refused, :func:`finite_float`), ``str``, ``X | None``, ``Literal[...]``
  (the choices), ``list[X]`` (several values), ``bool`` (a switch: ``--x`` turns on a field that
  defaults off; a field that defaults on is turned off by ``--no-x``, or by the flag its metadata
  names, e.g. ``--disable-bias-linear``).

A dataclass may name its flag prefix in a ``FLAG_PREFIX`` class variable. Field metadata keys:
``flag`` (spelling), ``cli`` (``False``: not a flag, a derived or internal
value), ``parse`` (a ``str -> value`` function for argparse), ``choices``, ``metavar``,
``negatable`` (a switch with both ``--x`` and ``--no-x``), ``requires`` (a switch that must come
with the flag, as Megatron-LM's ``--group-query-attention`` with ``--num-query-groups``:
:func:`argv_of` writes it before the flag).

:func:`add_flags` adds a dataclass's flags to a parser (or group), :func:`from_flags` builds the
dataclass back from the parsed namespace. With ``overrides=True`` every flag is optional and
defaults to ``None`` (tools that start from a preset and change only what is given);
:func:`overrides_from_flags` then returns just the given values.

This module imports nothing else from the package.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import textwrap
import types
import typing
from typing import Any, Literal

METADATA_KEYS = frozenset({"flag", "cli", "parse", "choices", "metavar", "negatable", "requires"})
"""Field metadata this module reads; anything else in a field's metadata is a mistake."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (and of its dataclass bases), one line each."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def cli_fields(cls: type, only: tuple[str, ...] | None = None) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, in declaration order; ``only`` names the fields to
    take instead (a tool that needs a few of a section's flags, or a non-flag field)."""
    if only is not None:
        return [f for f in dataclasses.fields(cls) if f.name in only]
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("cli", True)]


def flag_name(f: dataclasses.Field, *, prefix: str | None = None) -> str:
    """The flag that sets ``f`` (a switch that defaults on is spelled ``--no-...``)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    words = f.name.replace("_", "-")
    if prefix:
        words = f"{prefix}-{words}"
    if f.default is True and not f.metadata.get("negatable"):  # a switch that defaults on
        return f"--no-{words}"
    return f"--{words}"


def argv_of(config: object, *, only: tuple[str, ...] | None = None) -> list[str]:
    """The flags that give ``config`` (a section instance) its values: one per field that
    differs from its default, in declaration order (``only``: these fields)."""
    argv: list[str] = []
    for f in cli_fields(type(config), only):
        value = getattr(config, f.name)
        if value == _default(f) or (value is None and f.default is dataclasses.MISSING):
            continue
        if isinstance(value, bool):
            if f.metadata.get("negatable") and not value:
                argv.append("--no-" + flag_name(f)[2:])
            else:
                argv.append(flag_name(f))
        elif isinstance(value, (tuple, list)):
            argv += [flag_name(f), *map(str, value)] if value else []
        else:
            argv += [*_required_switches(f), flag_name(f), str(value)]
    return argv


def _required_switches(f: dataclasses.Field) -> list[str]:
    required = f.metadata.get("requires")
    return [required] if required else []


def closest_flag(name: str, known) -> str | None:
    """The flag of ``known`` that ``name`` most likely misspells (``--hiden-size`` →
    ``--hidden-size``), or None when none is close."""
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return matches[0] if matches else None


def unknown_flag_message(name: str, known) -> str:
    """``unrecognized flag --x`` with the closest of ``known`` as a suggestion."""
    close = closest_flag(name, known)
    return f"unrecognized flag {name}" + (f"; did you mean {close}?" if close else "")


class SpellCheckedParser(argparse.ArgumentParser):
    """argparse that names a misspelt flag first (``unrecognized flag --hiden-size; did you mean
    --hidden-size?``), where plain argparse reports the required flag it then misses."""

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        known = set(_option_strings(self))
        for token in argv:
            if token == "--":
                break
            name = token.partition("=")[0]
            if name.startswith("--") and name not in known:
                self.error(unknown_flag_message(name, known))
        return super().parse_args(argv, namespace)


class FlagHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each value flag's default, and each switch described by what it does.

    A switch is off unless given, so it shows no ``(default: ...)``. A switch that turns off
    what is on by default (``--no-load-optim``, ``--disable-bias-linear``) is documented under
    its field, whose docstring says the default behaviour and then, after ``; <flag>``, what the
    flag does: its help says which is which ("By default, ...; this flag ...").
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction):
            return super()._get_help_string(action)
        text = action.help or ""
        if isinstance(action, argparse._StoreFalseAction):
            for flag in action.option_strings:
                default, found, effect = text.partition(f"; {flag} ")
                if found:
                    return f"By default, {default[0].lower()}{default[1:]}; this flag {effect}"
        return text


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of its sub-commands' parsers."""
    names = list(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names += _option_strings(sub)
    return names


def _dest(section: str, f: dataclasses.Field) -> str:
    return f"{section}.{f.name}"


def _unwrap_optional(hint: Any) -> Any:
    """``X | None`` → ``X``; anything else unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _hint(cls: type, f: dataclasses.Field) -> Any:
    return _unwrap_optional(_type_hints(cls)[f.name])


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class (it compiles every annotation
    string of the class on each call: most of the parser's build time before)."""
    return typing.get_type_hints(cls)


def _is_switch(f: dataclasses.Field, cls: type) -> bool:
    return _hint(cls, f) is bool


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45
"""float32's largest finite number and smallest subnormal: a float flag lands in a float32
tensor (the learning rate in the optimizer's, a loss scale, an epsilon) as often as not."""


def finite_float(text: str) -> float:
    """A float flag's value: any number float32 holds (``nan``, ``inf`` are not one, and
    ``x <= 0`` is false for ``nan``, so every range check downstream would let it through;
    ``1e39`` is finite in Python but ``inf`` in a float32 tensor, ``1e-50`` is 0 there).

    Raises:
        argparse.ArgumentTypeError: naming the text.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_TINY:
        raise argparse.ArgumentTypeError(
            f"must be a finite number within float32's range (|x| <= 3.4e38, and 0 or at "
            f"least 1.4e-45), got {text!r}"
        )
    return value


def _value_options(cls: type, f: dataclasses.Field, name: str) -> dict:
    """argparse's type / choices / nargs / metavar for a non-switch field spelled ``name``."""
    hint, meta = _hint(cls, f), f.metadata
    options: dict[str, Any] = {}
    if typing.get_origin(hint) in (list, tuple) and "parse" not in meta:
        options["nargs"] = "*"
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is Literal:
        options["choices"] = typing.get_args(hint)
        hint = type(options["choices"][0])
    if "choices" in meta:
        options["choices"] = tuple(meta["choices"])
    reader = {int: int, float: finite_float}.get(hint, str)
    options["type"] = meta.get("parse", reader)
    if "choices" not in options:
        options["metavar"] = meta.get("metavar", name.lstrip("-").replace("-", "_").upper())
    return options


def _switch_options(f: dataclasses.Field, *, overrides: bool) -> dict:
    turns_off = f.default is True
    if f.metadata.get("negatable"):
        return {
            "action": argparse.BooleanOptionalAction,
            "default": None if overrides else f.default,
        }
    if overrides:
        return {"action": "store_const", "const": not turns_off, "default": None}
    if turns_off:
        return {"action": "store_false", "default": True}
    return {"action": "store_true", "default": False}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    section: str,
    prefix: str | None = None,
    overrides: bool = False,
    only: tuple[str, ...] | None = None,
) -> None:
    """Add one flag per field of ``cls`` (see the module docstring).

    Args:
        parser: a parser or an argument group of one.
        cls: the dataclass.
        section: namespace under which the values land (``args.<section>.<field>``); read them
            back with :func:`from_flags` using the same name.
        prefix: flag prefix of the section (``memo`` → ``--memo-alpha``).
        overrides: every flag optional with default ``None`` (only given values count).
        only: just these fields (see :func:`cli_fields`).
    """
    docs = field_docs(cls)
    prefix = prefix if prefix is not None else getattr(cls, "FLAG_PREFIX", None)
    for f in cli_fields(cls, only):
        unknown = set(f.metadata) - METADATA_KEYS
        if unknown:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")
        help_text = docs.get(f.name, "").replace("%", "%%")
        names = [flag_name(f, prefix=prefix)]
        if _is_switch(f, cls):
            options = _switch_options(f, overrides=overrides)
        else:
            options = _value_options(cls, f, names[0])
            default = _default(f)
            if overrides:
                options["default"] = None
            elif default is dataclasses.MISSING:
                options["required"] = True
            else:
                options["default"] = default
        parser.add_argument(*names, dest=_dest(section, f), help=help_text, **options)


def flag_values(
    cls: type, args: argparse.Namespace, *, section: str, only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags, by field name."""
    values = {}
    for f in cli_fields(cls, only):
        value = getattr(args, _dest(section, f))
        if typing.get_origin(_hint(cls, f)) is tuple and isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return values


def from_flags(
    cls: type,
    args: argparse.Namespace,
    *,
    section: str,
    only: tuple[str, ...] | None = None,
    **values: Any,
):
    """The ``cls`` instance of parsed flags; ``values`` set fields that are not flags."""
    return cls(**flag_values(cls, args, section=section, only=only), **values)


def overrides_from_flags(
    cls: type, args: argparse.Namespace, *, section: str, only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (``add_flags(..., overrides=True)``)."""
    values = flag_values(cls, args, section=section, only=only)
    return {name: value for name, value in values.items() if value is not None}
