"""One parallel layout of a job's processes, and every rule a model shape must meet to run in it.

A :class:`ParallelLayout` is a TP × CP × DP × PP split of the world, ranked in megatron-core's
default ``tp-cp-ep-dp-pp`` order (TP fastest), with sequence parallelism over the TP ranks. The
trainer's parallel flags are generated from it; the estimator, HotSPa's per-bucket layouts and
the preflight all use it. :meth:`ParallelLayout.check_fits` holds the divisibility rules.

This module imports nothing else from the package (but ``memo_ext.errors``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memo_ext.errors import UsageError

if TYPE_CHECKING:
    from memo_ext.shapes import ModelShape

_DIM = re.compile(r"(dp|tp|pp|cp)(\d+)")


class LayoutError(UsageError):
    """A layout that cannot run (a strategy string, a world size, a model it does not divide)."""


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """DP × TP × PP × CP, with sequence parallelism over TP (see the module docstring)."""

    tp: int = field(default=1, metadata={"flag": "--tensor-model-parallel-size"})
    """TP: shard attention heads and MLP width over this many processes."""
    sp: bool = field(default=False, metadata={"flag": "--sequence-parallel"})
    """SP: shard norms and dropout over the TP ranks along the sequence (only with TP > 1)."""
    pp: int = field(default=1, metadata={"flag": "--pipeline-model-parallel-size"})
    """PP: split the layers into this many stages (1F1B schedule)."""
    cp: int = field(default=1, metadata={"flag": "--context-parallel-size"})
    """CP: split each sequence into 2·CP load-balanced chunks over this many processes."""
    dp: int = field(default=1, metadata={"cli": False})
    """DP: the remaining processes, each holding a replica of the model."""

    def __post_init__(self) -> None:
        if self.tp == 1 and self.sp:  # SP shards over TP: with one TP rank there is nothing to do
            object.__setattr__(self, "sp", False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def model_parallel_size(self) -> int:
        """Processes that hold one replica: TP × PP × CP."""
        return self.tp * self.pp * self.cp

    @property
    def name(self) -> str:
        """``dp2tp2``: every degree above 1, DP always."""
        sizes = (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
        return f"dp{self.dp}" + "".join(f"{dim}{size}" for dim, size in sizes if size > 1)

    def describe(self) -> str:
        """``TP 2 × CP 1 × PP 1 × DP 2 + SP``, for logs."""
        sp = " + SP" if self.sp else ""
        return f"TP {self.tp} × CP {self.cp} × PP {self.pp} × DP {self.dp}{sp}"

    def with_world(self, world_size: int) -> ParallelLayout:
        """This layout's TP / PP / CP with the rest of ``world_size`` processes as DP.

        Raises:
            LayoutError: when TP × PP × CP does not divide the world.
        """
        self.check_positive()
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"the world size {world_size} is not divisible by TP × PP × CP = "
                f"{self.tp}×{self.pp}×{self.cp}; change the parallel sizes or the number of "
                "processes"
            )
        return ParallelLayout(
            tp=self.tp,
            sp=self.sp,
            pp=self.pp,
            cp=self.cp,
            dp=world_size // self.model_parallel_size,
        )

    def check_positive(self) -> None:
        """Raises LayoutError unless every degree is at least 1."""
        for dim in ("tp", "pp", "cp", "dp"):
            value = getattr(self, dim)
            if value < 1:
                flag = ParallelLayout.__dataclass_fields__[dim].metadata.get("flag", dim)
                raise LayoutError(f"{flag} must be at least 1, got {value}")

    def check_fits(self, shape: ModelShape, seq_length: int, *, length: str | None = None) -> None:
        """Raise :class:`LayoutError` when megatron-core cannot run ``shape`` on sequences of
        ``seq_length`` tokens in this layout.

        ``shape`` needs ``num_attention_heads``, ``num_query_groups``, ``ffn_hidden_size``,
        ``hidden_size`` and ``num_layers`` (a ``ModelShape`` or a ``TransformerConfig``);
        ``length`` names the sequence in the message (default ``--seq-length N``; HotSPa: ``the
        N-token bucket``).
        """
        self.check_positive()
        length = length or f"--seq-length {seq_length}"
        groups = shape.num_query_groups or shape.num_attention_heads
        # a ModelShape completes an unset width as Megatron-LM does; a TransformerConfig has it
        ffn = getattr(shape, "ffn_size", None) or shape.ffn_hidden_size
        sp_split = self.tp if self.sp else 1
        rules = [
            (shape.num_attention_heads, self.tp, "attention heads", "TP"),
            (groups, self.tp, "query groups", "TP"),
            (ffn, self.tp, "FFN width", "TP"),
            (shape.num_layers, self.pp, "layers", "PP"),
            # CP cuts each sequence into 2·CP load-balanced chunks
            (seq_length, 2 * self.cp if self.cp > 1 else 1, "sequence length", "2 × CP"),
            # SP shards each CP rank's tokens over the TP ranks
            (seq_length // self.cp, sp_split, "tokens per CP rank", "TP (sequence parallel)"),
        ]
        for value, divisor, what, by in rules:
            if value % divisor:
                raise LayoutError(
                    f"layout {self.name} cannot run {length}: {what} ({value}) not divisible "
                    f"by {by} ({divisor})"
                )

    # -- ranks and groups ------------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s TP / CP / DP / PP coordinates (``tp-cp-dp-pp`` order, TP fastest)."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Rank lists that differ only along ``dims`` (megatron-core's enumeration)."""
        fixed = [d for d in ("tp", "cp", "dp", "pp") if d not in dims]
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            out.setdefault(tuple(c[d] for d in fixed), []).append(rank)
        return list(out.values())  # ranks ascend within each group, as megatron-core's do


def parse_layout(text: str, world_size: int) -> ParallelLayout:
    """``"dp2tp2"`` → a layout with DP 2, TP 2 and SP on (SP is on whenever TP > 1); a missing
    ``dp`` takes the rest of the world.

    Raises:
        LayoutError: for text that is not such a product, or does not use ``world_size``.
    """
    spec = text.strip().lower()
    found = _DIM.findall(spec)
    if not spec or "".join(d + n for d, n in found) != spec:
        raise LayoutError(
            f"strategy {text!r} is not a product of dp<N>, tp<N>, pp<N>, cp<N> (e.g. dp2tp2)"
        )
    sizes: dict[str, int] = {}
    for dim, n in found:
        if dim in sizes:
            raise LayoutError(f"strategy {text!r} gives {dim} twice")
        if int(n) < 1:
            raise LayoutError(f"strategy {text!r}: {dim} must be at least 1")
        sizes[dim] = int(n)
    model_parallel = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    if "dp" not in sizes:
        if world_size % model_parallel:
            raise LayoutError(
                f"strategy {text!r}: TP × PP × CP = {model_parallel} does not divide the "
                f"{world_size} processes"
            )
        sizes["dp"] = world_size // model_parallel
    layout = ParallelLayout(**sizes, sp=sizes.get("tp", 1) > 1)
    if layout.world_size != world_size:
        raise LayoutError(
            f"strategy {text!r} uses {layout.world_size} processes but the job has {world_size}"
        )
    return layout


def parse_strategies(text: str, world_size: int) -> tuple[ParallelLayout, ...]:
    """``"dp4;dp2tp2;tp2pp2"`` → one layout per bucket, shortest bucket first."""
    return tuple(parse_layout(part, world_size) for part in text.split(";"))
