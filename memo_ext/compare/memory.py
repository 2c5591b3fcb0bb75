"""Activation memory and recompute cost of one process, per method, from one traced layer.

Each method's layer is traced once on fake tensors (``memo_ext.estimate.measure``) and scaled to
the pipeline stage, the micro-batches in flight and the iteration: what ``memo-memory-report``
prints and what the comparison harness sets beside each measured run. The command's
documentation (``memo_ext.commands.memory_report``) says how each figure is made.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from memo_ext.config import DataConfig, MemoConfig, TrainConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.fits import LayerFigures
from memo_ext.flags import flag_values
from memo_ext.memo.alpha import slots_after_forward
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

ROWS = ("none", "full", "selective", "memo-0", "memo-0.5", "memo-1")
"""The report's rows: traced methods (``memo_ext.estimate.fits``), MEMO at three α."""
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
        for method in ROWS + CHUNKED
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
