"""Memory, time and MFU at any scale, MEMO's α rule on estimated figures, and a preflight.

- ``presets``: model shapes (the planner's GPT presets, Llama shapes) and devices.
- ``measure``: per-layer bytes and FLOPs of megatron-core layers on fake tensors.
- ``model``: ``estimate(...)`` of one configuration.
- ``search``: ``find_max_seq_length(...)`` over parallel layouts.
- ``preflight``: ``preflight(run)`` / ``check_preflight(run)`` for the trainer.
- ``paper_table``: the MEMO paper's table, reproduced (``python -m memo_ext.estimate.paper_table``).
"""
