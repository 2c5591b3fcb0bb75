"""MEMO's traced device buffers are released: what a MEMO iteration keeps to its end is what a
plain one keeps, however many layers it has (a leak would grow with the layers)."""

from __future__ import annotations

import pytest

from memo_ext.mcore.specs import build_layer_spec
from memo_ext.mcore.transformer_config import traced_transformer_config
from memo_ext.memo.policy import memo_trace_options
from memo_ext.parallel import ParallelLayout
from memo_ext.planner.capture import trace_transformer_layer
from memo_ext.planner.trace import Free
from memo_ext.shapes import model_shape

SMALL = model_shape(
    "gpt-7b", num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256
)


def _kept_bytes(trace) -> int:
    freed = {event.id for event in trace.events if isinstance(event, Free)}
    return sum(event.size for event in trace.allocs if event.id not in freed)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_memo_iteration_keeps_no_more_than_plain(alpha, num_layers):
    config = traced_transformer_config(SMALL, layout=ParallelLayout(tp=2, sp=True))
    kwargs = dict(
        config=config, seq_length=256, micro_batch_size=1, num_layers=num_layers, vocab_size=1000
    )
    plain = trace_transformer_layer(**kwargs)
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    memo = trace_transformer_layer(**kwargs, **memo_trace_options(config, spec, alpha=alpha))
    # Plain keeps the SP gather buffer and the embedding / output-layer gradients; MEMO's
    # fetched, recomputed and offloaded device storages must all be released by then. Under
    # fake tensors a view made by set_ hid their release (7 tensors per layer kept to the end).
    assert _kept_bytes(memo) == _kept_bytes(plain)
