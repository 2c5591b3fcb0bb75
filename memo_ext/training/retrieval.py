"""Retrieval accuracy at each evaluation: passkey and needle-in-a-haystack over a grid of context
lengths and depths (``memo_ext.data.retrieval`` makes the prompts).

Scoring is greedy decoding with exact match, computed in one forward pass per prompt: the
decoder's answer equals the true answer exactly when, at every answer position, the argmax of
the logits given the true tokens before it is the true token (the first position where they
differ is the first token the decoder gets wrong, and up to it the decoder's context is the true
one). The model returns those per-token hits in place of its losses
(:meth:`~memo_ext.mcore.gpt.ChunkedLossGPTModel.greedy_scoring`), so a prompt goes through the
run's own schedule, layout and memory method like a validation batch: TP (the argmax found over
the vocabulary shards), SP, CP (each rank scores its chunks), PP (the last stage scores), MEMO.

Prompts are dealt round-robin to the DP ranks, one micro-batch each, grouped by length (one
schedule call per length); every rank adds (hits, answer tokens) per prompt into one table,
all-reduced over the world. A prompt is right when its hits equal its answer tokens: the TP
replicas of a prompt add identical pairs, which keeps that equality.

The metrics record of an evaluation carries, per task, ``val_<task>_acc`` (the grid's mean) and
``val_<task>_acc_by_cell`` (``{"4096@0.5": 0.75, ...}``, keyed by
:func:`~memo_ext.data.retrieval.cell_name`) and ``val_<task>_token_acc`` (answer tokens right),
documented in ``memo_ext.training.metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model
from tqdm import tqdm

from memo_ext.collectives import collective_device
from memo_ext.config import EvaluationConfig, RunConfig
from memo_ext.data.retrieval import (
    PromptParts,
    RetrievalSample,
    check_tokenizer,
    make_sample,
)
from memo_ext.device import maybe_pin
from memo_ext.training.step import scored_forward_step


def haystack_tokens(run: RunConfig) -> int:
    """Validation tokens the needle task hides its number in: the longest prompt's (an upper
    bound; each prompt takes what its length leaves). None for mock data, whose random ids are
    no text: the needle then hides in the filler sentences."""
    evaluation = run.evaluation
    if "needle" not in evaluation.eval_retrieval_tasks or not evaluation.retrieval:
        return 0
    return 0 if run.data.mock_data else max(evaluation.eval_retrieval_lengths)


def check_retrieval(run: RunConfig, tokenizer) -> None:
    """Before any work: the tokenizer writes digits and the shortest length holds each task's
    prompt (``build_samples`` makes them all once the validation data is read).

    Raises:
        UsageError: naming the tokenizer or the length.
    """
    evaluation = run.evaluation
    if not evaluation.retrieval:
        return
    name = getattr(tokenizer, "description", type(tokenizer).__name__)
    check_tokenizer(tokenizer.tokenize, tokenizer.detokenize, name=name)
    parts = PromptParts(tokenizer.tokenize, digits=evaluation.eval_retrieval_digits)
    shortest = min(evaluation.eval_retrieval_lengths)
    for task in evaluation.eval_retrieval_tasks:
        make_sample(parts, task=task, length=shortest, depth=0.0, index=0, seed=run.train.seed)


def build_samples(
    evaluation: EvaluationConfig,
    tokenizer,
    *,
    seed: int,
    haystack: Sequence[int] | None = None,
) -> list[RetrievalSample]:
    """Every prompt of the grid, in (task, length, depth, index) order; the same on every rank
    (:func:`check_retrieval` has checked the tokenizer and the lengths before)."""
    parts = PromptParts(tokenizer.tokenize, digits=evaluation.eval_retrieval_digits)
    return [
        make_sample(
            parts,
            task=task,
            length=length,
            depth=depth,
            index=index,
            seed=seed,
            haystack=haystack,
        )
        for task in evaluation.eval_retrieval_tasks
        for length in evaluation.eval_retrieval_lengths
        for depth in evaluation.eval_retrieval_depths
        for index in range(evaluation.eval_retrieval_samples)
    ]


class RetrievalScores:
    """(hits, answer tokens) per prompt on this rank, then the world's sums."""

    def __init__(self, count: int, *, device: torch.device):
        self.sums = torch.zeros(count, 2, dtype=torch.float64, device=device)

    def add(self, index: int, mask: torch.Tensor, hits: torch.Tensor) -> None:
        mask = mask.to(torch.float64)
        self.sums[index, 0] += (hits.to(torch.float64) * mask).sum()
        self.sums[index, 1] += mask.sum()

    def reduce(self) -> list[tuple[float, float]]:
        """(hits, answer tokens) of each prompt over the world (collective: every rank calls
        it); TP replicas count a prompt's tokens as many times as its hits."""
        sums = self.sums.to(collective_device())
        if dist.is_initialized():
            dist.all_reduce(sums)
        return [(hits, count) for hits, count in sums.tolist()]


def accuracy(samples: Sequence[RetrievalSample], counts: Sequence[tuple[float, float]]) -> dict:
    """The record's figures, per task: the grid's mean and each cell's share of prompts whose
    answer tokens are all hits, and the share of answer tokens that are."""
    figures: dict = {}
    for task in dict.fromkeys(sample.task for sample in samples):
        cells: dict[str, list[bool]] = {}
        hits = tokens = 0.0
        for sample, (hit, count) in zip(samples, counts):
            if sample.task == task:
                cells.setdefault(sample.cell, []).append(count > 0 and hit == count)
                hits, tokens = hits + hit, tokens + count
        by_cell = {cell: sum(oks) / len(oks) for cell, oks in cells.items()}
        figures[f"val_{task}_acc"] = sum(by_cell.values()) / len(by_cell)
        figures[f"val_{task}_acc_by_cell"] = by_cell
        figures[f"val_{task}_token_acc"] = hits / tokens if tokens else 0.0
    return figures


def evaluate_retrieval(
    samples: Sequence[RetrievalSample],
    *,
    model: torch.nn.Module,
    forward_backward: Callable,
    device: torch.device,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    show_progress: bool = False,
) -> dict:
    """Score every prompt with ``model`` (in eval mode, under no_grad) through
    ``forward_backward`` (megatron-core's schedule) and return the record's figures."""
    scores = RetrievalScores(len(samples), device=device)
    by_length: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        by_length.setdefault(sample.length, []).append(index)
    step = partial(scored_forward_step, device=device, add=scores.add)
    bar = tqdm(total=len(samples), desc="retrieval", unit="prompt", disable=not show_progress)
    with unwrap_model(model).greedy_scoring(vocab_size), bar:
        for length, indices in by_length.items():
            # every DP rank runs as many micro-batches: the short ones add a row of no prompt
            rounds = math.ceil(len(indices) / dp_size)
            mine = indices[dp_rank::dp_size]
            mine += [-1] * (rounds - len(mine))
            rows = [(i, _row(samples[max(i, 0)])) for i in mine]
            forward_backward(
                forward_step_func=step,
                data_iterator=iter(rows),
                model=[model],
                num_microbatches=rounds,
                seq_length=length,
                micro_batch_size=1,
                forward_only=True,
            )
            bar.update(len(indices))
    return accuracy(samples, scores.reduce())


def _row(sample: RetrievalSample) -> dict[str, torch.Tensor]:
    """The prompt as a micro-batch on the host, pinned on a GPU: the step copies it over with
    ``non_blocking=True``, which is asynchronous only from page-locked memory."""
    return {key: maybe_pin(torch.from_numpy(value)) for key, value in sample.batch().items()}
