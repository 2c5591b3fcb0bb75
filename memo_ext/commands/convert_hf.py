"""Hugging Face model folders ↔ this project's checkpoints. Examples::

    python -m tools.convert_hf import --hf-dir Llama-3.1-8B --out ckpt/llama31
    python pretrain_gpt_memo.py ... $(cat ckpt/llama31/model_flags.txt) \\
        --load ckpt/llama31 --finetune
    python -m tools.convert_hf export --load ckpt/llama31 --out hf/llama31 --family llama

``import`` reads config.json and the safetensors files (sharded or not) of a local folder, one
tensor at a time, prints the trainer flags that describe the model and writes them to
``OUT/model_flags.txt``. The checkpoint is written by one process at TP 1 / PP 1; megatron-core
reshards it when the trainer loads it under any other layout. It holds the weights only
(iteration 0): start from it with ``--finetune`` or ``--no-load-optim``.

``export`` writes config.json and model.safetensors that ``transformers`` loads, from an import
or from the ``--save`` of a run that started from one (the trainer carries the import's
hf_config.json there). Any other checkpoint needs ``--vocab-size`` and, without a
model_flags.txt, its model flags after the tool's own.
Families: llama (Llama 2 / 3 / 3.1), mistral, qwen2, gpt2. Bad input exits with status 2 and
one sentence.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# megatron-core warns at import about optional kernels this tool does not run
warnings.filterwarnings("ignore")

from memo_ext.arguments import OneSentenceParser  # noqa: E402
from memo_ext.errors import ReportedError, UsageError  # noqa: E402
from memo_ext.hf import FAMILIES  # noqa: E402
from memo_ext.plugins import with_plugins  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
"""``memo_ext.hf.checkpoint.DTYPES``'s names (that module imports megatron-core; a test checks
they agree)."""


PROG = "memo-convert-hf"
"""The installed command: its usage line and error prefix."""


def build_parser() -> argparse.ArgumentParser:
    summary, _, examples = __doc__.partition(" Examples::\n")
    parser = OneSentenceParser(
        prog=PROG,
        description=summary,
        epilog="examples:\n" + examples.lstrip("\n").split("\n\n")[0].replace("\\\\", "\\"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF folder → checkpoint")
    imp.add_argument("--hf-dir", type=Path, required=True, help="config.json + *.safetensors")
    imp.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    exp = sub.add_parser("export", help="checkpoint → HF folder")
    exp.add_argument("--load", type=Path, required=True, help="checkpoint folder (with tracker)")
    exp.add_argument("--out", type=Path, required=True, help="HF folder to write")
    exp.add_argument("--family", choices=FAMILIES, required=True)
    exp.add_argument("--dtype", choices=DTYPES, default="float32", help="tensor dtype")
    exp.add_argument("--vocab-size", type=int, help="tokenizer vocabulary (imported: known)")
    return parser


def run(argv: list[str]) -> None:
    args, extra = build_parser().parse_known_args(argv)
    # the model and megatron-core, imported once the command line is good
    from memo_ext.hf.checkpoint import export_hf, import_hf

    if args.command == "import":
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        flags = import_hf(hf_dir=args.hf_dir, out=args.out)
        print(f"checkpoint: {args.out}")
        print(f"trainer flags (also in {args.out / 'model_flags.txt'}):")
        print(f"  {shlex.join(flags)} --load {args.out} --finetune")
        return
    out = export_hf(
        load=args.load,
        out=args.out,
        family=args.family,
        dtype=args.dtype,
        flags=extra,
        vocab_size=args.vocab_size,
    )
    print(f"Hugging Face model: {out}")


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        run(list(sys.argv[1:] if argv is None else argv))
    except (UsageError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except ReportedError as err:  # a checkpoint that cannot be used (named), ...
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return err.exit_status
    return 0


if __name__ == "__main__":
    sys.exit(main())
