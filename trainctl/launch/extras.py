"""Before a run: the optional libraries its spec switches on are installed. Found, never imported here.

The CLI refuses (exit 2) a spec whose tracking sinks it could not load, before anything is queued or started;
importlib's finder only looks the package up, so `validate` stays as fast as without it (a test checks that
neither tensorboard nor wandb is imported). The ranks import them lazily (runtime/observe/tracking.py); where they run
in another environment without them, that sink is off with a warning and training goes on.
"""

from __future__ import annotations

import importlib.util

from trainctl.spec import RunSpec
from trainctl.spec.rules import problem

# field of the spec -> (top-level module the ranks import, extra of pyproject.toml that installs it)
_NEEDS = {"tracking.tensorboard": ("tensorboard", "tensorboard"), "tracking.wandb": ("wandb", "wandb")}


def missing_extras(spec: RunSpec) -> list[str]:
    """One problem line per switched-on sink whose library is not installed here."""
    t = spec.tracking
    # the field's value as the user wrote it, and how to switch it off
    on = {"tracking.tensorboard": (t.tensorboard or None, "false"),
          "tracking.wandb": (t.wandb.model_dump() if t.wandb is not None else None, "null")}
    out = []
    for field, (module, extra) in _NEEDS.items():
        value, off = on[field]
        if value is not None and importlib.util.find_spec(module) is None:
            out.append(problem(field, value, f"the {module} package is not installed here",
                               f"pip install 'trainctl[{extra}]', or set {field}: {off}"))
    return out
