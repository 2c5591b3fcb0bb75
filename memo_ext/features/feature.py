"""The features, listed once: the package's own (:data:`BUILT_IN`) and those plugins add
(:class:`Feature`, :data:`PLUGIN_FEATURES`; ``memo_ext.features.registry.register_feature``
registers one with what it brings).

The trainer's flags, the registries of priced and compared methods and the trainer's extensions
are read from these lists. This module imports the features' sections of the configuration
only, so that the flags can be built without the estimator, megatron-core or torch: a built-in
feature's other faces are imported when first asked (:meth:`BuiltIn.face`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memo_ext.features.hotspa.config import HotSPaConfig
from memo_ext.features.megatron_offload.config import MegatronOffloadConfig
from memo_ext.features.memo.config import MemoConfig
from memo_ext.features.recompute.config import RecomputeConfig

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


@dataclass(frozen=True)
class BuiltIn:
    """A feature of the package: its section of the run (a field of ``RunConfig`` of the same
    name, its flags a group of ``--help``) and the package holding its other faces."""

    name: str
    config: type
    title: str
    package: str
    """``memo_ext.features.<name>``: ``method.METHODS`` / ``method.COMPARED`` (the methods the
    estimator prices and comparisons run) and ``extension.<extension>`` (its trainer hooks)."""
    extension: str | None = None

    def face(self, module: str, attribute: str, default: Any = None) -> Any:
        """``attribute`` of the feature's ``module`` (``default`` where the feature has no such
        module or attribute)."""
        try:
            loaded = importlib.import_module(f"{self.package}.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"{self.package}.{module}":
                raise
            return default
        return getattr(loaded, attribute, default)


BUILT_IN: tuple[BuiltIn, ...] = (
    BuiltIn(
        "recompute",
        RecomputeConfig,
        "activation recomputation (Megatron baselines)",
        "memo_ext.features.recompute",
    ),
    BuiltIn(
        "memo",
        MemoConfig,
        "MEMO (token-wise activation swapping and recomputation)",
        "memo_ext.features.memo",
        extension="Memo",
    ),
    BuiltIn(
        "hotspa",
        HotSPaConfig,
        "HotSPa (length buckets with per-bucket parallel layouts)",
        "memo_ext.features.hotspa",
        extension="HotSPa",
    ),
    BuiltIn(
        "offload",
        MegatronOffloadConfig,
        "activation offloading (megatron-core baselines)",
        "memo_ext.features.megatron_offload",
        extension="MegatronOffload",
    ),
)
"""The package's features, in the order their flags, methods and trainer hooks are listed."""

PLUGIN_FEATURES: list[Feature] = []
"""The features plugins registered, in order (the built-in ones are ``RunConfig``'s fields)."""
