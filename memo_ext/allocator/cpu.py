"""torch's CPU allocations through the allocator core, so plans are served (and tested) on CPU.

PyTorch has no Python hook for its CPU allocator, but ``c10::SetCPUAllocator(allocator,
priority)`` is in the wheel's C++ headers. ``cpu_shim.cpp`` defines a ``c10::Allocator`` whose
``allocate`` calls the core's ``memo_alloc(nbytes, -1, NULL)`` and whose deleter calls
``memo_free(ptr, 0, -1, NULL)``; it is compiled against the installed torch on first use with
``torch.utils.cpp_extension.load`` (a plain shared library, no Python module: a few seconds)
and cached under torch's extension directory (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), keyed by the shim's source and torch's version.

Tensors allocated before the install keep their own deleter, and tensors allocated while the
shim was installed keep the shim's (which calls the core) after an uninstall: installing late
and uninstalling early are both safe. The install is process-wide: every thread's CPU
allocations go through the core while it is installed (other threads' are ``miss_thread`` in a
pass). Example::

    core = AllocatorCore()
    core.init("host")
    with cpu_allocator_installed(core):
        x = torch.empty(1024)          # served by the core (core.stats()["fallback_requests"])
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from memo_ext.allocator.core import AllocatorCore, AllocatorCoreError

SHIM_SOURCE = Path(__file__).resolve().parent / "cpu_shim.cpp"
DEFAULT_PRIORITY = 200
"""c10 keeps the allocator set with the highest priority (ties: the latest); torch's own CPU
allocator registers with 0."""

_shim: dict[str, ctypes.CDLL] = {}


class ShimBuildError(AllocatorCoreError):
    """The CPU shim cannot be compiled here (no C++ compiler, or the build failed)."""


def _find_cxx() -> str:
    # torch.utils.cpp_extension compiles with $CXX, else c++.
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler.split()[0]):
        raise ShimBuildError(
            f"the CPU allocator shim needs a C++ compiler and {compiler!r} was not found; "
            "install g++ (or set CXX) to route CPU tensors through the allocator core"
        )
    return compiler


def build_cpu_shim() -> ctypes.CDLL:
    """Compiles (first use) and loads the shim; returns it as a ctypes library.

    Raises:
        ShimBuildError: no C++ compiler, or the compilation failed.
    """
    if "shim" in _shim:
        return _shim["shim"]
    import torch
    from torch.utils import cpp_extension

    _find_cxx()
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()
    name = f"memo_cpu_shim_{digest[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(SHIM_SOURCE)],
            extra_cflags=["-O2"],
            extra_ldflags=["-ldl"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except (RuntimeError, OSError) as err:
        first = (str(err).strip().splitlines() or ["no output"])[0]
        raise ShimBuildError(f"compiling the CPU allocator shim failed ({first})") from None
    library = ctypes.CDLL(str(build_dir / f"{name}.so"))
    library.memo_shim_install.restype = ctypes.c_int
    library.memo_shim_install.argtypes = [ctypes.c_char_p, ctypes.c_int]
    library.memo_shim_uninstall.restype = ctypes.c_int
    library.memo_shim_installed.restype = ctypes.c_int
    library.memo_shim_last_error.restype = ctypes.c_char_p
    _shim["shim"] = library
    return library


def install_cpu_allocator(core: AllocatorCore, *, priority: int = DEFAULT_PRIORITY) -> None:
    """Makes torch's CPU allocator the core (``c10::SetCPUAllocator``), keeping the previous one
    for ``uninstall_cpu_allocator``.

    Raises:
        AllocatorCoreError: the core's backend is not ``host``, the shim is already installed,
            or an allocator of higher priority holds the CPU.
        ShimBuildError: the shim cannot be compiled.
    """
    if core.backend() != "host":
        raise AllocatorCoreError(
            f"the CPU shim needs the core on the host backend, not {core.backend()!r}; call "
            "core.init('host') first"
        )
    shim = build_cpu_shim()
    if shim.memo_shim_install(core.so_path().encode(), int(priority)) != 0:
        raise AllocatorCoreError(shim.memo_shim_last_error().decode())


def uninstall_cpu_allocator() -> None:
    """Restores the CPU allocator that was current before ``install_cpu_allocator``.

    Raises:
        AllocatorCoreError: the shim is not installed.
    """
    shim = build_cpu_shim()
    if shim.memo_shim_uninstall() != 0:
        raise AllocatorCoreError(shim.memo_shim_last_error().decode())


def cpu_allocator_installed_now() -> bool:
    """Whether torch's CPU allocator is the shim at this moment."""
    return "shim" in _shim and bool(_shim["shim"].memo_shim_installed())


@contextlib.contextmanager
def cpu_allocator_installed(
    core: AllocatorCore, *, priority: int = DEFAULT_PRIORITY
) -> Iterator[None]:
    """Routes torch's CPU allocations through ``core`` inside the block."""
    install_cpu_allocator(core, priority=priority)
    try:
        yield
    finally:
        uninstall_cpu_allocator()
