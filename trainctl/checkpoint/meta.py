"""What the trainer records about a run in a checkpoint's manifest (parallel layout, model shape), and how
a spec compares with it. No torch: `trainctl resume` checks a checkpoint before queueing a job, the
trainer checks it again at load (a checkpoint may have been chosen by an automatic restart)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainctl.checkpoint.format import CheckpointInfo
    from trainctl.spec import RunSpec


def layout_of(spec: RunSpec) -> dict[str, Any]:
    """The parallel layout a checkpoint was written with (manifest meta "layout")."""
    p = spec.parallel
    return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": spec.dp, "ep": p.ep, "zero": p.zero, "schedule": p.schedule,
            "virtual_stages": p.virtual_stages, "sequence_parallel": p.sequence_parallel,
            "micro_batch": p.micro_batch, "world_size": spec.world_size}


def model_of(spec: RunSpec) -> dict[str, Any]:
    """The model shape a checkpoint was written with (manifest meta "model"); where its first weights came from
    (`init_from`) is not part of its shape: a run started from one source may be continued by another spec."""
    return spec.model.model_dump(mode="json", exclude={"init_from"})


def model_differences(spec: RunSpec, meta: dict[str, Any]) -> list[str]:
    """'model.hidden: checkpoint 64, this run 128' for every model field that differs; [] when the same."""
    saved = meta.get("model") or {}
    return [f"model.{k}: checkpoint {saved.get(k)!r}, this run {v!r}"
            for k, v in model_of(spec).items() if saved.get(k) != v]


def different_model(spec: RunSpec, info: CheckpointInfo) -> str | None:
    """Why checkpoint `info` cannot be continued by `spec` (another model shape, named field by field), or None."""
    diffs = model_differences(spec, info.meta)
    if not diffs:
        return None
    return f"{info.path}: checkpoint of step {info.step} is for a different model shape ({'; '.join(diffs)})"


def saved_layout(meta: dict[str, Any]) -> dict[str, Any]:
    """A manifest's layout; checkpoints written before context parallelism have no "cp": it was 1."""
    old = meta.get("layout") or {}
    return {"cp": 1, **old} if old else {}


def same_layout(spec: RunSpec, meta: dict[str, Any]) -> bool:
    """The checkpoint was written with this spec's layout (its per-rank state, RNG included, applies as is)."""
    return saved_layout(meta) == layout_of(spec)


def layout_changes(spec: RunSpec, meta: dict[str, Any]) -> list[str]:
    """'tp 2 -> 4' for every layout setting that differs from the checkpoint's (resharded at load)."""
    old = saved_layout(meta)
    return [f"{k} {old[k]} -> {v}" for k, v in layout_of(spec).items() if k in old and old[k] != v]


def describe_layout(layout: dict[str, Any] | None) -> str:
    """'tp2 pp4 (v2) dp8 zero1' for a manifest's layout; '-' when the checkpoint has none."""
    if not layout:
        return "-"
    v = layout.get("virtual_stages") or 1
    pp = f"pp{layout.get('pp')}" + (f" (v{v})" if v > 1 else "")
    cp = f"cp{layout['cp']} " if (layout.get("cp") or 1) > 1 else ""
    ep = layout.get("ep") or 1
    dp = f"dp{layout.get('dp')}" + (f" ep{ep}" if ep > 1 else "")
    return f"tp{layout.get('tp')} {cp}{pp} {dp} zero{layout.get('zero')}"
