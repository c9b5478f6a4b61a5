"""The run spec: pydantic models, YAML loading, overrides and consistency rules (no torch)."""

from trainctl.spec.loader import frozen_text, load_spec, load_spec_text, resolved_dict, validate_spec
from trainctl.spec.models import RunSpec

__all__ = ["RunSpec", "frozen_text", "load_spec", "load_spec_text", "resolved_dict", "validate_spec"]
