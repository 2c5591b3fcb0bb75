"""Print the trainer's flag reference and the metrics file's keys as Markdown tables
(docs/flags.md and docs/metrics.md).

    python -m tools.flag_reference            # print
    python -m tools.flag_reference --update   # rewrite both sections in place

The sections lie between ``<!-- flags:begin -->`` and ``<!-- flags:end -->``, and between
``<!-- metrics:begin -->`` and ``<!-- metrics:end -->``; a test checks that each matches this
output.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"
METRICS_BEGIN, METRICS_END = "<!-- metrics:begin -->", "<!-- metrics:end -->"
DOCS = Path(__file__).resolve().parents[1] / "docs"
FLAGS_DOC, METRICS_DOC = DOCS / "flags.md", DOCS / "metrics.md"
"""Where the generated tables live."""


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:  # a switch: is it given by default? (``--no-x`` stores False)
        given = (
            not action.default if isinstance(action, argparse._StoreFalseAction) else action.default
        )
        return "on" if given else "off"
    if action.default in (None, [], ()):
        return "—"
    return f"`{action.default}`"


def flag_tables(parser: argparse.ArgumentParser) -> str:
    """One Markdown table per argument group."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        out += [f"**{group.title}**", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            choices = f" One of {', '.join(f'`{c}`' for c in a.choices)}." if a.choices else ""
            names = " / ".join(f"`{name}`" for name in a.option_strings)
            help_text = a.help.replace("%%", "%")  # argparse's escape
            out.append(f"| {names} | {_default(a)} | {help_text}{choices} |")
        out.append("")
    return "\n".join(out)


def readme_section(text: str, begin: str = BEGIN, end: str = END) -> str:
    return text[text.index(begin) + len(begin) : text.index(end)].strip("\n")


def _replace_section(text: str, body: str, begin: str, end: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flag_reference", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--update", action="store_true", help="Rewrite both docs' sections.")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from memo_ext.arguments import build_parser
    from memo_ext.training.metric_keys import metrics_table

    tables, metrics = flag_tables(build_parser()), metrics_table()
    if not args.update:
        print(tables + "\n" + metrics)
        return 0
    FLAGS_DOC.write_text(_replace_section(FLAGS_DOC.read_text(), tables, BEGIN, END))
    METRICS_DOC.write_text(
        _replace_section(METRICS_DOC.read_text(), metrics, METRICS_BEGIN, METRICS_END)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
