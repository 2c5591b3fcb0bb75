"""A save that fails inside torch's checkpoint writer is reported like one that fails in ours:
one sentence with the file system's reason, the previous checkpoint named; anything else that
is not a file-system fault propagates as it is."""

from __future__ import annotations

import pytest

from memo_ext.training.checkpoint import CheckpointError, TrainProgress, save_checkpoint
from memo_ext.training.checkpoint import save as ckpt


def _save_failing_with(monkeypatch, error: Exception, tmp_path):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt, "_save", fail)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4\n")
    save_checkpoint(
        save_dir=str(tmp_path), progress=TrainProgress(5, 10), model=None, optimizer=None,
        scheduler=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        # what torch.distributed.checkpoint's file writer raises for its worker's OSError
        RuntimeError("Worker failure: [Errno 28] No space left on device: '/ckpt/__0_0.distcp'"),
    ],
    ids=["ours", "torch-writer"],
)
def test_a_full_disk_during_a_save_is_one_sentence(monkeypatch, tmp_path, error):
    with pytest.raises(CheckpointError) as caught:
        _save_failing_with(monkeypatch, error, tmp_path)
    message = str(caught.value)
    assert f"saving iteration 5 to {tmp_path} failed: no space left on the disk" in message
    assert "iteration 4 is still the latest" in message


def test_a_writer_error_without_a_file_system_reason_is_not_disguised(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _save_failing_with(
            monkeypatch, RuntimeError("shape mismatch in a sharded tensor"), tmp_path
        )
