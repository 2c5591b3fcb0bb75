"""megatron-core's ``GPTModel`` with an output layer and loss computed in sequence chunks.

At long sequence lengths the logits dominate memory: megatron materialises ``[s, b, V/tp]``
logits (and the loss keeps softmax-sized buffers) for the whole micro-batch, 58 GiB per GPU for
a 7B GPT at 1M tokens under TP 8. With ``loss_chunks = k`` the output layer and the
vocab-parallel cross entropy run on k slices of the sequence, each under activation
checkpointing, so only one slice's logits exist at a time in the forward and in the backward.
The per-token losses are the same numbers (each token's logits and loss are computed alike);
only the weight gradient is summed in k parts.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class ChunkedLossGPTModel(GPTModel):
    """``GPTModel`` whose training loss is computed over ``loss_chunks`` slices of the sequence.

    Everything else (logits without labels, inference, multi-token prediction) is megatron's.
    """

    def __init__(self, *args, loss_chunks: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        if loss_chunks < 1:
            raise ValueError(f"loss_chunks must be at least 1, got {loss_chunks}")
        self.loss_chunks = loss_chunks

    def _postprocess(self, *args, **kwargs):
        labels = kwargs.get("labels")
        plain = (
            self.loss_chunks == 1
            or not self.post_process
            or labels is None
            or args  # megatron passes everything by keyword; anything else is not ours to alter
            or kwargs.get("mtp_in_postprocess")
            or kwargs.get("inference_context") is not None
        )
        if plain:
            return super()._postprocess(*args, **kwargs)
        return self._chunked_loss(kwargs["hidden_states"], labels)

    def _chunk_loss(self, hidden: Tensor, labels: Tensor, weight: Tensor | None) -> Tensor:
        logits, _ = self.output_layer(hidden, weight=weight)
        return self.compute_language_model_loss(labels, logits)  # [b, tokens of the chunk]

    def _chunked_loss(self, hidden_states: Tensor, labels: Tensor) -> Tensor:
        """Per-token losses ``[b, s]`` (this rank's tokens), one sequence slice at a time."""
        weight = None
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        # under SP each TP rank holds [s/tp, b, h]; the output layer gathers a slice from every
        # rank, so a chunk covers the same local rows of each rank's part of the sequence
        local = hidden_states.size(0)
        ranks = self.pg_collection.tp.size() if self.output_layer.sequence_parallel else 1
        losses, columns = [], []
        for start, end in _slices(local, self.loss_chunks):
            positions = torch.cat(
                [torch.arange(r * local + start, r * local + end) for r in range(ranks)]
            )
            chunk_labels = labels[:, positions.to(labels.device)]
            losses.append(
                checkpoint(
                    self._chunk_loss,
                    hidden_states[start:end],
                    chunk_labels,
                    weight,
                    use_reentrant=False,
                )
            )
            columns.append(positions)
        order = torch.cat(columns)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return torch.cat(losses, dim=1)[:, inverse.to(hidden_states.device)]


def _slices(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, nearly equal, non-empty ``[start, end)`` slices of ``length``."""
    parts = min(parts, length)
    bounds = [length * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
