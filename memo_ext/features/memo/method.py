"""MEMO as a method the estimator prices, the search tries and the comparisons run (see the
package's docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memo_ext.config import MemoConfig
from memo_ext.estimate.stage import MemoryMethod, Stage, StageContext
from memo_ext.features.compared import ComparedMethod
from memo_ext.features.memo.stage import memo_stage

if TYPE_CHECKING:
    from memo_ext.config import RunConfig
    from memo_ext.estimate.search import SearchSpace


class MemoMethod(MemoryMethod):
    """Token-wise activation swapping and recomputation (``--memo``)."""

    name = "memo"
    replays_caching_allocator = False  # MEMO plans its memory
    uses_host_memory = True
    suggestion = "add --memo"

    def price(self, ctx: StageContext) -> Stage:
        return memo_stage(ctx)

    def selected_by(self, run: RunConfig) -> bool:
        return run.memo.enabled

    def settings_of(self, run: RunConfig) -> MemoConfig:
        return run.memo

    def search_settings(self, space: SearchSpace) -> list[MemoConfig]:
        """Kept last layers in {2, 1, 0} and α in {the rule's, 0}, unless the space fixes them."""
        keeps = [space.keep_last_layers] if space.keep_last_layers is not None else [2, 1, 0]
        alphas = [space.alpha] if space.alpha is not None else [None, 0.0]
        return [
            MemoConfig(enabled=True, alpha=a, keep_last_layers=k, chunk_tokens=space.chunk_tokens)
            for k in keeps
            for a in alphas
        ]


MEMO = MemoMethod()

METHODS: tuple[MemoryMethod, ...] = (MEMO,)


class ComparedMemo(ComparedMethod):
    """MEMO in a comparison: α by the rule or given (``memo=0.5``), the comparison's kept last
    layers, traced at its α (0 for the rule)."""

    takes_alpha = True
    core_attention_only = True  # MEMO rebuilds its layers from our core attention
    estimator = MEMO

    def trainer_flags(self, alpha: float | None, *, keep_last_layers: int | None) -> list[str]:
        flags = ["--memo", "--memo-alpha", "auto" if alpha is None else f"{alpha:g}", *self.flags]
        if keep_last_layers is not None:
            flags += ["--memo-keep-last-layers", str(keep_last_layers)]
        return flags

    def estimator_settings(self, alpha: float | None, *, keep_last_layers: int | None):
        return MemoConfig(enabled=True, alpha=alpha, keep_last_layers=keep_last_layers)

    def traced(self, alpha: float | None) -> str:
        return f"memo-{alpha if alpha is not None else 0.0:g}"


COMPARED: tuple[ComparedMethod, ...] = (
    ComparedMemo(MEMO.name),
    ComparedMemo("memo+plan", ("--memo-allocator", "plan")),
)
"""MEMO, and MEMO with the planned allocator (the estimator does not model it apart)."""
