"""The README and the docs/ pages followed as a user would: their examples parsed, then run in order in one
working directory.

The README comes first, then the pages of PAGES in that order (a page may use what an earlier one made:
the README's runs/quick, the token file and the calibration profile of the pages before), then any other
docs/ page with examples, by name. Shared by tests/dist/test_readme_examples.py (every example does what its
page says) and the tests that check the walkthrough's runs in more depth (test_calibrate: its calibration
and its quick run), so the launches and the calibration run once per session (tests/conftest.py
`readme_walkthrough`).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cli_utils import trainctl
from data_utils import write_bpe_tokenizer, write_jsonl_corpus
from paths import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
# the docs/ pages, in the order they are followed after the README: a page's examples may use what an earlier
# page's made (runs/quick is the README's, sample.bin interop.md's, calibration-tiny-cpu.json plan-and-calibrate.md's)
PAGES = ("spec.md", "plan-and-calibrate.md", "launching.md", "resume-and-failures.md", "mfu-report.md",
         "interop.md", "extending.md", "results.md")
MEASURING = ("launch", "resume", "calibrate", "mfu-report", "checkpoints", "data check", "status", "runs")
SLURM_ELSEWHERE = "recipes/llama3-70b.yaml"


_NUM = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?k?"
_TIME = rf"(?:{_NUM} ?(?:ns|µs|us|ms|s)|\d+m \d+s|\d+h \d+m)"
_SIZE = rf"{_NUM} ?(?:B|kB|MB|GB|TB|KiB|MiB|GiB|TiB)"
# A page's token that varies with the machine or the moment, and the pattern its place accepts (no capturing
# group in either): in a command that measures, these may differ from the page's; the first is the page's `...`.
VARYING = [
    (r"\.\.\.|…", r".*?"),
    (r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[+-]\d{2}:\d{2}|Z)?", r"\S+"),
    (r"\d{4}-\d{2}-\d{2}", r"\d{4}-\d{2}-\d{2}"),
    (r"\d{2}:\d{2}:\d{2}", r"\d{2}:\d{2}:\d{2}"),
    (r"(?<=-)\d{8}-\d{6}(?:-\d+)?", r"\d{8}-\d{6}(?:-\d+)?"),  # runs/<name>-<YYYYmmdd-HHMMSS>
    (rf"(?<![\w.])(?:\d+m \d+s|\d+h \d+m|{_NUM} ?(?:ns|µs|us|ms|s))(?![\w/])", _TIME),
    (rf"(?<![\w.]){_NUM} ?(?:B|kB|MB|GB|TB|KiB|MiB|GiB|TiB)(?!\w)", _SIZE),
    (r"(?<![\w.])(?:\d[\d,]*\.\d+(?:e[-+]?\d+)?k?|\d{1,3}(?:,\d{3})+|\d+(?=%|k\b| ?tok/s|/gpu|/rank))", _NUM),
]
VARYING_RE = re.compile("|".join(f"({p})" for p, _ in VARYING))


@dataclass
class Example:
    command: str  # as the page writes it, without "$ " and a trailing "# comment"
    expected: list[str] | None  # the output lines the page shows; None for a ```bash line
    page: str  # README.md, docs/spec.md, ...
    line: int  # 1-based line in the page
    args: list[str] = field(default_factory=list)  # what runs (ADAPTED applied)
    why: str = ""  # the adaptation, if any

    @property
    def measuring(self) -> bool:
        words = self.command.split()[1:3]
        return any(" ".join(words).startswith(m) for m in MEASURING) or "--calibration" in self.command

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The pages the walkthrough follows, in order: the README, PAGES, then any other docs/ page by name."""
    ordered = [README, *(DOCS / name for name in PAGES)]
    return ordered + sorted(p for p in DOCS.rglob("*.md") if p not in ordered)


def all_examples() -> list[Example]:
    """Every page's examples, in the order the walkthrough runs them."""
    return [ex for page in pages() for ex in examples(page.read_text(), page.relative_to(REPO).as_posix())]


def examples(text: str, page: str = "README.md") -> list[Example]:
    """A page's examples, in order."""
    out: list[Example] = []
    block: str | None = None
    current: Example | None = None  # the $ example of this block whose output lines follow
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```"):
            block = raw[3:].strip() if block is None else None
            current = None
            continue
        if block == "text" and raw.startswith("$ trainctl "):
            current = Example(_command(raw[2:]), [], page, n)
            out.append(current)
        elif block == "text" and raw.startswith("$ "):
            raise AssertionError(f"{page}:{n}: a $ example this test cannot run: {raw}")
        elif current is not None and current.expected is not None and raw.strip():
            current.expected.append(raw)
        elif block == "bash" and raw.startswith("trainctl "):
            out.append(Example(_command(raw), None, page, n))
    for ex in out:
        ex.args, ex.why = adapted(ex)
    return out


def _command(text: str) -> str:
    words = shlex.split(text, comments=True)
    return shlex.join(words)


def adapted(ex: Example) -> tuple[list[str], str]:
    """ADAPTED: what a ```bash command runs here, and why it differs from the page's line."""
    args = shlex.split(ex.command)[1:]
    why = []
    slurm = args[0] == "launch" and SLURM_ELSEWHERE in args
    if ex.expected is None and args[0] in ("launch", "resume") and "--dry-run" not in args:
        args.append("--dry-run")
        why.append("--dry-run: it would submit to Slurm" if slurm else "--dry-run: the `$` examples train")
    if slurm:
        why.append("its Slurm cluster is elsewhere: no sinfo")
    return args, "; ".join(why)


# --- running an example ----------------------------------------------------------------------------------------


@dataclass
class Result:
    example: Example
    returncode: int
    output: str


def run(ex: Example, cwd: Path) -> Result:
    env = {"TRAINCTL_FAULTS": None, "TRAINCTL_WATCHDOG_S": None,
           "COLUMNS": "120"}  # the width the pages' tables were printed at
    if ex.args[0] == "launch" and SLURM_ELSEWHERE in ex.args:
        env["PATH"] = str(Path(sys.executable).parent)  # no sinfo: the shared Slurm test cluster is not ours
    p = trainctl(*ex.args, cwd=cwd, env=env, timeout=600)
    # the pages show paths relative to the directory they are followed in
    output = (p.stdout + p.stderr).replace(f"{cwd}/", "")
    return Result(ex, p.returncode, output)


@dataclass(frozen=True)
class Walkthrough:
    cwd: Path  # where it was followed: runs/quick, calibration-tiny-cpu.json... are here
    results: list[Result]

    def result(self, command_prefix: str) -> Result:
        """The first example whose command, as its page writes it, starts with `command_prefix`."""
        return next(r for r in self.results if r.example.command.startswith(command_prefix))


def follow(cwd: Path) -> Walkthrough:
    for name in ("recipes", "trainctl"):  # the README is followed from the repository root
        (cwd / name).symlink_to(REPO / name)
    # the files the Megatron example names (a local tokenizer.json and a .jsonl corpus)
    write_bpe_tokenizer(cwd / "tokenizer.json")
    write_jsonl_corpus(cwd / "corpus.jsonl")
    return Walkthrough(cwd, [run(ex, cwd) for ex in all_examples()])
