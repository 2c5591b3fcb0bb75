"""MEMO's connection to the trainer (:class:`Memo`, an ``memo_ext.extension.Extension``).

What ``--memo`` changes in a run: ``--memo-chunk-tokens auto`` settled for the run's device
(:meth:`Memo.resolve`); with ``--memo-allocator plan`` the process's allocator replaced before the
run's first tensor (:meth:`Memo.setup`) and MEMO's layer passes recorded, planned and served
(``memo_ext.memo.planned_memory``); every transformer layer built as a MEMO layer
(:meth:`Memo.layer_spec`); MEMO's and the planner's figures in every logged step.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from memo_ext.allocator.core import AllocatorCore
from memo_ext.config import AUTO, RunConfig
from memo_ext.estimate.cost_model import Batch
from memo_ext.extension import (
    Built,
    Extension,
    MetricKey,
    MetricSource,
    PlanningTarget,
    ResolveContext,
)
from memo_ext.features.memo.stage import (
    AUTO_CHUNK_MIN_TOKENS,
    AUTO_CHUNK_SLOWDOWN,
    auto_chunk_tokens,
)
from memo_ext.memo.planned_memory import (
    PlannedMemory,
    format_plan_metrics,
    install_allocator,
    shape_key,
)
from memo_ext.memo.policy import apply_memo, format_memo_metrics, memo_runtime_of
from memo_ext.memo.rules import offload_rule

logger = logging.getLogger(__name__)


class Memo(Extension):
    """Token-wise activation swapping and recomputation in every transformer layer."""

    name = "memo"
    rebuilds_layers = True
    metric_keys = (
        MetricKey(("memo_alpha",), "float", "MEMO's α in use (NaN until `auto` is solved)"),
        MetricKey(
            ("host_offload_bytes", "memo_d2h_bytes"),
            "int",
            "bytes MEMO copied device → host in the step (the same figure twice)",
        ),
        MetricKey(("memo_h2d_bytes",), "int", "bytes MEMO copied host → device in the step"),
        MetricKey(
            ("memo_recomputed_tokens",),
            "int",
            "token positions × sequences MEMO recomputed in the step",
        ),
        MetricKey(("memo_offloaded_layers",), "int", "layer forwards MEMO offloaded in the step"),
        MetricKey(("memo_host_pool_bytes",), "int", "host memory MEMO's pool holds"),
        MetricKey(
            ("memo_device_skeletons",),
            "int",
            "`--memo-chunk-tokens`: offloaded layers whose whole storages stay on the device for "
            "want of host memory",
        ),
        MetricKey(
            ("memo_copy_wait_s",),
            "float",
            "CUDA: seconds the compute stream waited for MEMO's copies in the step",
        ),
        MetricKey(
            ("plan_hit_ratio",),
            "float",
            "`--memo-allocator plan`: requests of the layer passes served at their planned "
            "offsets / (those + the passes' own misses)",
        ),
        MetricKey(
            ("plan_requests", "plan_hits", "plan_hit_bytes", "plan_misses"),
            "int",
            "the step's layer-pass requests, hits (count, bytes) and misses (size, extra, "
            "overlap, stream, no plan)",
        ),
        MetricKey(
            (
                "plan_miss_size",
                "plan_miss_extra",
                "plan_miss_overlap",
                "plan_miss_stream",
                "plan_miss_no_plan",
                "plan_miss_thread",
            ),
            "int",
            "misses by reason; `plan_miss_thread` counts other threads' requests made while a "
            "pass was open (no part of its sequence, not in the ratio)",
        ),
        MetricKey(
            ("plan_unplanned_bytes",),
            "int",
            "bytes of pass tensors the plan leaves to the caching path (they outlive their pass)",
        ),
        MetricKey(
            ("plan_arena_bytes", "plan_arena_peak_bytes"),
            "int",
            "the arena (the largest pass plan's peak) and its peak live bytes in the step",
        ),
        MetricKey(
            ("plan_fallback_peak_bytes", "plan_replans"),
            "int",
            "the caching path's peak live bytes in the step; pass kinds planned again",
        ),
        MetricKey(
            ("plan_time_s",),
            "float",
            "seconds the step spent planning its layer passes (the recording step, re-plans); "
            "left out of `step_time_s`, `tokens_per_s`, `tflops_per_device` and `mfu`",
        ),
    )

    def __init__(self, run: RunConfig):
        super().__init__(run)
        self.core: AllocatorCore | None = None
        self.planned: PlannedMemory | None = None
        self.runtime = None

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return run.memo.enabled

    @property
    def replaces_allocator(self) -> bool:
        return self.run.memo.allocator == "plan"

    def resolve(self, run: RunConfig, context: ResolveContext) -> RunConfig:
        """``--memo-chunk-tokens auto`` as a token count (``auto_chunk_tokens``); an
        ``--memo-offload-rule`` no rule is registered as, refused."""
        offload_rule(run.memo.offload_rule)
        if run.memo.chunk_tokens != AUTO:
            return run
        target = context.target
        chunk = auto_chunk_tokens(
            run.shape,
            run.layout,
            Batch(micro_batch_size=run.train.micro_batch_size),
            seq_length=run.data.seq_length,
            device=target.planned,
            eff=target.efficiency,
        )
        if os.environ.get("RANK", "0") == "0":
            logger.info(_chunk_decision(run, chunk, target))
        return dataclasses.replace(run, memo=dataclasses.replace(run.memo, chunk_tokens=chunk))

    def setup(self) -> None:
        """``--memo-allocator plan``: every allocation of this process through the allocator
        core (it cannot be swapped in once tensors exist on the device)."""
        if self.replaces_allocator:
            self.core = AllocatorCore()
            install_allocator(self.core)

    def layer_spec(self, run: RunConfig, spec, config):
        return apply_memo(spec, run.memo, config)

    def attach(self, built: Built) -> None:
        self.runtime = memo_runtime_of(built.model)
        if self.core is not None:
            memo = built.run.memo
            self.planned = PlannedMemory(
                self.core,
                shape_key=shape_key(built.run),
                cache_dir=memo.plan_cache_dir,
                work_limit=memo.plan_work_limit,
                time_limit_s=memo.plan_time_limit,
                rank=built.ctx.rank,
            )
            self.runtime.passes = self.planned

    def metric_sources(self) -> list[MetricSource]:
        runtime = self.runtime
        sources = [
            MetricSource(
                collect=lambda: runtime.take_metrics() if runtime is not None else {},
                describe=format_memo_metrics,
            )
        ]
        if self.planned is not None:
            sources.append(
                MetricSource(collect=self.planned.step_metrics, describe=format_plan_metrics)
            )
        return sources

    def begin_step(self, iteration: int) -> None:
        if self.planned is not None:
            self.planned.begin_step(iteration)

    def end_backward(self) -> None:
        if self.planned is not None:
            self.planned.end_step()  # the last layer pass ends with the backward

    def end_evaluation(self) -> None:
        if self.planned is not None:
            self.planned.end_evaluation()

    def excluded_time_s(self) -> float:
        """The step's planning (``plan_time_s``): done once, not part of training."""
        return self.planned.planning_s if self.planned is not None else 0.0

    def memory(self) -> tuple[int, int] | None:
        """The planned allocator's bytes (torch's CUDA statistics are the caching allocator's,
        absent once it is replaced)."""
        return self.planned.memory() if self.planned is not None else None


def _chunk_decision(run: RunConfig, chunk: int, target: PlanningTarget) -> str:
    """What ``--memo-chunk-tokens auto`` decided and why, in one line."""
    layout = run.layout
    local = run.data.seq_length // layout.cp // (layout.tp if layout.sp else 1)
    device = target.planned.name
    if target.device is None:
        device += " (no GPU here: the preset auto plans for; --preflight-device names another)"
    if chunk >= local:
        return (
            f"MEMO chunks: none — the whole {local} local tokens per layer pass (auto: no chunk "
            f"from {AUTO_CHUNK_MIN_TOKENS} tokens keeps a layer's matrix products and "
            f"collectives within {AUTO_CHUNK_SLOWDOWN:.0%} of the whole sequence's time on "
            f"{device})"
        )
    return (
        f"MEMO chunks: {chunk} of {local} local tokens (auto: the smallest within "
        f"{AUTO_CHUNK_SLOWDOWN:.0%} of the whole sequence's time on {device})"
    )
