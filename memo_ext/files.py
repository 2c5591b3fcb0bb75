"""Reading the JSON files a run is given or left: one sentence for a file that is missing,
unreadable, damaged or of the wrong shape, naming the file, never a parser's traceback."""

from __future__ import annotations

import json
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
