"""The calibration's host-link figure on CUDA: every visible GPU copies at once, one thread
each, and each reports its own rate. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_every_gpu_copies_at_once_and_reports_its_rate():
    from memo_ext.estimate.calibration import concurrent_copy_gbps, host_link_gbps

    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    rates = concurrent_copy_gbps(devices, nbytes=64 * 2**20, repeats=3)
    assert sorted(rates) == [d.index for d in devices]
    assert all(0 < r < 1000 for r in rates.values())
    assert 0 < host_link_gbps(device=devices[0], nbytes=64 * 2**20, repeats=3) < 1000
