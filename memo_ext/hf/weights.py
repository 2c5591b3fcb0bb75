"""Hugging Face causal-LM configs and tensors in this project's terms: trainer flags, and the
link between each HF tensor and megatron-core's GPT state-dict key.

Pure bookkeeping on dicts and tensors (no model, no files): :mod:`memo_ext.hf.checkpoint`
streams the tensors through these links. Families: ``llama`` (Llama 2 / 3 / 3.1, including
Llama 3.1's RoPE scaling), ``mistral`` and ``qwen2``, which share one layout (RMSNorm, SwiGLU, GQA,
RoPE; biases only in Qwen2's query / key / value projections), and ``gpt2`` (learned positions,
LayerNorm, tanh-GeLU MLP, biases everywhere, tied embeddings; its ``Conv1D`` weights are stored
transposed, ``[in, out]``).

megatron-core's layout, as the local layer spec builds it (``memo_ext.mcore.specs``):

- ``linear_qkv.weight`` ``[(heads + 2·groups)·d, h]``: per query group, that group's query heads,
  then its key head, then its value head (``[q_0 … q_{n-1}, k, v]`` for each group in turn);
- ``linear_fc1.weight`` ``[2·ffn, h]`` with SwiGLU: the gate half, then the up half
  (megatron's ``glu`` applies the activation to the first chunk);
- the embedding and output layer hold ``padded_vocab`` rows; the rows past the vocabulary are 0.

The keys are the module's own (``decoder.layers.0.input_layernorm.weight``); in the checkpoint
megatron-core's local spec stores the norms under transformer-engine's fused names
(``decoder.layers.self_attention.linear_qkv.layer_norm_weight``, layers stacked), so the
checkpoint's keys are those a transformer-engine model asks for too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memo_ext.errors import UsageError
from memo_ext.hf import FAMILIES
from memo_ext.shapes import ModelShape, embedding_rows

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}

VOCAB_DIVISIBLE_BY = 128
"""--make-vocab-size-divisible-by of an imported model (the trainer's default)."""

logger = logging.getLogger(__name__)

# megatron-core's Llama 3.1 scaling takes only the factor; the other three are fixed there
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_CONTEXT = 8192


@dataclass(frozen=True, kw_only=True)
class HFModel:
    """An HF causal LM as this project describes it: its family (which names its tensors), its
    :class:`~memo_ext.shapes.ModelShape` (the trainer's flags and the checkpoint's identity
    describe the same) and whether its output layer is the embedding."""

    family: str
    shape: ModelShape
    tied: bool

    @property
    def padded_vocab(self) -> int:
        """Embedding rows in our checkpoint (the trainer's padding rule, TP 1)."""
        return embedding_rows(self.shape.vocab_size, divisible_by=VOCAB_DIVISIBLE_BY)


def hf_model(config: dict) -> HFModel:
    """The model an HF ``config.json`` describes.

    Raises:
        UsageError: a family this tool does not convert, or a size that is missing or not a
            whole number (named).
    """
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UsageError(
            f"config.json's model_type is {family!r}; this tool converts {', '.join(FAMILIES)}"
        )
    if family == "gpt2":
        return _gpt2_model(config)
    hidden = whole_field(config, "hidden_size")
    heads = whole_field(config, "num_attention_heads")
    groups = whole_field(config, "num_key_value_heads", default=heads)
    if heads % groups:
        raise UsageError(
            f"config.json's num_attention_heads {heads} is not a multiple of its "
            f"num_key_value_heads {groups}"
        )
    if config.get("head_dim") is None and hidden % heads:
        raise UsageError(
            f"config.json's hidden_size {hidden} is not a multiple of its num_attention_heads "
            f"{heads}, and it gives no head_dim"
        )
    head_dim = whole_field(config, "head_dim", default=hidden // heads)
    shape = ModelShape(
        num_layers=whole_field(config, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=whole_field(config, "intermediate_size"),
        num_query_groups=groups,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2",
        position_embedding_type="rope",
        vocab_size=whole_field(config, "vocab_size"),
    )
    tied = _switch(config, "tie_word_embeddings", default=False)
    return HFModel(family=family, shape=shape, tied=tied)


def _gpt2_model(config: dict) -> HFModel:
    hidden, heads = whole_field(config, "n_embd"), whole_field(config, "n_head")
    if hidden % heads:
        raise UsageError(f"config.json's n_embd {hidden} is not a multiple of its n_head {heads}")
    shape = ModelShape(
        num_layers=whole_field(config, "n_layer"),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=whole_field(config, "n_inner", default=4 * hidden),
        normalization="LayerNorm",
        openai_gelu=True,
        position_embedding_type="learned_absolute",
        vocab_size=whole_field(config, "vocab_size"),
    )
    tied = _switch(config, "tie_word_embeddings", default=True)
    return HFModel(family="gpt2", shape=shape, tied=tied)


_MISSING = object()


def whole_field(config: dict, name: str, *, default=_MISSING) -> int:
    """``config[name]``, a whole number of at least 1 (``default`` when absent or null).

    Raises:
        UsageError: absent without a default, or not a whole number ≥ 1.
    """
    value = config.get(name)
    if value is None:
        if default is _MISSING:
            family = config.get("model_type")
            raise UsageError(f"config.json lacks {name}, which a {family} model needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"config.json's {name} is {value!r}; it must be a whole number ≥ 1")
    return value


def number_field(config: dict, name: str, *, default: float) -> float:
    """``config[name]``, a positive finite number (``default`` when absent or null).

    Raises:
        UsageError: not a positive finite number.
    """
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UsageError(f"config.json's {name} is {value!r}; it must be a positive number")
    return float(value)


def _switch(config: dict, name: str, *, default: bool) -> bool:
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UsageError(f"config.json's {name} is {value!r}; it must be true or false")
    return value


# ---------------------------------------------------------------------------------------------
# config.json → trainer flags
# ---------------------------------------------------------------------------------------------


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling dict, as transformers 4 (``rope_theta`` / ``rope_scaling``) or 5
    (``rope_parameters``) spells them; ``None`` for plain RoPE.

    Raises:
        UsageError: a base that is not a positive number, or a scaling that is not an object.
    """
    for name in ("rope_parameters", "rope_scaling"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise UsageError(f"config.json's {name} is {config[name]!r}; it must be an object")
    params = dict(config.get("rope_parameters") or {})
    theta = number_field({**config, **params}, "rope_theta", default=10000.0)
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return theta, None if kind == "default" else {**scaling, "rope_type": kind}


def _rope_flags(config: dict) -> list[str]:
    theta, scaling = rope_settings(config)
    if theta != int(theta):
        raise UsageError(f"rope_theta {theta} is not a whole number, which --rotary-base needs")
    flags = ["--position-embedding-type", "rope", "--rotary-base", str(int(theta))]
    if scaling is None:
        return flags
    if scaling["rope_type"] != "llama3":
        raise UsageError(
            f"rope_scaling of type {scaling['rope_type']!r} is not converted; only Llama 3.1's "
            "('llama3') maps onto --use-rope-scaling"
        )
    original = scaling.get("original_max_position_embeddings", _LLAMA3_ORIGINAL_CONTEXT)
    fixed = {**_LLAMA3_FIXED, "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT}
    given = {k: scaling.get(k, v) for k, v in _LLAMA3_FIXED.items()}
    given["original_max_position_embeddings"] = original
    if given != fixed:
        raise UsageError(
            f"rope_scaling {given} differs from megatron-core's fixed Llama 3.1 settings {fixed}; "
            "this model cannot be represented by --use-rope-scaling"
        )
    if scaling.get("factor") is None:
        raise UsageError("config.json's rope_scaling gives no factor, which Llama 3.1's needs")
    factor = number_field(scaling, "factor", default=1.0)
    return flags + ["--use-rope-scaling", "--rope-scaling-factor", str(factor)]


def trainer_flags(config: dict) -> list[str]:
    """``pretrain_gpt_memo.py``'s model flags for the model ``config`` describes.

    Raises:
        UsageError: a setting the trainer has no flag for (named).
    """
    model = hf_model(config)
    if model.family == "gpt2":
        return _gpt2_flags(config, model)
    shape = model.shape
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"hidden_act {act!r} is not converted; the llama family uses 'silu'")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UsageError("attention_bias / mlp_bias are not converted (no biases in this family)")
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        logger.warning(
            "sliding_window %s: attention here is full causal attention, the same as the "
            "model's for sequences up to that many tokens",
            config["sliding_window"],
        )
    flags = [
        "--num-layers", str(shape.num_layers),
        "--hidden-size", str(shape.hidden_size),
        "--ffn-hidden-size", str(shape.ffn_size),
        "--num-attention-heads", str(shape.num_attention_heads),
        "--group-query-attention",
        "--num-query-groups", str(shape.query_groups),
    ]  # fmt: skip
    if shape.kv_channels is not None:
        flags += ["--kv-channels", str(shape.kv_channels)]
    positions = whole_field(config, "max_position_embeddings", default=2048)
    flags += [
        "--normalization", "RMSNorm",
        "--norm-epsilon", repr(number_field(config, "rms_norm_eps", default=1e-6)),
        "--swiglu",
        "--disable-bias-linear",
        *(["--add-qkv-bias"] if shape.qkv_bias else []),
        *_rope_flags(config),
        "--max-position-embeddings", str(positions),
        "--make-vocab-size-divisible-by", str(VOCAB_DIVISIBLE_BY),
    ]  # fmt: skip
    if not model.tied:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def _gpt2_flags(config: dict, model: HFModel) -> list[str]:
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UsageError(f"activation_function {act!r} is not converted; GPT-2's is 'gelu_new'")
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(name):
            raise UsageError(
                f"{name} is not converted (megatron-core's attention has no such step)"
            )
    if config.get("scale_attn_weights") is False:
        raise UsageError("scale_attn_weights false is not converted (attention is scaled here)")
    if not model.tied:
        raise UsageError("a GPT-2 without tied embeddings is not converted")
    shape = model.shape
    flags = [
        "--num-layers", str(shape.num_layers),
        "--hidden-size", str(shape.hidden_size),
        "--ffn-hidden-size", str(shape.ffn_size),
        "--num-attention-heads", str(shape.num_attention_heads),
        "--normalization", "LayerNorm",
        "--norm-epsilon", repr(number_field(config, "layer_norm_epsilon", default=1e-5)),
        "--openai-gelu",
        "--position-embedding-type", "learned_absolute",
        "--max-position-embeddings", str(whole_field(config, "n_positions", default=1024)),
        "--make-vocab-size-divisible-by", str(VOCAB_DIVISIBLE_BY),
    ]  # fmt: skip
    return flags


def hf_config(*, family: str, run, vocab_size: int, base: dict | None = None) -> dict:
    """config.json of the model a run's flags describe, for ``family``; ``base`` (the source
    config of an imported checkpoint) gives the fields flags do not carry (token ids, …).

    Raises:
        UsageError: a model the family cannot describe.
    """
    if family not in FAMILIES:
        raise UsageError(f"--family must be one of {', '.join(FAMILIES)}, got {family!r}")
    shape, model = run.shape, run.model
    if model.apply_layernorm_1p:
        raise UsageError(f"a {family} model's norms are not zero-centred (--apply-layernorm-1p)")
    if family == "gpt2":
        return _gpt2_config(run, vocab_size=vocab_size, base=base)
    if not (shape.swiglu and shape.normalization == "RMSNorm" and shape.rotary):
        raise UsageError(f"a {family} model has RMSNorm, SwiGLU and RoPE; this checkpoint has not")
    if shape.add_bias_linear or shape.position_embedding_type != "rope":
        raise UsageError(f"a {family} model has no biases and plain RoPE; this checkpoint has not")
    if shape.add_qkv_bias != (family == "qwen2"):
        raise UsageError(
            f"a {family} model has {'' if family == 'qwen2' else 'no '}query / key / value "
            f"biases; this checkpoint has {'them' if shape.add_qkv_bias else 'none'}"
        )
    kept = ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window")
    config = {k: v for k, v in (base or {}).items() if k in kept}
    config.update(
        architectures=[ARCHITECTURES[family]],
        model_type=family,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.query_groups,
        head_dim=shape.head_dim,
        hidden_act="silu",
        rms_norm_eps=model.norm_epsilon,
        max_position_embeddings=model.max_position_embeddings,
        vocab_size=vocab_size,
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
        rope_theta=float(model.rotary_base),
        rope_scaling=_rope_scaling_dict(model),
    )
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


def _gpt2_config(run, *, vocab_size: int, base: dict | None) -> dict:
    shape, model = run.shape, run.model
    gpt2 = (
        shape.normalization == "LayerNorm"
        and shape.openai_gelu
        and shape.add_bias_linear
        and shape.position_embedding_type == "learned_absolute"
        and shape.query_groups == shape.num_attention_heads
        and shape.head_dim * shape.num_attention_heads == shape.hidden_size
        and not model.untie_embeddings_and_output_weights
    )
    if not gpt2:
        raise UsageError(
            "a gpt2 model has LayerNorm, --openai-gelu, biases, learned positions, one key / "
            "value head per query head and tied embeddings; this checkpoint has not"
        )
    kept = ("bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: v for k, v in (base or {}).items() if k in kept}
    config.update(
        architectures=[ARCHITECTURES["gpt2"]],
        model_type="gpt2",
        n_embd=shape.hidden_size,
        n_layer=shape.num_layers,
        n_head=shape.num_attention_heads,
        n_inner=shape.ffn_size,
        n_positions=model.max_position_embeddings,
        layer_norm_epsilon=model.norm_epsilon,
        activation_function="gelu_new",
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    return config


def _rope_scaling_dict(model) -> dict | None:
    if model.rotary_seq_len_interpolation_factor is not None:
        raise UsageError("--rotary-seq-len-interpolation-factor is not exported")
    if not model.use_rope_scaling:
        return None
    return {
        "rope_type": "llama3",
        "factor": model.rope_scaling_factor,
        **_LLAMA3_FIXED,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT,
    }


# ---------------------------------------------------------------------------------------------
# tensors: HF names ↔ megatron-core keys
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One megatron-core tensor and the HF tensors it is made of."""

    key: str
    """megatron-core state-dict key."""
    sources: tuple[str, ...]
    """HF tensor names, in the order ``to_mcore`` takes them."""
    to_mcore: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int) -> torch.Tensor:
    """HF's separate q ``[heads·d, …]``, k and v ``[groups·d, …]`` → megatron's interleaved
    ``[(heads + 2·groups)·d, …]`` (per group: its query heads, its key, its value)."""
    rest = q.shape[1:]
    per_group = [t.reshape(groups, -1, *rest) for t in (q, k, v)]  # [groups, n·d, …]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, *, heads: int, groups: int) -> list[torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[q, k, v]`` in HF's layout."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    grouped = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = grouped.split([heads // groups * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _same(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _vocab_rows(model: HFModel) -> tuple[Callable, Callable]:
    """Pad the vocabulary rows to the padded size with zeros / cut them back."""

    def pad(tensors):
        (table,) = tensors
        extra = model.padded_vocab - table.shape[0]
        return torch.cat([table, table.new_zeros(extra, *table.shape[1:])]) if extra else table

    return pad, lambda table: [table[: model.shape.vocab_size].contiguous()]


def llama_links(model: HFModel) -> list[Link]:
    """Every tensor of a Llama / Mistral / Qwen2 model, embedding first, output layer last."""
    pad, cut = _vocab_rows(model)
    shape = model.shape
    heads, groups = shape.num_attention_heads, shape.query_groups
    fuse = lambda ts: fuse_qkv(*ts, groups=groups)
    split = lambda t: split_qkv(t, heads=heads, groups=groups)
    gate_up = lambda ts: torch.cat(ts)
    halves = lambda t: [part.contiguous() for part in t.chunk(2)]
    keep = lambda t: [t]
    links = [Link("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), pad, cut)]
    for i in range(shape.num_layers):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        links += [
            Link(
                ours + "input_layernorm.weight", (theirs + "input_layernorm.weight",), _same, keep
            ),
            Link(
                ours + "self_attention.linear_qkv.weight",
                tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
                fuse,
                split,
            ),
            Link(
                ours + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), _same, keep
            ),
            Link(
                ours + "pre_mlp_layernorm.weight",
                (theirs + "post_attention_layernorm.weight",),
                _same,
                keep,
            ),
            Link(
                ours + "mlp.linear_fc1.weight",
                (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
                gate_up,
                halves,
            ),
            Link(ours + "mlp.linear_fc2.weight", (theirs + "mlp.down_proj.weight",), _same, keep),
        ]
        if shape.qkv_bias:
            biases = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            links.append(Link(ours + "self_attention.linear_qkv.bias", biases, fuse, split))
    links.append(Link("decoder.final_layernorm.weight", ("model.norm.weight",), _same, keep))
    if not model.tied:
        links.append(Link("output_layer.weight", ("lm_head.weight",), pad, cut))
    return links


def gpt2_links(model: HFModel, *, prefix: str = "transformer.") -> list[Link]:
    """Every tensor of a GPT-2 model; ``prefix``: ``""`` for files that name ``h.0…`` without
    it (OpenAI's original upload)."""
    pad, cut = _vocab_rows(model)
    shape = model.shape
    heads = shape.num_attention_heads
    keep = lambda t: [t]
    # Conv1D stores [in, out]; megatron's linear layers [out, in]
    flip = lambda ts: ts[0].t()
    unflip = lambda t: [t.t().contiguous()]
    # c_attn: [h, 3h] = [q | k | v] along the output; megatron interleaves them per head
    fuse_w = lambda ts: fuse_qkv(*ts[0].t().chunk(3), groups=heads)
    split_w = lambda t: [torch.cat(split_qkv(t, heads=heads, groups=heads)).t().contiguous()]
    fuse_b = lambda ts: fuse_qkv(*ts[0].chunk(3), groups=heads)
    split_b = lambda t: [torch.cat(split_qkv(t, heads=heads, groups=heads))]
    links = [
        Link("embedding.word_embeddings.weight", (prefix + "wte.weight",), pad, cut),
        Link("embedding.position_embeddings.weight", (prefix + "wpe.weight",), _same, keep),
    ]
    for i in range(shape.num_layers):
        ours, theirs = f"decoder.layers.{i}.", f"{prefix}h.{i}."
        pairs = [  # ours, theirs, the weight's to_mcore / to_hf, the bias's
            ("input_layernorm", "ln_1", _same, keep, _same, keep),
            ("self_attention.linear_qkv", "attn.c_attn", fuse_w, split_w, fuse_b, split_b),
            ("self_attention.linear_proj", "attn.c_proj", flip, unflip, _same, keep),
            ("pre_mlp_layernorm", "ln_2", _same, keep, _same, keep),
            ("mlp.linear_fc1", "mlp.c_fc", flip, unflip, _same, keep),
            ("mlp.linear_fc2", "mlp.c_proj", flip, unflip, _same, keep),
        ]
        for name, hf_name, w_in, w_out, b_in, b_out in pairs:
            links.append(Link(f"{ours}{name}.weight", (f"{theirs}{hf_name}.weight",), w_in, w_out))
            links.append(Link(f"{ours}{name}.bias", (f"{theirs}{hf_name}.bias",), b_in, b_out))
    links += [
        Link("decoder.final_layernorm.weight", (prefix + "ln_f.weight",), _same, keep),
        Link("decoder.final_layernorm.bias", (prefix + "ln_f.bias",), _same, keep),
    ]
    return links


def links_for(model: HFModel, *, names: set[str] | None = None) -> list[Link]:
    """The links of ``model``'s family; ``names``: the tensors of the files to read (a GPT-2
    upload may name them without the ``transformer.`` prefix)."""
    if model.family != "gpt2":
        return llama_links(model)
    bare = names is not None and "wte.weight" in names and "transformer.wte.weight" not in names
    return gpt2_links(model, prefix="" if bare else "transformer.")
