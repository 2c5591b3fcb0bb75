"""The files a run is given or leaves: JSON documents read with one sentence for a file that is
missing, unreadable, damaged or of the wrong shape (never a parser's traceback), and the cache
folders under ``$XDG_CACHE_HOME`` checked writable before anything is built there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from memo_ext.errors import UsageError

_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true / false"}


def json_kind(value: object) -> str:
    """``value``'s JSON type in words (``an object``, ``a list``, ``a number``, ...)."""
    if value is None:
        return "null"
    for kind, words in _JSON_TYPES.items():
        if isinstance(value, kind):
            return words
    return "a number"


def read_json(path: Path, *, expect: type = dict, error: type[Exception] = UsageError):
    """The JSON document in ``path``, which must be of type ``expect`` (an object unless told).

    Raises:
        error: naming ``path`` and what is wrong with it (missing, unreadable, not JSON, cut
            short, or another type).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise error(f"{path} cannot be read: {reason}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        cut = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        what = "cut short (a partly written file?)" if cut else "not valid JSON"
        raise error(
            f"{path} is {what}: {err.msg} (line {err.lineno}, column {err.colno})"
        ) from None
    if not isinstance(doc, expect):
        raise error(f"{path} holds {json_kind(doc)}, not {_JSON_TYPES.get(expect, expect)}")
    return doc


def cache_root() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where compiled libraries and plans are kept."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())


def writable_folder(path: Path, *, what: str, error: type[Exception] = UsageError) -> Path:
    """``path``, made if needed, after writing a file in it.

    Raises:
        error: ``what`` and the system's reason, with where to point the cache instead.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise error(
            f"{what} {path} cannot be written ({err.strerror or err}): point XDG_CACHE_HOME (or "
            "TORCH_EXTENSIONS_DIR for torch's builds) at a writable folder"
        ) from None
    return path
