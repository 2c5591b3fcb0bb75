"""Tensor bookkeeping for MEMO: what a saved tensor looks like, where its tokens are, and how to
rebuild it with exactly the layout autograd saw.

A saved tensor is described by a :class:`TensorMeta` (size, stride, storage offset, dtype and the
identity of its storage) so it can be re-created later with the same strides: kernels such as
matrix products may pick another summation order for another memory layout, which would change
MEMO's gradients (bit-identical to the plain backward in the CPU tests; on a GPU the recompute's
shorter matrix products may take other cuBLAS kernels, so the last bits can differ).
:class:`TokenLayout` says which dimension holds the tokens and how they are grouped: ``[s, b, h]``
tensors hold this rank's tokens in one block; under sequence parallelism, tensors gathered over
the TP group hold ``tp`` blocks, rank by rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def storage_key(t: Tensor) -> int:
    """Identity of ``t``'s storage, valid while the storage lives (works for fake tensors)."""
    return t.untyped_storage()._cdata


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view covers a gap-free block of memory with no element twice."""
    expected = 1
    for dim_size, dim_stride in sorted(zip(size, stride), key=lambda p: p[1]):
        if dim_size == 1:
            continue
        if dim_stride != expected:
            return False
        expected *= dim_size
    return True


@dataclass(frozen=True)
class TensorMeta:
    """Shape, layout and storage of a saved tensor."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Storage offset in elements."""
    dtype: torch.dtype
    device: torch.device
    storage: int
    """:func:`storage_key` of the tensor's storage."""
    storage_nbytes: int

    @classmethod
    def of(cls, t: Tensor) -> TensorMeta:
        return cls(
            size=tuple(t.shape),
            stride=tuple(t.stride()),
            offset=t.storage_offset(),
            dtype=t.dtype,
            device=t.device,
            storage=storage_key(t),
            storage_nbytes=t.untyped_storage().nbytes(),
        )

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def dense(self) -> bool:
        return _dense(self.size, self.stride)

    @property
    def view_key(self) -> tuple:
        """Equal for two saves of the same view of the same storage."""
        return (self.storage, self.offset, self.size, self.stride, self.dtype)


def storage_bytes(t: Tensor) -> Tensor:
    """All bytes of ``t``'s storage as a flat ``uint8`` tensor (a view, no copy).

    Views are made with ``as_strided``, not ``set_``: a tensor re-pointed at a storage by
    ``set_`` hides the storage's release from the planner's allocation recorder.
    """
    nbytes = t.untyped_storage().nbytes()
    if nbytes % t.element_size() == 0:
        whole = t.as_strided((nbytes // t.element_size(),), (1,), 0)
        return whole.view(torch.uint8) if t.dtype != torch.uint8 else whole
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage(), 0, (nbytes,), (1,))


def view_of(storage_u8: Tensor, meta: TensorMeta) -> Tensor:
    """``meta``'s view on another storage (a ``uint8`` tensor of ``meta.storage_nbytes`` bytes)."""
    if (
        storage_u8.storage_offset() == 0
        and storage_u8.is_contiguous()
        and storage_u8.numel() % meta.dtype.itemsize == 0
    ):
        return storage_u8.view(meta.dtype).as_strided(meta.size, meta.stride, meta.offset)
    out = torch.empty(0, dtype=meta.dtype, device=storage_u8.device)
    return out.set_(storage_u8.untyped_storage(), meta.offset, meta.size, meta.stride)


def empty_like_meta(meta: TensorMeta, *, device: torch.device | None = None) -> Tensor:
    """A fresh tensor with ``meta``'s size and strides (``meta`` must be dense)."""
    return torch.empty_strided(
        meta.size, meta.stride, dtype=meta.dtype, device=device or meta.device
    )


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of a tensor are.

    Dimension ``dim`` holds ``groups`` blocks of ``per_group`` tokens: one block for this rank's
    tokens (``[s/tp, b, h]`` under sequence parallelism, ``[s/cp, b, h]`` under context
    parallelism), ``tp`` blocks for tensors all-gathered over the TP group (rank r's tokens are
    block r). MEMO keeps the first ``kept`` tokens of every block and drops the rest, so the
    dropped tokens of every tensor are the ones a layer pass over the layer input's last
    ``per_group - kept`` tokens produces.
    """

    dim: int
    groups: int
    per_group: int

    def blocks(self, t: Tensor) -> Tensor:
        """``t`` with ``dim`` split into ``(groups, tokens per group)`` (a view)."""
        return t.unflatten(self.dim, (self.groups, t.size(self.dim) // self.groups))

    def head(self, t: Tensor, kept: int) -> Tensor:
        """The first ``kept`` tokens of each block, blocks split out (a view)."""
        return self.blocks(t).narrow(self.dim + 1, 0, kept)

    def tail(self, t: Tensor, kept: int) -> Tensor:
        """The tokens after the first ``kept`` of each block, blocks split out (a view)."""
        return self.blocks(t).narrow(self.dim + 1, kept, self.per_group - kept)

    def head_shape(self, size: tuple[int, ...], kept: int) -> tuple[int, ...]:
        """Shape of :meth:`head` for a tensor of ``size``."""
        return (*size[: self.dim], self.groups, kept, *size[self.dim + 1 :])

    def tail_positions(self, kept: int, *, device: torch.device | None = None) -> Tensor:
        """Indices along ``dim`` of the dropped tokens, block by block."""
        starts = torch.arange(self.groups, device=device) * self.per_group
        offsets = torch.arange(kept, self.per_group, device=device)
        return (starts[:, None] + offsets[None, :]).reshape(-1)


def find_token_layout(
    full: tuple[int, ...], probe: tuple[int, ...], *, tokens: int, probe_tokens: int, groups: int
) -> TokenLayout | None:
    """Token layout of a saved tensor from its shape in a full pass and in a probe pass.

    The probe runs the layer on ``probe_tokens`` of the ``tokens`` local tokens; the one dimension
    whose size changed holds the tokens, in 1 block (local tensors) or ``groups`` blocks (tensors
    gathered over the sequence-parallel group). ``None`` when no dimension changed.

    Raises:
        ValueError: when the shapes do not fit either layout.
    """
    if len(full) != len(probe):
        raise ValueError(f"a saved tensor changed rank between passes: {full} vs {probe}")
    changed = [d for d, (a, b) in enumerate(zip(full, probe)) if a != b]
    if not changed:
        return None
    if len(changed) == 1:
        d = changed[0]
        for g in sorted({1, groups}):
            if full[d] == g * tokens and probe[d] == g * probe_tokens:
                return TokenLayout(dim=d, groups=g, per_group=tokens)
    raise ValueError(
        f"cannot tell the token dimension of a saved tensor of shape {full} "
        f"(shape {probe} on {probe_tokens} of {tokens} tokens)"
    )
