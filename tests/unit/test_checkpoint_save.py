"""Saving a checkpoint (``memo_ext.training.checkpoint``) in one gloo process: checksums taken
while the files are written are the files' own, and the checkpoint loads; a write that fails in
one of the writer's threads fails the save and publishes nothing;
``memo_ext.benchmarks.checkpoint_save`` runs end to end, writes its JSON, and refuses a Megatron-LM
checkout it cannot compare with."""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from memo_ext.benchmarks.checkpoint_save import build_training_state, check_megatron_lm, main
from memo_ext.training.checkpoint import (
    MANIFEST,
    TRACKER,
    CheckpointError,
    TrainProgress,
    integrity,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    writer,
)
from tests.workers import free_port


@pytest.fixture(scope="module")
def state():
    """The trainer's model, optimizer and schedule in a gloo world of one process."""
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    saved = dict(os.environ)
    os.environ.update(env, MASTER_PORT=str(free_port()))
    try:
        with build_training_state(nproc=1) as built:
            yield built
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _save(state, save_dir: Path, iteration: int) -> Path:
    return save_checkpoint(
        save_dir=str(save_dir),
        progress=TrainProgress(iteration, 4 * iteration),
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
    )


def test_checksums_taken_while_writing_are_the_files_and_the_checkpoint_loads(
    state, tmp_path, monkeypatch
):
    read_back = []
    sha256 = integrity._sha256
    monkeypatch.setattr(
        integrity, "_sha256", lambda path: read_back.append(path.name) or sha256(path)
    )
    directory = _save(state, tmp_path, 1)
    files = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    manifest = json.loads((directory / MANIFEST).read_text())
    assert set(manifest["files"]) == files - {MANIFEST}
    assert any(name.endswith(".distcp") for name in files)
    # the tensors' files, torch's .metadata and the RNG file were hashed as they were written;
    # only megatron's small common files are read back
    assert sorted(read_back) == ["common.pt", "metadata.json"]
    monkeypatch.undo()
    for name, digest in manifest["files"].items():
        assert integrity._sha256(directory / name) == digest, name
    verify_checkpoint(directory)

    weight = next(state.model.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    progress = load_checkpoint(
        load_dir=str(tmp_path),
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
    )
    assert progress == TrainProgress(1, 4)
    assert torch.equal(weight.detach(), saved)


def test_a_write_failing_in_a_writer_thread_fails_the_save(state, tmp_path, monkeypatch):
    _save(state, tmp_path, 1)
    # torch's writer runs its files in this thread and in helper threads, whose own errors it
    # only prints; the slow first write here leaves a file to a helper thread, whose write fails
    write = writer._HashingWriter.write
    slowed = []

    def full_disk_in_helpers(self, data):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not slowed:
            slowed.append(time.sleep(0.5))
        return write(self, data)

    monkeypatch.setattr(writer._HashingWriter, "write", full_disk_in_helpers)
    with pytest.raises(CheckpointError) as caught:
        _save(state, tmp_path, 2)
    message = str(caught.value)
    assert f"saving iteration 2 to {tmp_path} failed: no space left on the disk" in message
    assert "iteration 1 is still the latest" in message
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    assert not (tmp_path / "iter_0000002").exists()


def test_the_benchmark_writes_its_results_without_megatron_lm(tmp_path, capsys):
    out = tmp_path / "save.json"
    assert main(["--nproc", "1", "--saves", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert (results["nproc"], results["saves"]) == (1, 2)
    assert results["skipped"] == "no --megatron-lm PATH given"
    assert "ratio_median" not in results
    assert list(results["implementations"]) == ["ours"]
    ours = results["implementations"]["ours"]
    assert len(ours["seconds"]) == 2 and all(s > 0 for s in ours["seconds"])
    assert ours["min_s"] == min(ours["seconds"]) <= ours["median_s"]
    # 2 layers of h 96, ffn 144 (SwiGLU), 4 heads in 2 query groups, no biases, tied 384 × 96
    # embedding; every layer: qkv 96 × 192, proj 96 × 96, fc1 96 × 288, fc2 144 × 96, 2 norms
    per_layer = 96 * 192 + 96 * 96 + 96 * 288 + 144 * 96 + 2 * 96
    assert results["parameters"] == 2 * per_layer + 384 * 96 + 96
    printed = capsys.readouterr().out
    assert "| ours (memo_ext) |" in printed
    assert "Megatron-LM comparison skipped: no --megatron-lm PATH given" in printed


def test_the_benchmark_refuses_a_checkout_that_cannot_be_compared(tmp_path):
    with pytest.raises(SystemExit, match="no megatron/training/checkpointing.py there"):
        check_megatron_lm(tmp_path)
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "core").mkdir()
    (tmp_path / "megatron" / "training" / "checkpointing.py").write_text("")
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 15\nPATCH = 3\n"
    )
    installed = importlib.metadata.version("megatron-core")
    with pytest.raises(SystemExit, match=f"holds megatron-core 0.15.3, but {installed} is"):
        check_megatron_lm(tmp_path)
