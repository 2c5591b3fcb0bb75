"""The training loop: build everything, run ``train_iters`` optimizer steps, log metrics.

One step = ``num_microbatches`` forward/backward passes through megatron-core's schedule
(1F1B when PP > 1), gradient reduction in ``finalize_model_grads`` (DP × CP sum, SP norm
grads over TP, tied embeddings over PP, division by the global token count), then the
optimizer and the LR schedule. Around it: evaluation on the validation split, checks for
non-finite losses and gradients, checkpoints and early stops, metrics to the console, the
metrics file, TensorBoard and W&B, and the housekeeping of ``memo_ext.training.housekeeping``
(garbage collection, cache emptying, profiling).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from memo_ext.allocator.core import AllocatorCore
from memo_ext.collectives import loss_pair
from memo_ext.config import RunConfig
from memo_ext.config.network import resolve_attention_backend
from memo_ext.data.datasets import close_batch_iterator
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.errors import ReportedError, UsageError
from memo_ext.estimate.preflight import check_preflight
from memo_ext.hardware import device_peak_tflops, device_spec
from memo_ext.hotspa.auto import plan_metrics
from memo_ext.hotspa.engine import HotSPaEngine, format_hotspa_metrics
from memo_ext.mcore.microbatches import StepBatchSizeCalculator, install_step_schedule
from memo_ext.mcore.transformer_config import run_transformer_config
from memo_ext.offload.policy import format_memo_metrics, memo_runtime_of, memo_step_metrics
from memo_ext.shapes import packed_train_flops, train_flops
from memo_ext.training.checkpointing import (
    TrainProgress,
    latest_iteration,
    load_checkpoint,
    prepare_save_dir,
    save_checkpoint,
)
from memo_ext.training.control import StopConditions
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
    shutdown,
)
from memo_ext.training.inputs import build_batches
from memo_ext.training.metrics import (
    MetricsWriter,
    StepMetrics,
    TensorBoardWriter,
    WandbWriter,
    cuda_memory,
)
from memo_ext.training.model import (
    build_gpt_model,
    count_parameters,
    params_in_sync,
    wrap_for_data_parallel,
)
from memo_ext.training.model_stats import params_l2_norm
from memo_ext.training.optimizer import build_lr_scheduler, build_optimizer, lr_for_logging
from memo_ext.training.planned_memory import (
    PlannedMemory,
    format_plan_metrics,
    install_allocator,
    shape_key,
)
from memo_ext.training.resolve import describe_run, resolve_run
from memo_ext.training.step import build_forward_step

logger = logging.getLogger(__name__)


class TrainingDiverged(ReportedError):
    """A non-finite loss or gradient norm; the message points at the last good checkpoint."""


@dataclass
class TrainSummary:
    """What a finished run reports back to its launcher."""

    iterations: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    stopped_early: bool = False

    def record(self, iteration: int, loss: float, tokens_per_s: float) -> None:
        self.iterations = iteration
        self.losses.append(loss)
        self.tokens_per_s.append(tokens_per_s)

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def last_loss(self) -> float:
        return self.losses[-1]


def train(run: RunConfig) -> TrainSummary:
    """Run a whole training job in this process (one rank of a torchrun job).

    ``run`` is the parsed configuration; it is resolved here against its tokenizer and data
    (``memo_ext.training.resolve``) and logged, and nothing changes it afterwards.
    """
    core = _install_planned_allocator(run)  # before the first tensor of the run
    tokenizer = tokenizer_for(run.data)
    run = resolve_run(run, tokenizer=tokenizer)
    if _is_logging_process():
        logger.info("run configuration:\n%s", describe_run(run))
    _maybe_preflight(run)
    init_distributed(timeout_minutes=run.distributed.timeout_minutes)
    try:
        with device_environment():
            ctx = init_model_parallel(
                layout=run.layout,
                seed=run.train.seed,
                timeout_minutes=run.distributed.timeout_minutes,
            )
            # after start-up (process groups made), before the first tensor of the model
            apply_memory_limit(
                run.preflight.memory_limit_gb, device=ctx.device, planned=core is not None
            )
            init_num_microbatches_calculator(
                rank=ctx.rank,
                rampup_batch_size=run.train.rampup_batch_size,
                global_batch_size=run.train.global_batch_size,
                micro_batch_size=run.train.micro_batch_size,
                data_parallel_size=ctx.dp_size,
            )
            if run.train.step_schedule is not None:
                install_step_schedule(
                    StepBatchSizeCalculator(
                        run.train.step_schedule,
                        seq_length=run.data.seq_length,
                        micro_batch_size=run.train.micro_batch_size,
                        data_parallel_size=ctx.dp_size,
                    )
                )
            return _train(run, ctx, tokenizer, core)
    finally:
        lift_memory_limit()  # the clean-up below may need memory (an out-of-memory exit too)
        destroy_num_microbatches_calculator()
        shutdown()


def _install_planned_allocator(run: RunConfig) -> AllocatorCore | None:
    """``--memo-allocator plan``: every allocation of this process through the allocator core
    (it cannot be swapped in once tensors exist on the device)."""
    if not (run.memo.enabled and run.memo.allocator == "plan"):
        return None
    core = AllocatorCore()
    install_allocator(core)
    return core


def _is_logging_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _maybe_preflight(run: RunConfig) -> None:
    """Estimate device and host memory; raise ``PreflightError`` when the run cannot fit.

    Runs before any process group exists (the estimator traces on a fake one); every rank
    reaches the same verdict from the same flags.
    """
    if not run.preflight.enabled or run.hotspa.enabled:  # HotSPa's auto checks each bucket
        return
    if run.offload.enabled:  # it would check the run without offloading and refuse too much
        logger.info("preflight skipped: the estimator does not model %s", run.offload.flag)
        return
    device = device_spec(run.preflight.device) if run.preflight.device else None
    check_preflight(run, device=device)


def _train(
    run: RunConfig, ctx: ParallelContext, tokenizer, core: AllocatorCore | None = None
) -> TrainSummary:
    # the home model's own megatron config: megatron's schedules read the gradient hooks from
    # it (_connect_schedule_hooks), so it is a copy, and the run's config stays as resolved
    config = run_transformer_config(run)
    bare = build_gpt_model(run=run, config=config, device=ctx.device)
    model = wrap_for_data_parallel(model=bare, run=run, config=config)
    _log_setup(run, ctx, model)
    for notice in notices_for_this_machine(run, cuda=torch.cuda.is_available()):
        logger.info(notice)
    optimizer = build_optimizer(
        model_chunks=[model],
        train=run.train,
        bf16=run.train.bf16,
        fp16=run.train.fp16,
        log_num_zeros_in_grad=run.logging.log_num_zeros_in_grad,
    )
    schedule = _schedule_policy(run)
    scheduler = build_lr_scheduler(optimizer=optimizer, train=run.train, schedule=schedule)
    _connect_schedule_hooks(config, model, optimizer, hotspa=run.hotspa.enabled)
    if run.checkpoint.save:
        prepare_save_dir(run.checkpoint.save)
    progress = TrainProgress()
    if run.checkpoint.load:
        _check_resumable(run)
        progress = load_checkpoint(
            load_dir=run.checkpoint.load,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            schedule=schedule,
        )

    session = _Session(
        run=run,
        ctx=ctx,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        forward_backward=get_forward_backward_func(),
        forward_step=build_forward_step(ctx.device, vocab_size=run.shape.vocab_size),
    )
    session.train_batches, session.valid_batches = build_batches(run, ctx, tokenizer, progress)
    session.metric_sources += _weight_statistics(run, model, optimizer)
    if run.memo.enabled:
        session.metric_sources.append(
            MetricSource(collect=lambda: memo_step_metrics(model), describe=format_memo_metrics)
        )
    if core is not None:
        session.planned = PlannedMemory(
            core,
            shape_key=shape_key(run),
            cache_dir=run.memo.plan_cache_dir,
            time_limit_s=run.memo.plan_time_limit,
            rank=ctx.rank,
        )
        memo_runtime_of(model).passes = session.planned
        session.metric_sources.append(
            MetricSource(collect=session.planned.step_metrics, describe=format_plan_metrics)
        )
    if run.hotspa.enabled:
        session.hotspa = _build_hotspa(run, ctx, model, config)
        plan = plan_metrics(run.hotspa)
        session.metric_sources.append(
            MetricSource(
                collect=lambda: {**session.hotspa.step_metrics(), **plan},
                describe=format_hotspa_metrics,
            )
        )
    try:
        with StopConditions(run.checkpoint) as stop:
            return _run_steps(session, progress, stop)
    finally:  # a failed run's iterators live on in its traceback: stop their loaders now
        close_batch_iterator(session.train_batches)
        close_batch_iterator(session.valid_batches)


def _schedule_policy(run: RunConfig) -> str:
    """Whose LR schedule a resumed run follows when its checkpoint's differs."""
    if run.checkpoint.override_opt_param_scheduler:
        return "flags"
    if run.checkpoint.use_checkpoint_opt_param_scheduler:
        return "checkpoint"
    return "strict"


def _check_resumable(run: RunConfig) -> None:
    """A checkpoint past --train-iters would train nothing and exit as if it had (checked on
    the tracker, before the checkpoint is read)."""
    iteration = latest_iteration(Path(run.checkpoint.load))
    if iteration is not None and iteration > run.train.train_iters:
        length = f"--train-iters {run.train.train_iters}"
        if run.train.sample_based:
            length = (
                f"the {run.train.train_iters} steps of --train-samples {run.train.train_samples}"
            )
        flag = "--train-samples" if run.train.sample_based else "--train-iters"
        raise UsageError(
            f"the checkpoint in {run.checkpoint.load} is at iteration {iteration}, past "
            f"{length}; raise {flag} to train further"
        )
    if iteration == run.train.train_iters:
        logger.info("the checkpoint is at iteration %d: training is complete", iteration)


def _build_hotspa(run: RunConfig, ctx: ParallelContext, home_model, home_config) -> HotSPaEngine:
    """Models of the non-home layouts on this process, and the switch plans between them."""

    def build_model(*, config, pg_collection):
        bare = build_gpt_model(
            run=run, device=ctx.device, config=config, pg_collection=pg_collection
        )
        # no optimizer here: gradients are all-reduced whole, then switched home
        return wrap_for_data_parallel(
            model=bare,
            run=run,
            config=config,
            pg_collection=pg_collection,
            distributed_optimizer=False,
        )

    # transformer-engine's attention keeps CP state beyond its cp_group attribute: give
    # CP-only layouts their own model there instead of swapping the home model's group
    te = resolve_attention_backend(run.model.attention_backend) == "te"
    engine = HotSPaEngine(
        run=run,
        home_model=home_model,
        home_config=home_config,
        build_model=build_model,
        share_home_model=not te,
    )
    logger.info(
        "HotSPa: buckets %s in layouts %s (home %s)",
        ",".join(map(str, run.hotspa.buckets)),
        ";".join(rt.name for rt in map(engine.runtimes.get, engine.keys)),
        run.hotspa.home.name,
    )
    return engine


@dataclass
class _Session:
    """What the step loop works with, built once by :func:`_train`."""

    run: RunConfig
    ctx: ParallelContext
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    forward_backward: Callable
    forward_step: Callable
    train_batches: Iterator | None = None
    valid_batches: Iterator | None = None
    document_lengths: list[int] = field(default_factory=list)
    """``--variable-seq-lengths``: the documents of this DP rank's rows in the last step."""
    metric_sources: list[MetricSource] = field(default_factory=list)
    """Per-step figures of the memory / parallelism systems (MEMO, HotSPa)."""
    hotspa: HotSPaEngine | None = None
    """``--hotspa``: runs each step's buckets in their layouts."""
    planned: PlannedMemory | None = None
    """``--memo-allocator plan``: records, plans and serves MEMO's layer passes."""


@dataclass(frozen=True)
class MetricSource:
    """A system's per-step figures: ``collect`` is called once per step (its counters cover that
    step) and its dict joins the logged record; ``describe`` renders it for the console."""

    collect: Callable[[], dict]
    describe: Callable[[dict], str]


def _weight_statistics(run: RunConfig, model, optimizer) -> list[MetricSource]:
    """--log-params-norm (the weights after the step's update) and --log-num-zeros-in-grad
    (the optimizer counts them in its step). Every rank collects every step: the norm is an
    all-reduce over the model-parallel ranks."""
    sources = []
    if run.logging.log_params_norm:

        def params_norm() -> dict:
            with params_in_sync(model):
                return {"params_norm": params_l2_norm(model.parameters())}

        sources.append(
            MetricSource(
                collect=params_norm, describe=lambda v: f"params norm {v['params_norm']:.3f}"
            )
        )
    if run.logging.log_num_zeros_in_grad:
        sources.append(
            MetricSource(
                collect=lambda: {"num_zeros_in_grad": optimizer.num_zeros_in_grad},
                describe=lambda v: f"zeros in grad {v['num_zeros_in_grad']}",
            )
        )
    return sources


def _log_setup(run: RunConfig, ctx: ParallelContext, model: torch.nn.Module) -> None:
    shape = run.shape
    logger.info(
        "world %d = %s | %d layers, hidden %d, heads %d/%d groups, seq %d, vocab %d | %s "
        "parameters on rank 0 | device %s",
        ctx.world_size,
        run.layout.describe(),
        shape.num_layers,
        shape.hidden_size,
        shape.num_attention_heads,
        shape.query_groups,
        run.data.seq_length,
        run.model.padded_vocab_size,
        f"{count_parameters(model):,}",
        ctx.device,
    )


def _connect_schedule_hooks(config, model, optimizer, *, hotspa: bool) -> None:
    """Tell megatron-core's schedules how to sync and finalize gradients (through the model's
    own ``TransformerConfig``, where megatron reads them)."""
    # HotSPa finalizes each layout's gradients itself, once all its buckets have run
    config.finalize_model_grads_func = None if hotspa else finalize_model_grads
    config.no_sync_func = model.no_sync
    if model.ddp_config.overlap_grad_reduce:
        # as Megatron-LM (its default --align-grad-reduce): the pipeline schedules start each
        # chunk's reduction once its last micro-batch's backward is done
        config.grad_sync_func = model.start_grad_sync
    if hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "scale_loss"):
        config.grad_scale_func = optimizer.optimizer.scale_loss


def _reduce_loss(losses: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(loss sum, real tokens) of the global batch, visible on every rank.

    Only last-stage ranks hold losses; every rank of the world joins one all-reduce of the
    pair. TP replicas add identical pairs, which scales both terms alike, so their ratio (the
    mean) and ratios of sums of pairs are unaffected.
    """
    pair = loss_pair(losses)
    if dist.is_initialized():
        dist.all_reduce(pair)
    return pair


def _mean(pair: torch.Tensor) -> float:
    return (pair[0] / pair[1].clamp(min=1)).item()


def _is_logged(iteration: int, run: RunConfig) -> bool:
    """First step (the starting loss), every ``log_interval`` steps, and the last step."""
    last = run.train.train_iters
    return iteration in (1, last) or iteration % run.logging.log_interval == 0


def _forward_backward(s: _Session, batches: Iterator, *, forward_only: bool) -> torch.Tensor:
    """One global batch through megatron's schedule; its (loss sum, real tokens).

    A training step takes the micro-batches of megatron-core's calculator (fewer while
    --rampup-batch-size ramps up); evaluation always the full global batch, as Megatron-LM.
    """
    num_microbatches = s.run.num_microbatches if forward_only else get_num_microbatches()
    if s.hotspa is not None:
        buckets = next(batches)
        s.document_lengths = [n for bucket in buckets for n in bucket.document_lengths]
        pair = s.hotspa.step(buckets, s.forward_step)
        if dist.is_initialized():
            dist.all_reduce(pair)
        return pair
    if s.run.data.variable_seq_lengths:
        # one step's packed rows: as many on every DP rank, but not the same count every step
        rows = next(batches)
        batches, num_microbatches = iter(rows), len(rows)
        s.document_lengths = [
            int(n) for row in rows for n in row["cu_seqlens"].diff().tolist() if n > 0
        ]
    losses = s.forward_backward(
        forward_step_func=s.forward_step,
        data_iterator=batches,
        model=[s.model],
        num_microbatches=num_microbatches,
        seq_length=s.run.data.seq_length,
        micro_batch_size=s.run.train.micro_batch_size,
        forward_only=forward_only,
    )
    return _reduce_loss(losses if parallel_state.is_pipeline_last_stage() else [])


def _train_one_step(
    s: _Session, *, global_batch: int
) -> tuple[float, float | None, float, bool, int]:
    """Forward / backward over the step's ``global_batch`` samples, then the update.

    Returns (loss, grad norm, lr, updated, tokens with a label in the global batch).
    """
    s.model.zero_grad_buffer()
    s.optimizer.zero_grad()
    pair = _forward_backward(s, s.train_batches, forward_only=False)
    if s.planned is not None:
        s.planned.end_step()  # the last layer pass ends with the backward
    maybe_empty_cache(s.run.cleanup, level=1)
    loss = _mean(pair)
    lr = lr_for_logging(s.optimizer.param_groups)  # the rate this step applies
    updated, grad_norm = s.optimizer.step()
    if updated:
        # a sample-based schedule counts samples (Megatron-LM), an iteration-based one steps
        s.scheduler.step(increment=global_batch if s.run.train.sample_based else 1)
    maybe_empty_cache(s.run.cleanup, level=2)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss, grad_norm, lr, updated, int(pair[1].item())


def evaluate(s: _Session) -> dict[str, float]:
    """Mean loss over ``eval_iters`` validation global batches, and its perplexity."""
    s.model.eval()
    pair = loss_pair([])
    with torch.no_grad():
        for _ in range(s.run.evaluation.eval_iters):
            pair += _forward_backward(s, s.valid_batches, forward_only=True)
            maybe_empty_cache(s.run.cleanup, level=1)
    s.model.train()
    loss = _mean(pair)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}


def _check_finite(s: _Session, iteration: int, loss: float, grad_norm: float | None) -> bool:
    """True when the step is usable; raise (or, when skipping, return False) otherwise."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return True
    if not s.run.train.check_for_nan_in_loss_and_grad:
        return True
    if s.run.train.skip_iterations_with_nan:
        logger.warning(
            "iteration %d: loss %s, grad norm %s; update skipped", iteration, loss, grad_norm
        )
        return False
    raise TrainingDiverged(
        f"iteration {iteration}: loss {loss}, gradient norm {grad_norm}; "
        + _last_good_checkpoint_hint(s.run)
    )


def _last_good_checkpoint_hint(run: RunConfig) -> str:
    for directory in (run.checkpoint.save, run.checkpoint.load):
        if directory and (it := latest_iteration(Path(directory))) is not None:
            return (
                f"the last good checkpoint is iteration {it} in {directory} "
                f"(resume with --load {directory}, e.g. with a lower --lr)"
            )
    return "no checkpoint was saved (use --save DIR --save-interval N to keep one)"


@dataclass
class _Reporter:
    """Writes a step's record to the console, the metrics file, TensorBoard and W&B (rank 0)."""

    run: RunConfig
    ctx: ParallelContext
    resume_from: int
    memory: Callable[[], tuple[int, int]] | None = None
    """(allocated, reserved) bytes of the step, when the planned allocator serves them (torch's
    CUDA statistics are the caching allocator's, absent once it is replaced)."""

    def __post_init__(self) -> None:
        run, rank0 = self.run, self.ctx.is_logging_rank
        self.writer = MetricsWriter(
            run.logging.metrics_file if rank0 else None, resume_from=self.resume_from
        )
        self.board = TensorBoardWriter(run.logging.tensorboard_dir if rank0 else None)
        self.wandb = _wandb_writer(run) if rank0 else WandbWriter(project=None)
        self.peak = device_peak_tflops(run.logging.device_peak_tflops)
        self.flops_per_sequence = None  # packed documents are counted per step, one by one
        if not run.data.variable_seq_lengths:
            self.flops_per_sequence = train_flops(
                run.shape,
                vocab_size=run.model.padded_vocab_size,
                seq_length=run.data.seq_length,
                sequences=1,
            )

    def report(
        self,
        record: StepMetrics,
        figures: list[tuple[MetricSource, dict]],
        *,
        document_lengths: list[int],
    ) -> None:
        flops = None
        if self.flops_per_sequence is not None:  # the step's batch (ramp-up: not the full one)
            flops = self.flops_per_sequence * record.global_batch_size / self.ctx.world_size
        elif document_lengths:
            # this DP rank's documents, shared by the model-parallel ranks of its replica
            # (with HotSPa: the whole batch's documents, shared by every process)
            model_parallel = self.ctx.world_size // self.ctx.dp_size
            if self.run.hotspa.enabled:
                model_parallel = self.ctx.world_size
            flops = packed_train_flops(
                self.run.shape,
                vocab_size=self.run.model.padded_vocab_size,
                document_lengths=document_lengths,
            )
            flops /= model_parallel
        if flops is not None:
            tflops = flops / record.step_time_s / 1e12
            record.tflops_per_device = tflops
            record.mfu = tflops / self.peak if self.peak else None
        memory = self.memory() if self.memory is not None else cuda_memory()
        record.mem_allocated_bytes, record.mem_reserved_bytes = memory
        for _, values in figures:
            record.extra.update(values)
        self.writer.write(record.to_json())
        self.board.write(record.to_json())
        self.wandb.write(record.to_json())
        throughput = self.run.logging.log_throughput
        line = [record.console_line(self.run.train.train_iters, throughput=throughput)]
        line += [source.describe(values) for source, values in figures]
        logger.info(" | ".join(filter(None, line)))

    def close(self) -> None:
        self.board.close()
        self.wandb.close()


def _wandb_writer(run: RunConfig) -> WandbWriter:
    """--wandb-project's run, configured with every setting of ``run``; its local files under
    --wandb-save-dir, else --save/wandb (as Megatron-LM), else wandb's default (./wandb)."""
    logging_cfg, save = run.logging, run.checkpoint.save
    save_dir = logging_cfg.wandb_save_dir or (str(Path(save) / "wandb") if save else None)
    return WandbWriter(
        project=logging_cfg.wandb_project,
        name=logging_cfg.wandb_exp_name,
        save_dir=save_dir,
        entity=logging_cfg.wandb_entity,
        config=dataclasses.asdict(run) if logging_cfg.wandb_project else None,
    )


def _run_steps(s: _Session, progress: TrainProgress, stop: StopConditions) -> TrainSummary:
    run = s.run
    reporter = _Reporter(
        run=run,
        ctx=s.ctx,
        resume_from=progress.iteration,
        memory=s.planned.memory if s.planned is not None else None,
    )
    housekeeping = Housekeeping(run, rank=s.ctx.rank)  # --manual-gc, --profile
    housekeeping.start()
    summary = TrainSummary()
    skipped = 0
    saved_at = progress.iteration  # a resumed run's checkpoint is on disk already
    # megatron-core's calculator at the samples consumed so far (resumed: the checkpoint's)
    update_num_microbatches(progress.consumed_samples, consistency_check=False)
    num_microbatches = get_num_microbatches()
    try:
        for iteration in range(progress.iteration + 1, run.train.train_iters + 1):
            ramped = _update_batch_ramp(progress.consumed_samples, num_microbatches)
            if ramped and run.checkpoint.save and saved_at != progress.iteration:
                # as Megatron-LM: a checkpoint of the steps so far whenever the batch grows
                _save(s, progress)
                saved_at = progress.iteration
            num_microbatches = get_num_microbatches()
            global_batch = get_current_global_batch_size()
            housekeeping.before_step(iteration)
            if s.planned is not None:
                s.planned.begin_step(iteration)
            start = time.perf_counter()
            loss, grad_norm, lr, updated, labelled_tokens = _train_one_step(
                s, global_batch=global_batch
            )
            figures = [(source, source.collect()) for source in s.metric_sources]
            skipped += not (_check_finite(s, iteration, loss, grad_norm) and updated)
            step_time = time.perf_counter() - start
            step_tokens = global_batch * run.data.seq_length
            if run.data.variable_seq_lengths:  # documents of any length: count what was trained
                step_tokens = labelled_tokens
            summary.record(iteration, loss, step_tokens / step_time)
            progress = TrainProgress(iteration, progress.consumed_samples + global_batch)
            extra = {}
            if run.evaluation.enabled and iteration % run.evaluation.eval_interval == 0:
                with housekeeping.around_evaluation():
                    extra.update(evaluate(s))
            if _is_logged(iteration, run) or extra:
                record = StepMetrics(
                    iteration=iteration,
                    loss=loss,
                    grad_norm=grad_norm,
                    lr=lr,
                    step_time_s=step_time,
                    tokens_per_s=step_tokens / step_time,
                    consumed_samples=progress.consumed_samples,
                    skipped_iterations=skipped,
                    global_batch_size=global_batch,
                    extra=extra,
                )
                reporter.report(record, figures, document_lengths=s.document_lengths)
            reason = stop.reason(iteration)
            if reason or _save_due(iteration, run):
                _save(s, progress)
                saved_at = iteration
            housekeeping.after_step(iteration)
            if reason:
                logger.info("stopping after iteration %d: %s", iteration, reason)
                summary.stopped_early = True
                break
    finally:
        housekeeping.close()
        reporter.close()
    return summary


def _update_batch_ramp(consumed_samples: int, num_microbatches: int) -> bool:
    """Move megatron-core's calculator to the batch of ``consumed_samples`` (Megatron-LM's
    order: unchecked, then checked); True when the micro-batches per step changed."""
    update_num_microbatches(consumed_samples, consistency_check=False, verbose=True)
    changed = get_num_microbatches() != num_microbatches
    # every batch of the ramp splits into micro-batches × DP: RunConfig checked START and INCR
    update_num_microbatches(consumed_samples, consistency_check=True)
    return changed


def _save(s: _Session, progress: TrainProgress) -> None:
    with params_in_sync(s.model):  # --overlap-param-gather: no stale weight shards on disk
        save_checkpoint(
            save_dir=s.run.checkpoint.save,
            progress=progress,
            model=s.model,
            optimizer=s.optimizer,
            scheduler=s.scheduler,
        )


def _save_due(iteration: int, run: RunConfig) -> bool:
    """At every ``--save-interval`` and at the end of training, when ``--save`` is set."""
    ckpt = run.checkpoint
    if not ckpt.save:
        return False
    if iteration == run.train.train_iters:
        return True
    return bool(ckpt.save_interval) and iteration % ckpt.save_interval == 0
