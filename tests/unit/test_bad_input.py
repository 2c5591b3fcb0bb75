"""Bad input ends in one sentence that names the problem: flags, data files, metrics files, plans.

Each case here once ran on silently, hung, or ended in a raw traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from memo_ext.arguments import parse_args
from memo_ext.config import DEFAULT_SPLIT, TokenizerSpec
from memo_ext.data.datasets import fit_split
from memo_ext.data.preprocess import preprocess_jsonl
from memo_ext.errors import UsageError
from memo_ext.planner import (
    Alloc,
    Free,
    Plan,
    PlannerInputError,
    PlanValidationError,
    Trace,
    validate,
)
from memo_ext.training.step import check_token_ids
from tests.launch import SMALL_GPT, cli, run_tool

BASE = SMALL_GPT


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--global-batch-size", "0"], "--global-batch-size must be at least 1"),
        (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "0"],
            "--vocab-size must be at least 1",
        ),
        (["--global-batch-size", "-4"], "--global-batch-size must be at least 1"),
        (["--lr-decay-iters", "-1"], "must be larger than --lr-warmup-iters 0"),
        (["--lr-warmup-iters", "5", "--lr-decay-iters", "3"], "--lr-decay-iters 3 must be larger"),
        (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be positive"),
        (["--adam-beta1", "1.0"], "--adam-beta1 must be in [0, 1)"),
        (["--adam-beta2", "-0.1"], "--adam-beta2 must be in [0, 1)"),
        (["--adam-eps", "0"], "--adam-eps must be positive"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
        (["--init-method-std", "-0.02"], "--init-method-std must be positive"),
        (["--kv-channels", "0"], "--kv-channels must be at least 1"),
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--position-embedding-type", "rope", "--kv-channels", "9"], "must be even"),
        (["--attention-backend", "flash"], "needs CUDA and the flash_attn package"),
        (["--memo", "--memo-keep-last-layers", "4"], "--memo would offload no layer"),
        (["--memo", "--memo-chunk-tokens", "0"], "--memo-chunk-tokens must be >= 1"),
        (
            ["--memo", "--memo-chunk-tokens", "64", "--variable-seq-lengths"],
            "--memo-chunk-tokens cannot chunk packed documents",
        ),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be positive"),
        (
            ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            "are exclusive",
        ),
    ],
)
def test_flags_that_ran_on_silently_are_refused(extra, message):
    with pytest.raises(UsageError) as err:
        parse_args([*BASE, *extra], world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_save_must_be_a_writable_directory(tmp_path):
    parse_args([*BASE, "--save", str(tmp_path / "new" / "ckpt")], world_size=1)  # made later
    a_file = tmp_path / "f"
    a_file.write_text("")
    for path, message in [(a_file, "is a file"), (a_file / "ckpt", f"lies under {a_file}")]:
        with pytest.raises(UsageError, match=message):
            parse_args([*BASE, "--save", str(path)], world_size=1)


@pytest.mark.parametrize(
    "flag, under_file, message",
    [
        ("--tensorboard-dir", "", "--tensorboard-dir {f} is a file"),
        ("--data-cache-path", "", "--data-cache-path {f} is a file"),
        ("--metrics-file", "m.jsonl", "folder {f} is a file"),
    ],
)
def test_output_paths_are_checked_before_training(tmp_path, flag, under_file, message):
    a_file = tmp_path / "f"
    a_file.write_text("")
    path = a_file / under_file if under_file else a_file
    with pytest.raises(UsageError, match=message.format(f=a_file)):
        parse_args([*BASE, flag, str(path)], world_size=1)


def test_a_metrics_file_that_cannot_be_written_is_named(tmp_path):
    from memo_ext.training.metrics import MetricsWriter

    (tmp_path / "ro").mkdir()
    target = tmp_path / "ro" / "m.jsonl"
    target.mkdir()  # a directory in the file's place: writing it fails as any OS error would
    with pytest.raises(UsageError, match=f"--metrics-file {target}: cannot write it"):
        MetricsWriter(str(target))


def test_disk_full_names_the_disk_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from memo_ext.training import checkpoint as checkpointing
    from memo_ext.training.checkpoint import save

    (tmp_path / checkpointing.TRACKER).write_text("3\n")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(save, "_save", full)
    with pytest.raises(checkpointing.CheckpointError) as err:
        checkpointing.save_checkpoint(
            save_dir=str(tmp_path),
            progress=checkpointing.TrainProgress(6, 24),
            model=None,
            optimizer=None,
            scheduler=None,
        )
    assert "no space left on the disk" in str(err.value)
    assert "iteration 3 is still the latest" in str(err.value)


# ---------------------------------------------------------------------------------------------
# data files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    """Ten documents of 40-80 bytes, ByteTokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "x" * int(n)}) for n in rng.integers(40, 80, size=10)]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = preprocess_jsonl(
        input_path=root / "in.jsonl",
        output_prefix=str(root / "c"),
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    )
    return summary.prefixes["text"]


def _data_args(prefix: str, *extra: str) -> list[str]:
    return [a for a in BASE if a != "--mock-data"] + ["--data-path", prefix, *extra]


def test_an_empty_split_part_is_refused_not_looped_on(small_corpus):
    # 969,30,1 gives the validation part documents [round(9.69), round(9.99)) of 10: none,
    # which megatron-core's GPTDataset loops on forever
    with pytest.raises(UsageError, match="gives the validation part 0 of the 10 documents"):
        parse_args(_data_args(small_corpus, "--split", "969,30,1"), world_size=1)
    assert parse_args(_data_args(small_corpus, "--split", "8,2,0"), world_size=1).data.split == (
        "8,2,0"
    )


def test_the_default_split_drops_the_parts_a_small_corpus_cannot_fill(small_corpus, caplog):
    with caplog.at_level(logging.INFO, logger="memo_ext.data.input_files"):
        run = parse_args(_data_args(small_corpus), world_size=1)
    assert run.data.split == "969,0,0"  # 10 documents: none for the test or validation part
    (record,) = caplog.records
    assert record.getMessage() == (
        "--split 969,0,0: the default 969,30,1 gives the validation and test part no document "
        "of the 10 in the smallest dataset; pass --split to choose"
    )
    # evaluation reads the validation part: the default keeps it, and the corpus is refused
    with pytest.raises(UsageError, match="--split 969,30,0 gives the validation part 0 of the"):
        parse_args(_data_args(small_corpus, "--eval-interval", "5"), world_size=1)


def test_the_default_split_is_kept_where_every_part_gets_documents():
    # the parts' counts as megatron-core rounds them: 1,000 documents fill 969,30,1
    assert fit_split(DEFAULT_SPLIT, [1000], keep_validation=False) == "969,30,1"
    assert fit_split(DEFAULT_SPLIT, [1000, 168], keep_validation=False) == "969,30,0"
    assert fit_split(DEFAULT_SPLIT, [168], keep_validation=True) == "969,30,0"
    assert fit_split("98,2,0", [20], keep_validation=False) == "98,0,0"


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_data_file_given_for_its_prefix_is_told_to_drop_the_suffix(small_corpus, suffix):
    with pytest.raises(UsageError) as err:
        parse_args(_data_args(small_corpus + suffix), world_size=1)
    assert str(err.value) == (
        f"--data-path takes dataset prefixes, not files: give {small_corpus} (drop {suffix}), "
        f"which names {small_corpus}.bin and {small_corpus}.idx"
    )
    weighted = ["--train-data-path", "0.5", small_corpus, "0.5", small_corpus + suffix]
    with pytest.raises(UsageError, match=f"--train-data-path takes .* \\(drop \\{suffix}\\)"):
        parse_args([a for a in BASE if a != "--mock-data"] + weighted, world_size=1)


def test_truncated_bin_and_garbage_idx_are_named(small_corpus, tmp_path):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"c{suffix}").write_bytes(Path(small_corpus + suffix).read_bytes())
    copy = str(tmp_path / "c")
    blob = Path(copy + ".bin").read_bytes()
    Path(copy + ".bin").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UsageError, match=r"c\.bin holds \d+ bytes but its index lists"):
        parse_args(_data_args(copy, "--split", "1,0,0"), world_size=1)
    # another corpus's longer .bin beside this index: what a mixed-up copy leaves
    Path(copy + ".bin").write_bytes(blob + blob[:10])
    with pytest.raises(UsageError, match=r"c\.bin holds \d+ bytes .* are not one pair"):
        parse_args(_data_args(copy, "--split", "1,0,0"), world_size=1)
    Path(copy + ".bin").write_bytes(blob)
    Path(copy + ".idx").write_bytes(b"not an index at all")
    with pytest.raises(UsageError, match=r"c\.idx is not a readable megatron-core index"):
        parse_args(_data_args(copy, "--split", "1,0,0"), world_size=1)


def test_preprocessing_an_empty_input_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no document"):
        preprocess_jsonl(
            input_path=tmp_path / "empty.jsonl",
            output_prefix=str(tmp_path / "e"),
            tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
        )
    assert not list(tmp_path.glob("e_*"))  # nothing half-written is left


def test_token_ids_outside_the_vocabulary_are_named():
    batch = {"tokens": torch.tensor([[1, 2, 300]]), "labels": torch.tensor([[2, 300, 5]])}
    with pytest.raises(UsageError, match="token id 300, outside the tokenizer's 257-token"):
        check_token_ids(batch, vocab_size=257)
    check_token_ids(batch, vocab_size=301)


# ---------------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------------


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    return run_tool(module, *args)


@pytest.mark.slow
def test_summarize_metrics_fails_on_nan_and_names_bad_files(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [
        {"iteration": i, "loss": v, "step_time_s": 1.0, "tokens_per_s": 1.0}
        for i, v in ((1, 5.0), (2, float("nan")))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    nan = _tool("tools.summarize_metrics", str(path), "--require-loss-drop", "1.0")
    assert nan.returncode == 1
    path.write_text('{"iteration": 1}\nnot json\n')
    garbage = _tool("tools.summarize_metrics", str(path))
    assert garbage.returncode == 2 and "line 2 is not a metrics record" in garbage.stderr
    assert len(garbage.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "tools.memory_report",
                *cli(num_layers=2, hidden_size=64, num_attention_heads=3, seq_length=64),
            ],
            "not divisible by 3 attention heads",
        ),
        (
            [
                "tools.memory_report",
                *cli(
                    num_layers=2,
                    hidden_size=64,
                    num_attention_heads=4,
                    seq_length=66,
                    tensor_model_parallel_size=4,
                    sequence_parallel=True,
                ),
            ],
            "not divisible by TP",
        ),
        (
            ["tools.estimate", "--model", "gpt-7b", "--matmul-efficiency", "2"],
            "--matmul-efficiency must be in (0, 1]",
        ),
    ],
)
@pytest.mark.slow
def test_tools_end_bad_input_in_one_sentence(args, message):
    result = _tool(*args)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# the planner
# ---------------------------------------------------------------------------------------------


def test_planner_refuses_sizes_beyond_64_bits():
    huge = [Alloc(id=f"t{k}", size=2**62) for k in range(3)]
    with pytest.raises(PlannerInputError, match="more than 2\\*\\*62"):
        Trace(events=huge)


def test_validate_refuses_negative_offsets():
    trace = Trace(events=[Alloc("a", 512), Alloc("b", 512), Free("a"), Free("b")])
    plan = Plan(offsets={"a": -512, "b": 0}, peak_bytes=512, lower_bound_bytes=1024, alignment=512)
    with pytest.raises(PlanValidationError, match="outside \\[0, 2\\*\\*62\\]"):
        validate(trace, plan)


class _Payload:
    """Unpickling this calls os.system: what a hostile snapshot would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_snapshot_pickles_cannot_run_code(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]], "x": _Payload(marker)}))
    result = _tool("tools.plan_memory", "--trace", str(path), "--out", str(tmp_path / "p.json"))
    assert result.returncode == 2 and "could run code" in result.stderr
    assert not marker.exists()


def test_plan_memory_names_a_layout_the_model_cannot_take(tmp_path, capsys):
    """Checked before megatron-core's TransformerConfig asserts it with a traceback."""
    from memo_ext.commands import plan_memory

    argv = ["--model", "gpt-7b", "--tensor-model-parallel-size", "3", "--seq-length", "1024"]
    assert plan_memory.main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "attention heads (32) not divisible by TP (3)" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["empty-bin", "text-idx", "idx-short-by-9", "idx-cut-to-12"])
def test_damaged_data_files_are_one_sentence_and_nothing_after(
    small_corpus, tmp_path, monkeypatch, damage
):
    """megatron-core's IndexedDataset.__del__ deletes what a failed __init__ never set: after
    the sentence, an "Exception ignored ... no attribute 'index'" would follow."""
    import gc
    import sys

    for suffix in (".bin", ".idx"):
        (tmp_path / f"c{suffix}").write_bytes(Path(small_corpus + suffix).read_bytes())
    idx = tmp_path / "c.idx"
    if damage == "empty-bin":
        (tmp_path / "c.bin").write_bytes(b"")
    elif damage == "text-idx":
        idx.write_text("hello\n")
    else:
        blob = idx.read_bytes()
        idx.write_bytes(blob[:-9] if damage == "idx-short-by-9" else blob[:12])
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    expected = r"c\.bin is empty" if damage == "empty-bin" else r"c\.idx is not a readable"
    with pytest.raises(UsageError, match=expected):
        parse_args(_data_args(str(tmp_path / "c"), "--split", "1,0,0"), world_size=1)
    gc.collect()
    assert unraisable == []


@pytest.mark.parametrize("damage", ["truncated-tokenizer-json", "garbage-vocab", "garbage-merges"])
def test_malformed_tokenizer_files_are_one_sentence(tmp_path, damage):
    """The tokenizers library's own exceptions (a parse error, a panic) become one sentence
    naming the files, exit 2."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    merges.write_text("#version: 0.2\na b\n")
    if damage == "garbage-vocab":
        vocab.write_text("garbage, not JSON")
    if damage == "garbage-merges":
        merges.write_text("#version: 0.2\nonly-one-token-on-this-line\n")
    flags = (
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
        if damage == "truncated-tokenizer-json"
        else ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    )
    named = "tokenizer.json is not a tokenizer.json" if "json" in damage else "are not a GPT-2"
    with pytest.raises(UsageError, match=named):
        parse_args([*BASE, *flags], world_size=1)


def test_load_pointed_at_a_file_says_so(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"weights")
    with pytest.raises(UsageError, match="model.pt is a file, not a directory; give the folder"):
        parse_args([*BASE, "--load", str(tmp_path / "model.pt")], world_size=1)


def test_a_save_writer_thread_dying_of_the_saves_error_prints_no_traceback(monkeypatch):
    """torch's checkpoint writer returns as soon as its own file fails, its other threads still
    writing; their deaths by the same full disk printed tracebacks (and torch's C++ "enforce
    fail" line) before the save's one sentence. Other errors of any thread still print."""
    import threading
    import time

    from memo_ext.training.checkpoint.writer import _quiet_about

    printed = []  # what the process's thread hook would print
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    full = OSError(28, "No space left on device")
    errors: list[Exception] = []

    def writer() -> None:
        time.sleep(0.2)  # still writing when the block's own work has failed
        errors.append(full)
        raise full

    with _quiet_about(errors):
        threading.Thread(target=writer).start()
    assert errors == [full] and printed == []

    def other() -> None:
        raise ValueError("a bug")

    with _quiet_about(errors):
        threading.Thread(target=other).start()
    assert [type(e) for e in printed] == [ValueError]
