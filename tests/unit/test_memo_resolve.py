"""``--memo-chunk-tokens auto`` says what it decided and why, in one line."""

from __future__ import annotations

import logging

from memo_ext.arguments import parse_args
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.training.resolve import resolve_run

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
    "--train-iters", "2", "--micro-batch-size", "1", "--lr", "1e-3", "--memo",
    "--memo-chunk-tokens", "auto", "--hidden-dropout", "0",
]  # fmt: skip


def _resolved(*extra: str, caplog):
    run = parse_args([*BASE, *extra], world_size=1)
    with caplog.at_level(logging.INFO):
        return resolve_run(run, tokenizer=tokenizer_for(run.data))


def test_a_sequence_too_short_to_chunk_is_said_to_run_whole(caplog):
    run = _resolved("--seq-length", "256", caplog=caplog)
    assert run.memo.chunk_tokens == 256
    line = next(r.getMessage() for r in caplog.records if "MEMO chunks" in r.getMessage())
    assert line.startswith("MEMO chunks: none — the whole 256 local tokens per layer pass")
    assert "within 2% of the whole sequence's time on h100-80g" in line
    assert "no GPU here" in line  # this machine has none: the preset is named as a preset


def test_a_given_device_is_named_without_the_preset_hint(caplog):
    _resolved("--seq-length", "256", "--preflight-device", "a800-80g", caplog=caplog)
    line = next(r.getMessage() for r in caplog.records if "MEMO chunks" in r.getMessage())
    assert "on a800-80g)" in line and "no GPU here" not in line


def test_the_planned_allocator_refuses_expandable_segments_on_cuda(monkeypatch):
    """The CUDA-only branch of MEMO's rules, on a process that reports CUDA."""
    import pytest
    import torch

    from memo_ext.config import MemoConfig
    from memo_ext.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(UsageError, match="expandable_segments cannot apply; unset it"):
        MemoConfig._check_planned_allocator(variable_seq_lengths=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    MemoConfig._check_planned_allocator(variable_seq_lengths=False)


def test_a_feature_must_say_when_it_is_on():
    import pytest

    from memo_ext.extension import Extension

    class Unfinished(Extension):
        name = "unfinished"

    with pytest.raises(TypeError, match="enabled"):
        Unfinished(run=None)
