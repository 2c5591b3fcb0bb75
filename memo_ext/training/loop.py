"""The training loop: build everything, run ``train_iters`` optimizer steps, log metrics.

One step = ``num_microbatches`` forward/backward passes through megatron-core's schedule
(1F1B when PP > 1), gradient reduction in ``finalize_model_grads`` (DP × CP sum, SP norm
grads over TP, tied embeddings over PP, division by the global token count), then the
optimizer and the LR schedule. Around it: evaluation (``memo_ext.training.evaluation``), checks
for non-finite losses and gradients, checkpoints and early stops (``memo_ext.training.control``),
the step's record (``memo_ext.training.report``), and the housekeeping of
``memo_ext.training.housekeeping`` (garbage collection, cache emptying, profiling).

Features plug in through their extensions (``memo_ext.extension``; the list is
``memo_ext.features``): the loop calls every enabled extension's hooks and names none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from memo_ext import device
from memo_ext.collectives import mean_loss
from memo_ext.config import RunConfig
from memo_ext.data.sampler import close_batch_iterator
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.extension import Built, Extension, PlanningTarget
from memo_ext.features.extensions import extensions_for, own_layouts
from memo_ext.features.megatron import run_transformer_config
from memo_ext.features.preflight import check_preflight, planning_target
from memo_ext.mcore.microbatches import init_microbatches, update_batch_ramp
from memo_ext.training.checkpoint import (
    TrainProgress,
    check_save_target,
    checkpoint_source,
    hold_save_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
    schedule_policy,
)
from memo_ext.training.control import (
    LossWatch,
    StopConditions,
    check_finite,
    check_resumable,
    save_due,
)
from memo_ext.training.evaluation import (
    check_evaluation_only,
    evaluate,
    evaluate_only,
    retrieval_samples,
)
from memo_ext.training.housekeeping import (
    Housekeeping,
    maybe_empty_cache,
    notices_for_this_machine,
)
from memo_ext.training.initialize import (
    ParallelContext,
    apply_memory_limit,
    device_environment,
    init_distributed,
    init_model_parallel,
    lift_memory_limit,
    rendezvous_environment,
    shutdown,
)
from memo_ext.training.inputs import build_batches
from memo_ext.training.metrics import StepMetrics
from memo_ext.training.model import build_gpt_model, params_in_sync, wrap_for_data_parallel
from memo_ext.training.optimizer import build_lr_scheduler, build_optimizer, lr_for_logging
from memo_ext.training.report import (
    Reporter,
    TrainSummary,
    is_logged,
    log_setup,
    weight_statistics,
    write_settings,
)
from memo_ext.training.resolve import resolve_run
from memo_ext.training.retrieval import check_retrieval, haystack_tokens
from memo_ext.training.session import Session, run_global_batch
from memo_ext.training.step import build_forward_step

logger = logging.getLogger(__name__)


def train(run: RunConfig) -> TrainSummary:
    """Run a whole training job in this process (one rank of a torchrun job).

    ``run`` is the parsed configuration; it is resolved here against its tokenizer and data
    (``memo_ext.training.resolve``) and logged, and nothing changes it afterwards.
    """
    rendezvous_environment()  # a rank outside the world says so now, not at the rendezvous
    extensions = extensions_for(run)
    for extension in extensions:
        extension.setup()  # before the first tensor of the run
    tokenizer = tokenizer_for(run.data)
    target = planning_target(run)
    run = resolve_run(run, tokenizer=tokenizer, extensions=extensions, target=target)
    check_save_target(run.checkpoint)  # before any work: nothing it started from is replaced
    check_evaluation_only(run)
    check_retrieval(run, tokenizer)
    if _is_logging_process():
        write_settings(run)
    _maybe_preflight(run, extensions, target)
    init_distributed(timeout_minutes=run.distributed.timeout_minutes)
    try:
        with device_environment(), contextlib.ExitStack() as held:
            ctx = init_model_parallel(
                layout=run.layout,
                seed=run.train.seed,
                timeout_minutes=run.distributed.timeout_minutes,
            )
            # after start-up (process groups made), before the first tensor of the model
            apply_memory_limit(
                run.preflight.memory_limit_gb,
                device=ctx.device,
                planned=any(extension.replaces_allocator for extension in extensions),
            )
            init_microbatches(
                run.train,
                seq_length=run.data.seq_length,
                rank=ctx.rank,
                data_parallel_size=ctx.dp_size,
            )
            if run.checkpoint.save:  # held until the run ends: one run per --save at a time
                held.enter_context(hold_save_dir(run.checkpoint.save))
            return _train(run, ctx, tokenizer, extensions)
    finally:
        lift_memory_limit()  # the clean-up below may need memory (an out-of-memory exit too)
        destroy_num_microbatches_calculator()
        shutdown()


def _is_logging_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _maybe_preflight(run: RunConfig, extensions: list[Extension], target: PlanningTarget) -> None:
    """Estimate device and host memory; raise ``PreflightError`` when the run cannot fit.

    Runs before any process group exists (the estimator traces on a fake one); every rank
    reaches the same verdict from the same flags.
    """
    if not run.preflight.enabled:
        return
    for extension in extensions:
        reason = extension.preflight_skip_reason(run)
        if reason:
            logger.info("preflight skipped: %s", reason)
            return
    check_preflight(run, target=target)


@dataclass(frozen=True)
class StepResult:
    """One training step on this process."""

    loss: float
    """Mean loss over the global batch's tokens with a label."""
    grad_norm: float | None
    lr: float
    """The rate this step applied."""
    updated: bool
    """False when the optimizer skipped the update (fp16 overflow)."""
    labelled_tokens: int
    """Tokens with a label in the global batch."""
    document_lengths: list[int]
    """Packed documents this process's FLOPs count (empty for fixed-length samples)."""
    flops_shared_by: int
    """Processes sharing those documents' FLOPs."""


def _train(
    run: RunConfig, ctx: ParallelContext, tokenizer, extensions: list[Extension]
) -> TrainSummary:
    # the home model's own megatron config: megatron's schedules read the gradient hooks from
    # it (_connect_schedule_hooks), so it is a copy, and the run's config stays as resolved
    config = run_transformer_config(run, global_groups=own_layouts(run) is None)

    def build_model(*, config, pg_collection=None, distributed_optimizer=None):
        bare = build_gpt_model(
            run=run,
            config=config,
            device=ctx.device,
            pg_collection=pg_collection,
            extensions=extensions,
        )
        return wrap_for_data_parallel(
            model=bare,
            run=run,
            config=config,
            pg_collection=pg_collection,
            distributed_optimizer=distributed_optimizer,
        )

    model = build_model(config=config)
    log_setup(run, ctx, model)
    for notice in notices_for_this_machine(run, cuda=device.on_gpu()):
        logger.info(notice)
    optimizer = build_optimizer(
        model_chunks=[model],
        train=run.train,
        bf16=run.train.bf16,
        fp16=run.train.fp16,
        log_num_zeros_in_grad=run.logging.log_num_zeros_in_grad,
    )
    schedule = schedule_policy(run.checkpoint)
    scheduler = build_lr_scheduler(optimizer=optimizer, train=run.train, schedule=schedule)
    finalizes = any(extension.finalizes_gradients for extension in extensions)
    _connect_schedule_hooks(config, model, optimizer, finalizes_gradients=finalizes)
    progress = TrainProgress()
    source = checkpoint_source(run.checkpoint)  # --load, else --pretrained-checkpoint
    if source is not None:
        if source.scope.progress:
            check_resumable(run)
        if source.flag != "--load":
            logger.info("starting from the weights of %s %s", source.flag, source.root)
        progress = load_checkpoint(
            load_dir=str(source.root),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            schedule=schedule,
            scope=source.scope,
            counts_samples=run.train.sample_based,
        )
    batches = build_batches(
        run, ctx, tokenizer, progress, extensions, haystack_tokens=haystack_tokens(run)
    )
    train_batches, valid_batches = batches.train, batches.valid
    try:
        # a model of another layout (an extension's own) keeps no optimizer state of its own
        others = lambda **kw: build_model(**kw, distributed_optimizer=False)  # noqa: E731
        built = Built(
            run=run, ctx=ctx, model=model, optimizer=optimizer, config=config, build_model=others
        )
        for extension in extensions:
            extension.attach(built)
        session = Session(
            run=run,
            ctx=ctx,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            forward_backward=get_forward_backward_func(),
            forward_step=build_forward_step(ctx.device, vocab_size=run.shape.vocab_size),
            train_batches=train_batches,
            valid_batches=valid_batches,
            retrieval=retrieval_samples(run, tokenizer, batches.haystack),
            extensions=extensions,
            metric_sources=weight_statistics(run, model, optimizer)
            + [source for extension in extensions for source in extension.metric_sources()],
            started_from=source.root if source is not None else None,
        )
        if run.evaluation.skip_train:
            weights_at = latest_iteration(source.root) if source is not None else None
            return evaluate_only(session, progress, iteration=weights_at or 0)
        with StopConditions(run.checkpoint) as stop:
            return _run_steps(session, progress, stop)
    finally:  # a failed run's iterators live on in its traceback: stop their loaders now
        for extension in extensions:
            extension.close()
        close_batch_iterator(train_batches)
        close_batch_iterator(valid_batches)


def _connect_schedule_hooks(config, model, optimizer, *, finalizes_gradients: bool) -> None:
    """Tell megatron-core's schedules how to sync and finalize gradients (through the model's
    own ``TransformerConfig``, where megatron reads them); not to finalize them where an
    extension reduces them itself."""
    config.finalize_model_grads_func = None if finalizes_gradients else finalize_model_grads
    config.no_sync_func = model.no_sync
    if model.ddp_config.overlap_grad_reduce:
        # as Megatron-LM (its default --align-grad-reduce): the pipeline schedules start each
        # chunk's reduction once its last micro-batch's backward is done
        config.grad_sync_func = model.start_grad_sync
    if hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "scale_loss"):
        config.grad_scale_func = optimizer.optimizer.scale_loss


def _train_one_step(s: Session, *, global_batch: int) -> StepResult:
    """Forward / backward over the step's ``global_batch`` samples, then the update."""
    s.model.zero_grad_buffer()
    s.optimizer.zero_grad()
    out = run_global_batch(s, s.train_batches, forward_only=False)
    for extension in s.extensions:
        extension.end_backward()
    maybe_empty_cache(s.run.cleanup, level=1)
    loss = mean_loss(out.pair)
    lr = lr_for_logging(s.optimizer.param_groups)  # the rate this step applies
    updated, grad_norm = s.optimizer.step()
    if updated:
        # a sample-based schedule counts samples (Megatron-LM), an iteration-based one steps
        s.scheduler.step(increment=global_batch if s.run.train.sample_based else 1)
    maybe_empty_cache(s.run.cleanup, level=2)
    device.synchronize()
    return StepResult(
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        updated=updated,
        labelled_tokens=int(out.pair[1].item()),
        document_lengths=out.document_lengths,
        flops_shared_by=out.flops_shared_by,
    )


def _run_steps(s: Session, progress: TrainProgress, stop: StopConditions) -> TrainSummary:
    run = s.run
    reporter = Reporter(
        run=run,
        ctx=s.ctx,
        resume_from=progress.iteration,
        memory=[extension.memory for extension in s.extensions],
    )
    housekeeping = Housekeeping(run, rank=s.ctx.rank)  # --manual-gc, --profile
    housekeeping.start()
    summary = TrainSummary(resumed_at=progress.iteration)
    skipped = 0
    saved_at = progress.iteration  # a resumed run's checkpoint is on disk already
    watch = LossWatch(
        save_dir=run.checkpoint.save,
        saved_at=saved_at if saved_at and run.checkpoint.save == run.checkpoint.load else None,
    )
    # megatron-core's calculator at the samples consumed so far (resumed: the checkpoint's)
    update_num_microbatches(progress.consumed_samples, consistency_check=False)
    num_microbatches = get_num_microbatches()
    try:
        for iteration in range(progress.iteration + 1, run.train.train_iters + 1):
            ramped = update_batch_ramp(progress.consumed_samples, num_microbatches)
            if ramped and run.checkpoint.save and saved_at != progress.iteration:
                # as Megatron-LM: a checkpoint of the steps so far whenever the batch grows
                _save(s, progress)
                saved_at = progress.iteration
                watch.saved(saved_at)
            num_microbatches = get_num_microbatches()
            global_batch = get_current_global_batch_size()
            housekeeping.before_step(iteration)
            for extension in s.extensions:
                extension.begin_step(iteration)
            with device.annotate(f"step {iteration}"):
                start = device.clock()
                step = _train_one_step(s, global_batch=global_batch)
                figures = [(source, source.collect()) for source in s.metric_sources]
                usable = check_finite(run, iteration, step.loss, step.grad_norm)
                skipped += not (usable and step.updated)
                step_time = device.clock() - start
            # one-off work inside the step (planning memory, say) is no part of its time
            step_time -= sum(extension.excluded_time_s() for extension in s.extensions)
            step_tokens = global_batch * run.data.seq_length
            if run.data.variable_seq_lengths:  # documents of any length: count what was trained
                step_tokens = step.labelled_tokens
            summary.record(iteration, step.loss, step_tokens / step_time)
            watch.step(iteration, step.loss)
            progress = TrainProgress(iteration, progress.consumed_samples + global_batch)
            extra = {}
            if run.evaluation.enabled and iteration % run.evaluation.eval_interval == 0:
                with housekeeping.around_evaluation():
                    extra.update(evaluate(s))
            if is_logged(iteration, run) or extra:
                record = StepMetrics(
                    iteration=iteration,
                    loss=step.loss,
                    grad_norm=step.grad_norm,
                    lr=step.lr,
                    step_time_s=step_time,
                    tokens_per_s=step_tokens / step_time,
                    consumed_samples=progress.consumed_samples,
                    skipped_iterations=skipped,
                    global_batch_size=global_batch,
                    extra=extra,
                )
                reporter.report(
                    record,
                    figures,
                    document_lengths=step.document_lengths,
                    flops_shared_by=step.flops_shared_by,
                )
            reason = stop.reason(iteration)
            if reason or save_due(iteration, run):
                _save(s, progress)
                saved_at = iteration
                watch.saved(iteration)
            housekeeping.after_step(iteration)
            if reason:
                logger.info("stopping after iteration %d: %s", iteration, reason)
                summary.stopped_early = True
                break
    finally:
        housekeeping.close()
        reporter.close()
    if (note := watch.closing_note()) is not None:
        logger.warning(note)
    return summary


def _save(s: Session, progress: TrainProgress) -> None:
    with params_in_sync(s.model):  # --overlap-param-gather: no stale weight shards on disk
        save_checkpoint(
            save_dir=s.run.checkpoint.save,
            progress=progress,
            model=s.model,
            optimizer=s.optimizer,
            scheduler=s.scheduler,
            save_optim=s.run.checkpoint.save_optim,
            save_rng=s.run.checkpoint.save_rng,
            model_flags=s.run.model_flags(),
            carried_from=s.started_from,
        )
