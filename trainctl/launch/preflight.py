"""`trainctl preflight SPEC` and `trainctl launch --preflight`: check the nodes before training, through the
same launch backend as `trainctl launch` (the worker is trainctl/runtime/workers/preflight.py), and judge them
(trainctl/launch/node_health.py). No torch.

The preflight job has a run directory of its own (default runs/preflight/<name>-<time>): a run directory the
launch will create is not touched, and an existing one (a resume) loses nothing if the preflight fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.launch.backend import PREFLIGHT_MODULE, Say
from trainctl.launch.create import default_run_dir
from trainctl.launch.node_health import NodeVerdict, Thresholds, judge
from trainctl.launch.worker_job import run_worker
from trainctl.rundir.paths import RunPaths
from trainctl.spec import RunSpec, validate_spec

PROGRESS = "preflight: "  # how the worker's rank 0 starts each progress line (trainctl/runtime/workers/preflight.py)
POLL_S = 1.0  # a preflight job takes seconds: ask Slurm often whether it has ended


@dataclass(frozen=True)
class Preflight:
    paths: RunPaths  # the preflight job's own run directory
    result: dict[str, Any]  # what the worker measured (RUN/preflight.json)
    verdicts: list[NodeVerdict]
    thresholds: Thresholds

    @property
    def bad(self) -> list[NodeVerdict]:
        return [v for v in self.verdicts if not v.ok]

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.paths.root), "ok": not self.bad, "bad_nodes": [v.node for v in self.bad],
                "thresholds": {k: getattr(self.thresholds, k) for k in Thresholds.OPTIONS},
                "nodes": [v.to_json() for v in self.verdicts], "measured": self.result}


def preflight_spec(spec: RunSpec, nodes: int, checkpoint_dir: Path) -> RunSpec:
    """The spec the worker runs: the spec's cluster and launcher on `nodes` nodes (more than the run needs
    gives spares to choose from), one rank per GPU with no model parallelism (it trains nothing), synthetic
    data, and the run's checkpoint directory to check."""
    if nodes < 1:
        raise UsageError(f"--nodes {nodes} is out of range", hint="give 1 or more nodes to check")
    data = spec.model_dump(mode="json", exclude_none=True)
    data["cluster"].update(nodes=nodes)
    data["cluster"].pop("calibration", None)
    data["launcher"]["backend"] = spec.backend  # `auto` would resolve by the node count, which changed
    data["parallel"] = {"micro_batch": 1}
    data["train"]["global_batch"] = nodes * spec.cluster.gpus_per_node
    data["data"] = {"synthetic": True}
    data["checkpoint"]["dir"] = str(checkpoint_dir.absolute())
    data["model"].pop("init_from", None)
    return validate_spec(data, "<preflight>")


def needed_bytes(spec: RunSpec) -> int | None:
    """Free space the run's checkpoints need at their peak (launch/diskspace.py's rule), None if it saves none."""
    ck = spec.checkpoint
    if not (ck.every_steps or ck.every_minutes):
        return None
    from trainctl.plan.checkpoint_size import checkpoint_bytes

    return (ck.keep_last + 1) * checkpoint_bytes(spec)


def run_preflight(spec: RunSpec, thresholds: Thresholds, say: Say, *, nodes: int | None = None,
                  run_dir: Path | None = None, target_run_dir: Path | None = None) -> Preflight:
    """Check `nodes` nodes (default the spec's) for the run that will live in `target_run_dir` (its checkpoint
    directory is checked; default the spec's own); UsageError on a bad threshold, RunError if the job fails."""
    from trainctl.checkpoint import resolve_checkpoint_dir

    thresholds.check()
    target = target_run_dir or default_run_dir(spec)
    pf = preflight_spec(spec, nodes or spec.cluster.nodes, resolve_checkpoint_dir(target, spec))
    # a launch's preflight sits beside the run directory it checks for; a plain one under runs/preflight/
    own = run_dir or (target.with_name(f"{target.name}-preflight") if target_run_dir is not None
                      else default_run_dir(spec, base=Path("runs") / "preflight"))
    paths = run_worker(pf, own, PREFLIGHT_MODULE,
                       "preflight", "preflight", PROGRESS, say, poll_s=POLL_S)
    result = json.loads(paths.preflight.read_text(encoding="utf-8"))
    return Preflight(paths, result, judge(result, thresholds, needed_bytes=needed_bytes(spec)), thresholds)
