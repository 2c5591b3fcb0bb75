"""megatron-core's ``GPTModel`` with an output layer and loss computed in sequence chunks.

At long sequence lengths the logits dominate memory: megatron materialises ``[s, b, V/tp]``
logits (and the loss keeps softmax-sized buffers) for the whole micro-batch, 58 GiB per GPU for
a 7B GPT at 1M tokens under TP 8. With ``loss_chunks = k`` the output layer and the
vocab-parallel cross entropy run on k slices of the sequence, each under activation
checkpointing, so only one slice's logits exist at a time in the forward and in the backward.
The per-token losses are the same numbers (each token's logits and loss are computed alike);
only the weight gradient is summed in k parts.

The same slices serve greedy scoring (:meth:`ChunkedLossGPTModel.greedy_scoring`): instead of
its loss, each labelled token gets 1 where the label is the argmax of its logits over the real
vocabulary (``torch.argmax``'s rule, the first of equal maxima), found across the TP ranks'
vocabulary shards without gathering them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class ChunkedLossGPTModel(GPTModel):
    """``GPTModel`` whose training loss is computed over ``loss_chunks`` slices of the sequence.

    Everything else (logits without labels, inference, multi-token prediction) is megatron's.
    """

    def __init__(self, *args, loss_chunks: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        if self.position_embedding_type == "yarn":
            # megatron-core 0.16.1 hands RotaryEmbedding the model's CP group but builds
            # YarnRotaryEmbedding without one (it falls back to the global group): with explicit
            # groups (HotSPa's layouts) the table would be cut for another layout's CP ranks
            self.rotary_pos_emb.cp_group = self.pg_collection.cp
        if loss_chunks < 1:
            raise ValueError(f"loss_chunks must be at least 1, got {loss_chunks}")
        self.loss_chunks = loss_chunks
        self._scored_vocab: int | None = None
        """While :meth:`greedy_scoring` holds: the real vocabulary the argmax ranges over."""

    @contextlib.contextmanager
    def greedy_scoring(self, vocab_size: int) -> Iterator[None]:
        """While held, the model called with labels returns ``[b, s]`` 1.0 / 0.0 per token (the
        label is the argmax of the logits over ids below ``vocab_size``) instead of losses: a
        greedy decoder's choice at each position, given the true tokens before it.

        Only the last pipeline stage computes it; the others return hidden states as always.
        """
        previous, self._scored_vocab = self._scored_vocab, vocab_size
        try:
            yield
        finally:
            self._scored_vocab = previous

    def _postprocess(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if self._scored_vocab is not None and self.post_process and labels is not None:
            if args or kwargs.get("mtp_in_postprocess"):
                raise ValueError("greedy scoring does not support multi-token prediction")
            return self._by_chunks(kwargs["hidden_states"], labels, self._chunk_hits)
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
        return self._by_chunks(kwargs["hidden_states"], labels, self._chunk_loss)

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """megatron's loss, in this model's own TP group.

        megatron-core's unfused vocab-parallel cross entropy reads the global TP group, which
        is another layout's when HotSPa builds this model with explicit groups.
        """
        tp_group = self.pg_collection.tp
        if tp_group is parallel_state.get_tensor_model_parallel_group(check_initialized=False):
            return super().compute_language_model_loss(labels, logits)
        if self.config.cross_entropy_loss_fusion:
            raise ValueError(
                "cross_entropy_loss_fusion with explicit process groups is not supported"
            )
        loss = _GroupVocabParallelCrossEntropy.apply(
            logits, labels.transpose(0, 1).contiguous(), tp_group
        )
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

    def _chunk_loss(self, hidden: Tensor, labels: Tensor, weight: Tensor | None) -> Tensor:
        logits, _ = self.output_layer(hidden, weight=weight)
        return self.compute_language_model_loss(labels, logits)  # [b, tokens of the chunk]

    def _chunk_hits(self, hidden: Tensor, labels: Tensor, weight: Tensor | None) -> Tensor:
        logits, _ = self.output_layer(hidden, weight=weight)  # [tokens, b, V/tp]
        hits = greedy_hits(
            logits, labels.transpose(0, 1), self.pg_collection.tp, vocab_size=self._scored_vocab
        )
        return hits.transpose(0, 1).float()  # [b, tokens of the chunk]

    def _by_chunks(self, hidden_states: Tensor, labels: Tensor, per_chunk) -> Tensor:
        """``per_chunk``'s per-token figures ``[b, s]`` (this rank's tokens: losses, or greedy
        hits), one sequence slice at a time."""
        weight = None
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        # under SP each TP rank holds [s/tp, b, h]; the output layer gathers a slice from every
        # rank, so a chunk covers the same local rows of each rank's part of the sequence
        local = hidden_states.size(0)
        ranks = self.pg_collection.tp.size() if self.output_layer.sequence_parallel else 1
        batch = labels.size(0)
        # [b, ranks * local] -> [b, ranks, local]: row r is TP rank r's part of the sequence.
        # Slicing views of it (no index tensors) keeps every chunk on the device: an index
        # built on the host would be a blocking copy and a stream sync per chunk
        by_rank = labels.reshape(batch, ranks, local)
        losses = []
        for start, end in _slices(local, self.loss_chunks):
            # [b, ranks * (end - start)], rank-major as the output layer gathers the chunk
            chunk_labels = by_rank[:, :, start:end].reshape(batch, -1)
            loss = checkpoint(
                per_chunk,
                hidden_states[start:end],
                chunk_labels,
                weight,
                use_reentrant=False,
            )
            losses.append(loss.reshape(batch, ranks, end - start))
        # back in sequence order: each rank's chunks side by side, the ranks one after another
        return torch.cat(losses, dim=2).reshape(batch, ranks * local)


def greedy_hits(logits: Tensor, labels: Tensor, group, *, vocab_size: int) -> Tensor:
    """Whether each label is ``torch.argmax`` of its row of vocabulary-parallel ``logits``
    (``[..., V/tp]``, this rank's shard of ``group``'s vocabulary; ``labels`` ``[...]``), over
    the ids below ``vocab_size`` (the padding rows of the table are no token a decoder could
    write). Two all-reduces over ``group``: the largest logit, then the first id holding it.
    """
    shard = logits.size(-1)
    start = group.rank() * shard
    ids = torch.arange(start, start + shard, device=logits.device)
    logits = logits.float().masked_fill(ids >= vocab_size, float("-inf"))
    best = logits.max(dim=-1).values
    if group.size() > 1:
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    # the first id of the shard holding the maximum; the vocabulary's end where none does
    first = torch.where(logits == best.unsqueeze(-1), ids, vocab_size).min(dim=-1).values
    if group.size() > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    return first == labels


def _slices(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, nearly equal, non-empty ``[start, end)`` slices of ``length``."""
    parts = min(parts, length)
    bounds = [length * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class _GroupVocabParallelCrossEntropy(torch.autograd.Function):
    """megatron-core's vocab-parallel cross entropy (no label smoothing) over a given group,
    from the same helpers as its own."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits: Tensor, target: Tensor, group) -> Tensor:
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), group.rank(), group.size()
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target, logits_max, start, end
            )
        )
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        exp_logits, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted, sum_exp
        )
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
        )
        return grad_input, None, None
