"""FLOP counting with torch's ``FlopCounterMode``, CPU attention included.

torch 2.13's counter knows the CUDA attention kernels but not the fused CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) that ``SDPAttention`` runs on the CPU and under
fake tensors, so without help every attention FLOP is silently missing from a count made here.
:func:`flop_counter` registers formulas for that kernel and its backward (the same full
``s × s`` products torch counts for its other kernels) and returns a counter.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _attention_flops(query_shape, key_shape, value_shape) -> int:
    # [b, heads, s, d]: QK^T and PV, 2 FLOPs per multiply-add
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def _forward_formula(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(query.shape, key.shape, value.shape)


def _backward_formula(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    # dV, dP, dQ, dK: twice the forward products, as torch counts its CUDA kernels
    return 2 * _attention_flops(query.shape, key.shape, value.shape)


def register_cpu_attention_flops() -> None:
    """Teach ``FlopCounterMode`` the CPU attention kernels (idempotent)."""
    if _CPU_FORWARD in flop_counter.flop_registry:
        return
    flop_counter.register_flop_formula(_CPU_FORWARD, get_raw=True)(_forward_formula)
    flop_counter.register_flop_formula(_CPU_BACKWARD, get_raw=True)(_backward_formula)


def flop_counter_mode(**kwargs) -> flop_counter.FlopCounterMode:
    """A ``FlopCounterMode`` (``display=False`` by default) that also counts CPU attention."""
    register_cpu_attention_flops()
    kwargs.setdefault("display", False)
    return flop_counter.FlopCounterMode(**kwargs)
