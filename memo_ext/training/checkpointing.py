"""Checkpoints with megatron-core ``dist_checkpointing``: exact resume, any layout, safe loading.

A checkpoint directory looks like Megatron-LM's::

    SAVE/latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    SAVE/iter_0000100/                          megatron-core sharded checkpoint (torch_dist)
        manifest.json                           SHA-256 of every file, written last
        rng/rank_00000.pt                       per-process RNG states (tensors only)

Model weights and optimizer moments are saved as sharded tensors with global keys, so a
checkpoint written under one TP / PP / CP / DP layout loads under another. Iteration, consumed
samples, the LR schedule and the optimizer step live in megatron's common state.

Writes are atomic: everything goes to ``iter_N.tmp``; only when all ranks are done does rank 0
write the manifest, rename the directory and then replace the tracker file, so a crash at any
point leaves the previous checkpoint as the latest one. The tensors are written in megatron-core's
``torch_dist`` format by threads of each process (the ranks holding the same replicas share the
writing out), fsync'ed, and hashed as they are written: the manifest reads back only megatron's
two small common files.

Loading never runs code from a checkpoint: file checksums are verified first, megatron's common
state is read with ``torch.load(weights_only=True)``, the one pickle that torch's checkpoint
format keeps (``.metadata``) is unpickled with an allow-list of its own data classes before
megatron reads it, and the RNG files are tensors read with ``weights_only=True``.

A load takes the model weights always and, per :class:`LoadScope`, the iteration and data
position, the optimizer's moments with the LR schedule, and the RNG states (``--finetune``,
``--no-load-optim``, ``--no-load-rng``); :func:`checkpoint_source` says which folder a run loads
(``--load``, else ``--pretrained-checkpoint``). Megatron-LM's own torch_dist checkpoints (no
manifest; their common state holds Megatron-LM's ``args``) load too:
:mod:`memo_ext.training.megatron_lm_checkpoint` checks and describes them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shlex
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel import random as mrandom
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from memo_ext.config import CheckpointConfig
from memo_ext.device import gpu_rng_state, set_gpu_rng_state
from memo_ext.errors import ReportedError, UsageError
from memo_ext.training import megatron_lm_checkpoint as megatron_lm

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FLAGS_FILE = "model_flags.txt"
"""Beside the checkpoints: the trainer flags of their model (:meth:`RunConfig.model_flags`)."""
MANIFEST = "manifest.json"
FORMAT = "memo-checkpoint/1"


class CheckpointError(ReportedError):
    """A checkpoint that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TrainProgress:
    """Where a run stands: restored from a checkpoint or zero."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass(frozen=True)
class LoadScope:
    """What a load restores besides the model weights, which it always loads."""

    progress: bool = True
    """The iteration and the data position (consumed samples); without: iteration 0."""
    optimizer: bool = True
    """The optimizer's moments and the LR schedule; without: both start afresh."""
    rng: bool = True
    """Every process's RNG states (when the checkpoint's layout is this run's)."""

    def describe(self) -> str:
        """What was left out, for the log ("" when nothing was)."""
        fresh = [
            name
            for name, kept in (
                ("iteration and data position", self.progress),
                ("optimizer and LR schedule", self.optimizer),
                ("RNG states", self.rng),
            )
            if not kept
        ]
        return f"; fresh: {', '.join(fresh)}" if fresh else ""


WEIGHTS_ONLY = LoadScope(progress=False, optimizer=False, rng=False)
"""--finetune (Megatron-LM's meaning): the weights, nothing else."""


@dataclass(frozen=True)
class CheckpointSource:
    """The folder of checkpoints a run starts from and what it takes from its newest one."""

    root: Path
    scope: LoadScope
    flag: str
    """The flag that named ``root`` (``--load`` or ``--pretrained-checkpoint``), for messages."""


def checkpoint_source(config: CheckpointConfig) -> CheckpointSource | None:
    """Where the run loads from: ``--load`` when it holds a checkpoint (with --finetune /
    --no-load-optim / --no-load-rng applied), else ``--pretrained-checkpoint`` (its weights
    only, as Megatron-LM), else ``--load`` (which starts fresh); ``None`` without either.

    Raises:
        UsageError: a --pretrained-checkpoint that holds none, or --finetune with nothing to
            take weights from.
    """
    load = Path(config.load) if config.load else None
    finetune = config.finetune
    scope = LoadScope(
        progress=not finetune,
        optimizer=config.load_optim and not finetune,
        rng=config.load_rng and not finetune,
    )
    if load is not None and latest_iteration(load) is not None:
        return CheckpointSource(load, scope, "--load")
    if load is not None and load.is_dir():
        _check_untracked(load, flag="--load")  # its checkpoints are not skipped unseen
    if config.pretrained_checkpoint:
        root = Path(config.pretrained_checkpoint)
        if latest_iteration(root) is None:
            _check_untracked(root, flag="--pretrained-checkpoint")
            raise UsageError(
                f"--pretrained-checkpoint {root} holds no checkpoint (no {TRACKER}); give the "
                "folder that holds one"
            )
        return CheckpointSource(root, WEIGHTS_ONLY, "--pretrained-checkpoint")
    if load is None:
        return None
    if finetune:
        raise UsageError(
            f"--finetune: --load {load} holds no checkpoint to take the weights from (no "
            f"{TRACKER}); give the folder of the pretrained checkpoint"
        )
    return CheckpointSource(load, scope, "--load")


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``sharded_state_dict`` megatron defines (under DDP / Float16Module)."""
    while not hasattr(model, "sharded_state_dict") or hasattr(model, "zero_grad_buffer"):
        model = model.module
    return model


def _model_identity(model: torch.nn.Module) -> dict:
    """What a checkpoint's weights are the weights of, beyond their shapes: written to its
    manifest and compared on load, so that weights that happen to fit another model (a padded
    vocabulary, a norm without its bias) are not loaded into it. Facts of the model the weights
    define, not how its flags were spelt: a QKV bias is there or not (``--add-qkv-bias`` with
    the linear layers' biases on changes nothing)."""
    gpt = model
    while not hasattr(gpt, "position_embedding_type") and hasattr(gpt, "module"):
        gpt = gpt.module
    c = gpt.config
    return {
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "ffn_hidden_size": c.ffn_hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_query_groups": c.num_query_groups,
        "kv_channels": c.kv_channels,
        "normalization": c.normalization,
        "layernorm_zero_centered_gamma": bool(c.layernorm_zero_centered_gamma),
        "activation": getattr(c.activation_func, "__name__", str(c.activation_func)),
        "gated_linear_unit": bool(c.gated_linear_unit),
        "add_bias_linear": bool(c.add_bias_linear),
        "qkv_bias": bool(c.add_bias_linear or c.add_qkv_bias),
        # YaRN rescales RoPE's table, not its weights: a RoPE checkpoint extends to YaRN
        "position_embedding_type": (
            "rope" if gpt.position_embedding_type == "yarn" else gpt.position_embedding_type
        ),
        "padded_vocab_size": gpt.vocab_size,
        "tied_embeddings": bool(gpt.share_embeddings_and_output_weights),
    }


def _check_model_identity(directory: Path, model: torch.nn.Module, saved: dict | None) -> bool:
    """Refuse a checkpoint of another model (``saved``: the identity it records), naming each
    difference; True when the checkpoint records its model (one written before the manifest did
    is not checked: False)."""
    here = _model_identity(model)
    if not isinstance(saved, dict):
        return False
    saved = normalized_identity(saved)
    differences = [
        f"{key} {saved[key]} there, {here[key]} here ({_IDENTITY_FLAGS[key](saved[key])})"
        for key in here
        if key in saved and saved[key] != here[key]
    ]
    if differences:
        raise UsageError(
            f"the checkpoint in {directory} holds another model: {'; '.join(differences)}; "
            "load it with the model flags it was trained with"
        )
    return True


def normalized_identity(record: dict) -> dict:
    """A model record as :func:`_model_identity` writes it now: one written before it recorded
    whether QKV has a bias (``add_qkv_bias``, a flag's value) says it the current way."""
    record = dict(record)
    if "add_qkv_bias" in record and "qkv_bias" not in record:
        record["qkv_bias"] = bool(record.pop("add_qkv_bias") or record.get("add_bias_linear"))
    record.pop("add_qkv_bias", None)
    return record


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


# ---------------------------------------------------------------------------------------------
# RNG states (per process, tensors only)
# ---------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    tracker = mrandom.get_cuda_rng_tracker()
    return {
        "torch": torch.get_rng_state(),
        "cuda": gpu_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "tracker": tracker.get_states() if tracker.is_initialized() else {},
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    set_gpu_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if state["tracker"]:
        mrandom.get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------------------
# Integrity: checksums and a safe look at torch's pickled metadata
# ---------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path, meta: dict, known: dict[str, str]) -> None:
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
    _check_torch_metadata(directory)
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


def _check_torch_metadata(directory: Path):
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
    rows = megatron_lm.tensor_shapes(_check_torch_metadata(directory)).get(
        megatron_lm.EMBEDDING_KEY
    )
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
    reason = megatron_lm.problem(directory, _check_torch_metadata(directory))
    if reason:
        raise CheckpointError(reason)


# ---------------------------------------------------------------------------------------------
# Writing: megatron's torch_dist format from threads of this process, hashed as it is written
# ---------------------------------------------------------------------------------------------

WRITER_THREADS = 2
"""Files each rank writes its tensors to, one thread each (megatron-core's default count)."""


class _HashingWriter:
    """A file opened for writing that feeds every byte written to ``digest`` too. torch's
    checkpoint writer only appends to its files (``write``, ``tell``), so the digest is the
    file's; there is no ``seek`` here that could make them differ."""

    def __init__(self, raw, digest) -> None:
        self.raw, self.digest = raw, digest

    def write(self, data) -> int:
        self.digest.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


class _HashingFileSystem(FileSystem):
    """torch's local file system for its checkpoint writer, keeping the SHA-256 of each file it
    writes (``checksums``: file name -> hex digest), so the manifest needs no read-back."""

    def __init__(self) -> None:
        super().__init__()
        # one writer thread per file: each key is set by one thread, no lock needed
        self.checksums: dict[str, str] = {}
        self.errors: list[Exception] = []
        """What failed while writing a file, in any thread."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        digest = hashlib.sha256()
        try:
            with super().create_stream(path, mode) as stream:
                yield _HashingWriter(stream, digest)
        except Exception as err:
            self.errors.append(err)
            raise
        self.checksums[Path(path).name] = digest.hexdigest()

    def rename(self, path, new_path) -> None:
        """``.metadata`` is written as ``.metadata.tmp`` and renamed: its digest follows it."""
        super().rename(path, new_path)
        digest = self.checksums.pop(Path(path).name, None)
        if digest is not None:
            self.checksums[Path(new_path).name] = digest


class _HashingFileSystemWriter(dcp.FileSystemWriter):
    """torch's checkpoint writer: ``WRITER_THREADS`` files per rank, each fsync'ed as
    megatron-core's own writer does, hashed as they are written (``fs.checksums``)."""

    def __init__(self, path) -> None:
        super().__init__(path, thread_count=WRITER_THREADS)
        self.fs = _HashingFileSystem()

    @property
    def checkpoint_id(self) -> str:
        # pickled into .metadata: a str, as megatron-core's writer leaves it (the load-time
        # allow-list of that pickle has no Path)
        return str(self.path)

    def write_data(self, plan, planner):
        """torch's writer, failing as it should: an error in one of its threads other than this
        one is only printed there, and the checkpoint's ``.metadata`` would then lack that
        file's tensors; it is raised here instead."""
        written = super().write_data(plan, planner)
        if self.fs.errors:
            raise self.fs.errors[0]
        if len(written.value()) != len(plan.items):
            raise RuntimeError(
                f"torch's checkpoint writer wrote {len(written.value())} of {len(plan.items)} "
                "items without reporting an error"
            )
        return written


class _ThreadedTorchDistSave(SaveShardedStrategy):
    """megatron-core's ``torch_dist`` format (read back by its own load strategy), written by
    torch's ``FileSystemWriter`` in threads of this process. megatron-core's own writer forks a
    process per file on every save and, on a process's first save, spawns a queue server (a
    new interpreter that imports the main module again): 2.5-4.5 s of the first save of a
    175K-parameter model on 2 CPU processes, and most of each later one's 0.1-0.2 s."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)
        self.checksums: dict[str, str] = {}
        """What the last ``save`` wrote on this rank: file name -> SHA-256."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # megatron's translation packs them into BytesIO items

    def save(self, sharded_state_dict: dict, checkpoint_dir) -> None:
        writer = _HashingFileSystemWriter(checkpoint_dir)
        dcp.save(
            mcore_to_pyt_state_dict(_main_replicas_by_key(sharded_state_dict), is_loading=False),
            storage_writer=writer,
            planner=MCoreSavePlanner(flatten_state_dict=False),
        )
        self.checksums = writer.fs.checksums


def _main_replicas_by_key(sharded_state_dict: dict) -> dict[str, list]:
    """The shards this rank writes, grouped by global key (the form megatron-core's translation
    to torch's format takes): the main replica of each; the others are the same numbers, held
    by other ranks too."""
    by_key = collections.defaultdict(list)
    for shard in nested_values(sharded_state_dict):
        if is_main_replica(shard.replica_id):
            key = shard.unique_key if isinstance(shard, ShardedObject) else shard.key
            by_key[key].append(shard)
    return dict(by_key)


def _save_strategy() -> tuple[SaveShardedStrategy, _ThreadedTorchDistSave]:
    """The strategy to save with, and the threaded one inside it that knows the checksums. As
    in Megatron-LM, the ranks that hold the same replicas (DP × CP) share out writing them."""
    threaded = _ThreadedTorchDistSave()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return threaded, threaded
    return FullyParallelSaveStrategyWrapper(threaded, group), threaded


def _write_rng_state(path: Path) -> str:
    """Write this rank's RNG states to ``path``; their SHA-256."""
    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    data = buffer.getbuffer()
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _gather_checksums(checksums: dict[str, str]) -> dict[str, str]:
    """Every rank's checksums on rank 0 (empty elsewhere); also the point where every rank has
    finished writing."""
    if not dist.is_initialized():
        return checksums
    gathered = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(checksums, gathered, dst=0)
    return {name: digest for part in gathered or [] for name, digest in part.items()}


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


CONTENT_METADATA = {
    # the distributed optimizer's state in the parameters' own shapes, gathered per DP group on
    # save: it loads into any TP / PP / DP layout (Megatron-LM's
    # --dist-ckpt-optim-fully-reshardable; its default, dp_reshardable, reshards over DP only)
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""How megatron-core lays out the optimizer's sharded state in our checkpoints; written into
each (``content_metadata``), and read back from each on load, as Megatron-LM does."""


def _sharded_state(
    model,
    optimizer,
    scheduler,
    progress: TrainProgress,
    *,
    is_loading: bool = False,
    metadata: dict | None = None,
) -> dict:
    """What a checkpoint holds; without ``optimizer`` (--no-save-optim, or a load of the weights
    alone) neither the moments nor the LR schedule. ``metadata``: the optimizer state's layout
    (the checkpoint's content metadata on load, :data:`CONTENT_METADATA` on save)."""
    model_sharded = _unwrap(model).sharded_state_dict()
    state = {
        "model": model_sharded,
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "format": FORMAT,
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sharded, is_loading=is_loading, metadata=metadata or CONTENT_METADATA
        )
        state["scheduler"] = scheduler.state_dict()
    return state


def _layout() -> dict:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
    }


LOCK = ".lock"
"""The file in ``--save`` that the run writing there holds locked (``flock``) while it runs."""


@contextlib.contextmanager
def hold_save_dir(save_dir: str) -> Iterator[None]:
    """Create ``save_dir``, check that it can hold checkpoints (a write now, so that a read-only
    or full disk or a file stops the run before training), and hold it for this run: a second
    run saving there at the same time would delete this one's staging folders; it is refused,
    naming this process. The lock is the kernel's (``flock``): a killed run leaves none.

    Raises:
        UsageError: naming the directory and the system's reason, or the run that holds it.
    """
    error, lock = None, None
    if _rank() == 0:
        error, lock = _take_save_dir(Path(save_dir))
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        if lock is not None:
            lock.close()
        raise UsageError(box[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def _take_save_dir(root: Path):
    """(the reason ``root`` cannot be this run's --save, or None; the open, locked file)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write_test"
        probe.write_bytes(b"0")
        probe.unlink()
        lock = open(root / LOCK, "a+")  # noqa: SIM115 - held open for the whole run
    except OSError as err:
        return f"--save {root} cannot hold checkpoints: {_os_reason(err)}", None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        return (
            f"--save {root} is in use by another run ({holder}), which would delete this "
            "run's staging folders or this run its; give another --save"
        ), None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return None, lock


def _os_reason(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return f"no space left on the disk ({err.strerror})"
    return err.strerror or str(err)


def save_checkpoint(
    *,
    save_dir: str,
    progress: TrainProgress,
    model,
    optimizer,
    scheduler,
    save_optim: bool = True,
    save_rng: bool = True,
    model_flags: list[str] | None = None,
) -> Path:
    """Write the checkpoint of ``progress.iteration`` atomically; return its directory. Without
    ``save_optim`` (--no-save-optim) it holds no optimizer moments and LR schedule; without
    ``save_rng`` (--no-save-rng) no RNG states. ``model_flags`` (the run's
    :meth:`~memo_ext.config.RunConfig.model_flags`) go to ``MODEL_FLAGS_FILE`` in ``save_dir``.

    Raises:
        CheckpointError: the save failed (a full disk is named as such); the previous checkpoint
            is untouched.
    """
    try:
        optimizer = optimizer if save_optim else None
        return _save(
            save_dir, progress, model, optimizer, scheduler, rng=save_rng, model_flags=model_flags
        )
    except (OSError, RuntimeError, CheckpointException) as err:
        # torch.distributed.checkpoint reports its writers' OSErrors as "Worker failure: ..."
        reason = _os_reason(err) if isinstance(err, OSError) else _wrapped_reason(err)
        if reason is None:
            raise
        previous = latest_iteration(Path(save_dir))
        kept = f"iteration {previous} is still the latest" if previous else "no earlier checkpoint"
        raise CheckpointError(
            f"saving iteration {progress.iteration} to {save_dir} failed: {reason}; {kept}"
        ) from err


def _wrapped_reason(err: Exception) -> str | None:
    """The file-system reason inside an error torch's checkpoint writer raised, or ``None``
    when it carries none (a bug, not a fault: raised as it is)."""
    text = str(err)
    match = re.search(r"\[Errno (\d+)\] ([^'\n]*)", text)
    if match is None:
        return None
    number, strerror = int(match.group(1)), match.group(2).strip()
    return _os_reason(OSError(number, strerror))


def _save(
    save_dir: str,
    progress: TrainProgress,
    model,
    optimizer,
    scheduler,
    *,
    rng: bool = True,
    model_flags: list[str] | None = None,
) -> Path:
    root = Path(save_dir)
    final = iteration_dir(root, progress.iteration)
    staging = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    strategy, threaded = _save_strategy()
    dist_checkpointing.save(
        _sharded_state(model, optimizer, scheduler, progress),
        str(staging),
        strategy,
        content_metadata=CONTENT_METADATA,
    )
    written = dict(threaded.checksums)
    if rng:
        rng_name = f"rng/rank_{_rank():05d}.pt"
        written[rng_name] = _write_rng_state(staging / rng_name)
    checksums = _gather_checksums(written)
    if _rank() == 0:
        meta = {
            "iteration": progress.iteration,
            "layout": _layout(),
            "model": _model_identity(model),
            "optimizer": optimizer is not None,
            **({"optimizer_format": optimizer.state_format} if optimizer is not None else {}),
            "rng": rng,
        }
        _write_manifest(staging, meta, checksums)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        tracker_tmp = root / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{progress.iteration}\n")
        os.replace(tracker_tmp, root / TRACKER)
        if model_flags is not None:
            _write_model_flags(root, model_flags)
    _barrier()
    logger.info("saved checkpoint %s", final)
    return final


def _write_model_flags(root: Path, flags: list[str]) -> None:
    """``MODEL_FLAGS_FILE`` beside the checkpoints: the flags that build their model, so that
    ``--finetune`` into a new run and ``tools.convert_hf export`` need no retyping (written
    whole or not at all)."""
    partial = root / (MODEL_FLAGS_FILE + ".tmp")
    partial.write_text(shlex.join(flags) + "\n")
    os.replace(partial, root / MODEL_FLAGS_FILE)


def latest_iteration(load_dir: Path) -> int | None:
    """The iteration the tracker file names, or None when the directory has no checkpoint."""
    tracker = load_dir / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not re.fullmatch(r"[0-9]+", text):  # str.isdigit() takes "²"
        raise CheckpointError(f"{tracker} should hold an iteration number, not {text!r}")
    return int(text)


def _broadcast_error(error: str | None) -> None:
    """Raise the same CheckpointError on every rank when rank 0 found one."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


_ITERATION_DIR = re.compile(r"iter_\d{7}")


def _check_untracked(root: Path, *, flag: str = "--load") -> None:
    """A ``--load`` directory without a tracker must not hold checkpoints either: starting from
    scratch there would quietly drop them."""
    one = (root / MANIFEST).is_file() or (root / megatron_lm.CONFIG).is_file()
    if _ITERATION_DIR.fullmatch(root.name) or one:
        raise UsageError(
            f"{flag} {root} is one checkpoint's directory; give the directory that holds it "
            f"({flag} {root.parent})"
        )
    found = sorted(p.name for p in root.iterdir() if _ITERATION_DIR.fullmatch(p.name))
    if found:
        raise UsageError(
            f"{flag} {root} holds checkpoints ({', '.join(found)}) but no {TRACKER}; write the "
            f"iteration to resume in it (e.g. {int(found[-1][5:])}) to resume from it"
        )


def load_checkpoint(
    *,
    load_dir: str,
    model,
    optimizer,
    scheduler,
    schedule: str = "strict",
    scope: LoadScope = LoadScope(),
    counts_samples: bool = False,
) -> TrainProgress:
    """Restore the latest checkpoint in ``load_dir``, this trainer's or Megatron-LM's; a
    directory without one starts from zero.

    The weights always load; ``scope`` says what else does (a load that skips the progress
    returns iteration 0, one that skips the optimizer leaves it and the LR schedule fresh).
    ``schedule`` says whose LR / weight-decay schedule wins when the checkpoint's differs from
    ``scheduler``'s: ``strict`` (refuse), ``flags`` or ``checkpoint``. ``counts_samples``: the
    run's schedule counts samples (--train-samples), as Megatron-LM's always does.

    Raises:
        CheckpointError: a missing directory, or a checkpoint that is incomplete or corrupt.
        UsageError: a checkpoint that does not fit this run (model, optimizer format, schedule),
            or a directory that holds checkpoints without a tracker.
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"--load directory {root} does not exist")
    iteration = latest_iteration(root)
    if iteration is None:
        _check_untracked(root)
        if _rank() == 0:  # every rank reads the same directory
            logger.warning("no checkpoint in %s (no %s); starting from scratch", root, TRACKER)
        return TrainProgress()
    directory = iteration_dir(root, iteration)
    foreign = _verify(directory)
    wanted = optimizer if scope.optimizer else None
    template = _sharded_state(
        model,
        wanted,
        scheduler,
        TrainProgress(),
        is_loading=True,
        metadata=_content_metadata(directory),
    )
    saved_schedule, layout = None, None  # layout None: RNG states not read (Megatron-LM's)
    if foreign:
        common = megatron_lm.read_common(directory)
        same_model = _check_megatron_lm_fits(directory, common, model, template)
        if wanted is not None:  # refused before the load, not after it
            saved_schedule = megatron_lm.schedule_state(
                common, counts_samples=counts_samples, directory=directory
            )
    else:
        same_model, layout = _check_ours_fits(
            directory, model, optimizer=None if wanted is None else wanted.state_format
        )
    loaded = _load_sharded(directory, template, model, same_model=same_model, foreign=foreign)
    if wanted is None:
        optimizer.reload_model_params()  # mixed precision: main params from the loaded weights
    else:
        optimizer.load_sharded_state_dict(loaded["optimizer"])
        saved_schedule = saved_schedule or loaded["scheduler"]
        _check_schedule(scheduler, saved_schedule, directory=directory, schedule=schedule)
        scheduler.load_state_dict(saved_schedule)
    if scope.rng:
        _maybe_restore_rng(directory, layout=layout, foreign=foreign)
    saved = (
        TrainProgress(*megatron_lm.progress(loaded))
        if foreign
        else TrainProgress(loaded["iteration"], loaded["consumed_samples"])
    )
    kind = "Megatron-LM checkpoint" if foreign else "checkpoint"
    logger.info("loaded %s %s (iteration %d)%s", kind, directory, saved.iteration, scope.describe())
    return saved if scope.progress else TrainProgress()


def _check_ours_fits(directory: Path, model, *, optimizer: dict | None) -> tuple[bool, dict | None]:
    """Refuse a checkpoint of ours that holds another model, or no optimizer state, or state of
    another format, when ``optimizer`` (this run's state format) is to be loaded; (whether it
    records this model, the layout its RNG states were written under, ``None`` when it holds
    none)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    same_model = _check_model_identity(directory, model, manifest.get("model"))
    if optimizer is not None and manifest.get("optimizer") is False:
        raise UsageError(
            f"the checkpoint in {directory} holds no optimizer state (it was saved with "
            "--no-save-optim); load it with --no-load-optim or --finetune"
        )
    saved = manifest.get("optimizer_format")
    if optimizer is not None and isinstance(saved, dict) and saved != optimizer:
        raise UsageError(
            f"the optimizer state in {directory} was saved by {_optimizer_flags(saved)}, this "
            f"run's optimizer is {_optimizer_flags(optimizer)}: give the same flags to resume, "
            "or start from its weights with --no-load-optim (or --finetune)"
        )
    return same_model, None if manifest.get("rng") is False else manifest["layout"]


def _optimizer_flags(state_format: dict) -> str:
    """``{"distributed": True, "precision": "bf16"}`` → ``--use-distributed-optimizer --bf16``."""
    flags = ["--use-distributed-optimizer"] if state_format.get("distributed") else []
    precision = state_format.get("precision")
    flags += [f"--{precision}"] if precision in ("bf16", "fp16") else []
    return " ".join(flags) if flags else "fp32 without --use-distributed-optimizer"


def _verify(directory: Path) -> bool:
    """Verify the checkpoint on rank 0 (every rank raises what it found); True when it is
    Megatron-LM's."""
    foreign = is_megatron_lm_checkpoint(directory)
    error = None
    if _rank() == 0:
        try:
            (verify_megatron_lm_checkpoint if foreign else verify_checkpoint)(directory)
        except CheckpointError as err:
            error = str(err)
    _broadcast_error(error)
    return foreign


def _content_metadata(directory: Path) -> dict | None:
    """The layout its optimizer state was saved in (``content_metadata``, ours and Megatron-LM's
    since 0.14), or None: none recorded, or a common file that cannot be read, which the load
    then names."""
    try:
        return dist_checkpointing.load_content_metadata(str(directory))
    except (RuntimeError, ValueError, KeyError, EOFError, OSError, pickle.UnpicklingError):
        return None


def _load_sharded(directory: Path, template: dict, model, *, same_model: bool, foreign: bool):
    """Load ``template``'s tensors into the model; the checkpoint's state (common and loaded).
    A checkpoint of Megatron-LM's is loaded with megatron-core's check that every requested key
    is there (``RAISE_UNEXPECTED``); ours are checked by their manifest."""
    strict = StrictHandling.RAISE_UNEXPECTED if foreign else StrictHandling.ASSUME_OK_UNEXPECTED
    try:
        loaded = dist_checkpointing.load(template, str(directory), strict=strict)
        _unwrap(model).load_state_dict(loaded["model"])
    except (RuntimeError, ValueError, KeyError, CheckpointingException, CheckpointException) as err:
        first = _first_line(err)
        if same_model:  # the model it records is this one: what does not load is damaged
            raise CheckpointError(
                f"the checkpoint in {directory} cannot be read although it holds this model: "
                f"{first[:300]}; it is damaged (use an earlier iteration)"
            ) from None
        raise UsageError(
            f"the checkpoint in {directory} does not fit this model (another shape or "
            f"architecture?): {first[:300]}"
        ) from None
    return loaded


def _requested(sharded: dict) -> dict:
    """Every sharded key a state dict asks for, by key (factories built: the keys they load)."""
    found = {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            parts = nested_values(built) if isinstance(built, (dict, list)) else [built]
        else:
            parts = [value]
        found.update((part.key, part) for part in parts if hasattr(part, "key"))
    return found


def _check_megatron_lm_fits(directory: Path, common: dict, model, template: dict) -> bool:
    """Refuse a Megatron-LM checkpoint of another model (by its ``args``, each difference named,
    then by its weights' keys and shapes) or whose optimizer state this run's optimizer cannot
    read (when ``template`` asks for one); True: it holds this model. Every rank reaches the
    same verdict (each checks the keys it loads; what none loads is checked against them all)."""
    metadata = _check_torch_metadata(directory)  # verified on rank 0 already
    shapes = megatron_lm.tensor_shapes(metadata)
    rows = shapes.get(megatron_lm.EMBEDDING_KEY, (None,))[0]
    identity = megatron_lm.model_identity(common["args"], embedding_rows=rows)
    _check_model_identity(directory, model, identity)
    stored = megatron_lm.stored_keys(metadata)
    requested = _requested(template["model"])
    problems = [f"{key} missing there" for key in sorted(set(requested) - stored)]
    problems += [
        f"{key} {shapes[key]} there, {tuple(part.global_shape)} here"
        for key, part in requested.items()
        if isinstance(part, ShardedTensor)
        and shapes.get(key, part.global_shape) != part.global_shape
    ]
    gathered = _on_all_ranks((problems, set(requested)))
    loaded_anywhere = set().union(*(keys for _, keys in gathered))
    extra = [
        f"{key} there, not here"
        for key in sorted(stored - loaded_anywhere)
        if "." in key and not key.startswith("optimizer.") and "_extra_state" not in key
    ]
    problems = extra + [problem for found, _ in gathered for problem in found]
    if problems:
        raise UsageError(
            f"the checkpoint in {directory} holds another model's weights: "
            f"{'; '.join(problems[:3])}; load it with the model flags it was trained with"
        )
    if "optimizer" in template:
        _check_megatron_lm_optimizer(directory, common, template["optimizer"], shapes)
    return True


def _on_all_ranks(value) -> list:
    """``value`` of every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _check_megatron_lm_optimizer(
    directory: Path, common: dict, template: dict, shapes: dict[str, tuple[int, ...]]
) -> None:
    """Refuse optimizer state in another format than this run's optimizer keeps (another
    optimizer, Megatron-LM's distributed optimizer layouts, mixed-precision main params)."""
    saved = common.get("optimizer")
    missing = [
        key
        for key, part in _requested(template).items()
        if isinstance(part, ShardedTensor) and shapes.get(key) != tuple(part.global_shape)
    ]
    missing = [key for keys in _on_all_ranks(missing) for key in keys]
    if not isinstance(saved, dict) or getattr(common["args"], "no_save_optim", False):
        reason = "it holds none (saved with --no-save-optim)"
    elif missing:
        reason = f"{missing[0]} is not there as this run's optimizer keeps it"
    elif not set(map(str, saved)) <= set(map(str, template)):
        # the common file holds the state's parts that are not sharded (the distributed
        # optimizer's dp_reshardable state is sharded objects, all but its layout's name): a
        # part this run's optimizer does not have is another optimizer's
        layout, ours = sorted(map(str, saved)), sorted(map(str, template))
        reason = f"its state holds {layout}, this run's optimizer {ours}"
    else:
        return
    raise UsageError(
        f"the optimizer state in {directory} does not fit this run's optimizer ({reason}); "
        "start from its weights with --finetune, or keep its iteration and data position "
        "with --no-load-optim"
    )


def _first_line(err: BaseException) -> str:
    """The first line of what went wrong; for torch's per-rank wrapper, of the first rank's."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


_SCHEDULE_KEYS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


def _check_schedule(scheduler, saved: dict, *, directory: Path, schedule: str) -> None:
    """Refuse (``strict``) or report a checkpoint whose LR schedule differs from the flags'."""
    current = scheduler.state_dict()
    differ = [
        f"{key} {saved.get(key)!r} vs {current[key]!r}"
        for key in _SCHEDULE_KEYS
        if key in saved and saved[key] != current[key]
    ]
    if not differ:
        logger.info("LR schedule: the flags' and the checkpoint's agree")
        return
    text = ", ".join(differ)
    if schedule == "strict":
        raise UsageError(
            f"the checkpoint in {directory} was trained with another LR schedule than these flags "
            f"give (checkpoint vs flags: {text}); resume with --override-opt_param-scheduler to "
            "follow the flags or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    whose = "these flags'" if schedule == "flags" else "the checkpoint's"
    logger.warning("LR schedule: %s (checkpoint vs flags: %s)", whose, text)


def _maybe_restore_rng(directory: Path, *, layout: dict | None, foreign: bool) -> None:
    """Restore this rank's RNG states when the checkpoint was written by the same ``layout``
    (``None``: no RNG states to read: Megatron-LM's, or a checkpoint saved with
    --no-save-rng)."""
    if layout is None:
        why = (
            "Megatron-LM's RNG states are not read here"
            if foreign
            else f"the checkpoint in {directory} holds no RNG states (saved with --no-save-rng)"
        )
        logger.warning("%s: RNG states start fresh", why)
        return
    if layout != _layout():
        logger.warning(
            "checkpoint layout %s differs from this run's %s: RNG states start fresh",
            layout,
            _layout(),
        )
        return
    path = directory / "rng" / f"rank_{_rank():05d}.pt"
    try:
        state = torch.load(path, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError, OSError) as err:
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {str(err)[:120]}): the checkpoint is "
            "damaged"
        ) from None
    _set_rng_state(state)


def schedule_policy(checkpoint) -> str:
    """Whose LR schedule a resumed run follows when its checkpoint's differs
    (``checkpoint``: the run's ``CheckpointConfig``)."""
    if checkpoint.override_opt_param_scheduler:
        return "flags"
    if checkpoint.use_checkpoint_opt_param_scheduler:
        return "checkpoint"
    return "strict"
