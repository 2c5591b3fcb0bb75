"""JSON Lines → megatron-core ``IndexedDataset`` files (``{prefix}_{key}_document.bin`` /
``.idx``), optionally on a pool of forked workers: what ``memo-preprocess-data`` and the demo
corpus run."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizerBase
from tqdm import tqdm

from memo_ext.config.data import TokenizerSpec
from memo_ext.data.tokenizers import build_tokenizer
from memo_ext.errors import UsageError

logger = logging.getLogger(__name__)


@dataclass
class PreprocessSummary:
    """What ``preprocess_jsonl`` wrote."""

    documents: int
    """Non-blank JSON lines read."""
    tokens: int
    """Tokens written, summed over all JSON keys (end-of-document ids included)."""
    seconds: float
    """Wall-clock time of the whole run."""
    prefixes: dict[str, str] = field(default_factory=dict)
    """Output data prefix per JSON key, ready for ``--data-path``."""
    empty_documents: int = 0
    """(line, key) pairs whose text had no tokens; they are not written."""
    tokenless_texts: int = 0
    """Of ``empty_documents``: texts with more than white space that the tokenizer turned into
    no tokens (a vocabulary that does not cover them)."""


def document_prefix(output_prefix: str, json_key: str) -> str:
    """Megatron-LM's output naming: ``{output_prefix}_{json_key}_document``."""
    return f"{output_prefix}_{json_key}_document"


@dataclass(frozen=True)
class _Encoder:
    """What tokenizes a JSON line: built once, in the main process, before any worker forks."""

    tokenizer: MegatronTokenizerBase
    json_keys: tuple[str, ...]
    append_eod: bool
    dtype: type
    """The output's id type: workers send back 2 bytes per id for a small vocabulary, not 8."""


class _EncodedLine(NamedTuple):
    nbytes: int
    """The line's size in bytes (for the progress bar)."""
    ids: dict[str, np.ndarray] | None
    """Token ids per JSON key; ``None`` for a blank line."""
    tokenless_texts: int
    """Texts of this line with more than white space that gave no tokens."""


# The encoder of a running ``_encoding``; forked workers inherit it with the loaded tokenizer.
_ENCODER: _Encoder | None = None


def _parse_line(line_no: int, raw: bytes) -> dict:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"Line {line_no} of the input is not valid JSON ({err}).") from None
    if not isinstance(record, dict):
        raise ValueError(
            f"Line {line_no} of the input is a JSON {type(record).__name__}, not an object."
        )
    return record


def _encode_line(item: tuple[int, bytes]) -> _EncodedLine:
    """Tokenize the configured keys of one JSON line with ``_ENCODER``."""
    line_no, raw = item
    if not raw.strip():
        return _EncodedLine(len(raw), None, 0)
    record = _parse_line(line_no, raw)
    tokenizer = _ENCODER.tokenizer
    encoded, tokenless = {}, 0
    for key in _ENCODER.json_keys:
        if key not in record:
            raise ValueError(
                f"Line {line_no} of the input has no key {key!r} (keys: {', '.join(record)}); "
                f"pass --json-keys with keys that every line has."
            )
        text = record[key]
        if not isinstance(text, str):
            raise ValueError(f"Line {line_no}: value of {key!r} must be a string.")
        ids = tokenizer.tokenize(text)
        tokenless += not ids and bool(text.strip())
        if ids and _ENCODER.append_eod:
            ids.append(tokenizer.eod)
        encoded[key] = np.asarray(ids, dtype=_ENCODER.dtype)
    return _EncodedLine(len(raw), encoded, tokenless)


def _encode_batch(batch: list[tuple[int, bytes]]) -> list[_EncodedLine]:
    return [_encode_line(item) for item in batch]


def _read_batches(path: Path, *, lines_per_batch: int) -> Iterator[list[tuple[int, bytes]]]:
    """Yield lists of (1-based line number, raw line), blank lines included."""
    with open(path, "rb") as handle:
        numbered = enumerate(handle, start=1)
        while batch := list(itertools.islice(numbered, lines_per_batch)):
            yield batch


class _AtomicIndexedWriter:
    """An ``IndexedDatasetBuilder`` that writes to temporary names and renames on ``close``."""

    def __init__(self, prefix: str, dtype: type) -> None:
        self.prefix = prefix
        self._tmp_bin = f"{prefix}.bin.tmp"
        self._tmp_idx = f"{prefix}.idx.tmp"
        self._builder = IndexedDatasetBuilder(self._tmp_bin, dtype=dtype)

    def add(self, ids: np.ndarray) -> None:
        """Append one document made of one sequence."""
        self._builder.add_document(ids, [int(ids.size)])

    def abort(self) -> None:
        """Close and delete the temporary files (after an error)."""
        self._builder.data_file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        """Write the index and move both files to their final names."""
        self._builder.finalize(self._tmp_idx)
        os.replace(self._tmp_bin, f"{self.prefix}.bin")
        os.replace(self._tmp_idx, f"{self.prefix}.idx")


class _Workers:
    """``workers`` forked tokenizer processes, each with a pipe of its own; batch ``j`` goes to
    worker ``j % workers``, which holds one batch at a time, so results come back in input order.

    Not ``multiprocessing.Pool``: its ``terminate`` first takes the task queue's read lock, which
    a worker holds while it waits for a task, and a pool stopped by Ctrl-C under load could wait
    on it forever. Here the workers share no lock: stopping them is a kill and a join.

    The workers ignore Ctrl-C from birth (the terminal sends it to every process of the group):
    the parent alone stops, removes its unfinished files and the workers, instead of one
    traceback per worker. A Ctrl-C that comes while they start stops the parent once they are up.
    """

    def __init__(self, workers: int):
        context = multiprocessing.get_context("fork")
        self.pipes, self.processes = [], []
        main = threading.current_thread() is threading.main_thread()
        pending: list[int] = []
        if main:  # only the main thread handles signals; the forks keep SIG_IGN
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
        try:
            for _ in range(workers):
                ours, theirs = context.Pipe()
                process = context.Process(target=_serve, args=(theirs,), daemon=True)
                process.start()
                theirs.close()
                self.pipes.append(ours)
                self.processes.append(process)
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        if pending:
            self.stop()
            raise KeyboardInterrupt

    def imap(self, batches: Iterable[list[tuple[int, bytes]]]) -> Iterator[list[_EncodedLine]]:
        """The encoded batches, in input order, one batch per worker in flight."""
        batches = iter(batches)
        in_flight = 0
        for worker, batch in enumerate(itertools.islice(batches, len(self.pipes))):
            self.pipes[worker].send(batch)
            in_flight += 1
        worker = 0
        while in_flight:
            yield self._receive(worker)
            batch = next(batches, None)
            if batch is None:
                in_flight -= 1
            else:  # the worker is idle now: the send cannot wait on it
                self.pipes[worker].send(batch)
            worker = (worker + 1) % len(self.pipes)

    def _receive(self, worker: int) -> list[_EncodedLine]:
        try:
            result = self.pipes[worker].recv()
        except EOFError:
            process = self.processes[worker]
            process.join(timeout=5)
            raise RuntimeError(
                f"tokenizer worker {worker} stopped (exit code {process.exitcode}); run with "
                "--workers 1 to see its error"
            ) from None
        if isinstance(result, Exception):
            raise result
        return result

    def stop(self) -> None:
        """Kill and reap every worker (nothing of theirs is kept)."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()
        for pipe in self.pipes:
            pipe.close()


def _serve(pipe) -> None:
    """A worker: encode each batch the pipe brings until the parent closes it; a batch that
    fails sends its exception back, for the parent to raise."""
    while True:
        try:
            batch = pipe.recv()
        except EOFError:
            return
        try:
            result = _encode_batch(batch)
        except Exception as err:  # noqa: BLE001 - raised again in the parent
            result = err
        pipe.send(result)


@contextlib.contextmanager
def _encoding(
    encoder: _Encoder, batches: Iterable[list[tuple[int, bytes]]], *, workers: int
) -> Iterator[Iterator[list[_EncodedLine]]]:
    """The encoded batches of lines, in input order: tokenized here, or on ``workers`` forked
    processes that are up when this context is entered.

    A worker takes a whole batch and returns it whole, so the progress bar advances by the
    bytes of a batch at once; advanced by one line when a batch arrives, its first rate would
    be one line's bytes over a whole batch's time (an ETA a hundred times too long).

    Forked, not spawned: a spawned worker imports torch and megatron-core again and loads the
    tokenizer again, seconds each before its first line (a small corpus took three times as
    long on two workers as on one); a forked one starts in milliseconds with all of it in memory.
    """
    global _ENCODER
    _ENCODER = encoder
    try:
        if workers <= 1:
            yield map(_encode_batch, batches)
        else:
            pool = _Workers(workers)
            try:
                yield pool.imap(batches)
            finally:
                pool.stop()
    finally:
        _ENCODER = None


def preprocess_jsonl(
    *,
    input_path: str | Path,
    output_prefix: str,
    tokenizer: TokenizerSpec,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    chunk_size: int = 256,
    show_progress: bool = True,
) -> PreprocessSummary:
    """Tokenize a JSON Lines file into one megatron-core indexed dataset per JSON key.

    Each non-blank line is one document; documents keep the input order for any ``workers``.

    Args:
        input_path: The ``.jsonl`` file; each line a JSON object holding ``json_keys``.
        output_prefix: Outputs go to ``{output_prefix}_{key}_document.bin`` / ``.idx``.
        tokenizer: The tokenizer (``memo_ext.data.tokenizers.build_tokenizer``).
        json_keys: The keys to tokenize, one output dataset each.
        append_eod: Append the end-of-document id to every non-empty document.
        workers: Number of forked tokenizer processes (1 tokenizes in this process).
        chunk_size: Lines sent to a worker at a time (and between updates of the progress bar).
        show_progress: Show a tqdm progress bar over input bytes.

    Returns:
        Counts, timing and the output prefixes.

    Raises:
        FileNotFoundError: The input file does not exist.
        UsageError: No text under ``json_keys``, or a tokenizer that gave no token for any of it.
        ValueError: A line is not a JSON object, lacks a key, or has text the tokenizer rejects.
    """
    start = time.perf_counter()
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(
            f"Input file {input_path} does not exist; pass --input an existing .jsonl file."
        )
    built = build_tokenizer(tokenizer)
    dtype = DType.optimal_dtype(built.vocab_size)
    encoder = _Encoder(built, tuple(json_keys), append_eod, dtype)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    writers = {
        key: _AtomicIndexedWriter(document_prefix(output_prefix, key), dtype) for key in json_keys
    }
    summary = PreprocessSummary(documents=0, tokens=0, seconds=0.0)
    batches = _read_batches(input_path, lines_per_batch=chunk_size)
    try:
        # the bar starts once the workers are up: their start-up stays out of its rate and ETA
        with (
            _encoding(encoder, batches, workers=workers) as encoded_batches,
            _progress_bar(input_path, show=show_progress) as progress,
        ):
            for batch in encoded_batches:
                for line in batch:
                    _write_document(writers, line, summary)
                progress.update(sum(line.nbytes for line in batch))
        if summary.tokens == 0:
            raise UsageError(_nothing_to_write(summary, input_path, encoder))
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.close()
    summary.prefixes = {key: writer.prefix for key, writer in writers.items()}
    summary.seconds = time.perf_counter() - start
    return summary


def _progress_bar(input_path: Path, *, show: bool) -> tqdm:
    return tqdm(
        total=input_path.stat().st_size,
        unit="B",
        unit_scale=True,
        disable=not show,
        desc=f"tokenizing {input_path.name}",
    )


def _write_document(
    writers: dict[str, _AtomicIndexedWriter], line: _EncodedLine, summary: PreprocessSummary
) -> None:
    if line.ids is None:  # a blank line
        return
    summary.documents += 1
    summary.tokenless_texts += line.tokenless_texts
    for key, ids in line.ids.items():
        if ids.size == 0:
            summary.empty_documents += 1
            continue
        writers[key].add(ids)
        summary.tokens += int(ids.size)


def _nothing_to_write(summary: PreprocessSummary, input_path: Path, encoder: _Encoder) -> str:
    """Why a run wrote no token: no text under the keys, or a tokenizer that drops all of it."""
    keys = " ".join(encoder.json_keys)
    if summary.tokenless_texts:
        return (
            f"{encoder.tokenizer.description} produced no tokens for any of the "
            f"{summary.tokenless_texts} texts under --json-keys {keys} in {input_path}: its "
            "vocabulary does not cover them and has no unknown token; give the tokenizer made "
            "for this corpus"
        )
    return (
        f"{input_path} holds no document with text under --json-keys {keys}; nothing to write, "
        "so give --json-keys the key that holds the text"
    )
