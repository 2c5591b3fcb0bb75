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

from memo_ext.estimate.model import Efficiency, Estimate, EstimateError, estimate
from memo_ext.estimate.model import Layout as EstimatorLayout
from memo_ext.estimate.presets import DeviceSpec, ModelShape
from memo_ext.hotspa.buckets import bucket_rows
from memo_ext.hotspa.documents import DocumentSource, global_batches
from memo_ext.hotspa.layouts import Layout, LayoutError, check_layout

logger = logging.getLogger(__name__)

WORKING_COPY_BYTES_PER_PARAM = 2 + 4
"""A non-home layout's bf16 working weight and fp32 gradient, per parameter it holds."""
MODES = ("switch", "dynamic-cp")
SAMPLED_STEPS = 32
"""Global batches packed to measure the expected rows per bucket."""


class StrategyError(ValueError):
    """No layout can run a bucket; the message gives the numbers."""


@dataclass(frozen=True)
class BucketChoice:
    """One bucket's layout and its predicted cost per step."""

    length: int
    rows: float
    """Expected rows per step."""
    layout: Layout
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
    def layouts(self) -> list[Layout]:
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
                layout = Layout(dp=rest // pp, tp=tp, pp=pp, cp=cp)
                try:
                    check_layout(layout, config=model, bucket_length=length)
                except LayoutError:
                    continue
                yield layout


def shares_home(layout: Layout, home: Layout) -> bool:
    """Runs on the home model (dynamic CP): the same TP and PP."""
    return (layout.tp, layout.pp) == (home.tp, home.pp)


def _estimate(
    model, device, layout: Layout, *, length: int, rows: float, eff, method: str = "none"
) -> Estimate:
    microbatches = max(1, math.ceil(rows / layout.dp))
    est_layout = EstimatorLayout(
        tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, sp=layout.sp, micro_batch_size=1,
        num_microbatches=microbatches, distributed_optimizer=False,
    )  # fmt: skip
    return estimate(
        model=model, device=device, layout=est_layout, method=method, seq_length=length,
        host_memory_bytes=1 << 40, efficiency=eff,
    )  # fmt: skip


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
    per_bucket: list[list[tuple[Layout, Estimate]]] = []
    for length, n, fraction in zip(bounds, rows, fractions):
        eff = replace(base, attention_fraction=fraction)
        options = []
        for layout in candidate_layouts(
            model, world_size=world_size, gpus_per_node=device.gpus_per_node, length=length
        ):
            try:
                options.append((layout, _estimate(model, device, layout, length=length, rows=n,
                                                  eff=eff, method=method)))  # fmt: skip
            except EstimateError:
                continue
        if not options:
            raise StrategyError(f"no DP × TP × PP × CP layout of {world_size} processes can run "
                                f"the {length}-token bucket of {model.name}")  # fmt: skip
        per_bucket.append(options)
    best: StrategyPlan | None = None
    for home, home_est in per_bucket[-1]:
        if home_est.device_peak_bytes > usable:
            continue
        choices = _choices_given_home(home, home_est, per_bucket, bounds, rows, usable=usable,
                                      device=device, world_size=world_size,
                                      dynamic_cp_only=mode == "dynamic-cp")  # fmt: skip
        if choices is None:
            continue
        plan = StrategyPlan(choices, home_est.grad_sync_s)
        if best is None or plan.step_s < best.step_s:
            best = plan
    if best is None:
        raise StrategyError(_nothing_fits(per_bucket, bounds, usable, device))
    return best


def evaluate_strategies(
    *,
    model: ModelShape,
    device: DeviceSpec,
    bounds: Sequence[int],
    rows: Sequence[float],
    layouts: Sequence[Layout],
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
            per_bucket.append([(layout, _estimate(model, device, layout, length=length, rows=n,
                                                  eff=eff, method=method))])  # fmt: skip
        except EstimateError as err:
            raise StrategyError(f"layout {layout.name}, {length}-token bucket: {err}") from None
    home, home_est = per_bucket[-1][0]
    world_size = home.world_size
    choices = None
    if home_est.device_peak_bytes <= usable:
        choices = _choices_given_home(home, home_est, per_bucket, bounds, rows, usable=usable,
                                      device=device, world_size=world_size,
                                      dynamic_cp_only=False)  # fmt: skip
    if choices is None:
        raise StrategyError(_nothing_fits(per_bucket, bounds, usable, device))
    return StrategyPlan(choices, home_est.grad_sync_s)


def _choices_given_home(
    home, home_est, per_bucket, bounds, rows, *, usable, device, world_size, dynamic_cp_only
):
    choices = []
    last = len(per_bucket) - 1
    for b, options in enumerate(per_bucket):
        if b == last:  # the longest bucket defines home
            choices.append(_choice(bounds[b], rows[b], home, home_est, home_est.device_peak_bytes,
                                   on_home=True, switch_s=0.0))  # fmt: skip
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
                fitting.append(_choice(bounds[b], rows[b], layout, est, peak, on_home=on_home,
                                       switch_s=switch))  # fmt: skip
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
    return BucketChoice(length, rows, layout, compute, 0.0 if on_home else est.grad_sync_s,
                        switch_s, peak)  # fmt: skip


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
    return (f"no home layout leaves room for every bucket's working copy on {device.name}; "
            "give --hotspa-strategies by hand or shorten the buckets")  # fmt: skip


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
