"""How much of the program's GPU-only code the emulated-device tier runs:
``python -m tests.emulated.cuda_coverage`` (``make test`` prints it after the tier).

The GPU-only code is found in the source, not listed by hand: every branch that runs only on a
GPU — the body of ``if on_gpu():`` / ``if x.type == "cuda":`` / ``if t.is_cuda:`` (and of an
``and`` of such a test), the ``else`` of their negations, and the rest of a block after ``if not
on_gpu(): return`` — in ``memo_ext`` and ``tools``. The tier runs under coverage.py
(``COVERAGE_PROCESS_START`` names ``.coveragerc``: its pytest workers and every process of its
rehearsals are measured, :mod:`tests.emulated.plugin` and the emulated ``sitecustomize`` start
it); this module combines the data files and prints, per file and in total, the statements of
those branches that ran. It exits 1 below ``--fail-under`` percent (default 0: report only).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("memo_ext", "tools")


def _sign(test: ast.expr) -> int:
    """+1: the test is true only on a GPU; -1: false only on a GPU; 0: not about the device."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -_sign(test.operand)
    if isinstance(test, ast.Call):
        func = test.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return 1 if name == "on_gpu" else 0
    if isinstance(test, ast.Attribute) and test.attr == "is_cuda":
        return 1
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        right = test.comparators[0]
        left = test.left
        about_type = isinstance(left, ast.Attribute) and left.attr == "type"
        if about_type and isinstance(right, ast.Constant) and right.value == "cuda":
            return (
                1
                if isinstance(test.ops[0], ast.Eq)
                else -1
                if isinstance(test.ops[0], ast.NotEq)
                else 0
            )
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return 1 if any(_sign(v) == 1 for v in test.values) else 0
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return -1 if any(_sign(v) == -1 for v in test.values) else 0
    return 0


def _lines(statements: list[ast.stmt]) -> set[int]:
    return {n for s in statements for n in range(s.lineno, (s.end_lineno or s.lineno) + 1)}


def gpu_only_lines(source: str) -> set[int]:
    """Line numbers of the GPU-only branches of one module (see the module docstring)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, statement in enumerate(block):
                if not isinstance(statement, ast.If):
                    continue
                sign = _sign(statement.test)
                if sign == 1:
                    lines |= _lines(statement.body)
                elif sign == -1:
                    lines |= _lines(statement.orelse)
                    exits = statement.body and isinstance(
                        statement.body[-1], (ast.Return, ast.Raise)
                    )
                    if not statement.orelse and exits:
                        lines |= _lines(block[i + 1 :])
    return lines


def report(*, fail_under: float) -> int:
    import coverage

    data = coverage.Coverage(config_file=str(ROOT / ".coveragerc"))
    data.combine(keep=False)
    data.save()
    data.load()
    rows, total_run, total = [], 0, 0
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            gpu = gpu_only_lines(path.read_text())
            if not gpu:
                continue
            _, statements, _, missing, _ = data.analysis2(str(path))
            branch = gpu & set(statements)
            ran = len(branch - set(missing))
            if branch:
                rows.append((str(path.relative_to(ROOT)), ran, len(branch)))
                total_run, total = total_run + ran, total + len(branch)
    width = max(len(r[0]) for r in rows)
    print(f"GPU-only branches run by the emulated tier ({len(rows)} files):")
    for name, ran, count in rows:
        print(f"  {name:<{width}}  {ran:>3} / {count:<3} {100 * ran / count:5.1f}%")
    share = 100 * total_run / max(total, 1)
    print(f"  {'total':<{width}}  {total_run:>3} / {total:<3} {share:5.1f}%")
    return 1 if share < fail_under else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.emulated.cuda_coverage")
    parser.add_argument("--fail-under", type=float, default=0.0, help="Percent (default 0).")
    return report(fail_under=parser.parse_args(argv).fail_under)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
