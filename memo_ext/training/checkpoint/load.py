"""Loading: the newest complete checkpoint (or a given one), verified before anything is read,
checked against the model and the optimizer this run built (ours or Megatron-LM's), then the
weights, and per :class:`LoadScope` the progress, optimizer, schedule and RNG states.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from memo_ext.errors import UsageError
from memo_ext.training.checkpoint import megatron_lm
from memo_ext.training.checkpoint.identity import check_model_identity, unwrap_model
from memo_ext.training.checkpoint.integrity import (
    check_torch_metadata,
    is_megatron_lm_checkpoint,
    verify_checkpoint,
    verify_megatron_lm_checkpoint,
)
from memo_ext.training.checkpoint.rng import set_rng_state
from memo_ext.training.checkpoint.source import (
    EVERYTHING,
    MANIFEST,
    TRACKER,
    CheckpointError,
    LoadScope,
    TrainProgress,
    check_untracked,
    iteration_dir,
    latest_iteration,
    this_rank,
)
from memo_ext.training.checkpoint.state import run_layout, sharded_state

logger = logging.getLogger(__name__)


def _broadcast_error(error: str | None) -> None:
    """Raise the same CheckpointError on every rank when rank 0 found one."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def load_checkpoint(
    *,
    load_dir: str,
    model,
    optimizer,
    scheduler,
    schedule: str = "strict",
    scope: LoadScope = EVERYTHING,
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
        check_untracked(root)
        if this_rank() == 0:  # every rank reads the same directory
            logger.warning("no checkpoint in %s (no %s); starting from scratch", root, TRACKER)
        return TrainProgress()
    directory = iteration_dir(root, iteration)
    foreign = _verify(directory)
    wanted = optimizer if scope.optimizer else None
    template = sharded_state(
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
    same_model = check_model_identity(directory, model, manifest.get("model"))
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
    if this_rank() == 0:
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
        unwrap_model(model).load_state_dict(loaded["model"])
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
    metadata = check_torch_metadata(directory)  # verified on rank 0 already
    shapes = megatron_lm.tensor_shapes(metadata)
    rows = shapes.get(megatron_lm.EMBEDDING_KEY, (None,))[0]
    identity = megatron_lm.model_identity(common["args"], embedding_rows=rows)
    check_model_identity(directory, model, identity)
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
    if layout != run_layout():
        logger.warning(
            "checkpoint layout %s differs from this run's %s: RNG states start fresh",
            layout,
            run_layout(),
        )
        return
    path = directory / "rng" / f"rank_{this_rank():05d}.pt"
    try:
        state = torch.load(path, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError, OSError) as err:
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {str(err)[:120]}): the checkpoint is "
            "damaged"
        ) from None
    set_rng_state(state)


def schedule_policy(checkpoint) -> str:
    """Whose LR schedule a resumed run follows when its checkpoint's differs
    (``checkpoint``: the run's ``CheckpointConfig``)."""
    if checkpoint.override_opt_param_scheduler:
        return "flags"
    if checkpoint.use_checkpoint_opt_param_scheduler:
        return "checkpoint"
    return "strict"
