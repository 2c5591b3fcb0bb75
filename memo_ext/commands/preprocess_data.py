"""Tokenize a JSON Lines corpus into megatron-core indexed datasets, as Megatron-LM's tool does.

Each line of the input is a JSON object; every ``--json-keys`` key becomes its own dataset
``{output-prefix}_{key}_document.bin`` / ``.idx``, which ``--data-path`` then names without the
suffix. Run from the repository root:

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteTokenizer --append-eod --workers 2

    # afterwards: --data-path data/corpus_text_document

``--tokenizer-type NullTokenizer --vocab-size V`` reads each text as space-separated integer ids.
A pretrained model's tokenizer, with Megatron-LM's ids:

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type TikTokenizer --tokenizer-model tokenizer.json --tiktoken-pattern v2 \\
        --vocab-size 131072 --append-eod

``python tools/preprocess_data.py ...`` works the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING

from memo_ext.arguments import OneSentenceParser
from memo_ext.config import TOKENIZER_TYPES, TokenizerSpec, check_writable_directory
from memo_ext.errors import UsageError
from memo_ext.plugins import with_plugins

if TYPE_CHECKING:
    from memo_ext.data.preprocess import PreprocessSummary


PROG = "memo-preprocess-data"
"""The installed command: its usage line and error prefix."""


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags (Megatron-LM's names)."""
    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True, help="JSON Lines file, one document per line.")
    parser.add_argument(
        "--output-prefix", required=True, help="Outputs are {prefix}_{key}_document.bin/.idx."
    )
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's vocabulary; TikTokenizer's ids in all (default 131072).",
    )
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="Local tokenizer file: tokenizer.json (HuggingFaceTokenizer), SentencePiece "
        "tokenizer.model (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer), "
        "tiktoken vocabulary .json (TikTokenizer).",
    )
    parser.add_argument("--vocab-file", default=None, help="vocab.json (GPT2BPETokenizer).")
    parser.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer).")
    parser.add_argument(
        "--tiktoken-pattern", choices=("v1", "v2"), default=None, help="TikTokenizer's regex."
    )
    parser.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids before the file's tokens (default: 1000).",
    )
    parser.add_argument(
        "--tiktoken-special-tokens",
        nargs="+",
        default=(),
        help="TikTokenizer's special tokens (default: <unk> <s> </s>).",
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys to tokenize (default: text)."
    )
    parser.add_argument(
        "--append-eod", action="store_true", help="End every document with the eod id."
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Forked tokenizer processes (default: 1, tokenizes in this process).",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=256, help="Lines handed to a worker at a time."
    )
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    return parser


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit status (0 on success, 2 on bad input, as every
    entry point of this project)."""
    try:
        args = build_parser().parse_args(argv)
        if os.path.exists(args.input) and not os.path.isfile(args.input):
            raise UsageError(f"--input {args.input} is not a regular file; give the .jsonl file")
        if not os.path.exists(args.input):  # before seconds of imports
            raise UsageError(f"--input {args.input} does not exist; give an existing .jsonl file")
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if args.workers < 1 or args.chunk_size < 1:
        print(f"{PROG}: error: --workers and --chunk-size must be >= 1.", file=sys.stderr)
        return 2
    # megatron-core's dataset writer, imported once the flags are good (--help answers at once)
    from memo_ext.data.preprocess import preprocess_jsonl

    try:
        parent = os.path.dirname(os.path.abspath(args.output_prefix))
        check_writable_directory(parent, flag=f"--output-prefix {args.output_prefix}: folder")
        summary = preprocess_jsonl(
            input_path=args.input,
            output_prefix=args.output_prefix,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            chunk_size=args.chunk_size,
            show_progress=not args.no_progress,
            tokenizer=TokenizerSpec(
                tokenizer_type=args.tokenizer_type,
                vocab_size=args.vocab_size,
                tokenizer_model=args.tokenizer_model,
                vocab_file=args.vocab_file,
                merge_file=args.merge_file,
                tiktoken_pattern=args.tiktoken_pattern,
                tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                tiktoken_special_tokens=args.tiktoken_special_tokens,
            ),
        )
    except (UsageError, FileNotFoundError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the output folder vanished or filled up while writing
        print(f"{PROG}: error: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the workers ignore it, this process stops them
        print(
            f"{PROG}: interrupted; nothing written (the unfinished files are removed, "
            f"any earlier {args.output_prefix}_* output is as it was)",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    for prefix in summary.prefixes.values():
        print(f"wrote {prefix}.bin / .idx")
    print(
        f"{summary.documents} documents, {summary.tokens} tokens "
        f"({summary.empty_documents} empty texts skipped{_tokenless(summary)}) "
        f"in {summary.seconds:.1f} s"
    )
    return 0


def _tokenless(summary: PreprocessSummary) -> str:
    if not summary.tokenless_texts:
        return ""
    return f", {summary.tokenless_texts} of them texts that gave the tokenizer no token"


if __name__ == "__main__":
    sys.exit(main())
