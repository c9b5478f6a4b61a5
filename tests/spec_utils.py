"""The spec-error lines a spec text gives (the one helper of the spec-rule tests)."""

from __future__ import annotations

import pytest

from trainctl.errors import SpecError
from trainctl.spec import load_spec_text


def problems(text: str, *overrides: str) -> list[str]:
    """Every line of the SpecError that `text` with `overrides` raises (source named s.yaml)."""
    with pytest.raises(SpecError) as err:
        load_spec_text(text, "s.yaml", overrides)
    return err.value.message.splitlines()


def one_problem(text: str, *overrides: str) -> str:
    """The one line of that SpecError (a test fails if there are more)."""
    found = problems(text, *overrides)
    assert len(found) == 1, found
    return found[0]
