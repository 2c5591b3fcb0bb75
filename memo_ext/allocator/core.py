"""The allocator core from Python: finding (or compiling) the C library and driving it.

The core (``core.c``, plain C, loaded with ctypes) is one process-wide allocator that serves a
memory plan at run time. Its ``memo_alloc`` / ``memo_free`` pair is called by the torch shim
(``memo_ext.allocator.shim``): on a GPU behind ``torch.cuda.memory.CUDAPluggableAllocator``
(``memo_ext.allocator.cuda``, which turns a NULL into ``torch.OutOfMemoryError``), on CPU behind
c10's CPU allocator (``memo_ext.allocator.cpu``), so the rules below are tested on CPU (the CUDA
backend there against a stand-in runtime, and on the emulated device of ``memo_ext.simulate``).

Design
------
*Arena.* One region, reserved once (``reserve_arena``) and shared by every pass kind. A plan
places the i-th request of a pass at ``arena_base + offsets[i]``; the arena is as large as the
largest plan needs.

*Passes.* The program marks stretches whose allocation sequence repeats exactly: one layer's
forward, one layer's backward (up to 8 kinds, 0..7). ``begin_pass(kind)`` / ``end_pass()``
bracket one; passes never nest. The thread that begins a pass owns it; the stream of the pass
is the stream of the owner's first request in it. Requests are numbered in the order the
owner makes them; other threads' requests get no number.

*Modes.* ``off``: every request goes to the fallback path. ``record``: inside a pass the
owner's allocations (with their rounded sizes) and the frees of those blocks are logged, in
order; ``recorded()`` returns the log of the last completed recorded pass, from which a plan is
made. A block still allocated when the pass ends is "alive at the end" (its later free is not
logged). ``serve``: the plan of the pass's kind is served. The mode is read when a pass begins.

*Hit or miss.* In a serve pass, request ``i`` of the owner is served at its planned offset when
all of these hold, checked in this order, the first failure naming the miss:

- ``miss_no_plan``: a plan is loaded for the kind (and the arena is reserved);
- ``miss_extra``: ``i`` is below the number of planned requests;
- ``miss_size``: its size rounded up to 512 bytes equals the planned size;
- ``miss_stream``: it is on the pass's stream and device, and on the stream of the arena's
  first hit (a block freed on one stream may still be read by work queued there);
- ``miss_overlap``: ``[offset, offset + size)`` overlaps no live arena block, of this pass or of
  an earlier one. This is an exact interval test on what is live now, not trust in the plan: a
  plan that does not match the program (a late free, a shifted sequence) can never put a
  block over live data.

A request of another thread is ``miss_thread`` (and does not advance the count). Every miss is
served by the fallback path, so a wrong plan costs memory, never correctness. A plan may also
leave a request to the fallback path on purpose (offset :data:`UNPLANNED`: a block that
outlives its pass); such a request is ``unplanned``, neither hit nor miss. ``requests == hits +
sum(misses) + unplanned`` always holds; requests outside a pass, or in record / off passes, are
fallback requests only.

*Fallback.* Requests are rounded up to 512 bytes (as PyTorch's caching allocator rounds) and
served from exact-size free lists keyed by (size, device, stream); a freed block goes back to
its list and the backend (malloc / cudaMalloc) is called only when the list is empty. Training
repeats the same sizes every step, so after the first step nothing reaches cudaMalloc or
cudaFree; exact sizes mean no splitting, so no fragmentation inside the cache and no bookkeeping
of block neighbours. Memory goes back to the backend only in ``release_cached()`` (called
after each evaluation, whose other lengths ask for other sizes, by ``--memo-allocator plan``)
and once, automatically, when the backend is out of memory. Free lists are per stream for the
same reason the arena is: a block is reused only on the stream that used it.

*Plans on load.* ``load_plan`` refuses (``PlanRefused``, with the core's sentence) offsets or
sizes that are not multiples of 512, zero sizes, blocks past ``arena_bytes``, blocks not in
request order, a block freed before it is allocated, and two blocks live at the same time whose
bytes overlap; ``alloc_at`` / ``free_at`` are event indices of the pass (``free_at = -1``: alive
at the end).

Example (host memory; on a GPU, ``init("cuda")`` before ``change_current_allocator``)::

    core = AllocatorCore()
    core.init("host")
    core.reserve_arena(1 << 20)
    core.load_plan(0, sizes=[512, 1024], offsets=[0, 512], alloc_at=[0, 1], free_at=[-1, -1],
                   arena_bytes=1536)
    core.set_mode("serve")
    core.begin_pass(0)
    a, b = core.alloc(500), core.alloc(1000)   # arena_base() + 0, arena_base() + 512
    core.end_pass()
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Literal

import numpy as np

from memo_ext.errors import UsageError
from memo_ext.files import cache_root, writable_folder

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE = PACKAGE_DIR / "core.c"
ABI_VERSION = 2
"""Must equal ``MEMO_ABI_VERSION`` in ``core.c``; a library of another version is rebuilt."""
BLOCK_ALIGN = 512
"""Requests are rounded up to this many bytes; plan offsets and sizes are multiples of it."""
NUM_KINDS = 8
"""Pass kinds are 0 .. NUM_KINDS - 1."""
BACKENDS = {"host": 0, "cuda": 1}
MODES = {"off": 0, "record": 1, "serve": 2}
EVENT_TYPES = ("alloc", "free", "free_other")
"""Record-log event kinds; ``free_other``: a block of the pass freed by another thread."""
STAT_NAMES = (
    "requests",
    "hits",
    "hit_bytes",
    "miss_size",
    "miss_extra",
    "miss_overlap",
    "miss_thread",
    "miss_stream",
    "miss_no_plan",
    "fallback_requests",
    "fallback_live_bytes",
    "fallback_peak_bytes",
    "fallback_cached_bytes",
    "arena_bytes",
    "arena_live_bytes",
    "arena_peak_live_bytes",
    "passes",
    "fallback_backend_allocs",
    "unplanned",
    "unplanned_bytes",
)
"""Keys of ``AllocatorCore.stats()``, in the order ``memo_stats`` writes them."""
UNPLANNED = 2**64 - 1
"""A plan's offset for a request it leaves to the fallback path (``MEMO_UNPLANNED``)."""
MISS_NAMES = tuple(name for name in STAT_NAMES if name.startswith("miss_"))

_load_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL, Path]] = {}


class AllocatorCoreError(UsageError):
    """A call to the allocator core failed; the message is the core's own sentence."""


class CoreBuildError(AllocatorCoreError):
    """The core library is not built and cannot be compiled here (no C compiler, failed build)."""


class PlanRefused(AllocatorCoreError):
    """The core refused a plan (misaligned, out of the arena, overlapping live blocks, ...)."""


def _cache_dir() -> Path:
    return cache_root() / "memo_ext" / "allocator"


def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _find_compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise CoreBuildError(
        "the allocator core is not built and no C compiler was found (tried $CC, cc, gcc, clang); "
        "install one, or run `pip install -e .` where one exists to build memo_ext.allocator._core"
    )


def _compile(target: Path) -> None:
    """Compiles ``core.c`` into ``target`` (atomically: a temporary file, then a rename)."""
    compiler = _find_compiler()
    writable_folder(target.parent, what="the allocator core's build folder", error=CoreBuildError)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    flags = ("-std=c11", "-O2", "-fPIC", "-shared", "-pthread")
    digest = f'-DMEMO_SOURCE_DIGEST="{_source_digest()}"'
    command = [*compiler.split(), *flags, digest, str(SOURCE), "-o", tmp, "-ldl"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        first = (result.stderr.strip().splitlines() or ["no output"])[0]
        raise CoreBuildError(f"compiling the allocator core failed ({first})")
    os.replace(tmp, target)


def _built_library() -> Path | None:
    """The library setup.py built into the package, unless ``core.c`` changed since.

    A build embeds ``memo-core-source:<digest of core.c>``; it is read from the file's bytes,
    so a stale library is never loaded. Without ``core.c`` any build is taken.
    """
    for path in sorted(PACKAGE_DIR.glob("_core*.so")):
        if not SOURCE.is_file() or f"memo-core-source:{_source_digest()}".encode() in (
            path.read_bytes()
        ):
            return path
    return None


def _open(path: Path) -> ctypes.CDLL | None:
    """Loads a core library; None when it is not of this ABI version."""
    library = ctypes.CDLL(str(path))
    if not hasattr(library, "memo_abi_version") or library.memo_abi_version() != ABI_VERSION:
        return None
    _declare(library)
    return library


def find_or_build_core() -> Path:
    """The core library to load: setup.py's build in the package when it matches ``core.c``,
    else ``~/.cache/memo_ext/allocator/<source digest>/_core.so``, compiled there if missing.

    Raises:
        CoreBuildError: nothing built and no compiler, or the compiler failed.
    """
    built = _built_library()
    if built is not None:
        return built
    if not SOURCE.is_file():
        raise CoreBuildError(
            f"the allocator core is not built and its source {SOURCE} is missing; reinstall the "
            "package"
        )
    path = _cache_dir() / _source_digest() / "_core.so"
    if not path.is_file():
        _compile(path)
    return path


def load_core() -> ctypes.CDLL:
    """Returns the core library, loaded once per process (see ``find_or_build_core``).

    Raises:
        CoreBuildError: nothing built and no compiler, the compiler failed, or the library is
            not of this ABI version.
    """
    with _load_lock:
        if "core" not in _loaded:
            path = find_or_build_core()
            library = _open(path)
            if library is None:
                raise CoreBuildError(
                    f"{path} is not an allocator core of ABI version {ABI_VERSION}; delete it "
                    "and rebuild (pip install -e .)"
                )
            _loaded["core"] = (library, path)
        return _loaded["core"][0]


def so_path() -> str:
    """Path of the loaded core library (for ``CUDAPluggableAllocator`` and the CPU shim)."""
    load_core()
    return str(_loaded["core"][1])


def _declare(lib: ctypes.CDLL) -> None:
    u64, i64, i32, ptr = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    signatures = {
        "memo_alloc": (ptr, [ctypes.c_size_t, ctypes.c_int, ptr]),
        "memo_free": (None, [ptr, ctypes.c_size_t, ctypes.c_int, ptr]),
        "memo_init": (ctypes.c_int, [ctypes.c_int]),
        "memo_backend": (ctypes.c_int, []),
        "memo_last_error": (ctypes.c_char_p, []),
        "memo_load_plan": (
            ctypes.c_int,
            [
                ctypes.c_int,
                ctypes.c_int,
                ctypes.POINTER(u64),
                ctypes.POINTER(u64),
                ctypes.POINTER(i64),
                ctypes.POINTER(i64),
                u64,
            ],
        ),
        "memo_drop_plan": (ctypes.c_int, [ctypes.c_int]),
        "memo_reserve_arena": (ctypes.c_int, [u64]),
        "memo_arena_bytes": (u64, []),
        "memo_arena_base": (u64, []),
        "memo_set_mode": (None, [ctypes.c_int]),
        "memo_get_mode": (ctypes.c_int, []),
        "memo_begin_pass": (ctypes.c_int, [ctypes.c_int]),
        "memo_end_pass": (ctypes.c_int, []),
        "memo_recorded_kind": (ctypes.c_int, []),
        "memo_recorded_count": (ctypes.c_int, []),
        "memo_recorded_events": (
            ctypes.c_int,
            [ctypes.c_int, ctypes.POINTER(i32), ctypes.POINTER(i64), ctypes.POINTER(u64)],
        ),
        "memo_stats": (None, [ctypes.POINTER(u64), ctypes.c_int]),
        "memo_stats_count": (ctypes.c_int, []),
        "memo_reset_stats": (None, []),
        "memo_live_blocks": (ctypes.c_int, []),
        "memo_release_cached": (None, []),
        "memo_shutdown": (None, []),
        "memo_abi_version": (ctypes.c_int, []),
        "memo_take_late": (
            ctypes.c_int,
            [ctypes.POINTER(i32), ctypes.POINTER(i64), ctypes.POINTER(i32), ctypes.c_int],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def _as_array(values, dtype, what: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        values = values.ravel().tolist()
    values = [int(v) for v in values]  # exact: 2**64 - 1 (UNPLANNED) does not fit a float
    if dtype == np.uint64:
        if any(v < 0 for v in values):
            raise PlanRefused(f"plan {what} must be non-negative, got {min(values)}")
        return np.ascontiguousarray(np.array(values, dtype=np.uint64))
    return np.ascontiguousarray(np.array(values, dtype=np.int64))


def _pointer(array: np.ndarray, ctype):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


class AllocatorCore:
    """The process-wide allocator core, in Python terms (see the module docstring).

    Every instance drives the same state: there is one core per process.
    """

    def __init__(self) -> None:
        self._lib = load_core()
        count = self._lib.memo_stats_count()
        if count != len(STAT_NAMES):
            raise CoreBuildError(f"the core reports {count} statistics, expected {len(STAT_NAMES)}")

    def _check(self, status: int, error: type[AllocatorCoreError] = AllocatorCoreError) -> None:
        if status < 0:
            raise error(self._lib.memo_last_error().decode())

    def so_path(self) -> str:
        """Path of the core library, as the module-level ``so_path()``."""
        return so_path()

    def init(self, backend: Literal["host", "cuda"]) -> None:
        """Chooses where memory comes from: host memory or the CUDA runtime (found at run time).

        Raises:
            AllocatorCoreError: unknown backend, no CUDA runtime or GPU, or blocks still live
                under another backend.
        """
        if backend not in BACKENDS:
            raise AllocatorCoreError(f"backend must be 'host' or 'cuda', got {backend!r}")
        self._check(self._lib.memo_init(BACKENDS[backend]))

    def backend(self) -> str | None:
        """The backend chosen by ``init`` (None before)."""
        current = self._lib.memo_backend()
        return next((name for name, value in BACKENDS.items() if value == current), None)

    def reserve_arena(self, nbytes: int) -> None:
        """Makes the arena at least ``nbytes`` (rounded up to 512 bytes, on a 64 KiB-aligned
        base); grows only with no block live in it (its base may move, plans are offsets).

        Raises:
            AllocatorCoreError: not initialised, blocks live in the arena, or out of memory.
        """
        self._check(self._lib.memo_reserve_arena(int(nbytes)))

    def arena_bytes(self) -> int:
        """Size of the arena in bytes (0 before ``reserve_arena``)."""
        return int(self._lib.memo_arena_bytes())

    def arena_base(self) -> int:
        """Address of the arena's first byte (0 before ``reserve_arena``)."""
        return int(self._lib.memo_arena_base())

    def load_plan(self, kind: int, sizes, offsets, alloc_at, free_at, arena_bytes: int) -> None:
        """Loads (or replaces) the plan of pass kind ``kind``, after checking it.

        Args:
            kind: pass kind, 0 .. 7.
            sizes: ``[n]`` planned size of each request of the pass, rounded up to 512 bytes.
            offsets: ``[n]`` byte offset of each request in the arena (multiples of 512), or
                :data:`UNPLANNED` for a request the plan leaves to the fallback path (its
                size is still checked; it counts as ``unplanned``, neither hit nor miss).
            alloc_at: ``[n]`` event index of each allocation within the pass (increasing).
            free_at: ``[n]`` event index of each free, or -1 when the block outlives the pass.
            arena_bytes: bytes the plan needs; the arena must already be that large.

        Raises:
            PlanRefused: the core's sentence naming the first inconsistency.
        """
        arrays = [
            _as_array(sizes, np.uint64, "sizes"),
            _as_array(offsets, np.uint64, "offsets"),
            _as_array(alloc_at, np.int64, "alloc_at"),
            _as_array(free_at, np.int64, "free_at"),
        ]
        n = len(arrays[0])
        if any(len(a) != n for a in arrays):
            raise PlanRefused(
                "plan arrays sizes, offsets, alloc_at and free_at must have the same length, got "
                + ", ".join(str(len(a)) for a in arrays)
            )
        if arena_bytes < 0:
            raise PlanRefused(f"plan arena_bytes must be non-negative, got {arena_bytes}")
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        status = self._lib.memo_load_plan(
            int(kind),
            n,
            _pointer(arrays[0], u64),
            _pointer(arrays[1], u64),
            _pointer(arrays[2], i64),
            _pointer(arrays[3], i64),
            int(arena_bytes),
        )
        self._check(status, PlanRefused)

    def drop_plan(self, kind: int) -> None:
        """Forgets the plan of pass kind ``kind`` (its passes then miss with ``miss_no_plan``)."""
        self._check(self._lib.memo_drop_plan(int(kind)))

    def set_mode(self, mode: Literal["off", "record", "serve"]) -> None:
        """Sets the mode the next ``begin_pass`` uses."""
        if mode not in MODES:
            raise AllocatorCoreError(f"mode must be 'off', 'record' or 'serve', got {mode!r}")
        self._lib.memo_set_mode(MODES[mode])

    def mode(self) -> str:
        """The mode the next ``begin_pass`` uses."""
        return next(name for name, value in MODES.items() if value == self._lib.memo_get_mode())

    def begin_pass(self, kind: int) -> None:
        """Opens a pass of ``kind``, owned by the calling thread.

        Raises:
            AllocatorCoreError: a pass is already open, or the kind is out of range.
        """
        self._check(self._lib.memo_begin_pass(int(kind)))

    def end_pass(self) -> None:
        """Closes the open pass (any thread may close it).

        Raises:
            AllocatorCoreError: no pass is open.
        """
        self._check(self._lib.memo_end_pass())

    def recorded(self) -> tuple[int | None, list[tuple[str, int, int]]]:
        """The last completed recorded pass: its kind (None if none) and its events in order,
        each ``("alloc", request index, rounded size)``, ``("free", index of the alloc, rounded
        size)``, or ``("free_other", ...)`` for a free made by another thread than the
        pass's owner."""
        count = self._lib.memo_recorded_count()
        types = np.zeros(count, dtype=np.int32)
        indices = np.zeros(count, dtype=np.int64)
        sizes = np.zeros(count, dtype=np.uint64)
        count = self._lib.memo_recorded_events(
            count,
            _pointer(types, ctypes.c_int32),
            _pointer(indices, ctypes.c_int64),
            _pointer(sizes, ctypes.c_uint64),
        )
        kind = self._lib.memo_recorded_kind()
        events = [
            (EVENT_TYPES[int(t)], int(i), int(s))
            for t, i, s in zip(types[:count], indices[:count], sizes[:count])
        ]
        return (kind if kind >= 0 else None), events

    def stats(self) -> dict[str, int]:
        """Counters and byte figures, keyed by ``STAT_NAMES`` (bytes are rounded sizes)."""
        out = np.zeros(len(STAT_NAMES), dtype=np.uint64)
        self._lib.memo_stats(_pointer(out, ctypes.c_uint64), len(STAT_NAMES))
        return {name: int(value) for name, value in zip(STAT_NAMES, out)}

    def reset_stats(self) -> None:
        """Zeroes the counters; peaks restart from the current live bytes."""
        self._lib.memo_reset_stats()

    def live_blocks(self) -> int:
        """Number of blocks handed out and not freed (arena and fallback)."""
        return int(self._lib.memo_live_blocks())

    def take_late(self) -> list[tuple[int, int, bool]]:
        """The planned blocks that made a request miss by overlap since the last call, as
        ``(kind, request index, outlived its pass)``, oldest first: blocks freed later than
        their plan says."""
        out: list[tuple[int, int, bool]] = []
        kinds, indexes = np.zeros(1024, np.int32), np.zeros(1024, np.int64)
        outlived = np.zeros(1024, np.int32)
        while True:
            n = self._lib.memo_take_late(
                _pointer(kinds, ctypes.c_int32),
                _pointer(indexes, ctypes.c_int64),
                _pointer(outlived, ctypes.c_int32),
                1024,
            )
            out += [
                (int(k), int(i), bool(o)) for k, i, o in zip(kinds[:n], indexes[:n], outlived[:n])
            ]
            if n < 1024:
                return out

    def release_cached(self) -> None:
        """Returns the cached fallback blocks to the backend."""
        self._lib.memo_release_cached()

    def shutdown(self) -> None:
        """Closes any pass, drops plans, the record log and the late blocks, sets mode ``off``,
        returns cached blocks and (with no planned block live) the arena to the backend. Live
        blocks stay valid and can still be freed; the backend stays chosen."""
        self._lib.memo_shutdown()

    def alloc(self, size: int, stream: int = 0) -> int:
        """Calls ``memo_alloc(size, -1, stream)`` directly (tests); returns the address.

        Raises:
            AllocatorCoreError: the core returned NULL for a non-empty request.
        """
        ptr = self._lib.memo_alloc(int(size), -1, ctypes.c_void_p(stream or None))
        if not ptr and size:
            raise AllocatorCoreError(self._lib.memo_last_error().decode())
        return int(ptr or 0)

    def free(self, ptr: int) -> None:
        """Calls ``memo_free(ptr, 0, -1, NULL)`` directly (tests)."""
        self._lib.memo_free(ctypes.c_void_p(ptr or None), 0, -1, None)
