"""The trainer's data: a resolved run's train and validation iterators.

Fixed-length samples come from megatron-core's ``GPTDataset`` splits (``memo_ext.data.datasets``)
in Megatron-LM's sampling order; whole documents (``--variable-seq-lengths``) are packed into rows
per step (``memo_ext.data.batches``), or by an extension that groups them its own way
(``Extension.batches``: HotSPa's buckets). Every iterator starts where a checkpoint's consumed
samples say.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from memo_ext.config import RunConfig
from memo_ext.data.batches import packed_step_batches
from memo_ext.data.datasets import build_gpt_datasets
from memo_ext.data.documents import document_source
from memo_ext.data.sampler import build_batch_iterator
from memo_ext.extension import Extension
from memo_ext.training.checkpoint import TrainProgress
from memo_ext.training.initialize import ParallelContext


def build_batches(
    run: RunConfig,
    ctx: ParallelContext,
    tokenizer,
    progress: TrainProgress,
    extensions: Sequence[Extension] = (),
) -> tuple[Iterator, Iterator | None]:
    """Train and validation iterators, both positioned where ``progress`` says."""
    if run.data.variable_seq_lengths:
        return _packed_batches(run, ctx, tokenizer, progress, extensions), None
    gbs = run.train.global_batch_size
    evals = run.train.train_iters // run.evaluation.eval_interval if run.evaluation.enabled else 0
    valid_samples = evals * run.evaluation.eval_iters * gbs
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
    if evals:
        if valid_ds is None:
            raise ValueError(
                "--eval-interval needs a validation split: give --split a valid part or "
                "--valid-data-path"
            )
        done = progress.iteration // run.evaluation.eval_interval
        valid = iterate(valid_ds, done * run.evaluation.eval_iters * gbs)
    return iterate(train_ds, progress.consumed_samples), valid


def _packed_batches(
    run: RunConfig,
    ctx: ParallelContext,
    tokenizer,
    progress: TrainProgress,
    extensions: Sequence[Extension],
) -> Iterator:
    """Per step, this DP rank's packed rows of the next ``global_batch_size`` documents, or
    the first extension's own batches of them."""
    source = document_source(run, vocab_size=tokenizer.vocab_size)
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
