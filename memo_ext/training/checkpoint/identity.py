"""The model a checkpoint holds, as its identity (its :class:`~memo_ext.shapes.ModelShape`,
padded vocabulary and tied head) and the flags that would rebuild it: written with every save,
compared before every load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from memo_ext.errors import UsageError
from memo_ext.mcore.transformer_config import model_shape_of
from memo_ext.shapes import ModelShape
from memo_ext.training.checkpoint.source import MANIFEST, MODEL_FLAGS_FILE

logger = logging.getLogger(__name__)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``sharded_state_dict`` megatron defines (under DDP / Float16Module)."""
    while not hasattr(model, "sharded_state_dict") or hasattr(model, "zero_grad_buffer"):
        model = model.module
    return model


def model_identity(model: torch.nn.Module) -> dict:
    """What a checkpoint's weights are the weights of, beyond their shapes: written to its
    manifest and compared on load, so that weights that happen to fit another model (a padded
    vocabulary, a norm without its bias) are not loaded into it. It is the model's
    :class:`~memo_ext.shapes.ModelShape` as megatron-core built it (:func:`identity_of`)."""
    gpt = model
    while not hasattr(gpt, "position_embedding_type") and hasattr(gpt, "module"):
        gpt = gpt.module
    config = gpt.config
    return identity_of(
        model_shape_of(config, position_embedding_type=gpt.position_embedding_type),
        zero_centred_norms=bool(config.layernorm_zero_centered_gamma),
        embedding_rows=gpt.vocab_size,
        tied=bool(gpt.share_embeddings_and_output_weights),
    )


def identity_of(
    shape: ModelShape, *, zero_centred_norms: bool, embedding_rows: int, tied: bool
) -> dict:
    """The identity record of a model of ``shape``: facts of the weights, not how the flags
    were spelt. Sizes are resolved: ``ffn_hidden_size`` by Megatron-LM's default where no flag
    gave it (``ModelShape.ffn_size``, the width megatron-core is given), ``num_query_groups`` and
    ``kv_channels`` as megatron-core fills them in; a QKV bias is there or not
    (``--add-qkv-bias`` beside the linear layers' biases changes nothing); YaRN rescales RoPE's
    table, not its weights, so a RoPE checkpoint extends to YaRN. The keys are those every
    manifest has recorded."""
    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": shape.ffn_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.query_groups,
        "kv_channels": shape.head_dim,
        "normalization": shape.normalization,
        "layernorm_zero_centered_gamma": zero_centred_norms,
        "activation": "silu" if shape.swiglu else "openai_gelu" if shape.openai_gelu else "gelu",
        "gated_linear_unit": shape.swiglu,
        "add_bias_linear": shape.add_bias_linear,
        "qkv_bias": shape.qkv_bias,
        "position_embedding_type": "rope" if shape.rotary else shape.position_embedding_type,
        "padded_vocab_size": embedding_rows,
        "tied_embeddings": tied,
    }


def check_model_identity(directory: Path, model: torch.nn.Module, saved: dict | None) -> bool:
    """Refuse a checkpoint of another model (``saved``: the identity it records), naming each
    difference; True when the checkpoint records its model (one written before the manifest did
    is not checked: False)."""
    problem = another_model(directory, saved=saved, here=model_identity(model))
    if problem is not None:
        raise UsageError(problem)
    return isinstance(saved, dict)


def another_model(directory: Path, *, saved: dict | None, here: dict) -> str | None:
    """The sentence that refuses the checkpoint in ``directory`` when the model it records
    (``saved``) is not ``here``, each difference named with the flag that changes it and the
    checkpoint's own model flags pointed at; None when it is the same model or records none."""
    if not isinstance(saved, dict):
        return None
    saved = normalized_identity(saved)
    differences = [
        f"{key} {saved[key]} there, {here[key]} here ({_hint(key, saved=saved, here=here)})"
        for key in here
        if key in saved and saved[key] != here[key]
    ]
    if not differences:
        return None
    flags_file = directory.parent / MODEL_FLAGS_FILE
    which = f" ({flags_file} lists them)" if flags_file.is_file() else ""
    return (
        f"the checkpoint in {directory} holds another model: {'; '.join(differences)}; "
        f"load it with the model flags it was trained with{which}"
    )


def recorded_identity(directory: Path) -> dict | None:
    """The model the manifest in ``directory`` records, read before anything is verified;
    None without a readable one (the load's verification then names what is wrong)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return manifest.get("model") if isinstance(manifest, dict) else None


def normalized_identity(record: dict) -> dict:
    """A model record as :func:`model_identity` writes it now: one written before it recorded
    whether QKV has a bias (``add_qkv_bias``, a flag's value) says it the current way."""
    record = dict(record)
    if "add_qkv_bias" in record and "qkv_bias" not in record:
        record["qkv_bias"] = bool(record.pop("add_qkv_bias") or record.get("add_bias_linear"))
    record.pop("add_qkv_bias", None)
    return record


def _hint(key: str, *, saved: dict, here: dict) -> str:
    """What to change so that this run's ``key`` is the checkpoint's. A QKV bias that the
    linear layers' biases bring (``qkv_bias`` follows ``add_bias_linear`` where that differs
    too) is changed by their flag, not by an ``--add-qkv-bias`` the run never gave."""
    linear = here["add_bias_linear"]
    if key == "qkv_bias" and saved.get("add_bias_linear", linear) != linear:
        key = "add_bias_linear"
    return _IDENTITY_FLAGS[key](saved[key])


def _switch(flag: str, *, on: bool = True) -> Callable[[bool], str]:
    """The hint for a model fact a switch sets: add it where the checkpoint has the fact."""
    return lambda there: f"{'give' if bool(there) == on else 'drop'} {flag}"


_IDENTITY_FLAGS: dict[str, Callable[[object], str]] = {
    "num_layers": lambda v: f"--num-layers {v}",
    "hidden_size": lambda v: f"--hidden-size {v}",
    "ffn_hidden_size": lambda v: f"--ffn-hidden-size {v}",
    "num_attention_heads": lambda v: f"--num-attention-heads {v}",
    "num_query_groups": lambda v: f"--group-query-attention --num-query-groups {v}",
    "kv_channels": lambda v: f"--kv-channels {v}",
    "normalization": lambda v: f"--normalization {v}",
    "layernorm_zero_centered_gamma": _switch("--apply-layernorm-1p"),
    "activation": lambda v: {"silu": "give --swiglu", "openai_gelu": "give --openai-gelu"}.get(
        v, "drop --swiglu / --openai-gelu"
    ),  # fmt: skip
    "gated_linear_unit": _switch("--swiglu"),
    "add_bias_linear": _switch("--disable-bias-linear", on=False),
    "qkv_bias": _switch("--add-qkv-bias"),
    "position_embedding_type": lambda v: f"--position-embedding-type {v}",
    "padded_vocab_size": lambda v: (
        f"{v} rows: the vocabulary comes from the tokenizer, padded to "
        "--make-vocab-size-divisible-by; use the tokenizer it was trained with"
    ),
    "tied_embeddings": _switch("--untie-embeddings-and-output-weights", on=False),
}
"""Per identity key, what to change so that a run builds the checkpoint's model."""
