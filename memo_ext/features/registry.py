"""The lists the rest of the house reads of the features (see the package's docstring):
:data:`METHODS` the estimator prices, :data:`COMPARED` a comparison runs, :data:`PLUGIN_FEATURES`
the features plugins add (:mod:`memo_ext.features.feature`), and how to add to them."""

from __future__ import annotations

import dataclasses
from typing import Any

from memo_ext.config import RunConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.feature import BUILT_IN, PLUGIN_FEATURES, Feature
from memo_ext.features.recompute.method import NO_RECOMPUTE

METHODS: list[MemoryMethod] = [m for f in BUILT_IN for m in f.face("method", "METHODS", ())]
"""Every memory method the estimator prices (``memo-estimate --method`` lists them in this
order)."""


COMPARED: list[ComparedMethod] = [m for f in BUILT_IN for m in f.face("method", "COMPARED", ())]
"""Every method a comparison can run (``memo-compare --methods``), in the order its help lists
them."""


def register_feature(feature: Feature) -> Feature:
    """Registers ``feature`` and what it brings (its methods, compared methods and extension);
    its name must be new. Returns ``feature``."""
    if any(known.name == feature.name for known in PLUGIN_FEATURES) or feature.name in {
        f.name for f in dataclasses.fields(RunConfig)
    }:
        raise ValueError(f"a feature {feature.name!r} is registered already")
    for method in feature.methods:
        register(METHODS, method)
    for method in feature.compared:
        register(COMPARED, method)
    if feature.extension is not None:
        from memo_ext.features import extensions  # megatron-core: a trainer's extension is

        extensions.register(feature.extension)
    PLUGIN_FEATURES.append(feature)
    return feature


def unregister_feature(feature: Feature) -> None:
    """Takes ``feature`` and what it brought out of the lists (a test's own, after the test)."""
    for method in feature.methods:
        unregister(METHODS, method)
    for method in feature.compared:
        unregister(COMPARED, method)
    if feature.extension is not None:
        from memo_ext.features import extensions

        extensions.unregister(feature.extension)
    if feature in PLUGIN_FEATURES:
        PLUGIN_FEATURES.remove(feature)


def compared_method(name: str) -> ComparedMethod | None:
    """The comparison method ``name``, or ``None``."""
    return next((m for m in COMPARED if m.name == name), None)


def register(registry: list, item):
    """Add ``item`` (a :class:`MemoryMethod` to :data:`METHODS`, a :class:`ComparedMethod` to
    :data:`COMPARED`) to ``registry``; its name must be new there. Returns ``item``."""
    if any(known.name == item.name for known in registry):
        raise ValueError(f"{item.name!r} is registered already")
    registry.append(item)
    return item


def unregister(registry: list, item) -> None:
    """Take ``item`` out of ``registry`` (a test's own, after the test)."""
    if item in registry:
        registry.remove(item)


def method_names() -> list[str]:
    """The names of :data:`METHODS`, in order."""
    return [m.name for m in METHODS]


def memory_method(name: str) -> MemoryMethod:
    """The registered method ``name``; UsageError naming the registered ones otherwise."""
    for method in METHODS:
        if method.name == name:
            return method
    raise UsageError(f"--method must be one of {', '.join(method_names())}, got {name!r}")


def traced(name: str) -> dict[str, Any]:
    """The ``method`` and ``settings`` of a traced layer as reports name it
    (``memo_ext.estimate.measure.trace_layer``'s keywords): a method's name (``full``), or
    ``NAME-SETTINGS`` that method reads itself (``memo-0.5@4096``); ``none`` is the plain layer.

    Raises:
        ValueError: for a name no registered method reads.
    """
    for method in sorted(METHODS, key=lambda m: -len(m.name)):  # the longest name that fits
        if name != method.name and not name.startswith(method.name + "-"):
            continue
        if method.plain:
            return dict(method=None, settings=None)
        text = name[len(method.name) + 1 :] if name != method.name else None
        return dict(method=method, settings=method.traced_settings(text))
    raise ValueError(f"no registered method traces a layer named {name!r}")


def memory_method_of(run: RunConfig) -> MemoryMethod:
    """The method ``run``'s flags select; no recomputation when none does."""
    return next((m for m in METHODS if m.selected_by(run)), NO_RECOMPUTE)
