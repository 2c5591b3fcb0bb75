"""The one rule for tensors handed to ``torch.distributed``: they live where the group moves data.

NCCL moves CUDA tensors only. A group made with ``backend="nccl"`` has no backend for the CPU, so
``dist.all_reduce`` of a CPU tensor raises ``No backend type associated with device type cpu``,
and gloo on a CPU machine moves host tensors. Host-side figures (a loss sum, a stop flag, a
norm, α) therefore travel as tensors on :func:`collective_device` of their group: the host when
the group has a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``), else this process's CUDA
device. Reading such a result back on the host is one device-to-host copy, made by the caller
when it needs the number.

This module imports nothing else from the package.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _backend_devices(backend: str) -> set[str]:
    """Device types a backend string serves: ``"cpu:gloo,cuda:nccl"`` names them; a bare name
    (``"nccl"``, ``"gloo"``) serves what torch registered it for."""
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return set(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives move (default group when ``None``).

    The host when the group has a CPU backend or no process group exists (a one-process run
    reduces nothing), else ``cuda:<current device>``.
    """
    if not dist.is_initialized() or "cpu" in _backend_devices(dist.get_backend(group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce_values(
    values: Sequence[float],
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Host numbers reduced over ``group`` (float64), for every rank; without a process group
    they come back unchanged."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def loss_pair(records: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(loss sum, real tokens) of megatron's logged ``"lm loss"`` records, float64, on the
    default group's collective device: ready for the all-reduce that sums it over the world.
    The records stay on their device until then (no host sync per micro-batch)."""
    pair = torch.zeros(2, dtype=torch.float64, device=collective_device())
    for record in records:
        pair += record["lm loss"].detach().to(pair.device, torch.float64)
    return pair


def world_loss_pair(records: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """:func:`loss_pair` summed over the world: the global batch's (loss sum, real tokens) on
    every rank.

    Only last-stage ranks hold records; every rank of the world joins one all-reduce of the
    pair. TP replicas add identical pairs, which scales both terms alike, so their ratio (the
    mean) and ratios of sums of pairs are unaffected.
    """
    pair = loss_pair(records)
    if dist.is_initialized():
        dist.all_reduce(pair)
    return pair


def mean_loss(pair: torch.Tensor) -> float:
    """The mean loss of a (loss sum, real tokens) pair (0 tokens: the sum)."""
    return (pair[0] / pair[1].clamp(min=1)).item()
