"""The shape of the code: the import-layer rule, no import cycles, line budgets, who writes node.meta.

Checked over the source text (``ast``), so every import counts: module-level, function-local and
type-only ones alike. ``docs/architecture.md`` states the same rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]

IR, RULES, CAPTURE, PLANNING, RUNTIME = (
    "autopar.ir",
    "autopar.rules",
    "autopar.capture",
    "autopar.planning",
    "autopar.runtime",
)
PASSES, COMPILER, ROOT, TOOLS = "autopar.passes", "autopar.compiler", "autopar", "autopar.tools"

# layer -> the layers it may import (besides itself); tools may import anything and nothing imports them
ALLOWED = {
    IR: set(),
    RULES: {IR},
    CAPTURE: {IR},
    RUNTIME: {IR},
    PLANNING: {IR, RULES, CAPTURE},
    PASSES: {IR, RULES, CAPTURE, RUNTIME},
    COMPILER: {IR, RULES, CAPTURE, PLANNING, RUNTIME, PASSES},
    ROOT: {IR, RULES, CAPTURE, PLANNING, RUNTIME, PASSES, COMPILER},
    TOOLS: {IR, RULES, CAPTURE, PLANNING, RUNTIME, PASSES, COMPILER, ROOT},
}


def _sources() -> dict[str, Path]:
    """Every module of the package by its dotted name (``passes/`` installs as ``autopar.passes``)."""
    found = {}
    for folder, package in ((REPO / "autopar", "autopar"), (REPO / "passes", "autopar.passes")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _sources()


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to: its phase package, or the compiler or the root."""
    for layer in (IR, RULES, CAPTURE, PLANNING, RUNTIME, PASSES, TOOLS, COMPILER):
        if module == layer or module.startswith(layer + "."):
            return layer
    return ROOT


def _type_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under ``if TYPE_CHECKING:``."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, inner.end_lineno + 1))
    return lines


def imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported autopar module, line, type-only)`` for every import statement in ``module``.

    ``from autopar.x import name`` counts as importing ``autopar.x.name`` when that is a module,
    else ``autopar.x``.
    """
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == "autopar" or target.startswith("autopar."):
                found.append((target, node.lineno, node.lineno in type_only))
    return found


def test_every_import_respects_the_layers():
    wrong = []
    for module in sorted(MODULES):
        mine = layer_of(module)
        for target, line, _ in imports(module):
            theirs = layer_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{MODULES[module].relative_to(REPO)}:{line}: {mine} imports {target}")
    assert not wrong, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(wrong)


def test_nothing_imports_the_command_line():
    users = [
        f"{MODULES[m].relative_to(REPO)}:{line}"
        for m in MODULES
        for target, line, _ in imports(m)
        if target == "autopar.tools.cli" and m != "autopar.tools.cli"
    ]
    assert not users, f"the CLI is imported by {users}"


def test_no_import_cycles():
    """Among modules, counting function-local imports too (type-only ones never run)."""
    graph = nx.DiGraph()
    for module in MODULES:
        graph.add_node(module)
        for target, _, type_only in imports(module):
            # importing a module runs its package's __init__ first
            parents = [target.rsplit(".", k)[0] for k in range(target.count("."))]
            for t in [target, *parents]:
                if t in MODULES and t != module and not type_only and not module.startswith(t + "."):
                    graph.add_edge(module, t)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles}"


# Each package's lines (its own modules, not its subpackages'): a budget to notice growth by, not a cap to
# cut files to. Raising one is a decision to record in the commit that does it.
LINE_BUDGETS = {
    "autopar": 700,
    "autopar.ir": 2900,
    "autopar.capture": 2700,
    "autopar.rules": 2400,
    "autopar.runtime": 4900,
    "autopar.tools": 3300,
    "autopar.passes": 1500,
    "autopar.planning": 750,
    "autopar.planning.cost": 1950,
    "autopar.planning.graph": 1400,
    "autopar.planning.pipeline": 1050,
    "autopar.planning.memory": 1300,
    "autopar.planning.assembly": 1050,
    "autopar.planning.search": 2350,
}


def package_of(module: str) -> str:
    """The package a module's lines count toward: itself if it is a package, else its parent."""
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def test_packages_stay_within_their_line_budgets():
    lines: dict[str, int] = {}
    for module, path in MODULES.items():
        package = package_of(module)
        lines[package] = lines.get(package, 0) + len(path.read_text().splitlines())
    print("\n".join(f"{p:28} {n:6} of {LINE_BUDGETS.get(p, 0)}" for p, n in sorted(lines.items())))
    assert set(lines) == set(LINE_BUDGETS), f"packages without a budget: {set(lines) ^ set(LINE_BUDGETS)}"
    over = {p: (n, LINE_BUDGETS[p]) for p, n in lines.items() if n > LINE_BUDGETS[p]}
    assert not over, f"packages over their line budget (lines, budget): {over}"


# planning's subpackages, lowest first: each imports only the ones before it (the planner on top)
PLANNING_ORDER = ("cost", "graph", "pipeline", "memory", "assembly", "search")


def planning_rank(module: str) -> int:
    """A planning module's place in :data:`PLANNING_ORDER` (the planner's modules come last)."""
    parts = module.split(".")
    return PLANNING_ORDER.index(parts[2]) if len(parts) > 3 else len(PLANNING_ORDER)


def test_planning_packages_import_only_those_below():
    wrong = [
        f"{MODULES[module].relative_to(REPO)}:{line}: imports {target}"
        for module in sorted(MODULES)
        if module.startswith(PLANNING + ".")
        for target, line, _ in imports(module)
        if target.startswith(PLANNING + ".") and planning_rank(target) > planning_rank(module)
    ]
    assert not wrong, f"planning imports against {PLANNING_ORDER}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_stay_small(module: str):
    path = MODULES[module]
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100
    ]
    assert not long, f"{path.relative_to(REPO)}: functions of 100 lines or more: {long}"


def _writes_meta(tree: ast.Module) -> list[int]:
    """Lines that assign, delete or update an entry of some ``.meta``."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "meta":
                lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("update", "setdefault", "pop", "clear")
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "meta"
        ):
            lines.append(node.lineno)
    return lines


def test_only_passes_write_node_meta():
    """Planning is pure: layouts travel as data; ``node.meta`` is written by passes (through ``ir.meta``)."""
    writers = {
        f"{MODULES[m].relative_to(REPO)}:{line}"
        for m in MODULES
        if layer_of(m) != PASSES and m != "autopar.ir.meta"
        for line in _writes_meta(ast.parse(MODULES[m].read_text()))
    }
    assert not writers, f"node.meta written outside the passes: {sorted(writers)}"
