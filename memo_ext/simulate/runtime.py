"""Building and loading the C++ half of the emulated CUDA device (``cuda_shim.cpp``).

The shim must be in the process before ``import torch``: torch asks for its CUDA hooks once, at
the first use, and keeps the answer. :func:`load` therefore finds torch's libraries from the
installed package without importing it, loads ``libc10`` and ``libtorch_cpu`` with
``RTLD_GLOBAL``, then the shim. It is compiled with the system's C++ compiler against the
installed torch's headers on first use and cached under ``~/.cache/memo_ext/simulate/``
(``$XDG_CACHE_HOME``), keyed by the shim's source and torch's version.

This module imports neither torch nor the package (but ``memo_ext.files``, which needs neither).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from memo_ext.files import cache_root, writable_folder

SOURCE = Path(__file__).resolve().with_name("cuda_shim.cpp")

_loaded: dict[str, ctypes.CDLL] = {}


def torch_dir() -> Path:
    """The installed torch package's folder (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def build() -> Path:
    """Compile the shim (once per source and torch version); returns the library's path."""
    version = importlib.metadata.version("torch")
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode()).hexdigest()[:16]
    build_dir = writable_folder(cache_root() / "memo_ext" / "simulate", what="the shim's cache")
    library = build_dir / f"cuda_shim_{digest}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler):
        raise RuntimeError(f"the emulated CUDA tier needs a C++ compiler; {compiler!r} is absent")
    torch = torch_dir()
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-w",
        f"-I{torch / 'include'}", f"-I{torch / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE), f"-L{torch / 'lib'}", "-lc10", "-ltorch_cpu",
        f"-Wl,-rpath,{torch / 'lib'}", "-o", str(partial),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    partial.replace(library)  # atomic: a concurrent build finds a whole library or none
    return library


def load() -> ctypes.CDLL:
    """The shim, loaded into this process before torch (idempotent).

    Raises:
        RuntimeError: when torch was imported first (its CUDA hooks are already chosen), or the
            shim cannot be built.
    """
    if "shim" in _loaded:
        return _loaded["shim"]
    import sys

    if "torch" in sys.modules:
        raise RuntimeError("load the emulated CUDA device before importing torch")
    library = build()
    lib_dir = torch_dir() / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    shim = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _declare(shim)
    _loaded["shim"] = shim
    return shim


def loaded() -> ctypes.CDLL | None:
    """The shim when :func:`load` ran in this process, else ``None``."""
    return _loaded.get("shim")


def _declare(shim: ctypes.CDLL) -> None:
    size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
    shim.memo_emulated_pinned_reserved.restype = size_t
    shim.memo_emulated_registered_bytes.restype = size_t
    shim.memo_emulated_registered_peak.argtypes = [ctypes.c_int]
    shim.memo_emulated_registered_peak.restype = size_t
    shim.memo_emulated_host_register.argtypes = [ptr, size_t]
    shim.memo_emulated_host_unregister.argtypes = [ptr]
    shim.memo_emulated_storage_token.argtypes = [ptr]
    shim.memo_emulated_storage_token.restype = size_t
    shim.memo_emulated_take_released.argtypes = [ctypes.POINTER(ctypes.c_size_t), size_t]
    shim.memo_emulated_take_released.restype = size_t
    shim.memo_emulated_bind_block.argtypes = [size_t, ptr, ptr, size_t, ptr]
    shim.memo_emulated_set_device_capacity.argtypes = [size_t]
    shim.memo_emulated_device_in_use.restype = size_t
    shim.memo_emulated_set_device_count.argtypes = [ctypes.c_int]
    shim.memo_emulated_set_current_device.argtypes = [ctypes.c_int]
    shim.memo_emulated_pluggable_alloc.argtypes = [
        ptr,
        size_t,
        ctypes.c_int,
        ptr,
        ctypes.POINTER(ptr),
        ctypes.c_char_p,
        size_t,
    ]
