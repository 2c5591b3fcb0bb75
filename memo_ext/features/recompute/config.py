"""The settings of Megatron-LM's activation recomputation (``--recompute-*``): the recompute
feature's section of the run's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from memo_ext.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class RecomputeConfig:
    """Megatron-LM's activation recomputation (the baselines MEMO is compared with)."""

    FLAG_PREFIX: ClassVar[str] = "recompute"

    granularity: Literal["full", "selective"] | None = None
    """Megatron recomputation: full layers, or selective (core attention)."""
    method: Literal["uniform", "block"] | None = None
    """Which layers full recomputation covers."""
    num_layers: int | None = None
    """Layers per recompute unit (uniform) or recomputed layers per stage (block)."""

    @classmethod
    def of_layout(cls, method: str) -> RecomputeConfig:
        """HotSPa's per-layout choice (``none``, ``selective``, ``full``: every layer)."""
        if method == "none":
            return cls()
        if method == "full":
            return cls(granularity="full", method="uniform", num_layers=1)
        return cls(granularity=method)

    def megatron_fields(self) -> dict:
        """The ``TransformerConfig`` fields that make megatron-core recompute this way."""
        return dict(
            recompute_granularity=self.granularity,
            recompute_method=self.method,
            recompute_num_layers=self.num_layers,
        )

    def check(self, *, stage_layers: int) -> None:
        """``stage_layers``: transformer layers per pipeline stage."""
        if self.granularity is None:
            if self.method or self.num_layers:
                raise UsageError(
                    "--recompute-method / --recompute-num-layers need --recompute-granularity full"
                )
            return
        if self.granularity == "selective":
            if self.method or self.num_layers:
                raise UsageError(
                    "--recompute-granularity selective takes no --recompute-method / -num-layers"
                )
            return
        if self.method is None or self.num_layers is None:
            raise UsageError(
                "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
            )
        if not 1 <= self.num_layers <= stage_layers:
            raise UsageError(
                f"--recompute-num-layers must be in [1, {stage_layers}] (layers per pipeline stage)"
            )
