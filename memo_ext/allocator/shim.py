"""The torch shim (``torch_shim.cpp``): the allocator core behind torch's CPU and CUDA allocators.

It is compiled against the installed torch's headers on first use with
``torch.utils.cpp_extension.load`` (a plain shared library, no Python module: a few seconds) and
cached under torch's extension directory (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), keyed by the shim's source and torch's version. It needs no CUDA
headers, so the same build serves CPU and CUDA machines.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from pathlib import Path

from memo_ext.allocator.core import AllocatorCore, AllocatorCoreError
from memo_ext.files import writable_folder

SHIM_SOURCE = Path(__file__).resolve().parent / "torch_shim.cpp"

_shim: dict[str, ctypes.CDLL] = {}


class ShimBuildError(AllocatorCoreError):
    """The torch shim cannot be compiled here (no C++ compiler, or the build failed)."""


def _find_cxx() -> str:
    # torch.utils.cpp_extension compiles with $CXX, else c++.
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler.split()[0]):
        raise ShimBuildError(
            f"the allocator's torch shim needs a C++ compiler and {compiler!r} was not found; "
            "install g++ (or set CXX) to put torch's allocations through the allocator core"
        )
    return compiler


def build_shim() -> ctypes.CDLL:
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
    name = f"memo_torch_shim_{digest[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = writable_folder(
        Path(root) / name, what="the allocator shim's build folder", error=ShimBuildError
    )
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
        raise ShimBuildError(f"compiling the allocator's torch shim failed ({first})") from None
    library = ctypes.CDLL(str(build_dir / f"{name}.so"))
    for fn in ("memo_shim_bind", "memo_shim_install"):
        getattr(library, fn).restype = ctypes.c_int
    library.memo_shim_bind.argtypes = [ctypes.c_char_p]
    library.memo_shim_install.argtypes = [ctypes.c_char_p, ctypes.c_int]
    library.memo_shim_uninstall.restype = ctypes.c_int
    library.memo_shim_installed.restype = ctypes.c_int
    library.memo_shim_last_error.restype = ctypes.c_char_p
    library.path = str(build_dir / f"{name}.so")
    _shim["shim"] = library
    return library


def loaded_shim() -> ctypes.CDLL | None:
    """The shim if this process built or loaded it, else ``None``."""
    return _shim.get("shim")


def bind_shim(core: AllocatorCore) -> ctypes.CDLL:
    """The shim, bound to ``core`` (its CUDA entry points call that core).

    Raises:
        AllocatorCoreError: the shim cannot find the core's entry points.
        ShimBuildError: the shim cannot be compiled.
    """
    shim = build_shim()
    if shim.memo_shim_bind(core.so_path().encode()) != 0:
        raise AllocatorCoreError(shim.memo_shim_last_error().decode())
    return shim
