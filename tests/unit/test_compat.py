"""The megatron-core behaviour that memo_ext.mcore.compat relies on, and its redirections."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import random as mrandom

from memo_ext.mcore import compat


def test_megatron_version_is_checked():
    assert compat.check_mcore_version().startswith("0.16.")


def test_megatron_still_has_what_we_redirect():
    # the tracker globals we swap, and the tracker names we seed
    for name in (
        "_CUDA_RNG_STATE_TRACKER",
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "_DATA_PARALLEL_RNG_TRACKER_NAME",
        "_MODEL_PARALLEL_RNG_TRACKER_NAME",
        "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
    ):
        assert hasattr(mrandom, name), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only redirection")
def test_cuda_placements_land_on_cpu_and_are_restored():
    before = torch.cuda.current_device
    with compat.cpu_compat():
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.tensor([1, 2], pin_memory=True).device.type == "cpu"
        torch.cuda.synchronize()
    assert torch.cuda.current_device is before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only redirection")
def test_rng_tracker_forks_the_cpu_generator():
    with compat.cpu_compat():
        compat.seed_cpu_rng_tracker(seed=5, tp_rank=0)
        tracker = mrandom.get_cuda_rng_tracker()
        torch.manual_seed(0)
        outside = torch.rand(3)
        torch.manual_seed(0)
        with tracker.fork():
            forked_first = torch.rand(3)
        assert torch.equal(torch.rand(3), outside)  # the default stream did not advance
        with tracker.fork():
            forked_second = torch.rand(3)
        assert not torch.equal(forked_first, forked_second)  # the forked stream advances
        compat.seed_cpu_rng_tracker(seed=5, tp_rank=1)
        with tracker.fork():
            other_rank = torch.rand(3)
        assert not torch.equal(other_rank, forked_first)  # TP ranks draw different masks


def test_megatron_optimizers_still_sort_parameters_by_cuda_type_names():
    # the names CpuDeviceRedirect spells CPU tensors' types with: where megatron-core 0.16's
    # mixed-precision and distributed optimizers classify their parameters
    import inspect

    from megatron.core.optimizer import distrib_optimizer, optimizer

    for module in (optimizer, distrib_optimizer):
        source = inspect.getsource(module)
        for name in ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"):
            assert f"'{name}'" in source, (module.__name__, name)


def test_type_names_read_as_cuda_ones_under_the_redirect_only():
    x = torch.zeros(2, dtype=torch.bfloat16)
    with compat.cpu_placement():
        assert x.type() == "torch.cuda.BFloat16Tensor"
        assert x.float().type() == "torch.cuda.FloatTensor"
        # a conversion keeps its meaning: the tensor stays on the CPU, in the asked dtype
        assert x.type(torch.float32).dtype == torch.float32
        assert x.type(torch.float32).device.type == "cpu"
    assert x.type() == "torch.BFloat16Tensor"
