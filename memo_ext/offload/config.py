"""MEMO settings: the ``MemoConfig`` dataclass, its ``--memo-*`` flags and their checks.

``add_memo_args`` adds the flags to a parser, ``validate_memo_args`` checks them against the rest
of the command line (before any process group or model exists), and ``memo_config_from_args``
turns them into a :class:`MemoConfig`. Checks that need megatron-core's ``TransformerConfig``
are repeated in :func:`memo_ext.offload.policy.apply_memo`, so code that builds models without the
command line is refused the same way.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

AUTO = "auto"
GIB = 2**30
# share of the available host memory that MEMO may take when no budget is given: the rest is
# for the data loader, the optimizer's host state and the operating system
DEFAULT_HOST_SHARE = 0.8


@dataclass
class MemoConfig:
    """Token-wise activation swapping and recomputation (MEMO) for every transformer layer."""

    enabled: bool = False
    """Apply MEMO to the layers built from our spec (``--memo``)."""
    alpha: float | None = None
    """Fraction of each token-wise activation's tokens copied to host memory, in [0, 1]; the rest
    is recomputed before the layer's backward. ``None`` means ``auto``: the largest α whose copy
    hides under one layer's forward time and whose host bytes fit the budget, measured on the
    spot at the first layer call."""
    host_memory_gb: float | None = None
    """Host memory MEMO may use per process, in GiB (2**30 bytes). ``None``: 80% of the memory
    available when the model is built, shared equally by the processes of this node."""
    keep_last_layers: int = 2
    """Layers at the end of each pipeline stage that keep their activations on the device: their
    backward starts right after their forward, so a round trip to the host would not pay."""

    @property
    def auto_alpha(self) -> bool:
        return self.alpha is None


class MemoArgumentError(ValueError):
    """A ``--memo*`` flag or combination that cannot run; the message says how to fix it."""


def parse_alpha(text: str) -> float | str:
    """``--memo-alpha`` value: a float in [0, 1] or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1] or 'auto', got {text!r}"
        ) from None
    return value


def add_memo_args(parser: argparse.ArgumentParser) -> None:
    """Add MEMO's flags (``--memo``, ``--memo-alpha``, ``--memo-host-memory-gb``,
    ``--memo-keep-last-layers``) to ``parser``."""
    g = parser.add_argument_group("MEMO (token-wise activation swapping and recomputation)")
    g.add_argument("--memo", action="store_true", help="Turn MEMO on.")
    g.add_argument(
        "--memo-alpha",
        type=parse_alpha,
        default=None,
        help="Fraction of each token-wise activation's tokens kept in host memory, in [0, 1], "
        "or 'auto' (largest α whose copy hides under a layer's forward and fits the host budget). "
        "Default: auto.",
    )
    g.add_argument(
        "--memo-host-memory-gb",
        type=float,
        default=None,
        help="Host memory MEMO may use per process, GiB. Default: 80%% of the available memory "
        "divided by the processes on this node.",
    )
    g.add_argument(
        "--memo-keep-last-layers",
        type=int,
        default=None,
        help="Layers at the end of each pipeline stage that keep their activations on the device "
        "(default 2).",
    )


def validate_memo_args(args: argparse.Namespace) -> None:
    """Check the ``--memo*`` flags against the rest of the command line.

    Raises:
        MemoArgumentError: with one sentence saying what to change.
    """
    given = [
        flag
        for flag, value in (
            ("--memo-alpha", args.memo_alpha),
            ("--memo-host-memory-gb", args.memo_host_memory_gb),
            ("--memo-keep-last-layers", args.memo_keep_last_layers),
        )
        if value is not None
    ]
    if not args.memo:
        if given:
            raise MemoArgumentError(f"{', '.join(given)} only apply with --memo; add --memo")
        return
    alpha = args.memo_alpha
    if alpha is not None and alpha != AUTO and not 0.0 <= alpha <= 1.0:
        raise MemoArgumentError(f"--memo-alpha must be in [0, 1] or 'auto', got {alpha}")
    if args.memo_host_memory_gb is not None and args.memo_host_memory_gb <= 0:
        raise MemoArgumentError(
            f"--memo-host-memory-gb must be positive, got {args.memo_host_memory_gb}"
        )
    if args.memo_keep_last_layers is not None and args.memo_keep_last_layers < 0:
        raise MemoArgumentError(
            f"--memo-keep-last-layers must be >= 0, got {args.memo_keep_last_layers}"
        )
    check_memo_combination(
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
        recompute_granularity=getattr(args, "recompute_granularity", None),
        attention_backend=getattr(args, "attention_backend", "sdpa"),
    )


def check_memo_combination(
    *,
    hidden_dropout: float,
    recompute_granularity: str | None,
    attention_backend: str,
    cpu_offloading: bool = False,
    fine_grained_activation_offloading: bool = False,
) -> None:
    """Refuse what MEMO cannot honour, with one sentence each.

    Hidden dropout sits in the token-local part that is recomputed on a token slice, where it
    would draw different masks; attention dropout is fine (attention is never re-run).
    """
    if hidden_dropout > 0.0:
        raise MemoArgumentError(
            f"--memo recomputes token slices and cannot reproduce hidden-dropout masks; "
            f"use --hidden-dropout 0 (got {hidden_dropout})"
        )
    if recompute_granularity is not None:
        raise MemoArgumentError(
            "--memo replaces megatron's activation recomputation; drop --recompute-granularity"
        )
    if attention_backend == "te":
        raise MemoArgumentError(
            "--memo works on layers with our core attention; use --attention-backend sdpa or flash"
        )
    if cpu_offloading or fine_grained_activation_offloading:
        raise MemoArgumentError(
            "--memo cannot run with megatron's cpu_offloading or "
            "fine_grained_activation_offloading; turn those off"
        )


def memo_config_from_args(args: argparse.Namespace) -> MemoConfig:
    """The :class:`MemoConfig` of validated flags."""
    alpha = args.memo_alpha
    return MemoConfig(
        enabled=bool(args.memo),
        alpha=None if alpha in (None, AUTO) else float(alpha),
        host_memory_gb=args.memo_host_memory_gb,
        keep_last_layers=2 if args.memo_keep_last_layers is None else args.memo_keep_last_layers,
    )


def available_host_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, or total physical memory where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget_bytes(config: MemoConfig) -> int:
    """This process's host-memory budget in bytes (see :attr:`MemoConfig.host_memory_gb`)."""
    if config.host_memory_gb is not None:
        return int(config.host_memory_gb * GIB)
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(available_host_memory_bytes() * DEFAULT_HOST_SHARE / max(1, local_procs))
