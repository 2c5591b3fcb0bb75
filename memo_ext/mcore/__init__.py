"""The only code that touches megatron-core's internals.

Modules:
    config: ``TransformerConfig`` of a model shape and a parallel layout, and back.
    specs: layer and block specs (our norm and core attention in megatron's local spec).
    attention: SDPA / flash-attn core attention with context parallelism and packed sequences.
    norms: LayerNorm / RMSNorm that mark their weights sequence-parallel.
    gpt: ``GPTModel`` with the output layer and loss run in sequence chunks (``--loss-chunks``).
    init: weights drawn independently of the parallel layout.
    packed: packed-sequence parameters and CP chunk positions of packed rows.
    groups: process groups of any layout; a model's CP group swapped (HotSPa, dynamic CP).
    compat: megatron-core on machines without CUDA (applied explicitly, behind a version check).
    tracing: layers on fake tensors in a fake world (the estimator's and the planner's traces).
    flop_count: FLOP counting of the CPU attention kernel.
"""
