"""MEMO: token-wise activation swapping and recomputation for every transformer layer.

Entry points: ``--memo`` on ``pretrain_gpt_memo.py`` (the trainer applies
:func:`memo_ext.memo.policy.apply_memo` to its layer spec), and
:func:`memo_ext.memo.policy.memo_trace_options` for traces of MEMO layers
(``tools/plan_memory.py --memo-alpha``). The design is in docs/memo.md.

Modules:
    policy: MEMO as a layer-spec policy; its per-step metrics; its traces.
    layer: the transformer layer and core attention that MEMO's spec builds.
    runtime: per-process state (α, host pool, transfer engine, ping-pong slots, prefetch).
    activations: one layer's saved tensors from its forward to its backward.
    tensors: saved-tensor metadata and token layouts.
    transfer: host buffers and device ↔ host copies (CUDA streams, or synchronous).
    alpha: MEMO's rule for α and the host-budget error.
"""
