"""The metrics each logged step writes: console line, JSON Lines file, TensorBoard.

MFU divides the model FLOPs of a step (``memo_ext.shapes.train_flops``: attention included,
recomputation not) by the device's peak (``memo_ext.hardware``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from memo_ext.allocator.cuda import cuda_allocator_installed
from memo_ext.device import on_gpu
from memo_ext.errors import ReportedError, UsageError
from memo_ext.extension import MetricKey

logger = logging.getLogger(__name__)

CURVE_KEYS = ("loss", "grad_norm")
"""What two runs that should be the same must agree on, step by step."""

STEP_KEYS: tuple[MetricKey, ...] = (
    MetricKey(("iteration",), "int", "optimizer step, from 1"),
    MetricKey(("loss",), "float", "mean loss over all real tokens of the global batch"),
    MetricKey(("grad_norm",), "float", "global L2 gradient norm before clipping"),
    MetricKey(("lr",), "float", "learning rate used by this step"),
    MetricKey(
        ("step_time_s",),
        "float",
        "wall time of the step, less one-off work inside it (`plan_time_s`)",
    ),
    MetricKey(("tokens_per_s",), "float", "global batch tokens / step time"),
    MetricKey(("consumed_samples",), "int", "samples trained on so far"),
    MetricKey(
        ("skipped_iterations",),
        "int",
        "steps so far whose update was skipped (an fp16 overflow, non-finite gradients under "
        "`--skip-iterations-with-nan`)",
    ),
    MetricKey(
        ("global_batch_size",),
        "int",
        "sequences of this step (smaller while `--rampup-batch-size` / "
        "`--step-batch-size-schedule` ramps up; documents with `--variable-seq-lengths`)",
    ),
    MetricKey(
        ("tflops_per_device",),
        "float",
        "model FLOPs (attention included, causal half; recomputation not counted) per device "
        "per second",
    ),
    MetricKey(
        ("mfu",), "float", "`tflops_per_device` / device peak (CUDA, or `--device-peak-tflops`)"
    ),
    MetricKey(
        ("mem_allocated_bytes", "mem_reserved_bytes"),
        "int",
        "CUDA peak memory since the last log; with `--memo-allocator plan` (any device), the "
        "allocator core's: arena peak + caching-path peak, and arena + caching-path blocks held",
    ),
)
"""The keys of :class:`StepMetrics`, the ones every record may hold."""

TRAINER_KEYS: tuple[MetricKey, ...] = (
    MetricKey(
        ("loss_scale",),
        "float",
        "`--fp16`: the loss scale after this step (megatron-core's grad scaler)",
    ),
    MetricKey(
        ("params_norm",),
        "float",
        "`--log-params-norm`: L2 norm of all weights after the step's update (each weight once "
        "over TP / PP ranks; fp32 master weights where megatron's optimizer keeps them)",
    ),
    MetricKey(
        ("num_zeros_in_grad",),
        "float",
        "`--log-num-zeros-in-grad`: zero elements of the step's reduced gradient (each weight "
        "once over TP / PP ranks), a count megatron-core's optimizer gives as a float",
    ),
    MetricKey(
        ("val_loss", "val_ppl"),
        "float",
        "`--eval-interval`: loss on `--eval-iters` validation batches, and its exponential",
    ),
    MetricKey(
        ("val_loss_by_position",),
        "dict[str, float]",
        "`--eval-interval` with `--eval-position-min-tokens` above 0 (64 by default): the "
        'validation loss per position bucket, `{"0-63": 5.1, "64-127": 4.9, ...}`',
    ),
    MetricKey(
        ("val_passkey_acc", "val_needle_acc"),
        "float",
        "`--eval-retrieval-lengths`: the share of passkey / needle-in-a-haystack prompts answered "
        "exactly by greedy decoding, over the grid of lengths × depths",
    ),
    MetricKey(
        ("val_passkey_acc_by_cell", "val_needle_acc_by_cell"),
        "dict[str, float]",
        "`--eval-retrieval-lengths`: that share per cell, keyed `LENGTH@DEPTH`, "
        '`{"4096@0": 1.0, "4096@0.5": 0.75, ...}`',
    ),
    MetricKey(
        ("val_passkey_token_acc", "val_needle_token_acc"),
        "float",
        "`--eval-retrieval-lengths`: the share of answer tokens the model predicts right given "
        "the true tokens before them (partial credit: it moves before whole answers do)",
    ),
)
"""Keys the trainer adds to a record besides :class:`StepMetrics`' (features add theirs:
``Extension.metric_keys``)."""


@dataclass
class StepMetrics:
    """One logged step; keys of the metrics file (DESIGN §5)."""

    iteration: int
    loss: float
    grad_norm: float | None
    lr: float
    step_time_s: float
    tokens_per_s: float
    consumed_samples: int
    skipped_iterations: int = 0
    """Steps so far whose update was skipped (an fp16 overflow, --skip-iterations-with-nan)."""
    global_batch_size: int | None = None
    """Samples (documents with --variable-seq-lengths) of this step; grows with
    --rampup-batch-size."""
    tflops_per_device: float | None = None
    mfu: float | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    extra: dict = field(default_factory=dict)
    """Further figures of this step (validation, MEMO, HotSPa), written as top-level keys."""

    def to_json(self) -> dict:
        record = {k: v for k, v in self.__dict__.items() if v is not None and k != "extra"}
        record.update(self.extra)
        return record

    def console_line(self, train_iters: int, *, throughput: bool = False) -> str:
        """The record as one console line; TFLOP/s per device and MFU only with ``throughput``
        (--log-throughput, as Megatron-LM shows them)."""
        parts = [
            f"iter {self.iteration:>6}/{train_iters}",
            f"loss {self.loss:.4f}",
            f"grad norm {self.grad_norm:.3f}" if self.grad_norm is not None else "grad norm -",
            f"lr {self.lr:.3e}",
            f"batch {self.global_batch_size}" if self.global_batch_size is not None else "",
            f"{self.step_time_s * 1e3:.0f} ms/step",
            f"{self.tokens_per_s:,.0f} tok/s",
            f"skipped {self.skipped_iterations}" if self.skipped_iterations else "",
        ]
        if throughput and self.tflops_per_device is not None:
            parts.append(f"{self.tflops_per_device:.3g} TFLOP/s/dev")
        if throughput and self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        if self.mem_allocated_bytes is not None:
            parts.append(f"mem {self.mem_allocated_bytes / 2**30:.2f} GiB")
        parts.append(evaluation_line(self.extra))
        return " | ".join(filter(None, parts))


def evaluation_line(figures: dict) -> str:
    """An evaluation's figures for the console: validation loss, retrieval accuracies."""
    parts = []
    if "val_loss" in figures:
        parts.append(f"val loss {figures['val_loss']:.4f} (ppl {figures['val_ppl']:.2f})")
    for task in ("passkey", "needle"):
        if f"val_{task}_acc" in figures:
            parts.append(f"{task} acc {figures[f'val_{task}_acc']:.3f}")
    return " | ".join(parts)


def cuda_memory() -> tuple[int | None, int | None]:
    """(allocated, reserved) peak bytes on this device since the last call, from torch's caching
    allocator: CUDA only, and not under the allocator core (torch's statistics raise there; the
    core reports its own)."""
    if not on_gpu() or cuda_allocator_installed():
        return None, None
    import torch  # on a GPU only: the metrics tools read files before torch loads

    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    return allocated, reserved


def _records_to_keep(path: Path, resume_from: int) -> list[str]:
    """The lines of ``path`` a run resumed at ``resume_from`` keeps: the records up to that
    iteration. A line that is no record (the half-written last line of a run that was killed,
    say) is dropped with a warning naming it; no record before it is lost."""
    if not path.is_file():
        return []
    kept, dropped = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            iteration = json.loads(line)["iteration"]
        except (json.JSONDecodeError, TypeError, KeyError):
            dropped.append(number)
            continue
        if isinstance(iteration, int) and iteration <= resume_from:
            kept.append(line + "\n")
    if dropped:
        logger.warning(
            "--metrics-file %s: dropped line%s %s, which %s no record (a run stopped while "
            "writing it?); the %d record(s) up to iteration %d are kept",
            path,
            "s" if len(dropped) > 1 else "",
            ", ".join(map(str, dropped)),
            "are" if len(dropped) > 1 else "is",
            len(kept),
            resume_from,
        )
    return kept


def _move_aside(path: Path) -> None:
    """An earlier run's records in ``path`` to ``path.previous`` (replacing an older one)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    previous = path.with_name(path.name + ".previous")
    os.replace(path, previous)
    logger.warning(
        "--metrics-file %s held an earlier run's records: moved to %s (this run starts the "
        "file anew)",
        path,
        previous,
    )


class MetricsWriter:
    """Appends one JSON object per logged step; a no-op when no file was asked for.

    A fresh run starts the file empty; an earlier run's records found there are moved aside to
    ``NAME.previous`` (one generation), with a warning, not lost. A resumed run (``resume_from``
    = the checkpoint's iteration) keeps the records up to that iteration and drops later ones,
    which a run that died after its last checkpoint left behind, so the file reads as one
    uninterrupted run.
    """

    def __init__(self, path: str | None, *, resume_from: int = 0):
        self.path = Path(path) if path else None
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = _records_to_keep(self.path, resume_from) if resume_from else []
            if not resume_from:
                _move_aside(self.path)
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text("".join(kept))  # the old file stays whole until this is
            os.replace(staging, self.path)
        except OSError as err:
            raise UsageError(f"--metrics-file {path}: cannot write it ({err})") from None

    def write(self, record: dict) -> None:
        """Append ``record``. A folder removed during the run is made again (with a warning:
        the records before are gone with it); any other failure ends the run in one sentence.

        Raises:
            ReportedError: the file cannot be written (a full disk, a read-only folder).
        """
        if self.path is None:
            return
        line = json.dumps(record) + "\n"
        try:
            self._append(line)
        except FileNotFoundError:
            logger.warning(
                "--metrics-file %s: its folder was removed during the run; made again from "
                "iteration %s (the records before are gone)",
                self.path,
                record.get("iteration"),
            )
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._append(line)
            except OSError as err:
                raise ReportedError(
                    f"--metrics-file {self.path}: cannot write it ({err})"
                ) from None
        except OSError as err:
            raise ReportedError(f"--metrics-file {self.path}: cannot write it ({err})") from None

    def _append(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


class TensorBoardWriter:
    """Scalars of each logged record under ``train/`` (``val/`` for validation), rank 0 only; a
    record's dict of figures (``val_loss_by_position``) as one scalar per entry under its key,
    e.g. ``val_loss_by_position/64-127``."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir:
            # tensorboard takes a second to import: only runs that write to it pay for it
            from torch.utils.tensorboard import SummaryWriter

            try:
                self.writer = SummaryWriter(log_dir=log_dir)
            except OSError as err:
                raise UsageError(f"--tensorboard-dir {log_dir}: cannot write it ({err})") from None

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["iteration"]
        for key, value in record.items():
            if isinstance(value, dict):
                for name, figure in value.items():
                    if isinstance(figure, (int, float)):
                        self.writer.add_scalar(f"{key}/{name}", figure, step)
                continue
            if key == "iteration" or not isinstance(value, (int, float)):
                continue
            group = "val" if key.startswith("val_") else "train"
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbWriter:
    """Every logged record to a Weights & Biases run, with the metrics file's keys, at its
    iteration; a no-op without a project (rank 0 only, like the metrics file).

    wandb is an optional dependency, imported only here (``pip install wandb``; the flags are
    checked for it before training). ``WANDB_MODE=offline`` keeps the run in ``save_dir`` for a
    later ``wandb sync``.
    """

    def __init__(
        self,
        *,
        project: str | None,
        name: str | None = None,
        save_dir: str | None = None,
        entity: str | None = None,
        config: dict | None = None,
    ):
        self.run = None
        if not project:
            return
        import wandb

        try:
            if save_dir:
                Path(save_dir).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=project, name=name, dir=save_dir, entity=entity or None, config=config
            )
        except Exception as err:  # noqa: BLE001 - wandb fails in many ways (login, network, disk)
            raise UsageError(
                f"--wandb-project {project}: wandb could not start a run ({err}); run wandb login, "
                "or set WANDB_MODE=offline to keep the run on this machine"
            ) from None

    def write(self, record: dict) -> None:
        if self.run is None:
            return
        values = {key: value for key, value in record.items() if key != "iteration"}
        self.run.log(values, step=record["iteration"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file, in order.

    A last line cut short (no newline after it: the run stopped while writing it) is left out
    with a warning.

    Raises:
        UsageError: a missing or empty file, or a line that is not a JSON object with an
            ``iteration``.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UsageError(f"{path} is not a regular file; give the metrics file a run wrote")
    if not path.is_file():
        raise UsageError(f"{path} does not exist; did the run start?")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a metrics file (not text: JSON Lines expected)") from None
    records = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "iteration" not in record:
            if number == len(lines) and not text.endswith("\n") and records:
                # a run stopped while writing its last record: the records before it stand
                logger.warning("%s: line %d is cut short (left out)", path, number)
                break
            raise UsageError(f"{path} line {number} is not a metrics record (a JSON object)")
        records.append(record)
    if not records:
        raise UsageError(f"{path} has no records; did the run log a step?")
    return records


def curve_differences(
    reference: list[dict], other: list[dict], *, rtol: float, keys: tuple[str, ...] = CURVE_KEYS
) -> list[str]:
    """Where two runs' logged curves differ by more than ``rtol`` (relative to the reference),
    one sentence each; empty when they agree at every logged iteration."""
    ref_steps = [r["iteration"] for r in reference]
    other_steps = [o["iteration"] for o in other]
    if ref_steps != other_steps:
        return [f"the runs logged different iterations: {ref_steps} vs {other_steps}"]
    differences = []
    for ref, got in zip(reference, other):
        for key in keys:
            a, b = ref.get(key), got.get(key)
            if not _agree(a, b, rtol=rtol):
                differences.append(f"iteration {ref['iteration']}: {key} {b!r} vs reference {a!r}")
    return differences


def _agree(a, b, *, rtol: float) -> bool:
    """Numbers within ``rtol`` of the reference ``a`` (two NaNs agree: both runs diverged the
    same way); anything else (absent or null in both, lists, objects) when equal."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(b - a) <= rtol * abs(a)
    return a == b
