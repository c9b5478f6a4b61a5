"""Every figure the docs show for `plan` and `validate` is what the command prints now (tests/docs_figures.py:
the blocks, and `python tests/docs_figures.py` to regenerate them). Each command runs once, in a directory with
the recipes, as the walkthrough runs it."""

from __future__ import annotations

import re

import pytest
from docs_figures import MEASURED, REGENERATE, Stale, blocks, generated_examples, printed, refreshed, workdir
from paths import REPO


def test_the_generated_blocks_are_found() -> None:
    commands = [ex.command for ex in generated_examples()]
    assert len(commands) >= 8
    assert {c.split()[1] for c in commands} == {"plan", "validate"}


def test_every_generated_block_is_what_its_command_prints(tmp_path) -> None:
    cwd = workdir(tmp_path)
    stale = []
    for ex in generated_examples():
        lines = (REPO / ex.page).read_text().splitlines()
        block = next(b for b in blocks(lines, [ex]))
        shown = lines[block.start:block.end]
        try:
            now = refreshed(shown, printed(ex, cwd), ex.where)
        except Stale as e:
            stale.append(str(e))
            continue
        stale += [f"{ex.where}: shows\n    {old}\n  the command prints\n    {new}"
                  for old, new in zip(shown, now, strict=True) if old != new]
    assert not stale, "\n".join(stale) + f"\nrun `{REGENERATE}` and commit the result"


SHOWN = ["Memory per GPU (worst: pipeline rank 0, 2,163,785,728 params)",
         "│ total     │ 37.85 GB │",
         "...",
         "step 19.39 s | ... | MFU 41.1%"]


def test_a_regeneration_brings_figures_up_to_date_and_keeps_what_the_page_left_out() -> None:
    output = "\n".join(["Memory per GPU (worst: pipeline rank 0, 2,000,000,001 params)",
                        "│ weights   │ 1.5 GB │",
                        "│ total     │ 138.5 GB │",
                        "other line",
                        "step 7.5 s | 1,024 tok/s | 4.2 TFLOP/s | MFU 9.0%"])
    assert refreshed(SHOWN, output, "page:1") == [
        "Memory per GPU (worst: pipeline rank 0, 2,000,000,001 params)",
        "│ total     │ 138.5 GB │",  # the whole line as printed: its padding follows the figure
        "...",
        "step 7.5 s | ... | MFU 9.0%"]  # a line the page abridged keeps its `...`
    assert refreshed(SHOWN, output.replace("1.5 GB", "1.5 GB"), "page:1") != SHOWN


def test_a_measured_block_takes_a_new_runs_times_and_keeps_its_counts() -> None:
    """A real run's figures vary (times, rates, sizes) and are regenerated from a new run; its counts (the step
    numbers) are the page's: `step 3/3` takes the third step's figures, not the second's."""
    shown = ["step 1/3 | loss 5.5608 | 772.6 ms | 1.3k tok/s (166/rank) | ... | MFU 0.26%",
             "...",
             "step 3/3 | loss 5.3199 | 478.9 ms | 2.1k tok/s (267/rank) | ... | MFU 0.43%"]
    output = "\n".join(f"step {n}/3 | loss 5.{n}000 | {n}00.5 ms | {n}.0k tok/s ({n}11/rank) | x | MFU 0.{n}0%"
                       for n in (1, 2, 3))
    assert refreshed(shown, output, "page:1", MEASURED) == [
        "step 1/3 | loss 5.1000 | 100.5 ms | 1.0k tok/s (111/rank) | ... | MFU 0.10%",
        "...",
        "step 3/3 | loss 5.3000 | 300.5 ms | 3.0k tok/s (311/rank) | ... | MFU 0.30%"]


def test_a_line_the_command_no_longer_prints_is_not_guessed() -> None:
    with pytest.raises(Stale, match="page:7"):
        refreshed(SHOWN, "Memory per GPU (worst: pipeline rank 0, 5 params)\n│ total │ 3 GB │\nstep 1 s", "page:7")


def test_no_figure_hides_in_a_command_comment() -> None:
    """What a command prints is shown under its `$` line, where the test above holds it to the command; a
    ```bash line's comment restating a printed figure (GB, %, seconds) would go stale unseen."""
    figure = re.compile(r"\d[\d.,]*\s?(?:GB|GiB|MB|MiB|TB|%|ms|s|days|GPU-hours|TFLOP/s)\b")
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        block = None
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                block = line[3:].strip() if block is None else None
            elif block == "bash" and "#" in line and figure.search(line.split("#", 1)[1]):
                found.append(f"{page.relative_to(REPO)}:{n}: {line}")
    assert not found, "show the output under a `$` line of a ```text block instead:\n" + "\n".join(found)
