"""Length buckets: each step's documents grouped by length and packed per bucket.

``--hotspa-buckets 4096,16384,32768`` are upper bounds. Each step takes the next global batch of
whole documents (the same order contract as ``--variable-seq-lengths``), sorts them by length
and packs them first-fit decreasing: a document goes into the first open row with room for it,
else opens a row in the smallest bucket that holds it, of that bucket's length. A document
never runs in a bucket shorter than itself, and the room a long document leaves in its row is
filled with shorter ones before shorter buckets open rows (backfill), so bucketing pads about as
little as packing everything into full-length rows. With ``--no-hotspa-backfill`` every
document stays in the smallest bucket that holds it.

A bucket's rows are dealt round-robin to the data-parallel ranks of that bucket's layout, topped
up with padding rows so that its DP ranks run as many micro-batches. Packing is deterministic
and every rank packs the whole global batch, so every rank agrees on which buckets are empty
(they are skipped: no switch, no collective).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from memo_ext.data.batches import deal_rows, row_to_micro_batch
from memo_ext.data.documents import DocumentSource, global_batches
from memo_ext.data.packing import pack_row, slot_length
from memo_ext.parallel import ParallelLayout


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


def bucket_rows(
    lengths: Sequence[int],
    bounds: Sequence[int],
    *,
    pad_multiples: Sequence[int] | None = None,
    backfill: bool = True,
) -> list[list[list[int]]]:
    """Document indices of each row of each bucket (see the module docstring).

    ``pad_multiples[b]`` is the slot granularity of bucket ``b``'s rows (``2·CP`` of its layout);
    a document's size in a row is its length rounded up to it. Empty documents go nowhere.
    """
    pads = list(pad_multiples or [1] * len(bounds))
    rows: list[tuple[int, list[int]]] = []  # (bucket, documents), in the order they opened
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n == 0:
            continue
        own = bisect.bisect_left(bounds, n)
        if own == len(bounds):
            raise ValueError(f"a document of {n} tokens is longer than the last bucket")
        target = next(
            (
                r
                for r, (b, _) in enumerate(rows)
                if (backfill or b == own) and room[r] >= slot_length(n, pads[b])
            ),
            None,
        )
        if target is None:
            rows.append((own, []))
            room.append(bounds[own])
            target = len(rows) - 1
        bucket, members = rows[target]
        members.append(index)
        room[target] -= slot_length(n, pads[bucket])
    out: list[list[list[int]]] = [[] for _ in bounds]
    for bucket, members in rows:
        out[bucket].append(members)
    return out


def pack_buckets(
    documents: Sequence[np.ndarray],
    *,
    bounds: Sequence[int],
    layouts: Sequence[ParallelLayout],
    rank: int,
    backfill: bool = True,
) -> list[BucketBatch]:
    """One global batch → the non-empty buckets, with this rank's micro-batches of each."""
    lengths = [len(d) for d in documents]
    pads = [2 * layout.cp if layout.cp > 1 else 1 for layout in layouts]
    out = []
    per_bucket = bucket_rows(lengths, bounds, pad_multiples=pads, backfill=backfill)
    for b, groups in enumerate(per_bucket):
        if not groups:
            continue
        layout = layouts[b]
        rows = [
            pack_row([documents[i] for i in group], row_tokens=bounds[b], pad_multiple=pads[b])
            for group in groups
        ]
        dp_rank = layout.coords(rank)["dp"]
        mine = deal_rows(rows, dp_rank=dp_rank, dp_size=layout.dp, row_tokens=bounds[b])
        out.append(
            BucketBatch(
                bucket=b,
                length=bounds[b],
                micro_batches=[row_to_micro_batch(r) for r in mine],
                rows=len(rows),
                document_lengths=[lengths[i] for g in groups for i in g],
            )
        )
    return out


def hotspa_step_batches(
    source: DocumentSource,
    *,
    bounds: Sequence[int],
    layouts: Sequence[ParallelLayout],
    rank: int,
    global_batch_size: int,
    seed: int,
    consumed_documents: int = 0,
    backfill: bool = True,
) -> Iterator[list[BucketBatch]]:
    """Endless steps; each is the list of non-empty buckets of one global batch."""
    for documents in global_batches(
        source,
        global_batch_size=global_batch_size,
        seq_length=bounds[-1],
        seed=seed,
        consumed_documents=consumed_documents,
    ):
        yield pack_buckets(documents, bounds=bounds, layouts=layouts, rank=rank, backfill=backfill)
