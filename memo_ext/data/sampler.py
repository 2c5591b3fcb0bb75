"""The micro-batch order: one dataset walked in a fixed global order, every data-parallel rank
handed its own micro-batches (the order contract is ``memo_ext.data.datasets``')."""

from __future__ import annotations

import logging
import resource
import signal
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


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
