"""Memory, time and MFU of one training configuration, from measured per-layer figures.

``estimate(...)`` combines the fake-tensor measurements of ``memo_ext.estimate.measure`` with
model states, the parallel layout, link bandwidths and achieved kernel efficiencies. Everything
is per process on the busiest pipeline stage; one step is one global batch.

Device memory at its peak is the model states plus the activations stored when the forward ends
plus the larger of two transients measured on the same layer: the output end (norm, output layer
and megatron's vocab-parallel loss) and one layer's forward + backward working set. Under MEMO
the backward of an offloaded layer also holds that layer's restored set and the next one's
prefetched set. A headroom fraction of the device is kept free for the allocator and the CUDA
context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memo_ext.estimate.measure import LayerFigures, layer_fit, transient_fit
from memo_ext.estimate.presets import DeviceSpec, ModelShape, transformer_config

METHODS = ("none", "full", "selective", "memo")

# Achieved fraction of the dense peak per op class. Large bf16 GEMMs (h >= 4096) reach about
# 75% of peak on A100 / H100 in cuBLAS; causal FlashAttention-2 forward + backward at head dim 128
# reaches about 60% of an A100's peak (~190 TFLOP/s in the FlashAttention-2 paper's benchmark).
DEFAULT_MATMUL_EFFICIENCY = 0.75
DEFAULT_ATTENTION_EFFICIENCY = 0.60
# Device memory kept free: CUDA context, NCCL buffers and allocator fragmentation (the paper saw
# 7.8 GB of 73.5 reserved at 7B / 512K with PyTorch's caching allocator; MEMO's planner removes
# most of it). One fraction for every method so that comparisons stay fair.
DEFAULT_HEADROOM = 0.06
# Share of the node's host memory MEMO may use, split equally between the node's processes: the
# trainer's default for --memo-host-memory-gb (memo_ext.offload.config.DEFAULT_HOST_SHARE).
DEFAULT_HOST_SHARE = 0.8
CAUSAL_FRACTION = 0.5
"""A causal kernel computes half of the ``s × s`` products the counter sees."""


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split (megatron-core's vocabulary)."""

    tp: int = 1
    """Tensor parallelism (within a node)."""
    cp: int = 1
    """Context parallelism: each sequence cut over ``cp`` ranks (2·cp load-balanced chunks)."""
    pp: int = 1
    """Pipeline stages (1F1B)."""
    dp: int = 1
    """Data parallelism: the rest of the GPUs."""
    sp: bool = False
    """Sequence parallelism over the TP ranks (only with ``tp > 1``)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    num_microbatches: int = 1
    """Micro-batches per step and data-parallel rank."""
    distributed_optimizer: bool = True
    """Shard the 12 optimizer bytes per parameter over DP (megatron's distributed optimizer)."""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the hardware's peaks (see the defaults' comments)."""

    matmul: float = DEFAULT_MATMUL_EFFICIENCY
    """Non-attention FLOPs (matrix products; element-wise ops are counted as free)."""
    attention: float = DEFAULT_ATTENTION_EFFICIENCY
    """Attention FLOPs (causal, flash-style kernel)."""
    headroom: float = DEFAULT_HEADROOM
    """Fraction of device memory kept free."""
    host_share: float = DEFAULT_HOST_SHARE
    """Fraction of host memory MEMO may use."""
    attention_fraction: float = 1.0
    """Share of a row's causal ``s × s`` attention products really computed: 1 for one
    sequence per row; ``Σ len_i² / s²`` for packed documents that attend only to themselves."""
    loss_chunks: int = 1
    """Sequence slices the output layer and loss run in (the trainer's ``--loss-chunks``): 1 is
    megatron's vocab-parallel cross entropy on the whole sequence; ``k`` divides that end's
    working set by ``k``."""


@dataclass(frozen=True)
class MemoSettings:
    """MEMO's knobs for the estimate."""

    alpha: float | None = None
    """Fraction of token-wise activations kept in host memory; ``None`` = the α rule."""
    keep_last_layers: int = 2
    """Last layers of each stage that keep their activations on the device."""


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

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def to_json(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        return out


def layer_figures(model: ModelShape, layout: Layout, *, tokens: int, method: str) -> LayerFigures:
    """Measured figures of one layer at ``tokens`` tokens per sequence on this process."""
    fit = layer_fit(
        model, tp=layout.tp, sp=layout.sp, micro_batch_size=layout.micro_batch_size, method=method
    )
    return fit.at(tokens)


def params_per_gpu(model: ModelShape, layout: Layout, layer: LayerFigures, seq_length: int) -> int:
    """Parameters on the busiest stage: its layers plus one end (embedding or output layer,
    TP-sharded; tied when PP is 1) and the final norm."""
    padded = -(-model.vocab_size // (128 * layout.tp)) * 128 * layout.tp
    ends = padded // layout.tp * model.hidden_size + 2 * model.hidden_size
    if model.position_embedding_type == "learned_absolute":
        ends += seq_length * model.hidden_size
    return model.num_layers // layout.pp * layer.param_count + ends


def model_state_bytes(params: int, layout: Layout) -> int:
    """bf16 weights (2) + fp32 main grads (4) + fp32 master weights and Adam moments (12)."""
    optimizer = 12 * params / (layout.dp if layout.distributed_optimizer else 1)
    return int(6 * params + optimizer)


@dataclass(frozen=True)
class _Memo:
    """MEMO's per-layer figures at one α."""

    alpha: float
    host_bytes: int
    slot_bytes: int
    backward: LayerFigures


def memo_at(model: ModelShape, layout: Layout, *, tokens: int, alpha: float) -> _Memo:
    """MEMO at α, interpolated between the α = 0 and α = 1 traces (host bytes and recompute
    FLOPs are linear in α; a ping-pong slot pins whole storages as soon as α > 0)."""
    zero = layer_figures(model, layout, tokens=tokens, method="memo-0")
    one = layer_figures(model, layout, tokens=tokens, method="memo-1")
    mix = lambda a, b: round(a + alpha * (b - a))  # noqa: E731
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
    )


def _links(device: DeviceSpec, layout: Layout) -> tuple[float, float, float]:
    """Bandwidths (GB/s) of the TP, CP and DP groups: NVLink while a group fits in a node."""
    inside = lambda ranks: (
        device.nvlink_gbps if ranks <= device.gpus_per_node else device.internode_gbps
    )  # noqa: E731,E501
    return inside(layout.tp), inside(layout.tp * layout.cp), inside(layout.gpus)


def tp_comm_bytes(model: ModelShape, layout: Layout, *, tokens: int) -> float:
    """Bytes one rank sends per layer forward for TP: two all-gathers and two reduce-scatters of
    ``[s/cp, b, h]`` bf16 with SP (or two all-reduces, the same volume, without)."""
    if layout.tp == 1:
        return 0.0
    full = tokens * layout.micro_batch_size * model.hidden_size * 2
    return 4 * full * (layout.tp - 1) / layout.tp


def cp_comm_bytes(model: ModelShape, layout: Layout, *, tokens: int) -> float:
    """Bytes one rank sends per layer forward for CP: its k and v chunk to each other rank."""
    if layout.cp == 1:
        return 0.0
    groups = model.num_query_groups or model.num_attention_heads
    d = model.hidden_size // model.num_attention_heads
    kv = 2 * tokens * layout.micro_batch_size * groups // layout.tp * d * 2
    return kv * (layout.cp - 1)


class EstimateError(ValueError):
    """A configuration the estimator (and the trainer) cannot run; one sentence."""


def check_layout(model: ModelShape, layout: Layout, *, seq_length: int) -> None:
    """Refuses layouts megatron-core would refuse, with the flag to change.

    Raises:
        EstimateError: naming the offending flag.
    """
    groups = model.num_query_groups or model.num_attention_heads
    for flag, value in (
        ("--tensor-model-parallel-size", layout.tp),
        ("--context-parallel-size", layout.cp),
        ("--pipeline-model-parallel-size", layout.pp),
        ("--micro-batch-size", layout.micro_batch_size),
        ("--seq-length", seq_length),
    ):
        if value < 1:
            raise EstimateError(f"{flag} must be a positive integer, got {value}")
    if model.num_attention_heads % layout.tp or groups % layout.tp:
        raise EstimateError(
            f"--tensor-model-parallel-size {layout.tp} must divide the {model.num_attention_heads}"
            f" attention heads and {groups} query groups"
        )
    if model.num_layers % layout.pp:
        raise EstimateError(
            f"--pipeline-model-parallel-size {layout.pp} must divide the {model.num_layers} layers"
        )
    chunk = 2 * layout.cp if layout.cp > 1 else 1
    sp_split = layout.tp if layout.sp else 1
    if seq_length % (chunk * sp_split):
        raise EstimateError(
            f"--seq-length {seq_length} must be divisible by {chunk * sp_split} (2·CP chunks, "
            "each split over TP under sequence parallelism)"
        )


def _seconds(flops_matmul, flops_attention, *, device, eff, cp) -> tuple[float, float]:
    """(matmul seconds, attention seconds) of counted FLOPs on this process."""
    peak = device.peak_tflops * 1e12
    # counted attention products are full s_q x s_k on the local s/cp tokens; under CP each local
    # query attends to cp times more keys (load-balanced), and a causal kernel does half
    attention = flops_attention * cp * CAUSAL_FRACTION * eff.attention_fraction
    return flops_matmul / (peak * eff.matmul), attention / (peak * eff.attention)


@dataclass
class _LayerTime:
    compute_s: float = 0.0
    comm_s: float = 0.0
    copy_s: float = 0.0
    forward_s: float = 0.0

    def add(self, other: _LayerTime, times: int = 1) -> None:
        self.compute_s += times * other.compute_s
        self.comm_s += times * other.comm_s
        self.copy_s += times * other.copy_s


def _layer_time(fig: LayerFigures, *, model, layout, device, eff, tokens, method, copy_bytes=0):
    """One layer's forward + backward for one micro-batch: compute, exposed comm and copies."""
    tp_link, cp_link, _ = _links(device, layout)
    f_mm, f_att = _seconds(
        fig.forward_matmul_flops, fig.forward_attention_flops, device=device, eff=eff, cp=layout.cp
    )
    b_mm, b_att = _seconds(
        fig.backward_matmul_flops,
        fig.backward_attention_flops,
        device=device,
        eff=eff,
        cp=layout.cp,
    )
    tp_s = tp_comm_bytes(model, layout, tokens=tokens) / (tp_link * 1e9)
    cp_s = cp_comm_bytes(model, layout, tokens=tokens) / (cp_link * 1e9)
    forward_passes = 2 if method == "full" else 1  # full recompute re-runs the forward's comm
    # TP collectives sit on the critical path (no comm overlap); ring attention's k / v passes
    # overlap the attention kernels, only the excess shows. Backward moves k, v and their grads.
    comm = forward_passes * max(0.0, cp_s - f_att) + max(
        0.0, 2 * cp_s - (b_att - (forward_passes - 1) * f_att)
    )
    comm += (forward_passes + 1) * tp_s
    forward_s = f_mm + f_att + tp_s + max(0.0, cp_s - f_att)
    copy = copy_bytes / (device.host_link_gbps * 1e9)
    # MEMO copies the layer's data out during its forward and back during the next backward
    exposed_copy = max(0.0, copy - forward_s) + max(0.0, copy - (b_mm + b_att))
    return _LayerTime(
        compute_s=f_mm + f_att + b_mm + b_att, comm_s=comm, copy_s=exposed_copy, forward_s=forward_s
    )


def solve_memo_alpha(
    *,
    zero: _Memo,
    one: _Memo,
    forward_s: float,
    device: DeviceSpec,
    host_budget_bytes: int,
    resident_layers: int,
) -> float:
    """MEMO's α rule (``memo_ext.offload.alpha.solve_alpha``) on estimated figures.

    Raises:
        HostMemoryError: when even α = 0 does not fit the host budget.
    """
    from memo_ext.offload.alpha import LayerCost, solve_alpha

    cost = LayerCost(
        full_bytes=zero.host_bytes,
        tokenwise_bytes=one.host_bytes - zero.host_bytes,
        forward_s=forward_s,
        copy_gbps=device.host_link_gbps,
    )
    return solve_alpha(cost, budget_bytes=host_budget_bytes, resident_layers=resident_layers)


def estimate(
    *,
    model: ModelShape,
    device: DeviceSpec,
    layout: Layout,
    method: str,
    seq_length: int,
    host_memory_bytes: int,
    memo: MemoSettings = MemoSettings(),
    efficiency: Efficiency = Efficiency(),
) -> Estimate:
    """Memory, time and MFU of one configuration (see the module docstring).

    Args:
        model: model shape.
        device: accelerator and links.
        layout: parallel layout and batch.
        method: ``none``, ``full``, ``selective`` (Megatron) or ``memo``.
        seq_length: tokens per sequence.
        host_memory_bytes: host memory per node.
        memo: MEMO's α (``None`` for the rule) and kept layers.
        efficiency: achieved kernel efficiencies, headroom and host share.

    Raises:
        EstimateError: for a layout or method that cannot run.
    """
    from memo_ext.offload.transfer import HostMemoryError

    if method not in METHODS:
        raise EstimateError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    check_layout(model, layout, seq_length=seq_length)
    eff, tokens = efficiency, seq_length // layout.cp
    stage_layers = model.num_layers // layout.pp
    in_flight = min(layout.pp, layout.num_microbatches)
    none = layer_figures(model, layout, tokens=tokens, method="none")
    transient = transient_fit(
        model, tp=layout.tp, sp=layout.sp, micro_batch_size=layout.micro_batch_size
    )
    layer_t = transient.layer_per_token * tokens
    loss_t = transient.loss_per_token * tokens / eff.loss_chunks
    params = params_per_gpu(model, layout, none, seq_length)
    states = model_state_bytes(params, layout)
    procs_per_node = min(layout.gpus, device.gpus_per_node)
    host_budget = int(host_memory_bytes * eff.host_share / procs_per_node)
    timing = dict(model=model, layout=layout, device=device, eff=eff, tokens=tokens)
    plain_time = _layer_time(none, method="none", **timing)
    notes: list[str] = []
    alpha = keep = None
    host = 0
    fits_host = True
    stage = _LayerTime()
    if method == "memo":
        keep = min(memo.keep_last_layers, stage_layers)
        offloaded = stage_layers - keep
        resident = in_flight * offloaded
        zero = memo_at(model, layout, tokens=tokens, alpha=0.0)
        one = memo_at(model, layout, tokens=tokens, alpha=1.0)
        alpha = memo.alpha
        if alpha is None:
            try:
                alpha = solve_memo_alpha(
                    zero=zero, one=one, forward_s=plain_time.forward_s, device=device,
                    host_budget_bytes=host_budget, resident_layers=resident,
                )  # fmt: skip
            except HostMemoryError as err:
                alpha, fits_host = 0.0, False
                notes.append(str(err))
        m = memo_at(model, layout, tokens=tokens, alpha=alpha)
        host = resident * m.host_bytes
        fits_host = fits_host and host <= host_budget
        stored = (
            in_flight * keep * none.saved_bytes
            + resident * m.backward.saved_bytes
            + min(2, resident) * m.slot_bytes
        )
        # backward of an offloaded layer: its restored set plus the next one's prefetched set
        restored = (2 * none.saved_bytes if offloaded else 0) + (
            in_flight - 1
        ) * keep * none.saved_bytes
        peak_activations = max(stored + loss_t, stored + layer_t, restored + layer_t)
        stage.add(
            _layer_time(m.backward, method="memo", copy_bytes=m.host_bytes, **timing), offloaded
        )
        stage.add(plain_time, keep)
        recompute = offloaded * (
            m.backward.backward_matmul_flops + m.backward.backward_attention_flops
            - none.backward_matmul_flops - none.backward_attention_flops
        )  # fmt: skip
    else:
        fig = layer_figures(model, layout, tokens=tokens, method=method)
        stored = in_flight * stage_layers * fig.saved_bytes
        # full recompute: the layer being recomputed holds its whole saved set again
        again = none.saved_bytes if method == "full" else 0
        peak_activations = max(stored + loss_t, stored + again + layer_t)
        stage.add(_layer_time(fig, method=method, **timing), stage_layers)
        recompute = stage_layers * (
            fig.backward_matmul_flops + fig.backward_attention_flops
            - none.backward_matmul_flops - none.backward_attention_flops
        )  # fmt: skip
    peak_activations = int(peak_activations)
    transient_bytes = peak_activations - int(stored)
    # output layer and loss: 2·tokens·h·vocab/tp forward, twice that backward
    padded = -(-model.vocab_size // (128 * layout.tp)) * 128 * layout.tp
    ends_flops = 6 * tokens * layout.micro_batch_size * model.hidden_size * padded // layout.tp
    stage.compute_s += _seconds(ends_flops, 0, device=device, eff=eff, cp=1)[0]
    stage_s = stage.compute_s + stage.comm_s + stage.copy_s
    slots = layout.num_microbatches + layout.pp - 1  # 1F1B: the pipeline fills and drains
    _, _, dp_link = _links(device, layout)
    # gradients are all-reduced over DP × CP (CP ranks hold the same weights), in fp32
    replicas = layout.dp * layout.cp
    dp_s = 2 * (replicas - 1) / replicas * 4 * params / (dp_link * 1e9)
    step_s = slots * stage_s + dp_s
    sequences = layout.micro_batch_size * layout.num_microbatches * layout.dp
    model_flops = _model_flops(model, seq_length=seq_length, sequences=sequences)
    usable = int(device.memory_bytes * (1 - eff.headroom))
    peak = states + peak_activations
    if layout.cp > 1:
        notes.append("context parallelism modelled as ring attention (local k / v saved)")
    return Estimate(
        model=model.name,
        method=method,
        gpu=device.name,
        seq_length=seq_length,
        layout=asdict(layout),
        alpha=alpha,
        keep_last_layers=keep,
        params_per_gpu=params,
        model_state_bytes=states,
        activation_bytes=int(stored),
        transient_bytes=transient_bytes,
        device_peak_bytes=peak,
        device_capacity_bytes=device.memory_bytes,
        device_usable_bytes=usable,
        host_bytes=int(host),
        host_budget_bytes=host_budget,
        step_time_s=step_s,
        tokens_per_s=sequences * seq_length / step_s,
        mfu=model_flops / (step_s * layout.gpus * device.peak_tflops * 1e12),
        compute_s=slots * stage.compute_s,
        exposed_comm_s=slots * stage.comm_s + dp_s,
        exposed_host_copy_s=slots * stage.copy_s,
        grad_sync_s=dp_s,
        layer_forward_s=plain_time.forward_s,
        recompute_flops=float(recompute * layout.num_microbatches),
        fits_device=peak <= usable,
        fits_host=fits_host,
        notes=notes,
    )


def _model_flops(model: ModelShape, *, seq_length: int, sequences: int) -> float:
    """Forward + backward model FLOPs, as the trainer's MFU counts them (causal half)."""
    from memo_ext.training.metrics import gpt_train_flops

    config = _flops_config(model)
    return gpt_train_flops(
        config=config, vocab_size=model.vocab_size, seq_length=seq_length, sequences=sequences
    )


_FLOPS_CONFIGS: dict[ModelShape, object] = {}


def _flops_config(model: ModelShape):
    if model not in _FLOPS_CONFIGS:
        _FLOPS_CONFIGS[model] = transformer_config(model)
    return _FLOPS_CONFIGS[model]
