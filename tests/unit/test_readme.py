"""The README documents every flag of the trainer, and keeps its two quick-start commands."""

from __future__ import annotations

from pathlib import Path

from memo_ext.arguments import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_flag_is_documented():
    flags = [
        action.option_strings[0]
        for action in build_parser()._actions
        if action.option_strings and action.dest != "help"
    ]
    missing = [flag for flag in flags if f"`{flag}`" not in README]
    assert not missing, f"flags missing from README.md: {missing}"


def test_quick_start_commands():
    assert "make demo" in README and "make test" in README
