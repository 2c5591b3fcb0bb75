"""Where this process computes, decided in one place.

A process computes on its GPU when torch sees one (``cuda:LOCAL_RANK``), else on the CPU. Every
question the package asks about that goes through this module, and only this module asks torch
(:func:`on_gpu`): the device's placement, its collective backend, waiting for its queued work,
its cache, the host memory its copies read, and its random states. Code elsewhere calls these
functions rather than branching on CUDA itself, so a GPU-only line lives here once, and the
emulated device (``memo_ext.simulate``, where the device is a GPU the code recognises) runs it.

The answer is read from torch at each call, never cached: the emulated device comes and goes
within one test process.

This module imports nothing of the package, and torch only when asked: the flags of every
entry point are checked before torch loads (seconds, more on a loaded machine).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_clock: Callable[[], float] | None = None


def on_gpu() -> bool:
    """True when this process computes on a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def local_device() -> torch.device:
    """The device this process is to use: its local rank's GPU (``LOCAL_RANK``, torchrun's), or
    the CPU."""
    import torch

    if on_gpu():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def compute_device() -> torch.device:
    """The device tensors of this process are made on now: the current GPU, or the CPU."""
    import torch

    if on_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_backend() -> str:
    """``torch.distributed``'s backend for this process's tensors: NCCL on a GPU, gloo on CPU."""
    return "nccl" if on_gpu() else "gloo"


def synchronize() -> None:
    """Wait for the work queued on the device (nothing is queued on the CPU)."""
    import torch

    if on_gpu():
        torch.cuda.synchronize()


def clock() -> float:
    """Seconds on the clock that times device work (read after :func:`synchronize`): the host's
    ``time.perf_counter``, or the modeled host clock of a simulated GPU (``memo_ext.simulate``),
    on which launches, copies and waits take the time the device model gives them."""
    return (_clock or time.perf_counter)()


def use_clock(read: Callable[[], float] | None) -> None:
    """Time device work with ``read`` from now on (``None``: the host's clock again)."""
    global _clock
    _clock = read


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """A named range of the program's device work: an NVTX range on a GPU (Nsight Systems shows
    it; a simulated GPU reports its time), nothing on the CPU."""
    if not on_gpu():
        yield
        return
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def empty_cache() -> None:
    """Give the caching allocator's free blocks back to the GPU (no cache on the CPU)."""
    import torch

    if on_gpu():
        torch.cuda.empty_cache()


def maybe_pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked host memory when this process computes on a GPU, so that a
    ``non_blocking`` copy of it to the device runs asynchronously (from pageable memory CUDA
    copies synchronously); on the CPU, ``tensor`` itself (there is no copy to make)."""
    if on_gpu() and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def gpu_rng_state() -> torch.Tensor:
    """The current GPU's generator state; an empty tensor on the CPU (there is none)."""
    import torch

    if on_gpu():
        return torch.cuda.get_rng_state()
    return torch.empty(0, dtype=torch.uint8)


def set_gpu_rng_state(state: torch.Tensor) -> None:
    """Restore :func:`gpu_rng_state`'s state (an empty one, saved on the CPU, restores nothing)."""
    import torch

    if on_gpu() and state.numel():
        torch.cuda.set_rng_state(state)
