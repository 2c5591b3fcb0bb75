"""The emulated device is a GPU the code recognises, so every path gated on the device runs:
its preset, the preflight's traces, the comparison's predictions. A trace takes the same path on
a GPU machine as on a CPU one, and touches nothing of the device."""

from __future__ import annotations

import pytest
import torch

from memo_ext.simulate.device import GPUS, emulated_cuda
from memo_ext.simulate.parts import part
from tests.emulated.test_training import TINY

ROPE_TP2_SP = [
    *TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
]  # fmt: skip


@pytest.mark.parametrize(("gpu", "preset"), [("h100", "h100-80g"), ("h200", "h200-141g")])
def test_the_device_is_a_known_part(gpu, preset):
    from memo_ext.hardware import cuda_device

    with emulated_cuda(gpu=gpu):
        spec = cuda_device()
        assert torch.cuda.get_device_name() == GPUS[part(gpu)].name
        assert torch.cuda.get_device_capability() == (9, 0)
    assert spec is not None and spec.name == preset
    assert spec.memory_bytes == GPUS[part(gpu)].total_memory


def test_each_gpu_of_a_machine_is_its_own_device():
    with emulated_cuda(gpus=2):
        assert torch.cuda.device_count() == 2
        torch.cuda.set_device(1)
        assert torch.tensor([1.0], device="cuda").device == torch.device("cuda", 1)
        assert torch.empty(2, device="cuda").device == torch.device("cuda", 1)
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.set_device(2)


def _rope_run(extra: list[str]):
    """The run as the trainer resolves it before its preflight."""
    from memo_ext.arguments import parse_args
    from memo_ext.data.tokenizers import tokenizer_for
    from memo_ext.training.resolve import resolve_run

    run = parse_args([*ROPE_TP2_SP, *extra])
    return resolve_run(run, tokenizer=tokenizer_for(run.data))


@pytest.mark.parametrize("memo", [[], ["--memo", "--memo-alpha", "0.5"]], ids=["plain", "memo"])
def test_the_preflight_traces_a_rope_model_under_tp_and_sp(memo, monkeypatch):
    """megatron places its RoPE table and SP gather buffers on torch.cuda.current_device(): on a
    GPU machine the trace must still keep them with its CPU fakes, and must not read the GPU's
    generator (a CUDA context made before the trainer picks its device)."""
    from memo_ext.features.preflight import check_preflight, planning_target

    with emulated_cuda(world_size=2) as cuda:

        def untouched(*args, **kwargs):
            raise AssertionError("a trace read the GPU's random state")

        class Untouched:
            get_state = set_state = manual_seed = untouched

        monkeypatch.setattr(torch.cuda, "default_generators", (Untouched(), Untouched()))
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", untouched)
            monkeypatch.setattr(module, "set_rng_state", untouched)
        storages = len(cuda.storages)
        run = _rope_run(memo)
        report = check_preflight(run, target=planning_target(run))
        assert len(cuda.storages) == storages  # nothing of the trace lives on the device
    assert report.checked and report.fits, report.message
    assert report.estimate.activation_bytes > 0


def test_the_comparison_predicts_on_the_gpu(tmp_path):
    """compare_methods' predictions and traced figures run in its parent process after every
    job: on the GPU, for a RoPE model under TP 2 + SP."""
    from memo_ext.compare.comparison import predict, traced_figures
    from memo_ext.compare.jobs import parse_method
    from memo_ext.estimate.cost_model import Efficiency
    from memo_ext.hardware import cuda_device
    from tests.unit.test_compare_methods import _comparison

    with emulated_cuda():
        method = parse_method("memo:alpha=0.5@tp2")
        comp = _comparison(tmp_path, methods=[method], cuda=True, efficiency=Efficiency())
        comp.layouts = {method.label: method.resolve_layout(comp.layouts["none"], 2)}
        comp.device = cuda_device()
        predicted = predict(comp, method, 128)
        traced = traced_figures(comp, method, 128, measured={}, predicted=predicted)
    assert predicted.get("error") is None and predicted["peak_memory_bytes"] > 0, predicted
    assert traced["host_bytes"] > 0, traced


def test_a_megatron_lm_scripts_attention_flags_on_a_gpu_without_its_packages(cuda):
    """On a GPU, --use-flash-attn needs the flash_attn package and is refused in one sentence
    without it (on the CPU it has no effect), and Megatron-LM's transformer-engine attention
    backends become SDPA without transformer-engine."""
    from memo_ext.arguments import parse_args
    from memo_ext.errors import UsageError

    with pytest.raises(UsageError, match="flash attention needs CUDA and the flash_attn package"):
        parse_args([*TINY, "--use-flash-attn"], world_size=1)
    run = parse_args([*TINY, "--attention-backend", "fused"], world_size=1)
    assert run.model.attention_backend == "sdpa"
