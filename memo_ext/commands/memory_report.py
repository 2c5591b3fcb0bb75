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
from dataclasses import asdict

from memo_ext.arguments import OneSentenceParser, parse_tool_args
from memo_ext.compare.memory import (
    SECTIONS,
    Setup,
    format_table,
    method_figures,
    report_notes,
    report_rows,
    trace_rows,
)
from memo_ext.errors import UsageError
from memo_ext.flags import FlagHelpFormatter, add_flags
from memo_ext.plugins import add_flag, with_plugins

PROG = "memo-memory-report"
"""The installed command: its usage line and error prefix."""


def build_parser() -> argparse.ArgumentParser:
    p = OneSentenceParser(
        prog=PROG,
        description="Activation memory and recompute FLOPs per method (fake tensors).",
        formatter_class=FlagHelpFormatter,
        allow_abbrev=False,
    )
    for section, cls, only, optional in SECTIONS:
        add_flags(p, cls, section=section, only=only, overrides=optional)
    p.add_argument("--num-micro-batches", type=int, default=1, help="Per iteration and process.")
    p.add_argument("--json", action="store_true", help="End with one JSON line of the figures.")
    add_flag(p)
    return p


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_tool_args(parser, argv)
        setup = Setup.from_args(args)
        setup.check()
        if setup.layout.cp > 1:
            # SDPAttention's CP path builds torch's CausalBias, a tensor subclass FakeTensorMode
            # cannot wrap; trace the same tokens per rank with TP / SP instead
            raise UsageError("--context-parallel-size > 1 cannot be traced on fake tensors yet")
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = report_rows(setup)
    figures = method_figures(setup, rows, trace_rows(setup, rows))
    layout, shape = setup.layout, setup.shape
    notes = "".join(f", {note}" for note in report_notes(setup))
    print(
        f"per process, per iteration: {shape.num_layers} layers / PP {layout.pp}, TP "
        f"{layout.tp}{' + SP' if layout.sp else ''}, CP {layout.cp}, {setup.seq_length} tokens × "
        f"{setup.micro_batch_size} sequence(s){notes} (one layer traced per method)"
    )
    print(format_table(figures))
    if args.json:
        print(json.dumps({"methods": {m: asdict(f) for m, f in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
