"""Hot switching: move weights (or gradients) between two parallel layouts of the same model.

Every process describes the shards it holds in each layout (:func:`describe_shards`: for each
parameter, by its global name, the segments of the full tensor along its partition dimension);
one ``all_gather_object`` makes the description global. :func:`build_plan` then cuts each
parameter into the finest common partition of the two layouts' segments and gives each piece a
sender: the receiving process itself when it already holds the piece (a local copy), else a
holder on the same node, else holders in turn so that replicas share the load. Everything one
process sends another goes in one flat message; all messages of a switch are posted together
(``batch_isend_irecv``). Every process builds the same plan from the same description, so the
two ends of a message agree on its layout without talking. Plans are built once per layout
pair and direction, and cached by the caller.

Weights are copied; gradients are added (``accumulate=True``) into the receiving layout's
gradients, which is how a bucket's contribution joins the home layout's. A weight switch writes
every element of its target (:meth:`SwitchPlan.check_fills`), so the target's storage may be
re-allocated, uninitialised, right before it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from memo_ext.device import clock
from memo_ext.mcore.init import global_parameter_names, tp_segments


@dataclass(frozen=True)
class Shard:
    """What one process holds of one parameter."""

    rank: int
    dim: int
    """Partition dimension (0 for replicated parameters)."""
    segments: tuple[tuple[int, int, int], ...]
    """``(start in the full tensor, length, start in the local tensor)`` along ``dim``."""
    inner: int
    """Elements per index of ``dim`` (the product of the other dimensions)."""


@dataclass(frozen=True)
class Piece:
    """One contiguous range of one parameter, sent from ``src`` to ``dst``."""

    name: str
    src: int
    dst: int
    dim: int
    src_start: int
    dst_start: int
    length: int
    inner: int

    @property
    def numel(self) -> int:
        return self.length * self.inner


def local_tensors(model: torch.nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Global name → this process's parameter (or its ``main_grad``)."""
    bare = unwrap_model(model)
    names = global_parameter_names(bare)
    out = {}
    for name, param in bare.named_parameters():
        out[names[name]] = param.main_grad if grads else param.data
    return out


def describe_shards(model: torch.nn.Module, *, rank: int, tp: int, tp_rank: int, gated: bool):
    """``{global name: Shard}`` for this process's part of ``model``."""
    bare = unwrap_model(model)
    names = global_parameter_names(bare)
    out = {}
    for name, param in bare.named_parameters():
        global_name = names[name]
        dim, segments = tp_segments(param, name=global_name, tp=tp, tp_rank=tp_rank, gated=gated)
        inner = param.numel() // param.shape[dim]
        out[global_name] = Shard(rank, dim, tuple(segments), inner)
    return out


def merge_shards(per_rank: list[dict[str, Shard]]) -> dict[str, list[Shard]]:
    """Every process's description (one dict per rank) → the holders of each parameter."""
    merged: dict[str, list[Shard]] = defaultdict(list)
    for shards in per_rank:
        for name, shard in shards.items():
            merged[name].append(shard)
    return dict(merged)


@dataclass
class SwitchPlan:
    """One direction between two layouts, as seen by process ``rank``."""

    rank: int
    local: list[Piece] = field(default_factory=list)
    sends: dict[int, list[Piece]] = field(default_factory=dict)
    recvs: dict[int, list[Piece]] = field(default_factory=dict)
    world_elements_moved: int = 0
    """Elements crossing between processes, over the whole job."""
    world_elements_reused: int = 0
    """Elements a process already held (copied locally), over the whole job."""

    def run(
        self,
        src: Mapping[str, torch.Tensor],
        dst: Mapping[str, torch.Tensor],
        *,
        accumulate: bool = False,
    ) -> SwitchStats:
        """Execute the plan: fill (or add into) ``dst`` from ``src``; returns what moved."""
        dtype, device = _dtype_device(src, dst)
        timer = SwitchTimer.start(device)
        ops, inboxes = [], {}
        for peer, pieces in sorted(self.sends.items()):
            message = torch.cat(
                [_view(src[p.name], p.dim, p.src_start, p.length).reshape(-1) for p in pieces]
            )
            ops.append(dist.P2POp(dist.isend, message.to(dtype), peer))
        for peer, pieces in sorted(self.recvs.items()):
            inboxes[peer] = torch.empty(sum(p.numel for p in pieces), dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, inboxes[peer], peer))
        requests = dist.batch_isend_irecv(ops) if ops else []
        for piece in self.local:  # overlaps with the messages in flight
            _write(
                dst,
                piece,
                _view(src[piece.name], piece.dim, piece.src_start, piece.length),
                accumulate,
            )
        for request in requests:
            request.wait()
        for peer, pieces in sorted(self.recvs.items()):
            offset = 0
            for piece in pieces:
                target = _view(dst[piece.name], piece.dim, piece.dst_start, piece.length)
                flat = inboxes[peer][offset : offset + piece.numel]
                _write(dst, piece, flat.view(target.shape), accumulate)
                offset += piece.numel
        element = torch.empty(0, dtype=dtype).element_size()
        sent = sum(p.numel for pieces in self.sends.values() for p in pieces)
        return SwitchStats(
            bytes_sent=sent * element,
            bytes_reused=sum(p.numel for p in self.local) * element,
            world_bytes_moved=self.world_elements_moved * element,
            timers=[timer.stop()],
        )

    def check_fills(self, dst: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` unless running the plan writes every element of every ``dst``
        tensor (this process's side) exactly once.

        Only shapes are read, so ``dst`` may have released storage. A target whose storage is
        re-allocated before each switch relies on this: an element left out would keep garbage.
        """
        written: dict[str, list[Piece]] = defaultdict(list)
        for piece in self.local + [p for pieces in self.recvs.values() for p in pieces]:
            written[piece.name].append(piece)
        for name, tensor in dst.items():
            pieces = sorted(written.pop(name, []), key=lambda p: p.dst_start)
            if not _tiles(pieces, tensor):
                raise ValueError(
                    f"the switch plan does not write every element of {name} "
                    f"{tuple(tensor.shape)} exactly once: it writes "
                    f"{[(p.dim, p.dst_start, p.length) for p in pieces]} (dim, start, length)"
                )
        if written:
            raise ValueError(f"the switch plan writes tensors the target lacks: {sorted(written)}")


def _tiles(pieces: list[Piece], tensor: torch.Tensor) -> bool:
    """``pieces`` (sorted by start) cover ``tensor`` along their dimension without gap or
    overlap, each piece whole in the other dimensions."""
    if tensor.numel() == 0:
        return True
    if not pieces:
        return False
    dim, end = pieces[0].dim, 0
    for p in pieces:
        if p.dim != dim or p.dst_start != end or p.inner * tensor.shape[dim] != tensor.numel():
            return False
        end += p.length
    return end == tensor.shape[dim]


@dataclass
class SwitchTimer:
    """How long one switch took on its device: CUDA events around it on the current stream
    (the messages and copies are queued there, so the host's clock would time their launch
    only), the host's clock on CPU, where every step runs as it is issued."""

    events: tuple | None = None
    """(start, end) ``torch.cuda.Event`` pair on CUDA."""
    started_s: float = 0.0
    host_s: float = 0.0

    @classmethod
    def start(cls, device: torch.device) -> SwitchTimer:
        if device.type != "cuda":
            return cls(started_s=clock())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return cls(events=(start, end))

    def stop(self) -> SwitchTimer:
        if self.events is None:
            self.host_s = clock() - self.started_s
        else:
            self.events[1].record()
        return self

    @property
    def seconds(self) -> float:
        """Waits for the switch's end event on CUDA (read it once the step is done)."""
        if self.events is None:
            return self.host_s
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class SwitchStats:
    bytes_sent: int = 0
    """Bytes this process sent."""
    bytes_reused: int = 0
    """Bytes this process copied from its own shards."""
    world_bytes_moved: int = 0
    """Bytes sent between processes by the whole job."""
    timers: list[SwitchTimer] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Device time of the switches (on CUDA this waits for the last one to end)."""
        return sum(timer.seconds for timer in self.timers)

    def add(self, other: SwitchStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_reused += other.bytes_reused
        self.world_bytes_moved += other.world_bytes_moved
        self.timers += other.timers


def _dtype_device(src, dst) -> tuple[torch.dtype, torch.device]:
    tensors = list(src.values()) + list(dst.values())
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"a switch moves one dtype, got {sorted(map(str, dtypes))}")
    return tensors[0].dtype, tensors[0].device


def _view(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(dim, start, length)


def _write(dst, piece: Piece, values: torch.Tensor, accumulate: bool) -> None:
    target = _view(dst[piece.name], piece.dim, piece.dst_start, piece.length)
    if accumulate:
        target.add_(values.view(target.shape))
    else:
        target.copy_(values.view(target.shape))


def build_plan(
    source: dict[str, list[Shard]],
    target: dict[str, list[Shard]],
    *,
    rank: int,
    ranks_per_node: int,
) -> SwitchPlan:
    """The pieces that fill every target shard from the source shards (see the module doc).

    Deterministic: every process computes the same global plan and keeps its own part.
    """
    if set(source) != set(target):
        missing = sorted(set(source) ^ set(target))
        raise ValueError(f"the two layouts hold different parameters: {missing[:4]}")
    plan = SwitchPlan(rank=rank)
    load: dict[int, int] = defaultdict(int)  # elements each sender has been given so far
    for name in sorted(target):
        holders = source[name]
        for shard in sorted(target[name], key=lambda s: s.rank):
            for start, length, local_start in shard.segments:
                for piece in _pieces(
                    name, holders, shard, start, length, local_start, load, ranks_per_node
                ):
                    if piece.src == piece.dst:
                        plan.world_elements_reused += piece.numel
                    else:
                        plan.world_elements_moved += piece.numel
                    if piece.src == piece.dst == rank:
                        plan.local.append(piece)
                    elif piece.src == rank:
                        plan.sends.setdefault(piece.dst, []).append(piece)
                    elif piece.dst == rank:
                        plan.recvs.setdefault(piece.src, []).append(piece)
    return plan


def _pieces(name, holders, shard, start, length, local_start, load, ranks_per_node):
    """Cut ``[start, start + length)`` of the target shard at every source boundary."""
    if any(h.dim != shard.dim or h.inner != shard.inner for h in holders):
        raise ValueError(f"{name}: the layouts cut it along different dimensions")
    cuts = {start, start + length}
    for h in holders:
        for s, n, _ in h.segments:
            cuts.update(c for c in (s, s + n) if start < c < start + length)
    bounds = sorted(cuts)
    for lo, hi in zip(bounds, bounds[1:]):
        covering = [
            (h.rank, s_local + lo - s)
            for h in holders
            for s, n, s_local in h.segments
            if s <= lo and hi <= s + n
        ]
        if not covering:
            raise ValueError(f"{name}: no source process holds [{lo}, {hi})")
        src, src_start = _choose_sender(covering, shard.rank, load, ranks_per_node)
        if src != shard.rank:  # only sends count: copies from a process's own shards are free
            load[src] += (hi - lo) * shard.inner
        yield Piece(
            name,
            src,
            shard.rank,
            shard.dim,
            src_start,
            local_start + lo - start,
            hi - lo,
            shard.inner,
        )


def _choose_sender(covering, dst: int, load, ranks_per_node: int) -> tuple[int, int]:
    """Self first, then the least loaded holder on the same node, then the least loaded one."""
    for src, offset in covering:
        if src == dst:
            return src, offset
    node = dst // ranks_per_node
    near = [c for c in covering if c[0] // ranks_per_node == node]
    pool = near or covering
    return min(pool, key=lambda c: (load[c[0]], c[0]))


def ranks_per_node() -> int:
    """Processes per node, from torchrun's ``LOCAL_WORLD_SIZE`` (all of them when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def element_count(shards: dict[str, list[Shard]]) -> int:
    """Elements of the full model described by ``shards`` (each parameter once)."""
    total = 0
    for holders in shards.values():
        h = holders[0]
        full = max(s + n for hh in holders for s, n, _ in hh.segments)
        total += full * h.inner
    return total
