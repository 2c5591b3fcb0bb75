"""MEMO as a memory policy on layer specs, and what the trainer and the tools ask of it.

``apply_memo`` turns the project's GPT layer spec into one whose layers run MEMO;
``memo_step_metrics`` gives the per-iteration numbers for the console and the metrics file;
``memo_trace_options`` lets the planner trace MEMO layers without knowing MEMO.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from memo_ext.config import MemoConfig
from memo_ext.memo.layer import MemoTransformerLayer, memo_core_attention
from memo_ext.memo.runtime import MemoRuntime


def apply_memo(
    layer_spec: ModuleSpec, memo_config: MemoConfig, transformer_config: TransformerConfig
) -> ModuleSpec:
    """A copy of ``layer_spec`` whose layers run MEMO, sharing one new :class:`MemoRuntime`.

    Raises:
        UsageError: for settings MEMO cannot honour (hidden dropout, megatron's own
            recomputation or offloading, a layer without our core attention).
    """
    config = transformer_config
    MemoConfig.check_combination(
        hidden_dropout=config.hidden_dropout,
        recompute_granularity=config.recompute_granularity,
        attention_backend="te" if _is_te_spec(layer_spec) else "local",
        cpu_offloading=config.cpu_offloading,
        fine_grained_activation_offloading=config.fine_grained_activation_offloading,
    )
    if layer_spec.module is not TransformerLayer:
        raise ValueError(f"MEMO applies to TransformerLayer specs, got {layer_spec.module}")
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = memo_core_attention(attention.core_attention)
    spec.module = MemoTransformerLayer
    spec.params = {**spec.params, "memo_runtime": MemoRuntime(memo_config)}
    return spec


def _is_te_spec(spec: ModuleSpec) -> bool:
    core = spec.submodules.self_attention.submodules.core_attention
    return "transformer_engine" in getattr(core, "__module__", "")


def memo_runtime_of(model: torch.nn.Module) -> MemoRuntime | None:
    """The runtime shared by ``model``'s MEMO layers, or ``None`` without MEMO."""
    for module in model.modules():
        if isinstance(module, MemoTransformerLayer):
            return module.memo_runtime
    return None


def memo_step_metrics(model: torch.nn.Module) -> dict[str, float | int]:
    """MEMO's numbers since the last call (call once per iteration); empty without MEMO.

    Keys: ``memo_alpha``, ``host_offload_bytes`` (= ``memo_d2h_bytes``, bytes copied device →
    host), ``memo_h2d_bytes``, ``memo_recomputed_tokens`` (token positions × sequences),
    ``memo_offloaded_layers`` (layer forwards offloaded), ``memo_host_pool_bytes`` (host memory
    held), with ``--memo-chunk-tokens`` ``memo_device_skeletons`` (offloaded layers whose whole
    storages stay on the device for want of host memory), and on CUDA ``memo_copy_wait_s``
    (compute-stream stalls on copies).
    """
    runtime = memo_runtime_of(model)
    return runtime.take_metrics() if runtime is not None else {}


def format_memo_metrics(metrics: dict[str, float | int]) -> str:
    """A console fragment such as ``memo α 0.30 | host 12.0 MiB/it | recomputed 4,096 tok``."""
    if not metrics:
        return ""
    parts = [
        f"memo α {metrics['memo_alpha']:.2f}",
        f"host {metrics['host_offload_bytes'] / 2**20:.1f} MiB/it",
        f"recomputed {metrics['memo_recomputed_tokens']:,} tok",
    ]
    if "memo_copy_wait_s" in metrics:
        parts.append(f"copy wait {metrics['memo_copy_wait_s'] * 1e3:.1f} ms")
    return " | ".join(parts)


TRACE_HOST_MEMORY_GB = float(2**40)
"""Host budget of traced MEMO layers: none, in effect; a trace states what MEMO would use."""


def memo_trace_options(
    config: TransformerConfig,
    layer_spec: ModuleSpec,
    *,
    alpha: float,
    chunk_tokens: int | None = None,
) -> dict:
    """Keyword arguments of ``memo_ext.planner.capture.trace_transformer_layer`` that trace
    ``layer_spec`` under MEMO at a fixed ``alpha`` (by chunks of ``chunk_tokens`` if given).

    One traced layer object runs every pass, so every pass offloads (no kept last layers). MEMO's
    host buffers are host memory and are named for the trace to leave out; its device buffers,
    fetches and recomputation stay in it.
    """
    memo = MemoConfig(
        enabled=True,
        alpha=alpha,
        keep_last_layers=0,
        host_memory_gb=TRACE_HOST_MEMORY_GB,
        chunk_tokens=chunk_tokens,
    )
    meta = {"memo_alpha": alpha}
    if chunk_tokens is not None:
        meta["memo_chunk_tokens"] = chunk_tokens
    return {
        "layer_spec": apply_memo(layer_spec, memo, config),
        "host_storages": host_buffer_storages,
        "meta": meta,
    }


def host_buffer_storages(model: torch.nn.Module) -> set[int]:
    """Storage keys (``untyped_storage()._cdata``) of the host buffers MEMO holds for ``model``."""
    runtime = memo_runtime_of(model)
    if runtime is None or runtime.pool is None:
        return set()
    return {buf.data.untyped_storage()._cdata for buf in runtime.pool.buffers}
