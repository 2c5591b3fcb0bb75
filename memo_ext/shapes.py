"""One GPT model shape, its presets, its padded vocabulary and its FLOP count.

:class:`ModelShape` is the project's single description of a decoder-only transformer's size: the
trainer's model flags are generated from it, the estimator, the planner and the memory report
take it, ``memo_ext.mcore.transformer_config`` converts it to and from megatron-core's
``TransformerConfig``, a checkpoint's identity record is written from it
(``memo_ext.training.checkpoint.identity``) and the Hugging Face converter reads a
``config.json`` into it (``memo_ext.hf.weights.HFModel``). The presets are the MEMO paper's GPT
models and Llama 1 / 2 / 3 shapes.

This module imports nothing else from the package (but ``memo_ext.errors``), so every subsystem
can build on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from memo_ext.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of one decoder-only GPT, in megatron-core's terms (see the module docstring)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int | None = None
    """MLP width (per branch with --swiglu); if unset, Megatron-LM's: 4h, and with --swiglu
    8h/3 rounded down to a multiple of 64."""
    num_query_groups: int | None = field(
        default=None, metadata={"requires": "--group-query-attention"}
    )
    """Key/value heads (GQA), given with --group-query-attention as in Megatron-LM (where the
    number counts only with that switch); as many as the query heads if unset."""
    kv_channels: int | None = None
    """Head dim; h / heads if unset."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm of each layer and the final norm."""
    swiglu: bool = False
    """Gated SiLU MLP (three matrices) instead of GeLU (two)."""
    openai_gelu: bool = False
    """GeLU by its tanh approximation (GPT-2's) instead of the exact erf form."""
    add_bias_linear: bool = field(default=True, metadata={"flag": "--disable-bias-linear"})
    """Biases in the linear layers; --disable-bias-linear drops them."""
    add_qkv_bias: bool = False
    """Biases in the query / key / value projection even with --disable-bias-linear (Qwen2);
    implied by the linear layers' biases, as Megatron-LM's ``validate_args`` sets it."""
    position_embedding_type: Literal["learned_absolute", "rope", "yarn"] = "learned_absolute"
    """Learned absolute positions (a [seq, h] table), rotary embeddings, or rotary embeddings
    with YaRN's frequency and attention scaling for context extension (--rotary-scaling-factor,
    --yarn-*)."""
    vocab_size: int = field(default=0, metadata={"cli": False})
    """Tokenizer vocabulary before padding (0 while no tokenizer has set it)."""
    untie_embeddings_and_output_weights: bool = field(default=False, metadata={"cli": False})
    """An output layer of its own (Llama's) rather than the input embedding reused: set by a
    preset, or by --untie-embeddings-and-output-weights when a run is resolved."""
    name: str = field(default="custom", metadata={"cli": False})
    """Preset name, or ``custom``."""

    # Unset sizes stay None rather than being filled in: a preset with another width or head
    # count (``model_shape("gpt-7b", num_attention_heads=8)``) keeps following the rule.

    @property
    def ffn_size(self) -> int:
        """MLP width: ``ffn_hidden_size``, else Megatron-LM's default (``validate_args``): 4h,
        and with SwiGLU two thirds of it (the same parameters in three matrices as the GeLU
        MLP's in two) rounded down to a multiple of 64."""
        return self.ffn_hidden_size or default_ffn_size(self.hidden_size, swiglu=self.swiglu)

    @property
    def qkv_bias(self) -> bool:
        """Whether the query / key / value projection has a bias (megatron-core gives it one
        when ``add_bias_linear or add_qkv_bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary(self) -> bool:
        """Positions by rotary embeddings (RoPE or YaRN: the same tensors, other table values)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def check(self) -> None:
        """Refuse a shape megatron-core cannot build, naming the flag to change.

        Raises:
            UsageError: one sentence.
        """
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "num_query_groups",
            "kv_channels",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{_flag(name)} must be at least 1, got {value}")
        heads, groups = self.num_attention_heads, self.query_groups
        if self.kv_channels is None and self.hidden_size % heads:
            raise UsageError(
                f"--hidden-size {self.hidden_size} is not divisible by {heads} attention heads; "
                "change one or give --kv-channels"
            )
        if self.openai_gelu and self.swiglu:
            raise UsageError("--openai-gelu is the GeLU MLP's activation; drop it or --swiglu")
        if heads % groups:
            raise UsageError(
                f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}"
            )


def default_ffn_size(hidden_size: int, *, swiglu: bool) -> int:
    """Megatron-LM's MLP width when --ffn-hidden-size is not given (``validate_args``): 4h, and
    with SwiGLU two thirds of it rounded down to a multiple of 64."""
    if swiglu:
        return int(4 * hidden_size * 2 / 3 / 64) * 64
    return 4 * hidden_size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    # the MEMO paper's models: GeLU MLP of 4h, LayerNorm, biases, GPT-2's vocabulary; RoPE, since
    # a learned position table at 1M tokens would alone hold 4B parameters for a 7B model
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=50257,
        position_embedding_type="rope",
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    groups=None,
    *,
    vocab: int = 32000,
    untied: bool = False,
) -> ModelShape:
    # Llama 1 / 2 shapes (Touvron et al. 2023, table 1 / 2 of the Llama 2 paper): 32k vocabulary;
    # Llama 3's (Meta's config.json files): 128,256 tokens and an output layer of its own
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        num_query_groups=groups,
        vocab_size=vocab,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=untied,
    )


LLAMA3_VOCAB = 128256


MODELS: dict[str, ModelShape] = {
    "gpt-7b": _gpt("gpt-7b", 32, 4096, 32),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-30b": _gpt("gpt-30b", 48, 7168, 56),
    "gpt-65b": _gpt("gpt-65b", 80, 8192, 64),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824),
    "llama-30b": _llama("llama-30b", 60, 6656, 52, 17920),  # Llama 1's "33B"
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, groups=8),
    "llama3-8b": _llama(
        "llama3-8b", 32, 4096, 32, 14336, groups=8, vocab=LLAMA3_VOCAB, untied=True
    ),
    "llama3-70b": _llama(
        "llama3-70b", 80, 8192, 64, 28672, groups=8, vocab=LLAMA3_VOCAB, untied=True
    ),
}
"""Presets by name."""


def model_shape(name: str, **overrides) -> ModelShape:
    """A preset with fields replaced by the non-``None`` ``overrides``.

    Raises:
        UsageError: for an unknown preset name.
    """
    if name not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(MODELS[name], **changes)


def embedding_rows(
    vocab_size: int, *, divisible_by: int = 128, tp_sizes: Iterable[int] = (1,)
) -> int:
    """The embedding rows this trainer gives a vocabulary: the smallest multiple of
    lcm(``divisible_by``, every TP degree of the run) that holds it, so that every layout a run
    uses (HotSPa's too) splits one and the same table. The run's resolution, the estimator, the
    planner's traces and the converters all pad by this rule; Megatron-LM's own
    (``divisible_by`` × TP, :func:`padded_vocab_size`) is read only from its checkpoints."""
    return padded_vocab_size(vocab_size, divisible_by=math.lcm(divisible_by, *tp_sizes))


def padded_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp_size: int = 1) -> int:
    """The embedding rows of a vocabulary: the smallest multiple of ``divisible_by · tp_size``
    that holds it (Megatron-LM's ``--make-vocab-size-divisible-by`` rule).

    Raises:
        ValueError: for a non-positive multiple.
    """
    if divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"divisible_by and tp_size must be positive, got {divisible_by} and {tp_size}."
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def forward_flops(
    shape: ModelShape,
    *,
    seq_length: int,
    sequences: int,
    vocab_size: int | None = None,
    causal_fraction: float = 0.5,
) -> float:
    """Forward FLOPs of ``sequences`` samples of ``seq_length`` tokens through the whole model.

    Model FLOPs only (recomputation does not count), attention included. ``causal_fraction`` is
    the share of the ``s × s`` attention products that is computed: 0.5 for a causal kernel that
    skips the masked half, 1.0 to count the full matrices. ``vocab_size`` is the output layer's
    width (default: the shape's vocabulary).
    """
    h, s, layers = shape.hidden_size, seq_length, shape.num_layers
    heads, groups, d = shape.num_attention_heads, shape.query_groups, shape.head_dim
    tokens = sequences * s
    qkv = 2 * tokens * h * (heads + 2 * groups) * d
    # QK^T and PV, each 2·s·s·d per head, of which the causal kernel computes a fraction
    attention = 2 * (2 * sequences * heads * s * s * d) * causal_fraction
    proj = 2 * tokens * heads * d * h
    mlp = 2 * tokens * h * shape.ffn_size * (3 if shape.swiglu else 2)
    logits = 2 * tokens * h * (shape.vocab_size if vocab_size is None else vocab_size)
    return layers * (qkv + attention + proj + mlp) + logits


def train_flops(shape: ModelShape, **kwargs) -> float:
    """Forward + backward (twice the forward) model FLOPs; see :func:`forward_flops`."""
    return 3.0 * forward_flops(shape, **kwargs)


def packed_train_flops(
    shape: ModelShape, *, document_lengths: list[int], vocab_size: int | None = None
) -> float:
    """Training FLOPs of packed documents: each attends only within itself, so the attention
    term is per document while everything else is per token."""
    return sum(
        train_flops(shape, seq_length=n, sequences=1, vocab_size=vocab_size)
        for n in document_lengths
    )
