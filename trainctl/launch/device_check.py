"""Before a local launch: a spec for GPUs on a machine without one trains on the CPU. No torch.

The trainer picks CUDA when torch sees a GPU and the CPU (gloo) otherwise, so an H100 spec launched on a
laptop or a CPU login node runs, thousands of times slower than its plan. Say so before anything starts;
`mfu-report` then does not hold the run against that plan (report/summary.py, `other_hardware`).
"""

from __future__ import annotations

from trainctl.hardware.detect import has_gpu
from trainctl.spec import RunSpec


def cpu_fallback_problem(spec: RunSpec) -> str | None:
    """The warning for a local run of a GPU spec here without a GPU; None when there is nothing to say."""
    if spec.backend != "local" or spec.cluster.gpu == "cpu" or has_gpu():
        return None
    return (f"cluster.gpu = {spec.cluster.gpu}, but this machine has no GPU: the {spec.world_size} ranks train on "
            f"the CPU (gloo), far slower than the plan for {spec.cluster.gpu}, and `trainctl mfu-report` will not "
            "compare the run with that plan. Fix: --set cluster.gpu=cpu to plan for this machine, or launch "
            "where the GPUs are")
