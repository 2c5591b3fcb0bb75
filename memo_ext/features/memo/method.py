"""MEMO as the methods the estimator prices (:class:`MemoMethod`, defined with the stage it
prices in ``memo_ext.features.memo.stage``) and the comparisons run (see the package's
docstring)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from memo_ext.config import MemoConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.memo.config import DEFAULT_OFFLOAD_RULE, parse_alpha
from memo_ext.features.memo.stage import MEMO
from memo_ext.memo.rules import offload_rule

METHODS: tuple[MemoryMethod, ...] = (MEMO,)


class ComparedMemo(ComparedMethod):
    """MEMO in a comparison: ``memo:alpha=0.5,rule=NAME``; α by the rule unless given, the
    comparison's kept last layers, priced and traced with the offload rule it runs."""

    settings_help = {
        "alpha": "share of each token block kept in host memory, 0 to 1 or auto (--memo-alpha)",
        "rule": "a registered offload rule (--memo-offload-rule)",
    }
    settings_defaults = {"alpha": "auto", "rule": DEFAULT_OFFLOAD_RULE}
    core_attention_only = True  # MEMO rebuilds its layers from our core attention
    estimator = MEMO

    def read_setting(self, key: str, value: str, *, text: str) -> str:
        try:
            if key == "rule":
                offload_rule(value)
                return value
            alpha = parse_alpha(value)
        except (UsageError, ValueError, argparse.ArgumentTypeError) as err:
            raise UsageError(f"{text}: {key}: {err}") from None
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise UsageError(f"{text}: alpha must be in [0, 1] or auto")
        return "auto" if alpha is None else f"{alpha:g}"

    def trainer_flags(self, settings: Mapping[str, str], *, keep_last_layers: int | None):
        flags = ["--memo", "--memo-alpha", settings.get("alpha", "auto"), *self.flags]
        if "rule" in settings:
            flags += ["--memo-offload-rule", settings["rule"]]
        if keep_last_layers is not None:
            flags += ["--memo-keep-last-layers", str(keep_last_layers)]
        return flags

    def estimator_settings(self, settings: Mapping[str, str], *, keep_last_layers: int | None):
        return MemoConfig(
            enabled=True,
            alpha=parse_alpha(settings.get("alpha", "auto")),
            keep_last_layers=keep_last_layers,
            offload_rule=settings.get("rule", DEFAULT_OFFLOAD_RULE),
        )

    def fixed_settings(self, settings: Mapping[str, str]) -> dict:
        fixed = {}
        if "alpha" in settings:
            fixed["alpha"] = parse_alpha(settings["alpha"])
        if "rule" in settings:
            fixed["offload_rule"] = settings["rule"]
        return fixed

    def check(self, settings: Mapping[str, str], *, stage_layers: int, keep_last_layers):
        memo = self.estimator_settings(settings, keep_last_layers=keep_last_layers)
        memo.check_offloads(stage_layers=stage_layers)

    def traced(self, settings: Mapping[str, str], *, measured: Mapping, predicted: Mapping):
        """At the given α, else the α the run chose (the estimator's when it did not train),
        with the rule it runs."""
        alpha = parse_alpha(settings.get("alpha", "auto"))
        if alpha is None:
            alpha = measured.get("memo_alpha") if measured else predicted.get("alpha")
        return MEMO, MEMO.traced_layer(alpha or 0.0, rule=settings.get("rule"))


COMPARED: tuple[ComparedMethod, ...] = (
    ComparedMemo(MEMO.name),
    ComparedMemo("memo+plan", ("--memo-allocator", "plan")),
)
"""MEMO, and MEMO with the planned allocator (the estimator does not model it apart)."""
