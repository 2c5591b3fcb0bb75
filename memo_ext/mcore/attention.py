"""Core-attention modules for megatron-core layer specs.

``SDPAttention`` is the portable backend: torch's ``scaled_dot_product_attention`` (flash /
memory-efficient kernels on CUDA, the fused CPU kernel elsewhere), causal, with grouped-query
attention, packed sequences (``thd`` with ``cu_seqlens``) and context parallelism.

Context parallelism follows Megatron's load-balanced layout: the sequence is cut into ``2·cp``
chunks and CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, so every rank does the same causal
work. Keys and values are all-gathered across the CP group (reduce-scattered in backward) and
each local query chunk attends to the global prefix that ends with it.

Packed rows run one variable-length kernel call on CUDA (flash-attn's
``flash_attn_varlen_func``, else torch's ``varlen_attn`` in half precision without dropout), and
one SDPA call per document elsewhere, with the boundaries read on the host (no device → host copy
per layer). Attention dropout always draws from megatron's tensor-parallel RNG stream (its CUDA
RNG tracker's fork), as megatron's own attention does, so TP ranks drop different heads' weights.

``FlashAttention`` wraps flash-attn's kernels on CUDA. Both modules take megatron's
core-attention constructor and ``forward`` signatures, so they slot into
``SelfAttentionSubmodules.core_attention``.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from memo_ext.mcore.packed import cp_chunk_positions, host_bounds


class SDPAttention(MegatronModule):
    """Causal core attention on torch SDPA; megatron's core-attention interface.

    Inputs are megatron's: query ``[sq, b, np, hn]``, key / value ``[sk, b, ng, hn]`` (``ng``
    query groups, ``np`` a multiple of ``ng``), or ``[t, np, hn]`` when packed. The output is
    ``[sq, b, np·hn]`` (``[t, np·hn]`` when packed).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention implements causal attention only, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.layer_number = layer_number
        self.cp_group = pg_collection.cp
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if packed_seq_params is not None:
            if cp_size > 1:
                return self._packed_context_parallel(query, key, value, packed_seq_params)
            return self._packed(query, key, value, packed_seq_params)
        if cp_size > 1:
            return self._context_parallel(query, key, value, cp_size)
        out = self._sdpa(query, key, value, causal=True)
        return out.reshape(out.size(0), out.size(1), -1)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool | Tensor) -> Tensor:
        """SDPA on megatron layouts: q ``[sq, b, np, hn]``, k / v ``[sk, b, ng, hn]``.

        ``causal`` is True for a square causal mask, or a mask / bias object to pass through.
        Returns ``[sq, b, np, hn]``.
        """
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        groups = q.size(1) // k.size(1)
        if groups > 1 and not isinstance(causal, bool):
            # lower-right causal biases do not take enable_gqa: expand k / v to all heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        kwargs = dict(dropout_p=self._dropout_p(), scale=self.softmax_scale)
        if isinstance(causal, bool):
            kwargs.update(is_causal=causal, enable_gqa=groups > 1)
        else:
            kwargs.update(attn_mask=causal)
        with self._dropout_rng():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.permute(2, 0, 1, 3)  # [sq, b, np, hn]

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _dropout_rng(self):
        """Megatron's tensor-parallel RNG stream around a kernel that drops out (each TP rank
        its own draws, the same on every DP replica), nothing otherwise."""
        if self._dropout_p() > 0.0:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams) -> Tensor:
        """Packed ``thd`` inputs: each sequence of ``cu_seqlens`` attends only to itself."""
        varlen = self._varlen_kernel(q)
        if varlen is not None:
            cu = params.cu_seqlens_q_padded
            cu = cu if cu is not None else params.cu_seqlens_q
            with self._dropout_rng():
                out = varlen(q, k, v, cu, params.max_seqlen_q)
            return out.reshape(out.size(0), -1)
        bounds = host_bounds(params)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            # [t_i, heads, hn] -> [t_i, 1, heads, hn]
            seg = (x[start:end].unsqueeze(1) for x in (q, k, v))
            outs.append(self._sdpa(*seg, causal=True).squeeze(1))
        out = torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)
        if bounds[-1] < q.size(0):  # padding tokens past the last sequence attend to nothing
            pad = q.new_zeros(q.size(0) - bounds[-1], *out.shape[1:])
            out = torch.cat([out, pad], dim=0)
        return out.reshape(out.size(0), -1)

    def _packed_context_parallel(
        self, q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams
    ) -> Tensor:
        """Packed rows under CP: each document's two local query chunks against its gathered
        keys / values (the load-balanced order of ``cp_chunk_positions``, per document slot)."""
        bounds = host_bounds(params)
        cp_size, rank = self.cp_group.size(), self.cp_group.rank()
        if bounds[-1] != q.size(0) * cp_size:
            raise ValueError("under CP, packed document slots must cover the whole row")
        held = torch.cat(
            [cp_chunk_positions(bounds, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]
        )
        order = torch.argsort(held).to(q.device)  # gathered rank by rank -> row order
        k_row, v_row = (
            tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.cp_group
            )[order]
            for x in (k, v)
        )
        outs, local = [], 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            chunk = (end - start) // (2 * cp_size)
            if chunk == 0:
                continue
            for global_chunk in (rank, 2 * cp_size - 1 - rank):
                q_chunk = q[local : local + chunk].unsqueeze(1)
                local += chunk
                seen = (global_chunk + 1) * chunk  # causal: the slot's first `seen` keys
                k_seen, v_seen = (x[start : start + seen].unsqueeze(1) for x in (k_row, v_row))
                mask = causal_lower_right(chunk, seen)
                outs.append(self._sdpa(q_chunk, k_seen, v_seen, causal=mask).squeeze(1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.size(0), -1)

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cp_size: int) -> Tensor:
        """Load-balanced CP: local q chunks ``r`` and ``2cp-1-r`` against all-gathered k / v."""
        chunk = q.size(0) // 2
        rank = self.cp_group.rank()
        k_full, v_full = (_gather_cp_sequence(x, self.cp_group, cp_size) for x in (k, v))
        outs = []
        for local, global_chunk in enumerate((rank, 2 * cp_size - 1 - rank)):
            q_chunk = q[local * chunk : (local + 1) * chunk]
            end = (global_chunk + 1) * chunk
            # queries at global positions [end - chunk, end) see keys [0, end): a causal mask
            # aligned to the lower-right corner of the [chunk, end] score matrix.
            mask = causal_lower_right(chunk, end)
            outs.append(self._sdpa(q_chunk, k_full[:end], v_full[:end], causal=mask))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.size(0), out.size(1), -1)

    def _varlen_kernel(self, q: Tensor):
        """One call over a packed row ``(q, k, v, cu_seqlens, max_seqlen) -> [t, np, hn]`` where
        the device has one (torch's ``varlen_attn``: CUDA, half precision, no dropout), else
        ``None``."""
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or self._dropout_p():
            return None
        return _torch_varlen(self.softmax_scale)


def _torch_varlen(scale: float):
    """torch's causal ``varlen_attn`` (torch >= 2.10), or ``None`` where it is absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    named = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in named else {"window_size": (-1, 0)}

    def run(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        groups = q.size(1) // k.size(1)
        if groups > 1 and "enable_gqa" not in named:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and "enable_gqa" in named else {}
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal, **extra)

    return run


def _gather_cp_sequence(x: Tensor, group: torch.distributed.ProcessGroup, cp_size: int) -> Tensor:
    """All-gather a CP-sharded ``[s/cp, b, ...]`` tensor into global sequence order ``[s, ...]``.

    Rank ``r`` holds chunks ``(r, 2cp-1-r)``; the gather yields them rank by rank, which is then
    permuted back to ``0 .. 2cp-1``. Backward reduce-scatters, so every rank's contribution to a
    key's gradient reaches the rank that owns it.
    """
    gathered = tensor_parallel.gather_from_sequence_parallel_region(
        x, tensor_parallel_output_grad=True, group=group
    )
    chunk = x.size(0) // 2
    owner_order = [c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)]
    position = {c: i for i, c in enumerate(owner_order)}
    pieces = gathered.split(chunk, dim=0)
    return torch.cat([pieces[position[c]] for c in range(2 * cp_size)], dim=0)


class FlashAttention(SDPAttention):
    """flash-attn kernels (CUDA only), same interface and layouts as :class:`SDPAttention`.

    Context parallelism's lower-right masks go through :class:`SDPAttention`'s SDPA path.
    """

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool | Tensor) -> Tensor:
        if not isinstance(causal, bool):
            return super()._sdpa(q, k, v, causal=causal)
        from flash_attn import flash_attn_func

        # flash-attn wants [b, s, heads, hn] and handles GQA natively
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        with self._dropout_rng():
            out = flash_attn_func(
                q, k, v, dropout_p=self._dropout_p(), softmax_scale=self.softmax_scale,
                causal=causal,
            )  # fmt: skip
        return out.transpose(0, 1)

    def _varlen_kernel(self, q: Tensor):
        from flash_attn import flash_attn_varlen_func

        def run(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
            return flash_attn_varlen_func(
                q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=self._dropout_p(),
                softmax_scale=self.softmax_scale, causal=True,
            )  # fmt: skip

        return run
