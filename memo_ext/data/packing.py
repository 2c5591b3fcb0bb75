"""Pack variable-length documents into fixed-length rows without cross-talk.

A row holds several whole documents back to back, then padding up to the row length:

    tokens        d0 d0 d0 d1 d1 d2 d2 d2 d2 pad pad
    position_ids   0  1  2  0  1  0  1  2  3   4   5   restart at every document
    loss_mask      1  1  0  1  0  1  1  1  0   0   0   no label for a document's last token
    cu_seqlens    [0, 3, 5, 9]                          real tokens of each document
    cu_seqlens_padded [0, 3, 5, 11]                     the padding belongs to the last document

``labels[i]`` is the token after ``tokens[i]`` in the same document, never the first token of the
next one. With the boundaries handed to the model (``memo_ext.mcore.packed``), attention, RoPE and
learned positions treat every document as if it ran alone, so each real token gets the loss it
would get in a batch of one; padding comes after every real token of the row, so causal
attention keeps it out of their results, and its loss is masked.

Under context parallelism every document is cut into ``2·CP`` equal chunks, so each document
gets a slot padded to a multiple of ``pad_multiple = 2·CP`` (TE's ``thd`` convention):
``cu_seqlens`` counts real tokens, ``cu_seqlens_padded`` marks the slots.

    pad_multiple = 4
    tokens        d0 d0 d0 pad d1 d1 pad pad
    cu_seqlens    [0, 3, 5]
    cu_seqlens_padded [0, 4, 8]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

PAD_TOKEN_ID = 0
"""Token id written into padding (any id works: padding is masked out of the loss)."""


@dataclass
class PackedRow:
    """One packed row of ``row_tokens`` tokens. All tensors live on the CPU."""

    tokens: torch.Tensor
    """int64 ``[row_tokens]``: the documents back to back, then padding."""
    labels: torch.Tensor
    """int64 ``[row_tokens]``: next token within the same document; 0 where there is none."""
    loss_mask: torch.Tensor
    """float32 ``[row_tokens]``: 1 for tokens that have a label, 0 for documents' last tokens and
    padding."""
    position_ids: torch.Tensor
    """int64 ``[row_tokens]``: 0, 1, ... within each document; padding continues the last one."""
    cu_seqlens: torch.Tensor
    """int32 ``[documents + 1]``: cumulative real tokens of the documents (0, n0, n0 + n1, …)."""
    cu_seqlens_padded: torch.Tensor
    """int32 ``[documents + 1]``: start of each document's slot, then ``row_tokens``."""
    document_ids: list[int]
    """Index of each packed document in the list given to :func:`pack_documents`."""

    @property
    def real_tokens(self) -> int:
        """Tokens of the row that belong to a document."""
        return int(self.cu_seqlens[-1])


def slot_length(length: int, pad_multiple: int = 1) -> int:
    """Tokens a document of ``length`` takes in a row: rounded up to ``pad_multiple``."""
    return -(-length // pad_multiple) * pad_multiple


def first_fit_decreasing(lengths: Sequence[int], *, row_tokens: int) -> list[list[int]]:
    """Group documents into rows of at most ``row_tokens`` tokens.

    Documents are placed longest first (ties by index, so the result is deterministic), each in
    the first row with room for it; within a row they keep that order.

    Args:
        lengths: Tokens of each document, each in ``[1, row_tokens]``.
        row_tokens: Capacity of a row.

    Returns:
        Document indices per row; no documents, no rows.

    Raises:
        ValueError: A document is empty or longer than a row.
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be positive, got {row_tokens}")
    for index, length in enumerate(lengths):
        if not 1 <= length <= row_tokens:
            raise ValueError(
                f"document {index} has {length} tokens; packing needs 1 to {row_tokens} "
                f"(cut documents at the row length first)"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        target = next((r for r, free in enumerate(room) if free >= length), None)
        if target is None:
            rows.append([])
            room.append(row_tokens)
            target = len(rows) - 1
        rows[target].append(index)
        room[target] -= length
    return rows


def pack_row(
    documents: Sequence[np.ndarray], *, row_tokens: int, pad_multiple: int = 1
) -> PackedRow:
    """Lay ``documents`` (1-D token id arrays) out as one row padded to ``row_tokens``, each in
    a slot of a multiple of ``pad_multiple`` tokens."""
    lengths = [len(doc) for doc in documents]
    slots = [slot_length(n, pad_multiple) for n in lengths]
    if not documents or sum(slots) > row_tokens or row_tokens % pad_multiple:
        raise ValueError(
            f"a row needs 1 or more documents of {row_tokens} tokens in all, "
            f"got {len(documents)} documents in {sum(slots)} tokens of slots "
            f"(multiples of {pad_multiple})"
        )
    tokens = np.full(row_tokens, PAD_TOKEN_ID, dtype=np.int64)
    labels = np.zeros(row_tokens, dtype=np.int64)
    loss_mask = np.zeros(row_tokens, dtype=np.float32)
    position_ids = np.zeros(row_tokens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(slots)]).astype(np.int32)
    starts[-1] = row_tokens  # the row's padding joins the last slot
    for doc, start, end, length in zip(documents, starts[:-1], starts[1:], lengths):
        tokens[start : start + length] = doc
        labels[start : start + length - 1] = doc[1:]
        loss_mask[start : start + length - 1] = 1.0
        # padding continues its document's positions, as its slot attaches it there
        position_ids[start:end] = np.arange(end - start)
    return PackedRow(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(starts),
        document_ids=[],
    )


def empty_row(*, row_tokens: int) -> PackedRow:
    """A row of padding only: no real token, no loss. It evens out micro-batch counts across
    data-parallel ranks; ``cu_seqlens_padded`` makes the padding one segment."""
    zeros = torch.zeros(row_tokens, dtype=torch.int64)
    return PackedRow(
        tokens=zeros.clone(),
        labels=zeros.clone(),
        loss_mask=torch.zeros(row_tokens, dtype=torch.float32),
        position_ids=torch.arange(row_tokens),
        cu_seqlens=torch.zeros(2, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, row_tokens], dtype=torch.int32),
        document_ids=[],
    )


def pack_documents(
    documents: Sequence[np.ndarray], *, row_tokens: int, pad_multiple: int = 1
) -> list[PackedRow]:
    """Pack documents into as few rows of ``row_tokens`` tokens as first-fit decreasing finds.

    Args:
        documents: 1-D integer token id arrays, each of 1 to ``row_tokens`` tokens.
        row_tokens: Length of every row (the bucket's sequence length).
        pad_multiple: Each document's slot is a multiple of this (``2·CP`` under context
            parallelism, else 1).

    Returns:
        The rows, each recording which documents it holds (``PackedRow.document_ids``).
    """
    slots = [slot_length(len(doc), pad_multiple) for doc in documents]
    groups = first_fit_decreasing(slots, row_tokens=row_tokens)
    rows = []
    for group in groups:
        row = pack_row(
            [np.asarray(documents[i]) for i in group],
            row_tokens=row_tokens,
            pad_multiple=pad_multiple,
        )
        row.document_ids = list(group)
        rows.append(row)
    return rows
