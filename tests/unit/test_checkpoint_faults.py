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


def test_torchs_zip_writer_stopping_on_a_full_disk_is_one_sentence(monkeypatch, tmp_path):
    # torch.save's writer reports a short write with no errno (a full disk under DP 2)
    error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4736 vs 4624")
    with pytest.raises(CheckpointError) as caught:
        _save_failing_with(monkeypatch, error, tmp_path)
    message = str(caught.value)
    assert "torch's file writer stopped short (unexpected pos 4736 vs 4624)" in message
    assert "free on the disk" in message and "iteration 4 is still the latest" in message


def _tracked(folder, iteration: int):
    (folder / f"iter_{iteration:07d}").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return folder


@pytest.mark.parametrize(
    "flags, why",
    [
        (dict(load="SAVE", finetune=True), "--finetune takes its weights and starts again"),
        ({}, "it loads no checkpoint"),
        (dict(load="OTHER"), "it starts from --load OTHER"),
        (dict(pretrained_checkpoint="OTHER"), "it starts from --pretrained-checkpoint OTHER"),
    ],
)
def test_a_save_never_replaces_checkpoints_the_run_does_not_resume(tmp_path, flags, why):
    from memo_ext.config.output import CheckpointConfig
    from memo_ext.errors import UsageError
    from memo_ext.training.checkpoint import check_save_target

    save, other = _tracked(tmp_path / "save", 20), _tracked(tmp_path / "other", 7)
    names = {"SAVE": str(save), "OTHER": str(other)}
    given = {k: names.get(v, v) for k, v in flags.items()}
    config = CheckpointConfig(save=str(save), **given)
    with pytest.raises(UsageError) as caught:
        check_save_target(config)
    message = str(caught.value)
    assert f"--save {save} holds the checkpoints of another run (up to iteration 20)" in message
    assert why.replace("OTHER", str(other)) in message


def test_a_save_may_go_where_the_run_resumes_or_where_nothing_is(tmp_path):
    from memo_ext.config.output import CheckpointConfig
    from memo_ext.training.checkpoint import check_save_target

    save = _tracked(tmp_path / "save", 20)
    check_save_target(CheckpointConfig(save=str(save), load=str(save)))
    check_save_target(CheckpointConfig(save=str(save), load=str(save), load_optim=False))
    (tmp_path / "new").mkdir()
    check_save_target(CheckpointConfig(save=str(tmp_path / "new"), load=str(save), finetune=True))
    check_save_target(CheckpointConfig(save=str(tmp_path / "absent")))


@pytest.mark.parametrize("flag", ["load", "pretrained_checkpoint"])
def test_a_hugging_face_folder_given_as_a_checkpoint_is_named_not_skipped(tmp_path, flag):
    """``--load HF`` would otherwise start from scratch in silence (a --load without a
    checkpoint starts fresh, as in Megatron-LM)."""
    from memo_ext.config.output import CheckpointConfig
    from memo_ext.errors import UsageError
    from memo_ext.training.checkpoint import checkpoint_source

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError) as caught:
        checkpoint_source(CheckpointConfig(**{flag: str(tmp_path)}))
    flag_name = "--" + flag.replace("_", "-")
    assert str(caught.value) == (
        f"{flag_name} {tmp_path} is a Hugging Face model folder (model.safetensors), which the "
        f"trainer does not load; import it first: memo-convert-hf import --hf-dir {tmp_path} "
        "--out CKPT, then --load CKPT --finetune"
    )
