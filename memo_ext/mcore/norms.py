"""Normalization layers for the local (non-transformer-engine) layer spec.

megatron-core's torch-norm wrapper refuses sequence parallelism because the gradients of a
norm's parameters must then be summed across the tensor-parallel group: each TP rank sees only
``s/tp`` tokens. Marking the parameters ``sequence_parallel = True`` is how megatron's
``finalize_model_grads`` knows to all-reduce them.

It also honours ``layernorm_zero_centered_gamma`` (Megatron-LM's ``--apply-layernorm-1p``), which
megatron's torch norms refuse: the stored weight is γ − 1 and the norm scales by weight + 1, as
transformer-engine's norms do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm over the last dimension, as ``config.normalization`` says.

    Constructed like megatron's norms (``config, hidden_size, eps``); parameters carry
    ``sequence_parallel`` so their gradients are reduced across TP ranks under SP. With
    ``config.layernorm_zero_centered_gamma`` the weight holds γ − 1 (initially 0).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization must be LayerNorm or RMSNorm, got {config.normalization}"
            )
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = eps
        self.hidden_size = hidden_size
        dtype = config.params_dtype
        gain = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), gain, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        shape = (self.hidden_size,)
        # [h]; zero-centred: the stored weight is γ − 1
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.rms:
            return F.rms_norm(x, shape, gamma, self.eps)
        return F.layer_norm(x, shape, gamma, self.bias, self.eps)
