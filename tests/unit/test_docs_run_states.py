"""docs/design/run-states.md's states table is the state model trainctl/rundir/runstate.py implements: the same
states, and for each finished one the exit code its attempt ends with."""

from __future__ import annotations

import re

from paths import REPO

from trainctl.rundir import runstate

PAGE = REPO / "docs" / "design" / "run-states.md"


def states_table() -> dict[str, str]:
    """The first table under "## Run states": state -> the exit-code cell."""
    section = PAGE.read_text().split("\n## Run states\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| state | meaning | active | exit code")
    out = {}
    for row in rows[1:]:  # the separator row starts "|---"
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 4:  # the transitions table that follows has three columns
            break
        out[cells[0]] = cells[3]
    return out


def test_the_page_lists_the_states_the_code_has() -> None:
    code = {v for k, v in vars(runstate).items() if re.fullmatch(r"[A-Z]+", k) and isinstance(v, str) and v == k}
    assert set(states_table()) == code


def test_the_page_gives_each_finished_state_its_exit_code() -> None:
    table = states_table()
    assert {s: int(table[s]) for s in runstate.EXIT_CODE} == runstate.EXIT_CODE
    assert all(table[s] == "" for s in table if s not in runstate.EXIT_CODE)
