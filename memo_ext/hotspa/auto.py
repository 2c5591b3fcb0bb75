"""``--hotspa-strategies auto``: each bucket's layout from the estimator's cost model.

Inputs: the model shape, a device preset, the bucket bounds and the expected rows per bucket
and step (measured by packing the run's first global batches, :func:`expected_rows`). For every
candidate home layout that fits the longest bucket, each other bucket takes the layout with the
least predicted time (the estimator's step time for its rows, plus the switch when it is not
home) among those that fit device memory next to the home layout's model states; the home with
the least total wins. A bucket that fits no layout is refused with the numbers.

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
from memo_ext.estimate.model import Batch, Efficiency, Estimate, EstimateError, estimate
from memo_ext.hardware import DeviceSpec
from memo_ext.hotspa.buckets import bucket_rows
from memo_ext.parallel import LayoutError, ParallelLayout
from memo_ext.shapes import ModelShape

logger = logging.getLogger(__name__)

WORKING_COPY_BYTES_PER_PARAM = 2 + 4
"""A non-home layout's bf16 working weight and fp32 gradient, per parameter it holds."""
MODES = ("switch", "dynamic-cp")
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

    @property
    def layouts(self) -> list[ParallelLayout]:
        return [c.layout for c in self.choices]

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
    rows = [0] * len(bounds)
    squares = [0.0] * len(bounds)
    batches = global_batches(
        source, global_batch_size=global_batch_size, seq_length=bounds[-1], seed=seed
    )
    for _, documents in zip(range(steps), batches):
        lengths = [len(d) for d in documents]
        for b, groups in enumerate(bucket_rows(lengths, bounds, backfill=backfill)):
            rows[b] += len(groups)
            squares[b] += sum(lengths[i] ** 2 for g in groups for i in g) / bounds[b] ** 2
    return [
        BucketStats(rows=r / steps, attention_fraction=(sq / r if r else 1.0))
        for r, sq in zip(rows, squares)
    ]


def expected_rows(source: DocumentSource, **kwargs) -> list[float]:
    """Mean packed rows per bucket and step (see :func:`bucket_statistics`)."""
    return [stats.rows for stats in bucket_statistics(source, **kwargs)]


def candidate_layouts(model: ModelShape, *, world_size: int, gpus_per_node: int, length: int):
    """DP × TP × PP × CP splits of the world megatron-core can run on a ``length`` bucket."""
    powers = [1 << k for k in range(world_size.bit_length()) if world_size % (1 << k) == 0]
    for tp in (t for t in powers if t <= gpus_per_node):
        for cp in powers:
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


def _estimate(
    model, device, layout: ParallelLayout, *, length: int, rows: float, eff, method: str = "none"
) -> Estimate:
    microbatches = max(1, math.ceil(rows / layout.dp))
    batch = Batch(micro_batch_size=1, num_microbatches=microbatches, distributed_optimizer=False)
    return estimate(
        model=model,
        device=device,
        layout=layout,
        batch=batch,
        method=method,
        seq_length=length,
        host_memory_bytes=1 << 40,
        efficiency=eff,
    )


def _switch_s(est: Estimate, device: DeviceSpec, world_size: int) -> float:
    link = device.nvlink_gbps if world_size <= device.gpus_per_node else device.internode_gbps
    return est.params_per_gpu * WORKING_COPY_BYTES_PER_PARAM / (link * 1e9)


def choose_strategies(
    *,
    model: ModelShape,
    device: DeviceSpec,
    bounds: Sequence[int],
    rows: Sequence[float],
    world_size: int,
    mode: str = "switch",
    attention_fractions: Sequence[float] | None = None,
    method: str = "none",
    efficiency: Efficiency | None = None,
) -> StrategyPlan:
    """The fastest fitting layout per bucket (see the module docstring).

    ``attention_fractions`` (per bucket, from :func:`bucket_statistics`) price packed rows'
    attention by their documents; by default every row is priced as one full sequence.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    base = efficiency or Efficiency()
    usable = int(device.memory_bytes * (1 - base.headroom))
    fractions = attention_fractions or [1.0] * len(bounds)
    per_bucket: list[list[tuple[ParallelLayout, Estimate]]] = []
    for length, n, fraction in zip(bounds, rows, fractions):
        eff = replace(base, attention_fraction=fraction)
        options = []
        for layout in candidate_layouts(
            model, world_size=world_size, gpus_per_node=device.gpus_per_node, length=length
        ):
            try:
                est = _estimate(
                    model, device, layout, length=length, rows=n, eff=eff, method=method
                )
            except EstimateError:
                continue
            options.append((layout, est))
        if not options:
            raise StrategyError(
                f"no DP × TP × PP × CP layout of {world_size} processes can run "
                f"the {length}-token bucket of {model.name}"
            )
        per_bucket.append(options)
    fit = dict(usable=usable, device=device, dynamic_cp_only=mode == "dynamic-cp")
    plans = [
        _plan_with_home(home, est, per_bucket, bounds, rows, **fit) for home, est in per_bucket[-1]
    ]
    plans = [plan for plan in plans if plan is not None]
    if not plans:
        raise StrategyError(_nothing_fits(per_bucket, bounds, usable, device))
    return min(plans, key=lambda plan: plan.step_s)


def evaluate_strategies(
    *,
    model: ModelShape,
    device: DeviceSpec,
    bounds: Sequence[int],
    rows: Sequence[float],
    layouts: Sequence[ParallelLayout],
    attention_fractions: Sequence[float] | None = None,
    method: str = "none",
    efficiency: Efficiency | None = None,
) -> StrategyPlan:
    """Predicted cost of given layouts (the last is home); refuses a bucket that cannot fit."""
    base = efficiency or Efficiency()
    usable = int(device.memory_bytes * (1 - base.headroom))
    fractions = attention_fractions or [1.0] * len(bounds)
    per_bucket = []
    for length, n, layout, fraction in zip(bounds, rows, layouts, fractions):
        eff = replace(base, attention_fraction=fraction)
        try:
            est = _estimate(model, device, layout, length=length, rows=n, eff=eff, method=method)
        except EstimateError as err:
            raise StrategyError(f"layout {layout.name}, {length}-token bucket: {err}") from None
        per_bucket.append([(layout, est)])
    home, home_est = per_bucket[-1][0]
    plan = _plan_with_home(
        home,
        home_est,
        per_bucket,
        bounds,
        rows,
        usable=usable,
        device=device,
        dynamic_cp_only=False,
    )
    if plan is None:
        raise StrategyError(_nothing_fits(per_bucket, bounds, usable, device))
    return plan


def _plan_with_home(
    home, home_est, per_bucket, bounds, rows, *, usable, device, dynamic_cp_only
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
        rows,
        usable=usable,
        device=device,
        world_size=home.world_size,
        dynamic_cp_only=dynamic_cp_only,
    )
    return None if choices is None else StrategyPlan(choices, home_est.grad_sync_s)


def _choices_given_home(
    home, home_est, per_bucket, bounds, rows, *, usable, device, world_size, dynamic_cp_only
):
    choices = []
    last = len(per_bucket) - 1
    for b, options in enumerate(per_bucket):
        if b == last:  # the longest bucket defines home
            choices.append(
                _choice(
                    bounds[b],
                    rows[b],
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
            peak = est.device_peak_bytes
            switch = 0.0
            on_home = shares_home(layout, home)
            if not on_home:
                # home's model states stay; this layout adds its working copy and activations
                peak += home_est.model_state_bytes - est.model_state_bytes
                peak += est.params_per_gpu * WORKING_COPY_BYTES_PER_PARAM
                switch = _switch_s(est, device, world_size)
            if peak <= usable:
                fitting.append(
                    _choice(bounds[b], rows[b], layout, est, peak, on_home=on_home, switch_s=switch)
                )
        if not fitting:
            return None
        if rows[b] == 0:  # never seen: keep it at home, nothing to switch
            home_choice = [c for c in fitting if c.layout == home]
            if home_choice:
                choices.append(home_choice[0])
                continue
        choices.append(min(fitting, key=lambda c: (c.total_s, c.layout.tp, c.layout.pp)))
    return choices


def _choice(length, rows, layout, est: Estimate, peak, *, on_home: bool, switch_s: float):
    compute = est.step_time_s - est.grad_sync_s
    return BucketChoice(
        length, rows, layout, compute, 0.0 if on_home else est.grad_sync_s, switch_s, peak
    )


def _nothing_fits(per_bucket, bounds, usable, device) -> str:
    gib = 2**30
    for b, options in enumerate(per_bucket):
        smallest = min(est.device_peak_bytes for _, est in options)
        if smallest > usable:
            which = f"layout {options[0][0].name}" if len(options) == 1 else "any layout"
            return (
                f"the {bounds[b]}-token bucket does not fit {which} on {device.name}: the "
                f"estimated peak is {smallest / gib:.1f} GiB of {usable / gib:.1f} GiB usable; "
                "use shorter buckets / --seq-length, more processes or other layouts"
            )
    return (
        f"no home layout leaves room for every bucket's working copy on {device.name}; "
        "give --hotspa-strategies by hand or shorten the buckets"
    )


def describe(plan: StrategyPlan) -> str:
    """One line per bucket, and the step, for the log."""
    lines = []
    for c in plan.choices:
        lines.append(
            f"≤{c.length} tokens: {c.rows:.1f} rows/step → {c.layout.name} "
            f"(predicted {(c.compute_s + c.sync_s) * 1e3:.3g} ms + switch "
            f"{c.switch_s * 1e3:.3g} ms, "
            f"peak {c.peak_bytes / 2**30:.3g} GiB)"
        )
    lines.append(
        f"step: {plan.step_s * 1e3:.3g} ms predicted, of which switching "
        f"{plan.switch_s * 1e3:.3g} ms and the home gradient reduction "
        f"{plan.home_sync_s * 1e3:.3g} ms"
    )
    return "\n".join(lines)
