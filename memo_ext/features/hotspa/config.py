"""HotSPa's section: length buckets, one parallel layout per bucket, and what HotSPa needs of
the rest of the run."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from memo_ext.config.common import AUTO, parse_token_counts
from memo_ext.errors import UsageError
from memo_ext.parallel import LayoutError, ParallelLayout, parse_strategies
from memo_ext.shapes import ModelShape

if TYPE_CHECKING:
    from memo_ext.config.data import DataConfig
    from memo_ext.config.network import ModelConfig
    from memo_ext.features.recompute.config import RecomputeConfig


def check_buckets(bounds: tuple[int, ...], *, seq_length: int) -> None:
    """Bucket bounds must ascend strictly and end at ``--seq-length``.

    Raises:
        UsageError: naming the problem.
    """
    if any(b < 2 for b in bounds) or list(bounds) != sorted(set(bounds)):
        text = ",".join(map(str, bounds))
        raise UsageError(f"--hotspa-buckets must be strictly ascending, each 2 or more: {text!r}")
    if bounds[-1] != seq_length:
        raise UsageError(
            f"the last of --hotspa-buckets ({bounds[-1]}) must equal --seq-length ({seq_length}): "
            "documents are cut at --seq-length and the longest bucket must hold them"
        )


def parse_buckets(text: str, *, seq_length: int) -> tuple[int, ...]:
    """``--hotspa-buckets`` text → checked ascending bounds ending at ``seq_length``.

    Raises:
        ValueError: naming the problem.
    """
    try:
        bounds = parse_token_counts(text)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"--hotspa-buckets {err}") from None
    check_buckets(bounds, seq_length=seq_length)
    return bounds


@dataclass(frozen=True, kw_only=True)
class HotSPaConfig:
    """Length buckets, each trained in its own parallel layout of the same processes."""

    FLAG_PREFIX: ClassVar[str] = "hotspa"

    enabled: bool = field(default=False, metadata={"flag": "--hotspa"})
    """Group each global batch into length buckets and train each bucket in its own parallel
    layout of the same processes, switching weights in and gradients back to the home layout (the
    longest bucket's) within the step. Needs --variable-seq-lengths; the layouts replace
    --tensor/--pipeline-model-parallel-size."""
    buckets: tuple[int, ...] = field(
        default=(), metadata={"parse": parse_token_counts, "metavar": "N1,N2,..."}
    )
    """Bucket upper bounds in tokens, ascending; the last must equal --seq-length (default:
    --seq-length alone, one bucket)."""
    strategy_spec: str = field(
        default=AUTO, metadata={"flag": "--hotspa-strategies", "metavar": "LAYOUTS|auto"}
    )
    """One layout per bucket, shortest first, separated by ';', each a product of dp<N>, tp<N>,
    pp<N>, cp<N> (e.g. 'dp4;dp2tp2;tp2cp2'; a missing dp takes the remaining processes; SP is on
    with TP > 1), optionally with the recomputation of that layout's model after a colon
    ('dp4:none;tp8:full'; default: --recompute-granularity; a layout that runs on the home model
    keeps home's). 'auto' picks, per bucket, the fastest layout and recomputation that fit
    device memory by the estimator's model, for --preflight-device (default: the CUDA device,
    or h100-80g on a machine without one); it trains one layout for every bucket when switching
    is not predicted to pay."""
    backfill: bool = True
    """Fill the room long documents leave in longer buckets' rows with shorter documents before
    opening shorter rows; --no-hotspa-backfill keeps every document in the smallest bucket that
    holds it."""
    mode: Literal["switch", "dynamic-cp"] = "switch"
    """switch: each bucket may use any DP × TP × PP × CP layout (weights re-sharded when TP or PP
    differ from home); dynamic-cp: every bucket keeps home's TP and PP and only the CP degree
    changes, so nothing is re-sharded. Layouts that differ from home only in CP run on the home
    model in both modes."""
    strategies: tuple[ParallelLayout, ...] | None = field(default=None, metadata={"cli": False})
    """One layout per bucket (shortest first); ``None`` while ``auto`` has not chosen."""
    recompute: tuple[str | None, ...] | None = field(default=None, metadata={"cli": False})
    """Per bucket, the recomputation of its layout's model where it is not the run's
    --recompute-granularity (``none``, ``selective`` or ``full``; ``None``: the run's); from a
    ``:method`` suffix of --hotspa-strategies, or chosen by ``auto``."""
    predicted_step_s: float | None = field(default=None, metadata={"cli": False})
    """The estimator's step time for these layouts (once resolved against a device)."""
    predicted_single_layout_s: float | None = field(default=None, metadata={"cli": False})
    """The estimator's step time with every document packed into --seq-length rows in the best
    single layout: what HotSPa is compared with (``auto`` takes it when switching does not
    pay, and then runs one bucket)."""

    @property
    def auto(self) -> bool:
        return self.strategy_spec.strip().lower() == AUTO

    @property
    def home(self) -> ParallelLayout:
        """The longest bucket's layout: megatron's global groups, optimizer and checkpoints."""
        if not self.strategies:
            raise RuntimeError("HotSPa strategies are not chosen yet; resolve the run first")
        return self.strategies[-1]

    def check(self) -> None:
        """HotSPa flags without --hotspa (the rest needs the run: :meth:`RunConfig.check`)."""
        if self.enabled:
            return
        defaults = HotSPaConfig()
        if (self.buckets, self.strategy_spec, self.mode) != (
            defaults.buckets,
            defaults.strategy_spec,
            defaults.mode,
        ):
            raise UsageError("--hotspa-buckets / --hotspa-strategies / --hotspa-mode need --hotspa")

    def parsed(self, *, seq_length: int, world_size: int, shape: ModelShape) -> HotSPaConfig:
        """Buckets defaulted and checked, explicit strategies parsed and checked against the
        model and each bucket.

        Raises:
            UsageError: one sentence.
        """
        buckets = self.buckets or (seq_length,)
        check_buckets(buckets, seq_length=seq_length)
        if self.auto:
            return dataclasses.replace(self, buckets=buckets)
        spec, recompute = split_recompute(self.strategy_spec)
        try:
            layouts = parse_strategies(spec, world_size)
            for layout, bucket in zip(layouts, buckets):
                layout.check_fits(shape, bucket, length=f"the {bucket}-token bucket")
        except LayoutError as err:
            raise LayoutError(f"--hotspa-strategies: {err}") from None
        if len(layouts) != len(buckets):
            raise UsageError(
                f"--hotspa-strategies gives {len(layouts)} layouts for {len(buckets)} buckets "
                f"({','.join(map(str, buckets))}); give one per bucket, shortest first"
            )
        home = layouts[-1]
        if self.mode == "dynamic-cp":
            for layout in layouts:
                if (layout.tp, layout.pp) != (home.tp, home.pp):
                    raise UsageError(
                        f"--hotspa-mode dynamic-cp changes only CP: layout {layout.name} has "
                        f"other TP / PP than home ({home.name})"
                    )
        return dataclasses.replace(
            self,
            buckets=buckets,
            strategies=layouts,
            recompute=recompute if any(recompute) else None,
        )

    def check_with(
        self,
        *,
        data: DataConfig,
        model: ModelConfig,
        recompute: RecomputeConfig,
        shape: ModelShape,
        layout: ParallelLayout,
        world_size: int,
    ) -> None:
        """HotSPa against the rest of the run (the sections it reads): whole documents, no
        dropout (the layouts share the home layout's random streams), layouts only from
        --hotspa-strategies, and recomputation suffixes only where a bucket has a model of its
        own."""
        if not self.enabled:
            return
        if not data.variable_seq_lengths:
            raise UsageError("--hotspa trains whole documents: add --variable-seq-lengths")
        dropout = max(model.attention_dropout, model.hidden_dropout)
        if dropout > 0:
            raise UsageError(
                "--hotspa layouts share the home layout's dropout random streams, so the TP ranks "
                "of another layout would draw the same masks; use --attention-dropout 0 "
                f"--hidden-dropout 0 (got {dropout})"
            )
        fixed = {
            "--tensor-model-parallel-size": layout.tp,
            "--pipeline-model-parallel-size": layout.pp,
            "--context-parallel-size": layout.cp,
        }
        for flag, value in fixed.items():
            if value != 1:
                raise UsageError(
                    f"with --hotspa the layouts come from --hotspa-strategies; drop {flag}"
                )
        hot = self.parsed(seq_length=data.seq_length, world_size=world_size, shape=shape)
        if hot.recompute:
            hot._check_recompute(recompute.granularity or "none")

    def _check_recompute(self, own: str) -> None:
        """``:method`` suffixes: not on buckets that run on the home model (whose recomputation
        is the run's, ``own``)."""
        home = self.strategies[-1]
        for layout, method in zip(self.strategies, self.recompute):
            on_home = (layout.tp, layout.pp) == (home.tp, home.pp)
            if method is not None and method != own and on_home:
                raise UsageError(
                    f"--hotspa-strategies: {layout.name}:{method} runs on the home model (same TP "
                    f"and PP as home, {home.name}), whose recomputation is "
                    f"--recompute-granularity's ({own}); drop ':{method}' or change the flag"
                )


RECOMPUTE_CHOICES = ("none", "selective", "full")
"""What a ``:method`` suffix of --hotspa-strategies may say."""


def split_recompute(spec: str) -> tuple[str, tuple[str | None, ...]]:
    """``"dp4:none;tp8"`` → (``"dp4;tp8"``, (``"none"``, ``None``)).

    Raises:
        UsageError: for a suffix that is not a recomputation.
    """
    layouts, methods = [], []
    for part in spec.split(";"):
        layout, colon, method = part.partition(":")
        method = method.strip().lower()
        if colon and method not in RECOMPUTE_CHOICES:
            raise UsageError(
                f"--hotspa-strategies: {part.strip()!r} ends in {method!r}; after a colon comes "
                f"the layout's recomputation, one of {', '.join(RECOMPUTE_CHOICES)}"
            )
        layouts.append(layout)
        methods.append(method if colon else None)
    return ";".join(layouts), tuple(methods)
