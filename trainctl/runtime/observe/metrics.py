"""Per-step metrics (rank 0): tokens/s, TFLOP/s per GPU, MFU and HFU, console + JSONL.

The MFU convention is docs/design/memory.md, "MFU convention" (owned by trainctl.model_shape)."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainctl import model_shape
from trainctl.spec.models import RunSpec


def model_flops_per_token(spec: RunSpec) -> float:
    """6*N + 12*L*h*s (trainctl.model_shape: the planner's arithmetic, so the plan and the job agree)."""
    return model_shape.model_flops_per_token_of(model_shape.ModelShape.from_spec(spec.model))


def hardware_flops_per_token(spec: RunSpec) -> float:
    """What the ranks really compute: + recomputed forwards and the padded vocabulary (HFU)."""
    shape = model_shape.ModelShape.from_spec(spec.model)
    return model_shape.hardware_flops_per_token(shape, spec.train.recompute, spec.padded_vocab)


@dataclass(frozen=True)
class FlopsModel:
    tokens_per_step: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    world_size: int
    peak_flops_per_rank: float
    peak_source: str

    @classmethod
    def from_spec(cls, spec: RunSpec, world_size: int, peak: float, source: str) -> FlopsModel:
        tokens = spec.train.global_batch * spec.model.seq_len
        mf = model_flops_per_token(spec) * tokens
        return cls(tokens, mf, hardware_flops_per_token(spec) * tokens, world_size, peak, source)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB; whole process


def step_record(step: int, steps: int, loss: float, lr: float, grad_norm: float, step_time: float,
                fm: FlopsModel, mem: int) -> dict[str, Any]:
    achieved = fm.model_flops_per_step / step_time / fm.world_size
    mfu = achieved / fm.peak_flops_per_rank
    hfu = fm.hardware_flops_per_step / step_time / fm.world_size / fm.peak_flops_per_rank
    rec: dict[str, Any] = {
        "step": step, "steps": steps, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        "step_time_s": step_time, "tokens": fm.tokens_per_step,
        "tokens_per_s": fm.tokens_per_step / step_time,
        "tokens_per_s_per_gpu": fm.tokens_per_step / step_time / fm.world_size,
        "model_flops_per_step": fm.model_flops_per_step, "tflops_per_gpu": achieved / 1e12,
        "peak_tflops_per_gpu": fm.peak_flops_per_rank / 1e12, "world_size": fm.world_size,
        "mfu": mfu, "hfu": hfu, "peak_mem_bytes": mem,
        "peak_source": fm.peak_source,  # which peak the MFU is relative to (catalog/NVML, spec, measured CPU)
        "time": time.time(),  # wall clock at the end of the step: lets the report place steps among events
    }
    if mfu > 1.0:
        rec["mfu_bug"] = True  # more than the peak is impossible: a FLOPs or timing accounting error
    return rec


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def console_line(r: dict[str, Any], per: str = "gpu") -> str:
    """Rank 0's line for a step; `per`: what one rank is, for the per-rank rates ("rank" on CPUs: no GPU)."""
    width = len(str(r["steps"]))
    # Above 100% of the peak is an accounting bug: never print it as if it were a result.
    util = ("MFU BUG (>100% of peak: FLOPs/timing accounting error)" if r.get("mfu_bug") else
            f"MFU {100 * r['mfu']:.2f}% | HFU {100 * r['hfu']:.2f}%")
    moe = r.get("moe")
    routing = "" if not moe else (f" | aux {moe['aux_loss']:.3f} imbalance {moe['imbalance']:.2f}"
                                  + (f" dropped {moe['dropped']}" if moe["dropped"] else "")
                                  + f" a2a {moe['a2a_s'] * 1e3:.1f} ms")
    return (f"step {r['step']:>{width}}/{r['steps']} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"gnorm {r['grad_norm']:.3f} | {r['step_time_s'] * 1e3:7.1f} ms | "
            f"{_si(r['tokens_per_s'])} tok/s ({_si(r['tokens_per_s_per_gpu'])}/{per}) | "
            f"{r['tflops_per_gpu']:.3g} TFLOP/s/{per} | {util} | mem {r['peak_mem_bytes'] / 2**30:.2f} GiB{routing}")


def step_line(r: dict[str, Any], *, compact: bool, per: str = "gpu") -> str:
    """The line rank 0 prints per step: `compact_line` for a terminal under terminal.COMPACT_BELOW
    columns, else `console_line`."""
    return compact_line(r) if compact else console_line(r, per=per)


def compact_line(r: dict[str, Any]) -> str:
    """The step line in under 80 columns: progress, loss, time, throughput, MFU and memory; the rest (lr,
    gradient norm, HFU, TFLOP/s) is in metrics.jsonl and the full line."""
    width = len(str(r["steps"]))
    util = "MFU BUG (>100%)" if r.get("mfu_bug") else f"MFU {100 * r['mfu']:.1f}%"
    moe = r.get("moe")
    routing = "" if not moe else (f" | imb {moe['imbalance']:.2f}"
                                  + (f" drop {moe['dropped']}" if moe["dropped"] else ""))
    return (f"step {r['step']:>{width}}/{r['steps']} | loss {r['loss']:.4f} | {r['step_time_s'] * 1e3:.0f} ms | "
            f"{_si(r['tokens_per_s'])} tok/s | {util} | {r['peak_mem_bytes'] / 2**30:.2f} GiB{routing}")


def warn(msg: str) -> None:
    print(f"trainctl: warning: {msg}", file=sys.stderr, flush=True)
