"""Trace files: ``memo-trace/1`` JSON in and out, MiniMalloc CSV and PyTorch snapshots in.

:func:`load_trace` picks the reader by the file's suffix: ``.csv`` is a MiniMalloc problem
(``id,lower,upper,size``, lifetimes as half-open ``[lower, upper)`` intervals), ``.pickle`` /
``.pkl`` a PyTorch memory snapshot with allocator history (``memo_ext.planner.cuda_history``),
anything else ``memo-trace/1`` JSON (``memo_ext.planner.trace``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from memo_ext.planner.errors import PlannerInputError
from memo_ext.planner.trace import Trace, trace_from_dict, trace_from_intervals, trace_to_dict


def save_trace(trace: Trace, path: str | Path) -> None:
    """Writes a trace as a ``memo-trace/1`` JSON file."""
    Path(path).write_text(json.dumps(trace_to_dict(trace)) + "\n")


def load_trace(path: str | Path) -> Trace:
    """Reads a ``memo-trace/1`` JSON file, a MiniMalloc CSV when the name ends in ``.csv``, or
    a PyTorch memory snapshot with allocator history (device 0) when it ends in ``.pickle`` or
    ``.pkl`` (``memo_ext.planner.cuda_history``).

    Raises:
        PlannerInputError: missing file, malformed JSON, unknown format or bad events.
    """
    path = Path(path)
    if not path.is_file():
        raise PlannerInputError(f"trace file {str(path)!r} does not exist")
    if path.suffix.lower() == ".csv":
        return trace_from_minimalloc_csv(path)
    if path.suffix.lower() in (".pickle", ".pkl"):
        # torch's snapshots only: the planner's other files are read without loading torch
        from memo_ext.planner.cuda_history import load_cuda_snapshot

        return load_cuda_snapshot(path)
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlannerInputError(f"trace file {str(path)!r} is not valid JSON ({err})") from None
    return trace_from_dict(doc)


_CSV_COLUMNS = {"id": ("id", "buffer"), "lower": ("lower", "start"), "upper": ("upper", "end")}


def _csv_column(header: list[str], key: str) -> int:
    for name in _CSV_COLUMNS.get(key, (key,)):
        if name in header:
            return header.index(name)
    raise PlannerInputError(f"the CSV header {header} has no {key!r} column")


def _read_csv_rows(path: Path) -> list[tuple[str, int, int, int]]:
    with path.open(newline="") as handle:
        rows = [row for row in csv.reader(handle) if row and any(cell.strip() for cell in row)]
    if not rows:
        raise PlannerInputError(f"CSV file {str(path)!r} is empty")
    header = [cell.strip().lower() for cell in rows[0]]
    cols = [_csv_column(header, key) for key in ("id", "lower", "upper", "size")]
    buffers = []
    for line, row in enumerate(rows[1:], start=2):
        try:
            buffer_id = row[cols[0]].strip()
            lower, upper, size = (int(row[c]) for c in cols[1:])
        except (IndexError, ValueError):
            raise PlannerInputError(f"CSV line {line}: expected id,lower,upper,size") from None
        if upper < lower:
            raise PlannerInputError(
                f"CSV line {line} (id {buffer_id!r}): upper {upper} is below lower {lower}"
            )
        buffers.append((buffer_id, lower, upper, size))
    return buffers


def trace_from_minimalloc_csv(path: str | Path) -> Trace:
    """Converts a MiniMalloc CSV (``id,lower,upper,size``) into a trace.

    Buffer ``b`` lives over ``[lower, upper)``. Events are emitted time point by time point, the
    frees of buffers ending at ``t`` before the allocs of buffers starting at ``t``, so two
    buffers conflict in the trace exactly when their intervals intersect. A zero-length buffer
    (``lower == upper``) is allocated and freed at ``t`` after the other allocs there. The header
    may also name the columns ``buffer,start,end,size``; other columns are ignored.

    Raises:
        PlannerInputError: unreadable rows, duplicate ids, non-positive sizes.
    """
    buffers = _read_csv_rows(Path(path))
    return trace_from_intervals(buffers, meta={"source": str(path), "kind": "minimalloc-csv"})
