"""Pictures of memory layouts: time on x, address on y, one rectangle per tensor.

matplotlib is imported only here, and only when a picture is asked for (``pip install
matplotlib`` or the project's ``plots`` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memo_ext.planner.caching_allocator import CachingAllocatorReplay
from memo_ext.planner.plan import Plan
from memo_ext.planner.problem import problem_from_trace
from memo_ext.planner.trace import Trace

GIB = float(1 << 30)


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "drawing the memory picture needs matplotlib: pip install matplotlib "
            "(or the project's 'plots' extra)"
        ) from None
    return plt


def _draw(ax, problem, addresses: np.ndarray, title: str, top_bytes: int) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    rects = [
        Rectangle((s, a / GIB), e - s, z / GIB)
        for s, e, a, z in zip(problem.start, problem.end, addresses, problem.sizes)
    ]
    colours = np.random.default_rng(0).random(len(rects))
    patches = PatchCollection(rects, cmap="tab20", edgecolor="k", linewidth=0.2)
    patches.set_array(colours)
    ax.add_collection(patches)
    ax.axhline(top_bytes / GIB, color="red", linewidth=1)
    ax.set_xlim(0, int(problem.end.max()) if problem.n else 1)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("event")
    ax.set_ylabel("address (GiB)")


def plot_layouts(
    *, trace: Trace, plan: Plan, replay: CachingAllocatorReplay, path: str | Path
) -> None:
    """Draws the caching allocator's layout next to the plan's, to the PNG at ``path``.

    Raises:
        RuntimeError: when matplotlib is not installed.
    """
    plt = _import_pyplot()
    ids, problem = problem_from_trace(trace)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    cached = np.asarray([replay.addresses[key] for key in ids], dtype=np.int64)
    planned = np.asarray([plan.offsets[key] for key in ids], dtype=np.int64)
    _draw(
        axes[0],
        problem,
        cached,
        f"caching allocator: reserved {replay.reserved_peak_bytes / GIB:.2f} GiB",
        replay.reserved_peak_bytes,
    )
    for address, _ in replay.segments:
        axes[0].axhline(address / GIB, color="grey", linewidth=0.3, linestyle=":")
    _draw(axes[1], problem, planned, f"plan: peak {plan.peak_bytes / GIB:.2f} GiB", plan.peak_bytes)
    top = max(replay.reserved_peak_bytes, plan.peak_bytes) / GIB
    axes[0].set_ylim(0, top * 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
