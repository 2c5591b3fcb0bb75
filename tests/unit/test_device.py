"""``memo_ext.device`` on the CPU: its GPU-only steps do nothing here (their GPU side runs on
the emulated device, ``tests/emulated/test_gpu_branches.py``)."""

from __future__ import annotations

import types

import numpy as np
import torch

from memo_ext import device


def test_pinning_is_a_no_op_on_the_cpu():
    tensor = torch.arange(5)
    assert device.maybe_pin(tensor) is tensor and not tensor.is_pinned()


def test_retrieval_rows_stay_as_they_are_on_the_cpu():
    from memo_ext.training.retrieval import _row

    tokens = np.arange(7, dtype=np.int64)[None]
    row = _row(types.SimpleNamespace(batch=lambda: {"tokens": tokens}))
    assert not row["tokens"].is_pinned()
    assert row["tokens"].data_ptr() == tokens.ctypes.data  # no copy: the prompt's own array
