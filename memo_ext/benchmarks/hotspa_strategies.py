"""The HotSPa paper's workloads, predicted by the estimator's cost model: eight ways per step.

The workloads follow the HotSPa paper's (SOSP 2024) setup as we take it: LLaMA models of 7B, 13B
and 30B parameters on 8 to 32 A800 GPUs (and H100 beside them) at 32K context, on CommonCrawl
(mostly short documents) and GitHub (longer, heavier-tailed files). This script rebuilds them
from parametric length distributions (nothing is downloaded) and predicts one step of each
strategy below with ``memo_ext/hotspa/auto.py``'s cost model (the estimator of
``docs/estimate.md`` plus HotSPa's switches). Every figure is a prediction: no GPU runs here.
Run from the repository root:

    python -m benchmarks.hotspa_strategies --json hotspa_strategies.json        # 54 workloads
    python -m benchmarks.hotspa_strategies --quick --check                       # 2, for tests
    python -m benchmarks.hotspa_strategies --models llama-7b --gpus 8 16 \\
        --distribution mix='0.7*lognormal(median=300,sigma=1.3)+0.3*uniform(8192,32768)'

**Strategies** (every one trains the same documents per step; rows are ``--seq-length`` long
unless bucketed):

- ``packed-causal``: Megatron-LM's packing, our stand-in for the HotSPa paper's baseline: the
  documents are concatenated and cut into full rows (no padding, documents may straddle rows) and
  attention is causal over the whole row (``attention_fraction`` 1), in the best layout without
  CP. Every strategy's ``speedup_vs_packed_causal`` is measured against it, to set beside the
  paper's speedups.
- ``pad``: one document per row, padded; per-document attention; best layout without CP.
- ``static``: documents packed first-fit into full rows with per-document attention (what
  ``--variable-seq-lengths`` trains with one bucket), best single layout without CP.
- ``static-cp``: the same with CP allowed. The better of ``static`` and ``static-cp`` is the
  strong static baseline ("best static").
- ``dynamic-cp``: megatron-core's dynamic context parallelism: buckets, each keeping the home
  layout's TP and PP and choosing only its CP (``--hotspa-mode dynamic-cp``).
- ``paper-layouts``: the paper's hand-picked style. Rule: the longest bucket (home) takes the
  smallest power-of-two TP within a node that fits device memory, the rest DP, no PP and no CP;
  if no TP fits, the largest TP that divides the heads within a node plus the smallest
  power-of-two PP that fits. Each shorter bucket then takes the first layout in the same order
  that fits next to home's model states (as the trainer holds them). Priced with
  ``evaluate_strategies``.
- ``hotspa-artifact``: the layouts the HotSPa artifact itself trains with, (DP, TP, PP) per
  bucket as its experiment scripts give them for 7B / 13B on 8 and 16 GPUs and its 32B on 32
  (:data:`HOTSPA_ARTIFACT_LAYOUTS`; the 32B is ``--models hotspa-32b``, llama-30b with 64
  heads). Only where ``--hotspa-buckets`` equals the artifact's (``4096,8192,16384,32768`` or
  ``4096,16384,32768`` at 32K); elsewhere ``—``. Priced as ``paper-layouts`` is, with the run's
  recomputation; where they do not fit, the cell reads ``✗ (speed-up)``: the speed-up they would
  have were device memory no limit.
- ``auto``: ours, ``choose_strategies(mode="switch", single=...)``: per-bucket layouts with
  switching, or the best single layout when switching does not pay.

A strategy that fits no layout is reported as a row with its error. The key check is
``auto / best static`` (best static's step over auto's): auto must never lose, so it must be at
least 0.99 in every workload; ``--check`` exits 1 otherwise.

**Distributions.** Document lengths in tokens, drawn from mixtures written in a small spec
language (``--distribution NAME=SPEC``), or read from a file (``--lengths-file PATH``, one
positive integer per line; its name is the file's stem); the language and the built-in
``commoncrawl``, ``github`` and ``control`` are described in ``memo_ext.data.lengths``.

**Context.** A document longer than ``--seq-length`` is cut into pieces of ``--seq-length``
tokens plus the remainder, as a pretraining loader splits it (megatron's ``GPTDataset`` likewise
never drops a document's tail); the pieces are trained as documents of their own.

**Memory.** Every strategy is priced as the trainer's ``auto`` prices a bucket: activations as
``--method`` keeps them, model states without the distributed optimizer. ``--method auto`` (the
default) takes, per workload, the least recomputation under which the strong baseline fits —
``none`` (every activation stored) if it fits, else ``full`` — as a user would set
``--recompute-granularity``; every strategy then runs with it, except that ``auto`` may give a
layout with a model of its own less or more recomputation (``none`` / ``full``), as the
trainer's ``auto`` does. Memory is sized for each bucket's fullest sampled step; each plan is
also priced again with every bucket at its most rows (the peak in brackets, ✗ where that step
would not fit).

**Outputs.** A markdown table on stdout, one row per workload (``--detail`` adds one row per
strategy), progress lines on stderr, a summary line with the least ``auto / best static``, and
with ``--json FILE`` every figure: each strategy's layouts, step, switch time and share, peak
memory (mean and busiest step), throughput and speedups, per-bucket choices, and each
distribution's summary (median, p90, p98, share at most 4K) before and after cutting at the
context.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memo_ext.config import parse_buckets
from memo_ext.data.lengths import (
    BUILTIN_SPECS,
    EXAMPLE_SPEC,
    LengthSource,
    SpecError,
    cut_to_context,
    parse_named_spec,
    parse_spec,
    read_lengths_file,
    summarize_lengths,
)
from memo_ext.errors import UsageError
from memo_ext.features.hotspa.auto import (
    AUTO_RECOMPUTE,
    BucketStats,
    StrategyError,
    StrategyPlan,
    choose_strategies,
    evaluate_strategies,
    length_statistics,
    sampled_lengths,
)
from memo_ext.features.recompute import method as recompute
from memo_ext.hardware import DEVICES, DeviceSpec, device_spec
from memo_ext.parallel import LayoutError, ParallelLayout
from memo_ext.shapes import MODELS, ModelShape, model_shape

GIB = 2**30
CHECK_THRESHOLD = 0.99
"""``auto / best static`` below this fails ``--check`` (1% for the float noise of equal plans)."""

DEFAULT_MODELS = ("llama-7b", "llama-13b", "llama-30b")
DEFAULT_GPUS = (8, 16, 32)
DEFAULT_DEVICES = ("a800-80g", "h100-80g")
QUICK = {
    "models": ("llama-7b",),
    "gpus": (8,),
    "devices": ("a800-80g",),
    "distributions": ("commoncrawl", "control"),
}
STRATEGIES = (
    "packed-causal",
    "pad",
    "static",
    "static-cp",
    "dynamic-cp",
    "paper-layouts",
    "hotspa-artifact",
    "auto",
)
STATIC = ("static", "static-cp")
"""The strong static baseline is the faster of these."""


# ---------------------------------------------------------------------------------------------
# Per-distribution statistics: what each strategy's rows hold per step


@dataclass(frozen=True)
class DistributionStats:
    """One distribution's rows per step under each packing, averaged over the sampled steps."""

    bucketed: list[BucketStats]
    """Per bucket, packed as HotSPa packs (first-fit decreasing, backfill)."""
    single: BucketStats
    """Every document packed first-fit into ``--seq-length`` rows, per-document attention."""
    pad: BucketStats
    """One document per row, padded."""
    packed_causal: BucketStats
    """Megatron-LM: the documents concatenated into full rows, causal over each row; the same
    rows every step (Megatron's global batch is a fixed number of rows), so no ``step_rows``."""
    tokens_per_step: float
    """Real tokens per step (the same for every strategy)."""


def measure_distribution(
    pieces: np.ndarray, *, bounds: Sequence[int], global_batch_size: int, seed: int, steps: int
) -> DistributionStats:
    """Pack the first ``steps`` global batches of ``pieces`` every way the strategies need."""
    context = bounds[-1]
    per_step = sampled_lengths(
        LengthSource(pieces),
        seq_length=context,
        global_batch_size=global_batch_size,
        seed=seed,
        steps=steps,
    )
    documents = tokens = squares = 0.0
    for step in per_step:
        lengths = np.array(step, dtype=np.float64)
        documents += len(lengths)
        tokens += lengths.sum()
        squares += (lengths**2).sum() / context**2
    return DistributionStats(
        bucketed=length_statistics(per_step, bounds=bounds),
        single=length_statistics(per_step, bounds=[context])[0],
        pad=BucketStats(
            rows=documents / steps,
            attention_fraction=squares / documents,
            fill=tokens / documents / context,
        ),
        packed_causal=BucketStats(rows=tokens / steps / context, attention_fraction=1.0, fill=1.0),
        tokens_per_step=tokens / steps,
    )


# ---------------------------------------------------------------------------------------------
# The strategies


@dataclass(frozen=True)
class Workload:
    """One distribution × model × GPU count × device."""

    distribution: str
    model: str
    gpus: int
    device: str

    @property
    def label(self) -> str:
        return f"{self.distribution} {self.model} {self.gpus}×{self.device}"


def best_single(
    model, device, *, gpus: int, context: int, stats: BucketStats, method: str, max_cp=None
):
    """The best one layout for full rows of ``stats``."""
    return choose_strategies(
        model=model,
        device=device,
        bounds=[context],
        stats=[stats],
        world_size=gpus,
        mode="switch",
        method=method,
        max_cp=max_cp,
    )


def paper_candidates(model: ModelShape, *, gpus: int, gpus_per_node: int, length: int):
    """The paper-style order: TP 1, 2, 4, … within a node (rest DP, no PP / CP); then the
    largest such TP with PP 2, 4, … (see ``paper-layouts`` in the module docstring)."""

    def valid(layout: ParallelLayout) -> bool:
        try:
            layout.check_fits(model, length)
        except LayoutError:
            return False
        return True

    powers = [1 << k for k in range(gpus.bit_length()) if gpus % (1 << k) == 0]
    tps = [
        tp
        for tp in powers
        if tp <= gpus_per_node and valid(ParallelLayout(dp=gpus // tp, tp=tp, sp=tp > 1))
    ]
    yield from (ParallelLayout(dp=gpus // tp, tp=tp, sp=tp > 1) for tp in tps)
    if tps:
        tp = tps[-1]
        for pp in (p for p in powers if p > 1 and tp * p <= gpus):
            layout = ParallelLayout(dp=gpus // (tp * pp), tp=tp, pp=pp, sp=tp > 1)
            if valid(layout):
                yield layout


def paper_layouts(
    model,
    device: DeviceSpec,
    *,
    gpus: int,
    bounds: Sequence[int],
    stats: Sequence[BucketStats],
    method: str,
) -> StrategyPlan:
    """Home: the first paper-order layout that fits the longest bucket; each shorter bucket:
    the first that fits next to home. Priced with ``evaluate_strategies``."""
    price = dict(model=model, device=device, method=method)

    def first_fitting(b: int, home: ParallelLayout | None) -> ParallelLayout:
        for layout in paper_candidates(
            model, gpus=gpus, gpus_per_node=device.gpus_per_node, length=bounds[b]
        ):
            pair = [layout] if home is None else [layout, home]
            which = [b] if home is None else [b, len(bounds) - 1]
            try:
                evaluate_strategies(
                    **price,
                    bounds=[bounds[i] for i in which],
                    stats=[stats[i] for i in which],
                    layouts=pair,
                )
            except StrategyError:
                continue
            return layout
        raise StrategyError(
            f"no layout without CP (TP within a node, then PP) fits the {bounds[b]}-token "
            f"bucket of {model.name} on {gpus} {device.name}"
            + ("" if home is None else f" next to home {home.name}")
        )

    home = first_fitting(len(bounds) - 1, None)
    layouts = [first_fitting(b, home) for b in range(len(bounds) - 1)] + [home]
    return evaluate_strategies(**price, bounds=bounds, stats=stats, layouts=layouts)


HOTSPA_ARTIFACT = "github.com/ccchengff/HotSPa-AE@941a18db2716fa458e140aab012d71f71e5df941"
HOTSPA_ARTIFACT_SCRIPT = "hotspa/scripts/exprs_for_paper/llama_hot_switch.sh"
# The HotSPa artifact's own layouts: ccchengff/HotSPa-AE at commit
# 941a18db2716fa458e140aab012d71f71e5df941, hotspa/scripts/exprs_for_paper/llama_hot_switch.sh
# (the line numbers below are that file's). The paper's experiment scripts
# commoncrawl/commoncrawl_{7b,13b}_{8,16}gpus.sh, commoncrawl/commoncrawl_32b_32gpus.sh and their
# github/github_*.sh twins call it with the same model, GPUs, context and combination; only the
# dataset (web/commoncrawl.json or code/github.json) differs, and the layouts do not depend on
# it, so each row serves both datasets. Values are copied as the script writes them:
# BUCKET_SIZES longest first down to 0, and ALL_PARALLEL_STRATEGY as "DP,TP,PP" (see
# ``artifact_buckets`` for which bucket each one trains). Combinations: c1 has buckets
# 4K / 16K / 32K, c2 4K / 8K / 16K / 32K (fewer where the context is shorter). As committed, the
# script's GPU-count tests (``[ "${WORLD_SIZE}" = "8"]``, no space before ``]``) are errors in
# bash, so it stops at "unsupport GPUs num"; the rows are the layouts it was written to run.
HOTSPA_ARTIFACT_LAYOUTS: dict[tuple[str, int, str, int], tuple[str, str]] = {
    # (artifact model, GPUs, combination, context): (BUCKET_SIZES, ALL_PARALLEL_STRATEGY)
    ("7b", 8, "c1", 32768): ("32768 16384 4096 0", "1,4,2 8,1,1 2,2,2"),  # L42-44
    ("7b", 8, "c1", 16384): ("16384 4096 0", "2,2,2 8,1,1"),  # L45-47
    ("7b", 8, "c1", 8192): ("8192 4096 0", "2,2,2 8,1,1"),  # L48-50
    ("7b", 8, "c1", 4096): ("4096 0", "8,1,1"),  # L51-53
    ("7b", 16, "c1", 32768): ("32768 16384 4096 0", "2,4,2 16,1,1 4,4,1"),  # L59-61
    ("7b", 16, "c1", 16384): ("16384 4096 0", "4,4,1 16,1,1"),  # L62-64
    ("7b", 16, "c1", 8192): ("8192 4096 0", "4,4,1 16,1,1"),  # L65-67
    ("7b", 16, "c1", 4096): ("4096 0", "16,1,1"),  # L68-70
    ("13b", 8, "c1", 32768): ("32768 16384 4096 0", "1,8,1 4,2,1 1,4,2"),  # L81-83
    ("13b", 8, "c1", 16384): ("16384 4096 0", "1,4,2 4,2,1"),  # L84-86
    ("13b", 8, "c1", 8192): ("8192 4096 0", "1,4,2 4,2,1"),  # L87-89
    ("13b", 8, "c1", 4096): ("4096 0", "4,2,1"),  # L90-92
    ("13b", 16, "c1", 32768): ("32768 16384 4096 0", "2,8,1 8,2,1 4,4,1"),  # L98-100
    ("13b", 16, "c1", 16384): ("16384 4096 0", "4,4,1 8,2,1"),  # L101-103
    ("13b", 16, "c1", 8192): ("8192 4096 0", "4,4,1 8,2,1"),  # L104-106
    ("13b", 16, "c1", 4096): ("4096 0", "8,2,1"),  # L107-109
    ("32b", 32, "c1", 32768): ("32768 16384 4096 0", "1,16,2 4,2,4 2,8,2"),  # L120-122
    ("32b", 32, "c1", 16384): ("16384 4096 0", "2,8,2 4,2,4"),  # L123-125
    ("32b", 32, "c1", 8192): ("8192 4096 0", "2,8,2 4,2,4"),  # L126-128
    ("32b", 32, "c1", 4096): ("4096 0", "4,2,4"),  # L129-131
    ("7b", 8, "c2", 32768): ("32768 16384 8192 4096 0", "1,4,2 8,1,1 4,2,1 2,2,2"),  # L146-148
    ("7b", 8, "c2", 16384): ("16384 8192 4096 0", "2,2,2 8,1,1 4,2,1"),  # L149-151
    ("7b", 8, "c2", 8192): ("8192 4096 0", "4,2,1 8,1,1"),  # L152-154
    ("7b", 8, "c2", 4096): ("4096 0", "8,1,1"),  # L155-157
    ("7b", 16, "c2", 32768): ("32768 16384 8192 4096 0", "2,4,2 16,1,1 8,2,1 4,4,1"),  # L163-165
    ("7b", 16, "c2", 16384): ("16384 8192 4096 0", "4,4,1 16,1,1 8,2,1"),  # L166-168
    ("7b", 16, "c2", 8192): ("8192 4096 0", "8,2,1 16,1,1"),  # L169-171
    ("7b", 16, "c2", 4096): ("4096 0", "16,1,1"),  # L172-174
    ("13b", 8, "c2", 32768): ("32768 16384 8192 4096 0", "1,8,1 4,2,1 2,2,2 1,4,2"),  # L185-187
    ("13b", 8, "c2", 16384): ("16384 8192 4096 0", "1,4,2 4,2,1 2,2,2"),  # L188-190
    ("13b", 8, "c2", 8192): ("8192 4096 0", "2,2,2 4,2,1"),  # L191-193
    ("13b", 8, "c2", 4096): ("4096 0", "4,2,1"),  # L194-196
    ("13b", 16, "c2", 32768): ("32768 16384 8192 4096 0", "2,8,1 8,2,1 4,2,2 4,4,1"),  # L202-204
    ("13b", 16, "c2", 16384): ("16384 8192 4096 0", "4,4,1 8,2,1 4,2,2"),  # L205-207
    ("13b", 16, "c2", 8192): ("8192 4096 0", "4,2,2 8,2,1"),  # L208-210
    ("13b", 16, "c2", 4096): ("4096 0", "8,2,1"),  # L211-213
    ("32b", 32, "c2", 32768): ("32768 16384 8192 4096 0", "1,16,2 4,2,4 4,4,2 2,8,2"),  # L224-226
    ("32b", 32, "c2", 16384): ("16384 8192 4096 0", "2,8,2 4,2,4 4,4,2"),  # L227-229
    ("32b", 32, "c2", 8192): ("8192 4096 0", "4,4,2 4,2,4"),  # L230-232
    ("32b", 32, "c2", 4096): ("4096 0", "4,2,4"),  # L233-235
}
ARTIFACT_MODELS = {"llama-7b": "7b", "llama-13b": "13b", "hotspa-32b": "32b"}
"""Our model for each of the artifact's (same layers, hidden, FFN and heads; our shapes keep
Llama's 32,000-token vocabulary where the artifact's has 30,592)."""
EXTRA_MODELS = {
    "hotspa-32b": dataclasses.replace(
        MODELS["llama-30b"], name="hotspa-32b", num_attention_heads=64
    )
}
"""The artifact's "32b" (llama_hot_switch.sh L13-18): llama-30b's 60 layers, hidden 6656 and FFN
17920, but 64 heads of 104 channels where Llama's 30B has 52 of 128, which its TP 8 and TP 16
layouts could not split. Same parameters and FLOPs as llama-30b."""


def benchmark_model(name: str) -> ModelShape:
    """A preset of ``memo_ext.shapes`` or one of :data:`EXTRA_MODELS`."""
    return EXTRA_MODELS[name] if name in EXTRA_MODELS else model_shape(name)


class NotInArtifact(StrategyError):
    """The artifact has no layouts for this model, GPU count and buckets (not a fit failure)."""


class ArtifactDoesNotFit(StrategyError):
    """The artifact's layouts do not fit device memory as we price it; ``ignoring_memory`` is
    their plan priced on a device without a memory limit (time only)."""

    def __init__(self, message: str, *, ignoring_memory: StrategyPlan | None):
        super().__init__(message)
        self.ignoring_memory = ignoring_memory


def artifact_buckets(bucket_sizes: str, strategies: str) -> tuple[list[int], list[ParallelLayout]]:
    """One artifact row as (bounds, layouts), both shortest bucket first.

    ``llama_hot_switch.py`` (``test_switch``) trains the longest bucket with strategy 0 and,
    for ``i`` ≥ 1, strategy ``i`` on ``buckets[num_strategy - i]`` of the buckets listed longest
    first: strategies 1, 2, … take the buckets from the shortest up. So with sizes
    ``32768 16384 4096 0`` and ``1,4,2 8,1,1 2,2,2``, ≤4K runs DP 8, ≤16K DP 2 × TP 2 × PP 2 and
    ≤32K DP 1 × TP 4 × PP 2.
    """
    bounds = sorted(int(s) for s in bucket_sizes.split() if int(s) > 0)
    triples = [tuple(int(x) for x in s.split(",")) for s in strategies.split()]
    layouts = [ParallelLayout(dp=dp, tp=tp, pp=pp, sp=tp > 1) for dp, tp, pp in triples]
    return bounds, layouts[1:] + layouts[:1]


def artifact_row(model: str, *, gpus: int, bounds: Sequence[int]) -> tuple[str, int, str, int]:
    """The artifact row for ``model`` on ``gpus`` GPUs with these buckets: the first in
    :data:`HOTSPA_ARTIFACT_LAYOUTS` (c1 before c2; at an 8K context both have buckets
    4K / 8K and differ in layouts, and c1's is taken)."""
    ours = ARTIFACT_MODELS.get(model)
    rows = [key for key in HOTSPA_ARTIFACT_LAYOUTS if key[:2] == (ours, gpus)]
    for key in rows:
        if artifact_buckets(*HOTSPA_ARTIFACT_LAYOUTS[key])[0] == list(bounds):
            return key
    if ours is None:
        why = f"the artifact trains only {', '.join(ARTIFACT_MODELS)} (its 32B is hotspa-32b)"
    elif not rows:
        counts = sorted({key[1] for key in HOTSPA_ARTIFACT_LAYOUTS if key[0] == ours})
        why = f"the artifact trains {model} only on {', '.join(map(str, counts))} GPUs"
    else:
        known = sorted({HOTSPA_ARTIFACT_LAYOUTS[key][0] for key in rows})
        why = f"the artifact's buckets for {model} on {gpus} GPUs are {'; '.join(known)}"
    raise NotInArtifact(f"not in the artifact: {why}")


def artifact_record(model: str, *, gpus: int, bounds: Sequence[int]) -> dict:
    """Which artifact row a workload took, and its (DP, TP, PP) per bucket, shortest first."""
    key = artifact_row(model, gpus=gpus, bounds=bounds)
    _, layouts = artifact_buckets(*HOTSPA_ARTIFACT_LAYOUTS[key])
    return {
        "source": f"{HOTSPA_ARTIFACT} {HOTSPA_ARTIFACT_SCRIPT}",
        **dict(zip(("model", "gpus", "combination", "context"), key)),
        "dp_tp_pp": [[x.dp, x.tp, x.pp] for x in layouts],
    }


def artifact_layouts(
    model: ModelShape,
    device: DeviceSpec,
    *,
    gpus: int,
    bounds: Sequence[int],
    stats: Sequence[BucketStats],
    method: str,
) -> StrategyPlan:
    """The artifact's (DP, TP, PP) per bucket, priced with ``evaluate_strategies`` as
    ``paper-layouts`` is."""
    key = artifact_row(model.name, gpus=gpus, bounds=bounds)
    _, layouts = artifact_buckets(*HOTSPA_ARTIFACT_LAYOUTS[key])
    price = dict(model=model, bounds=bounds, stats=stats, layouts=layouts, method=method)
    try:
        return evaluate_strategies(**price, device=device)
    except StrategyError as err:
        # the time alone: the same device with memory no object (no term but the fit uses it)
        unlimited = dataclasses.replace(device, memory_bytes=1 << 50)
        try:
            plan = evaluate_strategies(**price, device=unlimited)
        except StrategyError:
            plan = None
        raise ArtifactDoesNotFit(str(err), ignoring_memory=plan) from None


def strategy_plans(
    model: ModelShape,
    device: DeviceSpec,
    *,
    gpus: int,
    stats: DistributionStats,
    bounds: Sequence[int],
    method: str,
) -> Iterator[tuple[str, StrategyPlan | StrategyError]]:
    """Each strategy's plan, or the error that says why it fits nothing."""
    context = bounds[-1]
    single = dict(gpus=gpus, context=context, method=method)
    bucketed = dict(model=model, device=device, bounds=bounds, stats=stats.bucketed, method=method)
    builders = {
        "packed-causal": lambda: best_single(
            model, device, **single, stats=stats.packed_causal, max_cp=1
        ),
        "pad": lambda: best_single(model, device, **single, stats=stats.pad, max_cp=1),
        "static": lambda: best_single(model, device, **single, stats=stats.single, max_cp=1),
        "static-cp": lambda: best_single(model, device, **single, stats=stats.single),
        "dynamic-cp": lambda: choose_strategies(**bucketed, world_size=gpus, mode="dynamic-cp"),
        "paper-layouts": lambda: paper_layouts(
            model, device, gpus=gpus, bounds=bounds, stats=stats.bucketed, method=method
        ),
        "hotspa-artifact": lambda: artifact_layouts(
            model, device, gpus=gpus, bounds=bounds, stats=stats.bucketed, method=method
        ),
        "auto": lambda: choose_strategies(
            **bucketed,
            world_size=gpus,
            mode="switch",
            single=stats.single,
            recompute_choices=AUTO_RECOMPUTE,
        ),
    }
    for name in STRATEGIES:
        try:
            yield name, builders[name]()
        except StrategyError as err:
            yield name, err


def priced_stats(name: str, plan: StrategyPlan, stats: DistributionStats) -> list[BucketStats]:
    """The statistics ``plan`` was priced on (``auto`` may return the single-layout plan)."""
    if name in ("packed-causal", "pad"):
        return [stats.pad if name == "pad" else stats.packed_causal]
    return [stats.single] if len(plan.choices) == 1 else list(stats.bucketed)


def worst_step_record(
    plan: StrategyPlan, stats: Sequence[BucketStats], *, model, device, method: str
) -> dict:
    """Memory in the busiest sampled step, as a cross-check: ``auto`` already sizes a bucket's
    memory for its fullest sampled step; here every bucket is re-priced with its rows fixed at
    that step's, independently of how the plan was chosen."""
    worst = [
        dataclasses.replace(s, rows=float(max(s.step_rows or (s.rows,))), step_rows=())
        for s in stats
    ]
    try:
        again = evaluate_strategies(
            model=model,
            device=device,
            bounds=plan.bounds,
            stats=worst,
            layouts=plan.layouts,
            method=method,
            recompute=plan.methods,
        )
    except StrategyError as err:
        return {"fits_worst_step": False, "worst_step_error": str(err)}
    peak = max(c.peak_bytes for c in again.choices if c.rows > 0) / GIB
    return {"fits_worst_step": True, "worst_step_peak_gib": peak}


AUTO_METHODS = ("none", "full")
"""What ``--method auto`` tries per workload, least recomputation first."""


# ---------------------------------------------------------------------------------------------
# Figures and the check


def plan_record(plan: StrategyPlan, *, tokens_per_step: float) -> dict:
    """Every figure of one strategy's plan, JSON-ready."""
    running = [c for c in plan.choices if c.rows > 0] or plan.choices
    baseline = getattr(plan, "baseline", None)
    return {
        "layouts": [layout.name for layout in plan.layouts],
        "step_s": plan.step_s,
        "switch_s": plan.switch_s,
        "switch_share": plan.switch_s / plan.step_s,
        "peak_gib": max(c.peak_bytes for c in running) / GIB,
        "tokens_per_s": tokens_per_step / plan.step_s,
        "single_layout": bool(getattr(plan, "single_layout", len(set(plan.layouts)) == 1)),
        "predicted_gain": float(getattr(plan, "predicted_gain", 1.0)),
        "baseline_layouts": None if baseline is None else [x.name for x in baseline.layouts],
        "buckets": [
            {
                "length": c.length,
                "rows": c.rows,
                "layout": c.layout.name,
                "recompute": c.method,
                "compute_s": c.compute_s,
                "sync_s": c.sync_s,
                "switch_s": c.switch_s,
                "peak_gib": c.peak_bytes / GIB,
            }
            for c in plan.choices
        ],
    }


def workload_method(model, device, *, gpus: int, stats: DistributionStats, context: int) -> str:
    """``--method auto``: the least recomputation under which the strong baseline (one layout,
    CP allowed) fits; the last choice when none does (every strategy then reports why)."""
    for method in AUTO_METHODS:
        try:
            best_single(
                model, device, gpus=gpus, context=context, stats=stats.single, method=method
            )
        except StrategyError:
            continue
        return method
    return AUTO_METHODS[-1]


def error_record(err: StrategyError, *, tokens_per_step: float) -> dict:
    """Why a strategy has no plan: ``skipped`` (the artifact has no such row) or ``error`` (it
    fits nothing), with the artifact's time ignoring memory where it does not fit."""
    if isinstance(err, NotInArtifact):
        return {"skipped": str(err)}
    record = {"error": str(err)}
    if getattr(err, "ignoring_memory", None):
        plan = plan_record(err.ignoring_memory, tokens_per_step=tokens_per_step)
        record["ignoring_memory"] = plan
    return record


def run_workload(workload: Workload, stats: DistributionStats, *, bounds, method: str) -> dict:
    """All strategies of one workload, with speedups and ``auto / best static``."""
    model, device = benchmark_model(workload.model), device_spec(workload.device)
    if method == "auto":
        method = workload_method(model, device, gpus=workload.gpus, stats=stats, context=bounds[-1])
    pricing = dict(model=model, device=device, method=method)
    strategies = {}
    for name, plan in strategy_plans(
        model, device, gpus=workload.gpus, stats=stats, bounds=bounds, method=method
    ):
        if isinstance(plan, StrategyError):
            strategies[name] = error_record(plan, tokens_per_step=stats.tokens_per_step)
            continue
        strategies[name] = plan_record(plan, tokens_per_step=stats.tokens_per_step)
        strategies[name] |= worst_step_record(plan, priced_stats(name, plan, stats), **pricing)
    if "skipped" not in strategies["hotspa-artifact"]:
        where = dict(gpus=workload.gpus, bounds=bounds)
        strategies["hotspa-artifact"]["artifact"] = artifact_record(workload.model, **where)
    step = {name: s["step_s"] for name, s in strategies.items() if "step_s" in s}
    statics = [name for name in STATIC if name in step]
    best_static = min(statics, key=step.get) if statics else None
    priced = [r.get("ignoring_memory", r) for r in strategies.values()]
    for record in (r for r in priced if "step_s" in r):
        if "packed-causal" in step:
            record["speedup_vs_packed_causal"] = step["packed-causal"] / record["step_s"]
        if best_static:
            record["speedup_vs_best_static"] = step[best_static] / record["step_s"]
    ratio = None
    if best_static:  # auto refused where a static layout fits: it lost everything
        ratio = strategies["auto"].get("speedup_vs_best_static", 0.0)
    return {
        **dataclasses.asdict(workload),
        "method": method,
        "best_static": best_static,
        "auto_vs_best_static": ratio,
        "strategies": strategies,
    }


def check_summary(workloads: Sequence[dict], *, threshold: float = CHECK_THRESHOLD) -> dict:
    """The least ``auto / best static`` over the workloads where a static layout fits."""
    checked = [w for w in workloads if w["auto_vs_best_static"] is not None]
    worst = min(checked, key=lambda w: w["auto_vs_best_static"], default=None)
    least = None if worst is None else worst["auto_vs_best_static"]
    unsafe = [
        f"{Workload(**_key(w)).label} {name}"
        for w in workloads
        for name, r in w["strategies"].items()
        if r.get("fits_worst_step") is False
    ]
    return {
        "workloads": len(workloads),
        "checked": len(checked),
        "min_auto_vs_best_static": least,
        "worst_workload": None if worst is None else Workload(**_key(worst)).label,
        "threshold": threshold,
        "passed": least is None or least >= threshold,
        "fit_on_mean_rows_only": unsafe,
    }


def _key(record: dict) -> dict:
    return {f.name: record[f.name] for f in dataclasses.fields(Workload)}


# ---------------------------------------------------------------------------------------------
# Tables


def _speedup(record: dict, key: str = "speedup_vs_packed_causal") -> str:
    """``1.23×``; the step time where the baseline fits nothing."""
    if "skipped" in record:
        return "—"
    if "ignoring_memory" in record:  # the artifact's layouts: their speed-up, memory aside
        return f"✗ ({_speedup(record['ignoring_memory'], key)})"
    if "error" in record:
        return "does not fit"
    return f"{record[key]:.2f}×" if key in record else f"{record['step_s']:.2f} s"


def print_summary_table(workloads: Sequence[dict], out) -> None:
    """One row per workload: each strategy's speedup over ``packed-causal``, auto's details."""
    others = [s for s in STRATEGIES if s != "packed-causal"]
    print(
        "| distribution | model | GPUs | device | recompute | packed-causal | "
        + " | ".join(others)
        + " | auto layouts | auto switch | auto peak GiB (worst step) | auto / best static |",
        file=out,
    )
    print("|" + "---|" * (10 + len(others)), file=out)
    for w in workloads:
        s = w["strategies"]
        base = s["packed-causal"]
        base_cell = (
            "does not fit" if "error" in base else f"{base['step_s']:.2f} s {base['layouts'][0]}"
        )
        auto = s["auto"]
        auto_cells = (
            ["—", "—", "—"]
            if "error" in auto
            else [
                ";".join(
                    b["layout"] + ("" if b["recompute"] == w["method"] else f":{b['recompute']}")
                    for b in auto["buckets"]
                ),
                f"{auto['switch_share']:.1%}",
                _peaks(auto),
            ]
        )
        ratio = w["auto_vs_best_static"]
        cells = [
            w["distribution"],
            w["model"],
            str(w["gpus"]),
            w["device"],
            w["method"],
            base_cell,
            *(_speedup(s[name]) for name in others),
            *auto_cells,
            "—" if ratio is None else f"{ratio:.3f}",
        ]
        print("| " + " | ".join(cells) + " |", file=out)


def _peaks(record: dict) -> str:
    """``58.4 (58.4)``: the plan's peak, and the re-priced peak of the busiest sampled step
    (``✗`` where that does not fit)."""
    if record["fits_worst_step"]:
        return f"{record['peak_gib']:.1f} ({record['worst_step_peak_gib']:.1f})"
    return f"{record['peak_gib']:.1f} (✗ does not fit)"


def print_detail_table(workloads: Sequence[dict], out) -> None:
    """One row per workload and strategy."""
    print(
        "| distribution | model | GPUs | device | strategy | layouts (short → home) | step (s) "
        "| switch share | peak GiB (worst step) | vs packed-causal | vs best static |",
        file=out,
    )
    print("|" + "---|" * 11, file=out)
    for w in workloads:
        head = f"| {w['distribution']} | {w['model']} | {w['gpus']} | {w['device']} "
        for name, r in w["strategies"].items():
            if "error" in r or "skipped" in r:
                print(f"{head}| {name} | {r.get('error') or r['skipped']} | | | | | |", file=out)
                continue
            print(
                f"{head}| {name} | {';'.join(r['layouts'])} | {r['step_s']:.3f} | "
                f"{r['switch_share']:.1%} | {_peaks(r)} | {_speedup(r)} | "
                f"{_speedup(r, 'speedup_vs_best_static')} |",
                file=out,
            )


def print_distributions(distributions: dict, out) -> None:
    for name, d in distributions.items():
        raw, pieces = d["documents"], d["pieces"]
        print(
            f"- {name} ({d['spec']}): median {raw['median_tokens']:.0f}, p90 "
            f"{raw['p90_tokens']:.0f}, p98 {raw['p98_tokens']:.0f} tokens, "
            f"{raw['share_at_most_4096']:.1%} ≤ 4K; {d['cut_documents']:.2%} of documents cut "
            f"at the context into {pieces['count']} pieces; {d['tokens_per_step']:.0f} tokens "
            "per step",
            file=out,
        )


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted([*MODELS, *EXTRA_MODELS]),
        help="Default: llama-7b, llama-13b, llama-30b; hotspa-32b is the HotSPa artifact's 32B.",
    )
    parser.add_argument("--gpus", nargs="+", type=int, help="GPU counts (default: 8 16 32).")
    parser.add_argument(
        "--devices", nargs="+", choices=sorted(DEVICES), help="Default: a800-80g h100-80g."
    )
    parser.add_argument(
        "--distributions",
        nargs="+",
        metavar="NAME",
        help="Which to run, of "
        "commoncrawl, github, control and the ones defined below (default: the "
        "built-in three, or only yours when you define any).",
    )
    parser.add_argument(
        "--distribution",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help=f"A mixture of lengths, e.g. mix={EXAMPLE_SPEC} (repeatable).",
    )
    parser.add_argument(
        "--lengths-file",
        action="append",
        default=[],
        metavar="PATH",
        help="Document lengths, one per line; named after the file's stem.",
    )
    parser.add_argument("--seq-length", type=int, default=32768, help="The context, in tokens.")
    parser.add_argument("--hotspa-buckets", default="4096,8192,16384,32768")
    parser.add_argument("--global-batch-size", type=int, default=512, help="Documents per step.")
    parser.add_argument(
        "--documents",
        type=int,
        default=20000,
        help="Documents drawn per parametric distribution (before cutting).",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=32,
        help="Global batches packed to measure rows per step (the trainer's auto uses 32).",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--method",
        default="auto",
        choices=("auto", *(m.name for m in recompute.METHODS)),
        help="Activation memory method, as the trainer's --recompute-granularity passes it "
        "to auto; auto (default): per workload, none if the strong baseline fits so, else full.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="llama-7b, 8 a800-80g, commoncrawl and control (unless given).",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"Exit 1 when auto / best static < {CHECK_THRESHOLD} anywhere.",
    )
    parser.add_argument("--detail", action="store_true", help="Also one row per strategy.")
    parser.add_argument("--json", metavar="FILE", help="Write every figure here.")
    return parser


def load_distributions(args, parser) -> dict[str, dict]:
    """Name → ``{"spec", "lengths"}`` (raw document lengths), in the order they will run."""
    defined: dict[str, dict] = {}
    try:
        for text in args.distribution:
            name, mixture = parse_named_spec(text)
            defined[name] = {"spec": str(mixture), "mixture": mixture}
        for path in args.lengths_file:
            defined[Path(path).stem] = {"spec": f"file {path}", "lengths": read_lengths_file(path)}
    except SpecError as err:
        parser.error(str(err))
    builtin = {
        name: {"spec": spec, "mixture": parse_spec(spec)} for name, spec in BUILTIN_SPECS.items()
    }
    known = {**builtin, **defined}
    chosen = args.distributions or (
        QUICK["distributions"] if args.quick and not defined else list(defined or builtin)
    )
    unknown = [name for name in chosen if name not in known]
    if unknown:
        parser.error(f"--distributions: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    for name in chosen:
        entry = known[name]
        if "lengths" not in entry:
            entry["lengths"] = entry["mixture"].sample_lengths(args.documents, seed=args.seed)
    return {name: known[name] for name in chosen}


def describe_distribution(entry: dict, stats: DistributionStats, *, context: int) -> dict:
    lengths = entry["lengths"]
    return {
        "spec": entry["spec"],
        "documents": summarize_lengths(lengths),
        "pieces": summarize_lengths(cut_to_context(lengths, context)),
        "cut_documents": float(np.mean(lengths > context)),
        "tokens_per_step": stats.tokens_per_step,
        "rows_per_step": {
            "bucketed": [dataclasses.asdict(s) for s in stats.bucketed],
            "single": dataclasses.asdict(stats.single),
            "pad": dataclasses.asdict(stats.pad),
            "packed_causal": dataclasses.asdict(stats.packed_causal),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        bounds = list(parse_buckets(args.hotspa_buckets, seq_length=args.seq_length))
    except UsageError as err:
        parser.error(str(err))
    if min([args.global_batch_size, args.documents, args.steps, *(args.gpus or [1])]) < 1:
        parser.error("--global-batch-size, --documents, --steps and --gpus must be positive")
    quick = QUICK if args.quick else {}
    models = args.models or quick.get("models", DEFAULT_MODELS)
    gpu_counts = args.gpus or quick.get("gpus", DEFAULT_GPUS)
    devices = args.devices or quick.get("devices", DEFAULT_DEVICES)
    started = time.perf_counter()
    distributions = load_distributions(args, parser)
    results = {
        "config": {
            "seq_length": args.seq_length,
            "buckets": bounds,
            "global_batch_size": args.global_batch_size,
            "documents": args.documents,
            "steps": args.steps,
            "seed": args.seed,
            "method": args.method,
            "baseline": "packed-causal: Megatron-LM packing (causal over whole rows), no CP; "
            "our stand-in for the HotSPa paper's baseline",
            "hotspa_artifact": f"{HOTSPA_ARTIFACT} {HOTSPA_ARTIFACT_SCRIPT}",
        },
        "distributions": {},
        "workloads": [],
    }
    total = len(distributions) * len(models) * len(gpu_counts) * len(devices)
    for name, entry in distributions.items():
        stats = measure_distribution(
            cut_to_context(entry["lengths"], args.seq_length),
            bounds=bounds,
            global_batch_size=args.global_batch_size,
            seed=args.seed,
            steps=args.steps,
        )
        results["distributions"][name] = describe_distribution(
            entry, stats, context=args.seq_length
        )
        for workload in itertools.starmap(
            Workload, itertools.product([name], models, gpu_counts, devices)
        ):
            tick = time.perf_counter()
            record = run_workload(workload, stats, bounds=bounds, method=args.method)
            results["workloads"].append(record)
            done, seconds = len(results["workloads"]), time.perf_counter() - tick
            log_progress(record, done=done, total=total, seconds=seconds)
    summary = check_summary(results["workloads"])
    summary["runtime_s"] = time.perf_counter() - started
    results["summary"] = summary
    print_report(results, detail=args.detail)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.check and not summary["passed"]:
        print(
            f"check failed: auto / best static is {summary['min_auto_vs_best_static']:.3f} for "
            f"{summary['worst_workload']}, below {CHECK_THRESHOLD}",
            file=sys.stderr,
        )
        return 1
    return 0


def log_progress(record: dict, *, done: int, total: int, seconds: float) -> None:
    auto = record["strategies"]["auto"]
    if "error" in auto:
        what = f"auto does not fit: {auto['error']}"
    else:
        ratio = record["auto_vs_best_static"]
        what = f"auto {auto['step_s']:.2f} s ({';'.join(auto['layouts'])}), " + (
            "no static fits" if ratio is None else f"{ratio:.3f}× best static"
        )
    label = Workload(**_key(record)).label
    print(f"[{done}/{total}] {label}: {what} ({seconds:.1f} s)", file=sys.stderr, flush=True)


def print_report(results: dict, *, detail: bool) -> None:
    out, config, summary = sys.stdout, results["config"], results["summary"]
    print(
        f"Predicted by the estimator's cost model: {config['seq_length']}-token context, "
        f"{config['global_batch_size']} documents per step, buckets "
        f"{','.join(map(str, config['buckets']))}. Cells: speedup over packed-causal "
        "(Megatron-LM packing, our stand-in for the paper's baseline).",
        file=out,
    )
    print_distributions(results["distributions"], out)
    print(file=out)
    print_summary_table(results["workloads"], out)
    if detail:
        print(file=out)
        print_detail_table(results["workloads"], out)
    least = summary["min_auto_vs_best_static"]
    print(
        f"\nauto / best static: min {'—' if least is None else f'{least:.3f}'} over "
        f"{summary['checked']} of {summary['workloads']} workloads"
        + (f" ({summary['worst_workload']})" if summary["worst_workload"] else "")
        + f"; ran in {summary['runtime_s']:.0f} s",
        file=out,
    )
    unsafe = summary["fit_on_mean_rows_only"]
    if unsafe:
        print(
            f"{len(unsafe)} plans do not fit device memory when re-priced at the busiest "
            f"sampled step (marked ✗): {', '.join(unsafe)}",
            file=out,
        )


if __name__ == "__main__":
    raise SystemExit(main())
