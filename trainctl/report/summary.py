"""The headline numbers of a run: step-time distribution, throughput, MFU/HFU, the peak used, and the plan's
prediction beside the measurement."""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import Attempt, median, percentile
from trainctl.report.load import RunData
from trainctl.rundir.paths import PLAN

CPU_NO_PREDICTION = ("the plan has no prediction for this run: its accelerator has no catalog peak (a CPU's "
                     "peak is measured at run time), so the planner cannot estimate step time or MFU")


def steady_steps(final: list[dict[str, Any]], attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Final step records without the first step of each attempt (warm-up: allocator, autotuning,
    lazy init) and the profiled steps (train.profile: the profiler's overhead) when enough steps remain to say
    anything."""
    firsts = {id(a.records[0]) for a in attempts if a.records}
    rest = [r for r in final if id(r) not in firsts and not r.get("profiled")]
    return rest if len(rest) >= 3 else final


def peak_info(run: RunData) -> dict[str, Any]:
    rec = run.metrics[-1] if run.metrics else {}
    source = rec.get("peak_source")
    if source is None:
        starts = run.events_of("start")
        source = starts[-1].get("peak_source") if starts else None
    tflops = rec.get("peak_tflops_per_gpu")
    return {"tflops_per_gpu": tflops, "source": source or "unknown (not recorded by this trainer version)",
            "convention": mfu_convention(((run.spec or {}).get("train") or {}).get("precision"), source)}


def mfu_convention(precision: str | None, source: str | None) -> str:
    """What MFU is measured against (docs/design/memory.md, "MFU convention"): the dense BF16 peak for fp8 runs
    too, as torchtitan and Megatron report FP8 runs, so that an fp8 and a bf16 run of one model compare directly;
    on a CPU, where FP8 is emulated, the measured matmul rate as for any CPU run."""
    if precision != "fp8":
        return f"{precision or 'unknown'} run: MFU against the peak of its precision"
    if source and source.startswith("measured"):
        return "fp8 run, FP8 emulated on the CPU: MFU against the measured matmul rate, as for any CPU run"
    return ("fp8 run: MFU against the dense BF16 peak, as torchtitan and Megatron report; its linear layers' "
            "GEMMs run against an FP8 peak about twice that")


def mfu_bug(final: list[dict[str, Any]]) -> dict[str, Any] | None:
    """MFU above 100% cannot happen: it means the FLOPs or the timing are wrong, so it is not a result."""
    bad = [r for r in final if r.get("mfu_bug") or (r.get("mfu") or 0) > 1.0]
    if not bad:
        return None
    return {"steps": [r["step"] for r in bad][:20], "max_mfu": max(r.get("mfu") or 0 for r in bad),
            "message": "MFU above 100% of the peak: a FLOPs-accounting or timing bug (or a wrong peak), "
                       "not a result; MFU/HFU are withheld"}


def summarize(run: RunData, final: list[dict[str, Any]], attempts: list[Attempt]) -> dict[str, Any]:
    steady = steady_steps(final, attempts)
    st = [float(r["step_time_s"]) for r in steady]
    field = lambda k: [float(r[k]) for r in steady if r.get(k) is not None]  # noqa: E731
    bug = mfu_bug(final)
    out: dict[str, Any] = {
        "steps_completed": max((r["step"] for r in final), default=0),
        "steps_target": (final[-1].get("steps") if final else None),
        "records": len(run.metrics),
        "steps_in_stats": len(steady),
        "stats_note": ("first step of each attempt excluded (warm-up)"
                       + (", profiled steps too" if any(r.get("profiled") for r in final) else "")
                       if len(steady) < len(final) else "all steps"),
        "world_size": final[-1].get("world_size") if final else None,
        "tokens_per_step": final[-1].get("tokens") if final else None,
        "model_flops_per_step": final[-1].get("model_flops_per_step") if final else None,  # 6N + 12Lhs per token
        "step_time_s": {"median": median(st), "p10": percentile(st, 10), "p90": percentile(st, 90),
                        "min": min(st, default=None), "max": max(st, default=None)},
        "tokens_per_s": median(field("tokens_per_s")),
        "tokens_per_s_per_gpu": median(field("tokens_per_s_per_gpu")),
        "tflops_per_gpu": median(field("tflops_per_gpu")),
        "mfu": None if bug else {"median": median(field("mfu")), "best10": percentile(field("mfu"), 90)},
        "hfu": None if bug else {"median": median(field("hfu")), "best10": percentile(field("hfu"), 90)},
        "mfu_bug": bug,
        "peak": peak_info(run),
        "final_loss": final[-1].get("loss") if final else None,
    }
    out["plan"] = plan_comparison(run, out)
    return out


def devices(run: RunData) -> set[str]:
    """Where the ranks really computed ("cpu", "cuda"), from their step-time headers; empty if not recorded."""
    return {str(h.get("device", "")).partition(":")[0] for rs in run.steptimes.values() for h in rs.headers
            if h.get("device")}


def other_hardware(run: RunData) -> str | None:
    """Why the plan's times cannot be held against this run: it was planned for GPUs but ran on the CPU (a GPU
    spec launched on a machine without one trains there); None when it ran where it was planned for."""
    planned = ((run.plan or {}).get("hardware") or {}).get("gpu")
    if not planned or planned == "cpu" or devices(run) != {"cpu"}:
        return None
    return (f"the run trained on the CPU (no GPU where it ran) but its plan is for {planned}: a CPU step says "
            f"nothing about a step on {planned}, so the plan's step time and MFU are not compared with it (launch "
            "where the GPUs are, or plan for this machine with cluster.gpu: cpu and `trainctl calibrate`)")


def plan_comparison(run: RunData, s: dict[str, Any]) -> dict[str, Any]:
    """The plan's prediction beside the measurement, or why there is none to compare ("reason")."""
    pred = (run.plan or {}).get("prediction") or {}
    if not run.plan:
        return {"available": False, "reason": "no_plan", "note": f"no {PLAN} in the run directory"}
    if pred.get("mfu") is None:
        return {"available": False, "reason": "no_prediction", "note": CPU_NO_PREDICTION}
    mismatch = other_hardware(run)
    if mismatch:
        return {"available": False, "reason": "other_hardware", "note": mismatch,
                "planned_for": run.plan["hardware"]["gpu"], "ran_on": "cpu"}
    measured = (s.get("mfu") or {}).get("median")
    step = s["step_time_s"]["median"]
    return {
        "available": True,
        "mfu": pred["mfu"], "hfu": pred.get("hfu"), "step_time_s": pred.get("step_time_s"),
        "tokens_per_s": pred.get("tokens_per_s"),
        "mfu_gap_points": (measured - pred["mfu"]) * 100 if measured is not None else None,
        "measured_over_predicted_step": step / pred["step_time_s"] if step and pred.get("step_time_s") else None,
        "peak_flops": ((run.plan or {}).get("hardware") or {}).get("peak_flops"),
    }
