"""What one micro-batch does: slice it for this CP rank, run the model, and reduce the loss.

The loss is a sum over real tokens plus their count; megatron-core's schedules add these up
over micro-batches and ``finalize_model_grads`` divides the gradients by the token count of the
whole global batch (``calculate_per_token_loss``). The result is the mean over every real token
of the global batch, independent of how it is split over micro-batches, DP and CP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from megatron.core.utils import get_batch_on_this_cp_rank

from memo_ext.mcore.packed import build_packed_seq_params

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> LossOutput:
    """Per-token losses ``[b, s_local]`` → (loss sum, token count, logged pair)."""
    mask = loss_mask.float()
    loss_sum = (output_tensor.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    logged = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": logged}


def load_micro_batch(
    data_iterator: Iterator[dict[str, torch.Tensor]], *, device: torch.device
) -> dict[str, torch.Tensor]:
    """Next micro-batch on ``device``, cut to this context-parallel rank's two chunks.

    Packed rows (with ``cu_seqlens``) are not cut: they run with CP = 1.
    """
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    if "cu_seqlens" in batch:
        return batch
    return get_batch_on_this_cp_rank(batch)


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: torch.nn.Module,
    *,
    device: torch.device,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
    """megatron-core's ``forward_step_func``: model output and the loss closure."""
    batch = load_micro_batch(data_iterator, device=device)
    packed = None
    if "cu_seqlens" in batch:  # a packed row [1, t] of whole documents
        packed = build_packed_seq_params(
            cu_seqlens=batch.pop("cu_seqlens"),
            cu_seqlens_padded=batch.pop("cu_seqlens_padded"),
            device=device,
        )
    # tokens / labels / position_ids: [b, s/cp]; GPTModel returns per-token losses [b, s/cp]
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=packed,
    )
    return output, partial(loss_func, batch["loss_mask"])


def build_forward_step(device: torch.device) -> Callable:
    """``forward_step`` bound to a device, in the two-argument form the schedules call."""
    return partial(forward_step, device=device)
