"""tools/preprocess_data.py: round trips through megatron-core's IndexedDataset, errors, workers."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from memo_ext.commands.preprocess_data import main
from memo_ext.config import TokenizerSpec
from memo_ext.data import preprocess
from memo_ext.data.preprocess import preprocess_jsonl
from memo_ext.data.tokenizers import ByteTokenizer, NullTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

TEXTS = ["first document", "", "ünïcödé 🌍 and\nnewlines", "x" * 1000, "last"]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _read_documents(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def _run(input_path: Path, prefix: Path, *extra: str) -> int:
    argv = ["--input", str(input_path), "--output-prefix", str(prefix), "--no-progress"]
    return main([*argv, "--tokenizer-type", "ByteTokenizer", *extra])


@pytest.mark.parametrize("append_eod", [False, True])
def test_round_trip_equals_tokenized_text(tmp_path, append_eod):
    source = _write_jsonl(
        tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)]
    )
    assert _run(source, tmp_path / "out", *(["--append-eod"] if append_eod else [])) == 0

    tokenizer = ByteTokenizer()
    # Empty texts are skipped; eod is appended to the others when asked.
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] * append_eod for t in TEXTS if t]
    documents = _read_documents(str(tmp_path / "out_text_document"))
    assert documents == expected
    assert [tokenizer.detokenize(d) for d in documents] == [t for t in TEXTS if t]


def test_one_output_per_json_key_and_null_tokenizer(tmp_path):
    records = [{"a": "1 2 3", "b": "9"}, {"a": "4", "b": "0 0"}]
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "n"), "--no-progress"]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--json-keys", "a", "b"]
    assert main([*argv, "--append-eod"]) == 0
    assert _read_documents(str(tmp_path / "n_a_document")) == [[1, 2, 3, 10], [4, 10]]
    assert _read_documents(str(tmp_path / "n_b_document")) == [[9, 10], [0, 0, 10]]


@pytest.mark.slow
def test_workers_give_identical_files(tmp_path):
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcé🌍 \n"), size=rng.integers(0, 50))) for _ in range(300)]
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert _run(source, tmp_path / "one", "--append-eod") == 0
    assert (
        _run(source, tmp_path / "two", "--append-eod", "--workers", "2", "--chunk-size", "7") == 0
    )
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{suffix}").read_bytes()
        two = (tmp_path / f"two_text_document{suffix}").read_bytes()
        assert one == two


def test_workers_tokenize_with_the_tokenizer_loaded_here(tmp_path, monkeypatch):
    """Workers are forked with this process's modules and tokenizer: none imports torch and
    megatron-core or loads the tokenizer again (seconds each, longer than a small corpus takes)."""
    monkeypatch.setattr(NullTokenizer, "tokenize", lambda self, text: [os.getpid()])
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "not ids"}] * 40)
    summary = preprocess_jsonl(
        input_path=source,
        output_prefix=str(tmp_path / "w"),
        workers=2,
        chunk_size=4,
        show_progress=False,
        tokenizer=TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=2**23),
    )
    pids = {document[0] for document in _read_documents(summary.prefixes["text"])}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


class _RecordedBar(preprocess.tqdm):
    """The progress bar, recording (elapsed s, ETA s) whenever it is drawn with a rate."""

    drawn: list[tuple[float, float]] = []

    def display(self, *args, **kwargs):
        shown = self.format_dict
        rate = shown["rate"] or (shown["n"] / shown["elapsed"] if shown["elapsed"] else 0)
        if rate and shown["n"] < shown["total"]:
            self.drawn.append((shown["elapsed"], (shown["total"] - shown["n"]) / rate))
        return super().display(*args, **kwargs)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_eta_is_a_fair_guess_from_the_first_draw(tmp_path, monkeypatch, capsys, workers):
    """Lines of 10 ms in batches of 12 (0.12 s, above tqdm's 0.1 s between draws): an ETA drawn
    when the first batch arrives, from one line's bytes (or after the workers' start-up, from
    one line), would be ten to thousands of times the whole run."""

    def slow_bytes(self, text):
        time.sleep(0.01)
        return list(text.encode())

    monkeypatch.setattr(ByteTokenizer, "tokenize", slow_bytes)
    monkeypatch.setattr(preprocess, "tqdm", _RecordedBar)
    monkeypatch.setattr(_RecordedBar, "drawn", [])
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "x" * 100}] * 120)
    summary = preprocess_jsonl(
        input_path=source,
        output_prefix=str(tmp_path / "e"),
        workers=workers,
        chunk_size=12,
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    )
    assert _RecordedBar.drawn, "the bar was never drawn with a rate"
    for elapsed, eta in _RecordedBar.drawn:
        # the run's lines sleep; with other work on the machine a batch may come late, hence x3
        assert elapsed + eta < 3 * summary.seconds + 1.0, _RecordedBar.drawn


@pytest.mark.slow
@pytest.mark.launch  # the script as users run it
def test_subprocess_run_prints_summary(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}, {"text": "world!"}])
    command = [sys.executable, "tools/preprocess_data.py", "--input", str(source)]
    command += ["--output-prefix", str(tmp_path / "sub"), "--tokenizer-type", "ByteTokenizer"]
    result = subprocess.run(
        command + ["--append-eod"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "2 documents, 13 tokens" in result.stdout
    assert _read_documents(str(tmp_path / "sub_text_document"))[1] == list(b"world!") + [256]


def test_missing_input_file(tmp_path, capsys):
    assert _run(tmp_path / "nope.jsonl", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "nope.jsonl does not exist" in err and err.count("\n") == 1


def test_bad_json_line_names_its_line_number(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "ok"}\n\n{"text": broken}\n')
    assert _run(source, tmp_path / "out") == 2
    assert "Line 3 of the input is not valid JSON" in capsys.readouterr().err
    # No partial outputs are left behind.
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.slow
def test_bad_json_line_in_a_worker(tmp_path, capsys):
    lines = [json.dumps({"text": str(i)}) for i in range(20)] + ["[1, 2]"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert _run(tmp_path / "in.jsonl", tmp_path / "out", "--workers", "2") == 2
    assert "Line 21 of the input is a JSON list, not an object" in capsys.readouterr().err


def test_missing_key(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"body": "b"}])
    assert _run(source, tmp_path / "out") == 2
    assert "Line 2 of the input has no key 'text' (keys: body)" in capsys.readouterr().err


def test_an_output_prefix_under_a_file_is_one_sentence(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n')
    (tmp_path / "afile").write_text("")
    assert _run(source, tmp_path / "afile" / "out") == 2
    err = capsys.readouterr().err
    assert "afile is a file, not a directory" in err and err.count("\n") == 1


@pytest.mark.parametrize("bad", ["workers-two", "fifo-input"])
def test_argument_errors_are_one_sentence_without_a_usage_dump(tmp_path, capsys, bad):
    import os

    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n')
    if bad == "fifo-input":
        source = tmp_path / "pipe"
        os.mkfifo(source)  # reading it would wait for a writer forever
        extra = []
    else:
        extra = ["--workers", "two"]
    assert _run(source, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 1
    assert ("not a regular file" if bad == "fifo-input" else "invalid int value: 'two'") in err


def test_ctrl_c_on_two_workers_is_one_line_and_leaves_no_partial_output(tmp_path):
    """The terminal's SIGINT reaches the whole process group: the workers leave it to the
    parent, which removes its unfinished files, says so once and exits 130."""
    import signal

    corpus = tmp_path / "big.jsonl"
    with corpus.open("w") as f:
        for i in range(300_000):
            f.write(json.dumps({"text": "some words to tokenize " * 20 + str(i)}) + "\n")
    out = tmp_path / "out"
    job = subprocess.Popen(
        [sys.executable, "-m", "tools.preprocess_data", "--input", str(corpus),
         "--output-prefix", str(out / "c"), "--tokenizer-type", "ByteTokenizer",
         "--workers", "2", "--no-progress"],
        cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    # documents written: the workers are up and tokenizing
    written = lambda: any(p.stat().st_size for p in out.glob("*.bin.tmp"))  # noqa: E731
    while not written() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, "the tokenizing finished before it could be interrupted"
    os.killpg(job.pid, signal.SIGINT)
    try:
        _, err = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGABRT)  # the faulthandler prints where every thread waits
        _, err = job.communicate(timeout=30)
        raise AssertionError(f"no exit within 60 s of Ctrl-C:\n{err[-6000:]}") from None
    assert job.returncode == 130, err
    assert err.strip().splitlines() == [
        "memo-preprocess-data: interrupted; nothing written (the unfinished files are removed, any "
        f"earlier {out / 'c'}_* output is as it was)"
    ]
    assert list(out.iterdir()) == []
