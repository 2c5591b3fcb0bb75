"""Long-context GPT pretraining on megatron-core with MEMO and HotSPa.

Subpackages:
    training: the training loop on megatron-core (init, model, data, optimizer, logging).
    mcore: layer specs, attention backends and compatibility shims for megatron-core.
    offload: MEMO's token-wise activation swapping and recomputation.
    planner: allocation traces and the bi-level memory planner.
    allocator: the run-time side of a memory plan.
    hotspa: length buckets and parallelism hot switching.
    estimate: memory / time / MFU model at any scale.
"""

__version__ = "0.1.0"
