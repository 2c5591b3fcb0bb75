"""Process groups, devices and seeds for one training run.

torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``) decides the
job; gloo is used on CPU and NCCL on CUDA. megatron-core's ``parallel_state`` then carves the
world into TP × CP × DP × PP groups in its default ``tp-cp-ep-dp-pp`` order.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import logging
import os
import random
import re
import resource
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch.distributed import DistNetworkError, DistStoreError

from memo_ext import device
from memo_ext.errors import ReportedError, UsageError
from memo_ext.mcore.compat import check_mcore_version, cpu_compat, seed_cpu_rng_tracker
from memo_ext.parallel import ParallelLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    device: torch.device
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    dp_size: int

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


@contextlib.contextmanager
def device_environment() -> Iterator[torch.device]:
    """The device for this process; on CPU, megatron-core's CUDA assumptions are redirected."""
    local = device.local_device()
    if local.type == "cuda":
        torch.cuda.set_device(local)
        yield local
        return
    if "OMP_NUM_THREADS" not in os.environ:
        # oversubscribed OpenMP threads spin against each other: share the cores out
        local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_procs))
    with cpu_compat():
        yield torch.device("cpu")


@dataclass(frozen=True)
class Rendezvous:
    """Where this process meets the others (torchrun's environment, checked)."""

    rank: int
    world_size: int
    addr: str
    port: int


def rendezvous_environment() -> Rendezvous:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, checked
    before anything waits on them: a rank outside the world, or an address no one can resolve,
    would otherwise wait out the whole rendezvous deadline (a one-process run without them gets
    a world of one on this machine).

    Raises:
        UsageError: a value that is not a whole number, a rank outside the world, a port outside
            1-65535, or an address that does not resolve.
    """
    env = os.environ
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name in env:
            if not re.fullmatch(r"[0-9]+", env[name]):
                raise UsageError(f"{name}={env[name]!r} in the environment is not a whole number")
            values[name] = int(env[name])
    rank, world, port = values["RANK"], values["WORLD_SIZE"], values["MASTER_PORT"]
    started = "start the job with python -m memo_ext.launch (torchrun), which sets them"
    if world < 1 or rank >= world:
        raise UsageError(
            f"RANK={rank} is outside WORLD_SIZE={world} (ranks 0 to {world - 1}): {started}"
        )
    local, local_world = values.get("LOCAL_RANK", 0), values.get("LOCAL_WORLD_SIZE", world)
    if local >= local_world or local_world > world:
        raise UsageError(
            f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world} and WORLD_SIZE={world} do not "
            f"fit together: {started}"
        )
    if not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT={port} is not a port (1-65535)")
    addr = env["MASTER_ADDR"]
    try:
        socket.getaddrinfo(addr, port)
    except (socket.gaierror, UnicodeError) as err:
        reason = err.strerror if isinstance(err, socket.gaierror) else str(err)
        raise UsageError(
            f"MASTER_ADDR={addr} does not resolve ({reason}): give the host name or address "
            "of the node that runs rank 0"
        ) from None
    return Rendezvous(rank=rank, world_size=world, addr=addr, port=port)


def init_distributed(*, timeout_minutes: float = 10.0) -> None:
    """Create the default process group from torchrun's environment (or a 1-process group);
    the rendezvous, and later any collective, that waits ``timeout_minutes`` fails instead of
    hanging the job.

    Raises:
        UsageError: the environment does not describe a rank of a world
            (:func:`rendezvous_environment`).
        ReportedError: ``MASTER_PORT`` is taken on rank 0's machine, or not every rank joined
            before the deadline.
    """
    if dist.is_initialized():
        return
    where = rendezvous_environment()
    try:
        dist.init_process_group(
            backend=device.collective_backend(),
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    except (DistNetworkError, DistStoreError) as err:
        raise ReportedError(_rendezvous_failure(err, where, timeout_minutes)) from err


def _rendezvous_failure(err: Exception, where: Rendezvous, minutes: float) -> str:
    text = str(err)
    at = f"{where.addr}:{where.port}"
    if "EADDRINUSE" in text or "address already in use" in text:
        return (
            f"MASTER_PORT {where.port} is in use on this machine (another run?); give another "
            "port (--master-port N)"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return (
            f"the rendezvous at {at} waited {minutes:g} min (--distributed-timeout-minutes) and "
            f"{joined.group(1)} of {joined.group(2)} processes joined: start every rank with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return (
        f"rank {where.rank} could not join the rendezvous at {at} within {minutes:g} min "
        f"(--distributed-timeout-minutes): {first}"
    )


def init_model_parallel(
    *, layout: ParallelLayout, seed: int, timeout_minutes: float = 10.0
) -> ParallelContext:
    """Initialise megatron's parallel state and seed every generator; its groups' collectives
    fail after ``timeout_minutes`` of waiting.

    The data-parallel and model seeds follow Megatron-LM: one base seed for all ranks (so that
    CPU-initialised weights are identical everywhere before slicing) and a TP-rank offset for
    dropout inside tensor-parallel regions.
    """
    check_mcore_version()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=timeout_minutes,
    )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.on_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        seed_cpu_rng_tracker(seed=seed, tp_rank=tp_rank)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device.compute_device(),
        tp_rank=tp_rank,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )


def shutdown() -> None:
    """Tear down megatron's groups and the default process group, and collect the run's
    garbage: its model, optimizer and schedule hooks form reference cycles that keep every
    group's sockets and threads (about 50 threads for a small run) until a collection, so a
    process that trains again (a notebook, the test workers) would accumulate them."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def apply_memory_limit(limit_gb: float | None, *, device: torch.device, planned: bool) -> None:
    """``--memory-limit-gb``: make this process run out of memory past ``limit_gb`` GiB.

    CUDA: torch's per-process memory fraction of the device, so the caching allocator raises
    ``torch.OutOfMemoryError`` beyond it. CPU: ``RLIMIT_DATA`` at the data segment's size now
    plus the limit, so tensors (and anything else the process maps) past it fail to allocate;
    what start-up already holds (interpreter, libraries, process groups) is not counted.

    Raises:
        UsageError: with the planned allocator on CUDA (its arena is not torch's to cap).
    """
    if limit_gb is None:
        return
    limit = int(limit_gb * 2**30)
    if device.type == "cuda":
        if planned:
            raise UsageError(
                "--memory-limit-gb cannot cap --memo-allocator plan on CUDA; drop one of them"
            )
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        logger.info("memory limit: %.2f GiB of the device's %.2f", limit_gb, total / 2**30)
        return
    _map_large_allocations()
    start = _data_segment_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    _LIFTED_DATA_LIMIT.append(soft)
    cap = start + limit if hard == resource.RLIM_INFINITY else min(hard, start + limit)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    logger.info(
        "memory limit: the data segment may grow by %.2f GiB (from %.2f GiB at start-up)",
        limit_gb,
        start / 2**30,
    )


_LIFTED_DATA_LIMIT: list[int] = []
"""The CPU data-segment limit before ``apply_memory_limit`` set one (restored by
``lift_memory_limit``)."""


def lift_memory_limit() -> None:
    """Undo ``--memory-limit-gb`` on CPU after running out of memory, so that the exit can clean
    up (data-loader workers are stopped by a thread the limit would no longer let start)."""
    if _LIFTED_DATA_LIMIT:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (_LIFTED_DATA_LIMIT.pop(), hard))


def _map_large_allocations() -> None:
    """glibc: every allocation of 64 KiB or more its own mapping, returned on free, and one heap
    for all threads. By default glibc raises its mapping threshold as large blocks are freed and
    keeps them in per-thread heaps, so the data segment (what RLIMIT_DATA counts) would depend
    on allocation order and thread timing, not just on the tensors alive; with this, the same run
    runs out of memory at the same limit every time."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        logger.warning("--memory-limit-gb: cannot tune this C library's malloc; limits may vary")


_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)


def _data_segment_bytes() -> int:
    """``VmData`` of ``/proc/self/status``: what RLIMIT_DATA compares with its limit."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise UsageError("--memory-limit-gb on CPU needs Linux's /proc/self/status (VmData)")
