"""What a run writes and when: the logging, evaluation, checkpoint, cleanup, profile and
preflight sections."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from memo_ext.config.common import (
    at_least,
    check_regular_file,
    check_writable_directory,
    installed,
    parse_token_counts,
)
from memo_ext.errors import UsageError
from memo_ext.flags import finite_float, flag_name
from memo_ext.hardware import DEVICES


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console, metrics-file and TensorBoard output."""

    log_interval: int = 10
    """Log every this many steps (and the first and last)."""
    metrics_file: str | None = None
    """JSON Lines metrics, one object per logged step (rank 0); every setting of the run, resolved,
    goes beside it at start (metrics.jsonl: metrics.config.json)."""
    device_peak_tflops: float | None = None
    """Device dense peak for MFU; looked up from the CUDA device's name when unset."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (rank 0)."""
    log_throughput: bool = False
    """Show TFLOP/s per device and MFU in the console line (the metrics file, TensorBoard and W&B
    always get them)."""
    log_params_norm: bool = False
    """Log the L2 norm of all weights after each step as params_norm (every weight counted once
    over the TP / PP ranks; an all-reduce per step, as Megatron-LM)."""
    log_num_zeros_in_grad: bool = False
    """Log the zero elements of each step's reduced gradient as num_zeros_in_grad (every weight
    counted once over the TP / PP ranks)."""
    wandb_project: str | None = None
    """Also send every record of the metrics file to this Weights & Biases project (rank 0; needs
    pip install wandb; WANDB_MODE=offline writes the run locally)."""
    wandb_exp_name: str | None = None
    """Name of the W&B run; required with --wandb-project, as in Megatron-LM."""
    wandb_save_dir: str | None = None
    """Where W&B keeps its local files (default: --save/wandb, else ./wandb)."""
    wandb_entity: str | None = None
    """W&B team or user the run belongs to (default: the login's)."""

    @property
    def settings_file(self) -> Path | None:
        """Where the run's settings are written: beside the metrics file."""
        return Path(self.metrics_file).with_suffix(".config.json") if self.metrics_file else None

    def check(self) -> None:
        at_least(self.log_interval, 1, "--log-interval")
        self._check_wandb()
        if self.device_peak_tflops is not None and self.device_peak_tflops <= 0:
            raise UsageError(
                f"--device-peak-tflops must be positive, got {self.device_peak_tflops}"
            )
        if self.tensorboard_dir and not installed("tensorboard"):
            raise UsageError(
                "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
            )
        if self.tensorboard_dir:
            check_writable_directory(self.tensorboard_dir, flag="--tensorboard-dir")
        if self.metrics_file:
            if os.path.isdir(self.metrics_file):
                raise UsageError(f"--metrics-file {self.metrics_file} is a directory; give a file")
            check_regular_file(self.metrics_file, flag="--metrics-file")
            parent = os.path.dirname(os.path.abspath(self.metrics_file))
            check_writable_directory(parent, flag=f"--metrics-file {self.metrics_file}: folder")

    def _check_wandb(self) -> None:
        """W&B is on when --wandb-project is given and not empty (Megatron-LM's '' means off);
        its other flags without --wandb-project would be ignored, so they are refused."""
        if self.wandb_project is None:
            given = {
                "--wandb-exp-name": self.wandb_exp_name,
                "--wandb-save-dir": self.wandb_save_dir,
                "--wandb-entity": self.wandb_entity,
            }
            for flag, value in given.items():
                if value:
                    raise UsageError(f"{flag} applies only with --wandb-project; add it")
        if not self.wandb_project:
            return
        if not self.wandb_exp_name:
            raise UsageError("--wandb-project needs --wandb-exp-name NAME, the name of the run")
        if self.wandb_save_dir:
            check_writable_directory(self.wandb_save_dir, flag="--wandb-save-dir")
        if not installed("wandb"):
            raise UsageError("--wandb-project needs the wandb package: pip install wandb")


def parse_depths(text: str) -> tuple[float, ...]:
    """``"0,0.5,1"`` → ``(0.0, 0.5, 1.0)``.

    Raises:
        argparse.ArgumentTypeError: naming the text.
    """
    try:
        return tuple(finite_float(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated fractions in [0, 1], got {text!r}"
        ) from None


def parse_tasks(text: str) -> tuple[str, ...]:
    """``"passkey,needle"`` → ``("passkey", "needle")``.

    Raises:
        argparse.ArgumentTypeError: naming an unknown task.
    """
    tasks = tuple(part.strip() for part in text.split(","))
    unknown = [task for task in tasks if task not in RETRIEVAL_TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated tasks of {', '.join(RETRIEVAL_TASKS)}, got {text!r}"
        )
    return tasks


RETRIEVAL_TASKS = ("passkey", "needle")


@dataclass(frozen=True, kw_only=True)
class EvaluationConfig:
    """Validation during training."""

    eval_interval: int | None = None
    """Evaluate on the validation split every N steps (never if unset)."""
    eval_iters: int = 10
    """Validation global batches per evaluation."""
    eval_position_min_tokens: int = 64
    """Width in tokens of the first position bucket of the validation loss by position
    (val_loss_by_position: buckets [0, N), [N, 2N), [2N, 4N), ... up to --seq-length); 0 turns
    it off."""
    eval_retrieval_lengths: tuple[int, ...] = field(
        default=(), metadata={"parse": parse_token_counts, "metavar": "N1,N2,..."}
    )
    """Also score retrieval at each evaluation: passkey and needle-in-a-haystack prompts of these
    context lengths in tokens (they may exceed --seq-length), answered by greedy decoding with
    exact match (val_passkey_acc, val_needle_acc and their grids in the metrics file)."""
    eval_retrieval_depths: tuple[float, ...] = field(
        default=(0.0, 0.25, 0.5, 0.75, 1.0), metadata={"parse": parse_depths, "metavar": "D1,..."}
    )
    """Where the number hides, as the share of the filler before it: 0 first, 1 last."""
    eval_retrieval_samples: int = 4
    """Prompts per (task, length, depth) cell; a cell's accuracy is the share answered exactly."""
    eval_retrieval_tasks: tuple[str, ...] = field(
        default=RETRIEVAL_TASKS, metadata={"parse": parse_tasks, "metavar": "TASK,..."}
    )
    """Which retrieval tasks: passkey (a number in repeated filler sentences), needle (a number
    in the run's validation documents; the filler sentences without validation data)."""
    eval_retrieval_digits: int = 5
    """Digits of the number to retrieve."""
    skip_train: bool = False
    """Train no step: evaluate the loaded weights once (validation loss with --eval-iters,
    retrieval with --eval-retrieval-lengths), write the record at the checkpoint's iteration,
    and exit."""

    @property
    def retrieval(self) -> bool:
        """Retrieval is scored at each evaluation."""
        return bool(self.eval_retrieval_lengths)

    @property
    def enabled(self) -> bool:
        return bool(self.eval_interval) and (self.eval_iters > 0 or self.retrieval)

    def check(self) -> None:
        at_least(self.eval_interval, 1, "--eval-interval")
        at_least(self.eval_iters, 0, "--eval-iters")
        at_least(self.eval_position_min_tokens, 0, "--eval-position-min-tokens")
        self._check_retrieval()

    def _check_retrieval(self) -> None:
        lengths, depths = self.eval_retrieval_lengths, self.eval_retrieval_depths
        if not lengths:
            given = [
                f"--{f.name.replace('_', '-')}"
                for f in dataclasses.fields(self)
                if f.name.startswith("eval_retrieval_") and getattr(self, f.name) != f.default
            ]
            if given:
                raise UsageError(
                    f"{', '.join(given)} only apply with --eval-retrieval-lengths; add it"
                )
            return
        if any(length < 1 for length in lengths):
            raise UsageError(f"--eval-retrieval-lengths must be positive, got {lengths}")
        if len(set(lengths)) != len(lengths):
            raise UsageError(f"--eval-retrieval-lengths names a length twice: {lengths}")
        outside = [depth for depth in depths if not 0.0 <= depth <= 1.0]
        if outside:
            raise UsageError(
                f"--eval-retrieval-depths must lie in [0, 1] (the share of the filler before the "
                f"number), got {outside[0]:g}"
            )
        if not depths or len(set(depths)) != len(depths):
            raise UsageError(f"--eval-retrieval-depths must name distinct depths, got {depths}")
        at_least(self.eval_retrieval_samples, 1, "--eval-retrieval-samples")
        if not 1 <= self.eval_retrieval_digits <= 18:
            raise UsageError(
                f"--eval-retrieval-digits must be in [1, 18], got {self.eval_retrieval_digits}"
            )
        if len(set(self.eval_retrieval_tasks)) != len(self.eval_retrieval_tasks):
            raise UsageError(
                f"--eval-retrieval-tasks names a task twice: {self.eval_retrieval_tasks}"
            )

    def check_split(self, *, split: str, mock_data: bool) -> None:
        """Evaluation reads the validation part of --split (mock data has every part)."""
        if not self.enabled or mock_data:
            return
        weights = [float(w) for w in split.replace("/", ",").split(",") if w.strip()]
        if len(weights) < 2 or weights[1] <= 0:
            raise UsageError(f"--eval-interval needs a validation part in --split, got {split!r}")


@dataclass(frozen=True, kw_only=True)
class CleanupConfig:
    """When the trainer hands cached device memory back and collects Python garbage."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Return the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 0 never, 1 after
    each step's forward / backward passes and each validation batch, 2 also after the optimizer
    step. Less fragmentation, slower steps; nothing to free on CPU."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off while training and collect at fixed points
    instead (every --manual-gc-interval steps, around evaluations), so no rank stalls the others
    at a random step."""
    manual_gc_interval: int = 0
    """With --manual-gc, collect every N steps (0: never between steps)."""
    manual_gc_eval: bool = True
    """With --manual-gc, collect before each evaluation and the evaluation's garbage after it;
    --no-manual-gc-eval skips both."""

    def check(self) -> None:
        at_least(self.manual_gc_interval, 0, "--manual-gc-interval")
        if not self.manual_gc and (self.manual_gc_interval or not self.manual_gc_eval):
            raise UsageError(
                "--manual-gc-interval / --no-manual-gc-eval apply with --manual-gc; add --manual-gc"
            )


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """Profiling a window of training steps on some ranks."""

    FLAG_PREFIX: ClassVar[str] = "profile"

    enabled: bool = field(default=False, metadata={"flag": "--profile"})
    """Profile iterations --profile-step-start to --profile-step-end − 1 on the --profile-ranks:
    a torch.profiler trace (Chrome trace JSON for Perfetto or TensorBoard) in --tensorboard-dir,
    else ./profile, with --use-pytorch-profiler or on CPU; on CUDA without it, an nsys capture
    range (run under nsys profile --capture-range=cudaProfilerApi)."""
    step_start: int = 10
    """First profiled iteration; the one before it warms the profiler up."""
    step_end: int = 12
    """Profiling stops before this iteration."""
    ranks: tuple[int, ...] = (0,)
    """Global ranks that profile."""
    use_pytorch_profiler: bool = field(default=False, metadata={"flag": "--use-pytorch-profiler"})
    """Profile with torch.profiler instead of an nsys range (always so on CPU)."""

    @property
    def first_iteration(self) -> int:
        """The first profiled iteration (iterations count from 1)."""
        return max(self.step_start, 1)

    def check(self, *, train_iters: int | None, world_size: int) -> None:
        if not self.enabled:
            given = [
                flag_name(f, prefix=self.FLAG_PREFIX)
                for f in dataclasses.fields(self)
                if f.name != "enabled" and getattr(self, f.name) != f.default
            ]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise UsageError(f"{', '.join(given)} only {verb} with --profile; add --profile")
            return
        at_least(self.step_start, 0, "--profile-step-start")
        if self.step_end <= self.first_iteration:
            raise UsageError(
                f"--profile-step-end {self.step_end} must be larger than --profile-step-start "
                f"{self.step_start} (and than 1): iterations [start, end) are profiled"
            )
        if train_iters is not None and self.first_iteration > train_iters:
            raise UsageError(
                f"--profile-step-start {self.step_start} is past --train-iters {train_iters}: "
                "nothing would be profiled"
            )
        outside = [r for r in self.ranks if not 0 <= r < world_size]
        if not self.ranks or outside:
            raise UsageError(
                f"--profile-ranks must name ranks in [0, {world_size}), got "
                f"{' '.join(map(str, self.ranks)) or 'none'}"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving, resuming and stopping early."""

    save: str | None = None
    """Directory to write checkpoints to."""
    load: str | None = None
    """Resume from the newest checkpoint in this directory (none there: start fresh). Megatron-LM's
    own torch_dist checkpoints load too."""
    finetune: bool = False
    """Load only the model weights of the checkpoint: start at iteration 0 with a fresh optimizer,
    LR schedule, data position and RNG (Megatron-LM's --finetune)."""
    pretrained_checkpoint: str | None = None
    """Directory of checkpoints to take the starting weights from, as with --finetune, while
    --load holds none (or is not given); once --load holds one, runs resume from it."""
    load_optim: bool = True
    """On load, restore the optimizer's moments and the LR schedule; --no-load-optim starts both
    afresh (the schedule from its first step, as Megatron-LM) and keeps the weights, iteration and
    data position."""
    load_rng: bool = True
    """On load, restore every process's RNG states (under the checkpoint's layout);
    --no-load-rng starts them afresh."""
    save_optim: bool = True
    """Checkpoints hold the optimizer's moments and the LR schedule; --no-save-optim leaves them
    out (smaller checkpoints, which load with --finetune or --no-load-optim)."""
    save_rng: bool = True
    """Checkpoints hold every process's RNG states; --no-save-rng leaves them out (a run that
    loads such a checkpoint starts its RNG states afresh, as with --no-load-rng, and says so)."""
    save_interval: int | None = None
    """Save every this many steps (and at the end)."""
    exit_interval: int | None = None
    """Save and stop after a step whose number is a multiple of N."""
    exit_duration_in_mins: float | None = None
    """Save and stop after N minutes."""
    exit_signal_handler: bool = False
    """On SIGTERM / SIGINT save at the next step boundary and exit 0."""
    override_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--override-opt_param-scheduler"}
    )
    """On resume, train with the LR / weight-decay schedule of these flags, not the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--use-checkpoint-opt_param-scheduler"}
    )
    """On resume, keep the checkpoint's LR / weight-decay schedule whatever these flags say.
    Without either flag a resumed run whose schedule differs from its checkpoint's stops and
    names the difference (as Megatron-LM does)."""

    def check(self) -> None:
        at_least(self.save_interval, 1, "--save-interval")
        at_least(self.exit_interval, 1, "--exit-interval")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise UsageError(
                f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise UsageError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                "exclusive; choose the flags' schedule or the checkpoint's"
            )
        if self.save:
            check_writable_directory(self.save, flag="--save")
        if self.save_interval and not self.save:
            raise UsageError("--save-interval needs --save DIR")
        if not self.save_optim and not self.save:
            raise UsageError("--no-save-optim applies to the checkpoints of --save DIR; add it")
        if not self.save_rng and not self.save:
            raise UsageError("--no-save-rng applies to the checkpoints of --save DIR; add it")
        self._check_loading()
        same = self.save and os.path.abspath(self.load or "") == os.path.abspath(self.save)
        if self.load and os.path.exists(self.load) and not os.path.isdir(self.load):
            raise UsageError(
                f"--load {self.load} is a file, not a directory; give the folder of checkpoints "
                "(the one that holds latest_checkpointed_iteration.txt)"
            )
        if self.load and not os.path.isdir(self.load) and not same:
            # --load DIR --save DIR on a first run (Megatron-LM scripts' pattern) starts fresh
            raise UsageError(f"--load directory {self.load} does not exist")
        stops = self.exit_interval or self.exit_duration_in_mins or self.exit_signal_handler
        if stops and not self.save:
            raise UsageError(
                "--exit-interval / --exit-duration-in-mins / --exit-signal-handler save before "
                "stopping and need --save DIR"
            )

    def _check_loading(self) -> None:
        """What to load needs a checkpoint to load it from."""
        loads = self.load or self.pretrained_checkpoint
        if self.finetune and not loads:
            raise UsageError(
                "--finetune takes the weights of --load DIR or --pretrained-checkpoint DIR; "
                "give one"
            )
        if not (self.load_optim and self.load_rng) and not loads:
            raise UsageError(
                "--no-load-optim / --no-load-rng apply when a checkpoint is loaded; add --load DIR"
            )
        pretrained = self.pretrained_checkpoint
        if pretrained and not os.path.isdir(pretrained):
            raise UsageError(
                f"--pretrained-checkpoint {pretrained} is not a directory; give the folder of "
                "checkpoints (the one that holds latest_checkpointed_iteration.txt)"
            )


@dataclass(frozen=True, kw_only=True)
class PreflightConfig:
    """The memory check made before the model is built (``memo_ext.features.preflight``)."""

    enabled: bool = field(default=True, metadata={"flag": "--skip-preflight"})
    """Estimate device and host memory first and refuse a run that cannot fit; --skip-preflight
    runs it even if it cannot fit."""
    device: str | None = field(
        default=None, metadata={"flag": "--preflight-device", "choices": sorted(DEVICES)}
    )
    """Check the run against this device preset (default: the CUDA device; none on CPU); HotSPa's
    auto layouts are planned for it too."""
    calibration: str | None = field(default=None, metadata={"metavar": "FILE"})
    """Estimator calibration (memo-calibration/1 JSON, written by python -m tools.compare_methods
    --calibrate): the measured matmul / attention efficiencies and host-link bandwidth replace the
    estimator's assumptions in the preflight and in HotSPa's auto layouts."""
    memory_limit_gb: float | None = None
    """Cap this process's memory so that a run too big for a smaller device fails here with out
    of memory (exit status 3): on CUDA the device memory torch may use, in GiB (the preflight
    checks against it too); on CPU how far the process's data segment may grow after start-up
    (RLIMIT_DATA). Not with --memo-allocator plan on CUDA."""

    def check(self) -> None:
        """Refuse a non-positive limit (the calibration file is read by
        ``memo_ext.data.input_files.check_inputs``)."""
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise UsageError(f"--memory-limit-gb must be positive, got {self.memory_limit_gb}")
