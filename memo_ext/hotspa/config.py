"""HotSPa settings: the ``HotSPaConfig`` dataclass, its ``--hotspa-*`` flags and their checks.

Explicit strategies are checked against the model and the buckets when the flags are parsed;
``auto`` strategies are chosen (and refused when a bucket fits no layout) by
:func:`memo_ext.hotspa.auto.choose_strategies` before any process group exists.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from memo_ext.hotspa.buckets import parse_buckets
from memo_ext.hotspa.layouts import Layout, LayoutError, check_layout, parse_strategies

AUTO = "auto"


class HotSPaArgumentError(ValueError):
    """A ``--hotspa-*`` flag that cannot run; the message says how to fix it."""


@dataclass
class HotSPaConfig:
    """Length buckets, each trained in its own parallel layout of the same processes."""

    enabled: bool = False
    """``--hotspa``."""
    buckets: list[int] = field(default_factory=list)
    """Ascending upper bounds in tokens; the last is ``--seq-length``."""
    strategies: list[Layout] | None = None
    """One layout per bucket (shortest first); ``None`` until ``auto`` has chosen."""
    backfill: bool = True
    """Fill the room long documents leave in their rows with shorter documents."""
    mode: str = "switch"
    """``switch`` (any DP / TP / PP / CP per bucket) or ``dynamic-cp`` (only CP / DP vary)."""
    device: str | None = None
    """Device preset ``auto`` plans for (``--preflight-device``; the CUDA device by default)."""

    @property
    def home(self) -> Layout:
        """The longest bucket's layout: megatron's global groups, optimizer and checkpoints."""
        assert self.strategies, "HotSPa strategies are not chosen yet"
        return self.strategies[-1]


def add_hotspa_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HotSPa (length buckets with per-bucket parallel layouts)")
    g.add_argument(
        "--hotspa",
        action="store_true",
        help="Group each global batch into length buckets and train each bucket in its own "
        "parallel layout of the same processes, switching weights in and gradients back to the "
        "home layout (the longest bucket's) within the step. Needs --variable-seq-lengths; the "
        "layouts replace --tensor/--pipeline-model-parallel-size.",
    )
    g.add_argument(
        "--hotspa-buckets",
        default=None,
        metavar="N1,N2,...",
        help="Bucket upper bounds in tokens, ascending; the last must equal --seq-length "
        "(default: --seq-length alone, one bucket).",
    )
    g.add_argument(
        "--hotspa-strategies",
        default=AUTO,
        metavar="LAYOUTS|auto",
        help="One layout per bucket, shortest first, separated by ';', each a product of "
        "dp<N>, tp<N>, pp<N>, cp<N> (e.g. 'dp4;dp2tp2;tp2cp2'; a missing dp takes the remaining "
        "processes; SP is on with TP > 1). 'auto' picks, per bucket, the fastest layout that "
        "fits device memory by the estimator's model, for --preflight-device (default: the CUDA "
        "device, or h100-80g on a machine without one).",
    )

    g.add_argument(
        "--no-hotspa-backfill",
        dest="hotspa_backfill",
        action="store_false",
        help="Keep every document in the smallest bucket that holds it, instead of first filling "
        "the room long documents leave in longer buckets' rows with shorter documents.",
    )
    g.add_argument(
        "--hotspa-mode",
        choices=("switch", "dynamic-cp"),
        default="switch",
        help="switch: each bucket may use any DP × TP × PP × CP layout (weights re-sharded when "
        "TP or PP differ from home); dynamic-cp: every bucket keeps home's TP and PP and only "
        "the CP degree changes, so nothing is re-sharded. Layouts that differ from home only in "
        "CP run on the home model in both modes.",
    )


def validate_hotspa_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse what cannot run, before any work (explicit strategies are checked in full)."""
    if not args.hotspa:
        if (args.hotspa_buckets is not None or args.hotspa_strategies != AUTO
                or args.hotspa_mode != "switch"):  # fmt: skip
            raise HotSPaArgumentError("--hotspa-buckets / --hotspa-strategies / --hotspa-mode "
                                      "need --hotspa")  # fmt: skip
        return
    if not args.variable_seq_lengths:
        raise HotSPaArgumentError("--hotspa trains whole documents: add --variable-seq-lengths")
    fixed = {
        "--tensor-model-parallel-size": args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
    }
    for flag, value in fixed.items():
        if value != 1:
            raise HotSPaArgumentError(
                f"with --hotspa the layouts come from --hotspa-strategies; drop {flag}"
            )
    try:
        buckets = _buckets(args)
    except ValueError as err:
        raise HotSPaArgumentError(str(err)) from None
    if args.hotspa_strategies.strip().lower() == AUTO:
        return
    layouts = _strategies(args.hotspa_strategies, world_size)
    if len(layouts) != len(buckets):
        raise HotSPaArgumentError(
            f"--hotspa-strategies gives {len(layouts)} layouts for {len(buckets)} buckets "
            f"({','.join(map(str, buckets))}); give one per bucket, shortest first"
        )
    for layout, bucket in zip(layouts, buckets):
        _check(layout, args, bucket)
    home = layouts[-1]
    if args.hotspa_mode == "dynamic-cp":
        for layout in layouts:
            if (layout.tp, layout.pp) != (home.tp, home.pp):
                raise HotSPaArgumentError(
                    f"--hotspa-mode dynamic-cp changes only CP: layout {layout.name} has other "
                    f"TP / PP than home ({home.name})"
                )


def _buckets(args: argparse.Namespace) -> list[int]:
    text = args.hotspa_buckets if args.hotspa_buckets is not None else str(args.seq_length)
    return parse_buckets(text, seq_length=args.seq_length)


def _strategies(text: str, world_size: int) -> list[Layout]:
    try:
        return parse_strategies(text, world_size)
    except LayoutError as err:
        raise HotSPaArgumentError(f"--hotspa-strategies: {err}") from None


class _Shape:
    """The parts of the model shape ``check_layout`` reads, from parsed flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.num_attention_heads = args.num_attention_heads
        self.num_query_groups = args.num_query_groups
        self.ffn_hidden_size = args.ffn_hidden_size
        self.num_layers = args.num_layers


def _check(layout: Layout, args: argparse.Namespace, bucket: int) -> None:
    try:
        check_layout(layout, config=_Shape(args), bucket_length=bucket)
    except LayoutError as err:
        raise HotSPaArgumentError(f"--hotspa-strategies: {err}") from None


def hotspa_config_from_args(args: argparse.Namespace, world_size: int) -> HotSPaConfig:
    if not args.hotspa:
        return HotSPaConfig()
    strategies = None
    if args.hotspa_strategies.strip().lower() != AUTO:
        strategies = _strategies(args.hotspa_strategies, world_size)
    return HotSPaConfig(
        enabled=True, buckets=_buckets(args), strategies=strategies, mode=args.hotspa_mode,
        backfill=args.hotspa_backfill,
        device=args.preflight_device,
    )  # fmt: skip
