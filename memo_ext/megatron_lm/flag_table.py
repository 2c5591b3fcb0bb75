"""Megatron-LM's flags, read from ``megatron_lm_flags.json``."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).with_name("megatron_lm_flags.json")
SWITCH_ACTIONS = frozenset({"store_true", "store_false", "argparse.BooleanOptionalAction"})


@dataclass(frozen=True)
class MegatronFlag:
    """One ``add_argument`` of Megatron-LM: its spellings and the shape of its value."""

    names: tuple[str, ...]
    """Every spelling, the main one first (a ``BooleanOptionalAction`` adds ``--no-...``)."""
    group: str
    """Megatron-LM's argument group (``network_size``, ``moe``, ...)."""
    action: str | None = None
    nargs: str | int | None = None
    type: str | None = None
    choices: tuple | dict | None = None
    """The literal choices, or ``{"expression": source text}`` where Megatron-LM computes them."""
    default: Any = None
    """The literal default, or ``{"expression": source text}`` where Megatron-LM computes it."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def is_switch(self) -> bool:
        return self.action in SWITCH_ACTIONS

    @property
    def takes_list(self) -> bool:
        return self.nargs in ("*", "+") or isinstance(self.nargs, int)

    def is_default(self, values: list[str]) -> bool:
        """Whether ``values`` (the command-line text) spell Megatron-LM's default of this flag."""
        if self.is_switch or self.default is None or isinstance(self.default, dict) or not values:
            return False
        default = self.default if isinstance(self.default, list) else [self.default]
        if len(default) != len(values):
            return False
        return all(_same_value(text, value, self.type) for text, value in zip(values, default))


def _same_value(text: str, value: Any, type_name: str | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    if type_name in ("int", "float") or isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value)


@functools.cache
def megatron_source() -> dict[str, str]:
    """Where the list comes from: repository, path and commit."""
    return json.loads(DATA_FILE.read_text())["source"]


@functools.cache
def megatron_flags() -> dict[str, MegatronFlag]:
    """Every spelling of every Megatron-LM flag → its record."""
    table: dict[str, MegatronFlag] = {}
    for record in json.loads(DATA_FILE.read_text())["flags"]:
        names = list(record.pop("names"))
        if record.get("action") == "argparse.BooleanOptionalAction":
            names.append("--no-" + names[0].removeprefix("--"))
        choices = record.pop("choices", None)
        flag = MegatronFlag(
            names=tuple(names),
            choices=tuple(choices) if isinstance(choices, list) else choices,
            **record,
        )
        for name in names:
            table[name] = flag
    return table
