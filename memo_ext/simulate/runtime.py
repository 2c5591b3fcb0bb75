"""Building and loading the C++ half of the emulated CUDA device (``cuda_shim.cpp``).

The shim must be in the process before ``import torch``: torch asks for its CUDA hooks once, at
the first use, and keeps the answer. :func:`load` therefore finds torch's libraries from the
installed package without importing it, loads ``libc10``, ``libtorch_cpu`` and the shim
``RTLD_LOCAL`` (see :func:`load`). It is compiled with the system's C++ compiler against the
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


STUB = """#include <stddef.h>
static int (*malloc_)(void**, size_t), (*free_)(void*), (*get_device)(int*), (*last_error)(void);
int cudaMalloc(void** ptr, size_t size) { return malloc_(ptr, size); }
int cudaFree(void* ptr) { return free_(ptr); }
int cudaGetDevice(int* device) { return get_device(device); }
int cudaGetLastError(void) { return last_error(); }
void memo_emulated_forward(void* m, void* f, void* g, void* e) {
  malloc_ = m; free_ = f; get_device = g; last_error = e;
}
"""
"""The device's only global symbols (C, no dependencies): the shim's CUDA runtime under the
names the allocator core finds with ``dlsym(RTLD_DEFAULT, ...)``."""
FORWARDED = ("cudaMalloc", "cudaFree", "cudaGetDevice", "cudaGetLastError")


def build_stub(folder: Path) -> Path:
    """Compile :data:`STUB` into ``folder`` (once per source); returns the library's path."""
    library = folder / f"cuda_stub_{hashlib.sha256(STUB.encode()).hexdigest()[:16]}.so"
    if library.exists():
        return library
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    compiler = os.environ.get("CXX", "c++")  # as C: the shim's compiler, no other needed
    command = [compiler, "-x", "c", "-O1", "-shared", "-fPIC", "-w", "-", "-o", str(partial)]
    done = subprocess.run(command, input=STUB, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {library.name} failed:\n{done.stderr[-4000:]}")
    partial.replace(library)  # atomic, as the shim's
    return library


def load() -> ctypes.CDLL:
    """The shim, loaded into this process before torch (idempotent).

    Torch's libraries and the shim are loaded ``RTLD_LOCAL``, as ``import torch`` loads them.
    In the global scope their exports would bind every library loaded after them: ``libc10``'s
    gflags ``FLAGS_v`` / ``FLAGS_minloglevel`` took the place of abseil's flags of those names
    in OR-Tools' ``libabsl_log_flags``, whose static initialiser then crashed (importing
    CP-SAT: a segfault). A library loaded ``RTLD_GLOBAL`` puts its dependencies there too, so
    the shim cannot be global either; :data:`STUB` is, and forwards to the shim.

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
        ctypes.CDLL(str(lib_dir / name))
    shim = ctypes.CDLL(str(library))
    stub = ctypes.CDLL(str(build_stub(library.parent)), mode=ctypes.RTLD_GLOBAL)
    stub.memo_emulated_forward(*(ctypes.cast(getattr(shim, n), ctypes.c_void_p) for n in FORWARDED))
    _declare(shim)
    _loaded["stub"] = stub
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
