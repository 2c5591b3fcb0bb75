"""What installing the planned allocator on CUDA asks of NCCL: on torch 2.8 and later nothing
(its process group records no streams; ``TORCH_NCCL_AVOID_RECORD_STREAMS`` is deprecated
there), before 2.8 the variable at 1 (``record_stream`` does nothing under a pluggable
allocator). Runs on CPU: the core stops the install at its CUDA backend, after the check."""

from __future__ import annotations

import os
import types

import pytest
import torch

from memo_ext.allocator import cuda
from memo_ext.allocator.cuda import NCCL_HOLDS_TENSORS, install_cuda_allocator
from memo_ext.errors import UsageError


class _CoreReached(Exception):
    """The install got past its checks to the core."""


def _set_variable(monkeypatch, value: str | None) -> None:
    """The variable at ``value`` (``None``: unset) for this test; whatever the code under test
    sets is undone too (monkeypatch records the state before its first change only)."""
    monkeypatch.setenv(NCCL_HOLDS_TENSORS, "")
    if value is None:
        monkeypatch.delenv(NCCL_HOLDS_TENSORS)
    else:
        monkeypatch.setenv(NCCL_HOLDS_TENSORS, value)


def _core_that_stops() -> types.SimpleNamespace:
    def init(backend: str) -> None:
        raise _CoreReached(backend)

    return types.SimpleNamespace(init=init)


@pytest.mark.parametrize("value", [None, "0", "1"])
@pytest.mark.parametrize("version", ["2.8.0", "2.11.0+cu130", "2.13.0"])
def test_newer_torch_is_installed_on_with_the_variable_left_alone(monkeypatch, version, value):
    """Setting the deprecated variable only makes every rank warn; refusing 0 would refuse a
    setting torch ignores."""
    _set_variable(monkeypatch, value)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(_CoreReached, match="cuda"):
        install_cuda_allocator(_core_that_stops())
    assert os.environ.get(NCCL_HOLDS_TENSORS) == value


def test_older_torch_is_told_to_hold_the_tensors(monkeypatch):
    _set_variable(monkeypatch, None)
    cuda.maybe_hold_nccl_tensors(torch_version="2.7.1+cu126")
    assert os.environ[NCCL_HOLDS_TENSORS] == "1"
    _set_variable(monkeypatch, "0")
    with pytest.raises(UsageError, match=f"torch 2.7.1\\+cu126 needs {NCCL_HOLDS_TENSORS}=1"):
        cuda.maybe_hold_nccl_tensors(torch_version="2.7.1+cu126")
