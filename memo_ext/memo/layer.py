"""The transformer layer and core-attention classes that MEMO's spec builds.

:class:`MemoTransformerLayer` is megatron-core's ``TransformerLayer`` with one change: during
training, unless it is one of the last layers of its pipeline stage, its forward runs under the
shared :class:`~memo_ext.memo.runtime.MemoRuntime`. The core attention becomes a subclass of the
spec's own class (see :func:`memo_core_attention`) that lets the runtime observe it in the forward
and replace it by a stand-in in the recompute pass; parameters and state-dict keys are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from memo_ext.mcore.compat import transformer_layer_arguments
from memo_ext.memo.runtime import MemoRuntime


class MemoCoreAttentionMixin:
    """Mixed in front of a core-attention class; ``memo_pass`` is set by the layer for a pass."""

    memo_pass: Any = None

    def forward(self, query, key, value, *args, **kwargs):
        observer = self.memo_pass
        if observer is None:
            return super().forward(query, key, value, *args, **kwargs)

        def run():
            return super(MemoCoreAttentionMixin, self).forward(query, key, value, *args, **kwargs)

        return observer.core_attention(run, query, key, value)


_CORE_CLASSES: dict[type, type] = {}


def memo_core_attention(cls: type) -> type:
    """``cls`` with :class:`MemoCoreAttentionMixin` in front (one class per ``cls``)."""
    if issubclass(cls, MemoCoreAttentionMixin):
        return cls
    if cls not in _CORE_CLASSES:
        _CORE_CLASSES[cls] = type(f"Memo{cls.__name__}", (MemoCoreAttentionMixin, cls), {})
    return _CORE_CLASSES[cls]


class MemoTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose training forward runs under MEMO (see the module docstring)."""

    def __init__(self, *args, memo_runtime: MemoRuntime, vp_stage: int | None = None, **kwargs):
        super().__init__(*args, vp_stage=vp_stage, **kwargs)
        self.memo_runtime = memo_runtime
        pp_rank = get_pg_rank(self.pg_collection.pp)
        offset = get_transformer_layer_offset(self.config, vp_stage, pp_rank)
        self.memo_index = self.layer_number - offset - 1
        """0-based index of this layer within its pipeline stage."""
        self.memo_stage_layers = get_num_layers_to_build(
            self.config, vp_stage=vp_stage, pp_rank=pp_rank
        )
        keep = memo_runtime.config.kept_layers
        self.memo_offloads = self.memo_index < self.memo_stage_layers - keep
        """False for the last ``keep_last_layers`` layers of the stage: they keep activations."""
        if not isinstance(self.self_attention.core_attention, MemoCoreAttentionMixin):
            raise TypeError(
                "MemoTransformerLayer needs a core attention from memo_core_attention()"
            )
        memo_runtime.mode.check_layer(self)

    def forward(self, *args, **kwargs):
        kwargs = transformer_layer_arguments(args, kwargs)
        if not self._training_forward(kwargs):
            return super().forward(**kwargs)
        if not self.memo_offloads:
            # a kept layer's activations take the place of the ping-pong slots
            self.memo_runtime.before_kept_layer(self.memo_index)
            output = self.memo_runtime.mode.kept_forward(self, kwargs)
            self.memo_runtime.after_kept_layer(self.memo_index, output)
            return output
        return self.memo_runtime.forward_layer(self, kwargs)

    def _training_forward(self, kwargs: dict[str, Any]) -> bool:
        return (
            self.training
            and torch.is_grad_enabled()
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
        )

    def forward_plain(self, **kwargs):
        """megatron-core's forward, without MEMO (the runtime's passes call this)."""
        return TransformerLayer.forward(self, **kwargs)

    @contextlib.contextmanager
    def memo_pass(self, observer: Any) -> Iterator[None]:
        """Route the core attention through ``observer.core_attention`` for one pass."""
        core = self.self_attention.core_attention
        previous, core.memo_pass = core.memo_pass, observer
        try:
            yield
        finally:
            core.memo_pass = previous
