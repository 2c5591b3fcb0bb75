"""``--hotspa-strategies auto``: each bucket's layout from the estimator's cost model.

Inputs: the model shape, a device preset, the bucket bounds and each bucket's statistics
(:class:`BucketStats`: rows in every sampled step, attention share and fill, measured by packing
the run's first global batches, :func:`bucket_statistics`). For every candidate home layout that
fits the longest bucket, each other bucket takes the layout (and, for a layout with a model of
its own, the recomputation) with the least expected time per step — the estimator's time for
its rows, plus its own gradient reduction and the switch when it is not on the home model, paid
in the steps where it has rows — among those that fit device memory next to home's model
states; the home with the least total wins. A bucket that fits no layout is refused with the
numbers.

Never slower than one layout: given the statistics of packing every document into
``--seq-length`` rows, the best single layout is priced too and chosen unless switching is
predicted :data:`SWITCH_MARGIN` faster (:attr:`StrategyPlan.baseline`, ``predicted_gain``).

Candidates are DP × TP × PP × CP splits of the world with TP a power of two inside a node, CP a
power of two and SP on with TP > 1. A layout with home's TP and PP runs on the home model itself
(only the CP group changes: dynamic CP), so it costs no switch and no working copy. In
``dynamic-cp`` mode every bucket must be such a layout; in ``switch`` mode any layout goes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from memo_ext.data.documents import DocumentSource, global_batches
from memo_ext.errors import UsageError
from memo_ext.estimate.cost_model import (
    Batch,
    Efficiency,
    Estimate,
    EstimateError,
    collective_latency_s,
    estimate,
)
from memo_ext.features.recompute.method import recompute_method
from memo_ext.hardware import DeviceSpec
from memo_ext.hotspa.buckets import bucket_rows
from memo_ext.parallel import LayoutError, ParallelLayout
from memo_ext.shapes import ModelShape

logger = logging.getLogger(__name__)

WORKING_COPY_BYTES_PER_PARAM = 2 + 4
"""A non-home layout's bf16 working weight and fp32 gradient, per parameter it holds (2 + 2
with ``--grad-reduce-in-bf16``). It is held only while the layout's buckets run."""
MODES = ("switch", "dynamic-cp")
AUTO_RECOMPUTE = ("none", "full")
"""The recomputations the trainer's ``auto`` may give a layout with a model of its own."""
SWITCH_MARGIN = 0.02
"""Switching must be predicted this much faster than the best single layout to be chosen: its
extra costs (more models, switches, a pipeline fill and a partly empty row per bucket) are the
least certain part of the prediction."""
SAMPLED_STEPS = 32
"""Global batches packed to measure the expected rows per bucket."""


class StrategyError(UsageError):
    """No layout can run a bucket; the message gives the numbers."""


@dataclass(frozen=True)
class BucketChoice:
    """One bucket's layout and its predicted cost per step."""

    length: int
    rows: float
    """Expected rows per step."""
    layout: ParallelLayout
    compute_s: float
    """Predicted forward / backward time of the bucket's rows."""
    sync_s: float
    """Its own gradient all-reduce (0 on the home model, which reduces once for all)."""
    switch_s: float
    """Predicted weight + gradient switch time (0 on the home model)."""
    peak_bytes: int
    method: str = "none"
    """Activation recomputation of the layout's model (a ``--recompute-granularity`` value, or
    ``none``: ``memo_ext.features.recompute``)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.sync_s + self.switch_s


def predicted_step_s(choices: Sequence[BucketChoice], *, home_sync_s: float) -> float:
    """Predicted step: every bucket that has rows, plus one gradient reduction on home."""
    return sum(c.total_s for c in choices if c.rows > 0) + home_sync_s


@dataclass(frozen=True)
class StrategyPlan:
    """One layout per bucket (the last is home) and the predicted cost of a step."""

    choices: list[BucketChoice]
    home_sync_s: float
    """The home model's gradient reduction, once per step."""
    baseline: StrategyPlan | None = None
    """The single-layout plan this one was compared with (every document packed into
    ``--seq-length`` rows in the best one layout); ``None`` when no comparison was made."""

    @property
    def layouts(self) -> list[ParallelLayout]:
        return [c.layout for c in self.choices]

    @property
    def bounds(self) -> list[int]:
        return [c.length for c in self.choices]

    @property
    def methods(self) -> list[str]:
        """Each bucket's recomputation (``none``, ``selective``, ``full``)."""
        return [c.method for c in self.choices]

    @property
    def single_layout(self) -> bool:
        """One bucket at ``--seq-length`` in one layout: no switching at all."""
        return len(self.choices) == 1

    @property
    def predicted_gain(self) -> float:
        """Predicted speed-up over :attr:`baseline` (1.0 without one)."""
        return self.baseline.step_s / self.step_s if self.baseline else 1.0

    @property
    def step_s(self) -> float:
        return predicted_step_s(self.choices, home_sync_s=self.home_sync_s)

    @property
    def switch_s(self) -> float:
        return sum(c.switch_s for c in self.choices if c.rows > 0)


@dataclass(frozen=True)
class BucketStats:
    """What one bucket holds per step, on average over the sampled global batches."""

    rows: float
    """Packed rows per step."""
    attention_fraction: float
    """``Σ len² / length²`` over its rows' documents, per row: the share of a full causal
    row's attention that packed documents compute (1 when a document fills the row)."""
    fill: float = 1.0
    """``Σ len / length`` per row: the share of the row's tokens that are real (the rest is
    padding). With ``attention_fraction`` it gives the documents' typical length, which sets
    how efficiently the attention kernels run on them."""
    step_rows: tuple[int, ...] = ()
    """Rows in each sampled step (empty: every step holds ``rows``). A bucket pays its fixed
    costs (a pipeline fill, a partly used last micro-batch per DP rank, its gradient reduction
    and switch) only in the steps where it has rows."""

    def slots(self, layout: ParallelLayout) -> float:
        """Expected 1F1B slots per step in ``layout``: per DP rank ``⌈rows / DP⌉``
        micro-batches plus the pipeline's fill, in the steps that have rows."""
        steps = self.step_rows or (self.rows,)
        return sum(math.ceil(r / layout.dp) + layout.pp - 1 for r in steps if r > 0) / len(steps)

    @property
    def active(self) -> float:
        """Share of steps in which the bucket has rows."""
        steps = self.step_rows or (self.rows,)
        return sum(1 for r in steps if r > 0) / len(steps)


def bucket_statistics(
    source: DocumentSource,
    *,
    bounds: Sequence[int],
    global_batch_size: int,
    seed: int,
    steps: int = SAMPLED_STEPS,
    backfill: bool = True,
) -> list[BucketStats]:
    """Rows and attention share per bucket over the first ``steps`` global batches of the run,
    packed as the trainer packs them (``memo_ext.hotspa.buckets.bucket_rows``, CP = 1)."""
    lengths = sampled_lengths(
        source,
        seq_length=bounds[-1],
        global_batch_size=global_batch_size,
        seed=seed,
        steps=steps,
    )
    return length_statistics(lengths, bounds=bounds, backfill=backfill)


def sampled_lengths(
    source: DocumentSource,
    *,
    seq_length: int,
    global_batch_size: int,
    seed: int,
    steps: int = SAMPLED_STEPS,
) -> list[list[int]]:
    """The document lengths of the run's first ``steps`` global batches, one list per step."""
    batches = global_batches(
        source, global_batch_size=global_batch_size, seq_length=seq_length, seed=seed
    )
    return [[len(d) for d in documents] for _, documents in zip(range(steps), batches)]


def length_statistics(
    per_step: Sequence[Sequence[int]], *, bounds: Sequence[int], backfill: bool = True
) -> list[BucketStats]:
    """:class:`BucketStats` of the steps' documents (``per_step``: lengths per step) packed into
    ``bounds`` as the trainer packs them."""
    rows = [0] * len(bounds)
    squares = [0.0] * len(bounds)
    tokens = [0.0] * len(bounds)
    counts: list[list[int]] = [[] for _ in bounds]
    for lengths in per_step:
        for b, groups in enumerate(bucket_rows(lengths, bounds, backfill=backfill)):
            rows[b] += len(groups)
            counts[b].append(len(groups))
            squares[b] += sum(lengths[i] ** 2 for g in groups for i in g) / bounds[b] ** 2
            tokens[b] += sum(lengths[i] for g in groups for i in g) / bounds[b]
    steps = max(1, len(per_step))
    return [
        BucketStats(
            rows=r / steps,
            attention_fraction=(sq / r if r else 1.0),
            fill=(t / r if r else 1.0),
            step_rows=tuple(c),
        )
        for r, sq, t, c in zip(rows, squares, tokens, counts)
    ]


def expected_rows(source: DocumentSource, **kwargs) -> list[float]:
    """Mean packed rows per bucket and step (see :func:`bucket_statistics`)."""
    return [stats.rows for stats in bucket_statistics(source, **kwargs)]


def candidate_layouts(
    model: ModelShape,
    *,
    world_size: int,
    gpus_per_node: int,
    length: int,
    max_cp: int | None = None,
):
    """DP × TP × PP × CP splits of the world megatron-core can run on a ``length`` bucket
    (CP at most ``max_cp`` when given)."""
    powers = [1 << k for k in range(world_size.bit_length()) if world_size % (1 << k) == 0]
    for tp in (t for t in powers if t <= gpus_per_node):
        for cp in (c for c in powers if max_cp is None or c <= max_cp):
            rest = world_size // (tp * cp) if world_size % (tp * cp) == 0 else 0
            for pp in (p for p in range(1, rest + 1) if rest % p == 0):
                layout = ParallelLayout(dp=rest // pp, tp=tp, pp=pp, cp=cp, sp=tp > 1)
                try:
                    layout.check_fits(model, length)
                except LayoutError:
                    continue
                yield layout


def shares_home(layout: ParallelLayout, home: ParallelLayout) -> bool:
    """Runs on the home model (dynamic CP): the same TP and PP."""
    return (layout.tp, layout.pp) == (home.tp, home.pp)


def _microbatches(stats: BucketStats, layout: ParallelLayout) -> int:
    """Micro-batches per DP rank that memory is sized for: the fullest sampled step's (under
    PP, how many are in flight at once depends on it)."""
    return max(1, math.ceil(max(stats.step_rows or (stats.rows,)) / layout.dp))


def _estimate(
    model, device, layout: ParallelLayout, *, length: int, stats: BucketStats, eff, method="none"
) -> Estimate:
    """The estimator on one bucket's rows in ``layout``: memory for its fullest step; the time
    is rescaled to the expected step by :func:`_choice`."""
    microbatches = _microbatches(stats, layout)
    batch = Batch(micro_batch_size=1, num_microbatches=microbatches, distributed_optimizer=False)
    return estimate(
        model=model,
        device=device,
        layout=layout,
        batch=batch,
        method=recompute_method(method),
        seq_length=length,
        host_memory_bytes=1 << 40,
        efficiency=replace(eff, attention_fraction=stats.attention_fraction, fill=stats.fill),
    )


def _switch_s(est: Estimate, device: DeviceSpec, world_size: int, copy_bytes: int) -> float:
    link = device.nvlink_gbps if world_size <= device.gpus_per_node else device.internode_gbps
    latency = collective_latency_s(world_size, device)
    # weights home → layout and gradients back: one batched exchange each way
    return 2 * latency + est.params_per_gpu * copy_bytes / (link * 1e9)


def _options(model, device, *, length, stats, world_size, eff, method, max_cp=None, methods=()):
    """(layout, estimate) of every candidate layout the estimator can price for one bucket, with
    the run's ``method`` and each of ``methods`` (``Estimate.method`` tells them apart)."""
    options = []
    for layout in candidate_layouts(
        model,
        world_size=world_size,
        gpus_per_node=device.gpus_per_node,
        length=length,
        max_cp=max_cp,
    ):
        for m in dict.fromkeys((method, *methods)):
            try:
                est = _estimate(
                    model, device, layout, length=length, stats=stats, eff=eff, method=m
                )
            except EstimateError:
                continue
            options.append((layout, est))
    if not options:
        raise StrategyError(
            f"no DP × TP × PP × CP layout of {world_size} processes can run "
            f"the {length}-token bucket of {model.name}"
        )
    return options


def choose_strategies(
    *,
    model: ModelShape,
    device: DeviceSpec,
    bounds: Sequence[int],
    stats: Sequence[BucketStats],
    world_size: int,
    mode: str = "switch",
    method: str = "none",
    efficiency: Efficiency | None = None,
    single: BucketStats | None = None,
    max_cp: int | None = None,
    copy_bytes_per_param: int = WORKING_COPY_BYTES_PER_PARAM,
    recompute_choices: Sequence[str] = (),
) -> StrategyPlan:
    """The fastest fitting layout per bucket (see the module docstring).

    ``stats`` (per bucket, from :func:`bucket_statistics`) give the rows and price packed
    rows' attention by their documents. With ``single`` (the statistics of packing every
    document into ``bounds[-1]`` rows) the best single layout is a candidate too, and is
    chosen unless switching is predicted at least :data:`SWITCH_MARGIN` faster: the returned
    plan's :attr:`~StrategyPlan.baseline` is it either way. ``max_cp`` bounds the CP degree;
    ``copy_bytes_per_param`` is what a non-home layout's working copy holds per parameter.
    A layout with a model of its own may use any of ``recompute_choices`` instead of the run's
    ``method`` (e.g. no recomputation for short rows where home needs full recomputation);
    buckets on the home model keep ``method``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    eff = efficiency or Efficiency()
    usable = int(device.memory_bytes * (1 - eff.headroom))
    common = dict(world_size=world_size, eff=eff, method=method, max_cp=max_cp)
    alone = None
    if single is not None and len(bounds) > 1:
        alone = _best_single(
            model, device, length=bounds[-1], stats=single, usable=usable, **common
        )
    fit = dict(
        usable=usable,
        device=device,
        dynamic_cp_only=mode == "dynamic-cp",
        copy_bytes=copy_bytes_per_param,
    )
    try:
        last = len(bounds) - 1
        per_bucket = [
            _options(
                model,
                device,
                length=length,
                stats=st,
                methods=recompute_choices if b < last else (),
                **common,
            )
            for b, (length, st) in enumerate(zip(bounds, stats))
        ]
        plans = [
            _plan_with_home(home, est, per_bucket, bounds, stats, **fit)
            for home, est in per_bucket[-1]
        ]
        plans = [plan for plan in plans if plan is not None]
        if not plans:
            raise StrategyError(
                _nothing_fits(per_bucket, bounds, usable, device, copy_bytes_per_param)
            )
    except StrategyError:
        if alone is None:
            raise
        return replace(alone, baseline=alone)  # only one layout for every bucket fits
    best = min(plans, key=lambda plan: plan.step_s)
    if alone is None or best.step_s * (1 + SWITCH_MARGIN) < alone.step_s:
        return replace(best, baseline=alone)
    return replace(alone, baseline=alone)


def _best_single(model, device, *, length, stats, usable, **common) -> StrategyPlan | None:
    """Every document in ``length`` rows in the fastest single layout that fits (or ``None``)."""
    try:
        options = _options(model, device, length=length, stats=stats, **common)
    except StrategyError:
        return None
    plans = [
        StrategyPlan(
            [_choice(length, stats, layout, est, est.device_peak_bytes, on_home=True, switch_s=0)],
            est.grad_sync_s,
        )
        for layout, est in options
        if est.device_peak_bytes <= usable
    ]
    return min(plans, key=lambda plan: plan.step_s, default=None)


def evaluate_strategies(
    *,
    model: ModelShape,
    device: DeviceSpec,
    bounds: Sequence[int],
    stats: Sequence[BucketStats],
    layouts: Sequence[ParallelLayout],
    method: str = "none",
    efficiency: Efficiency | None = None,
    single: BucketStats | None = None,
    copy_bytes_per_param: int = WORKING_COPY_BYTES_PER_PARAM,
    recompute: Sequence[str | None] | None = None,
) -> StrategyPlan:
    """Predicted cost of given layouts (the last is home), with the best single layout as
    :attr:`~StrategyPlan.baseline` when ``single`` is given; refuses a bucket that cannot fit.
    ``recompute`` gives a bucket's method where it is not the run's ``method``."""
    eff = efficiency or Efficiency()
    usable = int(device.memory_bytes * (1 - eff.headroom))
    per_bucket = []
    methods = recompute or [None] * len(bounds)
    for length, st, layout, m in zip(bounds, stats, layouts, methods):
        try:
            est = _estimate(
                model, device, layout, length=length, stats=st, eff=eff, method=m or method
            )
        except EstimateError as err:
            raise StrategyError(f"layout {layout.name}, {length}-token bucket: {err}") from None
        per_bucket.append([(layout, est)])
    home, home_est = per_bucket[-1][0]
    plan = _plan_with_home(
        home,
        home_est,
        per_bucket,
        bounds,
        stats,
        usable=usable,
        device=device,
        dynamic_cp_only=False,
        copy_bytes=copy_bytes_per_param,
    )
    if plan is None:
        raise StrategyError(_nothing_fits(per_bucket, bounds, usable, device, copy_bytes_per_param))
    if single is None:
        return plan
    alone = _best_single(
        model,
        device,
        length=bounds[-1],
        stats=single,
        usable=usable,
        world_size=home.world_size,
        eff=eff,
        method=method,
    )
    return replace(plan, baseline=alone)


def _plan_with_home(
    home, home_est, per_bucket, bounds, stats, *, usable, device, dynamic_cp_only, copy_bytes
) -> StrategyPlan | None:
    """The best layout per bucket next to ``home`` (the longest bucket's), or ``None`` when home
    or some bucket does not fit."""
    if home_est.device_peak_bytes > usable:
        return None
    choices = _choices_given_home(
        home,
        home_est,
        per_bucket,
        bounds,
        stats,
        usable=usable,
        device=device,
        world_size=home.world_size,
        dynamic_cp_only=dynamic_cp_only,
        copy_bytes=copy_bytes,
    )
    return None if choices is None else StrategyPlan(choices, home_est.grad_sync_s)


def bucket_peak_bytes(est: Estimate, home_est: Estimate, *, on_home: bool, copy_bytes: int) -> int:
    """Device peak while a bucket runs: on the home model, its own estimate; in another layout,
    home's model states (which stay) plus this layout's working copy (weights and gradient
    buffer, held only while its buckets run) plus its activations."""
    if on_home:
        return est.device_peak_bytes
    activations = est.device_peak_bytes - est.model_state_bytes
    return home_est.model_state_bytes + est.params_per_gpu * copy_bytes + activations


def _choices_given_home(
    home,
    home_est,
    per_bucket,
    bounds,
    stats,
    *,
    usable,
    device,
    world_size,
    dynamic_cp_only,
    copy_bytes,
):
    choices = []
    last = len(per_bucket) - 1
    for b, options in enumerate(per_bucket):
        if b == last:  # the longest bucket defines home
            choices.append(
                _choice(
                    bounds[b],
                    stats[b],
                    home,
                    home_est,
                    home_est.device_peak_bytes,
                    on_home=True,
                    switch_s=0.0,
                )
            )
            continue
        fitting = []
        for layout, est in options:
            if dynamic_cp_only and not shares_home(layout, home):
                continue
            on_home = shares_home(layout, home)
            if on_home and est.method != home_est.method:
                continue  # the home model's recomputation is the run's
            peak = bucket_peak_bytes(est, home_est, on_home=on_home, copy_bytes=copy_bytes)
            switch = 0.0 if on_home else _switch_s(est, device, world_size, copy_bytes)
            if peak <= usable:
                fitting.append(
                    _choice(
                        bounds[b], stats[b], layout, est, peak, on_home=on_home, switch_s=switch
                    )
                )
        if not fitting:
            return None
        if stats[b].rows == 0:  # never seen: keep it at home, nothing to switch
            home_choice = [c for c in fitting if c.layout == home]
            if home_choice:
                choices.append(home_choice[0])
                continue
        choices.append(min(fitting, key=lambda c: (c.total_s, c.layout.tp, c.layout.pp)))
    return choices


def _choice(length, stats: BucketStats, layout, est: Estimate, peak, *, on_home, switch_s):
    """A bucket's expected cost per step in ``layout``: ``est`` priced its fullest step's rows;
    the per-slot time is scaled to the expected slots, and the bucket's own gradient reduction and
    switch are paid in the steps that have rows (see :meth:`BucketStats.slots`)."""
    per_slot = (est.step_time_s - est.grad_sync_s) / (_microbatches(stats, layout) + layout.pp - 1)
    sync = 0.0 if on_home else est.grad_sync_s * stats.active
    return BucketChoice(
        length,
        stats.rows,
        layout,
        per_slot * stats.slots(layout),
        sync,
        switch_s * stats.active,
        peak,
        est.method,
    )


def _nothing_fits(per_bucket, bounds, usable, device, copy_bytes) -> str:
    gib = 2**30
    homes = per_bucket[-1]
    for b, options in enumerate(per_bucket):
        smallest = min(
            bucket_peak_bytes(
                est, home_est, on_home=shares_home(layout, home), copy_bytes=copy_bytes
            )
            for layout, est in options
            for home, home_est in (homes if b < len(per_bucket) - 1 else [(layout, est)])
        )
        if smallest > usable:
            which = f"layout {options[0][0].name}" if len(options) == 1 else "any layout"
            beside = " beside home's model states" if b < len(per_bucket) - 1 else ""
            return (
                f"the {bounds[b]}-token bucket does not fit {which}{beside} on {device.name}: "
                f"the estimated peak is {smallest / gib:.1f} GiB of {usable / gib:.1f} GiB "
                "usable; use shorter buckets / --seq-length, more processes or other layouts"
            )
    return (
        f"no home layout leaves room for every bucket's working copy on {device.name}; "
        "give --hotspa-strategies by hand or shorten the buckets"
    )


def plan_metrics(hot) -> dict:
    """The metrics file's record of the chosen plan (``hot``: the resolved ``HotSPaConfig``):
    ``hotspa_plan`` is ``switch`` or ``single-layout``; ``hotspa_predicted_gain`` the predicted
    speed-up over one layout for every bucket (``None`` where nothing was predicted)."""
    gain = None
    if hot.predicted_step_s and hot.predicted_single_layout_s:
        gain = hot.predicted_single_layout_s / hot.predicted_step_s
    return {
        "hotspa_plan": "single-layout" if len(hot.strategies) == 1 else "switch",
        "hotspa_predicted_gain": gain,
    }


def describe(plan: StrategyPlan) -> str:
    """One line per bucket, and the step, for the log."""
    lines = []
    for c in plan.choices:
        method = ""
        if c.method != plan.choices[-1].method:
            method = " (no recomputation)" if c.method == "none" else f" ({c.method} recomputation)"
        lines.append(
            f"≤{c.length} tokens: {c.rows:.1f} rows/step → {c.layout.name}{method} "
            f"(predicted {(c.compute_s + c.sync_s) * 1e3:.3g} ms + switch "
            f"{c.switch_s * 1e3:.3g} ms, "
            f"peak {c.peak_bytes / 2**30:.3g} GiB)"
        )
    lines.append(
        f"step: {plan.step_s * 1e3:.3g} ms predicted, of which switching "
        f"{plan.switch_s * 1e3:.3g} ms and the home gradient reduction "
        f"{plan.home_sync_s * 1e3:.3g} ms"
    )
    if plan.baseline is not None:
        alone = plan.baseline
        lines.append(
            f"one layout for every bucket ({alone.layouts[0].name}, {alone.choices[0].rows:.1f} "
            f"rows of {alone.bounds[0]} tokens): {alone.step_s * 1e3:.3g} ms predicted; "
            + (
                "switching does not pay, so every document runs in that one layout"
                if plan.single_layout
                else f"switching is predicted {plan.predicted_gain:.2f}× as fast"
            )
        )
    return "\n".join(lines)
