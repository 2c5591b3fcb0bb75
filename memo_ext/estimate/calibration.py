"""The estimator calibrated on a real machine: kernels timed alone, efficiencies fitted to steps.

The time model (``memo_ext.estimate.cost_model``) divides FLOPs by peak × an assumed efficiency and
copies by an assumed host link. A :class:`~memo_ext.hardware.Calibration` replaces both with
what one machine achieves:

- :func:`measure_kernels` times a layer's matrix products, causal attention (forward +
  backward) and a device ↔ host copy on this process's device (CUDA, or the CPU);
- :func:`fit_efficiencies` fits the matmul and attention efficiencies to step times that real
  runs measured: each run's estimate splits into matmul seconds and attention seconds at
  efficiency 1 plus the rest (communication, exposed copies), and the two efficiencies that
  minimise the squared relative error are found by least squares;
- :func:`apply_calibration` turns a calibration into the ``DeviceSpec`` and ``Efficiency`` the
  estimator takes (``tools.estimate --calibration``, the trainer's preflight,
  ``memo-compare``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memo_ext.device import clock
from memo_ext.estimate.cost_model import CAUSAL_FRACTION, Efficiency
from memo_ext.hardware import Calibration, DeviceSpec
from memo_ext.shapes import ModelShape

if TYPE_CHECKING:  # the timing functions import it: the estimator's readers never load it
    import torch

logger = logging.getLogger(__name__)

COPY_BYTES = 256 * 2**20
"""Bytes of the timed host-link copy: large enough to reach the link's sustained rate."""


# --- kernels timed alone ----------------------------------------------------------------------


def _timed(fn: Callable[[], object], *, device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn`` after two warm-up calls (CUDA: synchronised)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    start = clock()
    for _ in range(repeats):
        fn()
    sync()
    return (clock() - start) / repeats


def matmul_tflops(*, rows: int, inner: int, cols: int, device, dtype, repeats: int) -> float:
    """Achieved TFLOP/s of ``[rows, inner] @ [inner, cols]``."""
    import torch

    a = torch.randn(rows, inner, device=device, dtype=dtype)
    b = torch.randn(inner, cols, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device=device, repeats=repeats)
    return 2 * rows * inner * cols / seconds / 1e12


def layer_matmul_tflops(model: ModelShape, *, tokens: int, device, dtype, repeats: int) -> float:
    """Achieved TFLOP/s over one layer's forward matrix products at ``tokens`` tokens (QKV,
    output projection, the MLP's two or three), weighted by their FLOPs."""
    h, d = model.hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.query_groups) * d
    shapes = [(h, qkv), (model.num_attention_heads * d, h), (model.ffn_size, h)]
    shapes += [(h, model.ffn_size)] * (2 if model.swiglu else 1)
    flops = seconds = 0.0
    for inner, cols in shapes:
        rate = matmul_tflops(
            rows=tokens, inner=inner, cols=cols, device=device, dtype=dtype, repeats=repeats
        )
        flops += 2 * tokens * inner * cols
        seconds += 2 * tokens * inner * cols / (rate * 1e12)
    return flops / seconds / 1e12


def attention_tflops(model: ModelShape, *, tokens: int, device, dtype, repeats: int) -> float:
    """Achieved TFLOP/s of causal SDPA forward + backward on ``[1, heads, tokens, d]``, FLOPs
    counted as the estimator counts them: the full ``s × s`` products (QKᵀ and PV forward, twice
    that backward, as ``memo_ext.mcore.flop_count``) times the causal half."""
    import torch
    import torch.nn.functional as F

    heads, groups, d = model.num_attention_heads, model.query_groups, model.head_dim
    q = torch.randn(1, heads, tokens, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, groups, tokens, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, groups, tokens, d, device=device, dtype=dtype, requires_grad=True)
    gqa = {"enable_gqa": True} if groups != heads else {}

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        out.backward(torch.ones_like(out))

    counted = 3 * (2 * 2 * heads * tokens * tokens * d)
    seconds = _timed(step, device=device, repeats=repeats)
    return counted * CAUSAL_FRACTION / seconds / 1e12


def host_link_gbps(*, device, nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Achieved copy bandwidth between the device and (pinned) host memory, GB/s per GPU, the
    slower of the two directions, while every visible GPU copies at once (as MEMO's ranks do:
    GPUs behind one PCIe switch share its uplink, ``DeviceSpec.gpus_per_host_link``); on the
    CPU a plain memory copy (what MEMO's host copies are there)."""
    import torch

    if device.type != "cuda":
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        seconds = _timed(lambda: target.copy_(source), device=device, repeats=repeats)
        return nbytes / seconds / 1e9
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return min(concurrent_copy_gbps(devices, nbytes=nbytes, repeats=repeats).values())


def concurrent_copy_gbps(
    devices: list[torch.device], *, nbytes: int = COPY_BYTES, repeats: int = 5
) -> dict[int, float]:
    """Per device of ``devices`` (CUDA), GB/s of the slower direction while all of them copy
    ``nbytes`` to and from pinned host memory at the same time (one thread per device, each
    direction started together)."""
    import torch

    together = threading.Barrier(len(devices))
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def run(dev: torch.device) -> None:
        try:
            torch.cuda.set_device(dev)  # the current device is per thread
            source = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            seconds = []
            for copy in (
                lambda: host.copy_(source, non_blocking=True),
                lambda: source.copy_(host, non_blocking=True),
            ):
                for _ in range(2):  # warm-up, before the others are waited for
                    copy()
                torch.cuda.synchronize(dev)
                together.wait()
                start = clock()
                for _ in range(repeats):
                    copy()
                torch.cuda.synchronize(dev)
                seconds.append((clock() - start) / repeats)
            results[dev.index] = nbytes / max(seconds) / 1e9
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)
            together.abort()

    threads = [threading.Thread(target=run, args=(dev,)) for dev in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@dataclass(frozen=True)
class KernelRates:
    """What :func:`measure_kernels` found on one device."""

    device: str
    """``cuda`` (with its name) or ``cpu``."""
    square_matmul_tflops: float
    """A large square product: the CPU's peak (the GPU's comes from the device table)."""
    layer_matmul_tflops: float
    attention_tflops: float
    host_link_gbps: float
    host_link_gpus: int
    """GPUs that copied at once when ``host_link_gbps`` was measured."""
    tokens: int
    """Tokens of the timed layer products."""
    attention_tokens: int
    """Sequence length of the timed attention."""


def measure_kernels(
    model: ModelShape, *, device: str = "cuda", tokens: int | None = None, repeats: int = 5
) -> KernelRates:
    """Times ``model``'s layer kernels on ``device`` (bf16 on CUDA, fp32 on the CPU, as the
    trainer runs there). Default sizes: 8192 tokens and 8192-token attention on CUDA, 1024 and
    1024 on the CPU (seconds either way)."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = tokens or (8192 if cuda else 1024)
    square = 8192 if cuda else 1024
    kw = dict(device=dev, dtype=dtype, repeats=repeats)
    rates = KernelRates(
        device=torch.cuda.get_device_name(dev) if cuda else "cpu",
        square_matmul_tflops=matmul_tflops(rows=square, inner=square, cols=square, **kw),
        layer_matmul_tflops=layer_matmul_tflops(model, tokens=tokens, **kw),
        attention_tflops=attention_tflops(model, tokens=tokens, **kw),
        host_link_gbps=host_link_gbps(device=dev),
        host_link_gpus=torch.cuda.device_count() if cuda else 1,
        tokens=tokens,
        attention_tokens=tokens,
    )
    logger.info("measured kernels: %s", rates)
    return rates


def kernel_calibration(rates: KernelRates, *, device: str, peak_tflops: float) -> Calibration:
    """A calibration from timed kernels alone (efficiencies = achieved rate / ``peak_tflops``,
    capped at 1)."""
    return Calibration(
        device=device,
        peak_tflops=peak_tflops,
        matmul_efficiency=min(1.0, rates.layer_matmul_tflops / peak_tflops),
        attention_efficiency=min(1.0, rates.attention_tflops / peak_tflops),
        host_link_gbps=rates.host_link_gbps,
        host_link_gpus=rates.host_link_gpus,
        source="microbenchmark",
        details={"kernels": dataclasses.asdict(rates)},
    )


# --- efficiencies fitted to measured steps ----------------------------------------------------


@dataclass(frozen=True)
class StepSample:
    """One run's measured step time and its estimate, split by what the efficiencies scale."""

    label: str
    measured_s: float
    matmul_s: float
    """Estimated non-attention compute seconds at matmul efficiency 1."""
    attention_s: float
    """Estimated attention seconds at attention efficiency 1."""
    other_s: float
    """The rest of the estimated step (exposed communication and host copies)."""

    def predicted_s(self, matmul: float, attention: float) -> float:
        return self.other_s + self.matmul_s / matmul + self.attention_s / attention


@dataclass(frozen=True)
class Fit:
    """Efficiencies fitted to step samples, and each sample's relative error under them."""

    matmul: float
    attention: float
    errors: dict[str, float]
    """Label → (predicted − measured) / measured."""

    @property
    def max_abs_error(self) -> float:
        return max((abs(e) for e in self.errors.values()), default=0.0)


def fit_efficiencies(samples: list[StepSample], *, prior: Efficiency) -> Fit:
    """The matmul and attention efficiencies (each in (0, 1]) that minimise the squared relative
    error of the predicted step times.

    The prediction is linear in x = 1 / matmul and y = 1 / attention, so this is linear least
    squares. When the samples cannot tell the two apart (one sample, or the same attention share
    in all), only a common factor on the prior's two is fitted; an efficiency above 1 is held at
    1 and the other refitted.
    """
    if not samples:
        raise ValueError("fit_efficiencies needs at least one measured step")
    rows = [(s.matmul_s / s.measured_s, s.attention_s / s.measured_s) for s in samples]
    targets = [1.0 - s.other_s / s.measured_s for s in samples]
    x0, y0 = 1 / prior.matmul, 1 / prior.attention
    x, y = _least_squares_2(rows, targets)
    if x is None or x < 1.0 or y < 1.0:
        scale = _one_coefficient([a * x0 + b * y0 for a, b in rows], targets)
        x, y = (x0, y0) if scale is None else (scale * x0, scale * y0)
    if x < 1.0:  # matmul above peak: hold it at 1, refit attention alone
        rest = [t - a for (a, _), t in zip(rows, targets)]
        x, y = 1.0, _one_coefficient([b for _, b in rows], rest) or y0
    if y < 1.0:
        rest = [t - b for (_, b), t in zip(rows, targets)]
        x, y = _one_coefficient([a for a, _ in rows], rest) or x0, 1.0
    x, y = max(x, 1.0), max(y, 1.0)
    errors = {s.label: s.predicted_s(1 / x, 1 / y) / s.measured_s - 1 for s in samples}
    return Fit(matmul=1 / x, attention=1 / y, errors=errors)


def _least_squares_2(rows, targets) -> tuple[float | None, float | None]:
    """Solves min Σ (a·x + b·y − t)²; ``(None, None)`` when the two columns are (nearly)
    parallel, so that the data cannot tell x from y."""
    aa = sum(a * a for a, _ in rows)
    bb = sum(b * b for _, b in rows)
    ab = sum(a * b for a, b in rows)
    at = sum(a * t for (a, _), t in zip(rows, targets))
    bt = sum(b * t for (_, b), t in zip(rows, targets))
    det = aa * bb - ab * ab
    if len(rows) < 2 or aa * bb == 0 or det < 1e-3 * aa * bb:  # columns' cosine > 0.9995
        return None, None
    return (at * bb - bt * ab) / det, (bt * aa - at * ab) / det


def _one_coefficient(column, targets) -> float | None:
    """Solves min Σ (c·z − t)² for z; ``None`` when the column is all zero (nothing to fit)."""
    cc = sum(c * c for c in column)
    if cc == 0:
        return None
    return sum(c * t for c, t in zip(column, targets)) / cc


def fitted_calibration(fit: Fit, *, base: Calibration, samples: list[StepSample]) -> Calibration:
    """``base`` (the kernels' calibration) with the fitted efficiencies and the fit's record."""
    details = dict(base.details)
    details["fit"] = {
        "runs": len(samples),
        "max_abs_error": fit.max_abs_error,
        "errors": fit.errors,
        "kernel_efficiencies": {
            "matmul": base.matmul_efficiency,
            "attention": base.attention_efficiency,
        },
    }
    return dataclasses.replace(
        base,
        matmul_efficiency=fit.matmul,
        attention_efficiency=fit.attention,
        source="fit",
        details=details,
    )


# --- a calibration in use ---------------------------------------------------------------------


def apply_calibration(
    calibration: Calibration, *, device: DeviceSpec, efficiency: Efficiency
) -> tuple[DeviceSpec, Efficiency]:
    """``device`` and ``efficiency`` with the calibration's host link and efficiencies.

    The efficiencies carry achieved TFLOP/s: against a device whose peak differs from the one
    calibrated they are rescaled to keep that rate (capped at 1). A calibration made on another
    device is applied with a warning.
    """
    if calibration.device != device.name:
        logger.warning(
            "calibration of %s applied to %s: its rates may not hold there",
            calibration.device,
            device.name,
        )
    scale = calibration.peak_tflops / device.peak_tflops
    calibrated = dataclasses.replace(
        efficiency,
        matmul=min(1.0, calibration.matmul_efficiency * scale),
        attention=min(1.0, calibration.attention_efficiency * scale),
    )
    return with_measured_host_link(device, calibration), calibrated


def with_measured_host_link(device: DeviceSpec, calibration: Calibration) -> DeviceSpec:
    """``device`` with the calibration's host link. Measured with at least as many GPUs copying
    as share an uplink, the figure is each GPU's share already (no sharing left to charge);
    measured with fewer (one GPU, or an older file that does not say), it is the uplink's rate
    and the device's sharing still applies."""
    shared = calibration.host_link_gpus >= device.gpus_per_host_link
    return dataclasses.replace(
        device,
        host_link_gbps=calibration.host_link_gbps,
        gpus_per_host_link=1 if shared else device.gpus_per_host_link,
    )
