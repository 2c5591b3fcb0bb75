"""Evaluation: the validation loss and its perplexity over ``--eval-iters`` global batches, the
loss by token position (``memo_ext.training.position_loss``), the retrieval accuracies
(``memo_ext.training.retrieval``), all in one :func:`evaluate`; and ``--skip-train``, one
evaluation of the loaded weights recorded as a run of its own (:func:`evaluate_only`).

The step loop (``memo_ext.training.loop``) calls :func:`evaluate` every ``--eval-interval``
steps; the figures join that step's metrics record.
"""

from __future__ import annotations

import logging
import math
import os
from functools import partial

import torch

from memo_ext.collectives import loss_pair, mean_loss
from memo_ext.config import RunConfig
from memo_ext.errors import UsageError
from memo_ext.training.checkpoint import TrainProgress
from memo_ext.training.housekeeping import maybe_empty_cache
from memo_ext.training.metrics import MetricsWriter, TensorBoardWriter, evaluation_line
from memo_ext.training.position_loss import METRICS_KEY as POSITION_KEY
from memo_ext.training.position_loss import PositionLoss, position_bounds
from memo_ext.training.report import TrainSummary
from memo_ext.training.retrieval import build_samples, evaluate_retrieval
from memo_ext.training.session import Session, run_global_batch

logger = logging.getLogger(__name__)


def check_evaluation_only(run: RunConfig) -> None:
    """--skip-train writes a metrics file of its one record: one that holds a run's records
    is not replaced.

    Raises:
        UsageError: naming the file.
    """
    path = run.logging.metrics_file
    if run.evaluation.skip_train and path and os.path.isfile(path) and os.path.getsize(path):
        raise UsageError(
            f"--skip-train writes its evaluation to a --metrics-file of its own, and {path} "
            "holds records already; give a new path"
        )


def retrieval_samples(run: RunConfig, tokenizer, haystack: list[int] | None) -> list:
    """The prompts of --eval-retrieval-lengths (none without it), made before the first step:
    a tokenizer without digits or a length too short for a prompt stops the run here."""
    evaluation = run.evaluation
    if not evaluation.retrieval:
        return []
    samples = build_samples(evaluation, tokenizer, seed=run.train.seed, haystack=haystack)
    if "needle" in evaluation.eval_retrieval_tasks:
        where = "validation documents" if haystack is not None else "the filler sentences"
        logger.info("retrieval: %d prompts per evaluation; the needle hides in %s",
                    len(samples), where)  # fmt: skip
    return samples


def evaluate(s: Session) -> dict:
    """Mean loss over ``eval_iters`` validation global batches, its perplexity, (unless
    --eval-position-min-tokens 0) the mean loss per position bucket, and (with
    --eval-retrieval-lengths) the retrieval accuracies."""
    s.model.eval()
    figures = {}
    with torch.no_grad():
        if s.valid_batches is not None:
            figures.update(_validation_loss(s))
        if s.retrieval:
            figures.update(
                evaluate_retrieval(
                    s.retrieval,
                    model=s.model,
                    forward_backward=s.forward_backward,
                    device=s.ctx.device,
                    dp_rank=s.ctx.dp_rank,
                    dp_size=s.ctx.dp_size,
                    vocab_size=s.run.shape.vocab_size,
                    show_progress=s.run.evaluation.skip_train and s.ctx.is_logging_rank,
                )
            )
            maybe_empty_cache(s.run.cleanup, level=1)
    for extension in s.extensions:
        extension.end_evaluation()
    s.model.train()
    return figures


def evaluate_only(s: Session, progress: TrainProgress, *, iteration: int) -> TrainSummary:
    """--skip-train: one evaluation of the loaded weights, recorded at ``iteration``, that of
    the checkpoint they came from (0 without one), also under --finetune or
    --pretrained-checkpoint, whose run would count its own steps from 0."""
    figures = evaluate(s)
    record = {"iteration": iteration, "consumed_samples": progress.consumed_samples}
    record.update(figures)
    if s.ctx.is_logging_rank:
        writer = MetricsWriter(s.run.logging.metrics_file, resume_from=iteration)
        writer.write(record)
        board = TensorBoardWriter(s.run.logging.tensorboard_dir)
        board.write(record)
        board.close()
    logger.info("evaluation at iteration %d | %s", iteration, evaluation_line(figures))
    return TrainSummary(iterations=iteration, resumed_at=iteration)


def _validation_loss(s: Session) -> dict:
    pair = loss_pair([])
    by_position = _position_loss(s)
    forward_step = s.forward_step
    if by_position is not None:
        forward_step = partial(s.forward_step, position_loss=by_position)
    for _ in range(s.run.evaluation.eval_iters):
        out = run_global_batch(s, s.valid_batches, forward_only=True, forward_step=forward_step)
        pair += out.pair
        maybe_empty_cache(s.run.cleanup, level=1)
    loss = mean_loss(pair)
    figures = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
    if by_position is not None:
        figures[POSITION_KEY] = by_position.reduce()
    return figures


def _position_loss(s: Session) -> PositionLoss | None:
    """An empty per-position accumulator for one evaluation, or None when turned off."""
    min_tokens = s.run.evaluation.eval_position_min_tokens
    if not min_tokens:
        return None
    bounds = position_bounds(seq_length=s.run.data.seq_length, min_tokens=min_tokens)
    return PositionLoss(bounds, device=s.ctx.device)
