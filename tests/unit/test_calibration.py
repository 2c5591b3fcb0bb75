"""Estimator calibration: the file format, the fit of efficiencies to measured steps, and its use
by tools.estimate and the trainer's preflight."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from memo_ext.arguments import parse_args
from memo_ext.commands import estimate as estimate_tool
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.errors import UsageError
from memo_ext.estimate.calibration import (
    StepSample,
    apply_calibration,
    fit_efficiencies,
    kernel_calibration,
    measure_kernels,
)
from memo_ext.estimate.cost_model import Efficiency
from memo_ext.features.preflight import preflight
from memo_ext.hardware import (
    DEVICES,
    Calibration,
    read_calibration,
    write_calibration,
)
from memo_ext.shapes import ModelShape
from memo_ext.training.resolve import resolve_run

CAL = Calibration(
    device="h200-141g",
    peak_tflops=989.0,
    matmul_efficiency=0.62,
    attention_efficiency=0.41,
    host_link_gbps=38.5,
    host_link_gpus=8,  # measured with a node's eight GPUs copying at once
)


def _samples(matmul: float, attention: float, *, seed: int, n: int = 6) -> list[StepSample]:
    """Steps of a machine with these efficiencies exactly (random shares of attention)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, other = rng.uniform(0.1, 2), rng.uniform(0.0, 3), rng.uniform(0, 0.3)
        measured = other + a / matmul + b / attention
        out.append(StepSample(f"r{i}", measured, a, b, other))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_recovers_the_efficiencies_that_made_the_steps(seed):
    rng = random.Random(100 + seed)
    matmul, attention = rng.uniform(0.2, 0.9), rng.uniform(0.2, 0.9)
    fit = fit_efficiencies(_samples(matmul, attention, seed=seed), prior=Efficiency())
    # exact data: only float rounding separates the fit from the truth
    assert fit.matmul == pytest.approx(matmul, rel=1e-9)
    assert fit.attention == pytest.approx(attention, rel=1e-9)
    assert fit.max_abs_error < 1e-9


def test_one_kind_of_step_fits_a_common_factor_on_the_prior():
    """Every sample has the same attention share: only the overall speed can be learned, so the
    prior's matmul : attention ratio is kept and scaled."""
    samples = [StepSample(f"r{i}", 3.0 * k, 1.0 * k, 0.5 * k, 0.0) for i, k in enumerate((1, 2))]
    prior = Efficiency(matmul=0.8, attention=0.4)
    fit = fit_efficiencies(samples, prior=prior)
    assert fit.matmul / fit.attention == pytest.approx(2.0)
    assert fit.max_abs_error < 1e-9


def test_efficiencies_never_exceed_one():
    # a step faster than peak on matmul: held at 1, attention refitted to the rest
    samples = [StepSample("a", 1.0, 2.0, 0.5, 0.0), StepSample("b", 2.0, 2.0, 1.7, 0.0)]
    fit = fit_efficiencies(samples, prior=Efficiency())
    assert 0 < fit.attention <= 1.0 and fit.matmul == 1.0


def test_the_file_round_trips(tmp_path):
    path = tmp_path / "cal.json"
    write_calibration(str(path), CAL)
    assert json.loads(path.read_text())["format"] == "memo-calibration/1"
    assert read_calibration(str(path)) == CAL


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"format": "memo-plan/1"}', "not a memo-calibration/1 file"),
        ('{"format": "memo-calibration/1", "device": "x"}', "lacks"),
        ("ATTENTION_2", "attention_efficiency must be in (0, 1]"),
    ],
)
def test_bad_files_are_one_sentence(tmp_path, content, says):
    path = tmp_path / "cal.json"
    if content == "ATTENTION_2":
        data = {"format": "memo-calibration/1", **dataclasses.asdict(CAL)}
        content = json.dumps({**data, "attention_efficiency": 2.0})
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError) as err:
        read_calibration(str(path))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_calibration_keeps_its_achieved_rates_on_another_peak():
    a100 = DEVICES["a100-80g"]
    device, eff = apply_calibration(CAL, device=DEVICES["h200-141g"], efficiency=Efficiency())
    assert (eff.matmul, eff.attention, device.host_link_gbps) == (0.62, 0.41, 38.5)
    half = dataclasses.replace(CAL, device="a100-80g", peak_tflops=156.0)
    device, eff = apply_calibration(half, device=a100, efficiency=Efficiency())
    assert eff.matmul * a100.peak_tflops == pytest.approx(0.62 * 156.0)


@pytest.mark.slow
def test_tools_estimate_reads_the_file_as_its_flags(tmp_path, capsys):
    """--calibration FILE gives the same estimate as the figures given as flags (its host link
    is per GPU with every GPU copying: no uplink sharing left to charge)."""
    path = tmp_path / "cal.json"
    write_calibration(str(path), CAL)
    common = ["--model", "gpt-7b", "--gpu", "h200-141g", "--gpus", "8", "--method", "memo"]
    common += ["--seq-length", "262144", "--tensor-model-parallel-size", "8", "--json"]
    assert estimate_tool.main([*common, "--calibration", str(path)]) == 0
    with_file = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    flags = ["--matmul-efficiency", "0.62", "--attention-efficiency", "0.41"]
    flags += ["--host-link-gbps", "38.5", "--gpus-per-host-link", "1"]
    assert estimate_tool.main([*common, *flags]) == 0
    with_flags = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert with_file == with_flags
    assert estimate_tool.main(common) == 0
    default = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert default["step_time_s"] < with_file["step_time_s"]  # 0.75 / 0.60 assumed before


def test_kernels_timed_on_the_cpu_make_a_valid_calibration():
    model = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    rates = measure_kernels(model, device="cpu", tokens=256, repeats=1)
    calibration = kernel_calibration(rates, device="cpu", peak_tflops=rates.square_matmul_tflops)
    calibration.check()
    assert rates.attention_tflops > 0 and rates.host_link_gbps > 0


def _resolved(argv: list[str]):
    run = parse_args(argv)
    return resolve_run(run, tokenizer=tokenizer_for(run.data))


def test_the_preflight_uses_the_calibration_and_the_memory_limit(tmp_path):
    path = tmp_path / "cal.json"
    write_calibration(str(path), CAL)
    model = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8"]
    run = ["--seq-length", "8192", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1"]
    run += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    base = _resolved([*model, *run])
    capped = _resolved([*model, *run, "--calibration", str(path), "--memory-limit-gb", "12"])
    plain = preflight(base, device=DEVICES["h200-141g"]).estimate
    tuned = preflight(capped, device=DEVICES["h200-141g"]).estimate
    assert tuned.device_capacity_bytes == 12 * 2**30 < plain.device_capacity_bytes
    assert tuned.step_time_s > plain.step_time_s  # 0.62 / 0.41 achieved, 0.75 / 0.60 assumed
    with pytest.raises(UsageError, match="--memory-limit-gb must be positive"):
        parse_args([*model, *run, "--memory-limit-gb", "0"])
    with pytest.raises(UsageError, match="cannot read it"):
        parse_args([*model, *run, "--calibration", str(tmp_path / "missing.json")])
