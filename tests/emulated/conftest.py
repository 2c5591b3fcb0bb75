"""Fixtures of the emulated-device tier (run by ``python -m tests.emulated``)."""

from __future__ import annotations

import pytest

from memo_ext.simulate import runtime

if runtime.loaded() is None:
    raise pytest.UsageError(
        "tests/emulated needs the emulated CUDA device loaded before torch: run it with "
        "`python -m tests.emulated` (make test runs it)"
    )


@pytest.fixture
def cuda():
    """The emulated CUDA device, as rank 0 of a one-process world."""
    from memo_ext.simulate.device import emulated_cuda

    with emulated_cuda() as device:
        yield device
