"""A feature from outside the package, as a plugin declares it (:class:`Feature`), and the list of
those registered (:data:`PLUGIN_FEATURES`, which the trainer's flags read). This module imports
nothing of the house, so that the flags can be built without the estimator or torch;
``memo_ext.features.registry.register_feature`` registers one with what it brings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memo_ext.estimate.stage import MemoryMethod
    from memo_ext.features.compared import ComparedMethod


@dataclass(frozen=True)
class Feature:
    """A feature from outside the package (``--plugin``), registered once with
    :func:`register_feature`: its section of the run (flags from its documented fields, as the
    built-in sections'; its ``check()`` and ``check_with(run)`` run with the run's checks), its
    trainer hooks, the memory methods the estimator prices and the methods comparisons run."""

    name: str
    """Its section's name (``RunConfig.section(name)``) and its flags' namespace."""
    config: type
    """A dataclass; ``FLAG_PREFIX`` names its flags' prefix, as the built-in sections do."""
    title: str
    """Its group in ``--help``."""
    extension: type | None = None
    """Its ``memo_ext.extension.Extension`` subclass, if it hooks into the trainer."""
    methods: tuple[MemoryMethod, ...] = ()
    compared: tuple[ComparedMethod, ...] = ()


PLUGIN_FEATURES: list[Feature] = []
"""The features plugins registered, in order (the built-in ones are ``RunConfig``'s fields)."""
