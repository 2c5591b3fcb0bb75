"""The trainer's data: a resolved run's train and validation iterators.

Fixed-length samples come from megatron-core's ``GPTDataset`` splits (``memo_ext.data.datasets``)
in Megatron-LM's sampling order; whole documents (``--variable-seq-lengths``) are packed into rows
per step (``memo_ext.data.batches``), or by an extension that groups them its own way
(``Extension.batches``: HotSPa's buckets). Every iterator starts where a checkpoint's consumed
samples say.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from memo_ext.config import RunConfig
from memo_ext.data.batches import packed_step_batches
from memo_ext.data.datasets import build_gpt_datasets
from memo_ext.data.documents import document_source
from memo_ext.data.sampler import build_batch_iterator
from memo_ext.extension import Extension
from memo_ext.training.checkpoint import TrainProgress
from memo_ext.training.initialize import ParallelContext


@dataclass
class Batches:
    """A run's data: its iterators, and the validation tokens retrieval prompts hide in."""

    train: Iterator
    valid: Iterator | None
    """Validation batches (``None``: no --eval-iters)."""
    haystack: list[int] | None
    """``haystack_tokens`` tokens of validation data, the same on every rank (``None``: no
    needle task, or no validation data)."""


def build_batches(
    run: RunConfig,
    ctx: ParallelContext,
    tokenizer,
    progress: TrainProgress,
    extensions: Sequence[Extension] = (),
    *,
    haystack_tokens: int = 0,
) -> Batches:
    """Train and validation iterators, both positioned where ``progress`` says, and the first
    ``haystack_tokens`` tokens of the validation split."""
    if run.data.variable_seq_lengths:
        return Batches(_packed_batches(run, ctx, tokenizer, progress, extensions), None, None)
    gbs = run.train.global_batch_size
    evaluation = run.evaluation
    evals = run.train.train_iters // evaluation.eval_interval if evaluation.eval_interval else 0
    evals += evaluation.skip_train
    valid_samples = evals * evaluation.eval_iters * gbs
    # the haystack reads whole validation samples from the split's start
    haystack_samples = math.ceil(haystack_tokens / run.data.seq_length)
    valid_samples = max(valid_samples, haystack_samples)
    per_split = run.data.per_split
    train_ds, valid_ds, _ = build_gpt_datasets(
        data_path=None if per_split else run.data.data_path or None,
        split=None if per_split else run.data.split_or_default,
        mock=run.data.mock_data,
        seq_length=run.data.seq_length,
        seed=run.train.seed,
        tokenizer=tokenizer,
        # --train-samples (Megatron-LM's count), or steps × batch; at least what the steps take
        num_samples=(run.train.total_train_samples, valid_samples, 0),
        cache_dir=run.data.data_cache_path,
        mmap_bin_files=run.data.mmap_bin_files,
        create_attention_mask=run.data.create_attention_mask_in_dataloader,
        blend_per_split=(
            (run.data.train_data_path, run.data.valid_data_path, run.data.test_data_path)
            if per_split
            else None
        ),
    )

    def iterate(dataset, consumed: int) -> Iterator:
        return build_batch_iterator(
            dataset,
            micro_batch_size=run.train.micro_batch_size,
            data_parallel_rank=ctx.dp_rank,
            data_parallel_size=ctx.dp_size,
            consumed_samples=consumed,
            num_workers=run.data.num_workers,
            pin_memory=ctx.device.type == "cuda",
        )

    valid = None
    if evals and evaluation.eval_iters:
        if valid_ds is None:
            raise ValueError(
                "--eval-interval needs a validation split: give --split a valid part or "
                "--valid-data-path"
            )
        done = progress.iteration // evaluation.eval_interval if evaluation.eval_interval else 0
        valid = iterate(valid_ds, done * evaluation.eval_iters * gbs)
    haystack = None
    if haystack_samples and valid_ds is not None and len(valid_ds) >= haystack_samples:
        rows = [np.asarray(valid_ds[i]["tokens"]) for i in range(haystack_samples)]
        haystack = np.concatenate(rows)[:haystack_tokens].tolist()
    return Batches(iterate(train_ds, progress.consumed_samples), valid, haystack)


def _packed_batches(
    run: RunConfig,
    ctx: ParallelContext,
    tokenizer,
    progress: TrainProgress,
    extensions: Sequence[Extension],
) -> Iterator:
    """Per step, this DP rank's packed rows of the next ``global_batch_size`` documents, or
    the first extension's own batches of them."""
    source = document_source(run.data, run.train, vocab_size=tokenizer.vocab_size)
    for extension in extensions:
        batches = extension.batches(
            run, source, rank=ctx.rank, consumed_documents=progress.consumed_samples
        )
        if batches is not None:
            return batches
    cp = run.layout.cp
    return packed_step_batches(
        source,
        global_batch_size=run.train.global_batch_size,
        seq_length=run.data.seq_length,
        seed=run.train.seed,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        consumed_documents=progress.consumed_samples,
        pad_multiple=2 * cp if cp > 1 else 1,
    )
