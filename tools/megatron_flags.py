"""Megatron-LM's flag list, and the table of how ``pretrain_gpt_memo.py`` handles each flag.

    python -m tools.megatron_flags extract PATH/megatron/training/arguments.py --commit SHA
    python -m tools.megatron_flags docs             # print docs/megatron_flags.md
    python -m tools.megatron_flags docs --update    # rewrite docs/megatron_flags.md

``extract`` reads the ``add_argument`` calls of a Megatron-LM checkout's ``arguments.py`` (by
parsing it; nothing of it is imported) and rewrites ``memo_ext/megatron_lm/megatron_lm_flags.json``
with the flag spellings, their argparse shape (switch, value, list) and literal defaults and
choices, stamped with the commit they came from. ``docs`` renders the status of every flag from
that file and ``memo_ext.megatron_lm.handling``; a test keeps the file in the repository equal to
its output.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "megatron_flags.md"
KEYS = ("action", "nargs", "type", "choices", "default")
"""``add_argument`` keywords recorded for each flag."""


def _value(node: ast.expr) -> object:
    """A literal as its value, anything else as ``{"expression": its source text}``."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"expression": ast.unparse(node)}


def extract_flags(source: str) -> list[dict]:
    """Every ``add_argument`` call of ``source``, in file order, with the function it is in."""
    flags = []
    for function in ast.parse(source).body:
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            record: dict = {"names": names, "group": _group(function.name)}
            for keyword in node.keywords:
                if keyword.arg in ("choices", "default", "nargs"):
                    record[keyword.arg] = _value(keyword.value)
                elif keyword.arg in KEYS:  # action, type: a string or a name
                    value = keyword.value
                    record[keyword.arg] = (
                        value.value if isinstance(value, ast.Constant) else ast.unparse(value)
                    )
            flags.append(record)
    flags.sort(key=lambda r: (r["group"], r["names"][0]))  # ast.walk is breadth-first
    return flags


def _group(function: str) -> str:
    """``_add_network_size_args`` → ``network_size``."""
    return function.removeprefix("_add_").removesuffix("_args").removesuffix("_arguments")


def _extract(args: argparse.Namespace) -> int:
    from memo_ext.megatron_lm.flag_table import DATA_FILE

    path = Path(args.arguments_py)
    flags = extract_flags(path.read_text())
    data = {
        "source": {
            "repository": "NVIDIA/Megatron-LM",
            "path": "megatron/training/arguments.py",
            "commit": args.commit,
        },
        "flags": flags,
    }
    DATA_FILE.write_text(_dump(data))
    print(f"{len(flags)} flags from {path} (commit {args.commit}) → {DATA_FILE}")
    return 0


def _dump(data: dict) -> str:
    """JSON with one flag per line (readable diffs when the list is re-extracted)."""
    lines = ["{", f' "source": {json.dumps(data["source"])},', ' "flags": [']
    rows = [json.dumps(flag, default=str) for flag in data["flags"]]
    lines += [f"  {row}," for row in rows[:-1]] + [f"  {rows[-1]}", " ]", "}"]
    return "\n".join(lines) + "\n"


STATUS = {
    "ours": "implemented",
    "same": "same",
    "mapped": "mapped",
    "no effect": "accepted, no effect",
    "refused": "refused",
}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _ours_note(flag, action: argparse.Action) -> str:
    """Where one of our flags differs from Megatron-LM's: values, default."""
    from memo_ext.megatron_lm.handling import VALUE_MAPS, VALUE_REASONS

    notes = [action.help.replace("%%", "%")] if action.help else []
    if flag.name in VALUE_MAPS:
        notes.append(f"values mapped: {VALUE_MAPS[flag.name].note}")
    elif isinstance(flag.choices, tuple) and action.choices:
        missing = [str(c) for c in flag.choices if c not in action.choices]
        if missing:
            reason = VALUE_REASONS.get(flag.name, "not implemented here")
            notes.append(f"values {', '.join(missing)} refused: {reason}")
    ours_default = action.default
    if (
        action.nargs != 0
        and flag.default is not None
        and not isinstance(flag.default, dict)  # an expression
        and ours_default is not None
        and ours_default != flag.default
        and not (isinstance(flag.default, list) and list(ours_default or ()) == flag.default)
    ):
        notes.append(f"default here {ours_default} (Megatron-LM: {flag.default})")
    return "; ".join(notes)


def render_table() -> str:
    """docs/megatron_flags.md: every Megatron-LM flag, grouped as Megatron-LM groups them."""
    from memo_ext.arguments import build_parser
    from memo_ext.megatron_lm.flag_table import megatron_flags, megatron_source
    from memo_ext.megatron_lm.handling import LATER_FLAGS, handling_of

    ours = build_parser()._option_string_actions
    source = megatron_source()
    flags = {f.name: f for f in megatron_flags().values()} | LATER_FLAGS
    by_group: dict[str, list] = {}
    for flag in flags.values():
        by_group.setdefault(flag.group, []).append(flag)
    counts: dict[str, int] = {}
    sections = []
    for group in sorted(by_group):
        rows = ["| flag | here | what it does here / why not |", "|---|---|---|"]
        for flag in sorted(by_group[group], key=lambda f: f.name):
            spellings = " / ".join(f"`{n}`" for n in flag.names)
            if flag.name in ours:
                status, note = "ours", _ours_note(flag, ours[flag.name])
            else:
                handling = handling_of(flag)
                status, note = handling.status, handling.note
            counts[status] = counts.get(status, 0) + 1
            rows.append(f"| {spellings} | {STATUS[status]} | {_cell(note)} |")
        sections += [f"## {group.replace('_', ' ')}", "", *rows, ""]
    total = sum(counts.values())
    summary = ", ".join(f"{counts.get(s, 0)} {STATUS[s]}" for s in STATUS)
    head = [
        "# Megatron-LM flags in `pretrain_gpt_memo.py`",
        "",
        "<!-- generated by python -m tools.megatron_flags docs --update; do not edit -->",
        "",
        f"Every flag of Megatron-LM's `pretrain_gpt.py` ({source['repository']} "
        f"`{source['path']}` at commit `{source['commit']}`, plus "
        f"{', '.join(f'`{n}`' for n in LATER_FLAGS)} from later Megatron-LM), {total} in all: "
        f"{summary}.",
        "",
        "- **implemented**: the same flag, implemented here (where values or defaults differ "
        "from Megatron-LM's, the last column says how);",
        "- **same**: accepted; its meaning is already what this trainer does (where only some "
        "values are, another value is refused);",
        "- **mapped**: rewritten onto this trainer's flags, with a log line saying so;",
        "- **accepted, no effect**: accepted with a log line; it only touches Megatron-LM "
        "machinery that has no counterpart here and changes no result;",
        "- **refused**: the run stops before any work with one message naming every refused "
        "flag of the command line and why; a refused flag given its Megatron-LM default value "
        "(`--expert-model-parallel-size 1`) asks for nothing and is accepted.",
        "",
    ]
    return "\n".join(head + sections)


def _docs(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")
    text = render_table()
    if args.update:
        DOCS.write_text(text)
        print(f"wrote {DOCS}")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron_flags", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    extract = commands.add_parser("extract", help="Rewrite the flag list from arguments.py.")
    extract.add_argument("arguments_py", help="Megatron-LM's megatron/training/arguments.py.")
    extract.add_argument("--commit", required=True, help="The Megatron-LM commit it is from.")
    extract.set_defaults(run=_extract)
    docs = commands.add_parser("docs", help="Print (or --update) docs/megatron_flags.md.")
    docs.add_argument("--update", action="store_true", help="Rewrite the file.")
    docs.set_defaults(run=_docs)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
