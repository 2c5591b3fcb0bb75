"""Traced figures kept on disk between runs: a question asked again costs no trace.

The estimator's and the memory report's figures come from fake-tensor traces of megatron-core
layers and iterations (``memo_ext.estimate.measure``, ``memo_ext.estimate.fragmentation``):
a fraction of a CPU-second to seconds each, the same every time for the same inputs. Each one
is kept as a JSON file under ``$XDG_CACHE_HOME/memo_ext/estimate`` (``~/.cache`` without it),
named by a digest of everything it depends on, which the file repeats:

- the call's own inputs (the model shape's every field, the layout, tokens, batch, dtype, ...);
- the memory method: its class (module and qualified name, so a plugin's method never takes a
  built-in's figures), name, traced layer's name, and the ``repr`` of its settings and state;
- the versions of Python, torch and megatron-core, and a digest of the package's sources a
  trace runs through (every module but those that only read, print or price the figures:
  :data:`UNTRACED`), of the loaded plugins' modules, and of the module of a method or offload
  rule defined outside the package, so an edit to any of them is a miss.

A call whose key cannot be made stable (a ``repr`` with an object's address, a module without a
source file) is traced as if there were no cache. A file that cannot be read, or that does not
hold its own key (cut short, damaged, written by another format), is a miss and is written
again. Writes go to a temporary file in the same folder renamed into place, so runs at the same
time never read half a file; a folder that cannot be written is no error, only no cache.

``MEMO_ESTIMATE_CACHE=off`` turns the cache off for a process, ``MEMO_ESTIMATE_CACHE=FOLDER``
keeps it in ``FOLDER``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memo_ext.files import cache_root

T = TypeVar("T")

ENV = "MEMO_ESTIMATE_CACHE"
"""``off`` (or ``0``, ``no``, ``false``): no cache; a folder: the cache's place."""
FORMAT = 1
"""The files' layout; a file of another is a miss."""
OFF = ("0", "off", "no", "false")
UNTRACED = (
    "benchmarks/",
    "commands/",
    "compare/",
    "data/",
    "hf/",
    "simulate/",
    "training/",
    "estimate/calibration.py",
    "estimate/cost_model.py",
    "estimate/search.py",
    "arguments.py",
    "flags.py",
    "hardware.py",
    "launch.py",
)
"""The package's sources (relative to it) no trace runs through: editing them keeps the cache."""
SOURCE_SUFFIXES = (".py", ".c", ".cpp", ".h", ".json")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def folder() -> Path | None:
    """Where the figures are kept (``None``: nowhere, ``MEMO_ESTIMATE_CACHE=off``)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    return Path(value).expanduser() if value else cache_root() / "memo_ext" / "estimate"


def cached(
    kind: str,
    key: dict[str, Any],
    compute: Callable[[], T],
    *,
    encode: Callable[[T], Any],
    decode: Callable[[Any], T],
    method: Any = None,
    settings: Any = None,
) -> T:
    """``compute()``'s value, from the file of (``kind``, ``key``, ``method``, ``settings``)
    and the code when there is one, else computed and written there.

    Args:
        kind: the figure's name (a folder of its own).
        key: the call's inputs, JSON values.
        encode: the value as JSON values; ``decode`` is its inverse.
        method: the ``MemoryMethod`` that builds the traced layers (``None``: the plain one),
            with its ``settings``.
    """
    base = folder()
    full = None if base is None else full_key(kind, key, method=method, settings=settings)
    if full is None:
        return compute()
    text = json.dumps(full, sort_keys=True)
    path = base / kind / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    found = _read(path, full)
    if found is not None:
        try:
            return decode(found)
        except Exception:  # a file of the right key but a damaged value: traced again
            pass
    value = compute()
    _write(path, {"key": full, "value": encode(value)})
    return value


def full_key(kind: str, key: dict[str, Any], *, method: Any, settings: Any) -> dict | None:
    """Everything the figure depends on (module docstring), or ``None`` when some part of it
    has no stable form."""
    described = _method_key(method, settings)
    outside = _outside_sources(method)
    if described is _UNSTABLE or outside is None:
        return None
    full = {
        "format": FORMAT,
        "kind": kind,
        "call": key,
        "method": described,
        "code": code_key(),
        "outside": outside,
    }
    try:
        text = json.dumps(full, sort_keys=True)
    except (TypeError, ValueError):
        return None
    # as the file will hold it (tuples as lists), to compare with what a file holds
    return None if _ADDRESS.search(text) else json.loads(text)


_UNSTABLE = object()


def _method_key(method: Any, settings: Any) -> Any:
    """The method's class, name, traced layer's name and settings as JSON values."""
    if method is None:
        return None if settings is None else {"settings": repr(settings)}
    cls = type(method)
    try:
        traced = method.traced_name(settings)
        state = repr(sorted(vars(method).items()))
    except Exception:  # a method that cannot name its layer: no stable key
        return _UNSTABLE
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "name": method.name,
        "traced": traced,
        "settings": repr(settings),
        "state": state,
    }


@functools.cache
def code_key() -> dict[str, str]:
    """The versions of Python, torch and megatron-core, and the digest of the package's traced
    sources (read once per process; no library is imported)."""
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": _version("torch"),
        "megatron-core": _version("megatron-core"),
        "sources": package_digest(),
    }


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def package_digest() -> str:
    """SHA-256 of the package's sources outside :data:`UNTRACED`, by relative path."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.suffix not in SOURCE_SUFFIXES or "__pycache__" in rel or rel.startswith(UNTRACED):
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _outside_sources(method: Any) -> dict[str, str] | None:
    """Digest per module outside the package that a trace may run: the loaded plugins, the
    method's class and the registered offload rules (``None``: one has no source file)."""
    names = {name for name in os.environ.get("MEMO_EXT_PLUGINS", "").split(os.pathsep) if name}
    if method is not None:
        names.add(type(method).__module__)
    rules = sys.modules.get("memo_ext.memo.rules")
    names.update(rule.__module__ for rule in getattr(rules, "RULES", {}).values())
    out = {}
    for name in sorted(names):
        if name == "memo_ext" or name.startswith("memo_ext."):
            continue
        digest = _module_digest(name)
        if digest is None:
            return None
        out[name] = digest
    return out


def _module_digest(name: str) -> str | None:
    """SHA-256 of module ``name``'s source (a package's: every source below it)."""
    module = sys.modules.get(name)
    source = getattr(module, "__file__", None)
    if not source or not Path(source).is_file():
        return None
    path = Path(source)
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    digest = hashlib.sha256()
    try:
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    except OSError:
        return None
    return digest.hexdigest()


def _read(path: Path, full: dict) -> Any:
    """The value in ``path`` if the file holds ``full`` as its key; ``None`` otherwise."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != full:
        return None
    return doc.get("value")


def _write(path: Path, doc: dict) -> None:
    """``doc`` into ``path`` whole or not at all (a temporary file renamed into place)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(doc, out)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        return
