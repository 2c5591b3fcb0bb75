"""A method as the comparisons run it (``memo-compare --methods``): its name, the settings it takes
(``NAME:KEY=VALUE,...``, :mod:`memo_ext.features.spelling`), the trainer flags that select it,
how the estimator predicts it and how it is traced on fake tensors, and what a machine must have
to run it. Each feature lists its own (``COMPARED`` in its package); the comparison harness
(``memo_ext.compare``) reads them from ``memo_ext.features.registry.COMPARED`` and names none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from memo_ext.errors import UsageError
from memo_ext.estimate.stage import MemoryMethod

Settings = tuple[tuple[str, str], ...]
"""A method's settings as written, each value in its one spelling (:meth:`parse_settings`)."""


class ComparedMethod:
    """One method of a comparison; the defaults are a method with no settings of its own."""

    name: str
    """What ``--methods`` calls it."""
    settings_help: ClassVar[dict[str, str]] = {}
    """The keys of its settings and what each sets (``--help`` lists them)."""
    settings_defaults: ClassVar[dict[str, str]] = {}
    """A setting at its default is left out of the method's label (``memo:alpha=auto`` is
    ``memo``)."""
    core_attention_only: bool = False
    """Whether it runs only with our core attention (not transformer-engine's)."""
    estimator: MemoryMethod | None = None
    """How the estimator predicts it; ``None``: not modelled."""

    def __init__(self, name: str, flags: tuple[str, ...] = (), **overrides: Any):
        self.name, self.flags = name, flags
        for key, value in overrides.items():
            if not hasattr(type(self), key):
                raise TypeError(f"{type(self).__name__} has no setting {key!r}")
            setattr(self, key, value)

    def parse_settings(self, pairs: Settings, *, text: str, flag: str = "--methods") -> Settings:
        """``pairs`` checked, each value in its one spelling (the label shows them so), in the
        order :attr:`settings_help` lists the keys; ``text`` is the whole spelling and ``flag``
        the option it came with, for errors.

        Raises:
            UsageError: for a key the method does not take, or a value it cannot read.
        """
        for key, _ in pairs:
            if key not in self.settings_help:
                takes = ", ".join(self.settings_help) or "no settings"
                raise UsageError(f"{flag}: {text!r}: {self.name} takes {takes}, not {key}")
        values = {
            key: self.read_setting(key, value, text=f"{flag}: {text!r}") for key, value in pairs
        }
        return tuple(
            (key, values[key])
            for key in self.settings_help
            if key in values and values[key] != self.settings_defaults.get(key)
        )

    def read_setting(self, key: str, value: str, *, text: str) -> str:
        """``value`` of ``key`` in its one spelling (UsageError, starting with ``text``, when it
        cannot be read)."""
        return value

    def fixed_settings(self, settings: Mapping[str, str]) -> dict[str, Any]:
        """The estimator's settings fields ``settings`` fix (``SearchSpace.fixed``)."""
        return {}

    def trainer_flags(self, settings: Mapping[str, str], *, keep_last_layers: int | None):
        """The trainer's flags that select it with ``settings``."""
        return list(self.flags)

    def estimator_settings(self, settings: Mapping[str, str], *, keep_last_layers: int | None):
        """The estimator's settings of it (``MemoryMethod`` settings)."""
        return None

    def traced(self, settings: Mapping[str, str], *, measured: Mapping, predicted: Mapping):
        """(memory method, its settings) of the layer traced on fake tensors
        (``memo_ext.estimate.measure.trace_layer``), given what the run measured (empty when it
        did not train) and what the estimator predicted; ``None``: not traced."""
        if self.estimator is None:
            return None
        return self.estimator, self.estimator_settings(settings, keep_last_layers=None)

    def untraced_note(self) -> str:
        """Why it is not traced on fake tensors."""
        return f"{self.name} is not traced on fake tensors"

    def check(self, settings: Mapping[str, str], *, stage_layers: int, keep_last_layers):
        """Raises UsageError, before any job runs, when the method cannot run on stages of
        ``stage_layers`` layers with the comparison's kept last layers."""
        return None

    def refusal(self) -> str | None:
        """Why this machine cannot run it (one sentence), or ``None``."""
        return None
