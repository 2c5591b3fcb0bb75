"""What one transformer layer holds and computes, measured on fake tensors.

A megatron-core layer built with the project's spec (``build_layer_spec``) runs forward and
backward under ``FakeTensorMode`` for one process of a TP (+ SP) layout, so nothing is
allocated: a 7B layer at 1M tokens takes a fraction of a second. Per method it yields

- the bytes autograd holds for the layer once its forward ends (unique storages of the saved
  tensors; parameters and the RoPE table, shared by every layer, excluded) and, for MEMO, the
  host bytes and the device bytes of one ping-pong slot of copy sources;
- the FLOPs of the forward and of the backward (recomputation included), split into attention
  and the rest (matrix products), counted by ``flop_counter_mode``;
- the largest total live at one time over a whole one-layer iteration (embedding, layer, loss,
  backward), the planner's lower bound on its trace.

Context parallelism is measured as a TP layout on the rank's ``s / cp`` tokens: torch's causal
bias object that our CPU CP path builds cannot be faked. That matches ring attention (the GPU
path: each rank saves its own q, k, v, output and log-sum-exp); the attention FLOPs are then
scaled by ``cp`` (each local query attends to ``cp`` times more keys, load-balanced).

The figures of one trace and the fits that scale two traces to any length are in
``memo_ext.estimate.fits``. Every trace is kept on disk by its inputs, the method and the code
(``memo_ext.estimate.trace_cache``); torch and megatron-core are imported by the traces
themselves, so a run whose figures are all found there imports neither here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memo_ext.estimate.fits import (
    LayerFigures,
    LayerFit,
    LiveFit,
    TransientFit,
    reference_tokens,
)
from memo_ext.estimate.trace_cache import cached
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape, embedding_rows

if TYPE_CHECKING:
    from memo_ext.estimate.stage import MemoryMethod

logger = logging.getLogger(__name__)

_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")


def _build_block(config, groups, *, method: MemoryMethod | None, settings: Any):
    """A one-layer ``TransformerBlock`` of ``method`` (``None``: the plain layer)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    from memo_ext.mcore.specs import build_layer_spec

    spec = build_layer_spec(config=config, attention_backend="sdpa")
    if method is not None:
        spec = method.layer_spec(spec, config, settings)
    submodules = TransformerBlockSubmodules(layer_specs=[spec], layer_norm=None)
    return TransformerBlock(config, submodules, post_process=False, pg_collection=groups)


def _split_flops(counter) -> tuple[int, int]:
    """(non-attention, attention) FLOPs of a finished ``FlopCounterMode``."""
    attention = other = 0
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        if any(name in str(op) for name in _ATTENTION_OPS):
            attention += flops
        else:
            other += flops
    return other, attention


def _rope_table(model: ModelShape, config, tokens: int):
    # Llama 3.1 scaling, interpolation and YaRN change the table's values, and YaRN multiplies
    # by a factor that plain RoPE multiplies by 1: the same tensors, bytes and FLOPs, so plain
    # RoPE's table stands for every rotary model
    if not model.rotary:
        return None
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(tokens)


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a logger while tracing: a traced MEMO layer reports its (fake) settings."""
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _shape_key(model: ModelShape, **call: Any) -> dict[str, Any]:
    """A traced figure's inputs as the disk cache keys them: every field of the model."""
    return {"model": dataclasses.asdict(model), **call}


def _int(value: Any) -> int:
    """A count read back from the disk cache (anything else there is a damaged file)."""
    if not isinstance(value, int):
        raise TypeError(f"a cached byte count must be an integer, got {value!r}")
    return value


def trace_layer(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    tokens: int,
    micro_batch_size: int,
    method: MemoryMethod | None = None,
    settings: Any = None,
    fp32: bool = False,
) -> LayerFigures:
    """Forward and backward of one layer of ``method`` on fake tensors (cached by the model,
    the layout, the method and its settings, in the process and on disk:
    ``memo_ext.estimate.trace_cache``).

    Args:
        model: the model shape (``num_layers`` is ignored: one layer is built).
        tp: tensor-parallel size; ``sp`` shards the layer input over it.
        tokens: tokens of one sequence on this process (``s / cp``).
        micro_batch_size: sequences per micro-batch.
        method: the memory method that builds the layer (``None``: the plain layer), with its
            ``settings`` (a hashable value, e.g. MEMO's ``MemoMethod.traced_layer``).
        fp32: trace in float32 instead of bf16 (to compare with a real CPU run).
    """
    # SP without TP is no SP: one trace for both spellings
    return _layer_figures(
        model, tp, sp and tp > 1, tokens, micro_batch_size, method, settings, fp32
    )


@functools.lru_cache(maxsize=512)
def _layer_figures(
    model: ModelShape,
    tp: int,
    sp: bool,
    tokens: int,
    micro_batch_size: int,
    method: MemoryMethod | None,
    settings: Any,
    fp32: bool,
) -> LayerFigures:
    """:func:`trace_layer` with SP normalised, from the disk cache or traced."""
    key = _shape_key(
        model, tp=tp, sp=sp, tokens=tokens, micro_batch_size=micro_batch_size, fp32=fp32
    )
    return cached(
        "layer",
        key,
        lambda: _trace_layer(model, tp, sp, tokens, micro_batch_size, method, settings, fp32),
        encode=dataclasses.asdict,
        decode=lambda value: LayerFigures(**{k: _int(v) for k, v in value.items()}),
        method=method,
        settings=settings,
    )


def _trace_layer(
    model: ModelShape,
    tp: int,
    sp: bool,
    tokens: int,
    micro_batch_size: int,
    method: MemoryMethod | None,
    settings: Any,
    fp32: bool,
) -> LayerFigures:
    """The trace behind :func:`trace_layer` (megatron-core imported here, when first needed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.mcore.flop_count import flop_counter_mode
    from memo_ext.mcore.tracing import fake_process_groups, tracing_environment
    from memo_ext.mcore.transformer_config import traced_transformer_config
    from memo_ext.memo.policy import memo_runtime_of, memo_step_metrics

    config = traced_transformer_config(
        model,
        layout=ParallelLayout(tp=tp, sp=sp),
        fp32=fp32,
        num_layers=1,
        **(method.layer_config(settings) if method is not None else {}),
    )
    local = tokens // tp if sp else tokens
    with (
        warnings.catch_warnings(),
        _quiet("memo_ext.memo"),
        fake_process_groups(tp=tp, cp=1) as groups,
        tracing_environment(),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        warnings.simplefilter("ignore")
        block = _build_block(config, groups, method=method, settings=settings)
        x = torch.empty(local, micro_batch_size, model.hidden_size, dtype=config.params_dtype)
        x.requires_grad_(True)
        rope = _rope_table(model, config, tokens)
        # parameters and the RoPE table (one tensor shared by every layer) are not activations
        excluded = {p.untyped_storage()._cdata for p in block.parameters()}
        if rope is not None:
            excluded.add(rope.untyped_storage()._cdata)
        saved: dict[int, int] = {}

        def count(t):
            key = t.untyped_storage()._cdata
            if key not in excluded:
                saved[key] = t.untyped_storage().nbytes()
            return t.detach()

        hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
        with flop_counter_mode() as forward_counter, hooks:
            out = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        held, slot = sum(saved.values()), 0
        runtime = memo_runtime_of(block)
        if runtime is not None:  # MEMO's own hook shadows the counter: its ledger says what stays
            held = sum(acts.device_bytes() for acts in runtime.live)
            slot = runtime.slot_bytes
        with flop_counter_mode() as backward_counter:
            out.backward(torch.ones_like(out))
        host = memo_step_metrics(block).get("host_offload_bytes", 0)
        params = sum(p.numel() for p in block.parameters())
    fwd_other, fwd_attention = _split_flops(forward_counter)
    bwd_other, bwd_attention = _split_flops(backward_counter)
    return LayerFigures(
        saved_bytes=held,
        input_bytes=x.numel() * x.element_size(),
        host_bytes=host,
        slot_bytes=slot,
        forward_matmul_flops=fwd_other,
        forward_attention_flops=fwd_attention,
        backward_matmul_flops=bwd_other,
        backward_attention_flops=bwd_attention,
        param_count=params,
    )


@functools.lru_cache(maxsize=256)
def layer_max_live_bytes(
    model: ModelShape, *, tp: int, sp: bool, tokens: int, micro_batch_size: int
) -> int:
    """Largest total live at one time over one layer's forward and backward (no recompute).

    From the planner's fake-tensor trace and its lower bound (no plan can peak below it); the
    layer input is pre-existing and not counted, its saved tensors are.
    """

    def trace() -> int:
        from memo_ext.mcore.transformer_config import traced_transformer_config
        from memo_ext.planner.capture import trace_transformer_layer

        layout = ParallelLayout(tp=tp, sp=sp)
        config = traced_transformer_config(model, layout=layout, num_layers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = trace_transformer_layer(
                config=config, seq_length=tokens, micro_batch_size=micro_batch_size
            )
        return _max_live(trace)

    key = _shape_key(model, tp=tp, sp=sp, tokens=tokens, micro_batch_size=micro_batch_size)
    return cached("layer_max_live", key, trace, encode=int, decode=_int)


def _max_live(trace) -> int:
    from memo_ext.planner.problem import lower_bound, problem_from_trace

    _, problem = problem_from_trace(trace)
    return int(lower_bound(problem))


@functools.lru_cache(maxsize=256)
def loss_max_live_bytes(
    model: ModelShape, *, tp: int, sp: bool, tokens: int, micro_batch_size: int
) -> int:
    """Largest total live over the output end: final norm, output layer, megatron's loss.

    megatron-core's ``vocab_parallel_cross_entropy`` runs on the bf16 logits
    ``[s, b, vocab / tp]``, casts them to fp32 and saves the fp32 softmax for backward; at long
    sequences this end outweighs a layer (7B, 1M tokens, TP 8: 12 GiB of bf16 logits and 25 GiB
    of fp32 softmax per process). The final hidden state is pre-existing, not counted.
    """
    sp = sp and tp > 1
    key = _shape_key(model, tp=tp, sp=sp, tokens=tokens, micro_batch_size=micro_batch_size)
    return cached(
        "loss_max_live",
        key,
        lambda: _trace_loss(model, tp=tp, sp=sp, tokens=tokens, micro_batch_size=micro_batch_size),
        encode=int,
        decode=_int,
    )


def _trace_loss(model: ModelShape, *, tp: int, sp: bool, tokens: int, micro_batch_size: int):
    """The trace behind :func:`loss_max_live_bytes`."""
    import torch
    from megatron.core import tensor_parallel
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.mcore.tracing import fake_parallel_state
    from memo_ext.planner.capture import trace_module

    h, b = model.hidden_size, micro_batch_size
    padded = embedding_rows(model.vocab_size, tp_sizes=(tp,))
    with warnings.catch_warnings(), fake_parallel_state(tp):
        warnings.simplefilter("ignore")
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(tokens // tp if sp else tokens, b, h, dtype=torch.bfloat16)
            x.requires_grad_(True)
            norm = torch.nn.Parameter(torch.empty(h, dtype=torch.bfloat16))
            weight = torch.nn.Parameter(torch.empty(padded // tp, h, dtype=torch.bfloat16))
            labels = torch.zeros(tokens, b, dtype=torch.long)

            def run(recorder) -> None:
                y = torch.nn.functional.layer_norm(x, (h,), norm)
                if sp:  # [s/tp, b, h] -> [s, b, h], as the output layer gathers under SP
                    y = tensor_parallel.gather_from_sequence_parallel_region(y)
                logits = torch.nn.functional.linear(y, weight)  # [s, b, vocab/tp], bf16
                loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
                loss.sum().backward()

            trace = trace_module(run)
    return _max_live(trace)


@functools.lru_cache(maxsize=256)
def chunked_layer_max_live_bytes(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    tokens: int,
    micro_batch_size: int,
    alpha: float,
    chunk_tokens: int,
) -> int:
    """Largest total live over one chunked MEMO layer's forward and backward (its restored
    data and recomputation included, host buffers not), from the planner's trace."""
    sp = sp and tp > 1

    def trace() -> int:
        from memo_ext.mcore.specs import build_layer_spec
        from memo_ext.mcore.transformer_config import traced_transformer_config
        from memo_ext.memo.policy import memo_trace_options
        from memo_ext.planner.capture import trace_transformer_layer

        layout = ParallelLayout(tp=tp, sp=sp)
        config = traced_transformer_config(model, layout=layout, num_layers=1)
        spec = build_layer_spec(config=config, attention_backend="sdpa")
        options = memo_trace_options(config, spec, alpha=alpha, chunk_tokens=chunk_tokens)
        with warnings.catch_warnings(), _quiet("memo_ext.memo"):
            warnings.simplefilter("ignore")
            trace = trace_transformer_layer(
                config=config, seq_length=tokens, micro_batch_size=micro_batch_size, **options
            )
        return _max_live(trace)

    key = _shape_key(
        model,
        tp=tp,
        sp=sp,
        tokens=tokens,
        micro_batch_size=micro_batch_size,
        alpha=alpha,
        chunk_tokens=chunk_tokens,
    )
    return cached("chunked_layer_max_live", key, trace, encode=int, decode=_int)


@functools.lru_cache(maxsize=512)
def layer_fit(
    model: ModelShape,
    *,
    tp: int,
    sp: bool,
    micro_batch_size: int,
    method: MemoryMethod | None = None,
    settings: Any = None,
) -> LayerFit:
    """Traces ``method`` at two lengths and returns the exact scaling rule."""
    granule = method.trace_granule(settings) if method is not None else None
    t1 = reference_tokens(tp=tp, sp=sp, chunk_tokens=granule)
    kw = dict(tp=tp, sp=sp, micro_batch_size=micro_batch_size, method=method, settings=settings)
    return LayerFit(
        t1=t1,
        low=trace_layer(model, tokens=t1, **kw),
        high=trace_layer(model, tokens=2 * t1, **kw),
    )


@functools.lru_cache(maxsize=256)
def transient_fit(model: ModelShape, *, tp: int, sp: bool, micro_batch_size: int) -> TransientFit:
    """Traces the layer and the output end at the reference length."""
    t = reference_tokens(tp=tp, sp=sp)
    kw = dict(tp=tp, sp=sp, tokens=t, micro_batch_size=micro_batch_size)
    layer = trace_layer(model, **kw)
    return TransientFit(
        layer_per_token=(layer_max_live_bytes(model, **kw) - layer.saved_bytes) / t,
        loss_per_token=loss_max_live_bytes(model, **kw) / t,
    )


@functools.lru_cache(maxsize=256)
def chunked_live_fit(
    model: ModelShape, *, tp: int, sp: bool, micro_batch_size: int, alpha: float, chunk_tokens: int
) -> LiveFit:
    """:func:`chunked_layer_max_live_bytes` at any token count (affine at whole chunks: every
    tensor is a chunk's or the whole sequence's)."""
    t1 = reference_tokens(tp=tp, sp=sp, chunk_tokens=chunk_tokens)
    kw = dict(
        tp=tp, sp=sp, micro_batch_size=micro_batch_size, alpha=alpha, chunk_tokens=chunk_tokens
    )
    return LiveFit(
        t1=t1,
        low=chunked_layer_max_live_bytes(model, tokens=t1, **kw),
        high=chunked_layer_max_live_bytes(model, tokens=2 * t1, **kw),
    )
