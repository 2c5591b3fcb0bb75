"""Faults during a run end it with one sentence instead of a hang or a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from memo_ext.config import TokenizerSpec
from memo_ext.data.preprocess import preprocess_jsonl
from tests.launch import ROOT, alone_env, cli, free_port, run_job

pytestmark = pytest.mark.dist

MODEL = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    micro_batch_size=2,
    train_iters=2,
    lr="1e-3",
)


def stalled_rank_job(argv: list[str]) -> int:
    """A job of the tests' worker pool (two ranks): rank 1 stalls, rank 0 waits for it in a
    barrier and writes what happened to ``argv[0]``."""
    from memo_ext.training.initialize import init_distributed

    (result_path,) = argv
    init_distributed(timeout_minutes=0.05)  # 3 s
    try:
        if dist.get_rank() == 1:
            # a stalled rank: it never joins the collective, and outlives rank 0's wait
            deadline = time.monotonic() + 20
            while not os.path.exists(result_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            return 0
        start = time.perf_counter()
        try:
            dist.barrier()
            outcome = "returned"
        except RuntimeError as err:
            outcome = f"raised: {str(err).splitlines()[0][:200]}"
        with open(result_path, "w") as f:
            json.dump({"outcome": outcome, "seconds": time.perf_counter() - start}, f)
        return 0
    finally:
        dist.destroy_process_group()


def test_a_stalled_rank_fails_the_collective_within_the_timeout(tmp_path):
    result = tmp_path / "rank0.json"
    job = run_job([str(result)], nproc=2, entry="tests.dist.test_faults:stalled_rank_job")
    assert job.status == 0, job.describe()
    found = json.loads(result.read_text())
    # gloo's own default would have waited 30 minutes
    assert found["outcome"].startswith("raised") and found["seconds"] < 15, found


def test_a_host_budget_memo_cannot_fit_is_one_sentence():
    run = run_job(
        [
            *MODEL,
            "--mock-data",
            "--memo",
            "--memo-keep-last-layers",
            "0",
            "--memo-host-memory-gb",
            "0.000001",
        ]
    )
    assert run.status == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "MEMO needs at least" in last and "raise --memo-host-memory-gb" in last
    assert "Traceback" not in run.stderr


def test_data_made_with_another_tokenizer_is_named(tmp_path):
    # bytes (ids up to 256) read with a 100-token vocabulary
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"text": "é" * 60}) + "\n" for _ in range(40))
    )
    prefix = preprocess_jsonl(
        input_path=tmp_path / "in.jsonl",
        output_prefix=str(tmp_path / "c"),
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    ).prefixes["text"]
    run = run_job(
        [
            *MODEL,
            "--data-path",
            prefix,
            "--split",
            "1,0,0",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        ]
    )
    assert run.status == 2, run.stderr[-2000:]
    assert "outside the tokenizer's 101-token vocabulary" in run.stderr.strip().splitlines()[-1]


def _launch(args: list[str], nproc: int = 2, script=ROOT / "pretrain_gpt_memo.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
    cmd = [sys.executable, "-m", "memo_ext.launch", *launcher, "--master-port", str(free_port())]
    cmd += [str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.launch
def test_the_launcher_ends_with_the_workers_sentence_and_status():
    # torchrun itself would exit 1 after a traceback of its own
    memo = ["--memo", "--memo-keep-last-layers", "0", "--memo-host-memory-gb", "0.000001"]
    run = _launch([*MODEL, "--mock-data", *memo])
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt_memo.py: rank "), last
    assert "failed: MEMO needs at least" in last
    assert "ChildFailedError" not in run.stderr
    # said once: not by each rank, not again in torchrun's own log lines
    assert run.stderr.count("MEMO needs at least") == 1, run.stderr[-2000:]


@pytest.mark.launch
def test_the_launcher_names_a_killed_rank(tmp_path):
    # a worker killed by a signal writes no sentence: the launcher names the signal
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    run = _launch([], nproc=1, script=script)
    assert run.returncode == 128 + 9, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].endswith("killed by SIGKILL")


def test_a_second_run_saving_into_the_same_folder_is_refused(tmp_path):
    """Two runs with one --save would delete each other's staging folders: while one holds the
    folder (here: this test process), a run saving there stops before training, naming the
    holder; once it is released, the run trains and saves."""
    from memo_ext.training.checkpoint import hold_save_dir
    from tests.launch import train_fails

    save = tmp_path / "ckpt"
    args = [*MODEL, "--mock-data", "--save", str(save), "--save-interval", "1"]
    with hold_save_dir(str(save)):
        line = train_fails(args, status=2)
    assert f"--save {save} is in use by another run (pid {os.getpid()} on " in line
    assert not (save / "iter_0000001").exists()
    result = run_job(args, nproc=2)
    assert result.status == 0, result.describe()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_the_save_folder_is_held_until_the_run_ends(tmp_path):
    """A run's hold ends with it: the same process (a test worker runs many jobs) can take the
    folder right after."""
    from memo_ext.training.checkpoint import hold_save_dir

    save = tmp_path / "ckpt"
    result = run_job([*MODEL, "--mock-data", "--save", str(save)], nproc=1)
    assert result.status == 0, result.describe()
    with hold_save_dir(str(save)):
        pass


def _path_flags() -> list[str]:
    """Every flag of the trainer that names a file or folder, found by its field's name."""
    from memo_ext.arguments import SECTIONS
    from memo_ext.flags import cli_fields, flag_name

    found = []
    for _, cls, _ in SECTIONS:
        for f in cli_fields(cls):
            named = f.name.endswith(("_file", "_dir", "_path", "_cache", "_model"))
            prefixes = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
            if (named or f.name in ("save", "load", "calibration")) and f.name not in prefixes:
                # dataset prefixes (prefix.bin, prefix.idx) are checked as files
                found.append(flag_name(f, prefix=getattr(cls, "FLAG_PREFIX", None)))
    return found


def test_the_path_flags_are_found():
    flags = _path_flags()
    assert {"--metrics-file", "--calibration", "--save", "--load", "--tokenizer-model"} <= set(
        flags
    )
    assert len(flags) >= 10, flags


@pytest.mark.parametrize("flag", _path_flags())
def test_a_fifo_for_any_path_flag_is_refused_without_hanging(tmp_path, flag):
    """Opening a FIFO blocks until something opens its other end: each path flag must refuse
    one, in one sentence, exit 2, well within the job's 60 s."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    extra = {
        "--tokenizer-model": ["--tokenizer-type", "HuggingFaceTokenizer"],
        "--vocab-file": ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", str(fifo)],
        "--merge-file": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(fifo)],
        "--wandb-save-dir": ["--wandb-project", "p", "--wandb-exp-name", "e"],
        "--memo-plan-cache": ["--memo", "--memo-allocator", "plan", "--memo-keep-last-layers", "0"],
    }.get(flag, [])
    # the files that list datasets are the run's data source, instead of mock data
    source = [] if flag in ("--data-args-path", "--per-split-data-args-path") else ["--mock-data"]
    result = run_job([*MODEL, *source, flag, str(fifo), *extra], nproc=1, timeout_s=60)
    assert result.status == 2, result.describe()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(fifo) in result.stderr.strip().splitlines()[-1]


def test_a_finetune_saving_over_the_checkpoints_it_started_from_is_refused(tmp_path):
    """``--finetune --load X --save X`` would start again at iteration 0 and move X's tracker
    to its own saves: refused before any work, and X's checkpoint stays the one a resume loads."""
    from tests.launch import train_fails

    ckpt = tmp_path / "ckpt"
    base = [*MODEL, "--mock-data", "--save", str(ckpt)]
    assert run_job(base, nproc=1).status == 0
    before = sorted(p.name for p in ckpt.iterdir())
    line = train_fails([*base, "--finetune", "--load", str(ckpt)], status=2)
    assert f"--save {ckpt} holds the checkpoints of another run (up to iteration 2)" in line
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    resumed = run_job([*base, "--load", str(ckpt), "--train-iters", "3",
                       "--override-opt_param-scheduler"], nproc=1)  # fmt: skip
    assert resumed.status == 0, resumed.describe()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3\n"


def test_ctrl_c_without_the_signal_handler_names_the_checkpoint_a_resume_loads(tmp_path):
    """Ctrl-C stops the run where it is (a save being written stays a staging folder, removed
    by the next run that holds the folder): one line naming the latest complete checkpoint,
    exit status 130, and the resume loads that checkpoint."""
    import signal

    ckpt = tmp_path / "ckpt"
    args = [*MODEL, "--mock-data", "--save", str(ckpt), "--save-interval", "1"]
    job = subprocess.Popen(
        [sys.executable, "pretrain_gpt_memo.py", *args, "--train-iters", "100000"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True, env=alone_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not (ckpt / "iter_0000002").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-2000:]
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert latest >= 2
    last = err.strip().splitlines()[-1]
    assert last == (
        f"pretrain_gpt_memo.py: error: interrupted (Ctrl-C); the latest complete checkpoint is "
        f"iteration {latest} in {ckpt} (a save being written is discarded); with "
        "--exit-signal-handler a signal saves first"
    )
    (ckpt / f"iter_{latest + 1:07d}.tmp").mkdir(exist_ok=True)  # as a save cut short leaves it
    resumed = run_job([*args, "--load", str(ckpt), "--train-iters", str(latest + 1),
                       "--override-opt_param-scheduler"], nproc=1)  # fmt: skip
    assert resumed.status == 0, resumed.describe()
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == latest + 1
    assert not list(ckpt.glob("*.tmp"))


def test_a_cache_folder_that_cannot_be_written_stops_the_planned_allocator_in_one_sentence(
    tmp_path,
):
    """The allocator's shim is compiled under $XDG_CACHE_HOME: a folder there that cannot be
    made is named before any tensor exists, with where to point the cache instead."""
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    args = [*MODEL, "--num-layers", "3", "--mock-data", "--memo", "--memo-keep-last-layers", "1",
            "--memo-allocator", "plan"]  # fmt: skip
    env = alone_env(XDG_CACHE_HOME=str(blocked))
    env.pop("TORCH_EXTENSIONS_DIR", None)
    result = subprocess.run(
        [sys.executable, "pretrain_gpt_memo.py", *args], cwd=ROOT, capture_output=True,
        text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"build folder {blocked}/torch_extensions/memo_torch_shim_" in last
    assert last.endswith("point XDG_CACHE_HOME (or TORCH_EXTENSIONS_DIR for torch's builds) at a "
                         "writable folder")  # fmt: skip
