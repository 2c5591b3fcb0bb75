"""How a memory method with settings is spelt on every command line:
``NAME[:KEY=VALUE[,KEY=VALUE ...]][@LAYOUT]`` (``memo:alpha=0.5,rule=tokenwise@tp8``).

This module splits the text and nothing more: the method named checks and reads its own
settings (``ComparedMethod.parse_settings``), so a method added by a plugin brings its keys with
it. The spelling before it, ``NAME=ALPHA[@LAYOUT]``, is read for a release with a notice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memo_ext.errors import UsageError

GRAMMAR = "NAME[:KEY=VALUE,...][@LAYOUT]"

_SPELLING = re.compile(
    r"^(?P<name>[a-z][a-z0-9_+-]*)(?::(?P<settings>[^@]*))?(?:@(?P<layout>[a-z0-9]+))?$"
)
_OLD = re.compile(r"^(?P<name>[a-z][a-z0-9_+-]*)=(?P<alpha>[^@:]+)(?P<layout>@[a-z0-9]+)?$")
_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True)
class Spelling:
    """One method as written: its name, its ``KEY=VALUE`` settings in order, its layout."""

    name: str
    settings: tuple[tuple[str, str], ...] = ()
    layout: str | None = None
    notice: str | None = None
    """Set when the text used the old spelling: one line saying the new one."""


def parse_spelling(text: str, *, flag: str) -> Spelling:
    """Splits ``text``; ``flag`` names the option in errors and notices.

    Raises:
        UsageError: for text that is not ``NAME[:KEY=VALUE,...][@LAYOUT]``, or a key given twice.
    """
    text = text.strip().lower()
    old = _OLD.match(text)
    if old is not None:
        new = f"{old['name']}:alpha={old['alpha']}{old['layout'] or ''}"
        spelling = parse_spelling(new, flag=flag)
        notice = f"{flag}: {text!r} is spelt {new!r} now; the old spelling goes in a later release"
        return Spelling(spelling.name, spelling.settings, spelling.layout, notice)
    match = _SPELLING.match(text)
    if match is None:
        raise UsageError(f"{flag}: {text!r} is not {GRAMMAR} (e.g. memo:alpha=0.5@tp4cp2)")
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (match["settings"] or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq or not _KEY.match(key) or not value:
            raise UsageError(f"{flag}: {text!r}: {item!r} is not KEY=VALUE")
        if key in dict(pairs):
            raise UsageError(f"{flag}: {text!r} gives {key} twice")
        pairs.append((key, value))
    return Spelling(match["name"], tuple(pairs), match["layout"])


def spell(name: str, settings: tuple[tuple[str, str], ...], layout: str | None = None) -> str:
    """:func:`parse_spelling`'s inverse."""
    text = name + (":" + ",".join(f"{k}={v}" for k, v in settings) if settings else "")
    return text + (f"@{layout}" if layout else "")
