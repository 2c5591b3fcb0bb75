"""The compiled search loops are cached once per user and source, not once per checkout."""

import importlib.util
import itertools
import os
from pathlib import Path

import pytest

import memo_ext.planner.solvers.canonical_kernel as canonical_kernel
import memo_ext.planner.solvers.cover_kernel as cover_kernel
from memo_ext.planner.solvers import kernel_cache

TOY_KERNEL = """
from numba import njit


@njit(cache=True)
def toy(x):
    return x * {factor} + 1
"""

_names = itertools.count()


def _checkout(folder: Path, factor: int = 3) -> Path:
    """A checkout's copy of a (toy) kernel module."""
    folder.mkdir(parents=True)
    path = folder / "toy_kernel.py"
    path.write_text(TOY_KERNEL.format(factor=factor))
    return path


def _import(path: Path):
    """Imports ``path`` as a new module, as a process of that checkout would."""
    spec = importlib.util.spec_from_file_location(f"toy_kernel_{next(_names)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert kernel_cache.install_cache_locator()
    return tmp_path / "cache"


def _as_kernel(monkeypatch, path: Path) -> None:
    monkeypatch.setattr(kernel_cache, "KERNEL_SOURCES", (path,))


def test_a_fresh_checkout_loads_the_kernels_another_one_compiled(tmp_path, cache_home, monkeypatch):
    first = _checkout(tmp_path / "clone-a")
    _as_kernel(monkeypatch, first)
    compiled = _import(first).toy
    assert compiled(2) == 7
    assert not compiled.stats.cache_hits and compiled.stats.cache_misses
    assert kernel_cache.kernels_cached_here(compiled)
    assert kernel_cache.kernel_cache_dir().is_relative_to(cache_home)
    assert not (first.parent / "__pycache__").exists() or not any(
        (first.parent / "__pycache__").glob("*.nbi")
    )

    second = _checkout(tmp_path / "clone-b")  # same source, elsewhere, nothing compiled there
    _as_kernel(monkeypatch, second)
    loaded = _import(second).toy
    assert loaded(2) == 7
    assert loaded.stats.cache_hits and not loaded.stats.cache_misses


def test_a_change_to_either_kernel_source_compiles_both_again(tmp_path, cache_home, monkeypatch):
    # the cover kernel calls into the canonical one: numba's own stamp, one file's, would
    # keep a cover kernel compiled against the old canonical kernel
    kernel = _checkout(tmp_path / "clone")
    callee = kernel.with_name("callee_kernel.py")
    callee.write_text("VERSION = 1\n")
    monkeypatch.setattr(kernel_cache, "KERNEL_SOURCES", (kernel, callee))
    assert _import(kernel).toy(2) == 7
    again = _import(kernel).toy
    assert again(2) == 7 and again.stats.cache_hits
    old_dir = kernel_cache.kernel_cache_dir()

    callee.write_text("VERSION = 2\n")
    compiled = _import(kernel).toy
    assert compiled(2) == 7
    assert compiled.stats.cache_misses and not compiled.stats.cache_hits
    assert kernel_cache.kernel_cache_dir() != old_dir


def test_other_modules_and_numba_cache_dir_keep_numbas_own_folders(
    tmp_path, cache_home, monkeypatch
):
    elsewhere = _checkout(tmp_path / "not-a-kernel")  # not among KERNEL_SOURCES
    compiled = _import(elsewhere).toy
    assert compiled(1) == 4 and not kernel_cache.kernels_cached_here(compiled)

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    kernel = _checkout(tmp_path / "kernel")
    _as_kernel(monkeypatch, kernel)
    compiled = _import(kernel).toy
    assert compiled(1) == 4 and not kernel_cache.kernels_cached_here(compiled)


def test_the_search_loops_are_cached_in_the_per_user_folder():
    if os.environ.get("NUMBA_CACHE_DIR") or not kernel_cache.kernel_cache_dir().exists():
        pytest.skip("numba's cache folder is set, or the per-user folder cannot be made here")
    for dispatcher in (canonical_kernel.run_kernel, cover_kernel.cover_kernel):
        assert kernel_cache.kernels_cached_here(dispatcher)
    digest = kernel_cache.kernel_digest()
    assert kernel_cache.kernel_cache_dir().name == digest
    assert len(digest) == 16
