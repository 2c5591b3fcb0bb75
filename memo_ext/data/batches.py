"""Packed micro-batches of variable-length documents for each data-parallel rank.

One optimizer step: take the next global batch of whole documents (``documents.global_batches``),
pack them into rows of ``seq_length`` tokens (``packing.pack_documents``), and deal the rows to
the data-parallel ranks round-robin; ranks short of a row get a padding-only row, so every rank
runs the same number of micro-batches (megatron-core's schedules need one count per step). A
micro-batch is one row in ``thd`` form: ``[1, seq_length]`` tensors plus its boundaries.

The loss is a sum over real tokens and a token count per micro-batch; megatron-core adds them
over micro-batches and ranks (``calculate_per_token_loss``), so the step's loss is the mean over
every real token of the global batch, however the documents fall into rows and ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from memo_ext.data.documents import DocumentSource, global_batches
from memo_ext.data.packing import PackedRow, empty_row, pack_documents


def deal_rows(rows: list[PackedRow], *, dp_rank: int, dp_size: int, row_tokens: int) -> list:
    """Rows ``dp_rank, dp_rank + dp_size, ...``, topped up with padding rows so that every rank
    gets ``ceil(len(rows) / dp_size)`` (at least one)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    per_rank = max(1, -(-len(rows) // dp_size))
    mine = rows[dp_rank::dp_size]
    return mine + [empty_row(row_tokens=row_tokens) for _ in range(per_rank - len(mine))]


def row_to_micro_batch(row: PackedRow) -> dict[str, torch.Tensor]:
    """A row as the trainer's micro-batch dict: ``[1, t]`` ids, positions, labels and loss mask,
    plus the int32 boundaries ``cu_seqlens`` / ``cu_seqlens_padded`` (``[n + 1]``)."""
    return {
        "tokens": row.tokens.unsqueeze(0),
        "labels": row.labels.unsqueeze(0),
        "loss_mask": row.loss_mask.unsqueeze(0),
        "position_ids": row.position_ids.unsqueeze(0),
        "cu_seqlens": row.cu_seqlens,
        "cu_seqlens_padded": row.cu_seqlens_padded,
    }


def packed_step_batches(
    source: DocumentSource,
    *,
    global_batch_size: int,
    seq_length: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    consumed_documents: int = 0,
    pad_multiple: int = 1,
) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless steps; each is this rank's list of packed micro-batches for one global batch.

    Every rank packs the whole global batch the same way (packing is deterministic), so the
    rows, and hence the losses, do not depend on ``dp_size``. Empty documents carry no token
    and are left out of the rows. Under CP, ``pad_multiple = 2·CP`` gives every document a slot
    that cuts into ``2·CP`` chunks.
    """
    for documents in global_batches(
        source,
        global_batch_size=global_batch_size,
        seq_length=seq_length,
        seed=seed,
        consumed_documents=consumed_documents,
    ):
        rows = pack_documents(
            [d for d in documents if len(d)], row_tokens=seq_length, pad_multiple=pad_multiple
        )
        dealt = deal_rows(rows, dp_rank=dp_rank, dp_size=dp_size, row_tokens=seq_length)
        yield [row_to_micro_batch(row) for row in dealt]
