"""The training loop: build everything, run ``train_iters`` optimizer steps, log metrics.

One step = ``num_microbatches`` forward/backward passes through megatron-core's schedule
(1F1B when PP > 1), gradient reduction in ``finalize_model_grads`` (DP × CP sum, SP norm
grads over TP, tied embeddings over PP, division by the global token count), then the
optimizer and the LR schedule.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from memo_ext.config import RunConfig
from memo_ext.training.checkpointing import TrainProgress, load_checkpoint, save_checkpoint
from memo_ext.training.control import StopConditions
from memo_ext.training.data import build_batch_iterator, build_gpt_datasets
from memo_ext.training.initialize import (
    ParallelContext,
    device_environment,
    init_distributed,
    init_model_parallel,
    shutdown,
)
from memo_ext.training.metrics import (
    MetricsWriter,
    StepMetrics,
    cuda_memory,
    device_peak_tflops,
    gpt_train_flops,
)
from memo_ext.training.model import build_gpt_model, count_parameters, wrap_for_data_parallel
from memo_ext.training.optimizer import build_lr_scheduler, build_optimizer
from memo_ext.training.step import build_forward_step
from memo_ext.training.tokenizers import build_tokenizer, padded_vocab_size

logger = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """What a finished run reports back to its launcher."""

    iterations: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    stopped_early: bool = False

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def last_loss(self) -> float:
        return self.losses[-1]


def train(run: RunConfig) -> TrainSummary:
    """Run a whole training job in this process (one rank of a torchrun job)."""
    init_distributed()
    try:
        with device_environment():
            ctx = init_model_parallel(config=run.transformer, seed=run.train.seed)
            return _train(run, ctx)
    finally:
        shutdown()


def _train(run: RunConfig, ctx: ParallelContext) -> TrainSummary:
    tokenizer = build_tokenizer(
        tokenizer_type=run.data.tokenizer_type, vocab_size=run.data.vocab_size
    )
    # padded to lcm(divisible_by, TP) rather than Megatron-LM's divisible_by × TP: the padded
    # logits enter the softmax, so the vocabulary must not change with the TP size
    run.model.vocab_size = padded_vocab_size(
        tokenizer.vocab_size,
        divisible_by=math.lcm(
            run.data.make_vocab_size_divisible_by, run.transformer.tensor_model_parallel_size
        ),
    )
    model = wrap_for_data_parallel(model=build_gpt_model(run=run, device=ctx.device), run=run)
    _log_setup(run, ctx, model)
    optimizer = build_optimizer(
        model_chunks=[model], train=run.train, bf16=run.transformer.bf16, fp16=run.transformer.fp16
    )
    scheduler = build_lr_scheduler(optimizer=optimizer, train=run.train)
    _connect_schedule_hooks(run, model, optimizer)
    progress = TrainProgress()
    if run.checkpoint.load:
        progress = load_checkpoint(
            load_dir=run.checkpoint.load, model=model, optimizer=optimizer, scheduler=scheduler
        )
    batches = _train_batches(run, ctx, tokenizer, consumed_samples=progress.consumed_samples)
    with StopConditions(run.checkpoint) as stop:
        return _run_steps(run, ctx, model, optimizer, scheduler, batches, progress, stop)


def _log_setup(run: RunConfig, ctx: ParallelContext, model: torch.nn.Module) -> None:
    t = run.transformer
    logger.info(
        "world %d = TP %d × CP %d × PP %d × DP %d%s | %d layers, hidden %d, heads %d/%d groups, "
        "seq %d, vocab %d | %s parameters on rank 0 | device %s",
        ctx.world_size, t.tensor_model_parallel_size, t.context_parallel_size,
        t.pipeline_model_parallel_size, ctx.dp_size, " + SP" if t.sequence_parallel else "",
        t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups,
        run.data.seq_length, run.model.vocab_size, f"{count_parameters(model):,}", ctx.device,
    )  # fmt: skip


def _connect_schedule_hooks(run: RunConfig, model, optimizer) -> None:
    """Tell megatron-core's schedules how to sync and finalize gradients."""
    config = run.transformer
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "scale_loss"):
        config.grad_scale_func = optimizer.optimizer.scale_loss


def _train_batches(run: RunConfig, ctx: ParallelContext, tokenizer, *, consumed_samples: int):
    samples = run.train.train_iters * run.train.global_batch_size
    train_ds, _, _ = build_gpt_datasets(
        data_path=run.data.data_path or None,
        split=run.data.split,
        mock=run.data.mock_data,
        seq_length=run.data.seq_length,
        seed=run.train.seed,
        tokenizer=tokenizer,
        num_samples=(samples, 0, 0),
        cache_dir=run.data.data_cache_path,
    )
    return build_batch_iterator(
        train_ds,
        micro_batch_size=run.train.micro_batch_size,
        data_parallel_rank=ctx.dp_rank,
        data_parallel_size=ctx.dp_size,
        consumed_samples=consumed_samples,
    )


def _reduce_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """Mean loss over the global batch, visible on every rank.

    Only last-stage ranks hold losses; every rank of the world joins one all-reduce of
    (loss sum, tokens). TP replicas add identical pairs, which scales both terms alike.
    """
    pair = torch.zeros(2, dtype=torch.float64)
    for record in losses:
        pair += record["lm loss"].detach().double().cpu()
    if dist.is_initialized():
        dist.all_reduce(pair)
    return (pair[0] / pair[1].clamp(min=1)).item()


def _is_logged(iteration: int, run: RunConfig) -> bool:
    """First step (the starting loss), every ``log_interval`` steps, and the last step."""
    last = run.train.train_iters
    return iteration in (1, last) or iteration % run.logging.log_interval == 0


def _train_one_step(run, model, optimizer, scheduler, batches, forward_backward, forward_step):
    """Forward / backward over the global batch, then the update; (loss, grad norm, lr, ok)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=run.num_microbatches,
        seq_length=run.data.seq_length,
        micro_batch_size=run.train.micro_batch_size,
        forward_only=False,
    )
    lr = optimizer.param_groups[0]["lr"]  # the rate this step applies
    updated, grad_norm = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    loss = _reduce_loss(losses if parallel_state.is_pipeline_last_stage() else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss, grad_norm, lr, updated


def _run_steps(run, ctx, model, optimizer, scheduler, batches, progress, stop) -> TrainSummary:
    forward_backward = get_forward_backward_func()
    forward_step = build_forward_step(ctx.device)
    writer = MetricsWriter(
        run.logging.metrics_file if ctx.is_logging_rank else None, resume_from=progress.iteration
    )
    flops_per_step = gpt_train_flops(
        config=run.transformer,
        vocab_size=run.model.vocab_size,
        seq_length=run.data.seq_length,
        sequences=run.train.global_batch_size,
    )
    peak = device_peak_tflops(run.logging.device_peak_tflops)
    summary = TrainSummary()
    skipped = 0
    for iteration in range(progress.iteration + 1, run.train.train_iters + 1):
        start = time.perf_counter()
        loss, grad_norm, lr, updated = _train_one_step(
            run, model, optimizer, scheduler, batches, forward_backward, forward_step
        )
        skipped += not updated
        step_time = time.perf_counter() - start
        tokens_per_s = run.train.global_batch_size * run.data.seq_length / step_time
        summary.iterations = iteration
        summary.losses.append(loss)
        summary.tokens_per_s.append(tokens_per_s)
        progress = TrainProgress(iteration, iteration * run.train.global_batch_size)
        if _is_logged(iteration, run):
            tflops = flops_per_step / ctx.world_size / step_time / 1e12
            allocated, reserved = cuda_memory()
            record = StepMetrics(
                iteration=iteration,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                step_time_s=step_time,
                tokens_per_s=tokens_per_s,
                consumed_samples=progress.consumed_samples,
                skipped_iterations=skipped,
                tflops_per_device=tflops,
                mfu=tflops / peak if peak else None,
                mem_allocated_bytes=allocated,
                mem_reserved_bytes=reserved,
            )
            writer.write(record.to_json())
            logger.info(record.console_line(run.train.train_iters))
        reason = stop.reason(iteration)
        if reason or _save_due(iteration, run):
            save_checkpoint(
                save_dir=run.checkpoint.save, progress=progress, model=model,
                optimizer=optimizer, scheduler=scheduler,
            )  # fmt: skip
        if reason:
            logger.info("stopping after iteration %d: %s", iteration, reason)
            summary.stopped_early = True
            break
    return summary


def _save_due(iteration: int, run: RunConfig) -> bool:
    """At every ``--save-interval`` and at the end of training, when ``--save`` is set."""
    ckpt = run.checkpoint
    if not ckpt.save:
        return False
    if iteration == run.train.train_iters:
        return True
    return bool(ckpt.save_interval) and iteration % ckpt.save_interval == 0
