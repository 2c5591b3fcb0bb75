"""Retrieval scores that mean something: a tiny model trained on a corpus where the passkey task
appears answers it, an untrained one does not, a decoder that reads the answer one token off
scores at chance, and the same weights score alike under every layout and with MEMO."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import ROOT, alone_env, cli, run_pretrain
from tests.retrieval_corpus import task_corpus

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DIGITS = 2
GRID = [
    "--eval-retrieval-lengths", "64,128",  # training is at 128 tokens
    "--eval-retrieval-depths", "0,0.5,1",
    "--eval-retrieval-samples", "8",
    "--eval-retrieval-digits", str(DIGITS),
    "--eval-retrieval-tasks", "passkey",
]  # fmt: skip
MODEL = cli(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=128,
    position_embedding_type="rope",
    normalization="RMSNorm",
    disable_bias_linear=True,
    attention_dropout=0,
    hidden_dropout=0,
    # a wider start than Megatron's 0.02 for a model this small: attention sharp enough to copy
    # the number within a few hundred steps
    init_method_std="0.1",
)
TRAIN = cli(
    micro_batch_size=16,
    global_batch_size=16,
    lr="3e-3",
    lr_warmup_iters=20,
    clip_grad="1.0",
    seed=1234,
    split="95,5,0",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data flags, checkpoint folder, records) of 900 steps on the task corpus, evaluated at
    the start (iteration 0 is the untrained model) and the end."""
    folder = tmp_path_factory.mktemp("retrieval")
    data = task_corpus(folder, digits=DIGITS)
    ckpt = folder / "ckpt"
    records = run_pretrain(
        [*MODEL, *TRAIN, *data, *GRID, "--train-iters", "900", "--eval-interval", "900",
         "--eval-iters", "1", "--save", str(ckpt), "--save-interval", "900"],
        nproc=1, workdir=folder, name="train", timeout_s=900,
    )  # fmt: skip
    return data, ckpt, records


def evaluate(
    data, ckpt, tmp_path, *flags, nproc: int = 1, name: str = "eval", module: str | None = None
) -> dict:
    """The --skip-train record of the checkpoint (``None``: the untrained model) under
    ``flags``, by ``module``'s trainer when given."""
    args = [*MODEL, *TRAIN, *data, *GRID, "--train-iters", "900", "--eval-iters", "0",
            "--skip-train", *flags]  # fmt: skip
    if ckpt is not None:
        args += ["--load", str(ckpt), "--finetune"]
    (record,) = run_pretrain(args, nproc=nproc, workdir=tmp_path, name=name, module=module)
    return record


def test_training_on_the_task_moves_the_score(trained, tmp_path):
    data, ckpt, records = trained
    untrained = evaluate(data, None, tmp_path, name="untrained")
    after = records[-1]
    assert untrained["iteration"] == 0 and after["iteration"] == 900
    assert untrained["val_passkey_acc"] <= 0.05, untrained["val_passkey_acc_by_cell"]
    assert after["val_passkey_acc"] >= 0.6, after["val_passkey_acc_by_cell"]
    # the same weights evaluated on their own give the in-loop record's figures
    again = evaluate(data, ckpt, tmp_path, name="again")
    for key in ("val_passkey_acc_by_cell", "val_passkey_token_acc"):
        assert again[key] == after[key]


def test_a_decoder_reading_the_answer_one_token_off_scores_at_chance(trained, tmp_path):
    """The answer's labels rotated by one token: the model's right digits are compared with
    their neighbours, which match only when the number repeats its digits (chance, 1/10)."""
    data, ckpt, records = trained
    right = records[-1]["val_passkey_acc"]
    broken = evaluate(data, ckpt, tmp_path, name="broken", module="tests.dist.retrieval_off_by_one")
    assert right >= 0.6
    assert broken["val_passkey_acc"] <= 0.2, broken["val_passkey_acc_by_cell"]


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, ["--micro-batch-size", "8"]),
    "memo": (1, ["--memo", "--memo-keep-last-layers", "1"]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_same_weights_score_alike_under_every_layout(trained, tmp_path, layout):
    data, ckpt, records = trained
    nproc, flags = LAYOUTS[layout]
    record = evaluate(data, ckpt, tmp_path, *flags, nproc=nproc, name=layout)
    after = records[-1]
    assert record["val_passkey_acc_by_cell"] == after["val_passkey_acc_by_cell"]
    assert record["val_passkey_token_acc"] == pytest.approx(after["val_passkey_token_acc"])


def test_the_tool_scores_a_checkpoint_under_tp_and_draws_two_grids_side_by_side(trained, tmp_path):
    """tools.eval_retrieval on the trained checkpoint (its model flags read from the folder)
    under TP 2 + SP: the grid the training run recorded, as JSON and a heatmap; --plot draws it
    beside the untrained model's and prints both."""
    data, ckpt, records = trained
    lengths = GRID[GRID.index("--eval-retrieval-lengths") + 1]

    def tool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tools.eval_retrieval", *args],
            cwd=ROOT, env=alone_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip

    out = tmp_path / "after"
    done = tool("--load", str(ckpt), "--out", str(out), "--nproc", "2",
                "--tensor-model-parallel-size", "2", "--sequence-parallel", *GRID)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    grid = json.loads((out / "retrieval.json").read_text())
    after = records[-1]["val_passkey_acc_by_cell"]
    assert grid["iteration"] == 900 and grid["lengths"] == [int(n) for n in lengths.split(",")]
    assert grid["depths"] == [0.0, 0.5, 1.0]
    assert grid["tasks"]["passkey"]["grid"] == [
        [after[f"{n}@{d:g}"] for d in grid["depths"]] for n in grid["lengths"]
    ]
    assert (out / "retrieval.png").stat().st_size > 10_000

    before = tmp_path / "before.json"
    untrained = dict(grid, iteration=0)
    untrained["tasks"] = {"passkey": {"accuracy": 0.0, "grid": [[0.0] * 3] * 2}}
    before.write_text(json.dumps(untrained))
    picture = tmp_path / "both.png"
    done = tool("--plot", str(before), str(out / "retrieval.json"), "--names", "before",
                "after", "--out", str(picture))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert picture.stat().st_size > 10_000
    mean, tokens = records[-1]["val_passkey_acc"], records[-1]["val_passkey_token_acc"]
    assert grid["tasks"]["passkey"]["token_accuracy"] == tokens
    heading = f"passkey: accuracy 0.00 / {mean:.2f}, token accuracy - / {tokens:.2f}"
    assert f"{heading}  (before / after)" in done.stdout
    assert "note: passkey of before is at chance" in done.stdout
    first_row = done.stdout.splitlines()[2].split()
    assert first_row[:4] == ["64", "0.00", "/", f"{after['64@0']:.2f}"]
