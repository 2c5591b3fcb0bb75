"""What MEMO leaves on the device after the forward, and what it puts in host memory.

Device side, checked independently of MEMO's own bookkeeping: every tensor autograd saves is
watched through a weak reference; after the forward (and a garbage collection) the ones still
alive are exactly what someone still holds. Host side: a hand count of the tensors a
RMSNorm / SwiGLU / GQA / RoPE layer saves, against the bytes MEMO copied.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from memo_ext.memo.activations import LayerActivations
from memo_ext.memo.policy import memo_runtime_of, memo_step_metrics
from memo_ext.memo.tensors import storage_key
from memo_ext.memo.transfer import DONE, Completion, SyncTransferEngine
from tests.unit.test_memo_layer import build_pair, make_config, megatron_one_process  # noqa: F401

H, HEADS, GROUPS, D, FFN = 32, 4, 2, 8, 48  # make_config's defaults
FP32 = 4


class SavedWatch:
    """Weak references to the storages of saved tensors: which are still alive, and their bytes.

    A storage's Python object lives exactly as long as the storage (torch keeps it while any
    tensor, view or C++ owner holds the storage), so its weak reference says whether anyone
    anywhere still holds that memory.
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self.refs: list[weakref.ref] = []
        self.exclude = {storage_key(t) for t in exclude}

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.nn.Parameter):
            self.refs.append(weakref.ref(t.untyped_storage()))

    def alive_bytes(self) -> int:
        gc.collect()
        storages = {}
        for ref in self.refs:
            storage = ref()
            if storage is not None and storage._cdata not in self.exclude:
                storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())


def forward_watched(layers, x, rope, watch: SavedWatch, monkeypatch=None):
    """Forward with every save watched: MEMO's pack hook and an outer hook for plain layers."""
    if monkeypatch is not None:
        original = LayerActivations.pack

        def spy(self, t):
            watch.add(t)
            return original(self, t)

        monkeypatch.setattr(LayerActivations, "pack", spy)

    def outer(t):
        watch.add(t)
        # detached: returning a node's own output would make a C++ reference cycle (a leak)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(outer, lambda t: t):
        h = x
        for layer in layers:
            h, _ = layer(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
    return h


@pytest.mark.slow
def test_device_holds_only_kept_layers_after_forward(monkeypatch):
    layers, s, b = 4, 12, 2
    config = make_config(layers=layers)
    ref, mem = build_pair(config, alpha=0.5, keep_last=1, layers=layers)
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0)(s)
    x = torch.randn(s, b, H, requires_grad=True)

    one = SavedWatch(exclude=[x, rope])
    out = forward_watched(ref[:1], x, rope, one)
    per_layer = one.alive_bytes()  # what one plain layer keeps for its backward
    assert per_layer > 0

    plain = SavedWatch(exclude=[x, rope])
    out = forward_watched(ref, x, rope, plain)
    # each layer's input is the previous one's output: all but the first are saved too
    assert plain.alive_bytes() == layers * per_layer + (layers - 1) * x.nbytes
    del out

    watch = SavedWatch(exclude=[x, rope])
    out = forward_watched(mem, x, rope, watch, monkeypatch)
    runtime = memo_runtime_of(mem)
    small = sum(acts.device_bytes() for acts in runtime.live)
    # the kept layer holds its activations; offloaded layers hold nothing else (the synchronous
    # engine has finished every copy, so no ping-pong slot holds sources any more)
    assert runtime.in_flight_source_bytes() == 0
    assert watch.alive_bytes() == 1 * per_layer + x.nbytes + small  # kept layer + its input
    assert small == 0  # every tensor this layer saves has a token dimension

    out.sum().backward()
    del out
    gc.collect()
    assert runtime.pool.in_use_bytes == 0  # host buffers are back in the pool for reuse


def hand_count_bytes(*, s: int, b: int, host_tokens: int) -> int:
    """Host bytes of one RMSNorm / SwiGLU / GQA / RoPE layer (fp32, no biases), by hand.

    Whole: the layer input [s, b, h], the attention output [s, b, heads·d] (the reshaped view of
    the attention kernel's own output: one storage) and its log-sum-exp [b, heads, s].
    Token-wise, per token and sequence: each RMSNorm saves its reciprocal root (1), the normalised
    input before the gain (h) and the output (h) that feeds the next linear layer; the pre-MLP
    norm also saves its input, the attention-residual sum (h); q, k, v ((heads + 2·groups)·d);
    SwiGLU saves the gate half of fc1's output, its SiLU, the up half and
    the product (4·ffn). Per token without a batch dimension: cos and sin tables for q and k (4·d).
    """
    whole = s * b * (H + HEADS * D + HEADS)
    per_token_sequence = 2 * (1 + 2 * H) + H + (HEADS + 2 * GROUPS) * D + 4 * FFN
    tokenwise = host_tokens * (b * per_token_sequence + 4 * D)
    return FP32 * (whole + tokenwise)


def test_host_bytes_match_hand_count_and_grow_linearly_in_alpha():
    s, b = 12, 2
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0)(s)
    x0 = torch.randn(s, b, H)
    measured = {}
    for alpha in (0.0, 0.25, 0.5, 1.0):
        _, mem = build_pair(make_config(), alpha=alpha)
        out, _ = mem[0](hidden_states=x0.clone().requires_grad_(True), rotary_pos_emb=rope)
        out.sum().backward()
        measured[alpha] = memo_step_metrics(mem)["host_offload_bytes"]
        assert measured[alpha] == hand_count_bytes(s=s, b=b, host_tokens=int(alpha * s))
    step = measured[0.25] - measured[0.0]
    assert measured[0.5] - measured[0.25] == step
    assert measured[1.0] - measured[0.5] == 2 * step


class HeldCopies(SyncTransferEngine):
    """Copies that stay 'in flight' until waited on: exercises the ping-pong rule on the CPU."""

    def __init__(self):
        self.waited: list[int] = []
        self.issued = 0

    def to_host(self, pairs, *, reuse):
        super().to_host(pairs, reuse=reuse)
        self.issued += 1
        return Completion(event=self.issued)

    def done(self, completion):
        return completion is DONE or completion.event is None

    def wait(self, completion):
        if completion.event is not None:
            self.waited.append(completion.event)


def _held_after_each_layer(*, layers: int, keep_last: int):
    s, b = 8, 2
    _, mem = build_pair(make_config(layers=layers), alpha=0.5, keep_last=keep_last, layers=layers)
    runtime = memo_runtime_of(mem)
    engine = HeldCopies()
    runtime.engine = engine
    from memo_ext.memo.transfer import HostPool

    runtime.pool = HostPool(budget_bytes=2**30, pin_memory=False)
    h = torch.randn(s, b, H, requires_grad=True)
    held = []
    for layer in mem:
        h, _ = layer(hidden_states=h, attention_mask=None)
        held.append(runtime.in_flight_source_bytes())
    return runtime, engine, h, held


def test_ping_pong_keeps_at_most_two_layers_of_sources():
    runtime, engine, h, held = _held_after_each_layer(layers=5, keep_last=0)
    # layer k's copy waits for layer k - 2's: the 3rd, 4th and 5th offloaded layers waited on
    # the 1st, 2nd and 3rd; sources of at most two layers are held at any time
    assert engine.waited == [1, 2, 3]
    per_layer = held[0]
    assert per_layer > 0
    assert held == [per_layer] + [2 * per_layer] * 4
    h.sum().backward()  # the backward waits on the last two and frees them
    assert runtime.in_flight_source_bytes() == 0
    assert sorted(engine.waited) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("keep_last", [1, 2])
def test_kept_layers_take_the_place_of_the_slots(keep_last):
    # 5 layers, the last keep_last kept: a kept layer first waits for every offloaded layer's
    # copy but the previous layer's, so one kept layer ends the forward next to one slot, two
    # kept layers next to none: never more than two layers' sets
    runtime, engine, h, held = _held_after_each_layer(layers=5, keep_last=keep_last)
    offloaded = 5 - keep_last
    per_layer = held[0]
    assert held[:offloaded] == [per_layer] + [2 * per_layer] * (offloaded - 1)
    # both wait on layer 2's copy (event 3) before the forward ends
    assert engine.waited == [1, 2, 3]
    assert held[offloaded:] == ([per_layer] if keep_last == 1 else [per_layer, 0])
    h.sum().backward()
    assert runtime.in_flight_source_bytes() == 0
    assert sorted(engine.waited) == list(range(1, offloaded + 1))
