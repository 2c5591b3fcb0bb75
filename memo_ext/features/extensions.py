"""The trainer's features as ``memo_ext.extension.Extension`` classes: the one list the trainer
reads (``extensions_for``). A new feature's extension is one line here, or one ``register``
call (a test's own extension)."""

from __future__ import annotations

from memo_ext.config import RunConfig
from memo_ext.extension import Extension
from memo_ext.features.feature import BUILT_IN

FEATURES: list[type[Extension]] = [
    f.face("extension", f.extension) for f in BUILT_IN if f.extension is not None
]
"""Every feature's extension, in the order its hooks run (and its figures appear in a logged
step)."""


def register(feature: type[Extension]) -> type[Extension]:
    """Add ``feature`` to :data:`FEATURES` (once); usable as a class decorator."""
    if feature not in FEATURES:
        FEATURES.append(feature)
    return feature


def unregister(feature: type[Extension]) -> None:
    """Take ``feature`` out of :data:`FEATURES` (a test's own, after the test)."""
    if feature in FEATURES:
        FEATURES.remove(feature)


def enabled_features(run: RunConfig) -> list[type[Extension]]:
    """The feature classes ``run`` turns on, in :data:`FEATURES`' order."""
    return [feature for feature in FEATURES if feature.enabled(run)]


def own_layouts(run: RunConfig) -> type[Extension] | None:
    """The feature of ``run`` that builds models in layouts of its own, if any
    (``Extension.own_layouts``)."""
    return next((f for f in enabled_features(run) if f.own_layouts), None)


def extensions_for(run: RunConfig) -> list[Extension]:
    """One extension per feature ``run`` turns on, made from the run as parsed."""
    return [feature(run) for feature in enabled_features(run)]
