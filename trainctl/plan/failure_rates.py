"""Published interruption rates of real training fleets, per GPU, so a job's MTBF scales with its size. Pure
data and arithmetic, no torch.

Each fleet's rate is what its operators published: interruptions over a span of days on a number of GPUs. The
per-GPU MTBF is GPU-hours per interruption (days x 24 x GPUs / interruptions), and a job of G GPUs fails on
average every (per-GPU MTBF / G) hours: interruptions of independent GPUs add up. A run picks its fleet with
`checkpoint.failure_fleet`; by default the fleet of its accelerator's generation (FLEET_OF_GPU), else Llama 3's
(the largest published record). `checkpoint.mtbf_hours` overrides any fleet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fleet:
    key: str
    interruptions: int  # interruptions counted in the span
    days: float  # the span
    gpus: int  # GPUs of the job they struck
    gpu: str  # the accelerator
    cite: str  # the publication, short
    source: str  # where the numbers are published, and what they count

    @property
    def gpu_hours_per_failure(self) -> float:
        """The per-GPU MTBF, hours: GPU-hours of the record per interruption."""
        return self.days * 24.0 * self.gpus / self.interruptions

    def job_mtbf_hours(self, gpus: float) -> float:
        return self.gpu_hours_per_failure / max(1, gpus)

    def describe(self, gpus: float) -> str:
        """Where a job's MTBF comes from, in one phrase."""
        return (f"{self.gpu_hours_per_failure:,.0f} GPU-hours per interruption / {gpus:,.0f} GPUs: fleet {self.key} "
                f"({self.interruptions} interruptions in {self.days:g} days on {self.gpus:,} {self.gpu}; "
                f"{self.cite})")


FLEETS: dict[str, Fleet] = {f.key: f for f in (
    Fleet(key="llama3-h100", interruptions=419, days=54.0, gpus=16384, gpu="H100 80GB",
          cite="Llama 3, Dubey et al. 2024, sec. 3.3.4",
          source="Dubey et al., The Llama 3 Herd of Models (2024), sec. 3.3.4 and Table 5: 419 unexpected "
                 "interruptions in a 54-day snapshot of 405B pre-training on 16,384 H100 GPUs"),
    Fleet(key="opt175b-a100", interruptions=105, days=60.0, gpus=992, gpu="A100 80GB",
          cite="OPT-175B, Zhang et al. 2022, sec. 2.5",
          source="Zhang et al., OPT: Open Pre-trained Transformer Language Models (2022), sec. 2.5: hardware "
                 "failures caused at least 35 manual restarts and, by the paper's estimate from the over 100 hosts "
                 "cycled out, 70+ automatic restarts over the 2 months of OPT-175B's training on 992 A100 80GB "
                 "GPUs: 105 interruptions, hardware failures only (Llama 3's 419 count every unexpected one)"),
)}
DEFAULT_FLEET = "llama3-h100"
# an accelerator's catalog name prefix -> the fleet of its generation (hardware/catalog.py names)
FLEET_OF_GPU = {"a100": "opt175b-a100", "h100": "llama3-h100", "h200": "llama3-h100"}


def fleet_for(gpu: str, chosen: str | None) -> Fleet:
    """The fleet the spec names, else its accelerator generation's, else DEFAULT_FLEET."""
    if chosen is not None:
        return FLEETS[chosen]
    key = next((k for prefix, k in FLEET_OF_GPU.items() if gpu.lower().startswith(prefix)), DEFAULT_FLEET)
    return FLEETS[key]
