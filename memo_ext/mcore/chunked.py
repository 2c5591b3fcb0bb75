"""megatron-core's transformer layer forward, with its token-local work done by sub-sequence chunks.

A GPT layer is token-local except for its core attention: the input norm, the QKV projection,
RoPE, the output projection, the residual adds, the pre-MLP norm and the MLP treat every token
on its own. :class:`ChunkedLayer` runs those parts over chunks of ``chunk_tokens`` local tokens
and only the core attention over the whole sequence, so the layer's transients (the gathered norm
output under sequence parallelism, the MLP's ``4h``-wide tensors, the projections' inputs) are
the size of a chunk, not of the sequence:

- ``pre_attention``: norm, QKV projection and RoPE of one chunk, giving its q / k / v rows,
  which ``place`` writes into the whole-sequence q / k / v;
- ``attention``: the core attention over the whole sequence;
- ``post_attention``: the output projection of the chunk's attention-output rows, the residual
  add, the pre-MLP norm, the MLP and its residual add: the chunk's rows of the layer output.

Under sequence parallelism the local tokens are this rank's shard and megatron's column- and
row-parallel layers all-gather / reduce-scatter over the tensor-parallel group along dimension
0, so a chunk all-gathers into ``[rank 0's rows of the chunk, rank 1's rows, ...]``: ``place``
writes those blocks where they belong in sequence order, and ``take`` hands the output
projection the attention output's rows in that same rank-by-rank order, so its reduce-scatter
gives each rank its own rows of the chunk.

``take`` and ``place`` are autograd nodes chained over a tensor's chunks, so that the tensor's
gradient is one buffer each chunk's backward fills in (row slicing alone would add up one
zero-padded whole-size gradient per chunk: quadratic work in the sequence).

Every value is megatron's ``TransformerLayer.forward``'s for the same input up to rounding:
each output row of a chunk's matrix product comes from the same row and weights as in the
whole-sequence product, but a BLAS may pick another kernel (summation order) for another row
count, and a weight's gradient sums the tokens chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from memo_ext.errors import UsageError


class ChunkingError(UsageError):
    """A layer or an input that sub-sequence chunking cannot run; the message says why."""


def chunk_bounds(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of ``tokens`` local tokens; the last may be shorter."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return [(s, min(s + chunk_tokens, tokens)) for s in range(0, tokens, chunk_tokens)]


def check_chunkable(layer: torch.nn.Module) -> None:
    """Refuse, in one sentence, a layer whose forward ``ChunkedLayer`` does not reproduce."""
    config = layer.config
    problems = []
    if not isinstance(layer.self_attention, SelfAttention):
        problems.append("its attention is not megatron's SelfAttention")
    if not isinstance(layer.mlp, MLP):
        problems.append("its MLP is not megatron's dense MLP (mixture of experts?)")
    if not isinstance(layer.cross_attention, (IdentityOp, IdentityFuncOp)):
        problems.append("it has cross-attention")
    if getattr(config, "attention_output_gate", False):
        problems.append("--attention-output-gate is set")
    if getattr(config, "fused_single_qkv_rope", False):
        problems.append("--fused-single-qkv-rope is set")
    if getattr(config, "multi_latent_attention", False):
        problems.append("it uses multi-latent attention")
    if problems:
        raise ChunkingError(f"--memo-chunk-tokens cannot chunk this layer: {'; '.join(problems)}")


@dataclass
class ChunkedLayer:
    """Forwards of ``layer`` (a megatron ``TransformerLayer``) in chunks (see the module
    docstring). ``kwargs`` are the layer's forward arguments; ``hidden_states`` gives the token
    count and is not kept (autograd nodes hold this object)."""

    layer: torch.nn.Module
    kwargs: dict[str, Any]
    chunk_tokens: int

    def __post_init__(self):
        if self.kwargs.get("packed_seq_params") is not None:
            raise ChunkingError(
                "--memo-chunk-tokens does not support packed sequences (RoPE positions restart "
                "per document); drop --memo-chunk-tokens or the packing"
            )
        self.tokens = self.kwargs["hidden_states"].size(0)
        """Local tokens (the input's dimension 0)."""
        self.kwargs = {k: v for k, v in self.kwargs.items() if k != "hidden_states"}
        self.groups = sp_groups(self.layer)
        """Blocks of a tensor gathered over the tensor-parallel group: its size under SP, else 1."""
        self.bounds = chunk_bounds(self.tokens, self.chunk_tokens)
        config = self.layer.config
        rope = self.kwargs.get("rotary_pos_emb")
        no_rope = config.no_rope_freq[self.layer.layer_number - 1] if config.no_rope_freq else False
        if rope is not None and not isinstance(rope, tuple):
            rope = (rope, rope)
        self.rope = None if no_rope else rope

    # ------------------------------------------------------------------------ the phases

    def pre_attention(self, rows: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
        """Input norm, QKV projection and RoPE of chunk ``chunk``, whose layer-input rows are
        ``rows``: the chunk's q, k and v (gathered rows under SP)."""
        start, stop = self.bounds[chunk]
        attention = self.layer.self_attention
        normed = self.layer.input_layernorm(rows)
        query, key, value = attention.get_query_key_value_tensors(normed, None, split_qkv=True)
        if self.rope is not None:
            config = self.layer.config
            mscale = _yarn_get_concentration_factor_from_config(config)
            cp = attention.pg_collection.cp
            q_rope, k_rope = (self._rope_rows(r, start, stop) for r in self.rope)
            if q_rope is not None:
                query = apply_rotary_pos_emb(
                    query, q_rope, config=config, mscale=mscale, cp_group=cp
                )
            if k_rope is not None:
                key = apply_rotary_pos_emb(key, k_rope, config=config, mscale=mscale, cp_group=cp)
        return query, key, value

    def attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The core attention over the whole sequence."""
        attention = self.layer.self_attention
        return attention.core_attention(
            query,
            key,
            value,
            self.kwargs.get("attention_mask"),
            attn_mask_type=attention.attn_mask_type,
            attention_bias=self.kwargs.get("attention_bias"),
            packed_seq_params=None,
        )

    def post_attention(self, rows: Tensor, attention_rows: Tensor) -> Tensor:
        """Output projection, residual adds, pre-MLP norm and MLP of one chunk, from its
        layer-input rows and its attention-output rows (see :meth:`rows`)."""
        layer, config = self.layer, self.layer.config
        projected = layer.self_attention.linear_proj(attention_rows)
        with layer.bias_dropout_add_exec_handler():
            hidden = layer.self_attn_bda(layer.training, config.bias_dropout_fusion)(
                projected, rows, layer.hidden_dropout
            )
        mlp_out = layer.mlp(layer.pre_mlp_layernorm(hidden))
        with layer.bias_dropout_add_exec_handler():
            return layer.mlp_bda(layer.training, config.bias_dropout_fusion)(
                mlp_out, hidden, layer.hidden_dropout
            )

    # ------------------------------------------------------------------- rows of a chunk

    def span(self, chunk: int, *, gathered: bool) -> _Span:
        """Where chunk ``chunk``'s rows are in a whole-sequence tensor (``gathered``: one
        gathered over the TP group under SP)."""
        start, stop = self.bounds[chunk]
        return _Span(start, stop, self.tokens, self.groups if gathered else 1)

    def rows(self, whole: Tensor, chunk: int, *, gathered: bool) -> Tensor:
        """Chunk ``chunk``'s rows of a whole-sequence tensor, as its phases take them: a view
        of the local rows, or (``gathered``, under SP) every rank's rows of the chunk, rank by
        rank (a copy)."""
        return self.span(chunk, gathered=gathered).rows(whole)

    def rows_view(self, whole: Tensor, chunk: int, *, gathered: bool) -> Tensor:
        """Chunk ``chunk``'s rows of ``whole`` as a view, ``[groups, rows, ...]`` under SP."""
        return self.span(chunk, gathered=gathered).view(whole)

    def take(self, whole: Tensor, chunk: int, *, gathered: bool) -> tuple[Tensor, Tensor]:
        """:meth:`rows` of ``whole`` and ``whole`` itself, through one autograd node: chain a
        tensor's chunks through ``take`` and its gradient is one buffer that each chunk's
        backward fills in (row slicing alone would add up one zero-padded whole-size
        gradient per chunk)."""
        return _Take.apply(whole, self.span(chunk, gathered=gathered))

    def place(self, whole: Tensor | None, part: Tensor, chunk: int, *, gathered: bool) -> Tensor:
        """Write ``part`` into chunk ``chunk``'s rows of ``whole`` (allocated at the first chunk)
        in place; the inverse of :meth:`rows`, with the same one-buffer gradient."""
        if whole is None:
            rows = self.tokens * (self.groups if gathered else 1)
            whole = part.new_empty((rows, *part.shape[1:]))
        return _Place.apply(whole, part, self.span(chunk, gathered=gathered))

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        """The forward on layer input ``x``, as ``TransformerLayer.forward`` returns it."""
        chunks = range(len(self.bounds))
        inputs, qkv = x, [None, None, None]
        for c in chunks:
            rows, inputs = self.take(inputs, c, gathered=False)
            parts = self.pre_attention(rows, c)
            qkv = [self.place(w, p, c, gathered=True) for w, p in zip(qkv, parts)]
        out = self.attention(*qkv)
        del qkv
        inputs, outputs, result = x, out, None
        for c in chunks:
            rows, inputs = self.take(inputs, c, gathered=False)
            attention_rows, outputs = self.take(outputs, c, gathered=True)
            part = self.post_attention(rows, attention_rows)
            result = self.place(result, part, c, gathered=False)
        return self.finish(result), None

    @staticmethod
    def finish(result: Tensor) -> Tensor:
        """The layer output as megatron returns it (not a view)."""
        return make_viewless_tensor(inp=result, requires_grad=result.requires_grad, keep_graph=True)

    def _rope_rows(self, table: Tensor | None, start: int, stop: int) -> Tensor | None:
        if table is None:
            return None
        if table.size(0) != self.groups * self.tokens:
            raise ChunkingError(
                f"the RoPE table has {table.size(0)} rows, expected {self.groups * self.tokens}"
            )
        return table.unflatten(0, (self.groups, self.tokens))[:, start:stop].flatten(0, 1)


@dataclass(frozen=True)
class _Span:
    """Rows ``[start, stop)`` of each of ``groups`` blocks of ``tokens`` rows."""

    start: int
    stop: int
    tokens: int
    groups: int

    def view(self, whole: Tensor) -> Tensor:
        if self.groups == 1:
            return whole[self.start : self.stop]
        return whole.unflatten(0, (self.groups, self.tokens))[:, self.start : self.stop]

    def rows(self, whole: Tensor) -> Tensor:
        view = self.view(whole)
        return view if self.groups == 1 else view.flatten(0, 1)


class _Take(torch.autograd.Function):
    """``(rows of a chunk, the whole)``; backward writes the rows' gradient into the whole's
    (zeros for the chain's last chunk, the first the backward reaches) and passes it on."""

    @staticmethod
    def forward(ctx, whole, span):
        ctx.span = span
        return span.rows(whole), whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad_rows, grad_whole):
        target = ctx.span.view(grad_whole)
        target.copy_(grad_rows.view(target.shape))
        return grad_whole, None


class _Place(torch.autograd.Function):
    """``whole`` with a chunk's rows overwritten by ``part``, in place; backward hands the
    part its rows of the gradient and passes the gradient on."""

    @staticmethod
    def forward(ctx, whole, part, span):
        ctx.span = span
        target = span.view(whole)
        target.copy_(part.view(target.shape))
        ctx.mark_dirty(whole)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.span.rows(grad), None


def sp_groups(layer) -> int:
    """Token blocks of tensors gathered over the TP group: the TP size under SP, else 1."""
    if not layer.config.sequence_parallel:
        return 1
    tp = layer.pg_collection.tp
    return tp.size() if tp is not None else 1
