"""Parallel layouts of one set of processes, and their process groups.

A :class:`Layout` is a DP × TP × PP × CP split of the world, ranked in megatron-core's default
``tp-cp-ep-dp-pp`` order (TP fastest). HotSPa gives each length bucket its own layout of the
same processes: ``--hotspa-strategies "dp4;dp2tp2;tp2pp2"`` (shortest bucket first). The home
layout (the longest bucket's) is the one megatron's ``parallel_state`` is initialised with; every
other layout gets its own :class:`~megatron.core.process_groups_config.ProcessGroupCollection`,
which megatron-core's models, DDP, schedules and ``finalize_model_grads`` accept in place of the
global groups.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch.distributed as dist

_DIM = re.compile(r"(dp|tp|pp|cp)(\d+)")


class LayoutError(ValueError):
    """A strategy string or layout that cannot run; the message says which and why."""


@dataclass(frozen=True)
class Layout:
    """DP × TP × PP × CP; sequence parallelism is on whenever TP > 1."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        return self.tp > 1

    @property
    def name(self) -> str:
        """``dp2tp2``: every degree above 1, DP always."""
        parts = [f"dp{self.dp}"] + [
            f"{dim}{size}" for dim, size in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
            if size > 1
        ]  # fmt: skip
        return "".join(parts)

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
        order = ("tp", "cp", "dp", "pp")
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        fixed = [d for d in order if d not in dims]
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            out.setdefault(tuple(c[d] for d in fixed), []).append(rank)
        assert all(len(r) == _prod(sizes[d] for d in dims) for r in out.values())
        return list(out.values())  # ranks ascend within each group, as megatron-core's do


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def parse_layout(text: str, world_size: int) -> Layout:
    """``"dp2tp2"`` → ``Layout(dp=2, tp=2)``; a missing ``dp`` takes the rest of the world."""
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
    layout = Layout(**sizes)
    if layout.world_size != world_size:
        raise LayoutError(
            f"strategy {text!r} uses {layout.world_size} processes but the job has {world_size}"
        )
    return layout


def parse_strategies(text: str, world_size: int) -> list[Layout]:
    """``"dp4;dp2tp2;tp2pp2"`` → one layout per bucket, shortest bucket first."""
    return [parse_layout(part, world_size) for part in text.split(";")]


def check_layout(layout: Layout, *, config, bucket_length: int) -> None:
    """Raise :class:`LayoutError` when megatron-core cannot run ``layout`` on a bucket.

    ``config`` is the run's ``TransformerConfig`` (heads, groups, layers, FFN width).
    """
    groups = config.num_query_groups or config.num_attention_heads
    needs = [
        (config.num_attention_heads, layout.tp, "attention heads", "TP"),
        (groups, layout.tp, "query groups", "TP"),
        (config.ffn_hidden_size, layout.tp, "FFN width", "TP"),
        (config.num_layers, layout.pp, "layers", "PP"),
        (bucket_length, 2 * layout.cp if layout.cp > 1 else 1, "bucket length", "2 × CP"),
        (
            bucket_length // layout.cp,
            layout.tp if layout.sp else 1,
            "bucket length / CP",
            "TP (sequence parallel)",
        ),
    ]
    for value, divisor, what, by in needs:
        if value % divisor:
            raise LayoutError(
                f"layout {layout.name} cannot run the {bucket_length}-token bucket: {what} "
                f"({value}) not divisible by {by} ({divisor})"
            )


def layout_config(config, layout: Layout):
    """The run's ``TransformerConfig`` with ``layout``'s parallel sizes (SP on with TP > 1)."""
    return dataclasses.replace(
        config,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
        pipeline_dtype=config.pipeline_dtype or config.params_dtype,
        finalize_model_grads_func=None,
        no_sync_func=None,
        grad_scale_func=None,
    )


def _new_groups(enumeration: list[list[int]]):
    """This rank's group of ``enumeration`` (every rank creates every group, in order)."""
    mine, _ = dist.new_subgroups_by_enumeration(enumeration)
    return mine


def build_process_groups(layout: Layout):
    """Every process group megatron-core's dense GPT needs, for ``layout``.

    Collective: every rank of the world calls it, for the same layouts in the same order.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if layout.world_size != dist.get_world_size():
        raise LayoutError(f"layout {layout.name} does not match the world size")
    pgs = ProcessGroupCollection()
    for name, dims in (
        ("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)),
        ("dp_cp", ("cp", "dp")), ("tp_cp", ("tp", "cp")), ("mp", ("tp", "pp")),
        ("tp_dp_cp", ("tp", "cp", "dp")),
    ):  # fmt: skip
        setattr(pgs, name, _new_groups(layout.groups(dims)))
    pipelines = layout.groups(("pp",))
    pgs.embd = _new_groups([sorted({p[0], p[-1]}) for p in pipelines])
    pgs.pos_embd = _new_groups([[p[0]] for p in pipelines])
    # dense model: expert parallelism of 1
    pgs.ep = _new_groups([[r] for r in range(layout.world_size)])
    pgs.expt_tp = pgs.tp
    pgs.expt_dp = pgs.dp_cp
    pgs.tp_ep = pgs.tp
    pgs.tp_ep_pp = pgs.mp
    pgs.intra_dp_cp = pgs.dp_cp
    return pgs


def home_process_groups():
    """The collection of megatron's global groups (the home layout's)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()
