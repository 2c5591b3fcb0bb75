"""What the config sections share: the ``auto`` value and small checks that raise one sentence."""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat
import sys

from memo_ext.errors import UsageError

AUTO = "auto"


def parse_token_counts(text: str) -> tuple[int, ...]:
    """``"4096,16384,32768"`` → ``(4096, 16384, 32768)``.

    Raises:
        argparse.ArgumentTypeError: naming the text.
    """
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated token counts, got {text!r}"
        ) from None


def at_least(value: float | None, low: float, flag: str) -> None:
    """``value`` (when given) is at least ``low``."""
    if value is not None and value < low:
        raise UsageError(f"{flag} must be at least {low:g}, got {value}")


def fraction(value: float, flag: str) -> None:
    """``value`` is in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise UsageError(f"{flag} must be in [0, 1), got {value}")


def check_writable_directory(path: str, *, flag: str) -> None:
    """``path`` is a directory this process can write, or can be created as one: a wrong path
    fails now, not at the first save.

    Raises:
        UsageError: naming the path and what is wrong with it.
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is" if existing == os.path.abspath(path) else f"lies under {existing}, which is"
        raise UsageError(f"{flag} {path} {where} a file, not a directory; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {existing} is not writable by this user")


def check_regular_file(path: str, *, flag: str) -> None:
    """``path``, where it exists, is a regular file: opening a FIFO blocks until another
    process opens its other end, and a device or socket is no file to read or append to.

    Raises:
        UsageError: naming the path and what it is.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing (a file to create) or unreadable: the caller's own checks say which
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise UsageError(f"{flag} {path} is {kind}, not a regular file; give a file")


def installed(module: str) -> bool:
    """``module`` can be imported (or already is: a module put in ``sys.modules`` may have no
    spec; one set to ``None`` there is blocked)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def importable(module: str, *names: str) -> bool:
    """``module`` imports and holds each of ``names``. Being found (:func:`installed`) is not
    enough for a compiled package: a wheel built for another torch is found but fails to import
    ("undefined symbol" in its extension), and a run that chose it would die at its first call.
    """
    if not installed(module):
        return False
    try:
        loaded = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - ImportError, OSError of a shared library, a wheel's own
        return False
    return all(hasattr(loaded, name) for name in names)
