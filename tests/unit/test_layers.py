"""The layering the architecture promises (docs/ARCHITECTURE.md, "Layers"), read from the source: torch is
imported at module level only under trainctl/runtime/ (the CLI, spec, planner, launcher and reports start
without it), and no two trainctl modules import each other at module level, directly or round a loop (an
import that works only in one order breaks with the next innocent import). Imports inside functions (lazy:
torch in a command that trains, typer's registration of the commands) and under TYPE_CHECKING do not run at
import time and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

from paths import REPO

PACKAGE = REPO / "trainctl"


def module_name(f: Path) -> str:
    parts = f.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in PACKAGE.rglob("*.py")}


def module_level_imports(f: Path) -> set[str]:
    """Top-level names of every module imported when `f` is imported (submodules resolved by name)."""
    out: set[str] = set()
    for node in ast.parse(f.read_text()).body:
        body = [node]
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` never runs; other ifs do
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                continue
            body = node.body + node.orelse
        elif isinstance(node, ast.Try):
            body = node.body
        for n in body:
            if isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                subs = {f"{n.module}.{a.name}" for a in n.names} & MODULES.keys()
                out.update(subs or {n.module})
    return out


IMPORTS = {m: module_level_imports(f) for m, f in MODULES.items()}


def test_torch_is_imported_only_by_the_runtime() -> None:
    outside = sorted(m for m, imps in IMPORTS.items()
                     if any(i == "torch" or i.startswith("torch.") for i in imps)
                     and not m.startswith("trainctl.runtime"))
    assert outside == []


def test_no_import_cycle_between_trainctl_modules() -> None:
    graph = {m: {i for i in imps if i in MODULES and i != m} for m, imps in IMPORTS.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert [" -> ".join(c) for c in cycles] == []
    assert len(MODULES) > 100  # the walk found the package
