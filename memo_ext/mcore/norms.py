"""Normalization layers for the local (non-transformer-engine) layer spec.

megatron-core's torch-norm wrapper refuses sequence parallelism because the gradients of a
norm's parameters must then be summed across the tensor-parallel group: each TP rank sees only
``s/tp`` tokens. Marking the parameters ``sequence_parallel = True`` is how megatron's
``finalize_model_grads`` knows to all-reduce them, which is all this module adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm over the last dimension, as ``config.normalization`` says.

    Constructed like megatron's norms (``config, hidden_size, eps``); parameters carry
    ``sequence_parallel`` so their gradients are reduced across TP ranks under SP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization must be LayerNorm or RMSNorm, got {config.normalization}"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centred gamma needs the te backend (--attention-backend te)")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.hidden_size = hidden_size
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        shape = (self.hidden_size,)
        if self.rms:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
