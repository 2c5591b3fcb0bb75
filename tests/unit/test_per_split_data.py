"""Per-split data (Megatron-LM's --train-data-path, --valid-data-path, --test-data-path,
--data-args-path, --per-split-data-args-path): parsing, refusals, datasets and a short run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memo_ext.arguments import parse_args
from memo_ext.config import TokenizerSpec
from memo_ext.data.datasets import build_gpt_datasets
from memo_ext.data.preprocess import preprocess_jsonl
from memo_ext.data.tokenizers import ByteTokenizer
from memo_ext.errors import UsageError
from tests.launch import SMALL_GPT, run_pretrain

BASE = [a for a in SMALL_GPT if a != "--mock-data"]


def _corpus(root: Path, name: str, letter: str) -> str:
    """Twenty documents of 40-80 copies of ``letter`` (ByteTokenizer), no end-of-document id:
    every token of the corpus is ``ord(letter)``."""
    rng = np.random.default_rng(len(name))
    lines = [json.dumps({"text": letter * int(n)}) for n in rng.integers(40, 80, size=20)]
    (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    summary = preprocess_jsonl(
        input_path=root / f"{name}.jsonl",
        output_prefix=str(root / name),
        show_progress=False,
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    )
    return summary.prefixes["text"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("per_split")
    return {
        "train": _corpus(root, "train", "a"),
        "valid": _corpus(root, "valid", "b"),
        "test": _corpus(root, "test", "c"),
    }


def _parse(*argv: str, **kwargs):
    return parse_args([*BASE, *argv], world_size=1, **kwargs)


def test_per_split_paths_parse_without_a_split(corpora):
    run = _parse("--train-data-path", corpora["train"], "--valid-data-path", corpora["valid"])
    assert run.data.per_split and run.data.split is None and not run.data.data_path
    assert run.data.train_data_path == (corpora["train"],)
    assert run.data.valid_data_path == (corpora["valid"],)
    assert run.data.test_data_path == ()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data-path", "{train}"], "replace --data-path and --data-args-path; give one kind"),
        (["--split", "8,2,0"], "take no --split; drop --split"),
        (["--eval-interval", "1"], "take from --valid-data-path; give it, or drop --eval-interval"),
        (["--mock-data"], "give exactly one of --data-path"),
        (
            ["--variable-seq-lengths", "--micro-batch-size", "1", "--valid-data-path", "{valid}"],
            "reads --train-data-path only",
        ),
    ],
)
def test_mixes_are_refused_in_one_sentence(corpora, extra, message):
    extra = [a.format(**corpora) for a in extra]
    with pytest.raises(UsageError) as err:
        _parse("--train-data-path", corpora["train"], *extra)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_valid_without_train_is_refused(corpora):
    with pytest.raises(UsageError, match="per-split data paths need --train-data-path"):
        _parse("--valid-data-path", corpora["valid"])


def test_every_named_file_is_checked_at_parse_time(corpora, tmp_path):
    with pytest.raises(UsageError, match=r"nope_text_document\.bin does not exist"):
        _parse(
            "--train-data-path",
            corpora["train"],
            "--test-data-path",
            str(tmp_path / "nope_text_document"),
        )
    with pytest.raises(UsageError, match="--valid-data-path weights must be non-negative"):
        _parse("--train-data-path", corpora["train"], "--valid-data-path", "-1", corpora["valid"])


def test_data_args_path_is_read_into_data_path(corpora, tmp_path):
    listing = tmp_path / "blend.txt"
    listing.write_text(f"0.5 {corpora['train']}\n0.5 {corpora['valid']}\n")
    run = _parse("--data-args-path", str(listing), "--split", "8,2,0")
    assert run.data.data_path == ("0.5", corpora["train"], "0.5", corpora["valid"])
    assert run.data.data_args_path is None
    with pytest.raises(UsageError, match="give --data-path or --data-args-path, not both"):
        _parse("--data-args-path", str(listing), "--data-path", corpora["train"])
    with pytest.raises(UsageError, match=r"--data-args-path .*missing\.txt cannot be read"):
        _parse("--data-args-path", str(tmp_path / "missing.txt"))
    binary = tmp_path / "blend.bin"
    binary.write_bytes(b"\x00\x01 prefix")  # valid UTF-8, no text: named, not echoed
    with pytest.raises(UsageError, match=r"--data-args-path .*blend\.bin holds control characters"):
        _parse("--data-args-path", str(binary))


def test_per_split_json_is_read_into_the_three_paths(corpora, tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(
        json.dumps({"train": [corpora["train"]], "valid": corpora["valid"], "test": []})
    )
    run = _parse("--per-split-data-args-path", str(path), "--eval-interval", "5")
    assert run.data.train_data_path == (corpora["train"],)
    assert run.data.valid_data_path == (corpora["valid"],)  # a string is split, as Megatron-LM
    assert run.data.test_data_path == () and run.data.per_split_data_args_path is None
    path.write_text(json.dumps({"train": [corpora["train"]]}))
    with pytest.raises(UsageError, match="--valid-data-path"):
        _parse("--per-split-data-args-path", str(path), "--eval-interval", "5")
    with pytest.raises(UsageError, match="not both"):
        _parse("--per-split-data-args-path", str(path), "--train-data-path", corpora["train"])
    path.write_text("{not json")
    with pytest.raises(UsageError, match="is not valid JSON"):
        _parse("--per-split-data-args-path", str(path))


def test_packed_documents_read_the_train_path(corpora):
    from memo_ext.data.documents import document_source

    run = _parse(
        "--train-data-path", corpora["train"], "--variable-seq-lengths", "--micro-batch-size", "1"
    )
    source = document_source(run.data, run.train, vocab_size=257)
    assert len(source) == 20 and set(source.document(3).tolist()) == {ord("a")}


def test_each_split_samples_only_its_own_prefix(corpora):
    train, valid, test = build_gpt_datasets(
        data_path=None,
        split=None,
        mock=False,
        seq_length=16,
        seed=1234,
        tokenizer=ByteTokenizer(),
        num_samples=(200, 40, 0),
        blend_per_split=([corpora["train"]], [corpora["valid"]], []),
    )
    assert test is None  # no test blend: megatron-core builds no test split
    assert len(train) >= 200 and len(valid) >= 40
    # every document of a corpus is one repeated letter: a sample shows which corpus it is from
    for dataset, letter in ((train, "a"), (valid, "b")):
        tokens = np.concatenate([dataset[i]["tokens"].numpy() for i in range(len(dataset))])
        assert set(tokens.tolist()) == {ord(letter)}


def _two_steps(train: str, valid: str, *, workdir: Path, name: str) -> list[dict]:
    return run_pretrain(
        [
            *BASE,
            *("--train-iters", "2", "--global-batch-size", "2", "--num-workers", "0"),
            *("--train-data-path", train, "--valid-data-path", valid),
            *("--eval-interval", "1", "--eval-iters", "1"),
        ],
        nproc=1,
        workdir=workdir,
        name=name,
    )


def test_two_steps_train_and_evaluate_on_their_own_prefixes(corpora, tmp_path):
    own = _two_steps(corpora["train"], corpora["valid"], workdir=tmp_path, name="own")
    assert [r["iteration"] for r in own] == [1, 2]
    assert all("val_loss" in r for r in own)
    # reference: the same run validating on the training corpus. Steps on all-"a" text make "a"
    # likelier: the loss on "a" text falls and the loss on all-"b" text rises
    same = _two_steps(corpora["train"], corpora["train"], workdir=tmp_path, name="same")
    assert [r["loss"] for r in own] == [r["loss"] for r in same]  # training does not change
    assert same[1]["val_loss"] < same[0]["val_loss"]
    assert own[1]["val_loss"] > own[0]["val_loss"]
