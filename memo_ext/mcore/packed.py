"""Document boundaries of a packed row, in the form megatron-core's ``GPTModel`` takes them.

``GPTModel.forward(..., packed_seq_params=...)`` with ``qkv_format="thd"`` runs one packed row
(micro-batch size 1, token ids ``[1, t]``). What megatron-core 0.16 does with it:

- learned absolute positions read ``position_ids`` as given, so they must restart per document;
- RoPE ignores ``position_ids``: it builds a table of ``max(max_seqlen_q, max_seqlen_kv)``
  positions and applies rows ``0 .. len-1`` of it to every segment of ``cu_seqlens_*_padded``
  (or ``cu_seqlens_*`` when no padded form is given), which restarts positions per document.
  The segments must cover every token of the row (``torch.split`` on their lengths), so padding
  has to belong to a segment: here it is attached to the last document.
- A trap: when the table has exactly ``cu_seqlens[-1]`` rows megatron switches to offset mode
  (segment ``i`` takes rows ``cu_seqlens[i] ..``, positions no longer restart). Passing the row
  length as ``max_seqlen`` (as is common) would trigger it for any row of several documents.
  :func:`build_packed_seq_params` passes the longest segment instead, which equals the row
  length only when the row holds a single segment, where both modes agree.
- core attention receives ``[t, heads, head_dim]`` and the params; ``SDPAttention`` attends
  within each padded segment, causally, so real tokens never see another document or padding.

The params are :class:`HostBoundsPackedSeqParams`: the boundaries also as host integers, read
from the host batch before it moved to the device, so attention and the CP cut need no
device → host copy (a synchronisation) per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class HostBoundsPackedSeqParams(PackedSeqParams):
    """megatron's ``thd`` params plus the padded boundaries on the host."""

    host_cu_seqlens_padded: tuple[int, ...] | None = None
    """``cu_seqlens_*_padded`` as host integers."""


def host_bounds(params: PackedSeqParams) -> list[int]:
    """The padded (else plain) query boundaries of ``params`` as host integers (read from the
    device only for params built elsewhere)."""
    host = getattr(params, "host_cu_seqlens_padded", None)
    if host is not None:
        return list(host)
    bounds = params.cu_seqlens_q_padded
    return (bounds if bounds is not None else params.cu_seqlens_q).tolist()


def build_packed_seq_params(
    *, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, device: torch.device | str
) -> HostBoundsPackedSeqParams:
    """``thd`` params of one row for ``GPTModel.forward``.

    Args:
        cu_seqlens: int32 ``[n + 1]``, start of each document's real tokens and the end of the
            last one, on the host.
        cu_seqlens_padded: int32 ``[n + 1]``, the same boundaries with the row's padding
            attached to the last document (last entry = row length), on the host.
        device: Where the model runs (the boundaries go there; megatron reads them back).

    Returns:
        Params with ``max_seqlen_*`` = the longest padded segment (see the module docstring).
    """
    if cu_seqlens.shape != cu_seqlens_padded.shape or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded "
            f"{tuple(cu_seqlens_padded.shape)} must both hold n + 1 >= 2 boundaries"
        )
    host = tuple(int(b) for b in cu_seqlens_padded.tolist())
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    padded = cu_seqlens_padded.to(device=device, dtype=torch.int32)
    max_seqlen = max(b - a for a, b in zip(host[:-1], host[1:]))
    return HostBoundsPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        host_cu_seqlens_padded=host,
    )


def cp_chunk_positions(cu_seqlens_padded: list[int], *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Row positions context-parallel rank ``cp_rank`` holds of a packed row, in its order.

    Each document slot (``cu_seqlens_padded``, lengths multiples of ``2·cp_size``) is cut into
    ``2·cp_size`` equal chunks and the rank keeps chunks ``cp_rank`` and ``2·cp_size - 1 -
    cp_rank`` of every slot, back to back: megatron-core's load-balanced CP order, per document,
    as TE's ``thd`` format and megatron's RoPE for ``thd`` expect.
    """
    pieces = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"a document slot of {end - start} tokens cannot be cut into 2·CP = "
                f"{2 * cp_size} chunks; pack with pad_multiple = 2·CP"
            )
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
