"""The estimator's efficiencies fitted to a comparison's measured steps (:func:`calibrate`), for
``--calibration FILE`` of the estimator and the trainer."""

from __future__ import annotations

import dataclasses

from memo_ext.compare.comparison import Comparison, estimate_configuration, predict
from memo_ext.compare.jobs import (
    OK,
    Method,
)
from memo_ext.compare.runs import Results
from memo_ext.estimate.calibration import (
    StepSample,
    fit_efficiencies,
    fitted_calibration,
    kernel_calibration,
    measure_kernels,
    with_measured_host_link,
)
from memo_ext.hardware import (
    Calibration,
)


def calibrate(comp: Comparison, results: Results) -> Calibration:
    """Kernels timed alone, then efficiencies fitted to every trained run's measured step."""
    kernels = comp.kernels or measure_kernels(comp.model, device="cpu")
    base = kernel_calibration(kernels, device=comp.device.name, peak_tflops=comp.device.peak_tflops)
    device = with_measured_host_link(comp.device, base)
    prior = dataclasses.replace(
        comp.efficiency, matmul=base.matmul_efficiency, attention=base.attention_efficiency
    )
    # a method the estimator does not model (megatron-offload) has no prediction to fit
    runs = [
        r
        for r in results.current()
        if r["status"] == OK and r["measured"]["step_time_s"] and r["predicted"]["step_time_s"]
    ]
    methods = {m.label: m for m in comp.methods}
    if not runs:
        return base
    efficiency = prior
    for _ in range(2):  # exposed copies depend on the layer time, hence on the efficiencies
        samples = [_sample(comp, methods[r["method"]], r, device, efficiency) for r in runs]
        fit = fit_efficiencies(samples, prior=prior)
        efficiency = dataclasses.replace(prior, matmul=fit.matmul, attention=fit.attention)
    calibration = fitted_calibration(fit, base=base, samples=samples)
    for run in runs:
        predicted = predict(
            comp, methods[run["method"]], run["seq_length"], efficiency=efficiency, device=device
        )
        measured = run["measured"]["step_time_s"]
        run["calibrated"] = {
            "step_time_s": predicted["step_time_s"],
            "mfu": predicted["mfu"],
            "step_time_error": predicted["step_time_s"] / measured - 1,
        }
    return calibration


def _sample(comp, method: Method, run: dict, device, efficiency) -> StepSample:
    seq = run["seq_length"]
    unit = dataclasses.replace(efficiency, matmul=1.0, attention=1.0)
    half = dataclasses.replace(efficiency, matmul=0.5, attention=1.0)
    at_one = estimate_configuration(comp, method, seq, efficiency=unit, device=device)
    at_half = estimate_configuration(comp, method, seq, efficiency=half, device=device)
    now = estimate_configuration(comp, method, seq, efficiency=efficiency, device=device)
    matmul_s = at_half.compute_s - at_one.compute_s
    return StepSample(
        label=f"{method.label}@{seq}",
        measured_s=run["measured"]["step_time_s"],
        matmul_s=matmul_s,
        attention_s=at_one.compute_s - matmul_s,
        other_s=now.step_time_s - now.compute_s,
    )


def format_calibration(calibration: Calibration) -> str:
    lines = [
        f"calibration ({calibration.source}) of {calibration.device}: matmul efficiency "
        f"{calibration.matmul_efficiency:.3f}, attention efficiency "
        f"{calibration.attention_efficiency:.3f} of {calibration.peak_tflops:.4g} TFLOP/s, host "
        f"link {calibration.host_link_gbps:.1f} GB/s"
    ]
    fit = calibration.details.get("fit")
    if fit:
        within = "yes" if fit["max_abs_error"] <= 0.10 else "NO"
        lines.append(
            f"calibrated step-time error over {fit['runs']} runs: max "
            f"{100 * fit['max_abs_error']:.1f}% (within 10%: {within})"
        )
    return "\n".join(lines)
