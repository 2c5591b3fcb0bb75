"""RoPE for context extension: a run's rotary settings in the form megatron-core 0.16.1 takes them.

megatron-core implements the three ways of stretching a RoPE model's context that Megatron-LM's
flags name; this module only hands them the run's settings:

- Llama 3.1's frequency scaling (``rope_scaling`` / ``rope_scaling_factor``) and linear position
  interpolation (``seq_len_interpolation_factor``) are ``GPTModel`` arguments, passed on to its
  ``RotaryEmbedding`` (:func:`rotary_arguments`);
- YaRN (``position_embedding_type="yarn"``): ``GPTModel`` builds its ``YarnRotaryEmbedding`` from
  ``yarn_*`` attributes of the config, which 0.16.1's ``TransformerConfig`` does not declare (it
  reads them with ``getattr`` and no default), and the attention multiplies q and k by YaRN's
  concentration factor whenever the config has ``yarn_rotary_scaling_factor``, whatever the
  position embedding. :class:`YarnTransformerConfig` declares them, so a YaRN model's config has
  them, no other config does, and ``dataclasses.replace`` keeps them.

The table is computed once per forward by the model and handed to every layer; whatever applies
RoPE on this project's side (MEMO's chunked layers, MEMO's recompute passes on a token slice)
slices that table and reads the concentration factor from the config, as megatron's attention does,
so every path rotates with the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.config import ModelConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """``TransformerConfig`` with the YaRN settings megatron-core 0.16.1's ``GPTModel`` and
    attention read off the config (see the module docstring); defaults are
    ``YarnRotaryEmbedding``'s."""

    yarn_rotary_scaling_factor: float = 1.0
    """Context-extension factor s."""
    yarn_original_max_position_embeddings: int = 4096
    """Context length before extension, in tokens."""
    yarn_beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept."""
    yarn_beta_slow: float = 1.0
    """Rotations over the original context below which a frequency is divided by s."""
    yarn_mscale: float = 1.0
    """Concentration factor's numerator coefficient."""
    yarn_mscale_all_dim: float = 0.0
    """Concentration factor's denominator coefficient."""
    yarn_correction_range_round_to_int: bool = True
    """Round the blended channel range to whole channels."""


def yarn_fields(model: ModelConfig) -> dict:
    """:class:`YarnTransformerConfig`'s fields from the run's flags."""
    return dict(
        yarn_rotary_scaling_factor=model.rotary_scaling_factor,
        yarn_original_max_position_embeddings=model.yarn_original_max_position_embeddings,
        yarn_beta_fast=model.yarn_beta_fast,
        yarn_beta_slow=model.yarn_beta_slow,
        yarn_mscale=model.mscale,
        yarn_mscale_all_dim=model.mscale_all_dim,
        yarn_correction_range_round_to_int=model.yarn_correction_range_round_to_int,
    )


def rotary_arguments(model: ModelConfig) -> dict:
    """``GPTModel``'s rotary arguments from the run's flags: base period, Llama 3.1 scaling and
    linear interpolation (``RotaryEmbedding`` reads all three; YaRN only the base)."""
    return dict(
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor,
    )
