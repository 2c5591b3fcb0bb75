"""The longest sequence a model trains at on given GPUs, over the layouts that make sense.

For each candidate layout (TP in {1, 2, 4, 8} within a node with SP on whenever TP > 1, CP
powers of two, DP the rest; PP as given) and each setting the method tries
(``MemoryMethod.search_settings``: MEMO's kept last layers in {2, 1, 0} and α in {the rule's α,
0}), a galloping search over multiples of ``granularity · 2·CP`` finds the longest
length that fits device and host memory; the best layout is the longest, then the fastest. Fit
is monotone in the length (every stored byte grows with it), which makes the search exact.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from memo_ext.estimate.cost_model import (
    Batch,
    Efficiency,
    Estimate,
    EstimateError,
    check_layout,
    estimate,
)
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.hardware import DeviceSpec
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

DEFAULT_GRANULARITY = 4096
MAX_MULTIPLE = 1 << 12
"""Search stops at ``granularity · 2·CP · 4096`` tokens (16M at CP 1)."""


@dataclass(frozen=True)
class SearchSpace:
    """Which knobs the search may turn; ``None`` means "try every sensible value"."""

    tp: int | None = None
    cp: int | None = None
    pp: int = 1
    sp: bool | None = None
    fixed: tuple[tuple[str, Any], ...] = ()
    """The method's own settings the user fixed, by its settings' field names (MEMO:
    ``alpha``, ``keep_last_layers``, ``chunk_tokens``, ``offload_rule``); the method's search
    tries the rest (``MemoryMethod.search_settings``)."""


def candidate_layouts(
    model: ModelShape, device: DeviceSpec, *, gpus: int, space: SearchSpace, batch: Batch
) -> Iterator[ParallelLayout]:
    """Layouts of ``gpus`` GPUs that megatron-core accepts for ``model``."""
    tps = [space.tp] if space.tp else [t for t in (1, 2, 4, 8) if t <= device.gpus_per_node]
    cps = [space.cp] if space.cp else [1 << k for k in range(0, 11) if 1 << k <= gpus]
    for tp, cp in itertools.product(tps, cps):
        model_parallel = tp * cp * space.pp
        if gpus % model_parallel:
            continue
        sp = (tp > 1) if space.sp is None else space.sp
        layout = ParallelLayout(tp=tp, cp=cp, pp=space.pp, dp=gpus // model_parallel, sp=sp)
        try:
            check_layout(model, layout, batch, seq_length=_granularity(layout, DEFAULT_GRANULARITY))
        except EstimateError:
            continue
        yield layout


def _granularity(layout: ParallelLayout, granularity: int) -> int:
    return granularity * 2 * layout.cp


def longest_fitting(run, *, layout: ParallelLayout, granularity: int) -> Estimate | None:
    """Galloping then binary search for the largest multiple of the layout's step that fits.

    ``run(layout=, seq_length=)`` returns an ``Estimate``.
    """
    step = _granularity(layout, granularity)
    first = run(layout=layout, seq_length=step)
    if not first.fits:
        return None
    lo, best = 1, first
    hi = 2
    while hi <= MAX_MULTIPLE:
        est = run(layout=layout, seq_length=hi * step)
        if not est.fits:
            break
        lo, best, hi = hi, est, hi * 2
    else:
        return best
    while hi - lo > 1:
        mid = (lo + hi) // 2
        est = run(layout=layout, seq_length=mid * step)
        if est.fits:
            lo, best = mid, est
        else:
            hi = mid
    return best


_ANY = SearchSpace()
DEFAULT_BATCH = Batch()
DEFAULT_EFFICIENCY = Efficiency()


def _configurations(*, space: SearchSpace, method: MemoryMethod, gpus: int, batch: Batch, **fixed):
    """What the search tries: ``(layout, run)`` per candidate layout and setting of the method
    (:meth:`MemoryMethod.search_settings`), where ``run(layout=, seq_length=)`` estimates it
    (``fixed``: the rest of ``estimate``'s inputs)."""
    model, device = fixed["model"], fixed["device"]
    for layout in candidate_layouts(model, device, gpus=gpus, space=space, batch=batch):
        for settings in method.search_settings(space):
            yield (
                layout,
                functools.partial(estimate, method=method, batch=batch, settings=settings, **fixed),
            )


def find_max_seq_length(
    *,
    model: ModelShape,
    device: DeviceSpec,
    gpus: int,
    method: MemoryMethod,
    host_memory_bytes: int,
    space: SearchSpace = _ANY,
    batch: Batch = DEFAULT_BATCH,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    granularity: int = DEFAULT_GRANULARITY,
    progress: bool = False,
) -> Estimate | None:
    """The best configuration at the longest length that fits, or ``None`` when none does;
    ``progress``: a bar on stderr over the configurations searched (seconds each on a loaded
    machine)."""
    best: Estimate | None = None
    configurations = list(
        _configurations(
            space=space,
            method=method,
            gpus=gpus,
            batch=batch,
            model=model,
            device=device,
            host_memory_bytes=host_memory_bytes,
            efficiency=efficiency,
        )
    )
    bar = tqdm(configurations, desc="layouts searched", unit="layout", disable=not progress)
    for layout, run in bar:
        found = longest_fitting(run, layout=layout, granularity=granularity)
        if found is not None and (best is None or _better(found, best)):
            best = found
    return best


def _better(a: Estimate, b: Estimate) -> bool:
    return (a.seq_length, a.mfu) > (b.seq_length, b.mfu)


def best_at_length(
    *,
    model: ModelShape,
    device: DeviceSpec,
    gpus: int,
    method: MemoryMethod,
    seq_length: int,
    host_memory_bytes: int,
    space: SearchSpace = _ANY,
    batch: Batch = DEFAULT_BATCH,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> Estimate:
    """The fastest fitting configuration at ``seq_length`` (else the one with the least memory).

    Raises:
        EstimateError: when no candidate layout accepts ``seq_length``; the user's own layout
            (or TP / CP 1) explains why.
    """
    results = []
    for layout, run in _configurations(
        space=space,
        method=method,
        gpus=gpus,
        batch=batch,
        model=model,
        device=device,
        host_memory_bytes=host_memory_bytes,
        efficiency=efficiency,
    ):
        try:
            results.append(run(layout=layout, seq_length=seq_length))
        except EstimateError:
            continue
    if not results:
        asked = ParallelLayout(tp=space.tp or 1, cp=space.cp or 1, pp=space.pp, sp=bool(space.sp))
        check_layout(model, asked, batch, seq_length=seq_length)
        raise EstimateError(f"no parallel layout of {gpus} GPUs accepts --seq-length {seq_length}")
    fitting = [r for r in results if r.fits]
    if fitting:
        return max(fitting, key=lambda r: r.mfu)
    return min(results, key=lambda r: r.device_peak_bytes)
