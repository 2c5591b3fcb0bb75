"""How the estimator prices MEMO: a stage's offloaded and kept layers, α by MEMO's rule on
estimated figures, the host budget, and ``--memo-chunk-tokens auto``.

The per-layer figures are traces of MEMO's own runtime on fake tensors
(``memo_ext.estimate.measure``, at α = 0 and 1, with the run's chunk and offload rule); the
device bytes a stage holds are the layer mode's rule (``memo_ext.memo.modes``), the one the
runtime follows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memo_ext.config import MemoConfig
from memo_ext.estimate.cost_model import (
    Batch,
    Efficiency,
    backward_flops,
    collective_latency_s,
    host_copy_gbps,
    layer_figures,
    layer_gemm_shapes,
    layer_time,
    matmul_shape_factor,
    sub_sequence_chunks,
)
from memo_ext.estimate.fits import LayerFigures
from memo_ext.estimate.stage import LayerTime, MemoryMethod, Stage, StageContext
from memo_ext.features.memo.config import DEFAULT_OFFLOAD_RULE
from memo_ext.hardware import DeviceSpec
from memo_ext.memo.alpha import HostMemoryError, LayerCost, slots_after_forward, solve_alpha
from memo_ext.memo.modes import StageBytes, layer_mode
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

if TYPE_CHECKING:
    from memo_ext.config import RunConfig
    from memo_ext.estimate.search import SearchSpace

DEFAULT_EFFICIENCY = Efficiency()
MEMO_DEFAULTS = MemoConfig(enabled=True)
"""MEMO as ``--memo`` alone runs it: α by the rule, the last two layers kept."""
AUTO_CHUNK_SLOWDOWN = 0.02
"""``--memo-chunk-tokens auto``: the smallest chunk whose matrix products and TP collectives
take at most this fraction longer than the whole sequence's (roofline and latencies above)."""
AUTO_CHUNK_MIN_TOKENS = 256
"""Smallest chunk ``auto`` considers (local tokens); candidates double from there."""


@dataclass(frozen=True)
class _Memo:
    """MEMO's per-layer figures at one α."""

    alpha: float
    host_bytes: int
    slot_bytes: int
    backward: LayerFigures
    live_bytes: int = 0
    """Chunked: the largest total live over one offloaded layer's forward and backward."""


def memo_at(
    model: ModelShape,
    layout: ParallelLayout,
    batch: Batch,
    *,
    tokens: int,
    alpha: float,
    chunk_tokens: int | None = None,
    offload_rule: str | None = None,
) -> _Memo:
    """MEMO at α (by chunks of ``chunk_tokens`` local tokens if given; its layers placing their
    saves by ``offload_rule``, MEMO's own if ``None``), interpolated between the α = 0 and α = 1
    traces (host bytes and recompute FLOPs are linear in α; a ping-pong slot pins whole
    storages as soon as α > 0)."""
    traced = functools.partial(MEMO.traced_layer, chunk_tokens=chunk_tokens, rule=offload_rule)
    zero, one = (
        layer_figures(model, layout, batch, tokens=tokens, method=MEMO, settings=traced(a))
        for a in (0.0, 1.0)
    )
    mix = lambda a, b: round(a + alpha * (b - a))  # noqa: E731
    live = 0
    if chunk_tokens:
        from memo_ext.estimate.measure import chunked_live_fit

        kw = dict(tp=layout.tp, sp=layout.sp, micro_batch_size=batch.micro_batch_size)
        lives = [
            chunked_live_fit(model, alpha=a, chunk_tokens=chunk_tokens, **kw).at(tokens)
            for a in (0.0, 1.0)
        ]
        live = mix(*lives)
    backward = LayerFigures(
        **{
            name: mix(getattr(zero, name), getattr(one, name))
            for name in LayerFigures.__dataclass_fields__
        }
    )
    return _Memo(
        alpha=alpha,
        host_bytes=mix(zero.host_bytes, one.host_bytes),
        slot_bytes=zero.slot_bytes if alpha == 0 else one.slot_bytes,
        backward=backward,
        live_bytes=live,
    )


def auto_chunk_tokens(
    model: ModelShape,
    layout: ParallelLayout,
    batch: Batch,
    *,
    seq_length: int,
    device: DeviceSpec,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> int:
    """``--memo-chunk-tokens auto``: the smallest power-of-two chunk (local tokens, from
    :data:`AUTO_CHUNK_MIN_TOKENS`) whose layer matrix products and TP collectives, forward and
    backward, take at most :data:`AUTO_CHUNK_SLOWDOWN` longer than the whole sequence's; the
    whole local sequence when none does."""
    tokens = seq_length // layout.cp
    local = tokens // (layout.tp if layout.sp else 1)
    latency = collective_latency_s(layout.tp, device)

    def seconds(chunk: int | None) -> float:
        factor = matmul_shape_factor(
            model, layout, batch, tokens=tokens, device=device, eff=eff, chunk_tokens=chunk
        )
        flops = sum(2 * m * k * n for m, k, n in layer_gemm_shapes(model, layout, tokens))
        matmul = 3 * flops * batch.micro_batch_size / (device.peak_tflops * 1e12 * eff.matmul)
        return matmul / factor + 8 * sub_sequence_chunks(layout, tokens, chunk) * latency

    whole = seconds(None)
    chunk = AUTO_CHUNK_MIN_TOKENS
    while chunk < local:
        if seconds(chunk) <= (1 + AUTO_CHUNK_SLOWDOWN) * whole:
            return chunk
        chunk *= 2
    return max(1, local)


def solve_memo_alpha(
    *,
    zero: _Memo,
    one: _Memo,
    forward_s: float,
    device: DeviceSpec,
    layout: ParallelLayout,
    host_budget_bytes: int,
    resident_layers: int,
) -> float:
    """MEMO's α rule (``memo_ext.memo.alpha.solve_alpha``) on estimated figures.

    Raises:
        HostMemoryError: when even α = 0 does not fit the host budget.
    """
    cost = LayerCost(
        full_bytes=zero.host_bytes,
        tokenwise_bytes=one.host_bytes - zero.host_bytes,
        forward_s=forward_s,
        copy_gbps=host_copy_gbps(device, layout),
    )
    return solve_alpha(cost, budget_bytes=host_budget_bytes, resident_layers=resident_layers)


def memo_stage(ctx: StageContext) -> Stage:
    """MEMO: the first layers of the stage offload, the last ``keep_last_layers`` do not
    (``ctx.settings``: the run's ``MemoConfig``, else ``--memo`` alone's)."""
    memo = ctx.settings or MEMO_DEFAULTS
    none, plain, host_budget = ctx.none, ctx.plain, ctx.host_budget
    layer_t, loss_t = ctx.layer_transient, ctx.loss_transient
    in_flight, stage_layers = ctx.in_flight, ctx.stage_layers
    model, layout, batch, tokens = ctx.model, ctx.layout, ctx.batch, ctx.tokens
    keep = min(memo.kept_layers, stage_layers)
    offloaded = stage_layers - keep
    resident = in_flight * offloaded
    chunk = memo.chunk_tokens
    if chunk == "auto":
        chunk = auto_chunk_tokens(
            model,
            layout,
            batch,
            seq_length=tokens * layout.cp,
            device=ctx.device,
            eff=ctx.eff,
        )
    at = dict(tokens=tokens, chunk_tokens=chunk, offload_rule=memo.offload_rule)
    mode = layer_mode(chunk)
    zero = memo_at(model, layout, batch, alpha=0.0, **at)
    alpha, fits_host, notes = memo.alpha, True, []
    # the last layers may keep their whole storages on the device when the host budget cannot
    # hold every layer's (the runtime's mode decides, chunked only)
    skeletons, skeleton_bytes, budget = 0, 0, host_budget
    if offloaded:
        full = zero.host_bytes
        try:
            skeletons = mode.skeletons(
                LayerCost(full_bytes=full, tokenwise_bytes=0),
                budget_bytes=host_budget,
                offloaded=offloaded,
                in_flight=in_flight,
            )
        except HostMemoryError as err:
            skeletons, fits_host = 0, False
            notes.append(str(err))
        skeleton_bytes = skeletons * in_flight * full
        budget = host_budget + skeleton_bytes
    if alpha is None:
        one = memo_at(model, layout, batch, alpha=1.0, **at)
        try:
            alpha = solve_memo_alpha(
                zero=zero,
                one=one,
                forward_s=plain.forward_s,
                device=ctx.device,
                layout=ctx.layout,
                host_budget_bytes=budget,
                resident_layers=resident,
            )
        except HostMemoryError as err:
            alpha, fits_host = 0.0, False
            notes.append(str(err))
    m = memo_at(model, layout, batch, alpha=alpha, **at)
    host = resident * m.host_bytes - skeleton_bytes
    if chunk:
        notes.append(f"MEMO by sub-sequence chunks of {chunk} local tokens")
    stored, peak = mode.stage_bytes(
        StageBytes(
            keep=keep,
            offloaded=offloaded,
            in_flight=in_flight,
            kept_saved_bytes=none.saved_bytes,
            saved_bytes=m.backward.saved_bytes,
            slot_bytes=m.slot_bytes,
            whole_host_bytes=zero.host_bytes,
            skeleton_bytes=skeleton_bytes,
            layer_transient_bytes=layer_t,
            live_bytes=m.live_bytes,
            loss_transient_bytes=loss_t,
        )
    )
    time = LayerTime()
    # the layer's data goes out during its forward and comes back during the next backward
    time.add(layer_time(m.backward, ctx, copy_bytes=m.host_bytes, chunk_tokens=chunk), offloaded)
    time.add(layer_time(none, ctx, chunk_tokens=chunk) if chunk else plain, keep)
    return Stage(
        stored=stored,
        peak_activations=peak,
        time=time,
        recompute_flops=offloaded * (backward_flops(m.backward) - backward_flops(none)),
        alpha=alpha,
        keep=keep,
        device_skeletons=skeletons,
        chunk_tokens=chunk,
        host_bytes=host,
        fits_host=fits_host and host <= host_budget,
        notes=notes,
    )


class MemoMethod(MemoryMethod):
    """Token-wise activation swapping and recomputation (``--memo``)."""

    name = "memo"
    replays_caching_allocator = False  # MEMO plans its memory
    uses_host_memory = True
    suggestion = "add --memo"

    def price(self, ctx: StageContext) -> Stage:
        return memo_stage(ctx)

    def selected_by(self, run: RunConfig) -> bool:
        return run.memo.enabled

    def settings_of(self, run: RunConfig) -> MemoConfig:
        return run.memo

    @staticmethod
    def traced_layer(
        alpha: float, *, chunk_tokens: int | None = None, rule: str | None = None
    ) -> MemoConfig:
        """The settings of an offloaded layer traced at ``alpha`` (by chunks of
        ``chunk_tokens`` local tokens if given; placing its saves by the offload rule ``rule``,
        MEMO's own if ``None``): a huge host budget, since the estimator states what is needed
        and the α rule applies the budget."""
        return MemoConfig(
            enabled=True,
            alpha=alpha,
            keep_last_layers=0,
            host_memory_gb=2**40,
            chunk_tokens=chunk_tokens,
            offload_rule=rule or DEFAULT_OFFLOAD_RULE,
        )

    def traced_settings(self, text: str | None) -> MemoConfig:
        """``ALPHA[@CHUNK][:RULE]``: ``memo-0.5``, ``memo-1@4096``, ``memo-0:my-rule``."""
        if text is None:
            raise ValueError("a traced MEMO layer needs its α: memo-ALPHA[@CHUNK][:RULE]")
        settings, _, rule = text.partition(":")
        alpha, _, chunk = settings.partition("@")
        return self.traced_layer(float(alpha), chunk_tokens=int(chunk) if chunk else None,
                                 rule=rule or None)  # fmt: skip

    def traced_name(self, settings: MemoConfig) -> str:
        chunk = f"@{settings.chunk_tokens}" if settings.chunk_tokens else ""
        rule = settings.offload_rule
        return f"memo-{settings.alpha:g}{chunk}" + (
            f":{rule}" if rule != DEFAULT_OFFLOAD_RULE else ""
        )

    def report_rows(self, *, chunk_tokens: int) -> list[tuple[str, MemoConfig]]:
        """α 0, 0.5 and 1 by whole layers; α 0 and 1 by chunks (``memo-chunked-A``)."""
        rows = [(f"memo-{a:g}", self.traced_layer(a)) for a in (0.0, 0.5, 1.0)]
        return rows + [
            (f"memo-chunked-{a:g}", self.traced_layer(a, chunk_tokens=chunk_tokens))
            for a in (0.0, 1.0)
        ]

    def report_stage(
        self, fig, plain, settings: MemoConfig, *, stage_layers, in_flight, keep_last_layers
    ) -> tuple[int, int, int]:
        """The offloaded layers at ``fig``, the kept last ones at ``plain``, and the ping-pong
        slots of copy sources (a few chunks in flight when chunked, whatever the layers)."""
        kept = _kept(settings, stage_layers=stage_layers, keep_last_layers=keep_last_layers)
        offloaded = stage_layers - kept
        if settings.chunk_tokens:
            pingpong = fig.slot_bytes if offloaded else 0
        else:
            pingpong = slots_after_forward(offloaded=offloaded, kept=kept) * fig.slot_bytes
        device = in_flight * (kept * plain.saved_bytes + offloaded * fig.saved_bytes)
        return device + pingpong, in_flight * offloaded * fig.host_bytes, offloaded

    def report_note(self, *, stage_layers: int, keep_last_layers: int | None, chunk_tokens: int):
        whole, chunked = (
            _kept(self.traced_layer(0.0, chunk_tokens=c), stage_layers=stage_layers,
                  keep_last_layers=keep_last_layers)
            for c in (None, 1)
        )  # fmt: skip
        return (
            f"MEMO keeps the last {whole} layers, chunked MEMO {chunked} with chunks of "
            f"{chunk_tokens} local tokens"
        )

    def layer_spec(self, spec, config, settings: MemoConfig):
        """The layer MEMO's runtime wraps (``memo_ext.memo.policy.apply_memo``)."""
        from memo_ext.memo.policy import apply_memo  # megatron-core: the tracer's, not --help's

        return apply_memo(spec, settings, config)

    def trace_granule(self, settings: MemoConfig) -> int | None:
        return settings.chunk_tokens

    def search_settings(self, space: SearchSpace) -> list[MemoConfig]:
        """Kept last layers in {2, 1, 0} and α in {the rule's, 0}, unless the space fixes them;
        whole layers and MEMO's own offload rule unless it fixes a chunk or a rule."""
        fixed = dict(space.fixed)
        keeps = (
            [fixed["keep_last_layers"]] if fixed.get("keep_last_layers") is not None else [2, 1, 0]
        )
        alphas = [fixed["alpha"]] if fixed.get("alpha") is not None else [None, 0.0]
        rule = fixed.get("offload_rule") or DEFAULT_OFFLOAD_RULE
        return [
            MemoConfig(
                enabled=True,
                alpha=a,
                keep_last_layers=k,
                chunk_tokens=fixed.get("chunk_tokens"),
                offload_rule=rule,
            )
            for k in keeps
            for a in alphas
        ]


MEMO = MemoMethod()


def _kept(settings: MemoConfig, *, stage_layers: int, keep_last_layers: int | None) -> int:
    """Kept last layers of a stage: the given count, else the trainer's default (2 whole, 0
    chunked), at most the stage's layers."""
    keep = keep_last_layers
    if keep is None:
        keep = 0 if settings.chunk_tokens else 2
    return min(keep, stage_layers)
