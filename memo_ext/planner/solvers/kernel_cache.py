"""Where numba keeps the compiled search loops: one per-user folder keyed by their source.

Compiling ``canonical_kernel`` and ``cover_kernel`` costs about ten CPU-seconds, ten times a
typical plan. numba caches the machine code, by default in ``__pycache__`` beside the source:
every clone, copy or build folder of the package then compiles its own on its first plan, even
on a machine that compiled the same source an hour before. Here the cache lives in
``~/.cache/memo_ext/planner_kernels/numba-<version>/<digest of both kernel sources>/``
(``$XDG_CACHE_HOME`` is obeyed), so a source is compiled once per user and machine, by
``make install`` (``canonical.warm_up``) or by the first plan; every checkout with the same
kernels loads it in a tenth of a second.

The digest also stands as numba's freshness stamp for both files, so a change to the canonical
kernel (which the cover kernel calls into) recompiles both. numba's own stamp covers one file.

A locator is tried before numba's own (``install_cache_locator``); it declines, and numba
falls back to its usual folders, when ``NUMBA_CACHE_DIR`` is set, when the folder cannot be
written, or when this numba version does not have the locator interface used here.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
from numba.core import caching

from memo_ext.files import cache_root

KERNEL_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("canonical_kernel.py", "cover_kernel.py")
)
"""The modules whose compiled functions are cached here."""


def kernel_digest() -> str:
    """Digest of the kernel sources together (the cache folder's name and freshness stamp)."""
    digest = hashlib.sha256()
    for path in KERNEL_SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def kernel_cache_dir() -> Path:
    """The folder the compiled kernels of this source and numba version are kept in."""
    root = cache_root() / "memo_ext" / "planner_kernels"
    return root / f"numba-{numba.__version__}" / kernel_digest()


def _is_kernel_source(py_file: str) -> bool:
    try:
        path = Path(py_file).resolve()
    except OSError:
        return False
    return any(path == source.resolve() for source in KERNEL_SOURCES)


_BASE = getattr(caching, "_CacheLocator", None)
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)

if _BASE is not None:

    class KernelCacheLocator(_BASE):
        """numba cache locator for the kernel modules (``None`` for every other file)."""

        def __init__(self, py_func, py_file):
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(kernel_cache_dir())

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            return kernel_digest()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.environ.get("NUMBA_CACHE_DIR") or not _is_kernel_source(py_file):
                return None
            locator = cls(py_func, py_file)
            try:
                locator.ensure_cache_path()
            except OSError:
                return None  # not writable: numba's own folders
            return locator

else:  # pragma: no cover - a numba without the locator interface keeps its own folders
    KernelCacheLocator = None


def install_cache_locator() -> bool:
    """Puts ``KernelCacheLocator`` first among numba's locators (once); False when this numba
    has no such interface, and the kernels are cached where numba puts them by default. Must
    run before the kernels' decorators, which choose their cache folder when applied."""
    classes = getattr(_IMPL, "_locator_classes", None)
    if KernelCacheLocator is None or not isinstance(classes, list):
        return False
    if KernelCacheLocator not in classes:
        classes.insert(0, KernelCacheLocator)
    return True


def kernels_cached_here(dispatcher) -> bool:
    """Whether a compiled function (a numba dispatcher) of the kernels is cached in
    ``kernel_cache_dir`` (and not in numba's default folders)."""
    cache_impl = getattr(getattr(dispatcher, "_cache", None), "_impl", None)
    return isinstance(getattr(cache_impl, "locator", None), KernelCacheLocator or ())
