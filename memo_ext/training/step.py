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
from megatron.core.utils import get_batch_on_this_cp_rank, unwrap_model

from memo_ext.errors import UsageError
from memo_ext.mcore.packed import build_packed_seq_params, cp_chunk_positions
from memo_ext.training.position_loss import PositionLoss

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def loss_func(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    position_loss: PositionLoss | None = None,
) -> LossOutput:
    """Per-token losses ``[b, s_local]`` → (loss sum, token count, logged pair); with
    ``position_loss`` (evaluation) the losses are also added there by ``position_ids``."""
    if position_loss is not None:
        position_loss.add(output_tensor, loss_mask, position_ids)
    mask = loss_mask.float()
    loss_sum = (output_tensor.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    logged = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": logged}


def check_token_ids(batch: dict[str, torch.Tensor], *, vocab_size: int) -> None:
    """Token ids must lie in the tokenizer's vocabulary: larger ones would train rows of the
    embedding table that are only padding (data made with another tokenizer).

    Raises:
        UsageError: naming the id and the vocabulary.
    """
    largest = max(int(batch[key].max()) for key in ("tokens", "labels") if batch[key].numel())
    if largest >= vocab_size:
        raise UsageError(
            f"the data holds token id {largest}, outside the tokenizer's {vocab_size}-token "
            "vocabulary; it was made with another tokenizer: give that one (--tokenizer-type, "
            "--tokenizer-model, --vocab-size) or make the data again with this one"
        )


def load_micro_batch(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    *,
    device: torch.device,
    cp_group=None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Next micro-batch on ``device``, cut to this context-parallel rank's two chunks; with
    ``vocab_size`` its token ids are checked first (on the host, before the copy).

    Packed rows (with ``cu_seqlens``) are cut per document slot (``cp_chunk_positions``) over
    ``cp_group`` (the model's); their boundaries stay whole. Plain rows use megatron's cut over
    the global CP group.
    """
    host = dict(next(data_iterator))
    if vocab_size is not None:
        check_token_ids(host, vocab_size=vocab_size)
    # the boundaries stay on the host: the params take them there (and copy them over)
    bounds = {k: host.pop(k) for k in ("cu_seqlens", "cu_seqlens_padded") if k in host}
    batch = {k: v.to(device, non_blocking=True) for k, v in host.items()}
    if not bounds:
        return get_batch_on_this_cp_rank(batch)
    batch.update(bounds)
    if cp_group is None or cp_group.size() == 1:
        return batch
    positions = cp_chunk_positions(
        bounds["cu_seqlens_padded"].tolist(), cp_rank=cp_group.rank(), cp_size=cp_group.size()
    ).to(device)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        batch[key] = batch[key][:, positions]
    return batch


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: torch.nn.Module,
    *,
    device: torch.device,
    vocab_size: int | None = None,
    position_loss: PositionLoss | None = None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
    """megatron-core's ``forward_step_func``: model output and the loss closure (which also
    adds the losses by position to ``position_loss`` when one is given)."""
    batch = load_micro_batch(
        data_iterator, device=device, cp_group=_cp_group(model), vocab_size=vocab_size
    )
    packed = None
    if "cu_seqlens" in batch:  # a packed row [1, t] of whole documents
        packed = build_packed_seq_params(
            cu_seqlens=batch.pop("cu_seqlens"),
            cu_seqlens_padded=batch.pop("cu_seqlens_padded"),
            device=device,
        )
    # tokens / labels / position_ids: [b, s/cp]; GPTModel returns per-token losses [b, s/cp].
    # attention_mask [b, 1, s/cp, s] (data loader's, when it makes one) reaches the core
    # attention as in Megatron-LM; ours are causal kernels and do not read it
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        packed_seq_params=packed,
    )
    closure = partial(loss_func, batch["loss_mask"])
    if position_loss is not None:
        # this CP rank's positions: cut with the tokens, so each is its global position
        closure = partial(closure, position_ids=batch["position_ids"], position_loss=position_loss)
    return output, closure


def scored_forward_step(
    data_iterator: Iterator[tuple[int, dict[str, torch.Tensor]]],
    model: torch.nn.Module,
    *,
    device: torch.device,
    add: Callable[[int, torch.Tensor, torch.Tensor], None],
) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
    """A ``forward_step_func`` for scoring a model held in
    :meth:`~memo_ext.mcore.gpt.ChunkedLossGPTModel.greedy_scoring`: the iterator yields
    (sample index, plain row ``[1, s]``); on the last stage the closure hands ``add`` the index,
    the row's mask and its per-token hits ``[1, s/cp]`` (an index below 0 is a row that only
    keeps the pipeline's micro-batch count even)."""
    index, host = next(data_iterator)
    batch = load_micro_batch(iter([host]), device=device, cp_group=_cp_group(model))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def closure(hits: torch.Tensor) -> LossOutput:
        if index >= 0:
            add(index, batch["loss_mask"], hits)
        mask = batch["loss_mask"].float()
        return (hits * mask).sum(), mask.sum().to(torch.int), {}

    return output, closure


def _cp_group(model: torch.nn.Module):
    """The model's own CP group (HotSPa builds models in several layouts)."""
    pgs = getattr(unwrap_model(model), "pg_collection", None)
    return getattr(pgs, "cp", None)


def build_forward_step(device: torch.device, *, vocab_size: int | None = None) -> Callable:
    """``forward_step`` bound to a device (and the vocabulary its token ids must lie in), in the
    two-argument form the schedules call."""
    return partial(forward_step, device=device, vocab_size=vocab_size)
