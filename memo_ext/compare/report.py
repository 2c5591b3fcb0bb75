"""The console table, the summary and the plot of ``memo-compare``.

Every function reads the run records of the comparison's JSON file (one dict per configuration:
``method``, ``seq_length``, ``status``, ``measured``, ``predicted``, ``deterministic`` and, after
a calibration, ``calibrated``), so a table or plot can be redrawn from the file alone.
"""

from __future__ import annotations

from pathlib import Path

OK = "ok"


def format_bytes(n: float | None) -> str:
    """``1.50 GiB``, ``12.0 MiB``; ``-`` for unknown."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _pair(measured, predicted, fmt) -> str:
    left = fmt(measured) if measured is not None else "-"
    right = fmt(predicted) if predicted is not None else "-"
    return f"{left} / {right}"


def _status(run: dict) -> str:
    status = run["status"]
    if status == "oom" and run.get("requested_bytes") is not None:
        return f"OOM ({format_bytes(run['requested_bytes'])} asked)"
    return {"ok": "ok", "oom": "OOM", "timeout": "timeout", "error": "error"}.get(status, status)


def _baseline_step(runs: list[dict], run: dict) -> tuple[float | None, float | None]:
    """(measured, predicted) step time of ``none`` at the same length, if it ran."""
    for other in runs:
        same = other["method"] == "none" and other["seq_length"] == run["seq_length"]
        if same and other["status"] == OK:
            return other["measured"]["step_time_s"], other["predicted"].get("step_time_s")
    return None, None


def run_rows(runs: list[dict]) -> list[list[str]]:
    """One row per run: measured / predicted side by side, deterministic figures after."""
    rows = []
    for run in sorted(runs, key=lambda r: (r["method"], r["seq_length"])):
        meas, pred, det = run.get("measured") or {}, run["predicted"], run.get("deterministic")
        base_m, base_p = _baseline_step(runs, run)
        ratio_m = meas.get("step_time_s") / base_m if base_m and meas.get("step_time_s") else None
        ratio_p = pred.get("step_time_s") / base_p if base_p and pred.get("step_time_s") else None
        det = det or {}
        rows.append(
            [
                run["method"],
                f"{run['seq_length']:,}",
                _status(run),
                _pair(meas.get("step_time_s"), pred.get("step_time_s"), lambda v: f"{v:.3g}"),
                _pair(ratio_m, ratio_p, lambda v: f"{v:.2f}"),
                _pair(meas.get("mfu"), pred.get("mfu"), lambda v: f"{100 * v:.1f}%"),
                _pair(meas.get("peak_memory_bytes"), pred.get("peak_memory_bytes"), format_bytes),
                format_bytes(det.get("device_activation_bytes")),
                _pair(meas.get("host_offload_bytes"), det.get("host_bytes"), format_bytes),
                f"{det['recompute_flops'] / 1e9:.3g}" if "recompute_flops" in det else "-",
            ]
        )
    return rows


HEADER = [
    "method",
    "seq",
    "status",
    "step s meas/pred",
    "× none meas/pred",
    "MFU meas/pred",
    "peak mem meas/pred",
    "activations",
    "host meas/traced",
    "recompute GFLOP",
]


def format_table(runs: list[dict]) -> str:
    """The runs as an aligned text table (see :data:`HEADER`)."""
    rows = [HEADER] + run_rows(runs)
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def longest(runs: list[dict], method: str) -> dict | None:
    """The longest run of ``method`` that trained."""
    done = [r for r in runs if r["method"] == method and r["status"] == OK]
    return max(done, key=lambda r: r["seq_length"], default=None)


def format_summary(runs: list[dict], methods: list[str], searches: dict[str, dict]) -> str:
    """Per method: the longest sequence that trained (and what bounds it), its MFU and step
    time; then each method against the first one."""
    lines = []
    best = {m: longest(runs, m) for m in methods}
    for method in methods:
        run, search = best[method], searches.get(method, {})
        if run is None:
            mine = [r for r in runs if r["method"] == method and r["status"] == "refused"]
            why = f" (refused: {mine[0]['message']})" if mine else ""
            lines.append(f"{method}: no length trained{why}")
            continue
        bound = search.get("bound")
        note = f" ({bound})" if bound else ""
        mfu = run["measured"].get("mfu")
        mfu_text = f", MFU {100 * mfu:.1f}%" if mfu is not None else ""
        lines.append(
            f"{method}: longest trained {run['seq_length']:,} tokens{note}{mfu_text}, step "
            f"{run['measured']['step_time_s']:.3g} s"
        )
    base = best.get(methods[0]) if methods else None
    for method in methods[1:]:
        run = best[method]
        if base is None or run is None:
            continue
        text = f"{method} vs {methods[0]}: {run['seq_length'] / base['seq_length']:.2f}× the length"
        mfu, base_mfu = run["measured"].get("mfu"), base["measured"].get("mfu")
        if mfu and base_mfu:
            text += f", {mfu / base_mfu:.2f}× the MFU (each at its longest)"
        lines.append(text)
    return "\n".join(lines)


def plot_comparison(
    runs: list[dict], methods: list[str], path: Path, *, title: str, mfu_note: str
) -> None:
    """MFU against sequence length per method (measured solid, predicted dashed; out-of-memory
    lengths as crosses on the axis; each method's longest trained length starred), and the
    estimator's step time against the measured one.

    Raises:
        ImportError: without matplotlib (``pip install matplotlib`` or the ``plots`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, method in enumerate(methods):
        color = colors[i % len(colors)]
        _plot_method(left, runs, method, color)
        _plot_times(right, runs, method, color)
    left.set_xscale("log", base=2)
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel(f"MFU ({mfu_note})")
    left.set_title("MFU by sequence length (★ longest trained, × out of memory)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    _finish_times(right)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_method(ax, runs: list[dict], method: str, color: str) -> None:
    mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["seq_length"])
    done = [r for r in mine if r["status"] == OK and r["measured"].get("mfu") is not None]
    if done:
        xs = [r["seq_length"] for r in done]
        ax.plot(xs, [r["measured"]["mfu"] for r in done], "o-", color=color, label=method)
    predicted = [r for r in mine if r["predicted"].get("mfu") is not None]
    if predicted:
        ax.plot(
            [r["seq_length"] for r in predicted],
            [r["predicted"]["mfu"] for r in predicted],
            "--",
            color=color,
            alpha=0.6,
            label=f"{method} (estimator)",
        )
    failed = [r for r in mine if r["status"] in ("oom", "timeout")]
    if failed:
        ax.plot([r["seq_length"] for r in failed], [0] * len(failed), "x", color=color, ms=10)
    best = longest(runs, method)
    if best is not None and best["measured"].get("mfu") is not None:
        y = best["measured"]["mfu"]
        ax.plot([best["seq_length"]], [y], "*", color=color, ms=16)
        ax.annotate(
            f"{best['seq_length']:,}",
            (best["seq_length"], y),
            textcoords="offset points",
            xytext=(6, 6),
            color=color,
            fontsize=8,
        )


def _plot_times(ax, runs: list[dict], method: str, color: str) -> None:
    done = [
        r
        for r in runs
        if r["method"] == method and r["status"] == OK and r["predicted"].get("step_time_s")
    ]
    if not done:
        return
    measured = [r["measured"]["step_time_s"] for r in done]
    ax.plot(measured, [r["predicted"]["step_time_s"] for r in done], "o", color=color, label=method)
    calibrated = [r for r in done if (r.get("calibrated") or {}).get("step_time_s")]
    if calibrated:
        ax.plot(
            [r["measured"]["step_time_s"] for r in calibrated],
            [r["calibrated"]["step_time_s"] for r in calibrated],
            "s",
            mfc="none",
            color=color,
            label=f"{method} (calibrated)",
        )


def _finish_times(ax) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="k", alpha=0.08)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("estimated step time (s)")
    ax.set_title("estimator against measurement (band: ±10%)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
