"""What the estimator knows of a layer, without tracing one: the figures of one trace (of a
memory method's layer, ``memo_ext.estimate.stage.MemoryMethod``), and the exact fits that scale
two traces to any token count (the traces are ``memo_ext.estimate.measure``'s, which imports
megatron-core; this module does not, so the tools' ``--help`` and argument errors answer at
once).

Every figure is linear in the tokens except attention FLOPs, which are quadratic; ``LayerFit``
traces two lengths and scales, which is exact (``tests/unit/test_estimate.py`` checks a third).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LayerFigures:
    """One layer, one micro-batch, one process, at one token count."""

    saved_bytes: int
    """Device bytes held for the layer after its forward (MEMO: what stays on the device)."""
    input_bytes: int
    """Bytes of the layer input ``[s/cp (/tp under SP), b, h]`` (what full recompute keeps)."""
    host_bytes: int
    """Bytes MEMO copies to host memory for the layer."""
    slot_bytes: int
    """MEMO: device bytes one ping-pong slot pins (storages of the copy sources)."""
    forward_matmul_flops: int
    """Forward FLOPs outside attention."""
    forward_attention_flops: int
    """Forward attention FLOPs as counted (full ``s × s`` products, no causal skip)."""
    backward_matmul_flops: int
    """Backward FLOPs outside attention, recomputation included."""
    backward_attention_flops: int
    """Backward attention FLOPs (full products), recomputation included."""
    param_count: int = 0
    """Parameters of the layer on this process."""


@dataclass(frozen=True)
class LayerFit:
    """A layer's figures at any token count, from traces at ``t1`` and ``t2 = 2·t1`` tokens.

    Bytes and non-attention FLOPs are affine in the tokens, attention FLOPs quadratic; the fit
    is exact for both (two points fix an affine function; attention is checked to be t²).
    """

    t1: int
    low: LayerFigures
    high: LayerFigures

    def at(self, tokens: int) -> LayerFigures:
        """Figures at ``tokens`` tokens per sequence on this process."""
        values = {}
        for f in fields(LayerFigures):
            a, b = getattr(self.low, f.name), getattr(self.high, f.name)
            if "attention" in f.name:
                values[f.name] = round(a * (tokens / self.t1) ** 2)
            elif f.name == "param_count":
                values[f.name] = a
            else:
                slope = (b - a) / self.t1
                values[f.name] = round(a + slope * (tokens - self.t1))
        return LayerFigures(**values)


def reference_tokens(*, tp: int, sp: bool, chunk_tokens: int | None = None) -> int:
    """A small token count every layout divides (SP needs a multiple of TP); chunked, at least
    four whole chunks of ``chunk_tokens`` local tokens (the figures are affine in the tokens
    from there on, at whole chunks)."""
    groups = tp if sp else 1
    return max(2048, 4 * (chunk_tokens or 0)) * groups


@dataclass(frozen=True)
class TransientFit:
    """Bytes per token live on top of the stored activations at the two peaks of an iteration.

    Both are linear in the tokens (every live tensor is), so one trace at the reference length
    gives the slope.
    """

    layer_per_token: float
    """One layer's forward + backward peak minus its saved set (``max_live - saved_bytes``)."""
    loss_per_token: float
    """The output end's peak (norm, output layer, loss and their backward)."""


@dataclass(frozen=True)
class LiveFit:
    """An affine fit of a peak in the tokens, from traces at ``t1`` and ``2·t1`` tokens."""

    t1: int
    low: int
    high: int

    def at(self, tokens: int) -> int:
        return round(self.low + (self.high - self.low) / self.t1 * (tokens - self.t1))
