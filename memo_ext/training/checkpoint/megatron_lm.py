"""Megatron-LM's own torch_dist checkpoints, read in this trainer's terms.

Megatron-LM's ``save_checkpoint`` writes the same megatron-core ``torch_dist`` directories as
this trainer (``iter_0000010/`` with ``metadata.json``, ``common.pt``, ``.metadata`` and the
``__R_W.distcp`` files, beside ``latest_checkpointed_iteration.txt``) with the same global keys
for the model, but no manifest of ours. What describes the checkpoint is its common state
(``common.pt``): its command line as ``args`` (an ``argparse.Namespace``), ``iteration``,
``checkpoint_version``, the optimizer's non-tensor state, ``opt_param_scheduler``. This module
recognises such a directory, checks its files with megatron-core's own metadata, and turns its
``args`` into what :mod:`memo_ext.training.checkpoint` compares and loads: the model's
identity, the data position, the LR schedule in this run's units, the padded vocabulary.

Nothing here unpickles more than megatron-core itself allows: ``common.pt`` is read with
``torch.load(weights_only=True)`` over the classes megatron-core registers as safe
(``argparse.Namespace``, its enums), and torch's ``.metadata`` comes in already unpickled
through the loader's allow-list.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy

from memo_ext.errors import UsageError
from memo_ext.shapes import default_ffn_size, padded_vocab_size

COMMON = "common.pt"
CONFIG = "metadata.json"
EMBEDDING_KEY = "embedding.word_embeddings.weight"
SCHEDULE_STEP_KEYS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
"""Megatron-LM's scheduler counts these in samples (it steps by the global batch)."""


def read_common(directory: Path) -> dict | None:
    """The common state of the megatron-core checkpoint in ``directory`` when it is Megatron-LM's
    (it holds ``args``); ``None`` for another (this trainer's) or an unreadable one."""
    try:
        common = torch.load(directory / COMMON, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        return None
    return common if isinstance(common, dict) and "args" in common else None


def is_torch_dist(directory: Path) -> bool:
    """``directory`` holds megatron-core's ``metadata.json`` of a torch_dist checkpoint."""
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("sharded_backend") == "torch_dist"


def unsupported_format(directory: Path) -> str | None:
    """A sentence for a checkpoint of Megatron-LM's in a format this trainer does not read (the
    legacy per-rank ``torch`` files, a dist-checkpoint backend other than torch_dist such as
    zarr), with the conversion Megatron-LM itself offers; None for any other folder."""
    legacy = sorted(p.name for p in directory.glob("mp_rank_*")) or (
        ["model_optim_rng.pt"] if (directory / "model_optim_rng.pt").is_file() else []
    )
    if legacy:
        what, load_format = f"in the legacy torch format ({legacy[0]}/...)", "torch"
    else:
        try:
            config = json.loads((directory / CONFIG).read_text())
        except (OSError, ValueError):
            return None
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        if backend in (None, "torch_dist"):
            return None
        what, load_format = f"in megatron-core's {backend} format", "torch_dist"
    root = directory.parent
    return (
        f"{directory} is a Megatron-LM checkpoint {what}, which is not supported (this trainer "
        f"reads torch_dist); convert it with Megatron-LM's pretrain_gpt.py, its model flags and "
        f"--load {root} --ckpt-format {load_format} --ckpt-convert-format torch_dist "
        "--ckpt-convert-save OUT, then load OUT/torch_dist"
    )


def problem(directory: Path, metadata) -> str | None:
    """What makes the Megatron-LM checkpoint in ``directory`` unusable, or ``None``: megatron-core's
    own checks of its format (``verify_checkpoint_and_load_strategy``), its common state, and
    every byte range that torch's ``.metadata`` (``metadata``, already unpickled safely) records
    being there. Megatron-LM writes no checksums, so a changed byte inside a file goes unseen."""
    try:
        verify_checkpoint_and_load_strategy(str(directory))
    except CheckpointingException as err:
        return f"{directory} is not a checkpoint megatron-core can read here ({err})"
    common = read_common(directory)
    if common is None or "iteration" not in common:
        return f"checkpoint file {directory / COMMON} is unreadable: the checkpoint is damaged"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            return f"checkpoint file {path} is missing"
        if path.stat().st_size < end:
            return f"checkpoint file {path} is truncated ({path.stat().st_size} of {end} bytes)"
    return None


def tensor_shapes(metadata) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in a torch_dist checkpoint, by key (``metadata``: torch's
    unpickled ``.metadata``); byte objects (RNG states, extra states) are not listed."""
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if hasattr(entry, "size")
    }


def stored_keys(metadata) -> set[str]:
    """Every key of a torch_dist checkpoint, tensors and objects (an object's shards, stored as
    ``key/shard_...``, count once)."""
    return {key.split("/shard_")[0] for key in metadata.state_dict_metadata}


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def _activation(args) -> tuple[str, bool]:
    """(activation function name, gated) of Megatron-LM's MLP flags."""
    if _arg(args, "swiglu"):
        return "silu", True
    if _arg(args, "quick_geglu"):
        return "quick_gelu", True
    if _arg(args, "squared_relu"):
        return "squared_relu", False
    # --openai-gelu reaches Megatron-LM's legacy models only: its megatron-core GPT (the one a
    # torch_dist checkpoint holds) runs the exact GeLU whatever the flag says
    return "gelu", False


def _qkv_bias(args) -> bool | None:
    """Whether QKV has a bias: megatron-core gives it one when ``add_bias_linear or
    add_qkv_bias`` (Megatron-LM's ``validate_args`` also sets the latter from the former)."""
    linear, qkv = _arg(args, "add_bias_linear"), _arg(args, "add_qkv_bias")
    if linear is None and qkv is None:
        return None
    return bool(linear or qkv)


def model_identity(args, *, embedding_rows: int | None) -> dict:
    """The model a Megatron-LM checkpoint holds, under the keys of this trainer's record
    (``identity.model_identity``): its flags, completed the way Megatron-LM's
    ``validate_args`` completes them; ``embedding_rows`` (from the tensors) is the padded
    vocabulary. Unknown entries are left out."""
    heads, hidden = _arg(args, "num_attention_heads"), _arg(args, "hidden_size")
    ffn = _arg(args, "ffn_hidden_size")
    if ffn is None and hidden is not None:
        ffn = default_ffn_size(hidden, swiglu=bool(_arg(args, "swiglu")))
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
    activation, gated = _activation(args)
    position = _arg(args, "position_embedding_type")
    if _arg(args, "use_rotary_position_embeddings"):
        position = "rope"
    untied = _arg(args, "untie_embeddings_and_output_weights")
    identity = {
        "num_layers": _arg(args, "num_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": _arg(args, "kv_channels") or (hidden // heads if hidden and heads else None),
        "normalization": _arg(args, "normalization"),
        "layernorm_zero_centered_gamma": bool(
            _arg(args, "apply_layernorm_1p") or _arg(args, "layernorm_zero_centered_gamma")
        ),
        "activation": activation,
        "gated_linear_unit": gated,
        "add_bias_linear": _arg(args, "add_bias_linear"),
        "qkv_bias": _qkv_bias(args),
        "position_embedding_type": position,
        "padded_vocab_size": embedding_rows or _arg(args, "padded_vocab_size"),
        "tied_embeddings": None if untied is None else not untied,
    }
    return {key: value for key, value in identity.items() if value is not None}


def progress(common: dict) -> tuple[int, int]:
    """(iteration, consumed training samples) of a Megatron-LM checkpoint."""
    consumed = _arg(common["args"], "consumed_train_samples", 0) or 0
    return int(common["iteration"]), int(consumed)


def schedule_state(common: dict, *, counts_samples: bool, directory: Path) -> dict:
    """Megatron-LM's LR-schedule state in this run's units. Megatron-LM's scheduler counts samples
    (it steps by the global batch); a sample-based run here does too, an iteration-based one
    counts steps: the checkpoint's counts are divided by its global batch, which must then have
    been constant and divide them.

    Raises:
        UsageError: a schedule that cannot be continued in steps, or none in the checkpoint.
    """
    saved = common.get("opt_param_scheduler", common.get("lr_scheduler"))
    if not isinstance(saved, dict):
        raise UsageError(
            f"the checkpoint in {directory} holds no LR schedule; load it with --finetune or "
            "--no-load-optim"
        )
    if counts_samples:
        return dict(saved)
    args = common["args"]
    batch = _arg(args, "global_batch_size")
    counts = {key: saved[key] for key in SCHEDULE_STEP_KEYS if saved.get(key) is not None}
    if saved.get("wsd_decay_steps") is not None:
        counts["wsd_decay_steps"] = saved["wsd_decay_steps"]
    exact = batch and not _arg(args, "rampup_batch_size")
    if not exact or any(value % batch for value in counts.values()):
        raise UsageError(
            f"the LR schedule in {directory} counts samples at a varying or unknown global batch, "
            "which an iteration-based run cannot continue; resume it with --train-samples, or "
            "start from its weights with --finetune"
        )
    return {**saved, **{key: value // batch for key, value in counts.items()}}


def _padding_rule(args) -> tuple[int | None, int | None]:
    """(--make-vocab-size-divisible-by, TP) of a Megatron-LM run: it pads to their product."""
    return _arg(args, "make_vocab_size_divisible_by"), _arg(args, "tensor_model_parallel_size")


def adopted_padded_vocab(
    common: dict, *, embedding_rows: int, vocab_size: int, tp_sizes: list[int], directory: Path
) -> int:
    """The padded vocabulary a run adopts from a Megatron-LM checkpoint: its embedding rows, so
    that every row (the padded ones enter the softmax) loads as trained. Megatron-LM pads to
    --make-vocab-size-divisible-by × its TP where this trainer pads to their lcm over the run's
    TP degrees, so the two may differ for the same tokenizer.

    Raises:
        UsageError: rows that are not Megatron-LM's padding of this tokenizer's vocabulary (another
            tokenizer), or that a TP degree of this run does not divide.
    """
    divisible, tp = _padding_rule(common["args"])
    expected = (
        padded_vocab_size(vocab_size, divisible_by=divisible, tp_size=tp)
        if divisible and tp
        else None
    )
    if embedding_rows < vocab_size or expected not in (None, embedding_rows):
        why = f"Megatron-LM's padding of this tokenizer's {vocab_size} tokens is {expected}"
        if expected is None:
            why = f"fewer than this tokenizer's {vocab_size} tokens"
        raise UsageError(
            f"the checkpoint in {directory} holds another model: padded_vocab_size "
            f"{embedding_rows} there ({why}); load it with the tokenizer it was trained with"
        )
    split = [size for size in tp_sizes if embedding_rows % size]
    if split:
        raise UsageError(
            f"the {embedding_rows} embedding rows of the checkpoint in {directory} do not split "
            f"over --tensor-model-parallel-size {split[0]}; use a TP degree that divides "
            f"{embedding_rows} (its own was {tp})"
        )
    return embedding_rows


def padding_note(common: dict, *, rows: int, ours: int) -> str:
    """The log line saying which padded vocabulary a run uses and why."""
    divisible, tp = _padding_rule(common["args"])
    rule = f"--make-vocab-size-divisible-by {divisible} × its TP {tp}" if divisible else "its rule"
    return (
        f"the Megatron-LM checkpoint's embedding has {rows} rows ({rule}); this run pads its "
        f"vocabulary to those {rows} rows instead of {ours} (lcm rule), so every row loads as "
        "saved"
    )
