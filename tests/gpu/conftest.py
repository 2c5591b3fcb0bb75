"""The GPU tier needs a GPU that computes: on the emulated device
(``python -m memo_ext.simulate.run``, which makes ``torch.cuda.is_available()`` true) its tests
are skipped, since they check values, timings and memory that only real kernels give."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("MEMO_EMULATED_GPU"):
        return
    skip = pytest.mark.skip(reason="the emulated device computes nothing: these need a real GPU")
    for item in items:
        if item.path.is_relative_to(config.rootpath / "tests" / "gpu"):
            item.add_marker(skip)
