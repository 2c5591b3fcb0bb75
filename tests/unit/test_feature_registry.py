"""A memory method beside MEMO, from this file alone: registered in ``memo_ext.features`` with one
call per face, the estimator prices a stage by it, ``memo-estimate`` offers it, and the comparison
harness spells it, builds its jobs' command lines and predicts it; unregistered, nothing of it
is left. The method is made up (half of every stored byte disappears for free); what is tested
is that nothing outside this file had to learn its name."""

from __future__ import annotations

import dataclasses

import pytest

from memo_ext.compare import comparison
from memo_ext.compare.jobs import parse_method
from memo_ext.errors import UsageError
from memo_ext.estimate.cost_model import Batch, Efficiency, estimate
from memo_ext.estimate.stage import MemoryMethod, Stage, StageContext
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.recompute.method import NO_RECOMPUTE
from memo_ext.features.registry import (
    COMPARED,
    METHODS,
    memory_method,
    method_names,
    register,
    unregister,
)
from memo_ext.hardware import DEVICES
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import MODELS
from tests.unit.test_compare_methods import _comparison


class HalfStored(MemoryMethod):
    """Stores half of what no recomputation stores, at no cost (a stand-in for a policy)."""

    name = "test-half-stored"

    def price(self, ctx: StageContext) -> Stage:
        plain = NO_RECOMPUTE.price(ctx)
        half = plain.stored / 2
        return dataclasses.replace(
            plain, stored=half, peak_activations=plain.peak_activations - half
        )

    def selected_by(self, run) -> bool:
        return False


HALF = HalfStored()
COMPARED_HALF = ComparedMethod(HALF.name, ("--test-half-stored",), estimator=HALF)


@pytest.fixture
def registered():
    register(METHODS, HALF)
    register(COMPARED, COMPARED_HALF)
    yield
    unregister(METHODS, HALF)
    unregister(COMPARED, COMPARED_HALF)


def _estimate(method: MemoryMethod):
    return estimate(
        model=MODELS["gpt-7b"],
        device=DEVICES["h100-80g"],
        layout=ParallelLayout(tp=8, sp=True),
        batch=Batch(),
        method=method,
        seq_length=1 << 15,
        host_memory_bytes=1 << 40,
    )


def test_the_estimator_prices_a_registered_method(registered):
    half, plain = _estimate(memory_method(HALF.name)), _estimate(NO_RECOMPUTE)
    assert half.method == HALF.name
    assert half.activation_bytes == pytest.approx(plain.activation_bytes / 2, abs=1)
    assert half.device_peak_bytes < plain.device_peak_bytes
    assert half.step_time_s == plain.step_time_s
    assert HALF.name in method_names()


def test_memo_estimate_offers_it(registered):
    from memo_ext.commands import estimate as tool

    (action,) = [a for a in tool.build_parser()._actions if "--method" in a.option_strings]
    assert HALF.name in action.help
    method, fixed = tool.method_of(HALF.name)
    assert method is HALF and fixed == {}


def test_a_comparison_runs_and_predicts_it(registered, tmp_path):
    method = parse_method(f"{HALF.name}@tp2")
    comp = _comparison(tmp_path, methods=[method], layouts={method.label: ParallelLayout(tp=2)})
    argv = comparison.job_argv(comp, method, 256, metrics=tmp_path / "m.jsonl", job_id="x")
    assert "--test-half-stored" in argv
    device, eff = DEVICES["h100-80g"], Efficiency()
    predicted = comparison.predict(comp, method, 256, efficiency=eff, device=device)
    assert predicted["peak_memory_bytes"] > 0 and "error" not in predicted


def test_unregistered_it_is_gone():
    with pytest.raises(UsageError, match="--method must be one of"):
        memory_method(HALF.name)
    with pytest.raises(UsageError, match="no method"):
        parse_method(HALF.name)
    with pytest.raises(ValueError, match="registered already"):
        register(METHODS, NO_RECOMPUTE)
