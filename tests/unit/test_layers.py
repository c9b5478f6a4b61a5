"""The layering docs/ARCHITECTURE.md promises (section "Layers"), read from the source, and the page's own
truth: its layers table in the real import order, the design pages' sections cited where they exist, and no comment
pointing outside the repository.

Layering: torch is imported at module level only under trainctl/runtime/ (the CLI, spec, planner, launcher and
reports start without it); no two trainctl modules import each other at module level, directly or round a
loop (an import that works only in one order breaks with the next innocent import); and every import, at
module level or inside a function, points down the layers table or stays in its row, save for the exceptions
the page lists. Imports under TYPE_CHECKING are annotations only and not counted."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from paths import REPO

PACKAGE = REPO / "trainctl"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


def module_name(f: Path) -> str:
    parts = f.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(n: ast.Import | ast.ImportFrom) -> set[str]:
    """Top-level names of the modules an import statement loads (submodules resolved by name)."""
    if isinstance(n, ast.Import):
        return {a.name for a in n.names}
    if not n.module or n.level:
        return set()
    subs = {f"{n.module}.{a.name}" for a in n.names} & MODULES.keys()
    return subs or {n.module}


def module_level_imports(f: Path) -> set[str]:
    """Every module imported when `f` is imported."""
    out: set[str] = set()
    for node in ast.parse(f.read_text()).body:
        body = [node]
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` never runs; other ifs do
            if _is_type_checking(node):
                continue
            body = node.body + node.orelse
        elif isinstance(node, ast.Try):
            body = node.body
        for n in body:
            if isinstance(n, ast.Import | ast.ImportFrom):
                out |= _imported(n)
    return out


def all_imports(f: Path) -> set[str]:
    """Every module `f` imports anywhere, inside functions too, leaving out `if TYPE_CHECKING:` blocks."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.update(_imported(child))
            walk(child)

    walk(ast.parse(f.read_text()))
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


# --- the layers table -------------------------------------------------------------------------------------


def section(heading: str) -> str:
    """The text of one `## heading` section of ARCHITECTURE.md, up to the next heading of its level."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def layers_table() -> list[list[str]]:
    """The entries of each row of the layers table, top row first: package names and module file names."""
    rows = [line for line in section("Layers").splitlines() if line.startswith("| `")]
    return [re.findall(r"`([\w.]+)`", row.split("|")[1]) for row in rows]


def row_of(module: str, rows: list[list[str]]) -> int:
    """The index of the row a trainctl module belongs to (its top-level package, or its own file)."""
    top = module.split(".")[1] if "." in module else module
    for i, entries in enumerate(rows):
        if top in entries or f"{top}.py" in entries:
            return i
    raise AssertionError(f"{module} has no row in docs/ARCHITECTURE.md's layers table")


def listed_exceptions() -> set[tuple[str, str]]:
    """The imports that reach up the table, as the page lists them: (`importer.py`, `imported.py`) pairs."""
    text = section("Layers").split("Imports that reach up the table", 1)[1]
    pairs = re.findall(r"^- `([\w/]+)\.py` -> `([\w/]+)\.py`", text, flags=re.MULTILINE)
    return {(f"trainctl.{a.replace('/', '.')}", f"trainctl.{b.replace('/', '.')}") for a, b in pairs}


def test_every_entry_of_the_package_has_a_row_in_the_layers_table() -> None:
    rows = layers_table()
    assert len(rows) >= 10, rows  # the table was found
    entries = sorted(p.name for p in PACKAGE.iterdir()
                     if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem not in ("__init__", "__main__")))
    listed = {e.removesuffix(".py") for row in rows for e in row}
    assert [e for e in entries if e.removesuffix(".py") not in listed] == []
    assert sorted(listed - {e.removesuffix(".py") for e in entries}) == []  # and no row names what is gone


def test_imports_point_down_the_layers_table() -> None:
    """A module imports from its own row or the rows below it; the few that reach up are the page's list."""
    rows = layers_table()
    exceptions = listed_exceptions()
    upward: set[tuple[str, str]] = set()
    for m, f in MODULES.items():
        if m == "trainctl" or m == "trainctl.__main__":
            continue
        for i in all_imports(f):
            if i in MODULES and i != "trainctl" and row_of(i, rows) < row_of(m, rows):
                upward.add((m, i))
    assert sorted(upward - exceptions) == []  # imports against the table's order
    assert sorted(exceptions - upward) == []  # listed exceptions that no longer exist


# --- the page's references ----------------------------------------------------------------------------------


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / n for n in names.split() if n.endswith((".py", ".md", ".sh", ".yaml", ".toml"))
            and (REPO / n).is_file()]


DESIGN_PAGES = [ARCHITECTURE, *sorted((REPO / "docs" / "design").glob("*.md"))]


def headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


# `docs/design/memory.md, "Section"` (or the map's `docs/ARCHITECTURE.md, "Section"`), also across a comment's
# line break
CITATION = re.compile(r'(ARCHITECTURE|design/[\w-]+)\.md(?:[,:]|\s)*(?:#\s*)?\(?(?:section\s+)?\\?"([^"\\]+)\\?"')
LINK = re.compile(r"(ARCHITECTURE|design/[\w-]+)\.md#([\w-]+)")


def cited_page(name: str) -> Path:
    return REPO / "docs" / f"{name}.md"


def test_every_citation_of_a_design_page_names_a_real_section() -> None:
    """Code and docs cite the map and the design pages by section name; each name is a heading of that page."""
    assert len(DESIGN_PAGES) > 5  # the design pages were found
    cited: list[tuple[str, str]] = []
    broken: list[str] = []
    for f in tracked_text_files():
        if f.name == "test_layers.py":  # its own patterns
            continue
        text = f.read_text()
        for page, section_name in CITATION.findall(text):
            section_name = re.sub(r"\s*\n\s*#?\s*", " ", section_name)  # a citation broken over lines
            cited.append((f.name, section_name))
            target = cited_page(page)
            if not target.is_file() or section_name not in headings(target):
                broken.append(f"{f.relative_to(REPO)}: {page}.md, \"{section_name}\"")
        for page, a in LINK.findall(text):
            target = cited_page(page)
            if not target.is_file() or a not in {anchor(h) for h in headings(target)}:
                broken.append(f"{f.relative_to(REPO)}: {page}.md#{a}")
    assert len(cited) > 50  # the citations were found
    assert broken == []


def test_the_map_is_a_map() -> None:
    """docs/ARCHITECTURE.md stays short enough to read in one sitting and links every design page."""
    text = ARCHITECTURE.read_text()
    assert len(text.splitlines()) <= 300
    unlinked = [p.name for p in DESIGN_PAGES[1:] if f"(design/{p.name}" not in text]
    assert unlinked == []


# Comments and docs stand on their own: no pointer to notes, issues or machines outside the repository.
OUTSIDE = re.compile(r"shared\s+notes|cpu\s+notes|\.\./shared|\bthe\s+issue\b|\bissues? #?\d+|done[- ]when|"
                     r"DEVELOPERS\.md|/work/|github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)", re.IGNORECASE)


def test_no_comment_points_outside_the_repository() -> None:
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()[:80]}"
            for f in tracked_text_files() if f.name != "test_layers.py"
            for n, line in enumerate(f.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []
