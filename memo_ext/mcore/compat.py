"""Running megatron-core 0.16 on machines without CUDA.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
buffers created with ``device=torch.cuda.current_device()`` or ``device="cuda"`` (sequence-parallel
gathers, pipeline p2p shapes, the per-token loss counter, RoPE tables), ``.cuda()`` on index
tensors, ``pin_memory=True``, ``torch.cuda.synchronize()``, the CUDA RNG tracker, and the
optimizers' checks of ``Tensor.type()`` against CUDA type names.

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
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
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


def _cuda_type_name(name: str) -> str:
    """``torch.BFloat16Tensor`` → ``torch.cuda.BFloat16Tensor``; a CUDA name stays."""
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


class CpuDeviceRedirect(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active.

    Factory calls (``torch.empty(..., device="cuda")``), ``Tensor.cuda()``, ``Tensor.to("cuda")``
    and ``pin_memory`` requests are served on the CPU, and ``Tensor.type()`` names a tensor's
    type as CUDA would (megatron-core's mixed-precision and distributed optimizers sort their
    parameters by those names); everything else passes through unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers sort parameters by their CUDA type names
            return _cuda_type_name(func(*args))
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


# ---------------------------------------------------------------------------------------------
# megatron-core 0.16's distributed optimizer: checkpoint fixes, on every machine
# ---------------------------------------------------------------------------------------------

_fully_reshardable = DistributedOptimizer.sharded_param_state_fully_reshardable
_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
_load_state_dict = DistributedOptimizer.load_state_dict


def _with_bucket_padding(unpadded: torch.Tensor, buffer) -> torch.Tensor:
    """A buffer's gathered state without the padding at its buckets' ends → laid out as the
    buffer is, padding included, where ``param_index_map``'s offsets point."""
    padded = unpadded.new_zeros(buffer.numel)
    start = 0
    for bucket in buffer.buckets:
        padded[bucket.offset : bucket.offset + bucket.numel_unpadded] = unpadded[
            start : start + bucket.numel_unpadded
        ]
        start += bucket.numel_unpadded
    return padded


def _fully_reshardable_state(self, model_sharded_state_dict, is_loading=False, metadata=None):
    """``sharded_param_state_fully_reshardable`` over world tensors laid out as the buffers are.

    megatron-core 0.16's ``get_parameter_state_dp_zero`` drops the padding at the end of each
    bucket, and the fully reshardable format then slices that state at the parameters'
    ``param_index_map`` offsets, which count the padding: with more than one bucket every
    parameter after the first bucket's end saves another parameter's moments and main weights
    (fixed upstream after core_v0.16.1). The gathered state is put back at the buffers'
    offsets first.
    """
    gather = self.get_parameter_state_dp_zero

    def gather_padded(**kwargs):
        state = gather(**kwargs)
        for index, by_dtype in (state or {}).items():
            if not isinstance(index, int):  # "buckets_coalesced"
                continue
            for world in by_dtype.values():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    if key in world:  # ranks that get no state hold {}
                        world[key] = _with_bucket_padding(world[key], self.buffers[index])
        return state

    self.get_parameter_state_dp_zero = gather_padded
    try:
        return _fully_reshardable(self, model_sharded_state_dict, is_loading, metadata)
    finally:
        del self.get_parameter_state_dp_zero


def _set_states_keeping_torch_step(self, model_param, tensors) -> None:
    """megatron-core 0.16's checkpoint loaders restore Adam's step from the parameter groups
    (``load_state_dict``) and then copy the other states into every state the optimizer holds
    (``_set_main_param_and_optimizer_states``). torch's AdamW keeps a step per parameter there
    (Apex's and transformer-engine's Adam do not): the copy then fails on a step the loader left
    out (fully_reshardable), or overwrites the restored step with the placeholder of the state
    the load was read into (dp_reshardable). Copy the rest; the step stays as restored."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
    step = state.pop("step", None)
    try:
        _set_states(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
    finally:
        if step is not None:
            state["step"] = step


def _load_state_dict_with_own_steps(self, state_dict) -> None:
    """megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` gives torch's AdamW one
    step tensor for all its parameters; torch's AdamW adds 1 to each parameter's step in place,
    so the shared tensor would count every parameter's update and skew Adam's bias correction
    from the first resumed step on. Each parameter gets its own copy."""
    _load_state_dict(self, state_dict)
    for state in self.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


DISTRIBUTED_OPTIMIZER_FIXES = (
    (DistributedOptimizer, "sharded_param_state_fully_reshardable", _fully_reshardable_state),
    # torch's AdamW, megatron-core's Adam without Apex or transformer-engine (every CPU run)
    (DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_states_keeping_torch_step),
    (DistributedOptimizer, "load_state_dict", _load_state_dict_with_own_steps),
)
"""``(owner, name, replacement)``: what :func:`fix_distributed_optimizer` installs."""


def fix_distributed_optimizer() -> None:
    """Install :data:`DISTRIBUTED_OPTIMIZER_FIXES` for the process (idempotent): the
    distributed optimizer's checkpoints then resume exactly and reshard, on CUDA and on the CPU.
    ``tests/unit/test_compat.py`` pins the megatron-core code each one stands in for."""
    check_mcore_version()
    for owner, name, replacement in DISTRIBUTED_OPTIMIZER_FIXES:
        setattr(owner, name, replacement)


# TransformerLayer.forward takes (*args, **kwargs) and hands them to _forward_attention, whose
# signature names them; a layer that wraps forward needs the names
_LAYER_ARGUMENTS = list(inspect.signature(TransformerLayer._forward_attention).parameters)[1:]


def transformer_layer_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``TransformerLayer`` call's arguments, all by name."""
    return {**dict(zip(_LAYER_ARGUMENTS, args)), **kwargs}
