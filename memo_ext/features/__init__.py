"""The trainer's features: one package each (``recompute``, ``megatron_offload``, ``memo``,
``hotspa``), and the registry the trainer, the estimator's callers, the search and the
comparisons read.

A feature's package holds its faces:

- its trainer hooks, an ``memo_ext.extension.Extension`` (``FEATURES`` in
  :mod:`memo_ext.features.extensions`, imported by the trainer only: extensions build layers and
  import megatron-core);
- for a feature that holds activations its own way, its
  :class:`~memo_ext.estimate.stage.MemoryMethod` (:data:`METHODS`: how the estimator prices a
  stage under it, which runs select it, what a search tries);
- the methods a comparison runs (:data:`COMPARED`,
  :class:`~memo_ext.features.compared.ComparedMethod`).

These lists are all the rest of the house knows of the features: nothing below this package
names one. A new feature is a package plus one line in each list it joins, or a ``register``
call from anywhere (a test's own: ``register(METHODS, method)``; an extension:
``memo_ext.features.extensions.register``).
"""

from __future__ import annotations

from memo_ext.config import RunConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.features import megatron_offload, memo, recompute
from memo_ext.features.compared import ComparedMethod

METHODS: list[MemoryMethod] = [*recompute.METHODS, *memo.METHODS]
"""Every memory method the estimator prices (``memo-estimate --method`` lists them in this
order)."""


COMPARED: list[ComparedMethod] = [*recompute.COMPARED, *megatron_offload.COMPARED, *memo.COMPARED]
"""Every method a comparison can run (``memo-compare --methods``), in the order its help lists
them."""


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


def memory_method_of(run: RunConfig) -> MemoryMethod:
    """The method ``run``'s flags select; no recomputation when none does."""
    return next((m for m in METHODS if m.selected_by(run)), recompute.NO_RECOMPUTE)
