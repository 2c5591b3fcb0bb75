"""What a checkpoint folder holds and which one a run loads: the layout of ``SAVE/`` (tracker,
``iter_N/``, manifest, model flags), the progress a checkpoint carries, what a load takes
(:class:`LoadScope`) and from where (:func:`checkpoint_source`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from memo_ext.config import CheckpointConfig
from memo_ext.errors import ReportedError, UsageError
from memo_ext.training.checkpoint import megatron_lm

logger = logging.getLogger(__name__)


TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FLAGS_FILE = "model_flags.txt"
"""Beside the checkpoints: the trainer flags of their model (:meth:`RunConfig.model_flags`)."""
SOURCE_CONFIG_FILE = "hf_config.json"
"""Beside an imported checkpoint (``memo_ext.hf``): the Hugging Face config.json the model came
from, whose fields no trainer flag holds (token ids, ...) an export keeps."""
CARRIED_FILES = (SOURCE_CONFIG_FILE,)
"""Files beside the checkpoints a run started from that each of its saves carries into its own
``--save`` folder: what a fine-tuned model descends from, for the export."""
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
        if len(fresh) == 3:  # --finetune, an export: what was read is the shorter phrase
            return "; its weights only"
        return f"; fresh: {', '.join(fresh)}" if fresh else ""


EVERYTHING = LoadScope()
"""A resume's load: every part a checkpoint holds."""
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
        check_untracked(load, flag="--load")  # its checkpoints are not skipped unseen
    if config.pretrained_checkpoint:
        root = Path(config.pretrained_checkpoint)
        if latest_iteration(root) is None:
            check_untracked(root, flag="--pretrained-checkpoint")
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


def check_save_target(config: CheckpointConfig) -> None:
    """What a save may overwrite: a ``--save`` folder that already holds checkpoints takes this
    run's only when the run resumes from them (``--load`` the same folder, without
    ``--finetune``). Any other run would replace them (its iterations start again, the tracker
    moves to its own), so the checkpoints a run started from are never lost to it.

    Raises:
        UsageError: naming the folder, what it holds and why this run does not resume from it.
    """
    if not config.save or not Path(config.save).is_dir():
        return
    root = Path(config.save)
    latest = latest_iteration(root)
    held = sorted(p.name for p in root.iterdir() if _ITERATION_DIR.fullmatch(p.name))
    if latest is None and not held:
        return
    source = checkpoint_source(config)
    if source is not None and source.scope.progress and _same_folder(source.root, root):
        return
    if source is not None and _same_folder(source.root, root):
        why = "--finetune takes its weights and starts again at iteration 0"
    elif source is not None:
        why = f"it starts from {source.flag} {source.root}"
    else:
        why = "it loads no checkpoint"
    holds = f"iteration {latest}" if latest is not None else ", ".join(held)
    raise UsageError(
        f"--save {root} holds the checkpoints of another run (up to {holds}), which this run "
        f"does not resume from ({why}): its saves would replace them; give a new --save folder, "
        f"or --load {root} without --finetune to resume them"
    )


def _same_folder(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_iteration(load_dir: Path) -> int | None:
    """The iteration the tracker file names, or None when the directory has no checkpoint."""
    tracker = load_dir / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not re.fullmatch(r"[0-9]+", text):  # str.isdigit() takes "²"
        raise CheckpointError(f"{tracker} should hold an iteration number, not {text!r}")
    return int(text)


_ITERATION_DIR = re.compile(r"iter_\d{7}")


def saved_iterations(root: Path) -> list[int]:
    """The iterations of the complete checkpoints in ``root`` (with their manifest), oldest
    first; a save being written (``iter_N.tmp``) is none."""
    if not root.is_dir():
        return []
    return sorted(
        int(d.name[len("iter_") :])
        for d in root.iterdir()
        if _ITERATION_DIR.fullmatch(d.name) and (d / MANIFEST).is_file()
    )


def check_untracked(root: Path, *, flag: str = "--load") -> None:
    """A ``--load`` directory without a tracker must not hold checkpoints either, nor a Hugging
    Face model: starting from scratch there would quietly drop them."""
    one = (root / MANIFEST).is_file() or (root / megatron_lm.CONFIG).is_file()
    if _ITERATION_DIR.fullmatch(root.name) or one:
        raise UsageError(
            f"{flag} {root} is one checkpoint's directory; give the directory that holds it "
            f"({flag} {root.parent})"
        )
    weights = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
    if (root / "config.json").is_file() or weights:
        raise UsageError(
            f"{flag} {root} is a Hugging Face model folder ({(weights or ['config.json'])[0]}), "
            f"which the trainer does not load; import it first: memo-convert-hf import --hf-dir "
            f"{root} --out CKPT, then --load CKPT --finetune"
        )
    found = sorted(p.name for p in root.iterdir() if _ITERATION_DIR.fullmatch(p.name))
    if found:
        raise UsageError(
            f"{flag} {root} holds checkpoints ({', '.join(found)}) but no {TRACKER}; write the "
            f"iteration to resume in it (e.g. {int(found[-1][5:])}) to resume from it"
        )
