"""Shared pytest fixtures. `tests/` is on sys.path (no __init__.py), so sibling helpers import by name."""

from slurm_fixtures import slurm_cluster  # noqa: F401  (session fixture: the real local Slurm cluster)
