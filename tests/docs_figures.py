"""The figures the docs show for a cheap, deterministic command are what that command prints now.

A page shows a command's output as a `$ trainctl ...` line in a ```text block with the output lines under it
(the same blocks tests/readme_walkthrough.py follows). For `plan` and `validate` without a measured input
(no run, no calibration profile) the output depends only on the code and the recipes, so its figures can be
regenerated. The page may leave lines out (`...` on its own line) or part of a line (`...` inside it); the
lines it shows keep their place, and only their figures are brought up to date:

    python tests/docs_figures.py          rewrite every such block in README.md and docs/ from its command
    python tests/docs_figures.py --runs   follow the whole walkthrough and rewrite every block, the measured
                                          figures of its real runs too (times, rates, sizes: not its counts)

tests/unit/test_docs_figures.py reruns the commands and fails when a block differs from what this writes.
Figures from real runs (launch, resume, calibrate, mfu-report) vary from run to run: `--runs` regenerates
them from one walkthrough, and tests/dist/test_readme_examples.py checks every count and the shape of the rest.
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from paths import REPO
from readme_walkthrough import VARYING, VARYING_RE, Example, all_examples, follow, run

REGENERATE = "python tests/docs_figures.py"
GENERATED_COMMANDS = ("plan", "validate")  # cheap (no torch, no launch) and deterministic without a measured input

NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
ELLIPSIS = r"\.\.\.|…"


@dataclass(frozen=True)
class Tokens:
    """What of a shown line may change on regeneration: its tokens (the first alternative is `...`) and the
    pattern each token's place accepts."""
    tokens: re.Pattern[str]
    accepts: tuple[str, ...]


# a plan or validate line: every figure is regenerated (and then held exactly by the test)
EXACT = Tokens(re.compile(f"({ELLIPSIS})|({NUMBER})"), (".*?", NUMBER))
# a measuring command's line: only what varies from run to run (times, sizes, rates, stamps); its counts
# (steps, ranks, attempts) are the page's, so a `step 3/3` line is never matched to step 2's
MEASURED = Tokens(VARYING_RE, tuple(accept for _, accept in VARYING))


def generated(ex: Example) -> bool:
    """An example whose shown output this module regenerates."""
    return ex.expected is not None and not ex.measuring and ex.args[0] in GENERATED_COMMANDS


def generated_examples() -> list[Example]:
    return [ex for ex in all_examples() if generated(ex)]


class Stale(Exception):
    """A shown line the command no longer prints in any form: the page needs a person, not a regeneration."""


def _collapse(line: str) -> str:
    return " ".join(line.replace("┃", "│").split())


def _group(m: re.Match[str]) -> int:
    return next(i for i, g in enumerate(m.groups()) if g is not None)


def _line_pattern(shown: str, kind: Tokens) -> re.Pattern[str]:
    """The shown line, spaces collapsed, as a regex: its tokens are groups, the rest literal."""
    out, pos = [], 0
    for m in kind.tokens.finditer(shown):
        out += [re.escape(shown[pos:m.start()]), f"({kind.accepts[_group(m)]})"]
        pos = m.end()
    out.append(re.escape(shown[pos:]))
    return re.compile("".join(out))


def _refreshed_line(shown: str, printed: str, kind: Tokens) -> str | None:
    """`shown` with the figures `printed` has in their places; `printed` itself when the page shows the whole
    line; None when `printed` is not this line."""
    m = _line_pattern(_collapse(shown), kind).fullmatch(_collapse(printed))
    if m is None:
        return None
    if not re.search(ELLIPSIS, shown):
        return printed.rstrip()  # the whole line: the command's own spacing (table padding follows the figures)
    new = iter(m.groups())
    return kind.tokens.sub(lambda t: (next(new), t.group(0))[1] if _group(t) == 0 else next(new), shown)


def refreshed(shown: list[str], output: str, where: str, kind: Tokens = EXACT) -> list[str]:
    """The block's lines with every figure as `output` prints it, each shown line matched in order."""
    printed = output.splitlines()
    out, at = [], 0
    for line in shown:
        if not line.strip() or line.strip() in ("...", "…"):
            out.append(line)
            continue
        for i in range(at, len(printed)):
            new = _refreshed_line(line, printed[i], kind)
            if new is not None:
                out.append(new)
                at = i + 1
                break
        else:
            raise Stale(f"{where}: the command no longer prints a line like\n    {line}\n"
                        f"after that point it printed\n    " + "\n    ".join(printed[at:at + 12]))
    return out


@dataclass
class Block:
    """The output lines a page shows under one `$` line: lines[start:end] of the page."""
    example: Example
    start: int  # 0-based index of the first output line
    end: int


def blocks(page_lines: list[str], examples: list[Example]) -> list[Block]:
    out = []
    for ex in examples:
        start = end = ex.line  # ex.line is 1-based: the output starts on the next line, index ex.line
        while end < len(page_lines) and not page_lines[end].startswith(("$ ", "```")):
            end += 1
        out.append(Block(ex, start, end))
    return out


def printed(ex: Example, cwd: Path) -> str:
    return run(ex, cwd).output


def workdir(base: Path) -> Path:
    """A directory the pages' commands run in, as the walkthrough's: the recipes at `recipes/`."""
    (base / "recipes").symlink_to(REPO / "recipes")
    return base


def rewrite(outputs: list[tuple[Example, str]]) -> list[str]:
    """Rewrite the blocks of these examples, each from its command's output, in place; the pages changed."""
    by_page: dict[str, list[tuple[Example, str]]] = {}
    for ex, output in outputs:
        by_page.setdefault(ex.page, []).append((ex, output))
    changed = []
    for page, pairs in by_page.items():
        path = REPO / page
        lines = path.read_text().splitlines()
        found = blocks(lines, [ex for ex, _ in pairs])
        for b, (ex, output) in reversed(list(zip(found, pairs, strict=True))):
            kind = EXACT if generated(ex) else MEASURED
            lines[b.start:b.end] = refreshed(lines[b.start:b.end], output, ex.where, kind)
        text = "\n".join(lines) + "\n"
        if text != path.read_text():
            path.write_text(text)
            changed.append(page)
    return changed


def main(argv: list[str]) -> int:
    """`--runs`: follow the whole walkthrough (it launches, calibrates and resumes, minutes on a small machine)
    and rewrite every block, the measured figures of real runs too; without it, only the cheap commands'."""
    with tempfile.TemporaryDirectory() as tmp:
        cwd = workdir(Path(tmp))
        try:
            if "--runs" in argv:
                (cwd / "recipes").unlink()  # follow() links what it needs
                walk = follow(cwd)
                changed = rewrite([(r.example, r.output) for r in walk.results if r.example.expected is not None])
            else:
                changed = rewrite([(ex, printed(ex, cwd)) for ex in generated_examples()])
        except Stale as e:
            print(f"{e}\nedit the block by hand (keep the lines the page needs), then run {REGENERATE} again",
                  file=sys.stderr)
            return 1
    print("rewrote " + ", ".join(changed) if changed else "every block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
