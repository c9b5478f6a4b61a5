"""The documentation holds together: every docs/ page is reachable from the README by its links, and every
relative link in the README and docs/ names a file that exists (and, into a Markdown page, a heading it has,
by GitHub's anchor rule)."""

from __future__ import annotations

import re
from pathlib import Path

from paths import REPO
from readme_walkthrough import DOCS, PAGES, README

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:")


def documentation() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(page: Path) -> str:
    """The page without its fenced code blocks and inline code, where a `](` is not a link."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(page.read_text()))


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not t.startswith(EXTERNAL)]


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2... for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", without_code_blocks(page.read_text()), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def target(page: Path, link: str) -> tuple[Path, str]:
    path, _, anchor = link.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in documentation():
        for link in links(page):
            file, anchor = target(page, link)
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {link}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {link}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for link in links(page):
            file, _ = target(page, link)
            if file.suffix == ".md" and file.exists() and file not in reached:
                reached.add(file)
                todo.append(file)
    unreached = [p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md") if p.resolve() not in reached]
    assert not unreached, f"not linked from README.md or a page it links: {unreached}"


def test_the_walkthrough_order_names_existing_pages() -> None:
    """The pages tests/readme_walkthrough.py follows in order (so their examples run) are there."""
    missing = [name for name in PAGES if not (DOCS / name).is_file()]
    assert not missing, missing


def test_the_readme_stays_short() -> None:
    """A newcomer reads the README in one go: at most 220 lines; the detail belongs on the pages it links (the
    architecture map's own limit is tests/unit/test_layers.py's)."""
    assert len(README.read_text().splitlines()) <= 220
