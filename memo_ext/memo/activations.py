"""One transformer layer's saved activations under MEMO, from its forward to its backward.

During the layer's forward, :class:`LayerActivations` is autograd's saved-tensor pack hook: every
tensor autograd saves is classified (:class:`Role`) and replaced by a small reference. When the
forward ends, the layer input, the attention output and the attention's own state go to host
memory whole; of every token-wise tensor the first α of each token block goes to host memory and
the rest is dropped. The first time the backward unpacks one of the layer's tensors, the host data
comes back and the dropped tokens are recomputed by one pass of the layer over the layer input's
dropped tokens, with a stand-in for the core attention that returns the saved attention output:
attention never runs again. Every saved tensor is then rebuilt with its original size, strides and
aliasing, so the backward computes exactly what it computes without MEMO.

Roles, by where a tensor is saved:

- inside the core attention: views of the attention inputs q / k / v are token-wise
  (``ATTN_INPUT``: their dropped tokens are what the stand-in receives in the recompute pass);
  anything else (output, log-sum-exp, under context parallelism the all-gathered keys and values)
  is ``FULL``;
- outside it: tensors on the storage of the layer input or of the attention output are ``FULL``;
  parameters are never touched; tensors with a token dimension are ``TOKENWISE``, the rest
  ``SMALL`` (kept on the device).

The tensors saved outside the core attention are saved again, in the same order and with the
token dimension shortened, by the recompute pass: that is how the two passes are aligned, and a
probe pass on one token tells which dimension holds the tokens.
"""

from __future__ import annotations

import contextlib
import enum
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from memo_ext.memo.rules import OffloadRule, Placement, SavedTensor, TokenWise
from memo_ext.memo.tensors import (
    TensorMeta,
    TokenLayout,
    empty_like_meta,
    find_token_layout,
    storage_bytes,
    storage_key,
    view_of,
)
from memo_ext.memo.transfer import DONE, Completion, HostBuffer, HostPool, host_view


@dataclass
class MemoStats:
    """What MEMO moved and recomputed since the runtime last reported (one iteration)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    recomputed_tokens: int = 0
    offloaded_layers: int = 0

    def take(self) -> MemoStats:
        """The counters so far; they restart from zero (layers keep counting into this object)."""
        taken = MemoStats(**vars(self))
        for name in vars(taken):
            setattr(self, name, 0)
        return taken


class Role(enum.Enum):
    """What MEMO does with a saved tensor."""

    SMALL = "small"
    """No token dimension, or kept by the offload rule: stays on the device."""
    FULL = "full"
    """Layer input, attention output, attention state, or a save the offload rule sends whole:
    its whole storage goes to host memory."""
    ATTN_INPUT = "attn_input"
    """A view of q / k / v inside the core attention: α of the tokens to host, rest recomputed."""
    TOKENWISE = "tokenwise"
    """α of the tokens to host, rest recomputed."""


_ROLE_OF = {
    Placement.TOKENWISE: Role.TOKENWISE,
    Placement.WHOLE: Role.FULL,
    Placement.KEEP: Role.SMALL,
}
"""The role of each placement an offload rule gives."""


class RecomputeMismatch(RuntimeError):
    """The recompute pass saved other tensors than the forward: the layer is not token-local."""


@dataclass(eq=False)
class Payload:
    """One distinct saved view (several saves of the same view share it)."""

    index: int
    role: Role
    meta: TensorMeta
    position: int | None
    """Index among the saves outside the core attention (the recompute pass's order)."""
    uses: int = 1
    layout: TokenLayout | None = None
    host: Tensor | None = None
    """TOKENWISE: the host part (head blocks, or the whole view when α = 1)."""
    device: Tensor | None = None
    """SMALL: the tensor itself."""
    pending: int = 0
    value: Tensor | None = None


@dataclass(eq=False)
class AttentionInput:
    """q, k or v as the core attention received it; token dimension 0."""

    meta: TensorMeta
    layout: TokenLayout
    source: Tensor | None
    needed: bool = False
    host: Tensor | None = None


@dataclass
class SavedRef:
    """What autograd holds instead of a saved tensor."""

    __slots__ = ("acts", "index")
    acts: LayerActivations
    index: int


def unpack_saved(obj: Any) -> Tensor:
    """Unpack hook: parameters were saved as themselves, the rest through a :class:`SavedRef`."""
    if isinstance(obj, SavedRef):
        return obj.acts.unpack(obj.index)
    return obj


@dataclass
class _Restore:
    """Device-side state of a layer between its first unpack and the end of its backward."""

    full: dict[int, Tensor] = field(default_factory=dict)
    """Storage key → device copy of the whole storage (uint8)."""
    input_heads: dict[int, Tensor] = field(default_factory=dict)
    tokenwise_heads: dict[int, Tensor] = field(default_factory=dict)
    recomputed: list[Tensor | None] = field(default_factory=list)
    stand_in_inputs: list[Tensor] = field(default_factory=list)
    input_storages: dict[object, Tensor] = field(default_factory=dict)
    scratch_storages: dict[int, Tensor] = field(default_factory=dict)


class LayerActivations:
    """Saved tensors of one forward of one layer, their host copies and their restoration."""

    def __init__(
        self,
        layer: torch.nn.Module,
        kwargs: dict[str, Any],
        *,
        host_tokens: int,
        groups: int,
        probe: ProbeShapes | None,
        pool: HostPool | None,
        engine,
        stats: MemoStats,
        on_backward: Callable[[LayerActivations], None],
        measure_only: bool = False,
        rule: OffloadRule | None = None,
    ):
        """``pool`` gives host buffers, ``engine`` moves data (``memo_ext.memo.transfer``),
        ``stats`` counts what moved; ``on_backward`` is called when the layer's backward starts
        (the runtime then frees copied sources and prefetches the layer before); ``rule``
        places the saves outside the core attention (``memo_ext.memo.rules``; MEMO's token-wise
        rule by default)."""
        x = kwargs["hidden_states"]
        self.pool, self.engine, self.stats = pool, engine, stats
        self._on_backward = on_backward
        self.layer = layer
        self.layer_index = layer.memo_index
        self.tokens = x.size(0)
        """This rank's tokens (the layer input's dimension 0)."""
        self.host_tokens = host_tokens
        """Tokens of each block that go to host memory; the rest are recomputed."""
        self.groups = groups
        """Token blocks of tensors gathered over the sequence-parallel group (TP size, or 1)."""
        self.sequences = x.size(1) if x.dim() == 3 else 1
        self.measure_only = measure_only
        self.rule = rule or TokenWise()
        self.input_meta = TensorMeta.of(x)
        self.input_requires_grad = x.requires_grad
        # everything the recompute pass needs besides the layer input (which lives on the host)
        self.kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        self.payloads: list[Payload] = []
        self.full_storages: dict[int, int] = {}
        """Storage key → bytes, for storages that go to host memory whole."""
        self.attention_inputs: list[AttentionInput] = []
        self.output_meta: TensorMeta | None = None
        self.positions = 0
        self.host_buffers: list[HostBuffer] = []
        self.full_hosts: dict[int, Tensor] = {}
        self.offloaded: Completion = DONE
        self.previous: weakref.ref | None = None
        self._probe = probe
        self._sources: dict[int, Tensor] = {}
        """Storage key → a tensor on that storage, until the host copies are issued."""
        self._payload_sources: list[Tensor] = []
        self._by_view: dict[tuple, int] = {}
        self._param_storages = {storage_key(p) for p in layer.parameters()}
        self._in_attention = False
        self._restore: _Restore | None = None
        self._prefetched: tuple[list[Tensor], Completion] | None = None
        self._consumed = 0
        self._full_storages_ready = False
        self.full_storages[self.input_meta.storage] = x.untyped_storage().nbytes()
        self._sources[self.input_meta.storage] = x.detach()

    # ----------------------------------------------------------------------------- forward side

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Install this object as the pack hook and the core-attention observer of the layer."""
        with (
            torch.autograd.graph.saved_tensors_hooks(self.pack, unpack_saved),
            self.layer.memo_pass(self),
        ):
            yield

    def pack(self, t: Tensor) -> Any:
        """Autograd's pack hook: classify ``t`` and return a reference to it."""
        if isinstance(t, torch.nn.Parameter) or storage_key(t) in self._param_storages:
            return t
        if t.device != self.input_meta.device:
            # a host tensor saved by a device layer (SDPA's memory-efficient kernel keeps its
            # philox seed and offset on the host, and its backward reads them there): it stays
            # as it is, where it is
            return t
        meta = TensorMeta.of(t)
        position = None
        if self._in_attention:
            inputs = [a for a in self.attention_inputs if a.meta.storage == meta.storage]
            role = Role.ATTN_INPUT if inputs else Role.FULL
            for a in inputs:
                a.needed = True
        else:
            position = self.positions
            self.positions += 1
            role = Role.FULL if meta.storage in self.full_storages else self._placed(t, position)
        key = (role, meta.view_key)
        index = self._by_view.get(key)
        if index is not None:
            self.payloads[index].uses += 1
            return SavedRef(self, index)
        payload = Payload(index=len(self.payloads), role=role, meta=meta, position=position)
        if role is Role.FULL and meta.storage not in self.full_storages:
            self.full_storages[meta.storage] = t.untyped_storage().nbytes()
        if role is Role.TOKENWISE:
            self._classify_tokenwise(payload, t)
        elif role is Role.SMALL:  # kept on the device by the rule
            payload.device = t.detach()
        t = t.detach()  # the same memory, without the graph (see Role.SMALL above)
        self._sources.setdefault(meta.storage, t)
        self._payload_sources.append(t)
        self.payloads.append(payload)
        self._by_view[key] = payload.index
        return SavedRef(self, payload.index)

    def _placed(self, t: Tensor, position: int) -> Role:
        """The role of a save outside the core attention, as the offload rule places it."""
        saved = SavedTensor(
            layer=self.layer_index,
            position=position,
            shape=tuple(t.shape),
            dtype=t.dtype,
            nbytes=_nbytes(t),
            hidden_size=self.input_meta.size[-1],
        )
        return _ROLE_OF[self.rule.place(saved)]

    def _classify_tokenwise(self, payload: Payload, t: Tensor) -> None:
        if self._probe is None or not 0 < self.host_tokens < self.tokens:
            return  # all tokens go one way: no need to know where they are
        probe = self._probe
        if payload.position >= len(probe.shapes):
            raise RecomputeMismatch(
                f"layer {self.layer_index} saved more tensors than its probe pass "
                f"({len(probe.shapes)}); the layer is not token-local"
            )
        payload.layout = find_token_layout(
            payload.meta.size,
            probe.shapes[payload.position],
            tokens=self.tokens,
            probe_tokens=probe.tokens,
            groups=self.groups,
        )
        if payload.layout is None:
            payload.role = Role.SMALL
            # detached: holding a node's own output from its saved state would be a reference
            # cycle through C++ that the garbage collector cannot break
            payload.device = t.detach()

    def core_attention(self, run: Callable[[], Tensor], query, key, value, *_, **__) -> Tensor:
        """Observe one core-attention call: note its inputs, run it, note its output."""
        if self._in_attention or self.output_meta is not None:
            raise RuntimeError("MEMO expects one core-attention call per layer")
        for x in (query, key, value):
            self.attention_inputs.append(
                AttentionInput(TensorMeta.of(x), self._input_layout(x), source=x.detach())
            )
        self._in_attention = True
        try:
            out = run()
        finally:
            self._in_attention = False
        self.output_meta = TensorMeta.of(out)
        self.full_storages.setdefault(self.output_meta.storage, out.untyped_storage().nbytes())
        self._sources.setdefault(self.output_meta.storage, out.detach())
        return out

    def _input_layout(self, x: Tensor) -> TokenLayout:
        for groups in sorted({1, self.groups}):
            if x.size(0) == groups * self.tokens:
                return TokenLayout(dim=0, groups=groups, per_group=self.tokens)
        raise ValueError(
            f"core-attention input of shape {tuple(x.shape)} does not hold the layer's "
            f"{self.tokens} tokens in dimension 0"
        )

    def end_forward(self) -> list[tuple[Tensor, Tensor]]:
        """Decide the host copies; return ``(host destination, device source)`` pairs.

        Sources stay referenced by the returned pairs only: the caller hands them to the ping-pong
        slot that frees them once the copies are done.
        """
        if self.output_meta is None:
            raise RuntimeError("the layer did not call its core attention; MEMO cannot apply")
        pairs: list[tuple[Tensor, Tensor]] = []
        for key, nbytes in self.full_storages.items():
            dst = self._host(nbytes, (nbytes,), torch.uint8)
            self.full_hosts[key] = dst
            pairs.append((dst, storage_bytes(self._sources[key])))
        a = self.host_tokens
        for inp in self.attention_inputs:
            if inp.needed and a > 0:
                src = inp.layout.head(inp.source, a)
                inp.host = self._host(_nbytes(src), tuple(src.shape), src.dtype)
                pairs.append((inp.host, src))
            inp.source = None
        for p in self.payloads:
            p.pending = p.uses
            if p.role is not Role.TOKENWISE or a == 0:
                continue
            src = self._payload_sources[p.index]
            if a < self.tokens:
                src = p.layout.head(src, a)
            p.host = self._host(_nbytes(src), tuple(src.shape), src.dtype)
            pairs.append((p.host, src))
        self._sources, self._payload_sources, self._by_view = {}, [], {}
        return pairs

    def _host(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self.measure_only:
            return torch.empty(0)
        buf = self.pool.acquire(nbytes)
        self.host_buffers.append(buf)
        return host_view(buf, shape, dtype)

    def host_bytes(self, host_tokens: int | None = None) -> int:
        """Host bytes of this layer if ``host_tokens`` tokens per block went to host memory."""
        a = self.host_tokens if host_tokens is None else host_tokens
        total = sum(self.full_storages.values())
        for inp in self.attention_inputs:
            if inp.needed:
                total += inp.meta.nbytes * a // self.tokens
        for p in self.payloads:
            if p.role is Role.TOKENWISE:
                total += p.meta.nbytes * a // self.tokens
        return total

    def host_buffer_count(self, host_tokens: int | None = None) -> int:
        """Host buffers this layer takes if ``host_tokens`` tokens per block go to host memory
        (one per whole storage, needed attention input and token-wise payload, as
        :meth:`end_forward` takes them)."""
        a = self.host_tokens if host_tokens is None else host_tokens
        count = len(self.full_storages)
        if a > 0:
            count += sum(1 for inp in self.attention_inputs if inp.needed)
            count += sum(1 for p in self.payloads if p.role is Role.TOKENWISE)
        return count

    def device_bytes(self) -> int:
        """Bytes this layer keeps on the device after its forward (SMALL tensors)."""
        return sum(p.meta.nbytes for p in self.payloads if p.role is Role.SMALL)

    # ---------------------------------------------------------------------------- backward side

    def host_tensors(self) -> list[Tensor]:
        """Host copies in a fixed order: full storages, attention-input heads, token-wise heads."""
        hosts = list(self.full_hosts.values())
        hosts += [inp.host for inp in self.attention_inputs if inp.host is not None]
        hosts += [p.host for p in self.payloads if p.host is not None]
        return hosts

    def prefetch(self) -> None:
        """Start bringing the host data back (the runtime calls this one layer ahead)."""
        if self._restore is None and self._prefetched is None:
            self._prefetched = self._fetch()

    def _fetch(self) -> tuple[list[Tensor], Completion]:
        """Start the host → device copies of this layer's host data."""
        hosts = self.host_tensors()
        tensors, completion = self.engine.to_device(
            hosts, device=self.input_meta.device, after=self.offloaded
        )
        for buf in self.host_buffers:
            buf.last_read = completion
        self.stats.h2d_bytes += sum(h.numel() * h.element_size() for h in hosts)
        return tensors, completion

    def unpack(self, index: int) -> Tensor:
        """Autograd's unpack hook for this layer: the saved tensor, rebuilt exactly."""
        if self._restore is None:
            self._materialize()
        p = self.payloads[index]
        if p.value is None:
            p.value = self._build(p)
        value = p.value
        p.pending -= 1
        if p.pending == 0:
            p.value = None
            self._consumed += 1
            if self._consumed == len(self.payloads):
                self._release()
        return value

    def _materialize(self) -> None:
        fetched, completion = self._prefetched or self._fetch()
        self._prefetched = None
        self.engine.wait(completion)
        st = _Restore()
        it = iter(fetched)
        for key in self.full_hosts:
            st.full[key] = next(it)
        for i, inp in enumerate(self.attention_inputs):
            if inp.host is not None:
                st.input_heads[i] = next(it)
        for i, p in enumerate(self.payloads):
            if p.host is not None:
                st.tokenwise_heads[i] = next(it)
        self._restore = st
        self._on_backward(self)
        if self.host_tokens < self.tokens:
            self._recompute(st)

    def _release(self) -> None:
        self._restore = None
        for p in self.payloads:
            p.pending = p.uses

    def full_view(self, st: _Restore, meta: TensorMeta) -> Tensor:
        return view_of(st.full[meta.storage], meta)

    def _recompute(self, st: _Restore) -> None:
        """One pass of the layer over the dropped tokens; attention replaced by its output."""
        a, n = self.host_tokens, self.tokens
        x = self.full_view(st, self.input_meta)
        out_layout = TokenLayout(dim=0, groups=self.output_meta.size[0] // n, per_group=n)
        out = out_layout.tail(self.full_view(st, self.output_meta), a).flatten(0, 1)
        stand_in = StandInAttention(out, expected_tokens=out_layout.groups * (n - a))
        saved: list[Tensor] = []
        run_token_slice(
            self.layer,
            {**self.kwargs, "hidden_states": x},
            start=a,
            groups=self.groups,
            requires_grad=self.input_requires_grad,
            stand_in=stand_in,
            # host tensors the forward kept as they were are not among its positions
            on_save=lambda t: saved.append(t.detach()) if t.device == x.device else None,
        )
        if len(saved) != self.positions:
            raise RecomputeMismatch(
                f"layer {self.layer_index}: the recompute pass saved {len(saved)} tensors, the "
                f"forward {self.positions}; the layer is not token-local"
            )
        st.recomputed = saved
        st.stand_in_inputs = stand_in.inputs
        self.stats.recomputed_tokens += (n - a) * self.sequences

    def _build(self, p: Payload) -> Tensor:
        st = self._restore
        if p.role is Role.SMALL:
            return p.device
        if p.role is Role.FULL:
            return self.full_view(st, p.meta)
        if p.role is Role.ATTN_INPUT:
            return self._attention_input_view(st, p.meta)
        return self._build_tokenwise(st, p)

    def _attention_input_view(self, st: _Restore, meta: TensorMeta) -> Tensor:
        """A saved view of a core-attention input, rebuilt. An input alone on its storage (V:
        a view of the fused QKV output, whose query and key thirds RoPE replaced) is rebuilt
        alone and dense, not the whole fused buffer around it; inputs that share a storage are
        rebuilt on a storage like the forward's."""
        inputs = [i for i, a in enumerate(self.attention_inputs) if a.meta.storage == meta.storage]
        if len(inputs) == 1:
            strides = _strides_within(meta, self.attention_inputs[inputs[0]].meta)
            if strides is not None:
                return self._dense_input(st, inputs[0]).as_strided(meta.size, strides, 0)
        return view_of(self._input_storage(st, meta.storage), meta)

    def _dense_input(self, st: _Restore, index: int) -> Tensor:
        """Attention input ``index`` as a contiguous tensor of its shape: host head and
        recomputed tail merged."""
        key = ("dense", index)
        if key not in st.input_storages:
            inp = self.attention_inputs[index]
            dense = torch.empty(inp.meta.size, dtype=inp.meta.dtype, device=_dev(st))
            tail = st.stand_in_inputs[index] if self.host_tokens < self.tokens else None
            self._merge(dense, inp.layout, st.input_heads.get(index), tail)
            st.input_storages[key] = dense
        return st.input_storages[key]

    def _input_storage(self, st: _Restore, key: int) -> Tensor:
        """A storage like the forward's, holding every attention input that lived on it."""
        if key not in st.input_storages:
            inputs = [(i, a) for i, a in enumerate(self.attention_inputs) if a.meta.storage == key]
            u8 = torch.empty(inputs[0][1].meta.storage_nbytes, dtype=torch.uint8, device=_dev(st))
            for i, inp in inputs:
                tail = st.stand_in_inputs[i] if self.host_tokens < self.tokens else None
                self._merge(view_of(u8, inp.meta), inp.layout, st.input_heads.get(i), tail)
            st.input_storages[key] = u8
        return st.input_storages[key]

    def _build_tokenwise(self, st: _Restore, p: Payload) -> Tensor:
        head = st.tokenwise_heads.pop(p.index, None)
        tail = None
        if self.host_tokens < self.tokens:
            tail = st.recomputed[p.position]
            st.recomputed[p.position] = None
            if head is None and tail.stride() == p.meta.stride and p.meta.dense:
                return tail  # recomputed whole with the forward's layout
        if p.meta.dense:
            target = empty_like_meta(p.meta, device=_dev(st))
        else:  # a view into a bigger storage: rebuild that storage (shared with its other views)
            if p.meta.storage not in st.scratch_storages:
                st.scratch_storages[p.meta.storage] = torch.empty(
                    p.meta.storage_nbytes, dtype=torch.uint8, device=_dev(st)
                )
            target = view_of(st.scratch_storages[p.meta.storage], p.meta)
        layout = p.layout or TokenLayout(dim=0, groups=1, per_group=self.tokens)
        self._merge(target, layout, head, tail)
        return target

    def _merge(
        self, target: Tensor, layout: TokenLayout, head: Tensor | None, tail: Tensor | None
    ) -> None:
        """Write the host head and the recomputed tail of each token block into ``target``."""
        a, n = self.host_tokens, self.tokens
        with torch.no_grad():
            if a == n:
                target.copy_(head.view(target.shape) if head.dim() != target.dim() else head)
                return
            if a == 0:
                target.copy_(tail)
                return
            layout.head(target, a).copy_(head)
            tail_blocks = tail.unflatten(layout.dim, (layout.groups, n - a))
            layout.tail(target, a).copy_(tail_blocks)


def _strides_within(view: TensorMeta, base: TensorMeta) -> tuple[int, ...] | None:
    """``view``'s strides on a contiguous copy of ``base``, when ``view`` is ``base`` with its
    dimensions permuted (SDPA's ``[s, b, heads, hn] -> [b, heads, s, hn]``); else ``None``."""
    if view.offset != base.offset or math.prod(view.size) != math.prod(base.size):
        return None
    dense = [math.prod(base.size[i + 1 :]) for i in range(len(base.size))]
    free = [i for i, n in enumerate(base.size) if n > 1]
    strides = []
    for size, stride in zip(view.size, view.stride):
        if size == 1:
            strides.append(0)
            continue
        match = next((i for i in free if (base.size[i], base.stride[i]) == (size, stride)), None)
        if match is None:
            return None
        free.remove(match)
        strides.append(dense[match])
    return tuple(strides) if not free else None


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _dev(st: _Restore) -> torch.device:
    return next(iter(st.full.values())).device


@dataclass
class ProbeShapes:
    """Shapes of the tensors a layer saves outside its core attention, on ``tokens`` tokens."""

    tokens: int
    shapes: list[tuple[int, ...]]


class StandInAttention:
    """Core attention for the recompute pass: returns the saved output, records the inputs."""

    def __init__(self, output: Tensor, *, expected_tokens: int):
        self.output = output
        self.expected_tokens = expected_tokens
        self.inputs: list[Tensor] = []

    def core_attention(self, run, query, key, value, *_, **__) -> Tensor:
        if query.size(0) != self.expected_tokens:
            raise RecomputeMismatch(
                f"the recompute pass gave the core attention {query.size(0)} tokens, "
                f"expected {self.expected_tokens}"
            )
        self.inputs = [query, key, value]
        return self.output.detach().requires_grad_(True)


class ZeroAttention:
    """Core attention for the probe pass: zeros of the output's shape."""

    def core_attention(self, run, query, key, value, *_, **__) -> Tensor:
        shape = (*query.shape[:-2], query.size(-2) * value.size(-1))
        return query.new_zeros(shape).requires_grad_(True)


def rope_rows(rope: Tensor, layout: TokenLayout, start: int, stop: int) -> Tensor:
    """Rows of a RoPE table ``[groups·tokens, 1, 1, d]`` for local tokens ``[start, stop)``."""
    if rope.size(0) != layout.groups * layout.per_group:
        raise ValueError(
            f"RoPE table has {rope.size(0)} rows, expected {layout.groups * layout.per_group}"
        )
    return layout.blocks(rope).narrow(1, start, stop - start).flatten(0, 1)


def run_token_slice(
    layer: torch.nn.Module,
    kwargs: dict[str, Any],
    *,
    start: int,
    stop: int | None = None,
    groups: int,
    requires_grad: bool,
    stand_in: Any,
    on_save: Callable[[Tensor], None],
) -> Tensor:
    """Run ``layer`` on its input's tokens ``[start, stop)``; report every non-parameter save.

    The RoPE table is cut to the same tokens (``groups`` blocks under sequence parallelism); the
    core attention is replaced by ``stand_in``. The pass builds an autograd graph only so that
    the same tensors are saved as in the forward; it is never run backward.
    """
    x = kwargs["hidden_states"]
    n = x.size(0)
    stop = n if stop is None else stop
    sliced = x.narrow(0, start, stop - start).detach().requires_grad_(requires_grad)
    kwargs = {**kwargs, "hidden_states": sliced}
    rope = kwargs.get("rotary_pos_emb")
    if rope is not None:
        layout = TokenLayout(dim=0, groups=groups, per_group=n)
        if isinstance(rope, tuple):
            kwargs["rotary_pos_emb"] = tuple(rope_rows(r, layout, start, stop) for r in rope)
        else:
            kwargs["rotary_pos_emb"] = rope_rows(rope, layout, start, stop)
    params = {storage_key(p) for p in layer.parameters()}

    def pack(t: Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or storage_key(t) in params:
            return t
        on_save(t)
        return 0

    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked),
        layer.memo_pass(stand_in),
    ):
        out, _ = layer.forward_plain(**kwargs)
    return out


def _never_unpacked(obj: Any) -> Tensor:
    raise RuntimeError("a MEMO recompute or probe graph was run backward")
