"""memo-simulate's own flags: what it refuses before starting anything, and the trainer flags it
sets itself (the runs are in tests/emulated/test_simulate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memo_ext.commands.simulate import main, trainer_flags
from memo_ext.errors import UsageError


def test_the_simulation_sets_its_own_steps_metrics_and_drops_checkpoints():
    user = ["--seq-length", "4096", "--save", "ckpt", "--save-interval=10", "--train-iters",
            "500", "--log-interval", "10", "--use-flash-attn", "--load", "ck",
            "--bf16"]  # fmt: skip
    flags, dropped = trainer_flags(user, steps=3, out=Path("/o"))
    assert dropped == ["--save ckpt", "--save-interval=10", "--train-iters 500",
                       "--log-interval 10", "--use-flash-attn", "--load ck"]  # fmt: skip
    assert flags == ["--seq-length", "4096", "--bf16", "--train-iters", "3", "--log-interval",
                     "1", "--log-throughput", "--metrics-file", "/o/metrics.jsonl"]  # fmt: skip


@pytest.mark.parametrize("pp", [["--pipeline-model-parallel-size", "2"],
                                ["--pipeline-model-parallel-size=4"]])  # fmt: skip
def test_pipeline_parallelism_is_refused(pp):
    with pytest.raises(UsageError, match="not simulated"):
        trainer_flags(["--seq-length", "4096", *pp], steps=1, out=Path("/o"))
    trainer_flags(["--pipeline-model-parallel-size", "1"], steps=1, out=Path("/o"))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus", "8"], "give the trainer's flags after --"),
        (["--gpus", "0", "--", "--bf16"], "--gpus and --steps must be at least 1"),
        (["--calibration", "nowhere.json", "--", "--bf16"], "is not a file"),
        (["--", "--pipeline-model-parallel-size", "2"], "not simulated"),
        (["--gpu", "b200", "--", "--bf16"], "choose from 'a100-80g'"),
    ],
)
def test_bad_input_is_one_sentence_with_status_2(argv, says, tmp_path, capsys):
    assert main(["--out", str(tmp_path / "sim"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memo-simulate: error: ") and says in err
    assert err.count("\n") == 1
