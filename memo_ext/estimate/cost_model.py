"""Memory, time and MFU of one training configuration, from measured per-layer figures.

``estimate(...)`` combines the fake-tensor measurements of ``memo_ext.estimate.measure`` with
model states, the parallel layout, link bandwidths and achieved kernel efficiencies. Everything
is per process on the busiest pipeline stage; one step is one global batch.

Device memory at its peak is the model states plus the activations stored when the forward ends
plus the larger of two transients measured on the same layer: the output end (norm, output layer
and megatron's vocab-parallel loss) and one layer's forward + backward working set. What the
stage stores and its peak are the memory method's (``memo_ext.estimate.stage``: no
recomputation, Megatron's recomputation, MEMO, each priced by its feature). A headroom fraction
of the device is kept free for the allocator and the CUDA context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from memo_ext.config import DEFAULT_HOST_SHARE
from memo_ext.errors import UsageError
from memo_ext.estimate.fits import LayerFigures
from memo_ext.estimate.stage import LayerTime, MemoryMethod, Place, Stage, StageContext
from memo_ext.hardware import DeviceSpec
from memo_ext.parallel import LayoutError, ParallelLayout
from memo_ext.shapes import ModelShape, embedding_rows, train_flops

# Achieved fraction of the dense peak per op class.
# - matmul (assumption from vendor benchmarks): large bf16 GEMMs (h >= 4096) reach about 75% of
#   peak on A100 / H100 in cuBLAS.
# - attention (FITTED): 0.53 is the value at which the estimator gives the MEMO paper's measured
#   52.30% MFU for 7B at 1M tokens on 8 × A800 (``python -m benchmarks.paper_table --fit``
#   finds it, with --loss-chunks 16 so that 1M fits: 52.4% at 0.53). The FlashAttention-2
#   paper's own A100 benchmark (causal forward + backward, head dim 128, ~190 TFLOP/s) suggests
#   about 0.60, which predicts 58.9% there; the difference (kernel in the paper's stack, A800
#   clocks, 4 heads per GPU at 1M tokens) is not separated. Only that one figure was used;
#   docs/estimate.md lists what it predicts beside the figures not used for fitting. A
#   calibration file replaces both on a real machine.
DEFAULT_MATMUL_EFFICIENCY = 0.75
DEFAULT_ATTENTION_EFFICIENCY = 0.53
# Device memory kept free for what no trace sees: the CUDA context, NCCL's buffers, cuBLAS and
# attention workspaces (assumption). One fraction for every method so that comparisons stay fair.
# The caching allocator's fragmentation is not in it: Megatron's methods price it by replaying
# their iteration (``memo_ext.estimate.fragmentation``, ``Efficiency.caching_allocator``); MEMO's
# planned allocator serves its activations from a planned region.
DEFAULT_HEADROOM = 0.06
CAUSAL_FRACTION = 0.5
"""A causal kernel computes half of the ``s × s`` products the counter sees."""
# Small work. The efficiencies above are what large kernels reach; short documents and thin
# shards run below them:
# - attention: FlashAttention-2's causal forward + backward at head dim 128 on an A100 runs at
#   roughly half its long-sequence rate at 512 tokens and near it from 4K up (FlashAttention-2
#   paper, Dao 2023, the A100 benchmark figure, read approximately). Modelled as the efficiency
#   times ``c / (c + ATTENTION_HALF_TOKENS)`` for query chunks of ``c`` tokens: a document of
#   ``len`` tokens is one chunk, or ``2·CP`` chunks of ``len / (2·CP)`` under CP.
ATTENTION_HALF_TOKENS = 512
# - matrix products: a roofline. A product runs at the matmul efficiency unless reading and
#   writing its operands through device memory takes longer (thin TP shards of short rows), and
#   never in less than a kernel's floor.
HBM_EFFICIENCY = 0.8
"""Achieved fraction of the data-sheet HBM bandwidth for streaming kernels (assumption)."""
KERNEL_FLOOR_S = 5e-6
"""Shortest time of one kernel, launch and tail included (assumption, order of CUDA's
launch overhead)."""
# - communication: every collective or p2p exchange costs a latency on top of its bytes; the
#   order of NCCL's small-message times (assumption): a few µs per ring hop in an NVLink domain,
#   more across the network, plus a fixed start.
COLLECTIVE_START_S = 8e-6
NVLINK_HOP_S = 2e-6
NETWORK_HOP_S = 8e-6
DDP_BUCKET_PARAMS = 40_000_000
"""megatron-core DDP's gradient bucket (``bucket_size`` default, in elements): one all-reduce
each."""


@dataclass(frozen=True, kw_only=True)
class Batch:
    """How one step's sequences reach a process, and how its optimizer state is kept."""

    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    num_microbatches: int = field(default=1, metadata={"flag": "--num-microbatches"})
    """Micro-batches per step and DP rank."""
    distributed_optimizer: bool = True
    """Shard the 12 optimizer bytes per parameter over DP (megatron's distributed optimizer; what
    runs at this scale use, hence the default)."""


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved fractions of the hardware's peaks (see the defaults' comments)."""

    matmul: float = field(
        default=DEFAULT_MATMUL_EFFICIENCY, metadata={"flag": "--matmul-efficiency"}
    )
    """Achieved fraction of the peak on non-attention FLOPs (matrix products; element-wise ops
    are counted as free)."""
    attention: float = field(
        default=DEFAULT_ATTENTION_EFFICIENCY, metadata={"flag": "--attention-efficiency"}
    )
    """Achieved fraction of the peak on attention FLOPs (causal, flash-style kernel)."""
    headroom: float = field(default=DEFAULT_HEADROOM, metadata={"flag": "--memory-headroom"})
    """Fraction of device memory kept free."""
    host_share: float = field(default=DEFAULT_HOST_SHARE, metadata={"flag": "--memo-host-share"})
    """Fraction of host memory MEMO may use (the trainer's default budget share)."""
    attention_fraction: float = field(default=1.0, metadata={"cli": False})
    """Share of a row's causal ``s × s`` attention products really computed: 1 for one
    sequence per row; ``Σ len_i² / s²`` for packed documents that attend only to themselves."""
    fill: float = field(default=1.0, metadata={"cli": False})
    """Share of a row's tokens that are real documents: with ``attention_fraction`` it gives
    the documents' typical length ``s · attention_fraction / fill`` (``Σ len² / Σ len``), which
    sets the attention kernels' efficiency."""
    caching_allocator: bool = field(
        default=False, metadata={"flag": "--caching-allocator-replay", "negatable": True}
    )
    """Megatron's methods: price device memory as PyTorch's caching allocator serves it (the
    iteration's allocations replayed, with fragmentation and the empty-cache retries near the
    limit: ``memo_ext.estimate.fragmentation``), not as the sum of what is allocated. On in
    ``tools.estimate`` and the benchmarks that compare with Megatron (a few seconds of tracing
    per layout); off in the trainer's preflight and HotSPa's ``auto``, which must answer at
    start-up."""
    loss_chunks: int = field(default=1, metadata={"cli": False})
    """Sequence slices the output layer and loss run in (the trainer's ``--loss-chunks``): 1 is
    megatron's vocab-parallel cross entropy on the whole sequence; ``k`` divides that end's
    working set by ``k``."""

    def check(self) -> None:
        """Raises EstimateError for a fraction out of range."""
        for name in ("matmul", "attention", "host_share"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                flag = Efficiency.__dataclass_fields__[name].metadata["flag"]
                raise EstimateError(f"{flag} must be in (0, 1], got {value}")
        if not 0.0 <= self.headroom < 1.0:
            raise EstimateError(f"--memory-headroom must be in [0, 1), got {self.headroom}")
        if self.loss_chunks < 1:
            raise EstimateError(f"--loss-chunks must be at least 1, got {self.loss_chunks}")


@dataclass
class Estimate:
    """One configuration's figures (per process unless said otherwise)."""

    model: str
    method: str
    gpu: str
    seq_length: int
    layout: dict
    alpha: float | None
    keep_last_layers: int | None
    memo_device_skeletons: int
    """Offloaded layers before the kept ones whose whole storages stay on the device for want of
    host memory (chunked MEMO; the trainer's ``memo_device_skeletons``)."""
    memo_chunk_tokens: int | None
    """MEMO's sub-sequence chunk, local tokens (``None``: whole)."""
    params_per_gpu: int
    model_state_bytes: int
    activation_bytes: int
    """Activations stored when the forward ends (all micro-batches in flight)."""
    transient_bytes: int
    """What sits on top of the stored activations at the peak."""
    device_peak_bytes: int
    device_capacity_bytes: int
    device_usable_bytes: int
    host_bytes: int
    """MEMO's host memory per process."""
    host_budget_bytes: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float
    exposed_comm_s: float
    exposed_host_copy_s: float
    grad_sync_s: float
    """The gradient all-reduce over DP × CP (part of ``exposed_comm_s``)."""
    layer_forward_s: float
    """One layer's forward (compute + TP communication): what MEMO's copy must hide under."""
    recompute_flops: float
    fits_device: bool
    fits_host: bool
    notes: list[str] = field(default_factory=list)
    reserved_bytes: int | None = None
    """Megatron's methods under the caching-allocator replay: the model states plus the
    activations' reserved peak (``None``: not replayed; MEMO plans its memory)."""
    fragmentation_bytes: int | None = None
    """Reserved minus allocated at the replay's peak."""
    allocator_retries: int | None = None
    """Empty-cache-and-retry events per step (each synchronises the device)."""
    allocator_retry_s: float = 0.0
    """Seconds per step those retries cost (part of ``step_time_s``)."""
    host_copy_gbps: float = 0.0
    """Device ↔ host bandwidth per GPU the copies were charged, GB/s (its share of the uplink
    while every rank of a node copies)."""

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def to_json(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        return out


def layer_figures(
    model: ModelShape,
    layout: ParallelLayout,
    batch: Batch,
    *,
    tokens: int,
    method: MemoryMethod | None = None,
    settings: Any = None,
) -> LayerFigures:
    """Measured figures of one layer of ``method`` with ``settings`` (``None``: the plain
    layer) at ``tokens`` tokens per sequence on this process."""
    from memo_ext.estimate.measure import layer_fit  # the tracer: megatron-core, when first used

    fit = layer_fit(
        model,
        tp=layout.tp,
        sp=layout.sp,
        micro_batch_size=batch.micro_batch_size,
        method=method,
        settings=settings,
    )
    return fit.at(tokens)


def params_per_gpu(
    model: ModelShape, layout: ParallelLayout, layer: LayerFigures, seq_length: int
) -> int:
    """Parameters on the busiest stage: its layers plus one end (embedding or output layer,
    TP-sharded as the trainer pads it; both at PP 1 when they are not tied) and the final norm."""
    padded = embedding_rows(model.vocab_size, tp_sizes=(layout.tp,))
    both_ends = model.untie_embeddings_and_output_weights and layout.pp == 1
    ends = (2 if both_ends else 1) * padded // layout.tp * model.hidden_size
    ends += 2 * model.hidden_size
    if model.position_embedding_type == "learned_absolute":
        ends += seq_length * model.hidden_size
    return model.num_layers // layout.pp * layer.param_count + ends


def model_state_bytes(params: int, layout: ParallelLayout, batch: Batch) -> int:
    """bf16 weights (2) + fp32 main grads (4) + fp32 master weights and Adam moments (12)."""
    optimizer = 12 * params / (layout.dp if batch.distributed_optimizer else 1)
    return int(6 * params + optimizer)


def collective_latency_s(ranks: int, device: DeviceSpec) -> float:
    """Latency of one collective (ring) over ``ranks`` processes, bytes aside."""
    if ranks <= 1:
        return 0.0
    hop = NVLINK_HOP_S if ranks <= device.gpus_per_node else NETWORK_HOP_S
    return COLLECTIVE_START_S + (ranks - 1) * hop


def p2p_latency_s(device: DeviceSpec, *, across_nodes: bool) -> float:
    """Latency of one point-to-point exchange, bytes aside."""
    return COLLECTIVE_START_S + (NETWORK_HOP_S if across_nodes else NVLINK_HOP_S)


def gemm_seconds(rows: int, inner: int, cols: int, *, device: DeviceSpec, eff: Efficiency):
    """One bf16 ``[rows, inner] @ [inner, cols]`` on the roofline (see ``HBM_EFFICIENCY``)."""
    compute = 2 * rows * inner * cols / (device.peak_tflops * 1e12 * eff.matmul)
    memory = 0.0
    if device.hbm_gbps:
        memory = 2 * (rows * inner + inner * cols + rows * cols) / (device.hbm_gbps * 1e9)
        memory /= HBM_EFFICIENCY
    return max(compute, memory) + KERNEL_FLOOR_S


def layer_gemm_shapes(model: ModelShape, layout: ParallelLayout, rows: int) -> list[tuple]:
    """``(rows, inner, cols)`` of a layer's QKV, output, fc1 and fc2 products on a TP shard."""
    h, tp = model.hidden_size, layout.tp
    qkv = (model.num_attention_heads + 2 * model.query_groups) * model.head_dim // tp
    fc1 = model.ffn_size * (2 if model.swiglu else 1) // tp
    shapes = [(rows, h, qkv), (rows, model.num_attention_heads * model.head_dim // tp, h)]
    return shapes + [(rows, h, fc1), (rows, model.ffn_size // tp, h)]


def matmul_shape_factor(
    model: ModelShape,
    layout: ParallelLayout,
    batch: Batch,
    *,
    tokens: int,
    device,
    eff,
    chunk_tokens: int | None = None,
) -> float:
    """Achieved / nominal speed of one layer's matrix products on this process: the QKV,
    output, fc1 and fc2 products of ``tokens × micro-batch`` rows on their TP shards (by chunks
    of ``chunk_tokens`` local tokens if given), each on the roofline, against all of them at the
    matmul efficiency (backward assumed alike)."""
    rows = tokens * batch.micro_batch_size
    counted = [(1, rows)]  # (times, rows) of each product
    if chunk_tokens:
        groups = layout.tp if layout.sp else 1
        chunk_rows = min(rows, chunk_tokens * groups * batch.micro_batch_size)
        full, last = divmod(rows, chunk_rows)
        counted = [(full, chunk_rows)] + ([(1, last)] if last else [])
    peak = device.peak_tflops * 1e12 * eff.matmul
    nominal = achieved = 0.0
    for times, r in counted:
        for m, k, n in layer_gemm_shapes(model, layout, r):
            nominal += times * 2 * m * k * n / peak
            achieved += times * gemm_seconds(m, k, n, device=device, eff=eff)
    return nominal / achieved


def attention_chunk_factor(*, seq_length: int, cp: int, eff: Efficiency) -> float:
    """Achieved / nominal speed of the attention kernels on this row's documents (see
    ``ATTENTION_HALF_TOKENS``): their typical length ``Σ len² / Σ len``, cut into ``2·CP``
    chunks under CP."""
    length = seq_length * eff.attention_fraction / max(eff.fill, 1e-12)
    chunk = length / (2 * cp) if cp > 1 else length
    return chunk / (chunk + ATTENTION_HALF_TOKENS)


def _links(device: DeviceSpec, layout: ParallelLayout) -> tuple[float, float, float]:
    """Bandwidths (GB/s) of the TP, CP and DP groups: NVLink while a group fits in a node."""

    def link(ranks: int) -> float:
        return device.nvlink_gbps if ranks <= device.gpus_per_node else device.internode_gbps

    return link(layout.tp), link(layout.tp * layout.cp), link(layout.world_size)


def tp_comm_bytes(model: ModelShape, layout: ParallelLayout, batch: Batch, *, tokens: int) -> float:
    """Bytes one rank sends per layer forward for TP: two all-gathers and two reduce-scatters of
    ``[s/cp, b, h]`` bf16 with SP (or two all-reduces, the same volume, without)."""
    if layout.tp == 1:
        return 0.0
    full = tokens * batch.micro_batch_size * model.hidden_size * 2
    return 4 * full * (layout.tp - 1) / layout.tp


def cp_comm_bytes(model: ModelShape, layout: ParallelLayout, batch: Batch, *, tokens: int) -> float:
    """Bytes one rank sends per layer forward for CP: its k and v chunk to each other rank."""
    if layout.cp == 1:
        return 0.0
    kv = 2 * tokens * batch.micro_batch_size * model.query_groups // layout.tp
    return kv * model.head_dim * 2 * (layout.cp - 1)


class EstimateError(UsageError):
    """A configuration the estimator (and the trainer) cannot run; one sentence."""


def check_layout(model: ModelShape, layout: ParallelLayout, batch: Batch, *, seq_length: int):
    """Refuses layouts megatron-core would refuse (``ParallelLayout.check_fits``).

    Raises:
        EstimateError: naming the offending flag or rule.
    """
    for flag, value in (
        ("--micro-batch-size", batch.micro_batch_size),
        ("--seq-length", seq_length),
    ):
        if value < 1:
            raise EstimateError(f"{flag} must be a positive integer, got {value}")
    try:
        layout.check_fits(model, seq_length)
    except LayoutError as err:
        raise EstimateError(str(err)) from None


def _seconds(
    flops_matmul, flops_attention, *, device, eff, cp, matmul_factor=1.0, attention_factor=1.0
) -> tuple[float, float]:
    """(matmul seconds, attention seconds) of counted FLOPs on this process, the kernels
    running at ``factor`` × their efficiency (small work, see ``matmul_shape_factor``)."""
    peak = device.peak_tflops * 1e12
    # counted attention products are full s_q x s_k on the local s/cp tokens; under CP each local
    # query attends to cp times more keys (load-balanced), and a causal kernel does half
    attention = flops_attention * cp * CAUSAL_FRACTION * eff.attention_fraction
    return (
        flops_matmul / (peak * eff.matmul * matmul_factor),
        attention / (peak * eff.attention * attention_factor),
    )


def layer_time(
    fig: LayerFigures,
    ctx: Place,
    *,
    forward_passes: int = 1,
    copy_bytes: int = 0,
    chunk_tokens: int | None = None,
) -> LayerTime:
    """One layer's forward + backward for one micro-batch: compute, exposed comm and copies
    (by sub-sequence chunks of ``chunk_tokens`` local tokens if given: smaller products, and
    the TP collectives once per chunk). ``forward_passes`` 2: the backward re-runs the forward
    (full recomputation), its communication included; ``copy_bytes`` go to host memory during
    the forward and come back during the next backward."""
    model, layout, batch, device, eff, tokens = (
        ctx.model,
        ctx.layout,
        ctx.batch,
        ctx.device,
        ctx.eff,
        ctx.tokens,
    )
    tp_link, cp_link, _ = _links(device, layout)
    seconds = dict(
        device=device,
        eff=eff,
        cp=layout.cp,
        matmul_factor=matmul_shape_factor(
            model, layout, batch, tokens=tokens, device=device, eff=eff, chunk_tokens=chunk_tokens
        ),
        attention_factor=attention_chunk_factor(
            seq_length=tokens * layout.cp, cp=layout.cp, eff=eff
        ),
    )
    f_mm, f_att = _seconds(fig.forward_matmul_flops, fig.forward_attention_flops, **seconds)
    b_mm, b_att = _seconds(fig.backward_matmul_flops, fig.backward_attention_flops, **seconds)
    # SP: two all-gathers and two reduce-scatters per pass; CP: a ring of cp - 1 exchanges
    tp_s = tp_comm_bytes(model, layout, batch, tokens=tokens) / (tp_link * 1e9)
    tp_s += (
        4
        * sub_sequence_chunks(layout, tokens, chunk_tokens)
        * collective_latency_s(layout.tp, device)
    )
    cp_s = cp_comm_bytes(model, layout, batch, tokens=tokens) / (cp_link * 1e9)
    cp_nodes = layout.tp * layout.cp > device.gpus_per_node
    cp_s += (layout.cp - 1) * p2p_latency_s(device, across_nodes=cp_nodes)
    # TP collectives sit on the critical path (no comm overlap); ring attention's k / v passes
    # overlap the attention kernels, only the excess shows. Backward moves k, v and their grads.
    comm = forward_passes * max(0.0, cp_s - f_att) + max(
        0.0, 2 * cp_s - (b_att - (forward_passes - 1) * f_att)
    )
    comm += (forward_passes + 1) * tp_s
    forward_s = f_mm + f_att + tp_s + max(0.0, cp_s - f_att)
    copy = copy_bytes / (host_copy_gbps(device, layout) * 1e9)
    exposed_copy = max(0.0, copy - forward_s) + max(0.0, copy - (b_mm + b_att))
    return LayerTime(
        compute_s=f_mm + f_att + b_mm + b_att, comm_s=comm, copy_s=exposed_copy, forward_s=forward_s
    )


def sub_sequence_chunks(layout: ParallelLayout, tokens: int, chunk_tokens: int | None) -> int:
    """Sub-sequence chunks of a layer on ``tokens`` (``s / cp``) tokens."""
    if not chunk_tokens:
        return 1
    local = tokens // (layout.tp if layout.sp else 1)
    return max(1, -(-local // chunk_tokens))


def host_copy_gbps(device: DeviceSpec, layout: ParallelLayout) -> float:
    """Each GPU's device ↔ host bandwidth while every rank of ``layout`` on a node copies at once
    (a method's ranks copy each layer's activations together): GPUs behind one uplink share it."""
    return device.host_copy_gbps(min(layout.world_size, device.gpus_per_node))


def backward_flops(fig: LayerFigures) -> int:
    """A layer's backward FLOPs, recomputation included."""
    return fig.backward_matmul_flops + fig.backward_attention_flops


def estimate(
    *,
    model: ModelShape,
    device: DeviceSpec,
    layout: ParallelLayout,
    batch: Batch = Batch(),
    method: MemoryMethod,
    seq_length: int,
    host_memory_bytes: int,
    settings: Any = None,
    efficiency: Efficiency = Efficiency(),
) -> Estimate:
    """Memory, time and MFU of one configuration (see the module docstring).

    Args:
        model: model shape.
        device: accelerator and links.
        layout: parallel layout (its DP size included).
        batch: micro-batches and optimizer sharding.
        method: how the stage holds its activations (``memo_ext.features.memory_method``).
        seq_length: tokens per sequence.
        host_memory_bytes: host memory per node.
        settings: the method's own settings (MEMO: its ``MemoConfig``); ``None``: its defaults.
        efficiency: achieved kernel efficiencies, headroom and host share.

    Raises:
        EstimateError: for a layout or method that cannot run.
    """
    if not isinstance(method, MemoryMethod):
        raise TypeError(f"method must be a MemoryMethod, got {method!r}")
    if model.vocab_size < 1:
        raise EstimateError(
            f"the vocabulary of {model.name} is unknown (vocab_size {model.vocab_size}); give it "
            "(--vocab-size), or estimate a run resolved against its tokenizer"
        )
    check_layout(model, layout, batch, seq_length=seq_length)
    eff, tokens = efficiency, seq_length // layout.cp
    stage_layers = model.num_layers // layout.pp
    in_flight = min(layout.pp, batch.num_microbatches)
    none = layer_figures(model, layout, batch, tokens=tokens)
    from memo_ext.estimate.measure import transient_fit

    transient = transient_fit(
        model, tp=layout.tp, sp=layout.sp, micro_batch_size=batch.micro_batch_size
    )
    params = params_per_gpu(model, layout, none, seq_length)
    states = model_state_bytes(params, layout, batch)
    procs_per_node = min(layout.world_size, device.gpus_per_node)
    ctx = StageContext(
        model=model,
        layout=layout,
        batch=batch,
        device=device,
        eff=eff,
        tokens=tokens,
        none=none,
        layer_transient=transient.layer_per_token * tokens,
        loss_transient=transient.loss_per_token * tokens / eff.loss_chunks,
        in_flight=in_flight,
        stage_layers=stage_layers,
        host_budget=int(host_memory_bytes * eff.host_share / procs_per_node),
        settings=settings,
    )
    ctx = replace(ctx, plain=layer_time(none, ctx))
    stage = method.price(ctx)
    return _finish(stage, ctx, seq_length=seq_length, states=states, params=params, method=method)


def _pp_exchange_s(model, layout: ParallelLayout, batch: Batch, *, tokens: int, device) -> float:
    """One pipeline send of a micro-batch's hidden states (``[s/cp, b, h]`` bf16, split over TP
    with SP): stages are ``world / pp`` ranks apart, so they share a node only inside one."""
    nbytes = (
        tokens * batch.micro_batch_size * model.hidden_size * 2 / (layout.tp if layout.sp else 1)
    )
    across = layout.world_size > device.gpus_per_node and (
        layout.world_size // layout.pp >= device.gpus_per_node
    )
    link = device.internode_gbps if across else device.nvlink_gbps
    return p2p_latency_s(device, across_nodes=across) + nbytes / (link * 1e9)


def _finish(stage: Stage, ctx: StageContext, *, seq_length, states, params, method: MemoryMethod):
    """The step's time and MFU from the stage's, and the :class:`Estimate`."""
    model, layout, batch, device, eff = ctx.model, ctx.layout, ctx.batch, ctx.device, ctx.eff
    time = stage.time
    # output layer and loss: 2·tokens·h·vocab/tp forward, twice that backward
    padded = embedding_rows(model.vocab_size, tp_sizes=(layout.tp,))
    ends_flops = 6 * ctx.tokens * batch.micro_batch_size * model.hidden_size * padded // layout.tp
    time.compute_s += _seconds(ends_flops, 0, device=device, eff=eff, cp=1)[0]
    stage_s = time.compute_s + time.comm_s + time.copy_s
    if layout.pp > 1:  # each micro-batch's activations in and their gradients out, per stage
        stage_s += 2 * _pp_exchange_s(model, layout, batch, tokens=ctx.tokens, device=device)
    slots = batch.num_microbatches + layout.pp - 1  # 1F1B: the pipeline fills and drains
    _, _, dp_link = _links(device, layout)
    # gradients are all-reduced over DP × CP (CP ranks hold the same weights), in fp32, one
    # collective per DDP bucket
    replicas = layout.dp * layout.cp
    dp_s = 2 * (replicas - 1) / replicas * 4 * params / (dp_link * 1e9)
    if replicas > 1:
        dp_s += -(-params // DDP_BUCKET_PARAMS) * collective_latency_s(replicas, device)
    step_s = slots * stage_s + dp_s
    sequences = batch.micro_batch_size * batch.num_microbatches * layout.dp
    model_flops = train_flops(model, seq_length=seq_length, sequences=sequences)
    usable = int(device.memory_bytes * (1 - eff.headroom))
    peak_activations = int(stage.peak_activations)
    peak = states + peak_activations
    fits_device = peak <= usable
    notes = list(stage.notes)
    replay = None
    if method.replays_caching_allocator and eff.caching_allocator:
        from memo_ext.estimate.fragmentation import stage_replay

        replay = stage_replay(
            model,
            layout,
            method=method,
            settings=ctx.settings,
            seq_length=seq_length,
            micro_batch_size=batch.micro_batch_size,
            num_microbatches=batch.num_microbatches,
            limit_bytes=max(0, usable - states),
            loss_chunks=eff.loss_chunks,
        )
        # the replay's iteration holds every allocation in order: where it runs out, not the
        # sum of the peaks, is the limit
        fits_device = replay.fits
        # the replay ran its own number of micro-batches; a step runs the batch's
        per_step = batch.num_microbatches / replay.microbatches
        retries, retry_s = round(replay.retries * per_step), replay.retry_s * per_step
        step_s += retry_s
        if retries:
            notes.append(f"the caching allocator empties its cache {retries} times per step")
    if layout.cp > 1:
        notes.append("context parallelism modelled as ring attention (local k / v saved)")
    return Estimate(
        model=model.name,
        method=method.name,
        gpu=device.name,
        seq_length=seq_length,
        layout={**asdict(layout), **asdict(batch)},
        alpha=stage.alpha,
        keep_last_layers=stage.keep,
        memo_device_skeletons=stage.device_skeletons,
        memo_chunk_tokens=stage.chunk_tokens,
        params_per_gpu=params,
        model_state_bytes=states,
        activation_bytes=int(stage.stored),
        transient_bytes=peak_activations - int(stage.stored),
        device_peak_bytes=peak,
        device_capacity_bytes=device.memory_bytes,
        device_usable_bytes=usable,
        host_bytes=int(stage.host_bytes),
        host_budget_bytes=ctx.host_budget,
        step_time_s=step_s,
        tokens_per_s=sequences * seq_length / step_s,
        mfu=model_flops / (step_s * layout.world_size * device.peak_tflops * 1e12),
        compute_s=slots * time.compute_s,
        exposed_comm_s=slots * time.comm_s + dp_s,
        exposed_host_copy_s=slots * time.copy_s,
        grad_sync_s=dp_s,
        layer_forward_s=ctx.plain.forward_s,
        recompute_flops=float(stage.recompute_flops * batch.num_microbatches),
        fits_device=fits_device,
        fits_host=stage.fits_host,
        notes=notes,
        reserved_bytes=None if replay is None else states + replay.reserved_peak_bytes,
        fragmentation_bytes=None if replay is None else replay.fragmentation_bytes,
        allocator_retries=None if replay is None else retries,
        allocator_retry_s=0.0 if replay is None else retry_s,
        host_copy_gbps=host_copy_gbps(device, layout),
    )
