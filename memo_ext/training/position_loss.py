"""Validation loss by token position: the curve that shows whether a long context is used.

Positions are the model's own ``position_ids`` (a token's index in its document for packed
rows, ``--variable-seq-lengths``; its index in the row otherwise), so they stay right after the
context-parallel cut, which slices ``position_ids`` with the tokens. Buckets double in width:
``[0, m), [m, 2m), [2m, 4m), ...`` up to ``--seq-length`` (the last one is cut there), with
``m = --eval-position-min-tokens``. The metrics record of an evaluation carries
``val_loss_by_position``: ``{"0-63": 5.1, "64-127": 4.9, ...}`` (inclusive first-last position,
buckets without a labelled token left out).

Sums are reduced as the validation loss is (``memo_ext.collectives.world_loss_pair``): one
all-reduce over the world of (loss sum, token count) per bucket. TP replicas add identical sums,
which scales numerator and denominator alike; only last pipeline stages add anything.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memo_ext.collectives import collective_device

METRICS_KEY = "val_loss_by_position"


def position_bounds(*, seq_length: int, min_tokens: int) -> list[int]:
    """Bucket edges ``[0, m, 2m, 4m, ..., seq_length]`` (one bucket when ``m >= seq_length``)."""
    bounds = [0]
    edge = min_tokens
    while edge < seq_length:
        bounds.append(edge)
        edge *= 2
    return bounds + [seq_length]


def bucket_labels(bounds: list[int]) -> list[str]:
    """``"first-last"`` inclusive positions of each bucket, e.g. ``"64-127"``."""
    return [f"{lo}-{hi - 1}" for lo, hi in zip(bounds[:-1], bounds[1:])]


class PositionLoss:
    """Sums of per-token losses and token counts per position bucket, over the micro-batches
    of one evaluation on this rank; :meth:`reduce` turns them into the world's means."""

    def __init__(self, bounds: list[int], *, device: torch.device):
        self.bounds = bounds
        # inner edges for bucketize; positions past the last edge fall in the last bucket
        self._edges = torch.tensor(bounds[1:-1], dtype=torch.long, device=device)
        self.sums = torch.zeros(2, len(bounds) - 1, dtype=torch.float64, device=device)
        """[0]: loss sum, [1]: labelled tokens, per bucket."""

    def add(self, losses: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Add one micro-batch: ``losses`` and ``mask`` ``[b, s_local]``, ``positions``
        ``[b or 1, s_local]`` (broadcast over the batch)."""
        bucket = torch.bucketize(positions.contiguous(), self._edges, right=True)
        bucket = bucket.expand_as(losses).reshape(-1)  # [b * s_local]
        mask = mask.to(torch.float64)
        weighted = losses.detach().to(torch.float64) * mask
        self.sums[0].index_add_(0, bucket, weighted.reshape(-1))
        self.sums[1].index_add_(0, bucket, mask.reshape(-1))

    def reduce(self) -> dict[str, float]:
        """Mean loss per bucket over the world (collective: every rank calls it); buckets with
        no labelled token are left out."""
        sums = self.sums.to(collective_device())
        if dist.is_initialized():
            dist.all_reduce(sums)
        means = {}
        for label, total, count in zip(bucket_labels(self.bounds), *sums.tolist()):
            if count > 0:
                means[label] = total / count
        return means
