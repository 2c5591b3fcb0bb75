"""The calibration's host-link figure on the emulated device: the CUDA path of
``concurrent_copy_gbps`` (a thread per device, pinned host buffers, copies each way, the
threads lined up after their warm-up) and ``host_link_gbps`` taking its slowest device."""

from __future__ import annotations

import threading

import pytest
import torch


@pytest.fixture()
def threads_on_the_device(cuda, monkeypatch):
    """The emulated device is a dispatch mode, and modes are per thread: the calibration's copy
    threads enter it as a real CUDA thread simply has the device."""
    from memo_ext.estimate import calibration

    class DeviceThread(threading.Thread):
        def run(self) -> None:
            with cuda.mode:
                super().run()

    monkeypatch.setattr(calibration.threading, "Thread", DeviceThread)
    return cuda


def test_every_device_copies_and_reports_its_rate(threads_on_the_device):
    from memo_ext.estimate.calibration import concurrent_copy_gbps, host_link_gbps

    cuda = threads_on_the_device
    rates = concurrent_copy_gbps([torch.device("cuda", 0)], nbytes=1 << 20, repeats=2)
    assert list(rates) == [0] and rates[0] > 0
    assert host_link_gbps(device=torch.device("cuda", 0), nbytes=1 << 20, repeats=2) > 0
    assert cuda.pinned_bytes() > 0  # the host side was pinned memory, as the copies need


def test_a_failing_copy_thread_raises_in_the_caller(threads_on_the_device, monkeypatch):
    from memo_ext.estimate import calibration

    def broken(*args, **kwargs):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(torch, "empty", broken)  # the copy threads' buffers
    with pytest.raises(RuntimeError, match="no pinned memory"):
        calibration.concurrent_copy_gbps([torch.device("cuda", 0)], nbytes=1 << 20)
