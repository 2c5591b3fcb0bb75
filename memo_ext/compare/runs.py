"""``memo-compare``' record of runs (``compare.json``, :class:`Results`) and the runner
that starts each configuration's job at most once (:class:`Runner`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from tqdm import tqdm

from memo_ext.compare.comparison import Comparison, job_argv, predict, run_key, traced_figures
from memo_ext.compare.jobs import (
    OK,
    REFUSED,
    JobOutcome,
    Method,
    measured_figures,
    run_job,
)
from memo_ext.errors import UsageError
from memo_ext.files import read_json

FORMAT = "memo-compare/1"


class Results:
    """``compare.json``: every run so far, saved after each one (so a stopped comparison
    resumes where it stopped)."""

    def __init__(self, comp: Comparison) -> None:
        self.path = comp.out / "compare.json"
        self.comp = comp
        self.runs: dict[str, dict] = {}
        self.searches: dict[str, dict] = {}
        self.calibration: dict | None = None
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = read_json(self.path)
        except UsageError as err:
            raise UsageError(f"{err}; remove it to start over") from None
        if data.get("format") != FORMAT or data.get("signature") != _jsonable(
            self.comp.signature()
        ):
            raise UsageError(
                f"{self.path} holds a comparison of another model, launch, step count or trainer "
                "flags; use another --out or remove it"
            )
        runs = data.get("runs", [])
        if not isinstance(runs, list) or not all(isinstance(r, dict) and "key" in r for r in runs):
            raise UsageError(f"{self.path} holds damaged run records; remove it to start over")
        self.runs = {run["key"]: run for run in runs}
        self.searches = data.get("find_max", {})
        self.calibration = data.get("calibration")

    def save(self) -> None:
        comp = self.comp
        data = {
            "format": FORMAT,
            "signature": _jsonable(comp.signature()),
            "methods": [m.label for m in comp.methods],
            "layouts": {k: dataclasses.asdict(v) for k, v in comp.layouts.items()},
            "device": dataclasses.asdict(comp.device),
            "efficiency": dataclasses.asdict(comp.efficiency),
            "kernels": dataclasses.asdict(comp.kernels) if comp.kernels else None,
            "notes": comp.notes,
            "runs": list(self.runs.values()),
            "find_max": self.searches,
            "calibration": self.calibration,
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def current(self) -> list[dict]:
        """Runs of this comparison's methods."""
        labels = {m.label for m in self.comp.methods}
        return [r for r in self.runs.values() if r["method"] in labels]


def _jsonable(value):
    return json.loads(json.dumps(value))


class BudgetSpent(Exception):
    """--time-budget-s has passed: no new job starts."""


class Runner:
    """Runs configurations once each, records them, and shows progress."""

    def __init__(self, comp: Comparison, results: Results, bar: tqdm) -> None:
        self.comp, self.results, self.bar = comp, results, bar
        self.deadline = time.monotonic() + (comp.time_budget_s or float("inf"))
        (comp.out / "jobs").mkdir(parents=True, exist_ok=True)

    def run(self, method: Method, seq: int) -> dict:
        """The record of ``method`` at ``seq`` tokens: from the file, else from a new job; for a
        method this machine cannot run, a ``refused`` record (decided anew on every invocation,
        so a machine that can run it does)."""
        key = run_key(self.comp, method, seq)
        if self.bar.n >= self.bar.total:  # a search's runs are not known in advance
            self.bar.total = self.bar.n + 1
        done = self.results.runs.get(key)
        retry = done is not None and (
            done["status"] == REFUSED or (self.comp.retry_errors and done["status"] == "error")
        )
        if done is not None and not retry:
            self.bar.update(1)
            return done
        refusal = method.refusal()
        if refusal is None and time.monotonic() > self.deadline:
            raise BudgetSpent
        if refusal is not None:
            record = self._record(method, seq, key, JobOutcome(REFUSED, None, 0.0, refusal))
        else:
            record = self._run_job(method, seq, key)
        self.results.runs[key] = record
        self.results.save()
        self.bar.update(1)
        tqdm.write(_one_line(record), file=sys.stderr)
        return record

    def _run_job(self, method: Method, seq: int, key: str) -> dict:
        comp = self.comp
        stem = f"{method.label.replace('@', '_at_').replace('=', '_').replace('+', 'p')}_{seq}"
        metrics, log = comp.out / "jobs" / f"{stem}.jsonl", comp.out / "jobs" / f"{stem}.log"
        argv = job_argv(comp, method, seq, metrics=metrics, job_id=f"compare-{key}")
        name = f"{method.label} @ {seq:,}"
        self.bar.set_postfix_str(name)
        live = sys.stderr.isatty()  # a log file gets the bar's own, rarer lines
        tick = lambda s: self.bar.set_postfix_str(f"{name}: {s:.0f} s", refresh=live)  # noqa: E731
        outcome = run_job(
            argv,
            log_path=log,
            metrics_path=metrics,
            timeout_s=comp.timeout_s,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            on_tick=tick,
        )
        return self._record(
            method, seq, key, outcome, log=str(log.relative_to(comp.out)), command=argv
        )

    def _record(
        self,
        method: Method,
        seq: int,
        key: str,
        outcome: JobOutcome,
        *,
        log: str | None = None,
        command: list[str] | None = None,
    ) -> dict:
        """The JSON record of one configuration: what ``outcome`` says, next to the estimate and
        the traced figures (``log`` and ``command`` are ``None`` where no job ran)."""
        comp = self.comp
        measured = measured_figures(outcome.records, warmup_steps=comp.warmup_steps)
        # the largest process's resident set (imported libraries and all), kept in the JSON only
        measured["peak_rss_bytes"] = outcome.peak_rss_bytes
        # "peak mem meas" is the device allocator's peak the run recorded in its metrics (none on
        # CPU) and only for a run that trained: a failed job's figures are its last moments'
        if outcome.status == OK:
            measured["peak_memory_bytes"] = measured.get("mem_allocated_bytes")
        predicted = predict(comp, method, seq)
        trained = measured if outcome.status == OK else {}
        return {
            "key": key,
            "method": method.label,
            "seq_length": seq,
            "layout": dataclasses.asdict(comp.layouts[method.label]),
            "status": outcome.status,
            "exit_status": outcome.exit_status,
            "message": outcome.message,
            "requested_bytes": outcome.requested_bytes,
            "wall_s": outcome.wall_s,
            "measured": measured,
            "predicted": predicted,
            "deterministic": traced_figures(
                comp, method, seq, measured=trained, predicted=predicted
            ),
            "log": log,
            "command": command,
        }


def _one_line(record: dict) -> str:
    status = record["status"]
    text = f"{record['method']} @ {record['seq_length']:,}: {status}"
    if status == OK:
        step = record["measured"]["step_time_s"]
        text += f", {step:.3g} s/step" if step is not None else ""
    elif record.get("message"):
        message = record["message"]
        text += f" ({message if len(message) <= 160 else message[:159] + '…'})"
    return text
