"""Whole documents of variable length, in global batches, for length-aware training (HotSPa).

Unlike ``GPTDataset``, which concatenates documents into fixed-length samples, a global batch here
is ``global_batch_size`` whole documents, each cut to its first ``seq_length`` tokens:

    source = IndexedDocuments("data/demo/stdlib_text_document")   # or MockDocuments(...)
    for batch in global_batches(source, global_batch_size=64, seq_length=4096, seed=1234):
        ...  # 64 int64 arrays of 1 to 4096 tokens

Order contract (what resume and DP-size changes rely on): epoch ``e`` visits the documents in
``numpy.random.default_rng([seed, e]).permutation(n)``; global position ``p`` is document
``perm_{p // n}[p % n]``; global batch ``k`` holds positions ``[k·gbs, (k+1)·gbs)``. The order
depends on the seed and the dataset only, never on the DP size, and a run that has consumed ``c``
documents continues at position ``c``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

if TYPE_CHECKING:
    from memo_ext.config import DataConfig, TrainConfig


class DocumentSource(Protocol):
    """Documents addressed by index: ``len()`` and ``document(i)`` (1-D int64 token ids)."""

    def __len__(self) -> int: ...

    def document(self, index: int) -> np.ndarray: ...


class IndexedDocuments:
    """The documents of a megatron-core indexed dataset (``--data-path`` prefix).

    A document is the concatenation of its sequences (``tools/preprocess_data.py`` writes one
    sequence per document, ending with the end-of-document id under ``--append-eod``).
    ``mmap`` False reads documents with file reads (``--no-mmap-bin-files``).
    """

    def __init__(self, prefix: str, *, mmap: bool = True) -> None:
        if not os.path.isfile(f"{prefix}.idx") or not os.path.isfile(f"{prefix}.bin"):
            raise FileNotFoundError(
                f"Dataset files {prefix}.bin / {prefix}.idx do not exist; create them with "
                f"tools/preprocess_data.py or fix --data-path."
            )
        self._dataset = IndexedDataset(prefix, mmap=mmap)
        # sequence s of the dataset is a part of document d when bounds[d] <= s < bounds[d + 1]
        self._bounds = np.asarray(self._dataset.document_indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def document(self, index: int) -> np.ndarray:
        first, last = self._bounds[index], self._bounds[index + 1]
        parts = [np.asarray(self._dataset[s], dtype=np.int64) for s in range(first, last)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class MockDocuments:
    """Synthetic documents with a long-tailed (clipped lognormal) length distribution.

    Lengths are drawn once from ``(seed)``; document ``i``'s token ids from ``(seed, i)``, so any
    document can be read alone, on any rank, in any order.
    """

    def __init__(
        self,
        *,
        num_documents: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        median_tokens: float | None = None,
        sigma: float = 1.2,
    ) -> None:
        """
        Args:
            num_documents: Documents in the corpus.
            seq_length: Longest document (lengths are clipped to ``[2, seq_length]``).
            vocab_size: Token ids are drawn from ``[0, vocab_size)``.
            seed: Fixes lengths and token ids.
            median_tokens: Median length before clipping; ``seq_length / 8`` when ``None``, so
                most documents are short and a tail reaches the full length.
            sigma: Spread of the log-length (larger: a heavier tail).
        """
        if seq_length < 2 or vocab_size < 1 or num_documents < 1:
            raise ValueError(
                f"mock documents need seq_length >= 2, vocab_size >= 1 and num_documents >= 1, "
                f"got {seq_length}, {vocab_size}, {num_documents}"
            )
        median = median_tokens if median_tokens is not None else seq_length / 8
        draws = np.random.default_rng(seed).lognormal(
            np.log(max(median, 1.0)), sigma, num_documents
        )
        self.lengths = np.clip(np.rint(draws), 2, seq_length).astype(np.int64)
        self._seed = seed
        self._vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, index])
        return rng.integers(0, self._vocab_size, size=int(self.lengths[index]), dtype=np.int64)


def document_at(num_documents: int, *, position: int, seed: int) -> int:
    """Index of the document at global ``position`` of the order contract."""
    epoch, offset = divmod(position, num_documents)
    return int(_permutation(num_documents, seed=seed, epoch=epoch)[offset])


def _permutation(num_documents: int, *, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_documents)


def global_batches(
    source: DocumentSource,
    *,
    global_batch_size: int,
    seq_length: int,
    seed: int,
    consumed_documents: int = 0,
) -> Iterator[list[np.ndarray]]:
    """Endless global batches of whole documents, each cut to its first ``seq_length`` tokens.

    Args:
        source: The corpus (:class:`IndexedDocuments`, :class:`MockDocuments`).
        global_batch_size: ``--global-batch-size``, in documents.
        seq_length: ``--seq-length``; longer documents keep their first ``seq_length`` tokens.
        seed: ``--seed``; fixes the order (see the module docstring).
        consumed_documents: Documents already trained on; iteration resumes right after them.

    Yields:
        Lists of ``global_batch_size`` int64 arrays, in the contract's order. Empty documents
        (possible in an indexed dataset) are kept as empty arrays so that counts stay exact.
    """
    if global_batch_size < 1 or seq_length < 1 or consumed_documents < 0:
        raise ValueError(
            f"global_batch_size and seq_length must be positive and consumed_documents "
            f"non-negative, got {global_batch_size}, {seq_length}, {consumed_documents}"
        )
    n = len(source)
    if n == 0:
        raise ValueError("the dataset holds no documents; check --data-path")
    position = consumed_documents
    epoch, order = -1, None
    while True:
        batch = []
        for _ in range(global_batch_size):
            if position // n != epoch:
                epoch = position // n
                order = _permutation(n, seed=seed, epoch=epoch)
            batch.append(source.document(int(order[position % n]))[:seq_length])
            position += 1
        yield batch


def document_source(data: DataConfig, train: TrainConfig, *, vocab_size: int) -> DocumentSource:
    """The whole documents ``--variable-seq-lengths`` trains on."""
    if data.mock_data:
        return MockDocuments(
            num_documents=train.total_train_samples,
            seq_length=data.seq_length,
            vocab_size=vocab_size,
            seed=train.seed,
        )
    # per-split paths: the packed rows read the training prefix (evaluation is refused there)
    prefix = (data.train_data_path or data.data_path)[0]
    return IndexedDocuments(prefix, mmap=data.mmap_bin_files)
