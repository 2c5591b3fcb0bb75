"""Build (or find cached) the demo corpus and print its data prefix.

    python -m tools.demo_corpus --out-dir data/demo
    # prints: data/demo/stdlib_text_document

The corpus is the running Python's standard-library sources, one document per file, tokenized
with ByteTokenizer (see ``memo_ext.data.demo_corpus``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from memo_ext.plugins import with_plugins

PROG = "memo-demo-corpus"
"""The installed command: its usage line and error prefix."""


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--out-dir", default="data/demo", help="Where the corpus is written.")
    parser.add_argument("--max-files", type=int, default=None, help="Use only the first N files.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from memo_ext.data.demo_corpus import build_demo_corpus  # megatron-core: not for --help

    print(build_demo_corpus(out_dir=Path(args.out_dir), max_files=args.max_files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
