"""Training data: JSON Lines → indexed datasets (``memo_ext.data.preprocess``), GPT dataset splits
(here), and the micro-batch order (``memo_ext.data.sampler``).

Three stages, each usable on its own:

1. ``preprocess_jsonl`` tokenizes a JSON Lines corpus into megatron-core ``IndexedDataset`` files
   (``{prefix}_{key}_document.bin`` / ``.idx``), optionally on a pool of forked workers. The
   ``memo-preprocess-data`` command line and the demo corpus both call it.
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
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizerBase

from memo_ext.config.data import check_split

logger = logging.getLogger(__name__)


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
