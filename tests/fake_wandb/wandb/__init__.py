"""A stand-in for the ``wandb`` package, for tests: it records what the trainer sends.

Put ``tests/fake_wandb`` first on ``sys.path`` (or ``PYTHONPATH`` for a training subprocess).
Every call is kept in :data:`CALLS` and, when ``FAKE_WANDB_LOG`` names a file, appended to it as
one JSON line: ``{"call": "init", "kwargs": {...}}``, ``{"call": "log", "values": {...},
"step": N}``, ``{"call": "finish"}``.
"""

from __future__ import annotations

import json
import os

CALLS: list[dict] = []


def _record(entry: dict) -> None:
    CALLS.append(entry)
    path = os.environ.get("FAKE_WANDB_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


class Run:
    """What ``wandb.init`` returns: ``log`` and ``finish``."""

    def __init__(self, kwargs: dict):
        _record({"call": "init", "kwargs": kwargs})

    def log(self, values: dict, step: int | None = None) -> None:
        _record({"call": "log", "values": values, "step": step})

    def finish(self) -> None:
        _record({"call": "finish"})


def init(**kwargs) -> Run:
    return Run(kwargs)
