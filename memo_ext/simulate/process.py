"""The emulated device in a whole process: what ``python -m memo_ext.simulate.run`` puts into every
Python process the command starts.

The launcher sets ``MEMO_EMULATED_GPU`` and puts ``memo_ext/simulate/site`` first on
``PYTHONPATH``; that folder's ``sitecustomize`` calls :func:`install` when Python starts. It loads
the C++ half before torch (which must come first) and, once ``import torch`` has finished, enters
:func:`memo_ext.simulate.device.emulated_cuda` for the rest of the process: rank and world from the
launcher's environment (torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``), the part from
``MEMO_EMULATED_GPU`` and the GPU count from ``MEMO_EMULATED_GPUS``. A process that never imports
torch (a shell tool, ``pip``) pays nothing but the shim's load.

At exit the device checks what the process left on it (a block freed under a copy still
running is an :class:`~memo_ext.simulate.device.OrderError`); an error there ends the process
with status 70, so a script that ran on the device fails where a GPU run could have gone wrong.

This module imports neither torch nor the package at import time.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import traceback

GPU_VARIABLE = "MEMO_EMULATED_GPU"
GPUS_VARIABLE = "MEMO_EMULATED_GPUS"
OUT_VARIABLE = "MEMO_SIMULATE_OUT"
"""A folder: the process writes its timeline there at exit (``memo_ext.simulate.trace``)."""
TRACE_VARIABLE = "MEMO_SIMULATE_TRACE"
"""``1``: keep every op for the Chrome trace too."""
WORLD_VARIABLE = "MEMO_SIMULATE_WORLD"
"""GPUs of the modeled job (their copies share uplinks; default: the machine's)."""
CALIBRATION_VARIABLE = "MEMO_SIMULATE_CALIBRATION"
"""A calibration file (``memo-calibration/1``) whose rates replace the preset's."""
ORDER_ERROR_STATUS = 70
"""A process whose device work broke an ordering rule ends with this status (EX_SOFTWARE)."""


def install() -> None:
    """Load the shim now and the device after ``import torch`` (idempotent; a no-op without
    ``MEMO_EMULATED_GPU``)."""
    if not os.environ.get(GPU_VARIABLE) or any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        return
    from memo_ext.simulate import runtime

    runtime.load()
    sys.meta_path.insert(0, _AfterTorch())
    _note_failure()  # before the main module looks up sys.exit (``sys.exit(main())``)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` through the other finders and runs :func:`_activate` once its module has
    executed (every ``torch`` submodule it imports is then importable). A look-up that does not
    import (``importlib.util.find_spec("torch")``) leaves it in place for the real import."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        index = sys.meta_path.index(self)
        for finder in sys.meta_path[index + 1 :]:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _ActivatingLoader(spec.loader, self)
                return spec
        return None


class _ActivatingLoader(importlib.abc.Loader):
    """``torch``'s own loader, then the device (once; the finder leaves ``sys.meta_path``)."""

    def __init__(self, loader, finder: _AfterTorch) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
            _activate()

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.loader, name)


_held: list = []


def _activate() -> None:
    from memo_ext.simulate.device import emulated_cuda

    out = os.environ.get(OUT_VARIABLE)
    context = emulated_cuda(
        rank=None,
        world_size=None,
        gpu=os.environ[GPU_VARIABLE],
        gpus=int(os.environ.get(GPUS_VARIABLE, "1")),
        rates=_rates(),
        keep_intervals=bool(out) and os.environ.get(TRACE_VARIABLE) == "1",
    )
    device = context.__enter__()
    _held.append(context)  # a generator context closed by the collector would leave the device
    _threads_on_the_device(device)
    atexit.register(_check_at_exit, device)
    if out:  # registered last: runs first, before the exit check can end the process
        atexit.register(_write_timeline, device, out)


_failing: list[bool] = []
"""Set when the process ends in failure: a non-zero ``sys.exit``, an uncaught exception."""


def _note_failure() -> None:
    """Record a failing end (see :data:`_failing`) for the exit check."""
    exit, hook = sys.exit, sys.excepthook

    def recording_exit(status=None):
        if status not in (None, 0):
            _failing.append(True)
        exit(status)

    def recording_hook(*args) -> None:
        _failing.append(True)
        hook(*args)

    sys.exit, sys.excepthook = recording_exit, recording_hook


def _rates():
    """The clock's rates: the part's preset for the world's GPUs, with the calibration file of
    ``MEMO_SIMULATE_CALIBRATION`` when set (``None``: the device's defaults)."""
    world = os.environ.get(WORLD_VARIABLE)
    path = os.environ.get(CALIBRATION_VARIABLE)
    if not world and not path:
        return None
    from memo_ext.hardware import device_spec, read_calibration
    from memo_ext.simulate.parts import part
    from memo_ext.simulate.timing import Rates

    gpus = int(world or os.environ.get(GPUS_VARIABLE, "1"))
    calibration = read_calibration(path) if path else None
    spec = device_spec(part(os.environ[GPU_VARIABLE]))
    return Rates.of(spec, gpus=gpus, calibration=calibration, source=path or "preset")


def _write_timeline(device, out: str) -> None:
    from pathlib import Path

    from memo_ext.simulate import trace

    memory = {
        "peak_device_bytes": device.lifetime_peak_bytes,
        "peak_pinned_host_bytes": max(device.registered_peak_bytes(), device.pinned_bytes()),
        "device_capacity_bytes": device.capacity(),
    }
    rank = int(os.environ.get("RANK", "0"))
    trace.write(Path(out), device.clock, rank=rank, memory=memory)


def _threads_on_the_device(device) -> None:
    """Every thread started from now on has the device, as every thread of a CUDA process has
    the GPU (the emulated device is a dispatch mode, and modes are per thread)."""
    import threading

    bootstrap = threading.Thread._bootstrap_inner

    def bootstrap_on_device(self) -> None:
        with device.mode:
            bootstrap(self)

    threading.Thread._bootstrap_inner = bootstrap_on_device


EXIT_WAIT_S = 10.0
"""How long the check at exit waits for another thread's device op to end."""


def _check_at_exit(device) -> None:
    """What the process dropped dies on the device, checked as :func:`emulated_cuda`'s end of
    block checks it. The device stays in place: finalizers that run after this one (pinned
    pages unregistered, process groups destroyed) still find it.

    Daemon threads still run here. One inside a device op holds the device's lock, which the
    check and every finalizer doing a tensor op need; if it does not come out within
    :data:`EXIT_WAIT_S` (an op that blocks, a finalizer gc ran inside an op that waits for this
    thread, a lock inherited held through ``fork``), the check is skipped with a note and the
    device gets a new lock, so the process exits as a GPU process would, not waiting forever.
    A process ending in failure (out of device memory, a non-zero exit, an uncaught
    exception) is not checked: it exits with its own status."""
    import gc
    import re
    import threading

    if not device.lock.acquire(timeout=EXIT_WAIT_S):
        owner = re.search(r"owner=(\d+)", repr(device.lock))
        thread = threading._active.get(int(owner.group(1))) if owner else None
        print(
            f"emulated CUDA device: the check at exit is skipped; thread "
            f"{thread.name if thread else '?'!r} has been inside a device op for "
            f"{EXIT_WAIT_S:g} s",
            file=sys.stderr,
            flush=True,
        )
        device.lock = threading.RLock()  # the op that holds the old one still releases it
        return
    device.lock.release()  # not held across gc: a finalizer may join a thread that needs it
    if _failing:
        # the error unwound through work in flight (a copy still reading a block its frames
        # held): the process ends there, with its own status, on a GPU too
        return
    try:
        gc.collect()
        device.collect_released()
    except AssertionError:  # an OrderError: device work a GPU could run in the wrong order
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(ORDER_ERROR_STATUS)
