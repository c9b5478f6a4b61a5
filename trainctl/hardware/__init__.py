"""Accelerator and interconnect catalog (no torch)."""

from trainctl.hardware.catalog import ACCELERATORS, FABRICS, Accelerator, Fabric

__all__ = ["ACCELERATORS", "FABRICS", "Accelerator", "Fabric"]
