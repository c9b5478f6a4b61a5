"""`trainctl resume RUN`: relaunch an existing run directory from its newest valid checkpoint. No torch.

The trainer itself finds and loads the checkpoint at start (runtime/checkpoint/policy.py); this layer runs
the same search (trainctl.checkpoint.latest_valid) in the same directory (resolve_checkpoint_dir) to
decide which one that will be, shows it (and the invalid ones it skips), and relaunches with the run's
backend, appending to the same run directory (metrics.jsonl, events.jsonl, job.json attempts, logs/).

`--from-step N` rewinds: checkpoints after N are moved aside to `step-M.abandoned-<time>` (a name that
is never a resume candidate, kept for inspection), so neither this start nor any later automatic restart
continues the abandoned branch. `--set k=v` changes the frozen spec (e.g. a new allocation: dp and
cluster.gpus_per_node together); the previous spec.yaml is kept as spec.prev-<n>.yaml. spec.yaml edited by hand
since trainctl wrote it (job.json's `frozen_spec`: its sha256 and text) is taken as such a change: each field
shown, the text it replaced kept as spec.prev-<n>.yaml, a `spec_changed` event recorded; never used silently.

A token file whose size or content changed since the checkpoint was written is refused, naming it
(trainctl.data.identity); `--accept-data-change` continues on it and records the change. A data file at
another path (`--set data.path=...`) is a spec change, shown as such.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainctl.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    abandoned_dirname,
    different_model,
    find_step,
    latest_valid,
    layout_changes,
    list_checkpoints,
    owner,
    resolve_checkpoint_dir,
)
from trainctl.checkpoint.meta import saved_layout
from trainctl.data import identity as data_identity
from trainctl.data.identity import DataIdentity
from trainctl.errors import SpecError, TrainctlError, UsageError
from trainctl.fileio import bytes_digest, require_writable, write_atomic
from trainctl.launch import repair, secrets
from trainctl.launch.backend import backend_for
from trainctl.launch.create import (
    build_plan_json,
    freeze_spec,
    frozen_spec_record,
    read_job,
    write_frozen_spec,
    write_job,
)
from trainctl.launch.status import open_run, read_job_json
from trainctl.plan.lr_scaling import lr_unchanged_warning
from trainctl.rundir.paths import RunPaths, load_jsonl, read_jsonl, record_event
from trainctl.spec import RunSpec, load_spec, load_spec_text, resolved_dict


@dataclass(frozen=True)
class HandEdit:
    """RUN/spec.yaml edited by hand since trainctl wrote it (job.json's `frozen_spec` record): what changed, and
    the text it replaced."""

    changes: list[str]  # 'train.lr: 0.001 -> 0.5 (consequence)'; empty when only comments or layout of the text
    replaced: str


def hand_edit(paths: RunPaths, job: dict[str, Any], now: RunSpec) -> HandEdit | None:
    """How spec.yaml (read as `now`) differs from the record job.json keeps of what trainctl last wrote there;
    None when it is unchanged, or when there is no record (a run of an older trainctl, a rebuilt job.json)."""
    rec = job.get("frozen_spec")
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str) or not isinstance(rec.get("yaml"), str):
        return None
    try:
        if bytes_digest(paths.spec.read_bytes()) == rec["sha256"]:
            return None
        was = load_spec_text(rec["yaml"], source=f"{paths.job} (frozen_spec)")
    except (OSError, SpecError):
        return None
    return HandEdit(spec_changes(was, now), rec["yaml"])  # every field: the layout's too


def unrecorded_edits(paths: RunPaths) -> list[str]:
    """The fields of RUN/spec.yaml edited by hand since trainctl last wrote it, as a restarted attempt (a torchrun
    restart, a Slurm requeue) would find them: `trainctl resume` shows and records such edits, a restart must not
    train on them unseen. Empty when unchanged, changed only in comments or layout, or without job.json's record."""
    try:
        job = read_job_json(paths)
        now = load_spec(paths.spec)
    except TrainctlError:  # a damaged job.json or spec: the start says so on its own
        return []
    edit = hand_edit(paths, job, now)
    return edit.changes if edit is not None else []


@dataclass
class ResumePlan:
    paths: RunPaths
    spec: RunSpec
    backend: str
    checkpoint_dir: Path
    checkpoint: CheckpointInfo | None  # what the trainer will load (None: it starts from step 0)
    skipped: list[CheckpointInfo] = field(default_factory=list)  # invalid ones newer than it
    abandon: list[CheckpointInfo] = field(default_factory=list)  # --from-step: newer ones moved aside
    overrides: list[str] = field(default_factory=list)  # as recorded: a credential's value redacted
    last_logged_step: int | None = None
    spec_changes: list[str] = field(default_factory=list)  # `--set` changes that are not layout changes
    held_back: list[str] = field(default_factory=list)  # credentials of launcher.env --set now: not written
    warnings: list[str] = field(default_factory=list)  # what a careful engineer would ask about the change
    notes: list[str] = field(default_factory=list)  # what the run directory holds that a reader skips
    data: list[DataIdentity] = field(default_factory=list)  # the token files now (job.json "data" from here on)
    data_changes: list[str] = field(default_factory=list)  # accepted with --accept-data-change
    hand_edit: HandEdit | None = None  # spec.yaml differs from what trainctl last wrote there

    @property
    def hand_edits(self) -> list[str]:
        return self.hand_edit.changes if self.hand_edit else []
    claim: owner.Claim | None = None  # the run's id and its checkpoint directory's owner record, written by prepare

    def layout_changes(self) -> list[str]:
        """'tp 2 -> 4' for every parallel setting that differs from the checkpoint's (resharded at load)."""
        return layout_changes(self.spec, self.checkpoint.meta) if self.checkpoint else []

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.paths.root), "backend": self.backend, "checkpoint_dir": str(self.checkpoint_dir),
                "resume_step": self.checkpoint.step if self.checkpoint else None,
                "layout_changes": self.layout_changes(),
                "skipped": [{"step": i.step, "path": str(i.path), "reason": i.reason} for i in self.skipped],
                "abandoned": [i.step for i in self.abandon], "overrides": self.overrides,
                "spec_changes": self.spec_changes, "hand_edits": self.hand_edits, "data_changes": self.data_changes,
                "warnings": self.warnings,
                "notes": self.notes,
                "last_logged_step": self.last_logged_step, "steps": self.spec.train.steps}


def require_same_model(spec: RunSpec, info: CheckpointInfo) -> None:
    """A checkpoint of another model shape cannot be continued: say so before a job is queued."""
    problem = different_model(spec, info) if "model" in info.meta else None
    if problem:
        raise UsageError(problem, hint="resume with the model the checkpoint was written with")


def plan_resume(run_dir: Path, from_step: int | None = None, overrides: list[str] | None = None,
                accept_data_change: bool = False) -> ResumePlan:
    """Read the run directory and decide what the relaunch will do; changes nothing."""
    root = Path(run_dir).absolute()
    paths = open_run(Path(run_dir))
    if (damage := repair.spec_problem(paths.spec)) is not None:  # a file-system error's leftovers: --repair
        raise repair.DamagedSpec(paths, damage, read_job_json(paths))
    require_writable(root, f"run directory {run_dir}")  # the relaunch appends to it: refuse before any change
    paths.refuse_links()  # nothing is written through a symbolic link a copy or a hand put there
    before = load_spec(paths.spec)  # as frozen: what the run ran with so far
    loaded = load_spec(paths.spec, overrides or [])
    spec = freeze_spec(loaded)  # what is written back (--set): credentials held back, data paths absolute
    job = read_job_json(paths)  # damaged: how to repair it (exit 2)
    edited = hand_edit(paths, job, before)
    backend = str(job.get("backend") or spec.backend)
    # before anything is changed: its job may still be queued or running
    backend_for(backend).require_not_active(paths)
    ckdir = resolve_checkpoint_dir(root, spec)
    # before its checkpoints are read: another run's directory is neither resumed from, written nor pruned
    claim = owner.for_resume(ckdir, root, job, read_jsonl(paths.events))
    skipped: list[CheckpointInfo] = []
    abandon: list[CheckpointInfo] = []
    # deep: every file's checksum, as the trainer verifies before it loads, so both name the same step
    if from_step is not None:
        try:
            info: CheckpointInfo | None = find_step(ckdir, from_step, deep=True)
        except CheckpointError as e:
            raise UsageError(e.message, hint=e.hint) from e
        abandon = [i for i in list_checkpoints(ckdir) if i.step > from_step]
    else:
        info = latest_valid(ckdir, deep=True, skipped=skipped)
    metrics = load_jsonl(paths.metrics)
    last = max((r["step"] for r in metrics.records if isinstance(r.get("step"), int)), default=None)
    if info is not None:
        require_same_model(spec, info)
    data, changed = data_now(paths, spec, info, job, accept_data_change)
    if info is not None and info.step >= spec.train.steps:
        where = "at" if info.step == spec.train.steps else "past"
        raise UsageError(f"checkpoint step {info.step} is already {where} train.steps={spec.train.steps}: "
                         "nothing to run",
                         hint=f"train longer with --set train.steps=N (N > {info.step})")
    return ResumePlan(paths=paths, spec=spec, backend=backend, checkpoint_dir=ckdir, checkpoint=info, skipped=skipped,
                      abandon=abandon, overrides=[secrets.redact_override(o) for o in overrides or []],
                      last_logged_step=last, spec_changes=spec_changes(before, spec, layout_reported(info)),
                      hand_edit=edited, held_back=secrets.credential_names(loaded.launcher.env),
                      warnings=change_warnings(load_spec_text(edited.replaced) if edited else before, spec),
                      notes=[n for n in (metrics.skipped_note(paths.metrics),
                                         load_jsonl(paths.events).skipped_note(paths.events), claim.note) if n],
                      data=data, data_changes=changed, claim=claim)


def data_now(paths: RunPaths, spec: RunSpec, info: CheckpointInfo | None, job: dict[str, Any],
             accept_change: bool) -> tuple[list[DataIdentity], list[str]]:
    """The identity of the spec's token files now, and how each differs from the file the run trained on at
    the same path (the checkpoint's record; job.json's for a checkpoint without one, or none). A difference is
    refused (exit 2, naming the file) unless `accept_change`. A file at another path is a spec change."""
    in_job = data_identity.recorded(job.get("data"))
    trained = data_identity.recorded(info.meta.get("data")) if info is not None and "data" in info.meta else in_job
    return data_identity.compare(spec, trained, known=in_job, accept=accept_change, run=str(paths.root),
                                 since=f"checkpoint step {info.step}" if info else "the run recorded it")


def change_warnings(before: RunSpec, after: RunSpec) -> list[str]:
    """Warnings about what `--set` changed: a new global batch with the old learning rate."""
    lr = lr_unchanged_warning(before.train.global_batch, after.train.global_batch, before.train.lr, after.train.lr)
    return [lr] if lr else []


# What a change of a field (other than the layout, which layout_changes reports) does to a resumed run.
CONSEQUENCE = {
    "train.steps": "the LR schedule is a function of train.steps: its warm-up stays, its decay stretches or "
                   "shrinks from here on",
    "train.global_batch": "more or fewer sequences per step from here on; the data position is kept in "
                          "sequences and the LR schedule counts steps",
    "train.lr": "the LR schedule is rescaled from here on", "train.min_lr": "the decay's floor changes",
    "train.warmup": "the LR schedule changes from here on",
    "train.seed": "only a fresh start uses the seed: the resumed model, data order and RNG come from the checkpoint",
    "model": "another model shape cannot load this checkpoint",
    "data": "the data position (sequences consumed) is kept and applied to the new data",
}


def layout_reported(info: CheckpointInfo | None) -> set[str]:
    """The spec fields a `layout change:` line reports (ResumePlan.layout_changes): those of the checkpoint's
    recorded layout; none without a checkpoint. Every other change (cluster.nodes, a field of a checkpoint
    written without a layout) is a spec change line."""
    return {f"parallel.{k}" for k in saved_layout(info.meta)} if info is not None else set()


def spec_changes(before: RunSpec, after: RunSpec, reported: Collection[str] = ()) -> list[str]:
    """'train.steps: 25 -> 45 (consequence)' for every field `--set` changed, those in `reported` (the layout
    change lines') aside."""
    old, new = _flat(resolved_dict(before)), _flat(resolved_dict(after))
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key) or key in reported or key == "name":
            continue
        why = CONSEQUENCE.get(key) or CONSEQUENCE.get(key.split(".", 1)[0])
        out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}" + (f" ({why})" if why else ""))
    return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare(plan: ResumePlan) -> None:
    """Apply the plan to the run directory: move abandoned checkpoints aside, write a changed spec."""
    paths = plan.paths
    paths.logs.mkdir(exist_ok=True)  # a run directory copied or pruned without its logs still resumes
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for info in plan.abandon:
        target = info.path.with_name(abandoned_dirname(info.step, stamp))
        os.replace(info.path, target)
        record_event(paths, "checkpoint_abandoned", step=info.step, path=str(target),
                     reason=f"trainctl resume --from-step {plan.checkpoint.step if plan.checkpoint else None}")
    frozen = None
    if plan.overrides or plan.hand_edits:  # a hand edit is kept and recorded as a --set is
        n = 1
        while paths.previous_spec(n).exists():
            n += 1
        if plan.hand_edit is not None:  # what the run trained with is the text the edit replaced
            write_atomic(paths.previous_spec(n), plan.hand_edit.replaced, fsync=True)
        else:
            os.replace(paths.spec, paths.previous_spec(n))
        frozen = write_frozen_spec(paths, plan.spec)
        # the attempts from here on are held against the new spec's plan, the earlier ones against their own
        previous_plan = None
        if paths.plan.exists():
            os.replace(paths.plan, paths.previous_plan(n))
            previous_plan = paths.previous_plan(n).name
        write_atomic(paths.plan, build_plan_json(plan.spec), fsync=True)
        record_event(paths, "spec_changed", overrides=plan.overrides, hand_edits=plan.hand_edits,
                     previous=paths.previous_spec(n).name, previous_plan=previous_plan)
    job = read_job(paths)
    job["data"] = [i.to_json() for i in plan.data]  # what the ranks check at their start from now on
    # spec.yaml as it is now is what trainctl wrote (or, unchanged but for comments, accepted)
    job["frozen_spec"] = frozen or frozen_spec_record(paths.spec.read_text(encoding="utf-8"))
    if plan.claim is not None:  # the ranks check the owner record against this id at their start
        job["run_id"] = plan.claim.run_id
    write_job(paths, job)
    if plan.claim is not None:
        plan.claim.apply(plan.checkpoint_dir, paths.root)
    if plan.data_changes:
        record_event(paths, "data_changed", changes=plan.data_changes, accepted="--accept-data-change",
                     step=plan.checkpoint.step if plan.checkpoint else 0)
    record_event(paths, "resume_requested", backend=plan.backend,
                 step=plan.checkpoint.step if plan.checkpoint else 0,
                 skipped=[i.step for i in plan.skipped], abandoned=[i.step for i in plan.abandon])
