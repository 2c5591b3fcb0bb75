"""Saving: one writer per save folder (a lock) and the atomic commit (``iter_N.tmp`` renamed once
every rank is done, then the tracker replaced).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shlex
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from memo_ext.errors import UsageError
from memo_ext.training.checkpoint.identity import model_identity
from memo_ext.training.checkpoint.integrity import write_manifest
from memo_ext.training.checkpoint.source import (
    CARRIED_FILES,
    MODEL_FLAGS_FILE,
    TRACKER,
    CheckpointError,
    TrainProgress,
    barrier,
    iteration_dir,
    latest_iteration,
    this_rank,
)
from memo_ext.training.checkpoint.state import CONTENT_METADATA, run_layout, sharded_state
from memo_ext.training.checkpoint.writer import gather_checksums, save_strategy, write_rng_state

logger = logging.getLogger(__name__)


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
    if this_rank() == 0:
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
    for staging in root.glob("iter_*.tmp"):  # a stopped run's unfinished save: never loaded
        shutil.rmtree(staging, ignore_errors=True)
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
    carried_from: Path | None = None,
) -> Path:
    """Write the checkpoint of ``progress.iteration`` atomically; return its directory. Without
    ``save_optim`` (--no-save-optim) it holds no optimizer moments and LR schedule; without
    ``save_rng`` (--no-save-rng) no RNG states. ``model_flags`` (the run's
    :meth:`~memo_ext.config.RunConfig.model_flags`) go to ``MODEL_FLAGS_FILE`` in ``save_dir``;
    the ``CARRIED_FILES`` beside the checkpoints of ``carried_from`` (the folder the run started
    from) are copied there too.

    Raises:
        CheckpointError: the save failed (a full disk is named as such); the previous checkpoint
            is untouched.
    """
    try:
        optimizer = optimizer if save_optim else None
        return _save(
            save_dir,
            progress,
            model,
            optimizer,
            scheduler,
            rng=save_rng,
            model_flags=model_flags,
            carried_from=carried_from,
        )
    except (OSError, RuntimeError, CheckpointException) as err:
        # torch.distributed.checkpoint reports its writers' OSErrors as "Worker failure: ..."
        reason = _os_reason(err) if isinstance(err, OSError) else _wrapped_reason(err, save_dir)
        if reason is None:
            raise
        previous = latest_iteration(Path(save_dir))
        kept = f"iteration {previous} is still the latest" if previous else "no earlier checkpoint"
        raise CheckpointError(
            f"saving iteration {progress.iteration} to {save_dir} failed: {reason}; {kept}"
        ) from err


def _wrapped_reason(err: Exception, save_dir: str) -> str | None:
    """The file-system reason inside an error torch's checkpoint writer raised, or ``None``
    when it carries none (a bug, not a fault: raised as it is)."""
    text = str(err)
    short = re.search(r"inline_container\.cc.*?(unexpected pos \d+ vs \d+|file write failed)", text)
    if short is not None:  # torch.save's zip writer: a write came back short, with no errno
        return (
            f"torch's file writer stopped short ({short.group(1)}), with "
            f"{_free_bytes(Path(save_dir)) / 2**20:.0f} MiB free on the disk"
        )
    match = re.search(r"\[Errno (\d+)\] ([^'\n]*)", text)
    if match is None:
        return None
    number, strerror = int(match.group(1)), match.group(2).strip()
    return _os_reason(OSError(number, strerror))


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _save(
    save_dir: str,
    progress: TrainProgress,
    model,
    optimizer,
    scheduler,
    *,
    rng: bool = True,
    model_flags: list[str] | None = None,
    carried_from: Path | None = None,
) -> Path:
    root = Path(save_dir)
    final = iteration_dir(root, progress.iteration)
    staging = final.with_name(final.name + ".tmp")
    if this_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    strategy, threaded = save_strategy()
    dist_checkpointing.save(
        sharded_state(model, optimizer, scheduler, progress),
        str(staging),
        strategy,
        content_metadata=CONTENT_METADATA,
    )
    written = dict(threaded.checksums)
    if rng:
        rng_name = f"rng/rank_{this_rank():05d}.pt"
        written[rng_name] = write_rng_state(staging / rng_name)
    checksums = gather_checksums(written)
    if this_rank() == 0:
        meta = {
            "iteration": progress.iteration,
            "layout": run_layout(),
            "model": model_identity(model),
            "optimizer": optimizer is not None,
            **({"optimizer_format": optimizer.state_format} if optimizer is not None else {}),
            "rng": rng,
        }
        write_manifest(staging, meta, checksums)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        tracker_tmp = root / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{progress.iteration}\n")
        os.replace(tracker_tmp, root / TRACKER)
        if model_flags is not None:
            _write_model_flags(root, model_flags)
        if carried_from is not None:
            _carry_files(carried_from, root)
    barrier()
    logger.info("saved checkpoint %s", final)
    return final


def _write_model_flags(root: Path, flags: list[str]) -> None:
    """``MODEL_FLAGS_FILE`` beside the checkpoints: the flags that build their model, so that
    ``--finetune`` into a new run and ``tools.convert_hf export`` need no retyping (written
    whole or not at all)."""
    partial = root / (MODEL_FLAGS_FILE + ".tmp")
    partial.write_text(shlex.join(flags) + "\n")
    os.replace(partial, root / MODEL_FLAGS_FILE)


def _carry_files(source: Path, root: Path) -> None:
    """``CARRIED_FILES`` from beside the checkpoints in ``source`` to beside those in ``root``
    (each written whole or not at all), so that a save descended from an import still names the
    config an export needs; a file ``source`` lacks is left as it is."""
    if source.resolve() == root.resolve():
        return
    for name in CARRIED_FILES:
        if (source / name).is_file():
            partial = root / (name + ".tmp")
            shutil.copyfile(source / name, partial)
            os.replace(partial, root / name)
