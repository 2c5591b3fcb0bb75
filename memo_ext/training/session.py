"""What the step loop and evaluation share: the :class:`Session` the loop builds once, and one
global batch through megatron-core's schedule (:func:`run_global_batch`), a training step's or
an evaluation's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches

from memo_ext.collectives import world_loss_pair
from memo_ext.config import RunConfig
from memo_ext.data.retrieval import RetrievalSample
from memo_ext.extension import Extension, MetricSource, StepLoss
from memo_ext.training.initialize import ParallelContext


@dataclass(frozen=True)
class Session:
    """What the step loop and evaluation work with, built once per run by the loop
    (``memo_ext.training.loop``)."""

    run: RunConfig
    ctx: ParallelContext
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    forward_backward: Callable
    forward_step: Callable
    train_batches: Iterator
    valid_batches: Iterator | None
    retrieval: list[RetrievalSample]
    """The retrieval prompts each evaluation scores (empty: none)."""
    extensions: list[Extension]
    metric_sources: list[MetricSource]
    """Per-step figures: the weights', then every extension's."""
    started_from: Path | None = None
    """The folder of checkpoints the weights were loaded from (its descent files go with every
    save), or ``None``."""


def run_global_batch(
    s: Session, batches: Iterator, *, forward_only: bool, forward_step: Callable | None = None
) -> StepLoss:
    """One global batch through megatron's schedule (with ``forward_step``, else the session's),
    or through the extension that runs a training step's passes itself.

    A training step takes the micro-batches of megatron-core's calculator (fewer while
    --rampup-batch-size ramps up); evaluation always the full global batch, as Megatron-LM.
    """
    if not forward_only:
        for extension in s.extensions:
            owned = extension.forward_backward(batches, s.forward_step)
            if owned is not None:
                return owned
    num_microbatches = s.run.num_microbatches if forward_only else get_num_microbatches()
    lengths = []
    if s.run.data.variable_seq_lengths:
        # one step's packed rows: as many on every DP rank, but not the same count every step
        rows = next(batches)
        batches, num_microbatches = iter(rows), len(rows)
        lengths = [int(n) for row in rows for n in row["cu_seqlens"].diff().tolist() if n > 0]
    losses = s.forward_backward(
        forward_step_func=forward_step or s.forward_step,
        data_iterator=batches,
        model=[s.model],
        num_microbatches=num_microbatches,
        seq_length=s.run.data.seq_length,
        micro_batch_size=s.run.train.micro_batch_size,
        forward_only=forward_only,
    )
    pair = world_loss_pair(losses if parallel_state.is_pipeline_last_stage() else [])
    # this DP rank's documents, shared by the model-parallel ranks of its replica
    shared_by = s.ctx.world_size // s.ctx.dp_size
    return StepLoss(pair=pair, document_lengths=lengths, flops_shared_by=shared_by)
