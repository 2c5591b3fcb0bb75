"""Will this run fit? A check the trainer makes before building the model.

``preflight(run)`` estimates the run's device peak and host bytes under the memory method its
flags select (``memo_ext.features.memory_method_of``) and returns a :class:`Report`;
``check_preflight(run)`` raises :class:`PreflightError` with the numbers and a suggestion (another
method's flag such as ``--memo``, a larger CP, …) when the run cannot fit. The device is the CUDA
device's preset (by name) or one given explicitly; on a machine without a GPU and without a given
device nothing is checked. ``--calibration`` replaces the estimator's assumed efficiencies and
host link with a machine's measured ones; ``--memory-limit-gb`` lowers the device's memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from memo_ext.config import RunConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.calibration import apply_calibration
from memo_ext.estimate.cost_model import Batch, Efficiency, Estimate, EstimateError
from memo_ext.estimate.cost_model import estimate as run_estimate
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.extension import PlanningTarget
from memo_ext.features.registry import METHODS, memory_method_of
from memo_ext.hardware import (
    DEVICES,
    GIB,
    DeviceSpec,
    available_host_memory_bytes,
    cuda_device,
    device_spec,
    read_calibration,
)
from memo_ext.parallel import ParallelLayout

logger = logging.getLogger(__name__)

_NO_GPU = "preflight skipped: no known GPU here (--preflight-device checks against a preset)"

AUTO_DEVICE = "h100-80g"
"""The device ``auto`` choices (HotSPa's layouts, MEMO's chunk) plan for on a machine without a
GPU and without ``--preflight-device``."""


class PreflightError(UsageError):
    """The run cannot fit device or host memory; the message says by how much and what to do."""


@dataclass
class Report:
    """What the preflight found."""

    checked: bool
    """False when there was nothing to check against (no device known)."""
    fits: bool
    """True when the run fits device and host memory (or was not checked)."""
    message: str
    """One paragraph: the numbers, and a suggestion when it does not fit."""
    estimate: Estimate | None = None


def _batch(run: RunConfig) -> Batch:
    return Batch(
        micro_batch_size=run.train.micro_batch_size,
        num_microbatches=max(1, run.num_microbatches),
        distributed_optimizer=run.train.use_distributed_optimizer,
    )


def preflight(
    run: RunConfig,
    *,
    device: DeviceSpec | None = None,
    host_memory_bytes: int | None = None,
    efficiency: Efficiency | None = None,
    target: PlanningTarget | None = None,
) -> Report:
    """Estimates ``run`` and says whether it fits.

    Args:
        run: the parsed run.
        device: the accelerator; default the CUDA device's preset.
        host_memory_bytes: host memory per node; default MEMO's budget (``--memo-host-memory-gb``
            per process) times the node's processes, else the memory available now.
        efficiency: estimator knobs (headroom, host share …).
        target: the run's device as the trainer decided it (:func:`planning_target`), in place
            of ``device`` and ``efficiency``.
    """
    if target is not None:
        if target.device is None:
            return Report(checked=False, fits=True, message=_NO_GPU)
        device = target.planned
        efficiency = replace(target.efficiency, loss_chunks=run.model.loss_chunks)
    else:
        device = device or cuda_device()
        if device is None:
            return Report(checked=False, fits=True, message=_NO_GPU)
        efficiency = efficiency or Efficiency(loss_chunks=run.model.loss_chunks)
        device, efficiency = as_configured(run, device, efficiency)
    layout = run.layout
    if host_memory_bytes is None:
        host_memory_bytes = _host_memory_bytes(run, layout, device, efficiency)
    method = memory_method_of(run)
    kwargs = dict(
        model=run.shape,
        device=device,
        batch=_batch(run),
        method=method,
        host_memory_bytes=host_memory_bytes,
        settings=method.settings_of(run),
        efficiency=efficiency,
    )
    try:
        est = run_estimate(layout=layout, seq_length=run.data.seq_length, **kwargs)
    except EstimateError as err:
        return Report(checked=False, fits=True, message=f"preflight skipped: {err}")
    if est.fits:
        refused = _retrieval_misfit(run, est, kwargs)
        if refused:
            return Report(checked=True, fits=False, message=refused, estimate=est)
        return Report(checked=True, fits=True, message=_numbers(est, method), estimate=est)
    hint = _suggestion(est, layout=layout, seq_length=run.data.seq_length, **kwargs)
    message = f"this run does not fit: {_numbers(est, method)}; {hint}"
    return Report(checked=True, fits=False, message=message, estimate=est)


def _retrieval_misfit(run: RunConfig, est: Estimate, kwargs: dict) -> str | None:
    """Why a retrieval prompt of the grid cannot run, or None. A prompt is one sequence forward
    under no_grad: the model states (the training estimate's) plus what the estimator prices as
    the transient at that length (one layer's working set and the logits) must fit; lengths up
    to --seq-length fit when training does."""
    longer = sorted(n for n in run.evaluation.eval_retrieval_lengths if n > run.data.seq_length)
    single = {**kwargs, "batch": replace(kwargs["batch"], micro_batch_size=1, num_microbatches=1)}
    needs = {}
    for length in longer:
        try:
            at_length = run_estimate(layout=run.layout, seq_length=length, **single)
        except EstimateError as err:
            logger.info("preflight: retrieval at %d tokens not estimated: %s", length, err)
            return None
        needs[length] = (
            at_length.transient_bytes,
            est.model_state_bytes + at_length.transient_bytes,
        )
    misfits = [n for n, (_, need) in needs.items() if need > est.device_usable_bytes]
    if not misfits:
        return None
    length = misfits[0]
    transient, need = needs[length]
    fits = [n for n in run.evaluation.eval_retrieval_lengths if n not in misfits]
    return (
        f"--eval-retrieval-lengths {length} does not fit: one prompt of {length} tokens needs "
        f"{need / GIB:.1f} GiB (model states {est.model_state_bytes / GIB:.1f}, one layer's "
        f"working set and the logits {transient / GIB:.1f}) of "
        f"{est.device_usable_bytes / GIB:.1f} GiB usable; keep "
        f"{','.join(map(str, fits)) if fits else 'shorter lengths'}, or use a larger "
        "--context-parallel-size"
    )


def as_configured(
    run: RunConfig, device: DeviceSpec, efficiency: Efficiency
) -> tuple[DeviceSpec, Efficiency]:
    """The device and efficiencies after ``--calibration`` and ``--memory-limit-gb``."""
    if run.preflight.calibration is not None:
        calibration = read_calibration(run.preflight.calibration)
        device, efficiency = apply_calibration(calibration, device=device, efficiency=efficiency)
    if run.preflight.memory_limit_gb is not None:
        limit = int(run.preflight.memory_limit_gb * GIB)
        device = replace(device, memory_bytes=min(device.memory_bytes, limit))
    return device, efficiency


def planning_target(run: RunConfig) -> PlanningTarget:
    """The device ``run`` plans for, decided once: ``--preflight-device``, else the CUDA
    device's preset, else (for ``auto`` choices only) :data:`AUTO_DEVICE`; with ``--calibration``
    and ``--memory-limit-gb`` applied (:func:`as_configured`)."""
    device = device_spec(run.preflight.device) if run.preflight.device else cuda_device()
    planned, efficiency = as_configured(run, device or DEVICES[AUTO_DEVICE], Efficiency())
    return PlanningTarget(device=device, planned=planned, efficiency=efficiency)


def check_preflight(run: RunConfig, **kwargs) -> Report:
    """:func:`preflight`, raising :class:`PreflightError` when the run cannot fit."""
    report = preflight(run, **kwargs)
    if not report.fits:
        raise PreflightError(report.message + " (--skip-preflight runs it anyway)")
    logger.info(report.message if not report.checked else f"preflight: {report.message}")
    return report


def _host_memory_bytes(
    run: RunConfig, layout: ParallelLayout, device: DeviceSpec, eff: Efficiency
) -> int:
    procs = min(layout.world_size, device.gpus_per_node)
    if run.memo.host_memory_gb is not None:
        # the user's per-process budget, expressed as node memory the estimator shares out
        return int(run.memo.host_memory_gb * GIB * procs / eff.host_share)
    return available_host_memory_bytes()


def _numbers(est: Estimate, method: MemoryMethod) -> str:
    gib = GIB
    text = (
        f"device peak {est.device_peak_bytes / gib:.1f} GiB of {est.device_usable_bytes / gib:.1f}"
        f" GiB usable (model states {est.model_state_bytes / gib:.1f}, activations "
        f"{est.activation_bytes / gib:.1f}, transient {est.transient_bytes / gib:.1f})"
    )
    if method.uses_host_memory:
        text += (
            f", host {est.host_bytes / gib:.1f} GiB of a {est.host_budget_bytes / gib:.1f} GiB "
            f"budget per process at α = {est.alpha:.2f}"
        )
    return text


def _suggestion(est: Estimate, *, layout: ParallelLayout, seq_length: int, **kwargs) -> str:
    """The first change that makes the run fit, among the methods that suggest themselves
    (:attr:`MemoryMethod.suggestion`: MEMO) and larger CP / TP."""
    tries = [
        (other.suggestion, layout, {"method": other, "settings": None})
        for other in METHODS
        if other.suggestion and other is not kwargs["method"]
    ]
    if not est.fits_host:
        tries.append(("raise --memo-host-memory-gb or keep more layers", layout, {}))
    if layout.dp % 2 == 0:
        bigger_cp = replace(layout, cp=layout.cp * 2, dp=layout.dp // 2)
        tries.append((f"use --context-parallel-size {bigger_cp.cp}", bigger_cp, {}))
        if layout.tp < 8:
            bigger_tp = replace(layout, tp=layout.tp * 2, dp=layout.dp // 2, sp=True)
            tries.append(
                (
                    f"use --tensor-model-parallel-size {bigger_tp.tp} --sequence-parallel",
                    bigger_tp,
                    {},
                )
            )
    for text, lay, change in tries:
        try:
            if run_estimate(layout=lay, seq_length=seq_length, **{**kwargs, **change}).fits:
                return text
        except EstimateError:
            continue
    return "shorten --seq-length, add GPUs for CP / TP, or use --memo with more host memory"
