"""``make demo``'s script end to end, shortened: the corpus is built, two ranks train under
``python -m memo_ext.launch``, and the metrics check at the end runs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.launch import ROOT, free_port

pytestmark = [pytest.mark.launch, pytest.mark.slow]


@pytest.mark.parametrize(
    "flags",
    [[], ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]],
    ids=["fp32", "gpu-configuration"],
)
def test_demo_script_trains_and_checks_its_metrics(tmp_path, flags):
    out = tmp_path / "demo"
    env = {
        **os.environ,
        "PYTHON": os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python")),
        "TRAIN_ITERS": "3",
        "OUT": str(out),
        "DATA_DIR": str(tmp_path / "data"),
        # 3 steps (warm-up: 0 steps at 1/10 of them) show little; the loss must not rise by a nat
        "REQUIRE_LOSS_DROP": "-1",
        "MASTER_PORT": str(free_port()),
    }
    if not os.path.exists(env["PYTHON"]):
        env["PYTHON"] = "python3"
    done = subprocess.run(
        ["bash", "scripts/demo_cpu.sh", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 3]  # --log-interval 10: first and last
    assert "3 iterations | loss" in done.stdout  # the summary line of the check
    # every setting in a file beside the metrics, one line on the console
    settings = json.loads((out / "metrics.config.json").read_text())
    assert settings["data"]["seq_length"] == 256 and settings["layout"]["dp"] == 2
    assert settings["train"]["bf16"] == ("--bf16" in flags)
    assert done.stderr.count(str(out / "metrics.config.json")) == 1
    # nothing a user cannot act on: no library's warnings, no per-split dataset notices
    console = done.stdout + done.stderr
    assert "Warning" not in console and "warnings.warn" not in console, console[-3000:]
    # the last step evaluated (loss by position, the retrieval grid) and saved a checkpoint
    assert "val_loss_by_position" in records[-1] and "val_passkey_acc" in records[-1]
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    if flags:
        return
    # the "next:" lines run as printed, on the demo's own outputs
    next_steps = done.stdout.split("next:\n", 1)[1].splitlines()
    for line in next_steps:
        if line.strip().startswith("python -m tools.plot_position_loss") or " export " in line:
            argv = line.split()[1:]
            ran = subprocess.run([env["PYTHON"], *argv], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
            assert ran.returncode == 0, line + ran.stderr[-3000:]
    assert (out / "position_loss.png").is_file() and (out / "hf" / "config.json").is_file()
    # run again: the earlier outputs move aside instead of stopping the run
    again = subprocess.run(
        ["bash", "scripts/demo_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"the previous demo's outputs are in {out}.previous" in again.stdout
    assert (out.parent / "demo.previous" / "hf" / "config.json").is_file()
    assert not (out / "hf").exists()
