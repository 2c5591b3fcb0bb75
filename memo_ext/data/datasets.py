"""Training data: JSON Lines → indexed datasets, GPT dataset splits, and the micro-batch order.

Three stages, each usable on its own:

1. ``preprocess_jsonl`` tokenizes a JSON Lines corpus into megatron-core ``IndexedDataset`` files
   (``{prefix}_{key}_document.bin`` / ``.idx``), optionally on a pool of forked workers. The
   ``tools/preprocess_data.py`` command line and the demo corpus both call it.
2. ``build_gpt_datasets`` turns ``--data-path`` / ``--split`` / ``--mock-data`` into train, valid
   and test ``GPTDataset`` s with megatron-core's ``BlendedMegatronDatasetBuilder``.
3. ``build_batch_iterator`` walks one dataset in a fixed global order and hands every
   data-parallel rank its own micro-batches.

Sampling order contract (what resume and DP-size changes rely on): the global sample order is
``consumed_samples, consumed_samples + 1, ...``. Micro-batch ``i`` of data-parallel rank ``r`` holds
the samples ``consumed_samples + (i * dp + r) * mbs + [0, mbs)``. Hence the ``dp * mbs`` samples of
one micro-step, and the ``global_batch_size`` samples of one optimizer step (``gbs / (dp * mbs)``
micro-steps), are the same contiguous block of the global order whatever the DP size; only their
assignment to ranks changes. This is the order of Megatron-LM's ``MegatronPretrainingSampler``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizerBase
from tqdm import tqdm

from memo_ext.config.data import TokenizerSpec, check_split
from memo_ext.data.tokenizers import build_tokenizer
from memo_ext.errors import UsageError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# 1. JSON Lines → indexed dataset
# ---------------------------------------------------------------------------------------------


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
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                yield pool.imap(_encode_batch, batches)
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


# ---------------------------------------------------------------------------------------------
# 2. GPT dataset splits
# ---------------------------------------------------------------------------------------------


def parse_blend(
    data_path: Sequence[str], *, flag: str = "--data-path"
) -> tuple[list[str], list[float] | None]:
    """Parse Megatron's ``--data-path`` blend syntax.

    Args:
        data_path: Either prefixes (``["a", "b"]``, blended in proportion to their sizes) or
            alternating weights and prefixes (``["0.7", "a", "0.3", "b"]``).
        flag: The flag the list came from, for the error messages.

    Returns:
        The prefixes and their weights (``None`` when none were given), as megatron-core's
        ``get_blend_from_list`` reads them.

    Raises:
        ValueError: The list is empty or a weight is negative or all weights are zero.
    """
    if not data_path:
        raise ValueError(f"{flag} is empty; give at least one dataset prefix.")
    prefixes, weights = get_blend_from_list(list(data_path))
    numbers = [p for p in prefixes if _is_number(p) and not os.path.isfile(p + ".bin")]
    if weights is None and numbers:
        raise ValueError(
            f"{flag} reads {numbers[0]} as a dataset prefix: weights and prefixes go in "
            f"pairs (0.7 a 0.3 b), or give prefixes only; got {len(data_path)} items."
        )
    if weights is not None and not all(math.isfinite(w) for w in weights):
        raise ValueError(f"{flag} weights must be finite numbers, got {weights}.")
    if weights is not None and (min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"{flag} weights must be non-negative with a positive sum, got {weights}.")
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_files(prefixes: Iterable[str]) -> None:
    """Raise ``FileNotFoundError`` naming the first missing ``.bin`` / ``.idx`` file."""
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise FileNotFoundError(
                    f"Dataset file {prefix + suffix} does not exist; create it with "
                    f"tools/preprocess_data.py or fix --data-path."
                )


def check_indexed_dataset(prefix: str) -> int:
    """Open ``prefix``'s index and check that its ``.bin`` holds every token the index lists;
    returns the number of documents.

    A garbage ``.idx`` or a truncated ``.bin`` would otherwise pass start-up and fail inside a
    training step.

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    check_data_files([prefix])
    if os.path.getsize(prefix + ".bin") == 0:
        raise ValueError(
            f"{prefix}.bin is empty (no tokens); make it again with tools/preprocess_data.py"
        )
    dataset = IndexedDataset.__new__(IndexedDataset)
    try:
        dataset.__init__(prefix)
    except Exception as err:  # noqa: BLE001 - megatron's reader fails in many ways on bad bytes
        # its __del__ deletes what a failed __init__ never set, and says so on stderr
        dataset.__dict__.setdefault("bin_reader", None)
        dataset.__dict__.setdefault("index", None)
        raise ValueError(
            f"{prefix}.idx is not a readable megatron-core index ({type(err).__name__}: "
            f"{str(err)[:200]}); make it again with tools/preprocess_data.py"
        ) from None
    index = dataset.index
    expected = int(index.sequence_lengths.sum(dtype=np.int64)) * index.dtype_size
    actual = os.path.getsize(prefix + ".bin")
    if actual < expected:
        raise ValueError(
            f"{prefix}.bin holds {actual} bytes but its index lists {expected} (a truncated "
            "copy?); copy it again or make it again with tools/preprocess_data.py"
        )
    if actual > expected:
        raise ValueError(
            f"{prefix}.bin holds {actual} bytes but its index lists {expected}: the .bin and "
            ".idx are not one pair (another corpus's index?); make both again with "
            "tools/preprocess_data.py"
        )
    return len(dataset.document_indices) - 1


SPLIT_PARTS = ("train", "validation", "test")
"""The parts of ``--split``, in its order."""


def _documents_per_part(split: str, documents: int) -> list[int | None]:
    """How many of ``documents`` each part of ``split`` gets (megatron-core's rounding); ``None``
    for a part of weight 0."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None
        if bounds is None
        else int(round(bounds[1] * documents)) - int(round(bounds[0] * documents))
        for bounds in matrix
    ]


def check_split_documents(prefix: str, split: str, *, documents: int) -> None:
    """Every part of ``--split`` with a weight must get at least one document of ``prefix``:
    megatron-core loops forever on an empty part.

    Raises:
        ValueError: naming the part and the counts.
    """
    for name, count in zip(SPLIT_PARTS, _documents_per_part(split, documents)):
        if count is not None and count < 1:
            raise ValueError(
                f"--split {split} gives the {name} part 0 of the {documents} documents in "
                f"{prefix}; give that part weight 0 (or more weight), or use more documents"
            )


def fit_split(split: str, documents: Sequence[int], *, keep_validation: bool) -> str:
    """``split`` with the parts that a dataset of ``documents`` would leave without a document
    set to weight 0: the test part, then the validation part unless ``keep_validation``.

    Args:
        split: The default ``--split``, such as ``"969,30,1"``.
        documents: The document count of every dataset of the blend.
        keep_validation: Evaluation reads the validation part: it is never dropped (a part
            still empty is then refused by :func:`check_split_documents`).

    Returns:
        The split, part for part as ``split`` except the dropped parts, which read ``0``.
    """
    weights = [part.strip() for part in split.split(",")]
    droppable = (2,) if keep_validation else (2, 1)
    for part in droppable:
        if part >= len(weights):
            continue
        counts = [_documents_per_part(",".join(weights), n)[part] for n in documents]
        if any(count is not None and count < 1 for count in counts):
            weights[part] = "0"
    return ",".join(weights)


def _check_blend_cache(*, prefixes: list[str], cache_dir: str | None) -> None:
    """megatron-core 0.16's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` when it
    writes its cache, which fails without a process group."""
    if cache_dir is not None and len(prefixes) > 1 and not torch.distributed.is_initialized():
        raise ValueError(
            "A --data-path blend of several datasets with --data-cache-path needs "
            "torch.distributed to be initialized (megatron-core's BlendedDataset asks for the "
            "rank); launch with torchrun or drop --data-cache-path."
        )


def _build_on_every_rank() -> bool:
    return True


def build_gpt_datasets(
    *,
    data_path: list[str] | None,
    split: str | None,
    mock: bool,
    seq_length: int,
    seed: int,
    tokenizer: MegatronTokenizerBase,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] = _build_on_every_rank,
    mmap_bin_files: bool = True,
    create_attention_mask: bool = False,
    blend_per_split: Sequence[Sequence[str]] | None = None,
) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """Build the train, valid and test datasets with megatron-core's blended dataset builder.

    Works in a single process and under an initialized ``torch.distributed`` group: megatron-core
    then builds on rank 0 first (writing the index cache), waits on a barrier, and the other
    ranks load the cached indices. Call it on every rank.

    Args:
        data_path: ``--data-path`` in Megatron's blend syntax (see ``parse_blend``).
        split: ``--split``, e.g. ``"969,30,1"``; a split with weight 0 is returned as ``None``.
            megatron-core ignores it for mock data (always ``"1,1,1"``). ``None`` with
            ``blend_per_split``.
        mock: ``--mock-data``: synthetic documents, ``data_path`` must be ``None``. A mock split
            holds about a million samples whatever ``num_samples`` asks for.
        seq_length: ``--seq-length``; every sample has this many tokens (labels shifted by one).
        seed: ``--seed``; fixes the document and sample shuffles.
        tokenizer: From ``build_tokenizer``; its ``eod`` / ``pad`` ids enter the samples.
        num_samples: Samples wanted from (train, valid, test); data repeats in epochs if needed.
        cache_dir: ``--data-cache-path`` for the shuffle indices; ``None`` lets megatron-core use
            ``{prefix}/cache`` next to the data (mock data is then not cached).
        is_built_on_rank: Returns False on ranks that need no data (they get ``None``).
        mmap_bin_files: ``--no-mmap-bin-files`` turns it off: samples are read with file reads.
        create_attention_mask: Each sample also holds megatron's causal ``attention_mask``
            ``[1, s, s]`` (bool, True = masked), one tensor shared by all samples.
        blend_per_split: ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``,
            each a blend used whole (megatron-core's ``blend_per_split``); an empty one gives
            ``None`` for its split. Replaces ``data_path`` and ``split``.

    Returns:
        ``(train, valid, test)``.

    Raises:
        ValueError: Inconsistent flags, a bad ``--split`` or a bad blend.
        FileNotFoundError: A ``.bin`` / ``.idx`` file of the blend is missing.
    """
    if mock + (data_path is not None) + (blend_per_split is not None) != 1:
        raise ValueError("Pass exactly one of --data-path, per-split paths and --mock-data.")
    blend = per_split = None
    if blend_per_split is not None:
        per_split = _parse_blend_per_split(blend_per_split, cache_dir=cache_dir)
        split = None
    else:
        check_split(split)
    if data_path is not None:
        blend = parse_blend(data_path)
        check_data_files(blend[0])
        _check_blend_cache(prefixes=blend[0], cache_dir=cache_dir)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
    )
    dataset_cls = MockGPTDataset if mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls, list(num_samples), is_built_on_rank, config
    )
    with _quiet_uncached_mock(mock and cache_dir is None):
        train, valid, test = builder.build()
    return train, valid, test


PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
"""The flags of megatron-core's ``blend_per_split``, in its order."""


def _parse_blend_per_split(
    blends: Sequence[Sequence[str]], *, cache_dir: str | None
) -> list[tuple[list[str], list[float] | None] | None]:
    """megatron-core's ``blend_per_split``: a parsed blend per split, ``None`` for an empty one."""
    if len(blends) != len(PER_SPLIT_FLAGS):
        raise ValueError(f"blend_per_split needs one blend per split, got {len(blends)}.")
    parsed = []
    for flag, blend in zip(PER_SPLIT_FLAGS, blends):
        if not blend:
            parsed.append(None)
            continue
        parsed.append(parse_blend(blend, flag=flag))
        check_data_files(parsed[-1][0])
        _check_blend_cache(prefixes=parsed[-1][0], cache_dir=cache_dir)
    return parsed


@contextlib.contextmanager
def _quiet_uncached_mock(quiet: bool) -> Iterator[None]:
    """Without --data-cache-path, megatron-core warns per mock split that it cannot save the
    split's indexes: mock data has nothing worth caching, so the warnings say nothing."""
    if not quiet:
        yield
        return
    mcore_logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    level = mcore_logger.level
    mcore_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        mcore_logger.setLevel(level)


# ---------------------------------------------------------------------------------------------
# 3. Micro-batches in a fixed global order
# ---------------------------------------------------------------------------------------------


def micro_batch_indices(
    *,
    num_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
) -> Iterator[list[int]]:
    """Yield this rank's micro-batches as lists of global sample indices.

    Micro-batch ``i`` of rank ``r`` is ``consumed_samples + (i * dp + r) * mbs + [0, mbs)``.
    Iteration stops before the first micro-step whose ``dp * mbs`` samples are not all in the
    dataset, so every rank yields the same number of micro-batches.
    """
    if micro_batch_size < 1 or data_parallel_size < 1:
        raise ValueError(
            f"micro_batch_size and data_parallel_size must be positive, "
            f"got {micro_batch_size} and {data_parallel_size}."
        )
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank must be in [0, {data_parallel_size}), got {data_parallel_rank}."
        )
    if not 0 <= consumed_samples <= num_samples:
        raise ValueError(
            f"consumed_samples must be in [0, {num_samples}] for this dataset, "
            f"got {consumed_samples}."
        )
    step_samples = micro_batch_size * data_parallel_size
    for step_start in range(consumed_samples, num_samples - step_samples + 1, step_samples):
        first = step_start + data_parallel_rank * micro_batch_size
        yield list(range(first, first + micro_batch_size))


class MicroBatchSampler:
    """:func:`micro_batch_indices` as a torch batch sampler: a ``DataLoader`` with it yields this
    rank's micro-batches in the contract's order, with or without worker processes."""

    def __init__(self, **indices_args) -> None:
        self.indices_args = indices_args
        next(micro_batch_indices(**indices_args), None)  # bad arguments raise here, not later

    def __iter__(self) -> Iterator[list[int]]:
        return micro_batch_indices(**self.indices_args)

    def __len__(self) -> int:
        a = self.indices_args
        step = a["micro_batch_size"] * a["data_parallel_size"]
        return len(range(a.get("consumed_samples", 0), a["num_samples"] - step + 1, step))


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into ``[b, s]`` tensors: int64 ids and positions, float32 loss mask; and
    megatron's ``attention_mask`` ``[b, 1, s, s]`` (bool) when the dataset makes one."""
    keys = _BATCH_KEYS + (("attention_mask",) if "attention_mask" in samples[0] else ())
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in keys}
    batch["loss_mask"] = batch["loss_mask"].to(torch.float32)
    for key in ("tokens", "labels", "position_ids"):
        batch[key] = batch[key].to(torch.int64)
    return batch


def build_batch_iterator(
    dataset: torch.utils.data.Dataset,
    *,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Iterate over this data-parallel rank's micro-batches, in the contract's global order.

    Args:
        dataset: A dataset from ``build_gpt_datasets`` (any map-style dataset whose items hold
            ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` of shape ``[s]``).
        micro_batch_size: ``--micro-batch-size``.
        data_parallel_rank: This rank's index in the data-parallel group.
        data_parallel_size: Size of the data-parallel group.
        consumed_samples: Global samples already trained on (from a checkpoint); iteration
            continues exactly where a run that consumed them left off.
        num_workers: ``--num-workers``: processes of a torch ``DataLoader`` that read and
            collate micro-batches ahead (kept for the whole iteration); 0 reads them here. The
            batches and their order are the same for any number.
        pin_memory: Put batches in page-locked host memory (CUDA: asynchronous copies).

    Yields:
        ``{"tokens", "labels", "position_ids"}`` as int64 ``[b, s]`` and ``"loss_mask"`` as
        float32 ``[b, s]``, where ``labels[:, t]`` is the token after ``tokens[:, t]`` (and
        ``"attention_mask"`` when the dataset makes one).
    """
    sampler = MicroBatchSampler(
        num_samples=len(dataset),
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        consumed_samples=consumed_samples,
    )
    # workers are forked, as torch (and Megatron-LM) do on Linux: they only index the dataset
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=_collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=_init_loader_process if num_workers else None,
    )
    return iter(loader)


def close_batch_iterator(batches: Iterator | None) -> None:
    """Stop the loader processes of a :func:`build_batch_iterator` iterator now (anything else:
    nothing to do). A finished run's iterator is dropped and stops them itself; a failed run's
    lives on in the traceback, and at the exit Python would wait for its processes forever
    (they ignore SIGTERM)."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # torch's multi-process iterator
    if shutdown is not None:
        shutdown()


def _init_loader_process(worker_id: int) -> None:
    _leave_stop_signals_to_the_trainer(worker_id)
    _drop_inherited_data_limit()


def _drop_inherited_data_limit() -> None:
    """--memory-limit-gb caps the trainer's own data segment on CPU (RLIMIT_DATA), and a forked
    loader process inherits the cap with little of it left: it would fail, or hang the trainer's
    exit. The loader's few batches are not what the cap measures."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def _leave_stop_signals_to_the_trainer(_worker_id: int) -> None:
    """A scheduler's SIGTERM (or a terminal's SIGINT) reaches every process of the job: a loader
    process that died of it would fail the next batch of a trainer that is saving before it
    stops (--exit-signal-handler). The trainer ends its loader processes itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
