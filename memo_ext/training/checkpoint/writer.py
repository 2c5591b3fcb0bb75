"""Writing: megatron-core's ``torch_dist`` format from threads of this process (the ranks holding
the same replicas share the writing out), fsync'ed and hashed as it is written.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import logging
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
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
from torch.distributed.checkpoint.filesystem import FileSystem

from memo_ext.training.checkpoint.rng import rng_state
from memo_ext.training.checkpoint.source import this_rank

logger = logging.getLogger(__name__)


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
        file's tensors; it is raised here instead (and not printed there: the save's failure
        is reported once, in one sentence, as a full disk is)."""
        with _quiet_about(self.fs.errors):
            written = super().write_data(plan, planner)
        if self.fs.errors:
            raise self.fs.errors[0]
        if len(written.value()) != len(plan.items):
            raise RuntimeError(
                f"torch's checkpoint writer wrote {len(written.value())} of {len(plan.items)} "
                "items without reporting an error"
            )
        return written


@contextlib.contextmanager
def _quiet_about(errors: list[Exception]):
    """A writer thread that dies of an error in ``errors`` (raised again by the caller) prints
    no traceback; any other error of any thread is printed as before. The block's threads are
    waited for (a minute at most) before the hook is put back."""
    printed = threading.excepthook

    def hook(args) -> None:
        seen = args.exc_value in errors or any(
            args.exc_value.__context__ is err or args.exc_value.__cause__ is err for err in errors
        )
        if not seen:
            printed(args)

    before = set(threading.enumerate())
    threading.excepthook = hook
    try:
        yield
    finally:
        # torch's writer returns as soon as this thread's own file fails, its other threads
        # still writing: their errors are this save's too
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=60)
        threading.excepthook = printed


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


def save_strategy() -> tuple[SaveShardedStrategy, _ThreadedTorchDistSave]:
    """The strategy to save with, and the threaded one inside it that knows the checksums. As
    in Megatron-LM, the ranks that hold the same replicas (DP × CP) share out writing them."""
    threaded = _ThreadedTorchDistSave()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return threaded, threaded
    return FullyParallelSaveStrategyWrapper(threaded, group), threaded


def write_rng_state(path: Path) -> str:
    """Write this rank's RNG states to ``path``; their SHA-256."""
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    data = buffer.getbuffer()
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def gather_checksums(checksums: dict[str, str]) -> dict[str, str]:
    """Every rank's checksums on rank 0 (empty elsewhere); also the point where every rank has
    finished writing."""
    if not dist.is_initialized():
        return checksums
    gathered = [None] * dist.get_world_size() if this_rank() == 0 else None
    dist.gather_object(checksums, gathered, dst=0)
    return {name: digest for part in gathered or [] for name, digest in part.items()}
