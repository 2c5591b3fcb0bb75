"""MEMO on a layer that runs by sub-sequence chunks: saved tensors leave the device chunk by chunk.

:class:`ChunkedActivations` runs one offloaded layer's forward as
:class:`~memo_ext.mcore.chunked.ChunkedLayer` does (token-local work by chunks, the core attention
whole) and is autograd's saved-tensor hook meanwhile. The saves fall into *records*: one per
phase of one chunk (``pre``: norm, QKV, RoPE; ``post``: output projection, MLP) and one for the
core attention. A save is

- ``full`` when it lives on the storage of the layer input, of the attention output or of a
  tensor the core attention saved for itself (log-sum-exp, gathered keys / values): those
  storages go to host memory whole, once per layer, as the unchunked MEMO does (or stay on the
  device, ``skeleton_on_device``, when the host budget cannot hold every layer's);
- ``qkv`` when it is a view of the core attention's inputs (whole-sequence q, k and v): the
  host chunks' rows of those go to host memory once attention has run, and the backward
  rebuilds the rest from the recompute chunks' ``pre`` pass;
- ``device`` when it lives on a tensor the layer was given (the RoPE table): kept as is;
- otherwise the record's own: a *host* record copies its own storages to host memory as soon
  as its chunk is done (one pooled buffer per record), a *recompute* record drops them on the
  spot.

α chooses the host records: the chunks that lie wholly inside the first ``floor(α · s)`` local
tokens; the others are recomputed. So the device holds one chunk's saves at a time in the
forward, plus the copies in flight (a few batches, :data:`COPIES_IN_FLIGHT` in the runtime).

In the backward the layer's whole storages come back first; then each record is restored when
autograd first unpacks one of its saves, and released once every save has been unpacked. A
recompute record re-runs its phase on its chunk, the same code on the same shapes, so it saves
the same tensors in the same order and the i-th save replaces the i-th. Restoring the attention
record re-runs the recompute chunks' ``pre`` phase (their q / k / v rows complete the
attention's inputs); those records stay restored until their own backward reads them. While a
record is restored the one created just before it (the next one the backward needs) is
prefetched.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from memo_ext.mcore.chunked import ChunkedLayer
from memo_ext.memo.activations import MemoStats, RecomputeMismatch, unpack_saved
from memo_ext.memo.tensors import TensorMeta, storage_bytes, storage_key, view_of
from memo_ext.memo.transfer import DONE, Completion, HostBuffer, HostPool, host_view


@dataclass(eq=False)
class _Save:
    kind: str
    """``full``, ``qkv``, ``device`` or ``own`` (see the module docstring)."""
    meta: TensorMeta
    device: Tensor | None = None


@dataclass(eq=False)
class _Record:
    """The saves of one phase of one chunk, or of the core attention."""

    phase: str
    """``pre``, ``attention`` or ``post``."""
    chunk: int
    host: bool
    index: int = 0
    """Position among the layer's records (creation order; the backward goes in reverse)."""
    saves: list[_Save] = field(default_factory=list)
    sources: dict[int, Tensor] = field(default_factory=dict)
    """Own storage key → a tensor on it, until the copies are issued (host records)."""
    storages: dict[int, int] = field(default_factory=dict)
    """Own storage key → bytes (outputs included), whether the record is host or recompute."""
    hosts: dict[int, Tensor] = field(default_factory=dict)
    """Own storage key → its bytes in host memory."""
    completion: Completion = field(default_factory=lambda: DONE)
    prefetched: tuple[list[Tensor], Completion] | None = None
    restored: dict[int, Tensor] | None = None
    """Host records in the backward: own storage key → device copy (``uint8``)."""
    recomputed: list[Tensor] | None = None
    """Recompute records in the backward: the recompute pass's saves, in order."""
    recomputed_outputs: list[Tensor] | None = None
    consumed: int = 0

    @property
    def live(self) -> bool:
        return self.restored is not None or self.recomputed is not None


@dataclass
class _Ref:
    """What autograd holds instead of a saved tensor."""

    __slots__ = ("acts", "record", "index")
    acts: ChunkedActivations
    record: _Record
    index: int


def unpack_any(obj: Any) -> Tensor:
    """Unpack hook for chunked and unchunked MEMO layers."""
    if isinstance(obj, _Ref):
        return obj.acts.unpack(obj.record, obj.index)
    return unpack_saved(obj)


class ChunkedActivations:
    """One forward of one chunked MEMO layer, its saves and their restoration."""

    def __init__(
        self,
        layer: torch.nn.Module,
        kwargs: dict[str, Any],
        *,
        chunk_tokens: int,
        host_tokens: int,
        pool: HostPool | None,
        engine,
        stats: MemoStats,
        offload: Callable[[list[tuple[Tensor, Tensor]], list[Completion]], Completion],
        on_backward: Callable[[Any], None],
        measure_only: bool = False,
        skeleton_on_device: bool = False,
    ):
        """``offload`` issues device → host copies (the runtime bounds those in flight);
        ``on_backward`` is called when the layer's backward starts; ``skeleton_on_device``
        keeps the whole storages on the device instead of copying them (host budget)."""
        x = kwargs["hidden_states"]
        self.layer = layer
        self.layer_index = layer.memo_index
        self.phases = ChunkedLayer(layer, kwargs, chunk_tokens)
        self._input = x
        self.tokens = x.size(0)
        self.sequences = x.size(1) if x.dim() == 3 else 1
        self.host_tokens = host_tokens
        self.pool, self.engine, self.stats = pool, engine, stats
        self._offload, self._on_backward = offload, on_backward
        self.measure_only = measure_only
        self.skeleton_on_device = skeleton_on_device
        self._skeleton: dict[int, Tensor] | None = None
        """The whole storages kept on the device (``skeleton_on_device``), until the backward."""
        self.input_meta = TensorMeta.of(x)
        self.input_requires_grad = x.requires_grad
        self.records: list[_Record] = []
        self.full_sources: dict[int, Tensor] = {storage_key(x): x.detach()}
        """Storage key → a tensor on it: storages that go to host memory whole."""
        self.full_hosts: dict[int, Tensor] = {}
        self.full_completion: Completion = DONE
        self.qkv_metas: list[TensorMeta] = []
        """The core attention's inputs q, k and v in the forward (whole-sequence buffers)."""
        self.qkv_hosts: list[Tensor] = []
        """Host copies of the host chunks' rows of q, k and v (``_qkv_blocks`` order)."""
        self._qkv_bytes = 0
        self.output_meta: TensorMeta | None = None
        self.host_buffers: list[HostBuffer] = []
        self._full_bytes = 0
        self._unreleased = 0
        self.previous: weakref.ref | None = None
        self._external = {storage_key(t) for t in _tensors(self.phases.kwargs)}
        self._params = {storage_key(p) for p in layer.parameters()}
        self._record: _Record | None = None
        self._full: dict[int, Tensor] | None = None
        self._full_prefetched: tuple[list[Tensor], Completion] | None = None
        self._qkv: dict[int, Tensor] | None = None

    # ----------------------------------------------------------------------------- forward

    def host_rows(self, host_tokens: int) -> int:
        """Local tokens of the host chunks: the chunks that end within ``host_tokens``."""
        return max([stop for _, stop in self.phases.bounds if stop <= host_tokens], default=0)

    def run(self) -> tuple[Tensor, None]:
        """The layer's forward (as ``TransformerLayer.forward`` returns it), saves captured."""
        phases, x = self.phases, self._input
        chunks = range(len(phases.bounds))
        inputs, qkv = x, [None, None, None]
        for c in chunks:
            rows, inputs = phases.take(inputs, c, gathered=False)
            with self._capturing(_Record("pre", c, self._is_host(c))) as record:
                parts = phases.pre_attention(rows, c)
            self._end_record(record)
            qkv = [phases.place(w, t, c, gathered=True) for w, t in zip(qkv, parts)]
            del rows, parts
        self.qkv_metas = [TensorMeta.of(t) for t in qkv]
        with self._capturing(_Record("attention", -1, True)):
            out = phases.attention(*qkv)
        self.output_meta = TensorMeta.of(out)
        self.full_sources.setdefault(storage_key(out), out.detach())
        self._offload_full(qkv)
        del qkv
        inputs, outputs, result = x, out, None
        for c in chunks:
            rows, inputs = phases.take(inputs, c, gathered=False)
            attention_rows, outputs = phases.take(outputs, c, gathered=True)
            with self._capturing(_Record("post", c, self._is_host(c))) as record:
                part = phases.post_attention(rows, attention_rows)
            self._end_record(record)
            result = phases.place(result, part, c, gathered=False)
            del rows, attention_rows, part
        # held until here so that no later tensor takes a storage key they are known by
        self.full_sources, self._input = {}, None
        return phases.finish(result), None

    def _is_host(self, chunk: int) -> bool:
        return self.phases.bounds[chunk][1] <= self.host_tokens

    @contextlib.contextmanager
    def _capturing(self, record: _Record) -> Iterator[_Record]:
        record.index = len(self.records)
        self.records.append(record)
        self._record = record
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_any):
                yield record
        finally:
            self._record = None

    def _pack(self, t: Tensor) -> Any:
        key = storage_key(t)
        if isinstance(t, torch.nn.Parameter) or key in self._params:
            return t
        record, meta = self._record, TensorMeta.of(t)
        save = _Save("own", meta)
        if record.phase == "attention" and key in {m.storage for m in self.qkv_metas}:
            save.kind = "qkv"
        elif key in self._external or t.device != self.input_meta.device:
            # inputs from outside the layer, and host tensors of a device layer (SDPA's
            # memory-efficient kernel keeps its philox seed and offset on the host, and its
            # backward reads them there), stay as they are, where they are
            save.kind, save.device = "device", t.detach()
        elif key in self.full_sources or record.phase == "attention":
            save.kind = "full"
            self.full_sources.setdefault(key, t.detach())
        if save.kind == "own":
            record.storages[key] = t.untyped_storage().nbytes()
            if record.host:
                record.sources.setdefault(key, t.detach())
        record.saves.append(save)
        return _Ref(self, record, len(record.saves) - 1)

    def _end_record(self, record: _Record) -> None:
        """A chunk's phase is done: copy its own storages to the host, or drop them."""
        sources = [storage_bytes(src) for src in record.sources.values()]
        hosts = self._host([s.numel() for s in sources])
        record.hosts = dict(zip(record.sources, hosts))
        record.sources = {}
        if sources and not self.measure_only:
            record.completion = self._offload(list(zip(hosts, sources)), self._reuse())

    def _qkv_blocks(self, qkv: list[Tensor], rows: int) -> Iterator[Tensor]:
        """The first ``rows`` local tokens' rows of q, k and v, one contiguous block per SP
        rank (the host chunks' rows)."""
        n, groups = self.tokens, self.phases.groups
        for t in qkv:
            for g in range(groups):
                yield t[g * n : g * n + rows]

    def _offload_full(self, qkv: list[Tensor]) -> None:
        """Copy the whole storages, and the host chunks' rows of q, k and v, to the host."""
        full = {key: storage_bytes(src) for key, src in self.full_sources.items()}
        if self.skeleton_on_device:
            self._skeleton, full = full, {}
        blocks = self._qkv_blocks(qkv, self.host_rows(self.host_tokens))
        blocks = [b.reshape(-1).view(torch.uint8) for b in blocks if b.numel()]
        sources = list(full.values()) + blocks
        hosts = self._host([s.numel() for s in sources])
        self.full_hosts = dict(zip(full, hosts))
        self.qkv_hosts = hosts[len(full) :]
        self._full_bytes = sum(s.numel() for s in full.values())
        self._qkv_bytes = sum(m.nbytes for m in self.qkv_metas)
        if sources and not self.measure_only:
            self.full_completion = self._offload(list(zip(hosts, sources)), self._reuse())

    def _host(self, sizes: list[int]) -> list[Tensor]:
        """Host destinations of ``sizes`` bytes, slices of one pooled buffer (one pinned
        allocation per copy batch, reused every iteration)."""
        if self.measure_only or not sizes:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        buf = self.pool.acquire(sum(sizes))
        self.host_buffers.append(buf)
        data = host_view(buf, (sum(sizes),), torch.uint8)
        return list(data.split(sizes))

    def _reuse(self) -> list[Completion]:
        """The copy that last read the newest host buffer (the next copy into it waits)."""
        return [self.host_buffers[-1].last_read]

    def host_bytes(self, host_tokens: int | None = None) -> int:
        """Host bytes of this layer if the chunks within ``host_tokens`` went to host memory."""
        a = self.host_rows(self.host_tokens if host_tokens is None else host_tokens)
        total = self._full_bytes + self._qkv_bytes * a // self.tokens
        for r in self.records:
            if r.phase != "attention" and self.phases.bounds[r.chunk][1] <= a:
                total += sum(r.storages.values())
        return total

    def device_bytes(self) -> int:
        """Bytes this layer keeps on the device after its forward: its whole storages when
        they stay there (``skeleton_on_device``), else none."""
        return sum(t.numel() for t in (self._skeleton or {}).values())

    # ---------------------------------------------------------------------------- backward

    def prefetch(self) -> None:
        """Start bringing back the whole storages and the last record (the backward's first)."""
        if self._full is None and self._full_prefetched is None and self._skeleton is None:
            self._full_prefetched = self._fetch(
                list(self.full_hosts.values()), self.full_completion
            )
        self._prefetch_record(len(self.records) - 1)

    def _fetch(self, hosts: list[Tensor], after: Completion) -> tuple[list[Tensor], Completion]:
        self.stats.h2d_bytes += sum(h.numel() for h in hosts)
        fetched, completion = self.engine.to_device(
            hosts, device=self.input_meta.device, after=after
        )
        # the host-to-device stream runs in order: this copy's end implies every earlier one's,
        # so it may stand for the last read of all this layer's buffers (their next reuse waits)
        for buf in self.host_buffers:
            buf.last_read = completion
        return fetched, completion

    def _prefetch_record(self, index: int) -> None:
        if index < 0:
            return
        record = self.records[index]
        if record.live or record.prefetched is not None:
            return
        if record.phase == "attention" and self.qkv_hosts:
            record.prefetched = self._fetch(self.qkv_hosts, self.full_completion)
        elif record.host and record.hosts:
            record.prefetched = self._fetch(list(record.hosts.values()), record.completion)

    def _fetched(self, record: _Record, hosts: list[Tensor], after: Completion) -> list[Tensor]:
        fetched, completion = record.prefetched or self._fetch(hosts, after)
        record.prefetched = None
        self.engine.wait(completion)
        return fetched

    def unpack(self, record: _Record, index: int) -> Tensor:
        """Autograd's unpack hook: the saved tensor, rebuilt exactly."""
        if self._full is None:
            self._materialize()
        if not record.live:
            self._restore(record)
        save = record.saves[index]
        if save.kind == "device":
            value = save.device
        elif save.kind == "full":
            value = view_of(self._full[save.meta.storage], save.meta)
        elif save.kind == "qkv":
            value = view_of(self._qkv[save.meta.storage], save.meta)
        elif record.host:
            value = view_of(record.restored[save.meta.storage], save.meta)
        else:
            value = record.recomputed[index]
        record.consumed += 1
        if record.consumed == len(record.saves):
            self._release(record)
        return value

    def _materialize(self) -> None:
        if self._skeleton is not None:
            self._full, self._skeleton = self._skeleton, None
            self._unreleased = sum(1 for r in self.records if r.saves)
            self._on_backward(self)
            return
        fetched, completion = self._full_prefetched or self._fetch(
            list(self.full_hosts.values()), self.full_completion
        )
        self._full_prefetched = None
        self.engine.wait(completion)
        self._full = dict(zip(self.full_hosts, fetched))
        self._unreleased = sum(1 for r in self.records if r.saves)
        self._on_backward(self)

    def _restore(self, record: _Record) -> None:
        if record.phase == "attention":
            self._restore_qkv(record)
        elif record.host:
            fetched = self._fetched(record, list(record.hosts.values()), record.completion)
            record.restored = dict(zip(record.hosts, fetched))
        else:
            self._recompute(record)
        self._prefetch_record(record.index - 1)

    def _restore_qkv(self, record: _Record) -> None:
        """The core attention's inputs: host rows fetched, the other chunks' rows recomputed
        (their ``pre`` records stay restored until their backward)."""
        device = self.input_meta.device
        qkv = [torch.empty(m.size, dtype=m.dtype, device=device) for m in self.qkv_metas]
        if self.qkv_hosts:
            fetched = self._fetched(record, self.qkv_hosts, self.full_completion)
            blocks = self._qkv_blocks(qkv, self.host_rows(self.host_tokens))
            with torch.no_grad():
                for block, data in zip((b for b in blocks if b.numel()), fetched):
                    block.view(-1).view(torch.uint8).copy_(data)
        for pre in self.records:
            if pre.phase == "pre" and not pre.host:
                if not pre.live:
                    self._recompute(pre)
                with torch.no_grad():
                    for whole, part in zip(qkv, pre.recomputed_outputs):
                        target = self.phases.rows_view(whole, pre.chunk, gathered=True)
                        target.copy_(part.view(target.shape))
                pre.recomputed_outputs = None
        self._qkv = {m.storage: storage_bytes(t) for m, t in zip(self.qkv_metas, qkv)}
        record.restored = {}

    def _recompute(self, record: _Record) -> None:
        """Re-run the record's phase on its chunk; its saves replace the forward's, in order."""
        x = view_of(self._full[self.input_meta.storage], self.input_meta)
        x = x.detach().requires_grad_(self.input_requires_grad)
        phases = self.phases
        saves: list[Tensor] = []

        def pack(t: Tensor) -> Any:
            if isinstance(t, torch.nn.Parameter) or storage_key(t) in self._params:
                return t
            saves.append(t.detach())
            return None

        # the backward runs without grad mode; the pass needs it to save what the forward saved
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            rows = phases.rows(x, record.chunk, gathered=False)
            if record.phase == "pre":
                outputs = phases.pre_attention(rows, record.chunk)
                record.recomputed_outputs = [t.detach() for t in outputs]
            else:
                out = view_of(self._full[self.output_meta.storage], self.output_meta)
                out = out.detach().requires_grad_(True)
                phases.post_attention(rows, phases.rows(out, record.chunk, gathered=True))
                start, stop = phases.bounds[record.chunk]
                self.stats.recomputed_tokens += (stop - start) * self.sequences
        if len(saves) != len(record.saves):
            raise RecomputeMismatch(
                f"layer {self.layer_index}, {record.phase} chunk {record.chunk}: the recompute "
                f"pass saved {len(saves)} tensors, the forward {len(record.saves)}"
            )
        record.recomputed = saves

    def _release(self, record: _Record) -> None:
        record.restored = record.recomputed = record.recomputed_outputs = None
        record.consumed = 0
        if record.phase == "attention":
            self._qkv = None
        self._unreleased -= 1
        if self._unreleased == 0:  # every record has been read back: the backward is done
            self._full = None


def _tensors(kwargs: dict[str, Any]) -> Iterator[Tensor]:
    for value in kwargs.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, Tensor):
                yield v


def _never_unpacked(obj: Any) -> Tensor:
    raise RuntimeError("a chunked MEMO recompute graph was run backward")
