"""Activation memory and recompute cost of one process, per method, at any scale, on a laptop.

Compares no recomputation (``none``), megatron-core's full and selective recomputation (``full``,
``selective``), MEMO at α = 0, 0.5, 1 (``memo-0``, ``memo-0.5``, ``memo-1``) and MEMO by
sub-sequence chunks (``--memo-chunk-tokens``, default 4096 local tokens) at α = 0 and 1
(``memo-chunked-0``, ``memo-chunked-1``) for one training iteration of one process (TP rank 0, CP
rank 0, first pipeline stage), without allocating any of that memory: the layers run on fake
tensors (``FakeTensorMode``) and a fake process group gives them the tensor-parallel shapes.
Example, the paper's 7B model at 1M tokens::

    python -m tools.memory_report --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 \\
        --num-attention-heads 32 --seq-length 1048576 --tensor-model-parallel-size 8 \\
        --sequence-parallel --bf16 --json

How the figures are made: one transformer layer is traced per method, inside a megatron-core
``TransformerBlock`` built with the method's settings, and multiplied by the layers of the stage.
``device_activation_bytes`` is what autograd still holds on the device after the forward (unique
storages of saved tensors, parameters excluded; for MEMO, the kept last layers plus the tensors
MEMO keeps on the device, plus the ping-pong copy sources still in flight when the forward ends:
two layers' with no kept layer, one with one, none with two or more, which take the slots' place;
chunked MEMO: the kept layers, by default none, plus the copies in flight, a few chunks' and one
layer's whole storages); ``host_bytes`` is what MEMO holds in host memory; ``recompute_flops`` is
the backward's FLOPs (torch's ``FlopCounterMode``) minus those of the backward without
recomputation. Only the transformer layers are counted: embedding, loss and logits are the same for
every method. With ``--json`` the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from dataclasses import asdict, dataclass

from memo_ext.arguments import OneSentenceParser, parse_tool_args
from memo_ext.config import DataConfig, MemoConfig, TrainConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.fits import LayerFigures
from memo_ext.flags import FlagHelpFormatter, add_flags, flag_values
from memo_ext.memo.alpha import slots_after_forward
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

METHODS = ("none", "full", "selective", "memo-0", "memo-0.5", "memo-1")
CHUNKED = ("memo-chunked-0", "memo-chunked-1")
DEFAULT_CHUNK_TOKENS = 4096
"""Chunk of the ``memo-chunked`` rows without ``--memo-chunk-tokens`` (local tokens)."""

# the trainer's flags this report takes: (namespace, dataclass, only these fields, optional)
SECTIONS = (
    ("shape", ModelShape, None, False),
    ("data", DataConfig, ("seq_length",), False),
    ("train", TrainConfig, ("micro_batch_size", "bf16", "fp16"), True),
    ("layout", ParallelLayout, ("tp", "sp", "cp", "pp"), False),
    ("memo", MemoConfig, ("keep_last_layers", "chunk_tokens"), False),
)


@dataclass
class MethodFigures:
    """A method's figures for one iteration of one process (the keys of ``--json``)."""

    device_activation_bytes: int
    host_bytes: int
    recompute_flops: int


def build_parser() -> argparse.ArgumentParser:
    p = OneSentenceParser(
        description="Activation memory and recompute FLOPs per method (fake tensors).",
        formatter_class=FlagHelpFormatter,
        allow_abbrev=False,
    )
    for section, cls, only, optional in SECTIONS:
        add_flags(p, cls, section=section, only=only, overrides=optional)
    p.add_argument("--num-micro-batches", type=int, default=1, help="Per iteration and process.")
    p.add_argument("--json", action="store_true", help="End with one JSON line of the figures.")
    return p


@dataclass(frozen=True)
class Setup:
    """What the report traces and scales: one process of one iteration."""

    shape: ModelShape
    layout: ParallelLayout
    seq_length: int
    micro_batch_size: int
    micro_batches: int
    fp32: bool
    keep_last_layers: int | None
    """``None``: 2 for whole-layer MEMO, 0 for chunked (the trainer's defaults)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def check(self) -> None:
        """Raises UsageError for a shape or layout megatron-core cannot build."""
        self.shape.check()
        self.layout.check_fits(self.shape, self.seq_length)
        for flag, value in (
            ("--micro-batch-size", self.micro_batch_size),
            ("--num-micro-batches", self.micro_batches),
        ):
            if value < 1:
                raise UsageError(f"{flag} must be positive, got {value}")
        if self.keep_last_layers is not None and self.keep_last_layers < 0:
            raise UsageError(f"--memo-keep-last-layers must be >= 0, got {self.keep_last_layers}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise UsageError(
                f"--memo-chunk-tokens must be a positive token count here, got {self.chunk_tokens}"
            )

    def kept_layers(self, method: str) -> int:
        """Kept last layers of ``method``'s rows, capped at the stage's layers."""
        keep = self.keep_last_layers
        if keep is None:
            keep = 0 if method.startswith("memo-chunked") else 2
        return min(keep, self.shape.num_layers // self.layout.pp)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Setup:
        values = {
            section: flag_values(dataclass_, args, section=section, only=only)
            for section, dataclass_, only, _ in SECTIONS
        }
        train = values["train"]
        return cls(
            shape=ModelShape(**values["shape"]),
            layout=ParallelLayout(**values["layout"]),
            seq_length=values["data"]["seq_length"],
            micro_batch_size=train["micro_batch_size"] or 1,
            micro_batches=args.num_micro_batches,
            fp32=not (train["bf16"] or train["fp16"]),
            keep_last_layers=values["memo"]["keep_last_layers"],
            chunk_tokens=values["memo"]["chunk_tokens"] or DEFAULT_CHUNK_TOKENS,
        )


def trace_methods(setup: Setup) -> dict[str, LayerFigures]:
    """One layer of each method on fake tensors (``memo_ext.estimate.measure``)."""
    from memo_ext.estimate.measure import trace_layer  # megatron-core: not for --help

    return {
        method: trace_layer(
            setup.shape,
            tp=setup.layout.tp,
            sp=setup.layout.sp,
            tokens=setup.seq_length // setup.layout.cp,
            micro_batch_size=setup.micro_batch_size,
            method=_traced(method, setup),
            fp32=setup.fp32,
        )
        for method in METHODS + CHUNKED
    }


def _traced(method: str, setup: Setup) -> str:
    """The traced method (``memo_ext.estimate.measure``) of a row."""
    if method.startswith("memo-chunked-"):
        return f"memo-{method.removeprefix('memo-chunked-')}@{setup.chunk_tokens}"
    return method


def method_figures(setup: Setup, layer: dict[str, LayerFigures]) -> dict[str, MethodFigures]:
    """Scale the traced layers to the stage, the micro-batches in flight and the iteration."""
    stage_layers = setup.shape.num_layers // setup.layout.pp
    in_flight = min(setup.layout.pp, setup.micro_batches)
    base = _backward_flops(layer["none"])
    out = {}
    for method, fig in layer.items():
        recompute = (_backward_flops(fig) - base) * setup.micro_batches
        if method.startswith("memo-"):
            kept = setup.kept_layers(method)
            offloaded = stage_layers - kept
            if method in CHUNKED:  # a few chunks in flight, whatever the layers
                pingpong = fig.slot_bytes if offloaded else 0
            else:
                pingpong = slots_after_forward(offloaded=offloaded, kept=kept) * fig.slot_bytes
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
    lines = [f"{'method':<15} {'device GiB':>12} {'host GiB':>12} {'recompute TFLOP':>16}"]
    for method, fig in figures.items():
        lines.append(
            f"{method:<15} {fig.device_activation_bytes / gib:>12.2f} "
            f"{fig.host_bytes / gib:>12.2f} {fig.recompute_flops / 1e12:>16.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_tool_args(parser, argv, tool="memory_report")
        setup = Setup.from_args(args)
        setup.check()
        if setup.layout.cp > 1:
            # SDPAttention's CP path builds torch's CausalBias, a tensor subclass FakeTensorMode
            # cannot wrap; trace the same tokens per rank with TP / SP instead
            raise UsageError("--context-parallel-size > 1 cannot be traced on fake tensors yet")
    except UsageError as err:
        print(f"memory_report: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    figures = method_figures(setup, trace_methods(setup))
    layout, shape = setup.layout, setup.shape
    print(
        f"per process, per iteration: {shape.num_layers} layers / PP {layout.pp}, TP "
        f"{layout.tp}{' + SP' if layout.sp else ''}, CP {layout.cp}, {setup.seq_length} tokens × "
        f"{setup.micro_batch_size} sequence(s), MEMO keeps the last {setup.kept_layers('memo-0')} "
        f"layers, chunked MEMO {setup.kept_layers('memo-chunked-0')} with chunks of "
        f"{setup.chunk_tokens} local tokens (one layer traced per method)"
    )
    print(format_table(figures))
    if args.json:
        print(json.dumps({"methods": {m: asdict(f) for m, f in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
