"""Activation memory and recompute cost of one process, per method, at any scale, on a laptop.

Compares no recomputation (``none``), megatron-core's full and selective recomputation
(``full``, ``selective``) and MEMO at α = 0, 0.5, 1 (``memo-0``, ``memo-0.5``, ``memo-1``) for one
training iteration of one process (TP rank 0, CP rank 0, first pipeline stage), without
allocating any of that memory: the layers run on fake tensors (``FakeTensorMode``) and a fake
process group gives them the tensor-parallel shapes. Example, the paper's 7B model at 1M tokens::

    python -m tools.memory_report --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 \\
        --num-attention-heads 32 --seq-length 1048576 --tensor-model-parallel-size 8 \\
        --sequence-parallel --bf16 --json

How the figures are made: one transformer layer is traced per method, inside a megatron-core
``TransformerBlock`` built with the method's settings, and multiplied by the layers of the stage.
``device_activation_bytes`` is what autograd still holds on the device after the forward (unique
storages of saved tensors, parameters excluded; for MEMO, the kept last layers plus the tensors
MEMO keeps on the device, plus two layers of ping-pong copy sources, the most that can be in
flight); ``host_bytes`` is what MEMO holds in host memory; ``recompute_flops`` is the backward's
FLOPs (torch's ``FlopCounterMode``) minus those of the backward without recomputation. Only the
transformer layers are counted: embedding, loss and logits are the same for every method. With
``--json`` the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

METHODS = ("none", "full", "selective", "memo-0", "memo-0.5", "memo-1")


@dataclass
class LayerFigures:
    """One traced layer under one method, for one micro-batch."""

    saved_bytes: int
    """Device bytes autograd holds for the layer after its forward."""
    host_bytes: int
    """Bytes the layer keeps in host memory (MEMO)."""
    backward_flops: int
    """FLOPs of the layer's backward, recomputation included."""
    source_bytes: int = 0
    """MEMO: device bytes of the layer's copy sources (a ping-pong slot)."""


@dataclass
class MethodFigures:
    """A method's figures for one iteration of one process (the keys of ``--json``)."""

    device_activation_bytes: int
    host_bytes: int
    recompute_flops: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Activation memory and recompute FLOPs per method (fake tensors).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="4h if unset.")
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--kv-channels", type=int, default=None)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-micro-batches", type=int, default=1, help="Per iteration and process.")
    p.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--memo-keep-last-layers", type=int, default=2)
    p.add_argument("--json", action="store_true", help="End with one JSON line of the figures.")
    return p


def transformer_config(args: argparse.Namespace, **overrides):
    """megatron-core config of the model, as ``pretrain_gpt_memo.py`` would build it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from memo_ext.mcore.specs import LOCAL_KERNEL_SETTINGS

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        **LOCAL_KERNEL_SETTINGS,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


@contextlib.contextmanager
def fake_world(args: argparse.Namespace) -> Iterator[None]:
    """Megatron's parallel state on torch's fake process group (rank 0 of TP × CP × PP)."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memo_ext.mcore.compat import cpu_compat, seed_cpu_rng_tracker

    tp, cp, pp = (
        args.tensor_model_parallel_size,
        args.context_parallel_size,
        args.pipeline_model_parallel_size,
    )
    dist.init_process_group("fake", rank=0, world_size=tp * cp * pp, store=FakeStore())
    try:
        with cpu_compat():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                context_parallel_size=cp,
                create_gloo_process_groups=False,
            )
            seed_cpu_rng_tracker(seed=0, tp_rank=0)
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _block(config, *, memo_alpha: float | None):
    """A one-layer megatron-core ``TransformerBlock`` of the method (MEMO: offloaded layer)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    from memo_ext.mcore.specs import build_layer_spec
    from memo_ext.offload.config import MemoConfig
    from memo_ext.offload.policy import apply_memo

    spec = build_layer_spec(config=config, attention_backend="sdpa")
    if memo_alpha is not None:
        # a huge budget: the report states what is needed, it does not enforce a machine's limit
        memo = MemoConfig(enabled=True, alpha=memo_alpha, keep_last_layers=0, host_memory_gb=2**40)
        spec = apply_memo(spec, memo, config)
    submodules = TransformerBlockSubmodules(layer_specs=[spec], layer_norm=None)
    return TransformerBlock(config, submodules, post_process=False)


def trace_layer(args: argparse.Namespace, method: str) -> LayerFigures:
    """Forward and backward of one layer of ``method`` on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.mcore.flop_count import flop_counter_mode
    from memo_ext.offload.policy import memo_runtime_of, memo_step_metrics

    overrides, alpha = {}, None
    if method == "full":
        overrides = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif method == "selective":
        overrides = dict(recompute_granularity="selective")
    elif method.startswith("memo-"):
        alpha = float(method.split("-", 1)[1])
    config = transformer_config(args, **overrides)
    with _frozen_rng(), FakeTensorMode(allow_non_fake_inputs=True):
        block = _block(config, memo_alpha=alpha)
        x, rope = _layer_inputs(args, config)
        # parameters, and the RoPE table (one tensor shared by every layer), are not activations
        params = {p.untyped_storage()._cdata for p in block.parameters()}
        if rope is not None:
            params.add(rope.untyped_storage()._cdata)
        saved: dict[int, int] = {}

        def count(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = t.untyped_storage().nbytes()
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            out = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        runtime = memo_runtime_of(block)
        source_bytes = 0
        held = sum(saved.values())
        if runtime is not None:  # MEMO's own hook shadows the counter: its ledger says what stays
            held = sum(acts.device_bytes() for acts in runtime.live)
            source_bytes = runtime.slot_bytes
        with flop_counter_mode() as counter:
            out.backward(torch.ones_like(out))
        host = memo_step_metrics(block).get("host_offload_bytes", 0)
    return LayerFigures(
        saved_bytes=held,
        host_bytes=host,
        backward_flops=counter.get_total_flops(),
        source_bytes=source_bytes,
    )


@contextlib.contextmanager
def _frozen_rng() -> Iterator[None]:
    """Random-state saving and forking made no-ops while tracing.

    Under fake tensors a saved generator state is fake too and cannot be restored; the traced
    layers draw no random numbers (dropout 0), so megatron's tracker forks and the checkpoint's
    state save / restore have nothing to do.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class _NoForkTracker:
        def fork(self, name: str = ""):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

        def is_initialized(self):
            return True

    state = torch.get_rng_state()
    saved = (torch.get_rng_state, torch.set_rng_state, mrandom._CUDA_RNG_STATE_TRACKER)
    torch.get_rng_state = lambda: state
    torch.set_rng_state = lambda new_state: None
    mrandom._CUDA_RNG_STATE_TRACKER = _NoForkTracker()
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state, mrandom._CUDA_RNG_STATE_TRACKER = saved


def _layer_inputs(args: argparse.Namespace, config):
    """This rank's layer input ``[s / cp (/ tp under SP), b, h]`` and its RoPE table."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    tokens = args.seq_length // args.context_parallel_size
    local = tokens // args.tensor_model_parallel_size if args.sequence_parallel else tokens
    x = torch.randn(local, args.micro_batch_size, args.hidden_size, dtype=config.params_dtype)
    x.requires_grad_(True)
    rope = None
    if args.position_embedding_type == "rope":
        rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(args.seq_length)
    return x, rope


def method_figures(
    args: argparse.Namespace, layer: dict[str, LayerFigures]
) -> dict[str, MethodFigures]:
    """Scale the traced layers to the stage, the micro-batches in flight and the iteration."""
    stage_layers = args.num_layers // args.pipeline_model_parallel_size
    in_flight = min(args.pipeline_model_parallel_size, args.num_micro_batches)
    micro_batches = args.num_micro_batches
    base = layer["none"].backward_flops
    out = {}
    for method, fig in layer.items():
        recompute = (fig.backward_flops - base) * micro_batches
        if method.startswith("memo-"):
            kept = min(args.memo_keep_last_layers, stage_layers)
            offloaded = stage_layers - kept
            pingpong = min(2, offloaded) * fig.source_bytes
            device = in_flight * (kept * layer["none"].saved_bytes + offloaded * fig.saved_bytes)
            out[method] = MethodFigures(
                device_activation_bytes=device + pingpong,
                host_bytes=in_flight * offloaded * fig.host_bytes,
                recompute_flops=offloaded * recompute,
            )
        else:
            out[method] = MethodFigures(
                device_activation_bytes=in_flight * stage_layers * fig.saved_bytes,
                host_bytes=0,
                recompute_flops=stage_layers * recompute,
            )
    return out


def format_table(figures: dict[str, MethodFigures]) -> str:
    gib = 2**30
    lines = [f"{'method':<10} {'device GiB':>12} {'host GiB':>12} {'recompute TFLOP':>16}"]
    for method, fig in figures.items():
        lines.append(
            f"{method:<10} {fig.device_activation_bytes / gib:>12.2f} "
            f"{fig.host_bytes / gib:>12.2f} {fig.recompute_flops / 1e12:>16.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context_parallel_size > 1:
        # SDPAttention's CP path builds torch's CausalBias, a tensor subclass FakeTensorMode
        # cannot wrap; trace the same tokens per rank with TP / SP instead
        parser.error("--context-parallel-size > 1 cannot be traced on fake tensors yet")
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with fake_world(args):
        layers = {method: trace_layer(args, method) for method in METHODS}
    figures = method_figures(args, layers)
    print(
        f"per process, per iteration: {args.num_layers} layers / PP "
        f"{args.pipeline_model_parallel_size}, TP {args.tensor_model_parallel_size}"
        f"{' + SP' if args.sequence_parallel else ''}, CP {args.context_parallel_size}, "
        f"{args.seq_length} tokens × {args.micro_batch_size} sequence(s), "
        f"MEMO keeps the last {args.memo_keep_last_layers} layers (one layer traced per method)"
    )
    print(format_table(figures))
    if args.json:
        print(json.dumps({"methods": {m: asdict(f) for m, f in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
