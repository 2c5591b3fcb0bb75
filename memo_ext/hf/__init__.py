"""Hugging Face causal LMs ↔ this project's checkpoints: :mod:`memo_ext.hf.weights` maps configs
to trainer flags and HF tensors to megatron-core keys; :mod:`memo_ext.hf.checkpoint` streams them
(``python -m tools.convert_hf``). Above the trainer: it builds runs from flags and models with
``memo_ext.training``."""

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
"""Families that import and export (``model_type`` in config.json); here, not in ``weights``,
so that the converter's flags are checked before torch loads."""
