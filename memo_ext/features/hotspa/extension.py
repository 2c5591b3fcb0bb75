"""HotSPa's connection to the trainer (:class:`HotSPa`, an ``memo_ext.extension.Extension``).

What ``--hotspa`` changes in a run: each bucket's layout settled (``auto``: by the estimator, from
a sample of the run's first global batches) and home, the longest bucket's layout, made the
run's layout (:meth:`HotSPa.resolve`); per step, documents grouped into length buckets and
packed in each bucket's layout (:meth:`HotSPa.batches`); the step's passes run bucket by bucket,
each in its layout, with weights switched in and gradients back to home
(:meth:`HotSPa.forward_backward`, ``memo_ext.hotspa.engine``), which also reduces the gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator

import torch.distributed as dist

from memo_ext.config import RunConfig, resolve_attention_backend
from memo_ext.extension import (
    Built,
    Extension,
    MetricKey,
    MetricSource,
    ResolveContext,
    StepLoss,
)
from memo_ext.features.hotspa import auto
from memo_ext.features.megatron import run_transformer_config
from memo_ext.hotspa.buckets import hotspa_step_batches
from memo_ext.hotspa.engine import HotSPaEngine, format_hotspa_metrics

logger = logging.getLogger(__name__)


class HotSPa(Extension):
    """Length buckets, each trained in its own parallel layout of the same processes."""

    name = "hotspa"
    flag = "--hotspa"
    own_layouts = True  # each bucket's model in its layout
    finalizes_gradients = True  # each layout's gradients once all its buckets have run
    metric_keys = (
        MetricKey(
            ("hotspa_bucket_rows", "hotspa_bucket_documents"),
            "list[int]",
            "packed rows and documents per bucket in this step (empty buckets: 0)",
        ),
        MetricKey(
            ("hotspa_weight_switch_bytes", "hotspa_grad_switch_bytes"),
            "int",
            "bytes sent between processes by the whole job for the weight switches (home → "
            "bucket layouts) and the gradient switches (back)",
        ),
        MetricKey(
            ("hotspa_switch_bytes_sent", "hotspa_switch_bytes_reused"),
            "int",
            "this process: bytes it sent, and bytes it copied from shards it already held",
        ),
        MetricKey(("hotspa_switch_s",), "float", "this process's time in switches"),
        MetricKey(
            ("hotspa_working_copy_bytes",),
            "int",
            "this process: the most bytes of non-home working copies (weights + gradient "
            "buffers) held at once during the step; 0 when none ran",
        ),
        MetricKey(
            ("hotspa_plan",),
            "str",
            "`switch`, or `single-layout` when `auto` found that switching does not pay",
        ),
        MetricKey(
            ("hotspa_predicted_gain",),
            "float | null",
            "the estimator's predicted speed-up of the layouts in use over one layout for every "
            "bucket (empty without a device to predict for)",
        ),
    )

    def __init__(self, run: RunConfig):
        super().__init__(run)
        self.engine: HotSPaEngine | None = None
        self.plan_figures: dict = {}
        self.world_size = run.world_size

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return run.hotspa.enabled

    def resolve(self, run: RunConfig, context: ResolveContext) -> RunConfig:
        """Each bucket's layout (``auto``: by the estimator) checked against device memory, and
        home as the run's layout."""
        return resolve_layouts(run, context)

    def model_tp_sizes(self, run: RunConfig) -> tuple[int, ...]:
        """Each bucket layout's TP (its model shares the home model's vocabulary)."""
        return tuple(layout.tp for layout in run.hotspa.strategies or ())

    def preflight_skip_reason(self, run: RunConfig) -> str | None:
        return "HotSPa's layouts were checked bucket by bucket when they were chosen"

    def attach(self, built: Built) -> None:
        """Models of the non-home layouts on this process, and the switch plans between them."""
        run = built.run
        # transformer-engine's attention keeps CP state beyond its cp_group attribute: give
        # CP-only layouts their own model there instead of swapping the home model's group
        te = resolve_attention_backend(run.model.attention_backend) == "te"
        own = run.recompute.granularity or "none"
        methods = run.hotspa.recompute or [None] * len(run.hotspa.strategies)
        self.engine = HotSPaEngine(
            variants=[
                (layout, None if method == own else method)
                for layout, method in zip(run.hotspa.strategies, methods)
            ],
            home_model=built.model,
            home_config=built.config,
            config_for=lambda layout, method: run_transformer_config(
                run, layout, recompute=method, global_groups=False
            ),
            build_model=built.build_model,
            gated=run.shape.swiglu,
            share_home_model=not te,
        )
        self.plan_figures = auto.plan_metrics(run.hotspa)
        self.world_size = built.ctx.world_size
        logger.info(
            "HotSPa: buckets %s in layouts %s (home %s)",
            ",".join(map(str, run.hotspa.buckets)),
            ";".join(rt.name for rt in map(self.engine.runtimes.get, self.engine.keys)),
            run.hotspa.home.name,
        )

    def batches(self, run: RunConfig, documents, *, rank: int, consumed_documents: int):
        """This process's rows of each non-empty bucket, in the bucket's layout."""
        hot = run.hotspa
        return hotspa_step_batches(
            documents,
            bounds=hot.buckets,
            layouts=hot.strategies,
            rank=rank,
            global_batch_size=run.train.global_batch_size,
            seed=run.train.seed,
            consumed_documents=consumed_documents,
            backfill=hot.backfill,
        )

    def metric_sources(self) -> list[MetricSource]:
        return [
            MetricSource(
                collect=lambda: {**self.engine.step_metrics(), **self.plan_figures},
                describe=format_hotspa_metrics,
            )
        ]

    def forward_backward(self, batches: Iterator, forward_step: Callable) -> StepLoss:
        buckets = next(batches)
        pair = self.engine.step(buckets, forward_step)
        if dist.is_initialized():
            dist.all_reduce(pair)
        # the whole batch's documents, whose FLOPs every process shares
        lengths = [n for bucket in buckets for n in bucket.document_lengths]
        return StepLoss(pair=pair, document_lengths=lengths, flops_shared_by=self.world_size)


def resolve_layouts(run: RunConfig, context: ResolveContext) -> RunConfig:
    """``run`` with HotSPa's layouts chosen or checked for ``context.target`` (see
    :meth:`HotSPa.resolve`)."""
    hot, target = run.hotspa, context.target
    if target.device is None and hot.strategies is not None:  # nothing to check them on
        return dataclasses.replace(run, layout=hot.home)
    # one sample of the run's first global batches, packed both ways
    lengths = auto.sampled_lengths(
        context.documents(),
        seq_length=hot.buckets[-1],
        global_batch_size=run.train.global_batch_size,
        seed=run.train.seed,
    )
    stats = auto.length_statistics(lengths, bounds=hot.buckets, backfill=hot.backfill)
    # the single-layout alternative: every document packed into --seq-length rows
    (single,) = auto.length_statistics(lengths, bounds=hot.buckets[-1:], backfill=hot.backfill)
    common = dict(
        model=run.shape,
        device=target.planned,
        bounds=hot.buckets,
        stats=stats,
        single=single if len(hot.buckets) > 1 else None,
        method=run.recompute.granularity or "none",
        efficiency=target.efficiency,
        # the working copy's gradient buffer has the dtype home's has
        copy_bytes_per_param=2 + (2 if run.distributed.grad_reduce_in_bf16 else 4),
    )
    if hot.strategies is None:
        plan = auto.choose_strategies(
            world_size=run.world_size,
            mode=hot.mode,
            # layouts with a model of their own may recompute less (or more) than home
            recompute_choices=auto.AUTO_RECOMPUTE,
            **common,
        )
        own = common["method"]
        hot = dataclasses.replace(
            hot,
            buckets=tuple(plan.bounds),
            strategies=tuple(plan.layouts),
            recompute=tuple(m if m != own else None for m in plan.methods),
        )
        if not any(hot.recompute):
            hot = dataclasses.replace(hot, recompute=None)
    else:
        plan = auto.evaluate_strategies(layouts=hot.strategies, recompute=hot.recompute, **common)
    hot = dataclasses.replace(
        hot,
        predicted_step_s=plan.step_s,
        predicted_single_layout_s=plan.baseline.step_s if plan.baseline else None,
    )
    if os.environ.get("RANK", "0") == "0":
        _log_plan(plan, hot, device_name=target.planned.name)
        _log_one_bucket(plan, requested=run.hotspa.buckets, stats=stats, backfill=hot.backfill)
    return dataclasses.replace(run, hotspa=hot, layout=hot.home)


def _log_one_bucket(plan, *, requested, stats, backfill: bool) -> None:
    """Why ``auto`` runs every document in one bucket when several were asked for: the rows
    each asked-for bucket gets from this data, and the margin switching had to beat."""
    if not plan.single_layout or len(requested) < 2:
        return
    rows = " / ".join(f"{s.rows:.1f}" for s in stats)
    sparse = min(stats, key=lambda s: s.rows).rows < 1
    note = (
        " (with backfill, short documents fill the room long ones leave; "
        "--no-hotspa-backfill keeps them in their own buckets)"
        if sparse and backfill
        else ""
    )
    logger.info(
        "HotSPa: --hotspa-buckets %s runs as one bucket of %d tokens in %s: this data gives "
        "the buckets %s rows per step%s, and switching layouts is not predicted %.0f%% faster",
        ",".join(map(str, requested)),
        plan.bounds[0],
        plan.layouts[0].name,
        rows,
        note,
        100 * auto.SWITCH_MARGIN,
    )


def _log_plan(plan, hot, *, device_name: str) -> None:
    logger.info("HotSPa layouts, predicted for %s:\n%s", device_name, auto.describe(plan))
    if plan.baseline is not None and plan.predicted_gain < 1.0:
        logger.warning(
            "--hotspa-strategies %s is predicted slower than one layout for every bucket: "
            "%.3g s per step against %.3g s for %s (%.2f×); --hotspa-strategies auto picks "
            "the faster",
            hot.strategy_spec,
            plan.step_s,
            plan.baseline.step_s,
            plan.baseline.layouts[0].name,
            plan.predicted_gain,
        )
