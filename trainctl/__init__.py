"""trainctl: plan, launch, resume and measure Megatron-style training runs."""

__version__ = "0.1.0"
