"""Whole-model figures of the weights for the log: ``--log-params-norm`` (megatron-core's
optimizer counts ``--log-num-zeros-in-grad`` itself).

Each logical element counts once, as in megatron-core's gradient norm:
tensor-parallel shards all count, TP-replicated parameters on TP rank 0 only, the last pipeline
stage's copy of a tied embedding not at all; the sums are then added over the model-parallel
group (TP × PP). Data-parallel replicas hold the same weights and reduced gradients, except the
distributed optimizer's fp32 shards, which are added over DP × CP first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from memo_ext.collectives import collective_device


def counted_once(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters whose elements this rank counts (see the module docstring)."""
    return [
        p for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]


def _sum_over_model_parallel(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value, group=parallel_state.get_model_parallel_group())
    return value


def params_l2_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of all weights of the model, every logical element once.

    Where megatron's mixed-precision optimizer keeps fp32 master weights (``main_param``) they
    are read, as Megatron-LM's ``calc_params_l2_norm`` reads them; else the weights themselves.
    The squares are summed on the collective device (one host read at the end).
    """
    params = list(params)
    device = collective_device()
    local = torch.zeros((), dtype=torch.float64, device=device)
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    any_sharded = False
    for p in counted_once(params):
        if getattr(p, "main_param_sharded", False):  # the distributed optimizer's fp32 shard
            any_sharded = True
            if p.main_param is not None:
                sharded += _squares(p.main_param, device)
            continue
        data = getattr(p, "main_param", None)
        local += _squares(p if data is None else data, device)
    if any_sharded and dist.is_initialized():  # every DP rank has the same parameters
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(sharded, group=group)
    return math.sqrt(_sum_over_model_parallel(local + sharded).item())


def _squares(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum of squares of ``t`` in float64, on ``device``."""
    return t.detach().double().pow(2).sum().to(device)
