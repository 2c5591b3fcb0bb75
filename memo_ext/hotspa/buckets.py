"""Length buckets: each step's documents grouped by length and packed per bucket.

``--hotspa-buckets 4096,16384,32768`` are upper bounds. Each step takes the next global batch of
whole documents (the same order contract as ``--variable-seq-lengths``), puts every document in
the smallest bucket that holds it, and packs each bucket's documents into rows of the bucket's
length (first-fit decreasing). A bucket's rows are dealt round-robin to the data-parallel ranks
of that bucket's layout, topped up with padding rows so that its DP ranks run as many
micro-batches. Packing is deterministic and every rank packs the whole global batch, so every
rank agrees on which buckets are empty (they are skipped: no switch, no collective).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from memo_ext.hotspa.batches import deal_rows, row_to_micro_batch
from memo_ext.hotspa.documents import DocumentSource, global_batches
from memo_ext.hotspa.layouts import Layout
from memo_ext.hotspa.packing import pack_documents


def parse_buckets(text: str, *, seq_length: int) -> list[int]:
    """``"4096,16384,32768"`` → ascending bounds; the last must be ``--seq-length``."""
    try:
        bounds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--hotspa-buckets must be comma-separated token counts, got {text!r}"
        ) from None
    if any(b < 2 for b in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(f"--hotspa-buckets must be strictly ascending, each 2 or more: {text!r}")
    if bounds[-1] != seq_length:
        raise ValueError(
            f"the last of --hotspa-buckets ({bounds[-1]}) must equal --seq-length ({seq_length}): "
            "documents are cut at --seq-length and the longest bucket must hold them"
        )
    return bounds


def assign_buckets(lengths: Sequence[int], bounds: Sequence[int]) -> list[list[int]]:
    """Indices of the documents in each bucket (the smallest bound ≥ the length), longest first.

    Empty documents carry no token and go nowhere.
    """
    buckets: list[list[int]] = [[] for _ in bounds]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n == 0:
            continue
        b = bisect.bisect_left(bounds, n)
        if b == len(bounds):
            raise ValueError(f"a document of {n} tokens is longer than the last bucket")
        buckets[b].append(index)
    return buckets


@dataclass
class BucketBatch:
    """One bucket of one step, as this rank sees it."""

    bucket: int
    """Index into the bounds (and the strategies)."""
    length: int
    """Row length: the bucket's bound."""
    micro_batches: list[dict[str, torch.Tensor]]
    """This rank's rows in the bucket's layout (same count on every DP rank of it)."""
    rows: int
    """Rows of the whole bucket, before padding rows."""
    document_lengths: list[int] = field(default_factory=list)
    """Lengths of the bucket's documents (all of them, not only this rank's)."""

    @property
    def labelled_tokens(self) -> int:
        return sum(n - 1 for n in self.document_lengths)


def pack_buckets(
    documents: Sequence[np.ndarray], *, bounds: Sequence[int], layouts: Sequence[Layout], rank: int
) -> list[BucketBatch]:
    """One global batch → the non-empty buckets, with this rank's micro-batches of each."""
    lengths = [len(d) for d in documents]
    out = []
    for b, members in enumerate(assign_buckets(lengths, bounds)):
        if not members:
            continue
        layout = layouts[b]
        rows = pack_documents([documents[i] for i in members], row_tokens=bounds[b],
                              pad_multiple=2 * layout.cp if layout.cp > 1 else 1)  # fmt: skip
        dp_rank = layout.coords(rank)["dp"]
        mine = deal_rows(rows, dp_rank=dp_rank, dp_size=layout.dp, row_tokens=bounds[b])
        out.append(
            BucketBatch(
                bucket=b,
                length=bounds[b],
                micro_batches=[row_to_micro_batch(r) for r in mine],
                rows=len(rows),
                document_lengths=[lengths[i] for i in members],
            )  # fmt: skip
        )
    return out


def hotspa_step_batches(
    source: DocumentSource,
    *,
    bounds: Sequence[int],
    layouts: Sequence[Layout],
    rank: int,
    global_batch_size: int,
    seed: int,
    consumed_documents: int = 0,
) -> Iterator[list[BucketBatch]]:
    """Endless steps; each is the list of non-empty buckets of one global batch."""
    for documents in global_batches(
        source, global_batch_size=global_batch_size, seq_length=bounds[-1], seed=seed,
        consumed_documents=consumed_documents,
    ):  # fmt: skip
        yield pack_buckets(documents, bounds=bounds, layouts=layouts, rank=rank)
