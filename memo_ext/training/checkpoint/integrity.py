"""Integrity: SHA-256 of every file in a manifest written last, and a safe look at torch's pickled
metadata (an allow-list of its own data classes); Megatron-LM's checkpoints, which carry no
manifest, are checked for what they can be.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
from pathlib import Path

import torch

from memo_ext.config import CheckpointConfig
from memo_ext.training.checkpoint import megatron_lm
from memo_ext.training.checkpoint.source import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    checkpoint_source,
    iteration_dir,
    latest_iteration,
)

logger = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, meta: dict, known: dict[str, str]) -> None:
    """List every file in ``directory`` with its SHA-256: from ``known`` (relative path ->
    digest, taken as the files were written) where it is there, else read from the file."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    names = [str(p.relative_to(directory)) for p in files]
    checksums = {name: known.get(name) or _sha256(directory / name) for name in names}
    manifest = {"format": FORMAT, **meta, "files": checksums}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def verify_checkpoint(directory: Path) -> dict:
    """Check every file against the manifest; return the manifest.

    Raises:
        CheckpointError: naming the missing, unexpected or corrupt file.
    """
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file() and (foreign := megatron_lm.unsupported_format(directory)):
        raise CheckpointError(foreign)
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {directory} is an incomplete checkpoint"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(
            f"{manifest_path} does not list the checkpoint's files (a JSON object with 'files' "
            "is expected): the checkpoint is damaged"
        )
    if manifest.get("format") != FORMAT:
        found = manifest.get("format")
        raise CheckpointError(f"{manifest_path} has format {found!r}, not {FORMAT}")
    for name, checksum in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if _sha256(path) != checksum:
            raise CheckpointError(f"checkpoint file {path} is corrupt (checksum mismatch)")
    check_torch_metadata(directory)
    return manifest


# torch.distributed.checkpoint describes a checkpoint in a pickled ``.metadata`` file, which
# megatron then unpickles. Only these data classes may appear in it.
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float64"),
    ("torch", "int64"),
    ("torch", "int32"),
    ("torch", "uint8"),
    ("torch", "int8"),
    ("torch", "bool"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(f"{module}.{name}")


def check_torch_metadata(directory: Path):
    """torch's ``.metadata`` of the checkpoint, unpickled through the allow-list."""
    path = directory / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except CheckpointError as err:
        raise CheckpointError(
            f"{path} refers to {err}, which a checkpoint has no reason to contain; refusing to "
            "load it (it could run code)"
        ) from None
    except Exception as err:  # noqa: BLE001 - any other failure means an unreadable file
        raise CheckpointError(f"checkpoint file {path} is unreadable ({err})") from err


def is_megatron_lm_checkpoint(directory: Path) -> bool:
    """A megatron-core torch_dist checkpoint without a manifest of ours whose common state is not
    ours: Megatron-LM's (one of ours that lost its manifest is incomplete, not foreign)."""
    if (directory / MANIFEST).is_file() or not megatron_lm.is_torch_dist(directory):
        return False
    try:
        common = torch.load(directory / "common.pt", map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable: Megatron-LM's checks name it
        return True
    return not (isinstance(common, dict) and common.get("format") == FORMAT)


def padded_vocab_to_load(
    config: CheckpointConfig, *, vocab_size: int, tp_sizes: list[int], padded: int
) -> int:
    """The padded vocabulary of a run that loads ``config``'s checkpoint: ``padded`` (this
    trainer's rule), or, for a Megatron-LM checkpoint, its embedding rows, which Megatron-LM pads
    by its own rule (``megatron_lm.adopted_padded_vocab``): adopted so that every row, the padded
    ones too (they enter the softmax), loads as trained.

    Raises:
        UsageError: rows of another tokenizer, or that a TP degree of the run does not divide.
    """
    source = checkpoint_source(config)
    iteration = latest_iteration(source.root) if source else None
    if iteration is None:
        return padded
    directory = iteration_dir(source.root, iteration)
    if not is_megatron_lm_checkpoint(directory):
        return padded
    common = megatron_lm.read_common(directory)
    rows = megatron_lm.tensor_shapes(check_torch_metadata(directory)).get(megatron_lm.EMBEDDING_KEY)
    if common is None or rows is None:
        return padded  # the load names what is wrong with it
    adopted = megatron_lm.adopted_padded_vocab(
        common,
        embedding_rows=rows[0],
        vocab_size=vocab_size,
        tp_sizes=tp_sizes,
        directory=directory,
    )
    if adopted != padded:
        logger.info(megatron_lm.padding_note(common, rows=adopted, ours=padded))
    return adopted


def verify_megatron_lm_checkpoint(directory: Path) -> None:
    """Check a Megatron-LM checkpoint with what it has: megatron-core's own checks of its format,
    torch's ``.metadata`` through the allow-list, and every byte range it records.

    Raises:
        CheckpointError: naming the missing, truncated or unreadable file.
    """
    reason = megatron_lm.problem(directory, check_torch_metadata(directory))
    if reason:
        raise CheckpointError(reason)
