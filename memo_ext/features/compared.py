"""A method as the comparisons run it (``memo-compare --methods``): its name, the trainer flags
that select it, how the estimator predicts it and how it is traced on fake tensors, and what a
machine must have to run it. Each feature lists its own (``COMPARED`` in its package); the
comparison harness (``memo_ext.compare``) reads them from
``memo_ext.features.registry.COMPARED`` and names none.
"""

from __future__ import annotations

from typing import Any

from memo_ext.estimate.stage import MemoryMethod


class ComparedMethod:
    """One method of a comparison; the defaults are a method with no settings of its own."""

    name: str
    """What ``--methods`` calls it."""
    takes_alpha: bool = False
    """Whether ``NAME=ALPHA`` gives it an α (MEMO's share of tokens kept in host memory)."""
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

    def trainer_flags(self, alpha: float | None, *, keep_last_layers: int | None) -> list[str]:
        """The trainer's flags that select it (``alpha``: ``None`` for the rule)."""
        return list(self.flags)

    def estimator_settings(self, alpha: float | None, *, keep_last_layers: int | None) -> Any:
        """The estimator's settings of it (``MemoryMethod`` settings)."""
        return None

    def traced(self, alpha: float | None) -> str | None:
        """The method one layer is traced as (``memo_ext.estimate.fits``); ``None``: not traced."""
        return self.estimator.name if self.estimator is not None else None

    def untraced_note(self) -> str:
        """Why it is not traced on fake tensors."""
        return f"{self.name} is not traced on fake tensors"

    def refusal(self) -> str | None:
        """Why this machine cannot run it (one sentence), or ``None``."""
        return None
