"""Imports point down the declared layers, never form a cycle, and megatron-core's private names
stay in ``memo_ext/mcore``.

Every import of the package counts, wherever it stands (a function-level import cannot hide a
cycle); only imports under ``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memo_ext.features.feature import BUILT_IN

PACKAGE = Path(__file__).resolve().parents[2] / "memo_ext"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "device"}),
    frozenset({"files", "plugins"}),
    frozenset({"shapes", "parallel", "hardware", "flags", "collectives", "extension"}),
    frozenset({"config.common"}),
    frozenset(f"{f.package.removeprefix('memo_ext.')}.config" for f in BUILT_IN),
    frozenset({"config"}),
    frozenset({"mcore", "data"}),
    frozenset({"planner", "allocator"}),
    frozenset({"memo"}),
    frozenset({"estimate"}),
    frozenset({"hotspa", "megatron_lm", "simulate"}),
    frozenset({"features"}),
    frozenset({"compare", "arguments", "training", "launch"}),
    frozenset({"hf"}),
    frozenset({"commands", "benchmarks"}),
)
"""Components of ``memo_ext``, lowest first. A component may import components of lower layers
only: not of its own layer (across), not of a higher one (up). The libraries (``memo``,
``hotspa``, the estimator) sit below ``features``, whose packages connect them to the trainer,
the estimator's callers and the comparisons; nothing below ``features`` knows a feature. Each
feature's section of the configuration (``features.<name>.config``) sits just below ``config``,
which gathers them, and above ``config.common``, the checks they share."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def package_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules a module imports (``from a import b``: ``a.b`` when it is a module)."""
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def read_package(root: Path = PACKAGE) -> dict[str, ast.AST]:
    """Module name → syntax tree, for every module of the package."""
    return {module_name(p, root): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}


def component(module: str) -> str:
    """``memo_ext.memo.runtime`` → ``memo``; a module declared in LAYERS is its own component
    (``memo_ext.config.common`` → ``config.common``, ``memo_ext.features.memo.config`` →
    ``features.memo.config``)."""
    parts = module.split(".")
    for depth in (4, 3):
        if len(parts) >= depth and layer_of(".".join(parts[1:depth])) is not None:
            return ".".join(parts[1:depth])
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int | None:
    return next((k for k, layer in enumerate(LAYERS) if name in layer), None)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up or across the layers, and modules of no declared component."""
    problems = []
    for source, targets in sorted(graph.items()):
        here = component(source)
        if here and layer_of(here) is None:
            problems.append(f"{source}: component {here!r} is in no layer of LAYERS")
            continue
        for target in sorted(targets):
            there = component(target)
            if not here or not there or there == here or layer_of(there) is None:
                continue
            if layer_of(there) >= layer_of(here):
                way = "across" if layer_of(there) == layer_of(here) else "up"
                problems.append(f"{source} imports {target} ({way}: {here} -> {there})")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def private_megatron_uses(tree: ast.AST) -> list[str]:
    """``_names`` imported from megatron-core, or read off a name bound to megatron-core."""
    bound: set[str] = set()
    found = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "megatron":
                    bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
    for node in _runtime_nodes(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return found


@pytest.fixture(scope="module")
def package() -> dict[str, ast.AST]:
    return read_package()


@pytest.fixture(scope="module")
def graph(package) -> dict[str, set[str]]:
    modules = set(package)
    return {name: package_imports(tree, modules) - {name} for name, tree in package.items()}


def test_every_component_has_a_layer(package):
    components = {component(m) for m in package} - {""}
    declared = set().union(*LAYERS)
    assert components == declared, (
        f"undeclared: {sorted(components - declared)}; gone: {sorted(declared - components)}"
    )


def test_imports_point_down_the_layers(graph):
    assert layering_violations(graph) == []


def test_no_import_cycles(graph):
    assert import_cycles(graph) == []


def test_megatron_private_names_only_in_mcore(package):
    uses = {
        name: private_megatron_uses(tree)
        for name, tree in package.items()
        if not name.startswith("memo_ext.mcore")
    }
    assert {name: found for name, found in uses.items() if found} == {}


RUN_PROTOCOLS = frozenset({"memo_ext.extension", "memo_ext.estimate.stage"})
"""The protocols a feature implements, whose methods are handed the run: below ``features`` the
only modules that name ``RunConfig``, and only as a type (under ``TYPE_CHECKING``)."""


def run_config_uses(tree: ast.AST) -> list[str]:
    """Where a module imports ``RunConfig`` at run time, and where it names it at all."""
    runtime = [
        f"imports RunConfig (line {node.lineno})"
        for node in _runtime_nodes(tree)
        if isinstance(node, ast.ImportFrom) and any(a.name == "RunConfig" for a in node.names)
    ]
    named = [
        f"names RunConfig (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id == "RunConfig"
    ]
    return runtime or named[:1]


def test_below_the_features_functions_take_the_sections_they_read(package):
    """The libraries below ``features`` (``mcore``, ``data``, the planner, MEMO, the estimator,
    HotSPa's engine, ...) are handed the sections of the run they read, never the whole run."""
    below = layer_of("features")
    uses = {
        name: run_config_uses(tree)
        for name, tree in package.items()
        if component(name)
        and layer_of(component(name)) < below
        and not component(name).startswith(("config", "features."))
    }
    runtime = {
        name: found
        for name, found in uses.items()
        if found and (name not in RUN_PROTOCOLS or found[0].startswith("imports"))
    }
    assert runtime == {}
    planted = "from memo_ext.config import RunConfig\ndef f(run: RunConfig): ...\n"
    assert run_config_uses(ast.parse(planted)) == ["imports RunConfig (line 1)"]
    hinted = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memo_ext.config import "
        "RunConfig\ndef f(run: RunConfig): ...\n"
    )
    assert run_config_uses(ast.parse(hinted)) == ["names RunConfig (line 4)"]


def test_the_checks_catch_what_they_are_for():
    # an upward import, an import across one layer, a cycle and a private megatron name, each
    # planted in a copy of a real graph and source, must be reported
    modules = {
        "memo_ext.estimate.cost_model",
        "memo_ext.training.loop",
        "memo_ext.planner.plan",
        "memo_ext.memo.runtime",
    }
    source = "def f():\n    from memo_ext.training.loop import train\n"
    planted = {"memo_ext.estimate.cost_model": package_imports(ast.parse(source), modules)}
    assert layering_violations(planted) == [
        "memo_ext.estimate.cost_model imports memo_ext.training.loop (up: estimate -> training)"
    ]
    across = {"memo_ext.planner.plan": {"memo_ext.allocator.core"}}
    assert "across" in layering_violations(across)[0]
    cycle = {
        "memo_ext.planner.plan": {"memo_ext.planner.trace"},
        "memo_ext.planner.trace": {"memo_ext.planner.plan"},
    }
    assert import_cycles(cycle) == [["memo_ext.planner.plan", "memo_ext.planner.trace"]]
    hidden = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import memo_ext.training.loop\n"
    )
    assert package_imports(ast.parse(hidden), modules) == set()
    private = "from megatron.core import parallel_state\nx = parallel_state._GLOBAL_MEMORY_BUFFER\n"
    assert private_megatron_uses(ast.parse(private)) == [
        "parallel_state._GLOBAL_MEMORY_BUFFER (line 2)"
    ]


# --- no module outside memo_ext/features names a feature --------------------------------------

MEGATRON_GRANULARITIES = frozenset({"full", "selective"})
"""megatron-core's own ``recompute_granularity`` values, which ``mcore`` and the tracer speak to
build its layers (the recompute feature's methods take their names)."""

NAMED_OUTSIDE_FEATURES: dict[tuple[str, str], str] = {
    ("memo_ext/compare/report.py", "none"): "the comparison table's baseline column",
    ("memo_ext/benchmarks/memo_chunking.py", "none"): "--chunks none: a layer without chunks",
    ("memo_ext/benchmarks/paper_table.py", "memo"): "the paper table's MEMO rows",
}
"""The comparisons with a feature's name still made outside ``memo_ext/features``, each with why.
A ratchet (as torchtitan's ``test_no_new_cli_options``): a new one fails the test, and so does
one that is gone but still listed."""


def feature_names() -> frozenset[str]:
    """Every name a feature answers to: its package, its extension's, its methods'."""
    from memo_ext.features.extensions import FEATURES
    from memo_ext.features.registry import COMPARED, METHODS

    packages = {p.name for p in (PACKAGE / "features").iterdir() if (p / "__init__.py").exists()}
    names = packages | {p.replace("_", "-") for p in packages}
    names |= {f.name for f in FEATURES} | {m.name for m in METHODS} | {m.name for m in COMPARED}
    return frozenset(names - MEGATRON_GRANULARITIES)


def _strings(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _strings(element)


def compared_names(tree: ast.AST, names: frozenset[str]) -> set[str]:
    """Strings a module compares with a name of ``names``: ``x == "memo"``, ``x in ("memo",
    ...)``, or a prefix / suffix test such as ``x.startswith("memo-")``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found |= {s for s in _strings(side) if s in names}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix")
        ):
            for arg in node.args:
                found |= {s for s in _strings(arg) if s.strip("-=+@:") in names}
    return found


def test_no_module_outside_features_compares_a_string_with_a_features_name():
    names = feature_names()
    assert {"memo", "hotspa", "megatron-offload", "memo+plan", "none"} <= names
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        if relative.startswith("memo_ext/features/"):
            continue
        found |= {(relative, s) for s in compared_names(ast.parse(path.read_text()), names)}
    assert sorted(found - set(NAMED_OUTSIDE_FEATURES)) == [], "a new comparison with a name"
    assert sorted(set(NAMED_OUTSIDE_FEATURES) - found) == [], "listed, but gone: unlist it"


def test_the_name_rule_catches_what_it_is_for():
    names = frozenset({"memo", "hotspa"})
    planted = "if method == 'memo' or x in ('a', 'hotspa') or y.startswith('memo-'):\n    pass\n"
    assert compared_names(ast.parse(planted), names) == {"memo", "hotspa", "memo-"}
    assert compared_names(ast.parse("x = 'memo'\nf('memo')\n"), names) == set()
