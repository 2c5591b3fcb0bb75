"""Compare two runs' metrics files step by step: are the loss curves the same?

    python -m tools.compare_metrics runs/tp1/metrics.jsonl runs/tp2/metrics.jsonl --rtol 1e-5

Both files must log the same iterations; at each, ``loss`` and ``grad_norm`` (or ``--keys``) must
agree within ``--rtol`` relative to the first file. Exits 0 when they do, 1 naming every
difference, 2 on bad input. The distributed parity tests compare their runs with it.
"""

from __future__ import annotations

import sys

from memo_ext.arguments import OneSentenceParser
from memo_ext.errors import UsageError
from memo_ext.flags import finite_float
from memo_ext.plugins import with_plugins
from memo_ext.training.metrics import CURVE_KEYS, curve_differences, read_metrics

PROG = "memo-compare-metrics"
"""The installed command: its usage line and error prefix."""


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("reference", help="Metrics file of the reference run.")
    parser.add_argument("other", help="Metrics file of the run to check.")
    parser.add_argument(
        "--rtol", type=finite_float, default=1e-5, help="Relative tolerance (default 1e-5)."
    )
    parser.add_argument(
        "--keys", nargs="+", default=list(CURVE_KEYS), help="Record keys to compare."
    )
    try:
        args = parser.parse_args(argv)
        if args.rtol < 0:
            raise UsageError(f"--rtol must be >= 0, got {args.rtol}")
        reference, other = read_metrics(args.reference), read_metrics(args.other)
        unknown = [key for key in args.keys if all(key not in r for r in reference)]
        if unknown:
            raise UsageError(
                f"--keys {' '.join(unknown)}: no record of {args.reference} has "
                f"{'it' if len(unknown) == 1 else 'them'}"
            )
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    differences = curve_differences(reference, other, rtol=args.rtol, keys=tuple(args.keys))
    for line in differences:
        print(line)
    if differences:
        print(f"{len(differences)} differences beyond rtol {args.rtol:g}")
        return 1
    keys = ", ".join(args.keys)
    print(f"{len(reference)} logged iterations agree within rtol {args.rtol:g} on {keys}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
