"""docs/reference/spec.md and cli.md are generated from the code (trainctl/cli/reference.py): the committed pages
must say what the spec models and the CLI say now, and every spec field must have something to say."""

from __future__ import annotations

import pytest
from paths import REPO

from trainctl.cli import reference


@pytest.mark.parametrize("page", sorted(reference.PAGES))
def test_committed_page_is_what_the_code_generates(page):
    committed = REPO / "docs" / "reference" / page
    assert committed.is_file(), f"docs/reference/{page} is missing: run `{reference.REGENERATE}`"
    assert committed.read_text() == reference.PAGES[page](), (
        f"docs/reference/{page} is out of date with the code: run `{reference.REGENERATE}` and commit the result")


def test_every_spec_field_has_a_description():
    missing = [key for key, field in reference.spec_fields() if not (field.description or "").strip()]
    assert not missing, f"spec fields without Field(description=...) in trainctl/spec/models.py: {missing}"


def test_every_spec_section_is_reached():
    # the walk must find the nested models (list entries and optional sections included), or their fields
    # would silently have no table and no description check
    paths = {s.path for s in reference.spec_sections()}
    assert {"model.moe", "parallel.grad_compression.powersgd", "data.blend[]", "launcher.nccl",
            "tracking.wandb"} <= paths
