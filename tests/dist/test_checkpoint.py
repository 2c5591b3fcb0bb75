"""Checkpoints: exact resume, resume into another layout, preemption, refusal of bad files."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.launch import (
    ROOT,
    TINY_LLAMA,
    assert_same_curves,
    cli,
    free_port,
    reference_run,
    run_pretrain,
    train_fails,
)

pytestmark = pytest.mark.dist

MODEL = TINY_LLAMA + cli(
    global_batch_size=4, lr="2e-3", lr_warmup_iters=2, lr_decay_style="cosine", weight_decay="0.1"
)
ITERS = ["--train-iters", "6"]
# a resumed run replays the same arithmetic: any difference is a resume bug, not rounding
RTOL = 1e-6


@pytest.fixture(scope="module")
def uninterrupted(reference_runs):
    return reference_run(MODEL + ITERS, nproc=1, cache_dir=reference_runs)


def stop_and_resume(tmp_path, first: list[str], second: list[str], nprocs=(1, 1)) -> list[dict]:
    save = tmp_path / "ckpt"
    save.mkdir()
    common = MODEL + ITERS + ["--save", str(save)]
    head = run_pretrain(
        common + first + ["--exit-interval", "3"], nproc=nprocs[0], workdir=tmp_path, name="head"
    )
    assert head[-1]["iteration"] == 3
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # the same metrics file continues: copy the head's records to where the tail appends
    (tmp_path / "tail.jsonl").write_text((tmp_path / "head.jsonl").read_text())
    return run_pretrain(
        common + second + ["--load", str(save)], nproc=nprocs[1], workdir=tmp_path, name="tail"
    )


def test_resume_is_exact_in_one_process(uninterrupted, tmp_path):
    curves = stop_and_resume(tmp_path, [], [])
    assert_same_curves(uninterrupted, curves, rtol=RTOL)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["tp2-sp", "pp2"],
)
def test_resume_is_exact_under_model_parallelism(uninterrupted, tmp_path, layout):
    curves = stop_and_resume(tmp_path, layout, layout, nprocs=(2, 2))
    # the uninterrupted reference is one process: layouts agree to fp32 summation order
    assert_same_curves(uninterrupted, curves, rtol=1e-5)


def test_checkpoint_loads_into_another_layout(uninterrupted, tmp_path):
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    curves = stop_and_resume(tmp_path, tp2, ["--pipeline-model-parallel-size", "2"], (2, 2))
    assert_same_curves(uninterrupted, curves, rtol=1e-5)


@pytest.mark.launch  # signals reach the processes of a real launch
def test_sigterm_saves_and_exits_zero(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    metrics = tmp_path / "run.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "pretrain_gpt_memo.py"),
        *MODEL,
        "--train-iters",
        "100000",
        "--save",
        str(save),
        "--exit-signal-handler",
        "--metrics-file",
        str(metrics),
        "--log-interval",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    # a cluster scheduler signals every process of the job; torchrun itself would kill its
    # workers on SIGTERM, so the workers (the 2 ranks and their data-loader processes) are the
    # ones signalled here
    assert len(psutil.Process(proc.pid).children()) == 2
    for worker in psutil.Process(proc.pid).children(recursive=True):
        worker.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-4000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert saved == records[-1]["iteration"] >= 3
    assert (save / f"iter_{saved:07d}" / "manifest.json").is_file()


@pytest.fixture
def saved_checkpoint(tmp_path) -> Path:
    save = tmp_path / "ckpt"
    save.mkdir()
    run_pretrain(
        MODEL + ["--train-iters", "2", "--save", str(save)], nproc=1, workdir=tmp_path, name="save"
    )
    return save


def load_fails(save: Path, tmp_path: Path, train_iters: int = 2) -> str:
    return train_fails([*MODEL, "--train-iters", str(train_iters), "--load", str(save)], status=1)


def _refresh_manifest(directory: Path) -> None:
    """Re-checksum after tampering, so only the content checks can catch it."""
    from memo_ext.training.checkpoint.integrity import _sha256

    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {name: _sha256(directory / name) for name in manifest["files"]}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_corrupt_and_partial_checkpoints_are_named(saved_checkpoint, tmp_path):
    directory = saved_checkpoint / "iter_0000002"
    data_file = next(p for p in directory.glob("*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    message = load_fails(saved_checkpoint, tmp_path)
    assert f"{data_file} is corrupt" in message

    (directory / "manifest.json").unlink()  # as a crash before the rename would leave it
    assert "manifest.json is missing" in load_fails(saved_checkpoint, tmp_path)

    (saved_checkpoint / "latest_checkpointed_iteration.txt").write_text("7\n")
    message = load_fails(saved_checkpoint, tmp_path, train_iters=8)
    assert "iter_0000007/manifest.json is missing" in message


class _Payload:
    """Unpickling this calls os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_payload_is_refused_without_running(saved_checkpoint, tmp_path):
    directory = saved_checkpoint / "iter_0000002"
    marker = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    pickle.dump({"metadata": _Payload(marker)}, buffer)
    (directory / ".metadata").write_bytes(buffer.getvalue())
    _refresh_manifest(directory)
    message = load_fails(saved_checkpoint, tmp_path)
    assert "refusing to load it" in message and ".metadata" in message
    assert not marker.exists()


def test_resume_with_another_schedule_needs_a_choice(saved_checkpoint, tmp_path):
    # the checkpoint decays its lr until step 3 (2 warm-up steps + 1); these flags until step 4
    longer = [*MODEL, "--train-iters", "4", "--load", str(saved_checkpoint)]
    message = train_fails(longer, status=2)
    assert "another LR schedule" in message and "lr_decay_steps 3 vs 4" in message
    assert "--override-opt_param-scheduler" in message
    flags = run_pretrain(
        [*longer, "--override-opt_param-scheduler"], nproc=1, workdir=tmp_path, name="flags"
    )
    kept = run_pretrain(
        [*longer, "--use-checkpoint-opt_param-scheduler"], nproc=1, workdir=tmp_path, name="kept"
    )
    assert [r["iteration"] for r in flags] == [3, 4] == [r["iteration"] for r in kept]
    # step 3 applies the peak lr under both; at step 4 the checkpoint's schedule has decayed
    # to 0 while the flags' still has lr to spend
    assert flags[0]["lr"] == kept[0]["lr"] == 2e-3
    assert flags[1]["lr"] > 0 and kept[1]["lr"] == 0.0


def test_load_and_train_iters_that_cannot_resume_are_refused(saved_checkpoint):
    iteration_dir = saved_checkpoint / "iter_0000002"
    message = train_fails([*MODEL, *ITERS, "--load", str(iteration_dir)], status=2)
    assert f"give the directory that holds it (--load {saved_checkpoint})" in message
    shorter = [*MODEL, "--train-iters", "1", "--lr-warmup-iters", "0"]
    past = train_fails([*shorter, "--load", str(saved_checkpoint)], status=2)
    assert "is at iteration 2, past --train-iters 1" in past
    other = [a if a != "36" else "48" for a in MODEL]  # another hidden size
    shape = train_fails([*other, "--train-iters", "2", "--load", str(saved_checkpoint)], status=2)
    # named by the checkpoint's model record (before it, by torch_dist's shape mismatch)
    assert "holds another model: hidden_size 36 there, 48 here" in shape
    # both at once: one attempt names every misfit, and where the checkpoint's flags are
    both = train_fails([*other, *shorter[len(MODEL) :], "--load", str(saved_checkpoint)], status=2)
    assert f"--load {saved_checkpoint} does not fit this run on 2 counts" in both
    assert "past --train-iters 1" in both and "hidden_size 36 there, 48 here" in both
    assert f"({saved_checkpoint / 'model_flags.txt'} lists them)" in both


def test_save_to_a_file_is_refused_before_training(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    message = train_fails([*MODEL, *ITERS, "--save", str(target / "ckpt")], status=2)
    assert "is a file, not a directory" in message


def test_malformed_manifests_trackers_and_rng_files_are_named(saved_checkpoint, tmp_path):
    """Each damage ends in one sentence naming the file, exit 1, no traceback."""
    directory = saved_checkpoint / "iter_0000002"
    manifest = directory / "manifest.json"
    good = manifest.read_text()
    for damaged in ('{"format": "memo-checkpoint/1"}', "[1, 2]"):  # no files / not an object
        manifest.write_text(damaged)
        message = load_fails(saved_checkpoint, tmp_path)
        assert f"{manifest} does not list the checkpoint's files" in message
    manifest.write_text(good)
    rng = directory / "rng" / "rank_00000.pt"
    rng.write_bytes(b"")
    _refresh_manifest(directory)  # the checksums alone would name it: the reader must too
    assert f"{rng} cannot be read" in load_fails(saved_checkpoint, tmp_path)
    tracker = saved_checkpoint / "latest_checkpointed_iteration.txt"
    tracker.write_text("²\n")  # a digit to str.isdigit(), not to int()
    message = train_fails([*MODEL, "--train-iters", "2", "--load", str(saved_checkpoint)], status=1)
    assert "should hold an iteration number, not '²'" in message


def test_a_checkpoint_of_another_model_is_refused_by_name(saved_checkpoint, tmp_path):
    """Weights that would load into another model (a padded vocabulary of another size, a
    LayerNorm's weights without their biases) are refused, each difference named."""
    args = [*MODEL, "--train-iters", "2", "--load", str(saved_checkpoint)]
    other_vocab = [*args, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
    message = train_fails(other_vocab, status=2)
    assert f"the checkpoint in {saved_checkpoint / 'iter_0000002'} holds another model" in message
    assert "padded_vocab_size 384 there, 512 here" in message
    layer_norm = tmp_path / "layernorm"
    with_norm = [a if a != "RMSNorm" else "LayerNorm" for a in MODEL]
    run_pretrain(
        [*with_norm, "--train-iters", "2", "--save", str(layer_norm)],
        nproc=1,
        workdir=tmp_path,
        name="layernorm",
    )
    message = train_fails([*MODEL, "--train-iters", "2", "--load", str(layer_norm)], status=2)
    assert "normalization LayerNorm there, RMSNorm here" in message


def test_a_damaged_common_file_of_this_model_is_named_damaged(saved_checkpoint, tmp_path):
    """The checkpoint records this run's model, so a file that does not load is damaged (exit
    1), not another model's (exit 2)."""
    directory = saved_checkpoint / "iter_0000002"
    common = directory / "common.pt"
    blob = bytearray(common.read_bytes())
    blob[len(blob) // 2 :] = bytes(len(blob) - len(blob) // 2)  # its second half zeroed
    common.write_bytes(bytes(blob))
    _refresh_manifest(directory)  # re-checksummed: only the reader can tell
    message = load_fails(saved_checkpoint, tmp_path)
    assert "cannot be read although it holds this model" in message and "damaged" in message


def test_a_save_records_the_flags_that_build_its_model(saved_checkpoint, tmp_path):
    """``model_flags.txt`` beside the checkpoints: the model and tokenizer flags, enough for a
    new run to ``--finetune`` from it with none of them retyped (and for
    ``tools.convert_hf export``, which reads the same file)."""
    import shlex

    from memo_ext.arguments import parse_args

    flags = shlex.split((saved_checkpoint / "model_flags.txt").read_text())
    training = ["--seq-length", "28", "--micro-batch-size", "2", "--global-batch-size", "4"]
    training += ["--lr", "1e-3", "--mock-data", "--train-iters", "3"]
    assert parse_args(flags + training).shape == parse_args(MODEL + ITERS).shape
    records = run_pretrain(
        [*flags, *training, "--load", str(saved_checkpoint), "--finetune"],
        nproc=1, workdir=tmp_path, name="finetune",
    )  # fmt: skip
    assert [r["iteration"] for r in records] == [1, 2, 3]


def test_a_resume_prints_no_library_warnings(tmp_path):
    # a fresh process each (the test workers' processes would have shown a warning once
    # already): megatron-core's loader trips torch deprecations that no user can act on
    save = tmp_path / "ckpt"
    args = [*MODEL, *ITERS, "--save", str(save)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    entry = [sys.executable, str(ROOT / "pretrain_gpt_memo.py")]
    for extra in (["--exit-interval", "2"], ["--load", str(save)]):
        done = subprocess.run(
            [*entry, *args, *extra], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "loaded checkpoint" in console
    assert "Warning" not in console and "warnings.warn" not in console, console[-3000:]


def _launch_until_records(
    tmp_path: Path, *extra: str, session: bool = False
) -> tuple[subprocess.Popen, Path]:
    """``python -m memo_ext.launch`` of 2 ranks training on, once 3 steps are logged;
    ``session``: in a process group of its own, as a terminal's foreground job is."""
    save, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    save.mkdir()
    cmd = [
        *(sys.executable, "-m", "memo_ext.launch", "--nproc-per-node", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        str(ROOT / "pretrain_gpt_memo.py"),
        *MODEL,
        *("--train-iters", "100000", "--save", str(save), "--metrics-file", str(metrics)),
        *("--log-interval", "1", *extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=session,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            return proc, save
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no 3 steps in 120 s:\n{proc.communicate()[1][-3000:]}")


@pytest.mark.launch  # signals reach the processes of a real launch
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signalled_launcher_saves_and_exits_zero(tmp_path, sig):
    """The launcher alone is signalled (a scheduler's preemption of the job step, Ctrl-C): it
    forwards the signal, every rank saves at the next step and exits, and the launch exits 0
    with one line, not torchrun's traceback."""
    proc, save = _launch_until_records(tmp_path, "--exit-signal-handler")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    assert err.strip().splitlines()[-1] == f"stopped by {sig.name}: every rank exited cleanly"
    assert "Traceback" not in err
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert (save / f"iter_{saved:07d}" / "manifest.json").is_file()


@pytest.mark.launch
def test_ctrl_c_in_a_terminal_ends_a_launch_with_the_line_naming_the_checkpoint(tmp_path):
    """A terminal's Ctrl-C reaches the launcher and every rank at once, here while they save at
    every step: one line naming the latest complete checkpoint (the ranks' own sentence, which
    the launcher quotes), exit status 130, no traceback from a rank whose peer stopped first."""
    proc, save = _launch_until_records(tmp_path, "--save-interval", "1", session=True)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-4000:]
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGINT: interrupted (Ctrl-C); the latest complete checkpoint is iteration "
        f"{latest} in {save} (a save being written is discarded); with --exit-signal-handler a "
        "signal saves first"
    )
    assert "Traceback" not in err, err[-4000:]


@pytest.mark.launch
def test_a_signalled_launcher_without_the_handler_is_no_clean_stop(tmp_path):
    """Without --exit-signal-handler the ranks die of the signal: 128 + 15, and no checkpoint."""
    proc, save = _launch_until_records(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM: ranks 0, 1 did not exit cleanly"
    assert not (save / "latest_checkpointed_iteration.txt").exists()
