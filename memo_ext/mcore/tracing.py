"""Running megatron-core layers on fake tensors in a fake world, on any machine.

The estimator and the planner trace real megatron-core layers at any scale under
``FakeTensorMode``: nothing is allocated, and a fake process-group backend gives one process the
shapes of any TP / SP / CP layout. What that needs from megatron-core's internals lives here:

- :func:`fake_process_groups`: a ``ProcessGroupCollection`` of a fake ``tp × cp`` world;
- :func:`fake_parallel_state`: megatron's *global* parallel state on a fake world (its
  vocab-parallel loss reads it);
- :func:`tracing_environment`: megatron's CUDA placements served on the CPU
  (``memo_ext.mcore.compat.cpu_placement``), random states frozen (:func:`frozen_rng`) and a
  private sequence-parallel gather buffer, so no fake tensor leaks into real runs;
- :func:`frozen_rng`: random-state save / restore made no-ops (a fake generator state cannot be
  restored).

A trace takes the same path on every machine: its tensors are CPU fakes whether or not the
machine has a GPU, so megatron's buffers are placed on the CPU too, and nothing in a trace
touches a real device (no CUDA context, no generator state) before the trainer picks its GPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.utils import GlobalMemoryBuffer
from torch.testing._internal.distributed.fake_pg import FakeStore

from memo_ext.mcore.compat import cpu_placement, replaced_attributes


@contextlib.contextmanager
def fake_process_groups(*, tp: int, cp: int):
    """Yields a ``ProcessGroupCollection`` of a fake ``tp x cp`` world (rank 0's view).

    The fake default group exists only inside the block, so real runs and other tests in the
    same process never see it.

    Raises:
        RuntimeError: when a process group is already initialised.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "tracing builds its own fake process group; trace before torch.distributed is "
            "initialised (or in a separate process)"
        )
    world = tp * cp
    with _fake_world(world):
        groups = ProcessGroupCollection()
        groups.tp = dist.new_group(list(range(tp)))
        groups.cp = dist.new_group(list(range(0, world, tp)))
        groups.pp = dist.new_group([0])
        groups.tp_cp = dist.new_group(list(range(world)))
        yield groups


@contextlib.contextmanager
def _fake_world(world: int) -> Iterator[None]:
    """torch's fake default process group of ``world`` ranks, this process rank 0, for the
    block. ``init_process_group`` wraps ``sys.excepthook`` to prefix "[rank0]: " to every line
    of a traceback and never unwraps it: the hook is put back as it was, or each trace of a
    process that estimates many times (a benchmark, a search) would add one prefix more."""
    hook = sys.excepthook
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@contextlib.contextmanager
def frozen_rng() -> Iterator[None]:
    """Random-state save / restore and tracker forks made no-ops while tracing.

    Under fake tensors a saved generator state is fake too and cannot be restored; the traced
    layers draw no random numbers (dropout 0), so megatron's checkpoint has nothing to restore.
    The stand-in tracker counts as initialised, so megatron's ``get_cuda_rng_tracker()`` keeps
    it instead of building a fresh, empty one; megatron's CUDA generator is never read.
    """

    class _NoForkTracker:
        def fork(self, name: str = ""):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

        def is_initialized(self):
            return True

    state = torch.get_rng_state()
    replacements = (
        (torch, "get_rng_state", lambda: state),
        (torch, "set_rng_state", lambda new_state: None),
        # a GPU's generator is never read: on a CUDA machine that would make a context on the
        # current device before the trainer has picked its own
        (torch.cuda, "get_rng_state", lambda device="cuda": state),
        (torch.cuda, "set_rng_state", lambda new_state, device="cuda": None),
        (mrandom, "_CUDA_RNG_STATE_TRACKER", _NoForkTracker()),
        (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
        (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
    )
    with replaced_attributes(replacements):
        yield


@contextlib.contextmanager
def fake_parallel_state(tp: int) -> Iterator[None]:
    """megatron's global parallel state on a fake ``tp``-rank world (its loss reads it)."""
    if dist.is_initialized():
        raise RuntimeError("estimating traces on a fake process group; call it before init")
    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    try:
        with _fake_world(tp), global_parallel_state(tp):
            yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = buffer


@contextlib.contextmanager
def global_parallel_state(tp: int) -> Iterator[None]:
    """megatron's global parallel state (TP ``tp``) on the fake world already initialised, for
    the code that reads it rather than a process-group collection (its loss, its SP gathers)."""
    try:
        with cpu_placement():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, create_gloo_process_groups=False
            )
            yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def tracing_environment() -> Iterator[None]:
    """For tracing layers on fake tensors, on any machine: megatron's CUDA placements on the
    CPU, random states frozen, and a private sequence-parallel gather buffer.

    Megatron keeps one global buffer for sequence-parallel all-gathers; a fresh one is installed
    for the trace (so its fake tensor never leaks into real runs) and the old one put back.
    """
    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    try:
        with cpu_placement(), frozen_rng():
            yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved
