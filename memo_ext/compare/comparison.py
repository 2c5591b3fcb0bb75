"""One comparison of ``memo-compare``, resolved from its flags (:class:`Comparison`), and
what one configuration of it is: its job's command line, its key in ``compare.json``, the
estimator's prediction and the figures traced on fake tensors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from memo_ext.compare.jobs import (
    Launch,
    Method,
)
from memo_ext.compare.memory import Row, Setup, method_figures, trace_rows
from memo_ext.errors import UsageError
from memo_ext.estimate.calibration import (
    KernelRates,
)
from memo_ext.estimate.cost_model import Batch, Efficiency, EstimateError, estimate
from memo_ext.flags import argv_of
from memo_ext.hardware import (
    DeviceSpec,
)
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

logger = logging.getLogger(__name__)

TRAINER = "memo_ext.commands.pretrain_gpt_memo"
"""The module each job runs under torchrun (``-m``): the installed trainer, from any folder."""


@dataclass
class Comparison:
    """Everything a comparison runs with, resolved and checked from the flags."""

    model: ModelShape
    methods: list[Method]
    layouts: dict[str, ParallelLayout]
    """Method label → its layout (DP included)."""
    seq_lengths: list[int]
    find_max: bool
    granularity: int
    max_seq_length: int
    find_max_start: int | None
    launch: Launch
    micro_batch_size: int
    num_microbatches: int
    keep_last_layers: int | None
    loss_chunks: int
    warmup_steps: int
    measure_steps: int
    timeout_s: float
    time_budget_s: float | None
    memory_limit_gb: float | None
    extra: list[str]
    out: Path
    device: DeviceSpec
    """The device the predictions are for (on CPU: this CPU, measured)."""
    cuda: bool
    host_memory_bytes: int
    efficiency: Efficiency
    kernels: KernelRates | None
    calibrate_path: Path | None
    retry_errors: bool
    notes: list[str] = field(default_factory=list)

    @property
    def fp32(self) -> bool:
        """The jobs train in fp32 (no --bf16 / --fp16 among the passed flags)."""
        return not ({"--bf16", "--fp16"} & set(self.extra))

    def signature(self) -> dict:
        """What makes two comparisons' runs interchangeable (not the methods or lengths)."""
        return {
            "model": dataclasses.asdict(self.model),
            "launch": [self.launch.nproc_per_node, self.launch.nnodes],
            "batch": [self.micro_batch_size, self.num_microbatches],
            "steps": [self.warmup_steps, self.measure_steps],
            "keep_last_layers": self.keep_last_layers,
            "loss_chunks": self.loss_chunks,
            "memory_limit_gb": self.memory_limit_gb,
            "extra": self.extra,
        }


def model_flags(model: ModelShape) -> list[str]:
    """The trainer's flags for ``model`` (its vocabulary through ``NullTokenizer``, which adds
    one token for end-of-document)."""
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size - 1)]
    return argv_of(model) + tokenizer


def layout_flags(layout: ParallelLayout) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout.tp)]
    flags += ["--context-parallel-size", str(layout.cp)]
    flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    return flags + (["--sequence-parallel"] if layout.sp else [])


def job_argv(comp: Comparison, method: Method, seq: int, *, metrics: Path, job_id: str):
    """The command of one configuration's job."""
    layout = comp.layouts[method.label]
    argv = comp.launch.torchrun_argv(job_id=job_id) + ["-m", TRAINER]
    argv += model_flags(comp.model) + layout_flags(layout)
    argv += method.trainer_flags(keep_last_layers=comp.keep_last_layers)
    batch = comp.micro_batch_size * layout.dp * comp.num_microbatches
    argv += ["--seq-length", str(seq), "--micro-batch-size", str(comp.micro_batch_size)]
    argv += ["--global-batch-size", str(batch), "--lr", "1e-4", "--mock-data"]
    argv += ["--train-iters", str(comp.warmup_steps + comp.measure_steps), "--log-interval", "1"]
    argv += ["--metrics-file", str(metrics), "--skip-preflight"]  # real runs decide what fits
    if comp.loss_chunks > 1:
        argv += ["--loss-chunks", str(comp.loss_chunks)]
    if not comp.cuda:  # MFU against the CPU's measured peak
        argv += ["--device-peak-tflops", f"{comp.device.peak_tflops:.6g}"]
    if comp.memory_limit_gb is not None:
        argv += ["--memory-limit-gb", f"{comp.memory_limit_gb:g}"]
    return argv + comp.extra


def run_key(comp: Comparison, method: Method, seq: int) -> str:
    layout = dataclasses.asdict(comp.layouts[method.label])
    text = json.dumps([comp.signature(), method.label, layout, seq], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predict(comp: Comparison, method: Method, seq: int, *, efficiency=None, device=None) -> dict:
    """The estimator's figures for one configuration (``error`` when it cannot estimate it).

    A prediction is a side figure of a measured run: whatever stops the estimator, the run's
    record is still written (with the error), and the comparison goes on."""
    try:
        est = estimate_configuration(comp, method, seq, efficiency=efficiency, device=device)
    except (EstimateError, UsageError) as err:
        return _no_prediction(str(err))
    except Exception as err:  # noqa: BLE001 - a defect of the estimator, reported with the run
        logger.warning("no prediction for %s @ %s: %s", method.label, seq, err, exc_info=True)
        return _no_prediction(f"the estimator failed: {type(err).__name__}: {err}")
    return {
        "step_time_s": est.step_time_s,
        "mfu": est.mfu,
        "peak_memory_bytes": est.device_peak_bytes,
        "fits": est.fits,
        "activation_bytes": est.activation_bytes,
        "host_bytes": est.host_bytes,
        "recompute_flops": est.recompute_flops,
        "alpha": est.alpha,
        "compute_s": est.compute_s,
        "exposed_comm_s": est.exposed_comm_s,
        "exposed_host_copy_s": est.exposed_host_copy_s,
    }


def _no_prediction(error: str) -> dict:
    return {"step_time_s": None, "mfu": None, "peak_memory_bytes": None, "error": error}


def estimate_configuration(
    comp: Comparison, method: Method, seq: int, *, efficiency=None, device=None
):
    """The estimator's :class:`Estimate` of one configuration.

    Raises:
        EstimateError: for a method the estimator does not model.
    """
    spec = method.spec
    if spec.estimator is None:
        raise EstimateError(f"the estimator does not model {method.name}")
    settings = spec.estimator_settings(
        dict(method.settings), keep_last_layers=comp.keep_last_layers
    )
    return estimate(
        model=comp.model,
        device=device or comp.device,
        layout=comp.layouts[method.label],
        batch=Batch(
            micro_batch_size=comp.micro_batch_size,
            num_microbatches=comp.num_microbatches,
            distributed_optimizer="--use-distributed-optimizer" in comp.extra,
        ),
        method=spec.estimator,
        seq_length=seq,
        host_memory_bytes=comp.host_memory_bytes,
        settings=settings,
        efficiency=efficiency or comp.efficiency,
    )


def traced_figures(
    comp: Comparison, method: Method, seq: int, *, measured: dict, predicted: dict
) -> dict:
    """Activation bytes kept, host bytes and recompute FLOPs of one iteration of one process,
    traced on fake tensors in the jobs' precision (``tools.memory_report``'s figures), with the
    settings the run chose (``measured``: its figures, empty when it did not train; else the
    estimator's ``predicted``)."""
    layout = comp.layouts[method.label]
    if layout.cp > 1:
        return {"note": "context parallelism cannot be traced on fake tensors"}
    traced = method.spec.traced(dict(method.settings), measured=measured, predicted=predicted)
    if traced is None:
        return {"note": method.spec.untraced_note()}
    row = Row(traced[0].traced_name(traced[1]), *traced)
    setup = Setup(
        shape=comp.model,
        layout=layout,
        seq_length=seq,
        micro_batch_size=comp.micro_batch_size,
        micro_batches=comp.num_microbatches,
        fp32=comp.fp32,
        keep_last_layers=comp.keep_last_layers,
    )
    try:
        layers = trace_rows(setup, [row])
    except Exception as err:  # noqa: BLE001 - as predict: the run's record is written regardless
        logger.warning("no traced figures for %s @ %s: %s", method.label, seq, err, exc_info=True)
        return {"note": f"the trace failed: {type(err).__name__}: {err}"}
    figures = dataclasses.asdict(method_figures(setup, [row], layers)[row.name])
    return {**figures, "traced_as": row.name, "dtype": "fp32" if comp.fp32 else "bf16"}
