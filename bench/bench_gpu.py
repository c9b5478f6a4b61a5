"""GPU bring-up on one GPU, every check in one call (a lent GPU's time is short): prints a table, writes JSON.

What runs, each in its own processes through the CLI a user types (`python -m trainctl ...`):
  env        torch/CUDA versions, the GPU as NVML names it and the catalog part it maps to
  matmul     bf16 8192^3 matrix products: the rate this card reaches, the ceiling MFU is read against
  big        `trainctl launch` of a ~0.9B Llama-style model (16 x 2048, GQA 16/8, SwiGLU, seq 2048, bf16) on
             one GPU through torchrun and NCCL (world size 1): tokens/s, TFLOP/s, MFU against the catalog peak,
             the allocator's peak against the plan's memory, one async checkpoint's blocking time
  bare       the same model, data, AdamW and schedule in a bare PyTorch loop (bench_trainer.bare_loop): the
             trainer's speed ratio to it
  calibrate  `trainctl calibrate` of the big spec, then `mfu-report --calibration`: the plan's step time on
             measured rates against the measured step
  recompute  the big model again with recompute selective and full, priced with that profile: predicted vs
             measured step time and memory per component
  grid       `trainctl calibrate` once (big, micro-batch 4), then that profile prices the big and a mid model (24 x
             1024, ~0.37B) x recompute none/selective/full x micro-batch 1 and 4: 12 launches, predicted vs
             measured step time and activations, the mean absolute error and the worst (one H100, 2026-11-26:
             activations to 0.1% in all twelve; step time 31% off on average before the dispatch floor, 22%
             with it: docs/results.md, "One profile, twelve runs"); --grid-runs picks runs, --grid-own-profiles
             also calibrates the mid model and prices its runs with its own profile (two H100s, 2026-11-27,
             after the stream and stack fixes: the GPU-bound runs 1-8% high: "One profile again")
  probe      bench/layer_probe.py: one layer timed alone, as stacks of 2 and 4 and queued, per model, micro-batch
             and recompute mode (which probe comes closest to a layer inside the step)
  fp16       a small model in fp16 with dynamic loss scaling: it trains (finite, falling loss)
  resume     a small model with train.deterministic: straight 16 steps with async checkpoints, then a copy
             rewound to step 8 by `trainctl resume --from-step 8`: steps 9-16 bit for bit? (also without
             train.deterministic, to say what differs)
  pytest     the unit tests, the local launch, trainer, compile and resume tests with CUDA visible (their CPU
             recipes must stay on the CPU); with --cpu-smoke one of them (seconds: the suite is the CPU's)

    python3 bench/bench_gpu.py --out DIR          # skips (exit 0) on a machine without a CUDA GPU
    python3 bench/bench_gpu.py --cpu-smoke        # the same flow at toy size on the CPU (checks this script)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trainctl.rundir.paths import RunPaths, read_jsonl  # noqa: E402  (the repository on sys.path first)

LLAMA = {"activation": "swiglu", "norm": "rmsnorm", "position": "rope", "tied_embeddings": False, "bias": False}


def model(size: str, smoke: bool) -> dict[str, Any]:
    if smoke:
        return {**LLAMA, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 256,
                "seq_len": 64}
    if size == "big":  # ~0.9B: 16 x (4.2M attn + 34.6M MLP) x ... + 2 x 65.5M embedding/head
        return {**LLAMA, "layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 8, "ffn_hidden": 5632,
                "vocab": 32000, "seq_len": 2048}
    if size == "mid":  # ~0.37B: 24 x (3.1M attn + 8.7M MLP) + 2 x 32.8M embedding/head; half big's width
        return {**LLAMA, "layers": 24, "hidden": 1024, "heads": 16, "kv_heads": 8, "ffn_hidden": 2816,
                "vocab": 32000, "seq_len": 2048}
    return {**LLAMA, "layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2816, "vocab": 32000,
            "seq_len": 1024}


def spec(name: str, size: str, a: argparse.Namespace, gpu: str, *, steps: int, micro_batch: int,
         precision: str = "bf16", every: int | None = None, deterministic: bool = False,
         compile: bool = False) -> dict[str, Any]:
    return {
        "name": name, "model": model(size, a.cpu_smoke),
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": micro_batch},
        "train": {"global_batch": micro_batch, "steps": steps, "lr": 3e-4, "warmup": 2, "precision": precision,
                  "seed": 1234, "grad_clip": 1.0, "deterministic": deterministic, "compile": compile},
        "data": {"synthetic": True},
        "checkpoint": {"every_steps": every, "keep_last": 2, "async": True},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": gpu},
        "launcher": {"backend": "local", "mode": "torchrun"},
    }


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out: Path = a.out
        self.work = Path(a.work)
        self.results: dict[str, Any] = {}
        self.gpu = "cpu"  # cluster.gpu of every spec: the catalog part NVML names (check_env)
        self.big_runs: dict[bool, Path] = {}  # the big model's run directory, eager (False) and compiled (True)
        self.log = self.out / "log.txt"
        self.t0 = time.monotonic()
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1"}

    def sh(self, args: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        try:
            r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            r = subprocess.CompletedProcess(args, 124, out, err)
        with self.log.open("a") as f:
            f.write(f"\n=== {what}: {' '.join(args)} -> {r.returncode} in {time.monotonic() - t0:.1f} s\n"
                    f"--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}\n")
        return r

    def trainctl(self, *args: str, timeout: float = 300, what: str = "") -> subprocess.CompletedProcess[str]:
        return self.sh([sys.executable, "-m", "trainctl", *args], timeout, what or args[0])

    def launch(self, name: str, sp: dict[str, Any], timeout: float = 300) -> tuple[Path, list[dict[str, Any]]]:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        path = d / "spec.yaml"
        path.write_text(yaml.safe_dump(sp))
        run = d / "run"
        r = self.trainctl("launch", str(path), "--run-dir", str(run), timeout=timeout, what=f"launch {name}")
        if r.returncode:
            raise RuntimeError(f"launch exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
        return run, metrics(run)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        left = self.a.budget_s - (time.monotonic() - self.t0)
        if left < 20:
            self.results[name] = {"skipped": f"budget: {left:.0f} s left"}
            return
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as e:  # every check runs: one failure must not hide the others' figures
            res = {"error": f"{type(e).__name__}: {e}"}
        res["wall_s"] = round(time.monotonic() - t0, 1)
        self.results[name] = res
        (self.out / "bench_gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        print(f"[{time.monotonic() - self.t0:6.1f} s] {name}: {json.dumps(res, default=str)[:600]}", flush=True)


def metrics(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunPaths(run).metrics)


def events(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunPaths(run).events)


def steady(recs: list[dict[str, Any]], key: str, skip: int) -> float:
    vals = [r[key] for r in recs[skip:] if r.get(key) is not None] or [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals)


def checkpoint_figures(run: Path, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The training loop's blocked seconds per save (metrics ckpt_block_s) and the committed sizes."""
    blocked = [(r["step"], round(r["ckpt_block_s"], 3)) for r in recs if r.get("ckpt_block_s")]
    saved = [(e["step"], e.get("bytes")) for e in events(run) if e["event"] == "checkpoint_committed"]
    return {"blocked_s_by_step": blocked, "committed_bytes_by_step": saved}


def check_env(b: Bench) -> dict[str, Any]:
    import torch

    from trainctl.hardware.detect import detect_gpus

    gpus = detect_gpus()
    res: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available(),
                           "nvml": [{"name": g.name, "memory_gb": round(g.memory_gb, 1), "catalog": g.catalog_key}
                                    for g in gpus]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    b.gpu = gpus[0].catalog_key if gpus and gpus[0].catalog_key else ("cpu" if b.a.cpu_smoke else "h100-sxm")
    res["cluster.gpu"] = b.gpu
    r = b.trainctl("hardware", timeout=60)
    res["hardware_cmd_rc"] = r.returncode
    return res


def check_matmul(b: Bench) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    n = 8192
    xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # random, never zeros
    for _ in range(3):
        xs[0] @ xs[1]
    torch.cuda.synchronize()
    times = []
    for i in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        xs[i % 3] @ xs[(i + 1) % 3]
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return {"bf16_tflops_median": round(2 * n**3 / statistics.median(times) / 1e12, 1)}


def check_big(b: Bench, compile: bool) -> dict[str, Any]:
    a = b.a
    name = "big-compiled" if compile else "big"
    sp = spec(f"gpu-{name}", "big", a, b.gpu, steps=a.steps, micro_batch=a.micro_batch,
              every=a.big_checkpoint_every or None, compile=compile)
    run, recs = b.launch(name, sp, timeout=420)
    b.big_runs[compile] = run
    skip = 5
    step_s = steady(recs, "step_time_s", skip)
    last = recs[-1]
    peak_mem = max(r["peak_mem_bytes"] or 0 for r in recs)
    res: dict[str, Any] = {
        "steps": len(recs), "micro_batch": a.micro_batch, "step_s_median": round(step_s, 4),
        "tokens_per_s": round(last["tokens"] / step_s),
        "tflops": round(last["model_flops_per_step"] / step_s / 1e12, 1),
        "mfu": round(steady(recs, "mfu", skip), 4), "peak_tflops": last["peak_tflops_per_gpu"],
        "peak_source": last.get("peak_source"), "peak_mem_gb": round(peak_mem / 1e9, 2),
        "loss_first_last": [round(recs[0]["loss"], 4), round(last["loss"], 4)],
        "comm_s_median": steady(recs, "comm_s", skip) if "comm_s" in last else None}
    start = next((e for e in events(run) if e["event"] == "start"), {})
    res["params_built"] = start.get("params")
    res["checkpoint"] = checkpoint_figures(run, recs)
    plan = b.trainctl("plan", str(run / "spec.yaml"), "--json", timeout=60)
    if plan.returncode == 0:
        pj = json.loads(plan.stdout)
        res["plan_memory_gb"] = {k: round(v / 1e9, 2) for k, v in (pj.get("memory") or {}).items()
                                 if k in ("weights", "gradients", "optimizer", "activations", "transient", "total")}
        res["plan_step_s"] = (pj.get("prediction") or pj.get("estimate") or {}).get("step_time_s")
    rep = b.trainctl("mfu-report", str(run), "--json", timeout=120)
    if rep.returncode == 0:
        (b.out / f"mfu_report_{name}.json").write_text(rep.stdout)
    txt = b.trainctl("mfu-report", str(run), timeout=120)
    (b.out / f"mfu_report_{name}.txt").write_text(txt.stdout + txt.stderr)
    return res


def check_bare(b: Bench, compile: bool) -> dict[str, Any]:
    """The bare loop on the big run's own spec (torch.compile on in both or off in both)."""
    import bench_trainer

    run = b.big_runs[compile]
    out = b.work / f"bare-{compile}.json"
    r = b.sh([sys.executable, bench_trainer.__file__, "--bare", str(run), "--out", str(out)], 420, "bare loop")
    if r.returncode:
        raise RuntimeError(f"bare loop exited {r.returncode}: {r.stderr.strip()[-400:]}")
    bare = json.loads(out.read_text())
    bare_s = statistics.median(bare["times"][5:])
    trainer_s = b.results["big-compiled" if compile else "big"]["step_s_median"]
    recs = metrics(run)
    gap = max(abs(x["loss"] - y) / abs(y) for x, y in zip(recs, bare["losses"], strict=False))
    return {"bare_step_s_median": round(bare_s, 4), "ratio_bare_over_trainer": round(bare_s / trainer_s, 3),
            "max_rel_loss_gap": gap, "bare_peak_mem_gb": bare.get("peak_mem_gb")}


def check_calibrate(b: Bench) -> dict[str, Any]:
    prof = b.work / "calibration.json"
    run = b.big_runs[False]
    r = b.trainctl("calibrate", str(run / "spec.yaml"), "--out", str(prof), timeout=240)
    if r.returncode:
        raise RuntimeError(f"calibrate exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
    shutil.copy(prof, b.out / "calibration.json")
    txt = b.trainctl("mfu-report", str(run), "--calibration", str(prof), timeout=120)
    (b.out / "mfu_report_calibrated.txt").write_text(txt.stdout + txt.stderr)
    one = report_json(b, run, None, "--calibration", str(prof))
    return {"predicted_step_s": _dig(one, "prediction", "step_time_s"), "measured_step_s": _dig(one, "measured",
                                                                                                  "step_time_s")}


def check_recompute(b: Bench) -> dict[str, Any]:
    """The plan held against the trainer on this GPU at the other recompute settings: the big model, eager, priced
    with the profile `calibrate` measured (so it runs after it); step time and memory per component, each
    predicted beside measured (`mfu-report --json`)."""
    prof = b.work / "calibration.json"
    if not prof.exists():
        raise RuntimeError("needs the calibrate check's profile")
    res: dict[str, Any] = {}
    for mode in ("selective", "full"):
        sp = spec(f"gpu-recompute-{mode}", "big", b.a, b.gpu, steps=min(b.a.steps, 15), micro_batch=b.a.micro_batch)
        sp["train"]["recompute"] = mode
        sp["cluster"]["calibration"] = str(prof)
        run, _ = b.launch(f"recompute-{mode}", sp, timeout=300)
        one = report_json(b, run, f"mfu_report_recompute_{mode}.json")
        pred, meas = _dig(one, "prediction", "step_time_s"), _dig(one, "measured", "step_time_s")
        mem = {row["component"]: [round((row["predicted_bytes"] or 0) / 1e9, 2),
                                  round((row["measured_bytes"] or 0) / 1e9, 2)]
               for row in (_dig(one, "memory", "rows") or [])}
        res[mode] = {"step_s_predicted_measured": [pred, meas],
                     "step_error": round(pred / meas - 1, 3) if pred and meas else None,
                     "memory_gb_predicted_measured": mem}
    return res


def check_grid(b: Bench) -> dict[str, Any]:
    """The calibration issue's GPU check: `trainctl calibrate` once (the big model at micro-batch 4), then that one
    profile prices two model sizes x recompute none/selective/full x micro-batch 1 and 4, each launched and held
    against its plan (`mfu-report --calibration --json`): step time and activations, predicted beside measured.
    The mid model is priced from the big model's profile (the plan says it extrapolates: another model)."""
    t0 = time.monotonic()
    prof = grid_calibrate(b, "big")
    res: dict[str, Any] = {"calibrate_s": round(time.monotonic() - t0, 1), "runs": {}}
    own = grid_calibrate(b, "mid") if b.a.grid_own_profiles else None  # what the mid model's own profile says
    errors, own_errors = [], []
    for size in ("big", "mid"):
        for micro_batch in (1, 4):
            for mode in ("none", "selective", "full"):
                key = f"{size}-mb{micro_batch}-{mode}"
                if b.a.grid_runs and key not in b.a.grid_runs.split(","):
                    continue
                if b.a.budget_s - (time.monotonic() - b.t0) < 60:  # a launch and its reports take 30-50 s
                    res["runs"][key] = "skipped: budget"
                    continue
                sp = spec(f"gpu-grid-{key}", size, b.a, b.gpu, steps=b.a.grid_steps, micro_batch=micro_batch)
                sp["train"]["recompute"] = mode
                sp["cluster"]["calibration"] = str(prof)
                try:
                    run, recs = b.launch(f"grid-{key}", sp, timeout=240)
                    one = report_json(b, run, None)
                except Exception as e:  # one failed run must not hide the others' figures
                    res["runs"][key] = f"error: {type(e).__name__}: {str(e)[-300:]}"
                    continue
                pred, meas = _dig(one, "prediction", "step_time_s"), _dig(one, "measured", "step_time_s")
                rows = {row["component"]: row for row in (_dig(one, "memory", "rows") or [])}
                act = rows.get("activations", {})
                err = round(pred / meas - 1, 4) if pred and meas else None
                if err is not None:
                    errors.append(err)
                if own is not None and size == "mid":
                    own_pred = _dig(report_json(b, run, None, "--calibration", str(own)), "prediction", "step_time_s")
                    own_err = round(own_pred / meas - 1, 4) if own_pred and meas else None
                    if own_err is not None:
                        own_errors.append(own_err)
                    res["runs"].setdefault(f"{key}-own-profile", {"step_error": own_err})
                res["runs"][key] = {
                    "step_ms_predicted_measured": [round(1e3 * pred, 1) if pred else None,
                                                   round(1e3 * meas, 1) if meas else None],
                    "step_error": err,
                    "activations_gb_predicted_measured": [round((act.get("predicted_bytes") or 0) / 1e9, 3),
                                                          round((act.get("measured_bytes") or 0) / 1e9, 3)],
                    "peak_gb": round(max(x["peak_mem_bytes"] or 0 for x in recs) / 1e9, 2),
                    "mfu": round(steady(recs, "mfu", 3), 4)}
    if errors:
        res["step_error_mean_abs"] = round(statistics.mean(abs(e) for e in errors), 4)
        res["step_error_worst"] = max(errors, key=abs)
    if own_errors:
        res["mid_own_profile_step_error_mean_abs"] = round(statistics.mean(abs(e) for e in own_errors), 4)
    return res


def grid_calibrate(b: Bench, size: str) -> Path:
    """`trainctl calibrate` of the `size` model at micro-batch 4; the profile's path (a copy under --out)."""
    prof = b.work / f"grid-calibration-{size}.json"
    d = b.work / f"grid-cal-{size}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.yaml").write_text(yaml.safe_dump(spec(f"gpu-grid-cal-{size}", size, b.a, b.gpu, steps=10,
                                                     micro_batch=4)))
    r = b.trainctl("calibrate", str(d / "spec.yaml"), "--out", str(prof), "--run-dir", str(d / "run"), timeout=300)
    if r.returncode:
        raise RuntimeError(f"calibrate exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
    shutil.copy(prof, b.out / prof.name)
    return prof


def check_probe(b: Bench) -> dict[str, Any]:
    """bench/layer_probe.py: one layer timed alone, as stacks and queued, beside the grid's in-step figures."""
    left = b.a.budget_s - (time.monotonic() - b.t0)
    r = b.sh([sys.executable, str(ROOT / "bench" / "layer_probe.py"), "--json", str(b.out / "layer_probe.json"),
              "--budget-s", str(max(10.0, left - 30))], timeout=max(30.0, left), what="layer_probe")
    return {"rc": r.returncode, "rows": len(r.stdout.strip().splitlines())}


def report_json(b: Bench, run: Path, keep_as: str | None, *args: str) -> dict[str, Any]:
    """`mfu-report RUN ARGS --json` of one run (kept under --out as `keep_as`)."""
    rep = b.trainctl("mfu-report", str(run), *args, "--json", timeout=120)
    if rep.returncode:
        raise RuntimeError(f"mfu-report {' '.join(args)} exited {rep.returncode}: {rep.stderr.strip()[-400:]}")
    if keep_as:
        (b.out / keep_as).write_text(rep.stdout)
    rj = json.loads(rep.stdout)
    return rj["runs"][0] if isinstance(rj, dict) and "runs" in rj else rj


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def check_fp16(b: Bench) -> dict[str, Any]:
    sp = spec("gpu-fp16", "small", b.a, b.gpu, steps=30, micro_batch=4, precision="fp16", every=10)
    run, recs = b.launch("fp16", sp)
    losses = [r["loss"] for r in recs]
    finite = all(x == x and abs(x) != float("inf") for x in losses)
    return {"steps": len(recs), "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)], "finite": finite,
            "falls": losses[-1] < losses[0], "step_s_median": round(steady(recs, "step_time_s", 5), 4),
            "skipped_steps": sum(1 for e in events(run) if e["event"] in ("step_skipped", "nonfinite_step")),
            "checkpoint": checkpoint_figures(run, recs)}  # saves 1, 2, 3: the first one pins its host buffers


def resume_pair(b: Bench, name: str, deterministic: bool) -> dict[str, Any]:
    sp = spec(name, "small", b.a, b.gpu, steps=16, micro_batch=4, every=8, deterministic=deterministic)
    run, straight = b.launch(name, sp)
    copy = run.parent / "resumed"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("logs"))
    r = b.trainctl("resume", str(copy), "--from-step", "8", timeout=300, what=f"resume {name}")
    if r.returncode:
        raise RuntimeError(f"resume exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
    resumed_lines = [m for m in metrics(copy) if m["step"] > 8][-8:]  # appended after the copied 1-16
    pairs = list(zip([m for m in straight if m["step"] > 8], resumed_lines, strict=False))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in pairs)
    gn_diff = max(abs(x["grad_norm"] - y["grad_norm"]) for x, y in pairs)
    return {"compared_steps": len(pairs), "bitwise_losses": all(x["loss"] == y["loss"] for x, y in pairs),
            "bitwise_grad_norms": all(x["grad_norm"] == y["grad_norm"] for x, y in pairs),
            "max_loss_diff": loss_diff, "max_grad_norm_diff": gn_diff,
            "checkpoint": checkpoint_figures(run, straight)}


PYTEST_FILES = ["tests/unit", "tests/dist/test_launch_local.py", "tests/dist/test_trainer_runtime.py",
                "tests/dist/test_compile.py", "tests/dist/test_resume_cli.py"]


def check_pytest(b: Bench) -> dict[str, Any]:
    if b.a.cpu_smoke:  # the suite is the CPU's own anyway: the smoke runs one test through the same command
        how = ["-n", "0", "tests/unit/test_cli.py::test_validate_ok"]
    else:  # a worker per core, at most 8 (each test file stays in one worker)
        how = ["-n", str(min(8, os.cpu_count() or 1)), *PYTEST_FILES]
    r = b.sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *how], 240, "pytest")
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    return {"rc": r.returncode, "summary": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-bench-out")))
    ap.add_argument("--work", default="/tmp/trainctl-gpu-bench", help="run directories (checkpoints: GBs)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--big-checkpoint-every", type=int, default=20, help="0: the big runs save no checkpoint")
    ap.add_argument("--grid-steps", type=int, default=12, help="steps of each run of the grid check")
    ap.add_argument("--grid-runs", default="", help="grid: only these runs (comma-separated, e.g. big-mb4-none)")
    ap.add_argument("--grid-own-profiles", action="store_true",
                    help="grid: also calibrate the mid model and price its runs with its own profile")
    ap.add_argument("--budget-s", type=float, default=420, help="checks not started by then are skipped")
    ap.add_argument("--only", default="", help="comma-separated checks (default all)")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: checks this script's flow")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not a.cpu_smoke:
        print("bench_gpu: no CUDA GPU here; skipped (--cpu-smoke runs the flow at toy size on the CPU)")
        return
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    b = Bench(a)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "env": lambda: check_env(b), "matmul": lambda: check_matmul(b), "big": lambda: check_big(b, False),
        "bare": lambda: check_bare(b, False), "big-compiled": lambda: check_big(b, True),
        "bare-compiled": lambda: check_bare(b, True), "fp16": lambda: check_fp16(b),
        "resume_deterministic": lambda: resume_pair(b, "resume-det", True),
        "calibrate": lambda: check_calibrate(b), "recompute": lambda: check_recompute(b),
        "grid": lambda: check_grid(b), "probe": lambda: check_probe(b),
        "resume_default": lambda: resume_pair(b, "resume-default", False),
        "pytest": lambda: check_pytest(b)}
    only = [x for x in a.only.split(",") if x]
    for name, fn in checks.items():
        if not only or name in only or name == "env":
            b.step(name, fn)
    with tarfile.open(a.out / "runs.tgz", "w:gz") as tar:  # every run's records and logs, no checkpoints
        for p in sorted(Path(a.work).rglob("*")):
            if p.is_file() and "checkpoints" not in p.parts and p.stat().st_size < 4_000_000:
                tar.add(p, arcname=str(p.relative_to(a.work)))
    print("\n| check | result |\n|---|---|")
    for name, res in b.results.items():
        print(f"| {name} | {json.dumps(res, default=str)[:900]} |")


if __name__ == "__main__":
    main()
