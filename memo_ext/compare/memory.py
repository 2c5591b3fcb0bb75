"""Activation memory and recompute cost of one process, per method, from one traced layer.

Each method's layer is traced once on fake tensors (``memo_ext.estimate.measure``) and scaled to
the pipeline stage, the micro-batches in flight and the iteration: what ``memo-memory-report``
prints and what the comparison harness sets beside each measured run. The command's
documentation (``memo_ext.commands.memory_report``) says how each figure is made.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from memo_ext.config import DataConfig, MemoConfig, TrainConfig
from memo_ext.errors import UsageError
from memo_ext.estimate.fits import LayerFigures
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.features.registry import METHODS
from memo_ext.flags import flag_values
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

PLAIN = "none"
"""The plain layer's row name: the layer every row is scaled against."""
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


@dataclass(frozen=True)
class Row:
    """One row of the report: a memory method's layer with the settings it is traced at."""

    name: str
    method: MemoryMethod
    settings: Any = None


def report_rows(setup: Setup) -> list[Row]:
    """Every registered method's rows (``MemoryMethod.report_rows``), in the registry's order."""
    return [
        Row(name, method, settings)
        for method in METHODS
        for name, settings in method.report_rows(chunk_tokens=setup.chunk_tokens)
    ]


def report_notes(setup: Setup) -> list[str]:
    """What the methods say of their rows in the report's header."""
    stage_layers = setup.shape.num_layers // setup.layout.pp
    notes = (
        method.report_note(
            stage_layers=stage_layers,
            keep_last_layers=setup.keep_last_layers,
            chunk_tokens=setup.chunk_tokens,
        )
        for method in METHODS
    )
    return [note for note in notes if note]


def trace_rows(setup: Setup, rows: list[Row]) -> dict[str, LayerFigures]:
    """One layer of each row on fake tensors (``memo_ext.estimate.measure``), and the plain
    layer (``none``) the others are scaled against."""
    from memo_ext.estimate.measure import trace_layer  # megatron-core: not for --help

    def trace(method: MemoryMethod | None, settings: Any) -> LayerFigures:
        return trace_layer(
            setup.shape,
            tp=setup.layout.tp,
            sp=setup.layout.sp,
            tokens=setup.seq_length // setup.layout.cp,
            micro_batch_size=setup.micro_batch_size,
            method=None if method is None or method.plain else method,
            settings=settings,
            fp32=setup.fp32,
        )

    return {PLAIN: trace(None, None), **{row.name: trace(row.method, row.settings) for row in rows}}


def method_figures(
    setup: Setup, rows: list[Row], layers: dict[str, LayerFigures]
) -> dict[str, MethodFigures]:
    """Scale each row's traced layer to the stage, the micro-batches in flight and the
    iteration (``MemoryMethod.report_stage``)."""
    stage_layers = setup.shape.num_layers // setup.layout.pp
    in_flight = min(setup.layout.pp, setup.micro_batches)
    plain = layers[PLAIN]
    out = {}
    for row in rows:
        fig = layers[row.name]
        device, host, recomputed = row.method.report_stage(
            fig,
            plain,
            row.settings,
            stage_layers=stage_layers,
            in_flight=in_flight,
            keep_last_layers=setup.keep_last_layers,
        )
        recompute = (_backward_flops(fig) - _backward_flops(plain)) * setup.micro_batches
        out[row.name] = MethodFigures(
            device_activation_bytes=device, host_bytes=host, recompute_flops=recomputed * recompute
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
