"""The real local Slurm cluster (slurm/), started once per session for the end-to-end tests."""

from slurm_fixtures import slurm_cluster  # noqa: F401  (session fixture)
