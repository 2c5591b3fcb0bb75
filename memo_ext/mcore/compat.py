"""Running megatron-core 0.16 on machines without CUDA.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
buffers created with ``device=torch.cuda.current_device()`` or ``device="cuda"`` (sequence-parallel
gathers, pipeline p2p shapes, the per-token loss counter, RoPE tables), ``.cuda()`` on index
tensors, ``pin_memory=True``, ``torch.cuda.synchronize()`` and the CUDA RNG tracker.

On a machine without CUDA every one of those calls would raise, so redirecting them to the CPU
cannot change a result silently: it only lets the same code run. The redirection is applied
explicitly (never at import): by the trainer through :func:`cpu_compat` when CUDA is unavailable,
and by the estimator's fake-tensor traces through :func:`cpu_placement` on every machine (a
trace's tensors are CPU fakes, GPU or not). ``tests/unit/test_compat.py`` pins the megatron-core
behaviour it relies on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import package_info
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.overrides import TorchFunctionMode

from memo_ext.device import on_gpu

logger = logging.getLogger(__name__)

SUPPORTED_MCORE = ("0.16.",)


def check_mcore_version() -> str:
    """Return the installed megatron-core version, refusing versions we have not checked."""
    version = package_info.__version__
    if not version.startswith(SUPPORTED_MCORE):
        raise RuntimeError(
            f"megatron-core {version} is installed but this project is tested with "
            f"{', '.join(v + 'x' for v in SUPPORTED_MCORE)}; install megatron-core>=0.16,<0.17."
        )
    return version


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, int):  # an int device means a CUDA ordinal in torch factories
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CpuDeviceRedirect(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active.

    Factory calls (``torch.empty(..., device="cuda")``), ``Tensor.cuda()``, ``Tensor.to("cuda")``
    and ``pin_memory`` requests are served on the CPU; everything else passes through unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and args[1:] and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Drop-in for megatron's CUDA RNG tracker that forks the CPU generator instead.

    megatron forks a named RNG state for dropout inside tensor-parallel regions so that each
    TP rank draws different masks. On the CPU the same contract holds with the CPU generator.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} or seed {seed} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked; seed the model first")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def seed_cpu_rng_tracker(*, seed: int, tp_rank: int) -> None:
    """Seed the CPU tracker with megatron's offsets (data-parallel, model-parallel, expert)."""
    tracker = mrandom.get_cuda_rng_tracker()
    if not isinstance(tracker, CpuRNGStatesTracker):
        raise RuntimeError("seed_cpu_rng_tracker() needs cpu_compat() to be active")
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 10_000 * (tp_rank + 1))


_PLACEMENT_REPLACEMENTS = (
    # a device object rather than an ordinal: autograd's backward does not see the
    # CpuDeviceRedirect mode, and megatron's backward functions allocate with it too
    (torch.cuda, "current_device", lambda: torch.device("cpu")),
    (torch.cuda, "synchronize", lambda device=None: None),
)


@contextlib.contextmanager
def replaced_attributes(replacements) -> Iterator[None]:
    """``setattr`` each ``(owner, name, value)`` for the block, then put the originals back."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


@contextlib.contextmanager
def cpu_placement() -> Iterator[None]:
    """megatron-core's CUDA placements served on the CPU for the block, whatever the machine.

    ``torch.cuda.current_device()``, ``device="cuda"`` factories, ``.cuda()``, ``.to("cuda")``
    and pinned requests land on the CPU, and ``torch.cuda.synchronize`` does nothing. The
    estimator's fake-tensor traces run under it on every machine: a trace's tensors are CPU
    fakes, and megatron's own buffers (RoPE tables, sequence-parallel gathers) must join them
    there rather than on a GPU the machine may have.
    """
    check_mcore_version()
    with (
        replaced_attributes(_PLACEMENT_REPLACEMENTS),
        CpuDeviceRedirect(),
        warnings.catch_warnings(),
    ):
        # advice for CUDA's connection queues: there are none on the CPU
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
        yield


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Let megatron-core 0.16 train on the CPU for the duration of the block:
    :func:`cpu_placement` and megatron's CUDA RNG tracker on the CPU generator.

    Raises:
        RuntimeError: when CUDA is available (a training run there uses the GPU's generator) or
            the installed megatron-core is a version this shim was not checked against.
    """
    if on_gpu():
        raise RuntimeError("cpu_compat() is for machines without CUDA; CUDA is available here")
    rng = (
        (mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker()),
        (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
        # recomputation saves and restores "CUDA" RNG states next to the CPU one it already
        # keeps; with no CUDA generator there is nothing more to keep
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
        (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
    )
    with replaced_attributes(rng), cpu_placement():
        yield


# TransformerLayer.forward takes (*args, **kwargs) and hands them to _forward_attention, whose
# signature names them; a layer that wraps forward needs the names
_LAYER_ARGUMENTS = list(inspect.signature(TransformerLayer._forward_attention).parameters)[1:]


def transformer_layer_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``TransformerLayer`` call's arguments, all by name."""
    return {**dict(zip(_LAYER_ARGUMENTS, args)), **kwargs}
