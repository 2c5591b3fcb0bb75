"""Every key of the metrics file, documented where it is collected: :class:`StepMetrics`' and
the trainer's own (``memo_ext.training.metrics``), and each feature's
(``Extension.metric_keys``). docs/metrics.md's table is made from :func:`metric_keys`
(``python -m tools.flag_reference --update``), and the tests hold every record they train
against it (``tests/launch.py``)."""

from __future__ import annotations

from memo_ext.extension import MetricKey
from memo_ext.features.extensions import FEATURES
from memo_ext.training.metrics import STEP_KEYS, TRAINER_KEYS


def metric_keys() -> tuple[MetricKey, ...]:
    """Every documented key, in the table's order: the step's, the trainer's, each feature's."""
    keys = [*STEP_KEYS, *TRAINER_KEYS]
    for feature in FEATURES:
        keys += feature.metric_keys
    return tuple(keys)


def undocumented(record: dict, extra: tuple[MetricKey, ...] = ()) -> list[str]:
    """The keys of ``record`` no :class:`MetricKey` documents (of :func:`metric_keys`, or
    ``extra``: a feature registered outside the package), or whose value has another type, one
    phrase each (empty: the record is as documented)."""
    by_name = {name: key for key in (*metric_keys(), *extra) for name in key.names}
    problems = []
    for name, value in record.items():
        key = by_name.get(name)
        if key is None:
            problems.append(f"{name}: not documented")
        elif not key.accepts(value):
            problems.append(f"{name}: {value!r} is not {key.type}")
    return problems


def metrics_table(keys: tuple[MetricKey, ...] | None = None) -> str:
    """docs/metrics.md's table of the metrics file's keys."""
    lines = ["| key | type | meaning |", "|---|---|---|"]
    for key in keys or metric_keys():
        names = ", ".join(f"`{name}`" for name in key.names)
        lines.append(f"| {names} | {key.type.replace(' | ', ' or ')} | {key.meaning} |")
    return "\n".join(lines)
