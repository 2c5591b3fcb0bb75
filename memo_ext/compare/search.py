"""The longest sequence a method trains at, found by real runs (:func:`find_longest`): doubling
from the longest known to train, then bisecting between what trains and what runs out of
memory or time. A length that ran out of time is reported as such: it caps the search (a
longer one takes longer still) without saying where the memory runs out."""

from __future__ import annotations

from memo_ext.compare.comparison import Comparison, estimate_configuration
from memo_ext.compare.jobs import (
    OK,
    OOM,
    TIMEOUT,
    Method,
)
from memo_ext.compare.runs import Runner
from memo_ext.errors import UsageError
from memo_ext.estimate.cost_model import EstimateError


def find_longest(comp: Comparison, runner: Runner, method: Method) -> dict:
    """The longest length ``method`` trains at, by real runs over multiples of the granularity:
    from the longest known to train, double until one fails (out of device memory, MEMO's host
    budget refusing it, or past the time limit), then halve the gap; a failure of another kind
    stops the search. The ``bound`` says what the shortest failing length did: "does not
    train" (out of memory), or ran past the job time limit (its memory untested)."""
    unit = comp.granularity
    runs = runner.results.current()
    lo, hi = known_bounds(runs, method.label)
    failed = _status_at(runs, method.label, hi)
    if lo is None and hi is None:
        seq = _round(comp.find_max_start or _predicted_longest(comp, method), unit)
        lo, hi, failed, stop = _probe(runner, method, seq, lo, hi, failed)
        if stop:
            return {"longest": None, "bound": stop}
    while True:
        if lo is None:
            seq = _round(hi // 2, unit)
            if seq >= hi:
                fails = "fails" if failed == OOM else _timed_out(comp)
                return {"longest": None, "bound": f"{hi:,} {fails} and nothing shorter to try"}
        elif hi is None:
            if lo >= comp.max_seq_length:
                return {"longest": lo, "bound": "reached --max-seq-length"}
            seq = min(_round(2 * lo, unit), comp.max_seq_length)
        else:
            if hi - lo <= unit:
                fails = "does not train" if failed == OOM else _timed_out(comp)
                return {"longest": lo, "bound": f"{hi:,} {fails}"}
            seq = max(_round((lo + hi) // 2, unit), lo + unit)
        lo, hi, failed, stop = _probe(runner, method, seq, lo, hi, failed)
        if stop:
            return {"longest": lo, "bound": stop}


def _probe(runner: Runner, method: Method, seq: int, lo, hi, failed):
    """Run ``seq``: (lo, hi, the status at hi, why the search stops or None)."""
    record = runner.run(method, seq)
    if record["status"] == OK:
        return seq, hi, failed, None
    if record["status"] in (OOM, TIMEOUT):
        return lo, seq, record["status"], None
    return lo, hi, failed, f"{seq:,} failed: {record['message']}"


def _timed_out(comp: Comparison) -> str:
    """What a length that timed out did: its memory was never put to the test."""
    return f"ran past --job-timeout-s {comp.timeout_s:g}: a time limit, not a memory one"


def known_bounds(runs: list[dict], label: str) -> tuple[int | None, int | None]:
    """(longest that trained, shortest above it that ran out of memory or time)."""
    mine = [r for r in runs if r["method"] == label]
    trained = [r["seq_length"] for r in mine if r["status"] == OK]
    lo = max(trained, default=None)
    failed = [
        r["seq_length"]
        for r in mine
        if r["status"] in (OOM, TIMEOUT) and (lo is None or r["seq_length"] > lo)
    ]
    return lo, min(failed, default=None)


def _status_at(runs: list[dict], label: str, seq: int | None) -> str | None:
    """How the runs of ``seq`` failed: out of memory where one did, else out of time."""
    statuses = {r["status"] for r in runs if r["method"] == label and r["seq_length"] == seq}
    return OOM if OOM in statuses else TIMEOUT if TIMEOUT in statuses else None


def _round(seq: int, unit: int) -> int:
    return max(unit, seq // unit * unit)


def _predicted_longest(comp: Comparison, method: Method) -> int:
    """The estimator's longest fitting multiple of the granularity (on CPU, where it models
    another precision and memory than the run's: the granularity)."""
    unit = comp.granularity
    if not comp.cuda:
        return unit

    def fits(seq: int) -> bool:
        try:
            return estimate_configuration(comp, method, seq).fits
        except (EstimateError, UsageError):
            return False

    seq = unit
    while fits(2 * seq) and 2 * seq <= comp.max_seq_length:
        seq *= 2
    return seq
