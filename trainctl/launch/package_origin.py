"""Which trainctl the ranks import: the launcher's installed package, whatever their working directory holds.
No torch.

`python -m` puts the working directory first on sys.path. A rank started where a `trainctl/` folder lies (the
git clone, launched from its parent directory) imports that folder instead: as a namespace package without
`__version__` (an editable install still serves the submodules, so it trains until the first checkpoint
commit asks for the version), or another checkout's code. The launchers therefore start the ranks with
PYTHONSAFEPATH=1 (Python >= 3.11 leaves the working directory out of sys.path) and tell them where the
launcher's package lives; each rank checks what it imported before it trains (`problem`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_ENV = "TRAINCTL_PACKAGE"  # the launcher's package directory, when the ranks run its interpreter


def package_dir() -> Path | None:
    """The directory of the trainctl package this process imported; None for a namespace package (a folder
    named trainctl without __init__.py)."""
    import trainctl

    where = getattr(trainctl, "__file__", None)
    return Path(where).resolve().parent if where else None


def rank_variables(python: str | None) -> dict[str, str]:
    """The variables every rank starts with. The package directory only when the ranks run this interpreter
    (`python` None or sys.executable): launcher.python, e.g. a container's, has its own installation."""
    out = {"PYTHONSAFEPATH": "1"}
    here = package_dir()
    if here is not None and (python is None or os.path.abspath(python) == sys.executable):
        out[PACKAGE_ENV] = str(here)
    return out


def problem() -> str | None:
    """Why the trainctl this process imported is not the launcher's (one line), or None."""
    here = package_dir()
    if here is None:
        import trainctl

        folder = next(iter(getattr(trainctl, "__path__", [])), "?")
        return (f"trainctl was imported from {folder}, a folder without the package's __init__.py (the working "
                f"directory {os.getcwd()} holds a trainctl/ folder ahead of the installed package)")
    expected = os.environ.get(PACKAGE_ENV)
    if expected and Path(expected).resolve() != here:
        return f"trainctl was imported from {here}, not from the launcher's package {expected}"
    return None


PROBLEM_HINT = ("start the launch from another directory (Python 3.10 has no PYTHONSAFEPATH to keep the working "
                "directory out of the ranks' imports), or check PYTHONPATH")
