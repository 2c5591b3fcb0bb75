"""Out-of-tree features, memory methods and offload rules, imported before any flag is parsed.

A plugin is a Python module that registers what it adds when imported: an offload rule
(``memo_ext.memo.rules.register``), a feature with its flags, trainer hooks and memory methods
(``memo_ext.features.registry.register_feature``), or any of the lists that registry keeps. It
reaches a process three ways, all loaded by :func:`load` at the start of the trainer and of
every ``memo-*`` command:

- ``--plugin MODULE`` on the command line (repeatable; taken out before the command's own flags
  are parsed, so the trainer and every tool accept it);
- the entry-point group ``memo_ext.plugins`` of an installed package (each entry a module);
- the environment variable ``MEMO_EXT_PLUGINS`` (module names separated by ``:``), which
  :func:`load` sets to every module it imported: the processes a command starts (torchrun's
  workers, ``memo-compare``'s jobs, ``memo-simulate``'s run) load the same plugins.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence

from memo_ext.errors import UsageError

FLAG = "--plugin"
ENV = "MEMO_EXT_PLUGINS"
GROUP = "memo_ext.plugins"
HELP = (
    "Import MODULE before the flags are parsed: its features, memory methods and offload rules "
    f"join the built-in ones (repeatable; also the {GROUP} entry points and ${ENV}, which the "
    "processes this one starts inherit)."
)


def load(argv: Sequence[str]) -> list[str]:
    """Imports the plugins of ``argv``, of the environment and of the entry-point group, once
    each, and returns ``argv`` without the ``--plugin`` flags before a bare ``--`` (those after
    it belong to the command that follows, which loads them itself).

    Raises:
        UsageError: for a flag without a module, or a module that cannot be imported.
    """
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    own, named = _taken_out(argv[:end])
    _, after = _taken_out(argv[end:])
    inherited = [name for name in os.environ.get(ENV, "").split(os.pathsep) if name]
    loaded = [_import(name) for name in dict.fromkeys([*inherited, *named, *after])]
    for entry in importlib.metadata.entry_points(group=GROUP):
        if entry.module not in loaded:
            loaded.append(_import(entry.module, source=f"entry point {entry.name!r}"))
    if loaded:
        os.environ[ENV] = os.pathsep.join(loaded)
    return own + argv[end:]


def _taken_out(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``argv`` without ``--plugin M`` / ``--plugin=M``, the modules named)."""
    rest, names = [], []
    tokens = iter(argv)
    for token in tokens:
        if token == FLAG:
            name = next(tokens, None)
            if name is None or name.startswith("-"):
                raise UsageError(f"{FLAG} needs a module name (--plugin my_package.my_rules)")
            names.append(name)
        elif token.startswith(FLAG + "="):
            names.append(token.partition("=")[2])
        else:
            rest.append(token)
    return rest, names


def _import(name: str, *, source: str = FLAG) -> str:
    try:
        importlib.import_module(name)
    except ImportError as err:
        raise UsageError(
            f"{source} {name}: cannot import it ({err}); is its folder on PYTHONPATH or its "
            "package installed?"
        ) from None
    return name


def add_flag(parser) -> None:
    """``--plugin`` in ``parser``'s ``--help`` (:func:`load` takes it out before parsing)."""
    parser.add_argument(FLAG, metavar="MODULE", action="append", default=[], help=HELP)


def with_plugins(prog: str) -> Callable:
    """Decorates a command's ``main(argv)``: the plugins are loaded first, and a plugin that
    cannot be loaded ends the command with one sentence and exit status 2."""

    def decorate(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                argv = load(sys.argv[1:] if argv is None else argv)
            except UsageError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2
            return main(argv)

        return run

    return decorate
