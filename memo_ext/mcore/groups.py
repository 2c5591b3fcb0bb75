"""megatron-core process groups of any parallel layout, and a model's CP group swapped.

megatron-core's models, DDP, schedules and ``finalize_model_grads`` take a
``ProcessGroupCollection`` in place of the global ``parallel_state`` groups, so models of
several layouts can live on the same processes (HotSPa). :func:`build_process_groups` makes the
collection of a :class:`~memo_ext.parallel.ParallelLayout`; :func:`swap_cp_group` runs a model
with another CP group (dynamic CP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import unwrap_model

from memo_ext.parallel import LayoutError, ParallelLayout


def _new_groups(enumeration: list[list[int]]):
    """This rank's group of ``enumeration`` (every rank creates every group, in order)."""
    mine, _ = dist.new_subgroups_by_enumeration(enumeration)
    return mine


def build_process_groups(layout: ParallelLayout) -> ProcessGroupCollection:
    """Every process group megatron-core's dense GPT needs, for ``layout``.

    Collective: every rank of the world calls it, for the same layouts in the same order.
    """
    if layout.world_size != dist.get_world_size():
        raise LayoutError(f"layout {layout.name} does not match the world size")
    pgs = ProcessGroupCollection()
    for name, dims in (
        ("tp", ("tp",)),
        ("cp", ("cp",)),
        ("dp", ("dp",)),
        ("pp", ("pp",)),
        ("dp_cp", ("cp", "dp")),
        ("tp_cp", ("tp", "cp")),
        ("mp", ("tp", "pp")),
        ("tp_dp_cp", ("tp", "cp", "dp")),
    ):
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


def home_process_groups() -> ProcessGroupCollection:
    """The collection of megatron's global groups (the home layout's)."""
    return ProcessGroupCollection.use_mpu_process_groups()


@contextlib.contextmanager
def swap_cp_group(model: torch.nn.Module, group) -> Iterator[None]:
    """Run ``model`` with another CP group: every module's ``cp_group`` and every process-group
    collection's ``cp`` point at ``group`` inside the block (megatron-core's modules read them
    at call time; ours too)."""
    saved, seen = [], set()
    for module in unwrap_model(model).modules():
        if hasattr(module, "cp_group"):
            saved.append((module, "cp_group", module.cp_group))
        pgs = getattr(module, "pg_collection", None)
        if pgs is not None and id(pgs) not in seen and hasattr(pgs, "cp"):
            seen.add(id(pgs))
            saved.append((pgs, "cp", pgs.cp))
    try:
        for obj, attr, _ in saved:
            setattr(obj, attr, group)
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
