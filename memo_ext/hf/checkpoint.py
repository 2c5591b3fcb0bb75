"""Hugging Face folders ↔ this project's checkpoints (``python -m tools.convert_hf``).

Import: the model that config.json describes is built from the trainer flags
(:func:`memo_ext.hf.weights.trainer_flags`) in one process at TP 1 / PP 1, its tensors
are filled from the safetensors files one at a time (``safe_open``: only the tensors of one
megatron-core key are read at once, beside the model), and it is saved with
:func:`memo_ext.training.checkpoint.save_checkpoint` as iteration 0 without optimizer state.
megatron-core reshards the checkpoint on load, so the trainer starts from it under any TP / PP.
Next to the checkpoint: ``model_flags.txt`` (the trainer flags) and ``hf_config.json`` (the
source config, for the fields an export keeps). A training run that starts from it writes both
beside its own saves too, so a fine-tuned model exports with no flag retyped.

Export: the same model is built from the flags, the checkpoint loaded into it (weights only),
and its tensors written to one ``model.safetensors`` with a config.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shlex
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from memo_ext.arguments import parse_args
from memo_ext.config import RunConfig
from memo_ext.device import compute_device, on_gpu
from memo_ext.errors import UsageError
from memo_ext.features.megatron import run_transformer_config
from memo_ext.hf.files import check_names, check_tied_head, read_config, tensor_files
from memo_ext.hf.weights import (
    VOCAB_DIVISIBLE_BY,
    hf_config,
    hf_model,
    links_for,
    trainer_flags,
)
from memo_ext.mcore.compat import cpu_compat
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import embedding_rows
from memo_ext.training.checkpoint import (
    MODEL_FLAGS_FILE,
    SOURCE_CONFIG_FILE,
    WEIGHTS_ONLY,
    TrainProgress,
    load_checkpoint,
    save_checkpoint,
)
from memo_ext.training.initialize import init_distributed, init_model_parallel
from memo_ext.training.model import build_gpt_model

logger = logging.getLogger(__name__)

FLAGS_FILE = MODEL_FLAGS_FILE
"""In an imported checkpoint's folder: the trainer flags of its model, one line."""
SOURCE_CONFIG = SOURCE_CONFIG_FILE
"""In an imported checkpoint's folder, and the --save folder of every run descended from it
(the trainer carries it forward): the HF config.json it came from."""

# flags the trainer's parser needs to build a run; none of them changes the model
_RUN_STUB = ["--lr", "1e-4", "--train-iters", "1", "--mock-data", "--micro-batch-size", "1"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise UsageError(
            "the Hugging Face converter needs safetensors: pip install -e '.[hf]'"
        ) from None


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A one-process megatron world (TP = PP = 1) on this machine's device, torn down after
    (an already initialised process group is used as it is)."""
    owned = not dist.is_initialized()
    init_distributed()
    compat = contextlib.nullcontext() if on_gpu() else cpu_compat()
    owned_groups = not parallel_state.model_parallel_is_initialized()
    try:
        with compat:
            if owned_groups:
                init_model_parallel(layout=ParallelLayout(), seed=0)
            yield
    finally:
        if owned_groups:
            parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


def build_model(
    flags: list[str], *, vocab_size: int, world_size: int = 1
) -> tuple[RunConfig, torch.nn.Module]:
    """The run and this process's model that ``flags`` describe, with ``vocab_size`` tokens
    (padded as the trainer pads them); call inside :func:`single_process`, or inside
    megatron's parallel state of the flags' layout over ``world_size`` processes."""
    # the flags are the converter's own (trainer_flags, or an import's model_flags.txt): the
    # notes on Megatron-LM flags among them are for a user who typed them
    run = parse_args(
        [*flags, *_RUN_STUB, "--seq-length", "8"], world_size=world_size, notices=False
    )
    padded = embedding_rows(
        vocab_size, divisible_by=run.model.make_vocab_size_divisible_by, tp_sizes=(run.layout.tp,)
    )
    run = dataclasses.replace(
        run,
        shape=dataclasses.replace(run.shape, vocab_size=vocab_size),
        model=dataclasses.replace(run.model, padded_vocab_size=padded, attention_backend="sdpa"),
    )
    model = build_gpt_model(run=run, config=run_transformer_config(run), device=compute_device())
    return run, model


def check_new_folder(out: Path, *, what: str) -> None:
    """Both directions write into a new or empty folder only: files already there would be
    replaced, or, worse, stay beside ours (another model's shards and index, which
    ``transformers`` would then load with ours).

    Raises:
        UsageError: ``out`` is a file or holds anything.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a new folder for {what}")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UsageError(
            f"--out {out} already holds {shown}; give a new or empty folder for {what} (nothing "
            "in a folder is replaced or mixed with this tool's files)"
        )


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------


def import_hf(*, hf_dir: Path, out: Path, progress: bool = True) -> list[str]:
    """Convert the HF model in ``hf_dir`` to a checkpoint in ``out``; return its trainer flags.

    Raises:
        UsageError: an unsupported model, a missing tensor or a tensor of the wrong shape.
    """
    _require_safetensors()
    from safetensors import safe_open

    check_new_folder(out, what="the checkpoint")
    config = read_config(hf_dir)
    flags = trainer_flags(config)
    source = hf_model(config)
    files = tensor_files(hf_dir)
    check_names(source, files, hf_dir)
    with single_process(), contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())
        }
        read = lambda name: handles[files[name]].get_tensor(name)  # noqa: E731
        check_tied_head(source, files, read)
        _, model = build_model(flags, vocab_size=source.shape.vocab_size)
        params = model.state_dict(keep_vars=True)
        links = links_for(source, names=set(files))
        for link in tqdm(links, desc="import", unit="tensor", disable=not progress):
            tensors = [read(name) for name in link.sources]
            _copy_into(params[link.key], link.to_mcore(tensors), key=link.key)
        _check_all_filled(params, links)
        out.mkdir(parents=True, exist_ok=True)
        save_checkpoint(
            save_dir=str(out),
            progress=TrainProgress(),
            model=model,
            optimizer=None,
            scheduler=None,
            save_optim=False,
        )
    (out / FLAGS_FILE).write_text(shlex.join(flags) + "\n")
    (out / SOURCE_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return flags


def _copy_into(param: torch.Tensor, value: torch.Tensor, *, key: str) -> None:
    if param.shape != value.shape:
        raise UsageError(
            f"{key}: the weights give shape {tuple(value.shape)}, config.json's model "
            f"{tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value)  # cast to the model's dtype


def _check_all_filled(params: dict, links: list) -> None:
    tensors = {k for k, v in params.items() if isinstance(v, torch.Tensor)}
    left = sorted(tensors - {link.key for link in links})
    if left:  # a key this tool does not know keeps its random init: refuse, never ship it
        raise UsageError(f"the model has tensors no HF tensor fills: {', '.join(left)}")


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


def _cast(tensor: torch.Tensor, dtype: str, *, name: str) -> torch.Tensor:
    """``tensor`` in ``dtype``, refusing a weight the type cannot hold (fp16 tops out at 65504:
    a larger weight would be exported as inf, a silently different model).

    Raises:
        UsageError: naming the tensor and its largest magnitude.
    """
    cast = tensor.to(DTYPES[dtype]).clone()
    if torch.isfinite(tensor).all() and not torch.isfinite(cast).all():
        largest = tensor.abs().max().item()
        raise UsageError(
            f"{name} holds values up to {largest:.4g}, which {dtype} cannot represent; export "
            "with --dtype bfloat16 or float32"
        )
    return cast


class _NoOptimizer:
    """The optimizer a weights-only load needs: the model's weights are its only parameters."""

    def reload_model_params(self) -> None:
        pass


def model_flags(load: Path, extra: list[str]) -> list[str]:
    """The trainer flags of the checkpoint in ``load``: ``extra`` when given, else those the
    import wrote.

    Raises:
        UsageError: neither.
    """
    if extra:
        return extra
    path = load / FLAGS_FILE
    if not path.is_file():
        raise UsageError(
            f"{load} has no {FLAGS_FILE}; give the model's trainer flags after the tool's "
            "(e.g. --num-layers 32 --hidden-size 4096 ... --vocab-size N)"
        )
    return shlex.split(path.read_text())


def load_model(
    load: Path, *, flags: list[str], vocab_size: int, world_size: int = 1
) -> tuple[RunConfig, torch.nn.Module]:
    """The model of ``flags`` with the newest checkpoint in ``load``'s weights (see
    :func:`build_model` for where to call it)."""
    run, model = build_model(flags, vocab_size=vocab_size, world_size=world_size)
    load_checkpoint(
        load_dir=str(load),
        model=model,
        optimizer=_NoOptimizer(),
        scheduler=None,
        scope=WEIGHTS_ONLY,
    )
    return run, model


def _tokenizer_vocab(flags: list[str]) -> int | None:
    """The vocabulary of the tokenizer ``flags`` name (a run's ``model_flags.txt`` holds its
    tokenizer flags), or ``None`` when none is named or it cannot be built here (its files
    are elsewhere)."""
    from memo_ext.data.tokenizers import build_tokenizer

    run = parse_args([*flags, *_RUN_STUB, "--seq-length", "8"], world_size=1, notices=False)
    try:
        return build_tokenizer(run.data.tokenizer).vocab_size
    except (ValueError, OSError):
        return None


def export_hf(
    *,
    load: Path,
    out: Path,
    family: str,
    dtype: str = "float32",
    flags: list[str] | None = None,
    vocab_size: int | None = None,
    progress: bool = True,
) -> Path:
    """Write the checkpoint in ``load`` as an HF ``family`` model folder ``out`` (config.json
    and model.safetensors in ``dtype``); return ``out``.

    Raises:
        UsageError: no flags or vocabulary size known, or a model the family cannot describe.
    """
    _require_safetensors()
    from safetensors.torch import save_file

    check_new_folder(out, what="the Hugging Face model")
    flags = model_flags(load, flags or [])
    source = (
        json.loads((load / SOURCE_CONFIG).read_text()) if (load / SOURCE_CONFIG).is_file() else None
    )
    vocab_size = vocab_size or (source or {}).get("vocab_size") or _tokenizer_vocab(flags)
    if not vocab_size:
        raise UsageError(
            f"{load} has no {SOURCE_CONFIG} (not an import, nor the --save of a run started from "
            "one) and its tokenizer flags name no tokenizer this machine can build: give "
            "--vocab-size (the tokenizer's)"
        )
    with single_process():
        run, model = load_model(load, flags=flags, vocab_size=vocab_size)
        config = hf_config(family=family, run=run, vocab_size=vocab_size, base=source)
        config["torch_dtype"] = dtype
        target = hf_model(config)
        if target.padded_vocab != run.model.padded_vocab_size:
            raise UsageError(
                f"the checkpoint pads its vocabulary to {run.model.padded_vocab_size} rows; this "
                f"tool exports models padded to a multiple of {VOCAB_DIVISIBLE_BY}"
            )
        params = model.state_dict(keep_vars=True)
        tensors = {}
        for link in tqdm(links_for(target), desc="export", unit="tensor", disable=not progress):
            param = params.pop(link.key)
            parts = link.to_hf(param.detach())
            for name, part in zip(link.sources, parts):
                tensors[name] = _cast(part, dtype, name=name)
            param.data = param.data.new_empty(0)  # one copy of the model at a time
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
