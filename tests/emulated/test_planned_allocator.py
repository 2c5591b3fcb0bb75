"""``--memo-allocator plan`` on the emulated device: every device storage allocated and freed
through torch's pluggable-allocator interface into the allocator core (the torch shim's
``memo_cuda_alloc`` / ``memo_cuda_free``, the core's CUDA backend over the stand-in runtime)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.emulated.test_training import TINY, train_on
from tests.launch import unserved_steps

PLANNED = [
    "--memo",
    "--memo-keep-last-layers",
    "1",
    "--memo-alpha",
    "1",
    "--memo-allocator",
    "plan",
]


def test_planned_layer_passes_are_served_on_the_device(cuda, tmp_path):
    """Backward passes run on autograd's device thread here, as on a GPU: their frees come at
    that thread's times; the hit ratio holds every served step but one whose block freed late
    was planned again."""
    summary, records = train_on(cuda, tmp_path, *PLANNED, "--train-iters", "6",
                                "--memo-plan-cache", str(tmp_path / "plans"))  # fmt: skip
    assert summary.iterations == 6
    assert cuda.allocator is not None and cuda.shim.memo_emulated_device_in_use() > 0
    assert len(records) == 6 and unserved_steps(records) == []
    # torch's own statistics raise under a pluggable allocator: the core's figures stand in
    assert records[-1]["mem_allocated_bytes"] > 0


def test_running_out_of_device_memory_is_torch_out_of_memory_with_the_bytes(cuda, tmp_path):
    """The core returns NULL when cudaMalloc fails; torch would wrap that pointer and the first
    kernel would fault (a sticky illegal address). The shim raises OutOfMemoryError instead,
    which the trainer reports with the bytes asked for (exit status 3)."""
    from memo_ext.allocator.core import AllocatorCore
    from memo_ext.commands.pretrain_gpt_memo import _train_reporting_oom
    from memo_ext.errors import OutOfMemory

    AllocatorCore().release_cached()  # the process-wide core may cache an earlier test's blocks
    room = 64 << 10
    cuda.shim.memo_emulated_set_device_capacity(cuda.shim.memo_emulated_device_in_use() + room)
    try:
        with pytest.raises(OutOfMemory, match=r"tried to allocate \d+ bytes") as error:
            _train_reporting_oom([*TINY, *PLANNED])
    finally:
        cuda.shim.memo_emulated_set_device_capacity(2**64 - 1)
    assert error.value.exit_status == 3 and error.value.requested_bytes > 0


@pytest.mark.parametrize("value", [None, "0"])
def test_the_nccl_variable_is_neither_set_nor_refused(cuda, tmp_path, monkeypatch, value):
    """torch's NCCL process group records no streams (record_stream does nothing under a
    pluggable allocator; the emulated device raises on any under the core): it stashes a
    collective's tensors whatever TORCH_NCCL_AVOID_RECORD_STREAMS says, which it deprecates
    (setting it only warns on every rank), so the planned allocator trains with it at 0 or unset
    and leaves it so."""
    from torch.torch_version import TorchVersion

    from memo_ext.allocator.cuda import NCCL_HOLDS_TENSORS, NCCL_STASHES_SINCE

    if TorchVersion(torch.__version__) < NCCL_STASHES_SINCE:
        pytest.skip(f"torch {torch.__version__} still needs {NCCL_HOLDS_TENSORS}=1")
    monkeypatch.setenv(NCCL_HOLDS_TENSORS, "")  # undone to the state before the test
    if value is None:
        monkeypatch.delenv(NCCL_HOLDS_TENSORS)
    else:
        monkeypatch.setenv(NCCL_HOLDS_TENSORS, value)
    train_on(cuda, tmp_path, *PLANNED, "--train-iters", "1")
    assert os.environ.get(NCCL_HOLDS_TENSORS) == value
