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
import json
import logging
import os
import sys
import warnings
from dataclasses import asdict, dataclass

from memo_ext.estimate.measure import LayerFigures, trace_layer
from memo_ext.estimate.presets import ModelShape

METHODS = ("none", "full", "selective", "memo-0", "memo-0.5", "memo-1")


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


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The traced model's shape from the flags (the vocabulary does not enter a layer)."""
    return ModelShape(
        name="custom",
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        vocab_size=0,
        num_query_groups=args.num_query_groups,
        swiglu=args.swiglu,
        normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        position_embedding_type=args.position_embedding_type,
    )


def trace_methods(args: argparse.Namespace) -> dict[str, LayerFigures]:
    """One layer of each method on fake tensors (``memo_ext.estimate.measure``)."""
    model = model_shape(args)
    return {
        method: trace_layer(
            model,
            tp=args.tensor_model_parallel_size,
            sp=args.sequence_parallel,
            tokens=args.seq_length // args.context_parallel_size,
            micro_batch_size=args.micro_batch_size,
            method=method,
            fp32=not (args.bf16 or args.fp16),
        )
        for method in METHODS
    }


def method_figures(
    args: argparse.Namespace, layer: dict[str, LayerFigures]
) -> dict[str, MethodFigures]:
    """Scale the traced layers to the stage, the micro-batches in flight and the iteration."""
    stage_layers = args.num_layers // args.pipeline_model_parallel_size
    in_flight = min(args.pipeline_model_parallel_size, args.num_micro_batches)
    micro_batches = args.num_micro_batches
    base = _backward_flops(layer["none"])
    out = {}
    for method, fig in layer.items():
        recompute = (_backward_flops(fig) - base) * micro_batches
        if method.startswith("memo-"):
            kept = min(args.memo_keep_last_layers, stage_layers)
            offloaded = stage_layers - kept
            pingpong = min(2, offloaded) * fig.slot_bytes
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


def _backward_flops(fig: LayerFigures) -> int:
    return fig.backward_matmul_flops + fig.backward_attention_flops


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
    figures = method_figures(args, trace_methods(args))
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
