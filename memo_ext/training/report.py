"""What a run reports: each logged step's record to the console, the metrics file, TensorBoard
and W&B (:class:`Reporter`), the figures of the weights (:func:`weight_statistics`), the setup
line, and what a finished run hands back to its launcher (:class:`TrainSummary`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memo_ext.config import RunConfig
from memo_ext.extension import MetricSource
from memo_ext.hardware import device_peak_tflops
from memo_ext.shapes import packed_train_flops, train_flops
from memo_ext.training.initialize import ParallelContext
from memo_ext.training.metrics import (
    MetricsWriter,
    StepMetrics,
    TensorBoardWriter,
    WandbWriter,
    cuda_memory,
)
from memo_ext.training.model import count_parameters, params_in_sync
from memo_ext.training.model_stats import params_l2_norm

logger = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """What a finished run reports back to its launcher."""

    iterations: int = 0
    """The last step trained."""
    resumed_at: int = 0
    """The step of the checkpoint the run resumed from (0: a fresh start)."""
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

    def line(self) -> str:
        """The run's last log line: steps, first and last logged loss, median throughput."""
        steps = f"{self.iterations} iterations"
        if self.resumed_at:  # the first loss is the resumed run's, not the start of training
            steps = (
                f"iterations {self.resumed_at + 1}-{self.iterations} (resumed at {self.resumed_at})"
            )
        # the run's first step carries one-time work (compiling, warming caches): left out, as
        # summarize_metrics leaves out the first logged step
        steady = self.tokens_per_s[1:] or self.tokens_per_s
        median = statistics.median(steady)
        first = self.iterations - len(steady) + 1
        over = f"step {first}" if first == self.iterations else f"steps {first}-{self.iterations}"
        return (
            f"done: {steps}, loss {self.first_loss:.4f} -> {self.last_loss:.4f}, "
            f"{median:.0f} tokens/s (median of {over})"
        )


def is_logged(iteration: int, run: RunConfig) -> bool:
    """First step (the starting loss), every ``log_interval`` steps, and the last step."""
    last = run.train.train_iters
    return iteration in (1, last) or iteration % run.logging.log_interval == 0


def write_settings(run: RunConfig) -> None:
    """Every setting of the run to the file beside the metrics file (one console line: the
    setup line after it describes the model and layout)."""
    path = run.logging.settings_file
    if path is None:
        logger.info("settings: not recorded (--metrics-file records them beside its metrics)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(dataclasses.asdict(run), indent=1, default=str) + "\n")
    os.replace(staging, path)
    logger.info("settings: %s", path)


def log_setup(run: RunConfig, ctx: ParallelContext, model: torch.nn.Module) -> None:
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


def weight_statistics(run: RunConfig, model, optimizer) -> list[MetricSource]:
    """--log-params-norm (the weights after the step's update), --log-num-zeros-in-grad
    (the optimizer counts them in its step) and, with --fp16, the loss scale. Every rank
    collects every step: the norm is an all-reduce over the model-parallel ranks."""
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
    if run.train.fp16:  # the scale the next step multiplies its loss by; an overflow halves it
        sources.append(
            MetricSource(
                collect=lambda: {"loss_scale": optimizer.loss_scale},
                describe=lambda v: f"loss scale {v['loss_scale']:g}",
            )
        )
    return sources


@dataclass
class Reporter:
    """Writes a step's record to the console, the metrics file, TensorBoard and W&B (rank 0)."""

    run: RunConfig
    ctx: ParallelContext
    resume_from: int
    memory: list = field(default_factory=list)
    """Callables giving (allocated, reserved) bytes of the step, or ``None``; the first answer
    counts (a feature that serves device memory itself), else torch's CUDA statistics."""

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
        flops_shared_by: int,
    ) -> None:
        """``document_lengths``: packed documents whose FLOPs ``flops_shared_by`` processes
        share (fixed-length samples are counted from the step's global batch)."""
        flops = None
        if self.flops_per_sequence is not None:  # the step's batch (ramp-up: not the full one)
            flops = self.flops_per_sequence * record.global_batch_size / self.ctx.world_size
        elif document_lengths:
            flops = packed_train_flops(
                self.run.shape,
                vocab_size=self.run.model.padded_vocab_size,
                document_lengths=document_lengths,
            )
            flops /= flops_shared_by
        if flops is not None:
            tflops = flops / record.step_time_s / 1e12
            record.tflops_per_device = tflops
            record.mfu = tflops / self.peak if self.peak else None
        memory = next((m for m in (f() for f in self.memory) if m is not None), None)
        record.mem_allocated_bytes, record.mem_reserved_bytes = memory or cuda_memory()
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
