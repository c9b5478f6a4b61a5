"""The bundled trainer (one rank) vs a bare PyTorch loop of the identical model, side by side.

Same StageModule (all layers), same data loader, AdamW with the same hyper-parameters and LR schedule,
same grad clipping, same dtype and threads; each runs in its own process, one after the other. Prints
tokens/s of both, their ratio (target >= 0.98), the losses (they should agree) and the trainer's MFU.

    .venv/bin/python bench/bench_trainer.py                 # hidden 512, 4 layers, seq 256 on the CPU
    .venv/bin/python bench/bench_trainer.py --hidden 2048 --layers 16 --seq 2048 --batch 8 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_spec(a: argparse.Namespace) -> dict:
    return {
        "name": "bench-trainer",
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab, "seq_len": a.seq},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": a.batch},
        "train": {"global_batch": a.batch, "steps": a.steps, "lr": 3e-4, "warmup": 2, "precision": a.precision,
                  "seed": 1, "grad_clip": 1.0},
        "data": {"synthetic": True},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": a.gpu},
    }


def bare_loop(run_dir: Path, out: Path) -> None:
    """The reference: a plain PyTorch training loop, no trainctl engine code."""
    import torch

    from trainctl.model_shape import ModelShape
    from trainctl.runtime.model.transformer import build_stage, compile_blocks, loss_fn
    from trainctl.runtime.parallel.tensor_parallel import TPContext
    from trainctl.runtime.train.loader import build_loader
    from trainctl.runtime.train.optim import lr_at
    from trainctl.spec import load_spec

    spec = load_spec(run_dir / "spec.yaml")
    t = spec.train
    torch.manual_seed(t.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda" and t.precision == "bf16"
    cfg = ModelShape.from_spec(spec.model)
    tp = TPContext.single()
    model = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=t.seed, recompute=t.recompute,
                        device=device)
    compile_blocks([model], t.compile_with)  # the trainer's own compile: torch.compile on in both or off in both
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            fused=True if device.type == "cuda" else None)  # the trainer's choice on a GPU
    loader = build_loader(spec, 0, 1, t.seed)
    times, cpu, losses = [], [], []
    for step in range(t.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = loader.next_step()
        x, y = x.to(device), y.to(device)
        total = 0.0
        for i in range(x.shape[0]):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(model(x[i]), y[i], cfg, tp) / x.shape[0]
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(total)
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    out.write_text(json.dumps({"times": times, "cpu": cpu, "losses": losses, "peak_mem_gb": peak_gb}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternating trainer/bare runs; best median kept")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--gpu", default="cpu", help="cluster.gpu of the spec (catalog peak on CUDA)")
    ap.add_argument("--bare", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare:
        bare_loop(a.bare, a.out)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(ROOT)}
    w = a.warmup_steps
    best_trainer, best_bare, recs, bare = float("inf"), float("inf"), [], {}
    cpu_trainer, cpu_bare = float("inf"), float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / "spec.yaml").write_text(yaml.safe_dump(make_spec(a)))
        # alternate the two, best median of each: a busy shared machine slows whichever runs at the time
        for _ in range(a.rounds):
            (run / "metrics.jsonl").unlink(missing_ok=True)
            # one plain process (no torchrun agent beside it), like the bare loop; a free port for gloo
            r = subprocess.run([sys.executable, "-m", "trainctl.runtime", str(run)],
                               env={**env, "MASTER_PORT": str(_free_port())}, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"trainer failed:\n{r.stderr[-3000:]}")
            recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            best_trainer = min(best_trainer, statistics.median(x["step_time_s"] for x in recs[w:]))
            cpu_trainer = min(cpu_trainer, statistics.median(x["cpu_time_s"] for x in recs[w:]))
            out = Path(tmp) / "bare.json"
            r = subprocess.run([sys.executable, __file__, "--bare", str(run), "--out", str(out)], env=env,
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"bare loop failed:\n{r.stderr[-3000:]}")
            bare = json.loads(out.read_text())
            best_bare = min(best_bare, statistics.median(bare["times"][w:]))
            cpu_bare = min(cpu_bare, statistics.median(bare["cpu"][w:]))
    t_trainer, t_bare = best_trainer, best_bare
    tokens = a.batch * a.seq
    flops = recs[-1]["model_flops_per_step"]
    peak = recs[-1]["peak_tflops_per_gpu"] * 1e12
    mfu = flops / (t_trainer * peak)  # one rank: MFU of the best median step time
    loss_gap = max(abs(x["loss"] - b) / abs(b) for x, b in zip(recs, bare["losses"], strict=True))
    print(f"model: {a.layers} layers, hidden {a.hidden}, heads {a.heads}, vocab {a.vocab}, seq {a.seq}, "
          f"batch {a.batch}, {a.precision}, {a.threads} thread(s); best of {a.rounds} medians of steps "
          f"{w + 1}-{a.steps}")
    print(f"trainer (1 rank): {tokens / t_trainer:10.1f} tokens/s  ({t_trainer * 1e3:.1f} ms/step)")
    print(f"bare PyTorch    : {tokens / t_bare:10.1f} tokens/s  ({t_bare * 1e3:.1f} ms/step)")
    print(f"ratio trainer/bare: {t_bare / t_trainer:.3f}   (target >= 0.98)")
    print(f"CPU-time ratio    : {cpu_bare / cpu_trainer:.3f}   (process CPU seconds per step: {cpu_trainer:.3f} vs "
          f"{cpu_bare:.3f}; less sensitive to other load on a shared machine)")
    print(f"trainer MFU: {mfu:.1%} of {peak / 1e12:.3f} TFLOP/s per rank ({flops / t_trainer / 1e12:.3f} TFLOP/s "
          f"achieved; {recs[-1]['model_flops_per_step'] / 1e9:.1f} GFLOP per step)")
    print(f"max relative loss gap trainer vs bare: {loss_gap:.1e}")


if __name__ == "__main__":
    main()
