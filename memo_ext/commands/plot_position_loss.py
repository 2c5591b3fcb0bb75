"""Draw the validation loss by token position of one or more runs (is the long context used?).

    python -m tools.plot_position_loss runs/a/metrics.jsonl runs/b/metrics.jsonl --out curve.png
    python -m tools.plot_position_loss runs/a/metrics.jsonl --iteration 2000 --out curve.png

Reads each file's ``val_loss_by_position`` record (written at every evaluation unless
--eval-position-min-tokens 0) at ``--iteration`` (default: each file's last evaluation) and
draws loss against position bucket, one line per file, on a log-2 position axis. Needs
matplotlib (``pip install matplotlib``, or the ``plots`` extra). Exits 2 on bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memo_ext.arguments import OneSentenceParser
from memo_ext.errors import UsageError
from memo_ext.plugins import with_plugins
from memo_ext.training.metrics import read_metrics

METRICS_KEY = "val_loss_by_position"
"""The record key the curve is read from (``memo_ext.training.position_loss.METRICS_KEY``; not
imported from there, which loads torch)."""


PROG = "memo-plot-position-loss"
"""The installed command: its usage line and error prefix."""


def position_curve(records: list[dict], *, iteration: int | None = None) -> tuple[int, dict]:
    """(iteration, ``{"first-last": loss}``) of the evaluation at ``iteration`` (the last one
    when None).

    Raises:
        UsageError: no record with the figures (at that iteration).
    """
    evaluated = [r for r in records if isinstance(r.get(METRICS_KEY), dict)]
    if not evaluated:
        raise UsageError(
            f"no record has {METRICS_KEY}: run with --eval-interval N (and "
            "--eval-position-min-tokens above 0)"
        )
    if iteration is None:
        return evaluated[-1]["iteration"], evaluated[-1][METRICS_KEY]
    for record in evaluated:
        if record["iteration"] == iteration:
            return iteration, record[METRICS_KEY]
    found = ", ".join(str(r["iteration"]) for r in evaluated)
    raise UsageError(f"--iteration {iteration}: no evaluation there; evaluated at {found}")


def bucket_points(curve: dict) -> tuple[list[int], list[int], list[float]]:
    """(first positions, last positions, losses) of a curve's buckets, by first position."""
    spans = sorted((*map(int, label.split("-")), loss) for label, loss in curve.items())
    return [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans]


def draw(curves: list[tuple[str, int, dict]], out: Path) -> None:
    """One line per (name, iteration, curve), x at each bucket's last position + 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, iteration, curve in curves:
        _, lasts, losses = bucket_points(curve)
        ax.plot(
            [last + 1 for last in lasts], losses, marker="o", label=f"{name} (iter {iteration})"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position (bucket end)")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss by token position")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("metrics", nargs="+", help="Metrics files (--metrics-file) of the runs.")
    parser.add_argument("--out", required=True, help="PNG file to write.")
    parser.add_argument(
        "--iteration", type=int, default=None, help="Evaluation to draw (default: the last)."
    )
    try:
        args = parser.parse_args(argv)
        curves = []
        for path in args.metrics:
            try:
                iteration, curve = position_curve(read_metrics(path), iteration=args.iteration)
            except UsageError as err:
                raise UsageError(f"{path}: {err}") from None
            curves.append((Path(path).parent.name or Path(path).stem, iteration, curve))
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "drawing needs matplotlib: pip install matplotlib (or the plots extra)"
            ) from None
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(curves, out)
    print(f"wrote {out} ({len(curves)} run{'s' if len(curves) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
