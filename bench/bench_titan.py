"""trainctl's bundled trainer against torchtitan on one GPU, the same model, one call: prints a table, writes JSON.

The model is bench_gpu's `big` (16 layers, hidden 2048, 16 heads / 8 KV heads, SwiGLU 5632, vocabulary 32,000,
sequence 2048, untied, bf16 autocast over fp32 weights), micro-batch 8, one GPU. Both trainers read one spec
(`RUN/spec.yaml`): the same data (trainctl's synthetic loader feeds torchtitan's Trainer), AdamW 0.9/0.95, eps
1e-8, weight decay 0.1 (torchtitan also decays the norms' weights), the same LR per step (trainctl's
`lr_at`, set before each of torchtitan's steps), grad clip 1.0, the same SDPA kernel (`--sdpa flash`: only
the flash backend is enabled in both; torchtitan's wrapper otherwise prefers cuDNN attention), and
torch.compile off in both or on in both (each as its own trainer does it: trainctl compiles every block,
torchtitan every block with fullgraph=True and its loss).

Runs, each in its own process, in this order while --budget-s lasts:
  eager     trainctl then torchtitan, --loss-steps steps; torchtitan starts from trainctl's initial weights
            (trainctl state dict -> Hugging Face names (trainctl's own mapping) -> torchtitan's
            Llama3StateDictAdapter.from_hf, which un-permutes q/k for its interleaved rotary): loss curves
  compiled  trainctl then torchtitan, --steps steps (own initial weights: speed only)
  again     a second round of the four, shorter, to see the spread (alternating)

Per run: tokens/s (median step after --skip steps), MFU under trainctl's convention (docs/design/memory.md,
"MFU convention": 6N + 12·L·h·s per token, N the matmul weights with the LM head, against the catalog's dense
BF16 peak) and under torchtitan's own (6·(params - embedding) + 12·L·h·s, its peak table), the allocator's peak.

`--plan loss-check` instead runs trainctl eager twice (its run-to-run spread: flash attention's backward is
not deterministic) beside torchtitan with trainctl's weight-decay groups, then torchtitan compiled and as it
ships (cuDNN attention).

    python3 bench/bench_titan.py --out DIR      # skips (exit 0) on a machine without a CUDA GPU
    python3 bench/bench_titan.py --cpu-smoke    # toy sizes on the CPU: both trainers run a few steps
    python3 bench/bench_titan.py --cpu-fsdp 2 --micro-batch 2 --steps 10 --skip 3 --rounds 8 --budget-s 1400

`--cpu-fsdp RANKS`: trainctl's ZeRO-3 against torchtitan's FSDP2 on the CPU, each under torchrun over RANKS
gloo ranks of one thread, a 16M-parameter Llama (CPU_FSDP_MODEL) in fp32, eager, the same data; torchtitan as
it ships (fused AdamW, its FSDP2 wrapping and loss) but for one gloo patch (`sum_without_division`). Rounds
alternate the order; per round the ratio of torchtitan's median step (and rank 0's CPU seconds per step) to
trainctl's, and their median over the rounds. A 2-core VM's steps spread 10-20% from round to round, so the
medians of 8 rounds decide. Measured 2026-11-27 (2 cores, torch 2.13.0+cpu, torchtitan 0.2.2), torchtitan /
trainctl, step time / CPU seconds: before 0.939 / 0.975 (trainctl slower: its AdamW was torch's per-tensor
loop on the CPU, its embedding and LM head shared the root FSDP unit); with fused AdamW 0.970 / 0.926; with
the ends as torchtitan's units too 1.019 / 1.028, and in a second run 1.011 / 0.960 (per round 0.87-1.17):
on par within the noise.

torchtitan travels as wheels (0.2.2 runs on torch 2.11; 0.3.0 needs packages that 2.11 predates): torchtitan,
torchdata, tyro, docstring_parser, typeguard, typing_extensions, datasets, dill, multiprocess (its llama3 module
imports them; a stub stands in where `datasets` does not import), and trainctl's pydantic.

Measured on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, torchtitan 0.2.2, 2026-11-26), flash SDPA in both,
MFU against 989.4 TFLOP/s (trainctl's convention; torchtitan's own reads 0.0002 higher), medians of steps 6+:

|                       | trainctl eager | torchtitan eager | trainctl compiled | torchtitan compiled |
|---|---|---|---|---|
| tokens/s (runs)       | 61,793 62,179 61,301 61,281 | 67,592 67,584 66,827 | 82,101 81,806 | 81,092 81,228 80,415 |
| MFU                   | 35.5-36.0%     | 38.7-39.1%       | 47.4-47.5%        | 46.6-47.0%          |
| allocator peak        | 40.9 GB        | 43.6 GB          | 36.9 GB           | 32.1 GB             |

trainctl / torchtitan: 0.92 eager, 1.01 compiled. torchtitan eager with its own SDPA order (cuDNN first, which
SDPA also picks for trainctl's attention by default on the H100): 71,174 and 70,351 tokens/s (+5%). Loss curves
from trainctl's initial weights on the same batches: within 0.006 for 10 steps, then they drift apart as far
as trainctl's own runs do (mean loss of steps 41-50, one run each: trainctl 3.330, 3.374, 3.375; torchtitan
3.363 with trainctl's decay groups, 3.438 decaying the norms too).

Again on one H100 (2026-11-27) after the trainer took Megatron's activations (a bf16 residual stream, SwiGLU
keeping [gate; up] only; runs of 15-20 steps, so one or two per cell):

|                       | trainctl eager | torchtitan eager | trainctl compiled | torchtitan compiled |
|---|---|---|---|---|
| tokens/s, bf16 RoPE   | 68,717 68,632  | 67,550 67,051    | 83,536 83,977     | 80,169 80,659       |
| tokens/s, fp32 RoPE   | 64,928         | 67,470           | 82,468            | 80,160              |
| allocator peak        | 35.7 GB        | 43.6 GB          | 35.7 GB           | 32.1 GB             |

trainctl / torchtitan with RoPE in fp32 (what main runs): 0.96 eager, 1.03 compiled (bf16 RoPE: 1.02, 1.04).
From the same initial weights the curves now part early: torchtitan's single-GPU autocast keeps an fp32
residual stream, trainctl a bf16 one as Megatron does (step 10: 5.048 vs 4.602; step 20: 4.271 vs 4.186).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gpu import LLAMA, model  # noqa: E402  (the repository on sys.path first)

TRAINERS = ("trainctl", "torchtitan")


# --cpu-fsdp's model: a ~16M-parameter Llama (4 x (1.0M attention + 2.4M MLP) + 2 x 2.1M embedding and head)
CPU_FSDP_MODEL = {**LLAMA, "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn_hidden": 1536,
                  "vocab": 4096, "seq_len": 256}


def make_spec(a: argparse.Namespace, gpu: str, steps: int, compile: bool) -> dict[str, Any]:
    dp = a.cpu_fsdp or 1
    return {
        "name": "titan-vs-trainctl", "model": CPU_FSDP_MODEL if a.cpu_fsdp else model("big", a.cpu_smoke),
        "parallel": {"tp": 1, "pp": 1, "dp": dp, "zero": 3 if a.cpu_fsdp else 1, "micro_batch": a.micro_batch},
        "train": {"global_batch": a.micro_batch * dp, "steps": steps, "lr": 3e-4, "warmup": 2,
                  "precision": "fp32" if a.cpu_fsdp else "bf16", "seed": 1234, "grad_clip": 1.0, "compile": compile},
        "data": {"synthetic": True},
        "checkpoint": {"every_steps": None, "keep_last": 1},
        "cluster": {"nodes": 1, "gpus_per_node": dp, "gpu": gpu},
        "launcher": {"backend": "local", "mode": "torchrun"},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------
# In the worker processes
# ---------------------------------------------------------------------------------------------------------


def sdpa_flags(sdpa: str) -> None:
    """`flash`: only the flash (and math, the last resort) SDPA backends stay enabled, process-wide."""
    import torch

    if sdpa == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)


def sdpa_choice(heads: int, kv_heads: int, head_dim: int, seq: int, batch: int, priority: list | None = None) -> str:
    """The backend SDPA picks for the model's causal GQA attention under the current flags (bf16, CUDA, with
    gradients), inside `sdpa_kernel(priority, set_priority=True)` as torchtitan's wrapper calls it if given."""
    import contextlib

    import torch

    if not torch.cuda.is_available():
        return "cpu"
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(priority, set_priority=True) if priority else contextlib.nullcontext():
        return _sdpa_choice(heads, kv_heads, head_dim, seq, batch)


def _sdpa_choice(heads: int, kv_heads: int, head_dim: int, seq: int, batch: int) -> str:
    import torch

    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    from torch.nn.attention import SDPBackend

    c = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=heads != kv_heads)
    return SDPBackend(c).name


def _titan_sdpa() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # its wrapper's default


def trainctl_worker(run: Path, sdpa: str) -> None:
    """trainctl's rank, as `python -m trainctl.runtime RUN` starts it, after the SDPA flags."""
    sdpa_flags(sdpa)
    from trainctl.runtime.entry import main

    main([str(run)])


def _trainctl_init(spec: Any, device: Any) -> dict[str, Any]:
    """trainctl's initial weights as Hugging Face's state dict (the bare loop's way of building the model)."""
    import torch

    from trainctl.hf.format import layout
    from trainctl.model_shape import ModelShape
    from trainctl.runtime.model.hf_weights import to_hf
    from trainctl.runtime.model.transformer import build_stage

    cfg = ModelShape.from_spec(spec.model)
    torch.manual_seed(spec.train.seed)
    stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=spec.train.seed, device=device)
    full = {k: v.detach() for k, v in stage.state_dict().items()}
    hf = to_hf(layout(cfg), full)  # CPU fp32 tensors
    del stage, full
    return hf


def titan_worker(run: Path, out: Path, sdpa: str, init_from_trainctl: bool, decay_norms: bool = True) -> None:
    """torchtitan's own Trainer (its model, parallelize_llama's compile, optimizer container, loss, train_step)
    on trainctl's spec and data; per-step wall times (synchronised), losses, the allocator's peak."""
    import torch

    smoke = not torch.cuda.is_available()
    if smoke:  # torchtitan assumes an accelerator: make it see the CPU (the smoke checks the flow only)
        import torch._utils

        torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    sdpa_flags(sdpa)
    _titan_import_fallbacks()

    from torch.nn.attention import SDPBackend
    from torchtitan.components.metrics import build_metrics_processor
    from torchtitan.config import ConfigManager
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
    from torchtitan.tools import utils as tt_utils
    from torchtitan.train import Trainer

    from trainctl.model_shape import ModelShape
    from trainctl.runtime.train.loader import build_loader
    from trainctl.runtime.train.optim import lr_at
    from trainctl.spec import load_spec

    spec = load_spec(run / "spec.yaml")
    t = spec.train
    cfg = ModelShape.from_spec(spec.model)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))  # world: FSDP2's shards
    if sdpa == "flash":  # the wrapper's own list (its default: cuDNN, flash, math, cuDNN first)
        ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.FLASH_ATTENTION]
    margs = TransformerModelArgs(
        dim=cfg.hidden, n_layers=cfg.layers, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab,
        multiple_of=cfg.ffn_hidden, norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),  # Llama 3.1's scaling off: trainctl's rotary
        max_seq_len=cfg.seq_len)

    class Loader:
        """trainctl's synthetic batches as torchtitan's ({'input': x}, labels), one micro-batch a step."""

        def __init__(self) -> None:
            self.loader = build_loader(spec, rank, world, t.seed)  # this replica's batches, as trainctl's

        def __iter__(self):
            while True:
                x, y = self.loader.next_step()
                yield {"input": x[0]}, y[0]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    def metrics_processor(job_config, parallel_dims, model_args, tag=None):
        mp = build_metrics_processor(job_config, parallel_dims, model_args, tag)
        record["metrics_processor"] = mp
        return mp

    if smoke:  # its memory monitor reads CUDA's allocator
        import torchtitan.components.metrics as tt_metrics

        class NoMemory:
            device_name = "cpu"

            def get_peak_stats(self) -> Any:
                return tt_metrics.DeviceMemStats(*[0] * len(tt_metrics.DeviceMemStats._fields))

            def reset_peak_stats(self) -> None:
                pass

        tt_metrics.build_device_memory_monitor = NoMemory
        import torchtitan.distributed.utils as tt_dist

        tt_dist.set_pg_timeouts = lambda **kw: None  # its barrier names a CUDA device
        import torchtitan.models.llama3.infra.parallelize as tt_parallelize
        from torch.distributed.fsdp import FSDPModule

        def sum_without_division(model: torch.nn.Module) -> None:
            """torchtitan divides by its global token count itself and turns FSDP2's division off with a divide
            factor of 1, which FSDP2 sends as PREMUL_SUM, an op gloo lacks: the same plain sum, as SUM."""
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)

        tt_parallelize.disable_fsdp_gradient_division = sum_without_division

    record: dict[str, Any] = {}
    base = get_train_spec("llama3")
    register_train_spec("trainctl_bench", dataclasses.replace(
        base, model_args={"bench": margs}, build_tokenizer_fn=None, build_validator_fn=None,
        build_dataloader_fn=lambda **kw: Loader(), build_metrics_processor_fn=metrics_processor))
    argv = ["--model.name", "trainctl_bench", "--model.flavor", "bench", "--job.dump_folder", str(out.parent / "tt"),
            "--training.local_batch_size", str(spec.parallel.micro_batch), "--training.seq_len", str(cfg.seq_len),
            "--training.steps", str(t.steps), "--training.max_norm", str(t.grad_clip),
            "--training.mixed_precision_param", "float32" if t.precision == "fp32" else "bfloat16",
            "--parallelism.data_parallel_shard_degree", str(world), "--activation_checkpoint.mode", "none",
            "--optimizer.lr", str(t.lr), "--optimizer.beta1", str(t.beta1), "--optimizer.beta2", str(t.beta2),
            "--optimizer.eps", str(t.eps), "--optimizer.weight_decay", str(t.weight_decay),
            "--optimizer.implementation", "fused" if not smoke or world > 1 else "foreach",
            "--lr_scheduler.warmup_steps", str(t.warmup), "--metrics.log_freq", "1", "--debug.seed", str(t.seed)]
    if t.compile:
        argv.append("--compile.enable")
    job = ConfigManager().parse_args(argv)
    os.environ.setdefault("LOCAL_RANK", "0")
    times: list[float] = []
    cpu_times: list[float] = []  # this process's CPU seconds per step, as trainctl records cpu_time_s
    losses: list[float] = []
    sync = torch.cuda.synchronize if not smoke else (lambda: None)

    class Timed(Trainer):
        def forward_backward_step(self, **kw):
            loss = super().forward_backward_step(**kw)
            self._losses.append(loss.detach())
            return loss

        def train_step(self, data_iterator):
            for opt in self.optimizers.optimizers:  # trainctl's schedule, step by step (lr_at is 0-based)
                for g in opt.param_groups:
                    g["lr"] = lr_at(self.step - 1, t)
            self._losses = []
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            super().train_step(data_iterator)
            sync()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            losses.append(float(sum(x.item() for x in self._losses)))

    peak = [0]
    if not smoke:  # torchtitan's metrics reset CUDA's peak after every logged step: keep the running maximum
        reset = torch.cuda.reset_peak_memory_stats

        def keep_peak(*args: Any, **kw: Any) -> None:
            peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
            reset(*args, **kw)

        torch.cuda.reset_peak_memory_stats = keep_peak  # type: ignore[assignment]

    t_start = time.perf_counter()
    trainer = Timed(job)
    model = trainer.model_parts[0]
    if init_from_trainctl:
        hf = _trainctl_init(spec, trainer.device)
        sd = Llama3StateDictAdapter(margs, None).from_hf(hf)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or [m for m in missing if "freqs_cis" not in m]:
            raise RuntimeError(f"weights did not map: missing {missing[:4]}, unexpected {unexpected[:4]}")
        del hf, sd
    trainer.lr_schedulers.step = lambda: None  # trainctl's schedule, set before each step (Timed.train_step)
    if not decay_norms:  # trainctl's groups: no weight decay on 1-D weights (norms); torchtitan decays all
        for opt in trainer.optimizers.optimizers:
            params = opt.param_groups[0]["params"]
            opt.param_groups[0]["params"] = [p for p in params if p.dim() >= 2]
            opt.add_param_group({"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0})
    if not smoke:
        torch.cuda.empty_cache()
        reset()
        peak[0] = 0
    setup_s = time.perf_counter() - t_start
    trainer.train()
    mp = record.get("metrics_processor")
    res = {
        "times": times, "cpu_times": cpu_times, "losses": losses, "setup_s": round(setup_s, 1),
        "params": sum(p.numel() for p in model.parameters()),
        "flops_per_token_titan": getattr(mp, "num_flops_per_token", None),
        "peak_flops_titan": tt_utils.get_peak_flops(torch.cuda.get_device_name()) if not smoke else None,
        "peak_mem_bytes": max(peak[0], torch.cuda.max_memory_allocated()) if not smoke else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if not smoke else None,
        "sdpa": sdpa_choice(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len, spec.parallel.micro_batch,
                            ScaledDotProductAttentionWrapper.sdpa_backends or _titan_sdpa()),
        "torchtitan": _version("torchtitan"), "compile": bool(t.compile),
        "tokens_per_step": t.global_batch * cfg.seq_len}
    if rank == 0:
        out.write_text(json.dumps(res))
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _titan_import_fallbacks() -> None:
    """torchtitan's llama3 module imports its Hugging Face dataset loader (`datasets`), which this bench never
    uses (trainctl's loader feeds it): where `datasets` does not import, a stub stands in for it. Its MoE
    kernels import triton, which a CPU-only torch lacks (the smoke): a stub for that module, never called."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is None:  # only torchtitan's MoE kernels import it
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None  # type: ignore[attr-defined]
        sys.modules[kernels.__name__] = kernels
    try:
        import datasets  # noqa: F401
        import datasets.distributed  # noqa: F401
    except Exception:
        stub = types.ModuleType("datasets")
        dist = types.ModuleType("datasets.distributed")
        for name in ("Dataset", "IterableDataset", "load_dataset", "interleave_datasets"):
            setattr(stub, name, object)
        dist.split_dataset_by_node = object  # type: ignore[attr-defined]
        stub.distributed = dist  # type: ignore[attr-defined]
        sys.modules["datasets"], sys.modules["datasets.distributed"] = stub, dist
        print("bench_titan: `datasets` did not import; a stub stands in (torchtitan's own loader unused)")


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out: Path = a.out
        self.work = Path(a.work)
        self.t0 = time.monotonic()
        self.log = self.out / "log.txt"
        self.log.unlink(missing_ok=True)
        self.runs: list[dict[str, Any]] = []
        self.env_info: dict[str, Any] = {}
        self.gpu = "cpu"
        self.peak_flops: float | None = None  # trainctl's peak for MFU (its runs' metrics): both are held to it
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1" if a.cpu_fsdp else os.environ.get("OMP_NUM_THREADS", "4" if a.cpu_smoke else "8")}

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.t0)

    def sh(self, args: list[str], timeout: float, what: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        try:
            r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            r = subprocess.CompletedProcess(args, 124, out, err)
        with self.log.open("a") as f:
            f.write(f"\n=== {what}: {' '.join(args)} -> {r.returncode} in {time.monotonic() - t0:.1f} s\n"
                    f"--- stdout\n{r.stdout[-5000:]}\n--- stderr\n{r.stderr[-8000:]}\n")
        return r

    def one(self, trainer: str, compile: bool, steps: int, round_: int, init: bool = False, sdpa: str | None = None,
            decay_norms: bool = True) -> dict[str, Any]:
        """One run in its own process; `init`: torchtitan starts from trainctl's initial weights; `decay_norms`
        False: torchtitan leaves the norms' weights out of weight decay, as trainctl does."""
        sdpa = sdpa or self.a.sdpa
        name = (f"{trainer}-{'compiled' if compile else 'eager'}-r{round_}"
                + ("" if sdpa == self.a.sdpa else f"-{sdpa}") + ("" if decay_norms else "-nodecaynorms"))
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        run = d / "run"
        run.mkdir()
        (run / "spec.yaml").write_text(yaml.safe_dump(make_spec(self.a, self.gpu, steps, compile)))
        env = {**self.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
               "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor-cache")}
        me = [sys.executable, __file__, "--sdpa", sdpa]
        if self.a.cpu_fsdp:  # one process per rank, as torchrun starts each trainer
            me = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.a.cpu_fsdp),
                  "--master-port", env["MASTER_PORT"], *me[1:]]
        timeout = max(10.0, min(self.a.run_timeout_s, self.left()))
        t0 = time.monotonic()
        res: dict[str, Any] = {"run": name, "trainer": trainer, "compile": compile, "round": round_, "sdpa_mode": sdpa,
                               "init_from_trainctl": init, "decay_norms": decay_norms}
        ranks = self.a.cpu_fsdp or 1  # the peak of them all is the MFU denominator
        if trainer == "trainctl":
            r = self.sh([*me, "--trainctl-worker", str(run)], timeout, name, env)
            if r.returncode:
                res["error"] = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}"
            else:
                res.update(trainctl_figures(run, self.a.skip, ranks))
                self.peak_flops = res["peak_tflops"] * 1e12 * ranks if res.get("peak_tflops") else self.peak_flops
        else:
            out = d / "titan.json"
            args = [*me, "--titan-worker", str(run), "--json", str(out)]
            args += ["--init-from-trainctl"] * init + ["--no-decay-norms"] * (not decay_norms)
            r = self.sh(args, timeout, name, env)
            if r.returncode or not out.exists():
                res["error"] = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}"
            else:
                res.update(titan_figures(json.loads(out.read_text()), self.a.skip, flops_per_token(run),
                                         self.peak_flops))
        res["wall_s"] = round(time.monotonic() - t0, 1)
        self.runs.append(res)
        (self.out / "bench_titan.json").write_text(json.dumps(
            {"env": self.env_info, "runs": self.runs, "args": {k: str(v) for k, v in vars(self.a).items()}},
            indent=1, default=str))
        short = {k: v for k, v in res.items() if k not in ("losses", "times")}
        print(f"[{time.monotonic() - self.t0:6.1f} s] {json.dumps(short, default=str)[:700]}", flush=True)
        return res


def flops_per_token(run: Path) -> float:
    """trainctl's MFU numerator per token (docs/design/memory.md, "MFU convention") for the run's model."""
    from trainctl.model_shape import ModelShape, model_flops_per_token_of
    from trainctl.spec import load_spec

    return model_flops_per_token_of(ModelShape.from_spec(load_spec(run / "spec.yaml").model))


def trainctl_figures(run: Path, skip: int, ranks: int = 1) -> dict[str, Any]:
    """The run's figures; its MFU against the peak of all `ranks` (the record's peak is one rank's)."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = statistics.median(r["step_time_s"] for r in recs[skip:] or recs)
    last = recs[-1]
    tokens = last["tokens"]
    peak = last.get("peak_tflops_per_gpu")
    return {"steps": len(recs), "step_s_median": round(step, 4), "tokens_per_s": round(tokens / step),
            "cpu_s_median": round(statistics.median(r["cpu_time_s"] for r in recs[skip:] or recs), 4),
            "mfu": round(last["model_flops_per_step"] / step / (peak * 1e12 * ranks), 4) if peak else None,
            "peak_mem_gb": round(max(r.get("peak_mem_bytes") or 0 for r in recs) / 1e9, 2),
            "losses": [round(r["loss"], 5) for r in recs], "times": [round(r["step_time_s"], 4) for r in recs],
            "peak_tflops": peak, "peak_source": last.get("peak_source")}


def titan_figures(res: dict[str, Any], skip: int, flops_per_token: float, peak_flops: float | None
                  ) -> dict[str, Any]:
    times = res["times"]
    step = statistics.median(times[skip:] or times)
    out: dict[str, Any] = {"steps": len(times), "step_s_median": round(step, 4)}
    if res.get("cpu_times"):
        out["cpu_s_median"] = round(statistics.median(res["cpu_times"][skip:] or res["cpu_times"]), 4)
    tokens_per_step = res.get("tokens_per_step")
    if tokens_per_step:
        tps = tokens_per_step / step
        out["tokens_per_s"] = round(tps)
        if peak_flops:
            out["mfu"] = round(flops_per_token * tps / peak_flops, 4)
        if res.get("flops_per_token_titan") and res.get("peak_flops_titan"):
            out["mfu_titan_convention"] = round(res["flops_per_token_titan"] * tps / res["peak_flops_titan"], 4)
    out["peak_mem_gb"] = round(res["peak_mem_bytes"] / 1e9, 2) if res.get("peak_mem_bytes") else None
    out["losses"] = [round(x, 5) for x in res["losses"]]
    out["times"] = [round(x, 4) for x in times]
    out.update({k: res[k] for k in ("sdpa", "setup_s", "params", "torchtitan", "flops_per_token_titan")})
    return out


def check_env(b: Bench) -> None:
    import torch

    from trainctl.hardware.detect import detect_gpus

    gpus = detect_gpus()
    on_cpu = b.a.cpu_smoke or b.a.cpu_fsdp
    b.gpu = gpus[0].catalog_key if gpus and gpus[0].catalog_key else ("cpu" if on_cpu else "h100-sxm")
    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "torchtitan": _version("torchtitan"), "cluster.gpu": b.gpu,
                            "nvml": [g.name for g in gpus]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1))
        m = model("big", False)
        hd = m["hidden"] // m["heads"]
        info["sdpa_default"] = sdpa_choice(m["heads"], m["kv_heads"], hd, m["seq_len"], b.a.micro_batch)
        sdpa_flags(b.a.sdpa)
        info["sdpa_forced"] = sdpa_choice(m["heads"], m["kv_heads"], hd, m["seq_len"], b.a.micro_batch)
        if b.a.sdpa == "flash" and info["sdpa_forced"] != "FLASH_ATTENTION":
            info["sdpa_note"] = f"flash not chosen under the flags ({info['sdpa_forced']}): both run SDPA's default"
            b.a.sdpa = "default"
        n = 8192
        xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for _ in range(3):
            xs[0] @ xs[1]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            xs[0] @ xs[1]
        torch.cuda.synchronize()
        info["matmul_bf16_tflops"] = round(10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12, 1)
        del xs
        torch.cuda.empty_cache()
    info["sdpa_mode"] = b.a.sdpa
    b.env_info = info
    print(f"env: {json.dumps(info)}", flush=True)


def loss_compare(b: Bench) -> dict[str, Any]:
    """Loss curves of runs on the same batches from the same initial weights (trainctl's seed): every
    torchtitan run started from trainctl's weights against the first trainctl eager run, and trainctl's
    eager runs of equal length against each other (the run-to-run spread: SDPA's backward is not
    deterministic)."""
    ref = next((r for r in b.runs if r["trainer"] == "trainctl" and not r["compile"] and "losses" in r), None)
    out: dict[str, Any] = {}
    if ref is None:
        return out
    others = [r for r in b.runs if "losses" in r and r is not ref and not r["compile"]
              and (r.get("init_from_trainctl") or r["trainer"] == "trainctl")
              and len(r["losses"]) >= len(ref["losses"])]
    for r in others:
        x, y = ref["losses"], r["losses"]
        n = min(len(x), len(y))
        gaps = [abs(x[i] - y[i]) for i in range(n)]
        marks = sorted({0, 1, 4, 9, 19, 29, 39, n - 1} & set(range(n)))
        out[f"{ref['run']} vs {r['run']}"] = {
            "steps": n, "max_abs_gap": round(max(gaps), 4), "max_abs_gap_first10": round(max(gaps[:10]), 4),
            "mean_last10": [round(statistics.mean(x[n - 10:n]), 4), round(statistics.mean(y[n - 10:n]), 4)]
            if n >= 10 else None, "at_steps": {i + 1: [x[i], y[i]] for i in marks}}
    return out


def summary(b: Bench) -> list[dict[str, Any]]:
    """Per trainer and compile mode: the best (fastest) run's figures, and every run's tokens/s."""
    rows = []
    for compile in (False, True):
        for trainer in TRAINERS:
            runs = [r for r in b.runs if r["trainer"] == trainer and r["compile"] == compile and "tokens_per_s" in r
                    and r["sdpa_mode"] == b.a.sdpa]
            if not runs:
                err = next((r.get("error") for r in b.runs if r["trainer"] == trainer and r["compile"] == compile),
                           "not run")
                rows.append({"trainer": trainer, "compile": compile, "error": (err or "")[-300:]})
                continue
            best = max(runs, key=lambda r: r["tokens_per_s"])
            rows.append({"trainer": trainer, "compile": compile, "tokens_per_s": best["tokens_per_s"],
                         "all_tokens_per_s": [r["tokens_per_s"] for r in runs], "step_s": best["step_s_median"],
                         "mfu": best.get("mfu"), "mfu_titan_convention": best.get("mfu_titan_convention"),
                         "peak_mem_gb": best.get("peak_mem_gb"), "sdpa": best.get("sdpa")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "titan-bench-out")))
    ap.add_argument("--work", default="/tmp/trainctl-titan-bench")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--loss-steps", type=int, default=50, help="round 1's eager pair: same weights, loss curves")
    ap.add_argument("--steps", type=int, default=30, help="round 1's compiled pair")
    ap.add_argument("--again-steps", type=int, default=20, help="round 2 (all four), while the budget lasts")
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the medians (compile, warm-up)")
    ap.add_argument("--sdpa", choices=["flash", "default"], default="flash")
    ap.add_argument("--plan", choices=["full", "loss-check"], default="full",
                    help="loss-check: trainctl eager twice and torchtitan without decay on the norms (the loss "
                         "curves' spread), torchtitan compiled and as it ships")
    ap.add_argument("--budget-s", type=float, default=420, help="runs not started by then are skipped")
    ap.add_argument("--run-timeout-s", type=float, default=200)
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: checks this script's flow")
    ap.add_argument("--cpu-fsdp", type=int, default=0, metavar="RANKS",
                    help="on the CPU: trainctl's ZeRO-3 against torchtitan's FSDP2 over RANKS gloo ranks (one "
                         "thread each), a 16M Llama in fp32, eager, --rounds alternating rounds")
    ap.add_argument("--rounds", type=int, default=4, help="--cpu-fsdp: rounds, each trainer once, order alternating")
    ap.add_argument("--trainctl-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--titan-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--init-from-trainctl", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-decay-norms", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainctl_worker:
        trainctl_worker(a.trainctl_worker, a.sdpa)
        return
    if a.titan_worker:
        titan_worker(a.titan_worker, a.json, a.sdpa, a.init_from_trainctl, not a.no_decay_norms)
        return
    import torch

    if not torch.cuda.is_available() and not a.cpu_smoke and not a.cpu_fsdp:
        print("bench_titan: no CUDA GPU here; skipped (--cpu-smoke runs the flow at toy size on the CPU)")
        return
    if a.cpu_smoke:
        a.loss_steps, a.steps, a.again_steps, a.skip = min(a.loss_steps, 6), min(a.steps, 4), 3, 1
        a.micro_batch = min(a.micro_batch, 2)
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    Path(a.work).mkdir(parents=True)
    b = Bench(a)
    check_env(b)
    R = dict  # one run: trainer, compile, steps, round_ (and init, sdpa, decay_norms: Bench.one)
    if a.cpu_fsdp:  # speed only (each from its own initial weights), the order alternating round by round
        plan = [R(trainer=trainer, compile=False, steps=a.steps, round_=i + 1)
                for i in range(a.rounds) for trainer in (TRAINERS if i % 2 == 0 else TRAINERS[::-1])]
    elif a.plan == "full":
        plan = [R(trainer="trainctl", compile=False, steps=a.loss_steps, round_=1),
                R(trainer="torchtitan", compile=False, steps=a.loss_steps, round_=1, init=True),
                R(trainer="trainctl", compile=True, steps=a.steps, round_=1),
                R(trainer="torchtitan", compile=True, steps=a.steps, round_=1),
                R(trainer="torchtitan", compile=False, steps=a.again_steps, round_=2),
                R(trainer="trainctl", compile=False, steps=a.again_steps, round_=2),
                R(trainer="torchtitan", compile=True, steps=a.again_steps, round_=2),
                R(trainer="trainctl", compile=True, steps=a.again_steps, round_=2),
                # last, if time is left: torchtitan as it ships (its SDPA wrapper puts cuDNN attention first)
                R(trainer="torchtitan", compile=False, steps=a.again_steps, round_=3, sdpa="default")]
        if a.cpu_smoke:  # round 1 is the whole flow; a second round on the CPU only costs minutes
            plan = [*plan[:4], plan[-1]]
    else:  # loss-check: is the loss gap the norms' weight decay, or run-to-run noise? (and compiled memory)
        plan = [R(trainer="trainctl", compile=False, steps=a.loss_steps, round_=1),
                R(trainer="torchtitan", compile=False, steps=a.loss_steps, round_=1, init=True, decay_norms=False),
                R(trainer="trainctl", compile=False, steps=a.loss_steps, round_=2),
                R(trainer="torchtitan", compile=True, steps=a.again_steps, round_=2),
                R(trainer="torchtitan", compile=False, steps=a.again_steps, round_=3, sdpa="default")]
    for run in plan:
        if b.left() < (15 if a.cpu_smoke else 45):
            b.runs.append({"run": f"{run['trainer']}-{run['compile']}-r{run['round_']}", **run,
                           "round": run["round_"], "skipped": f"budget: {b.left():.0f} s left"})
            continue
        b.one(**run)
    rows = summary(b)
    losses = loss_compare(b)
    (b.out / "bench_titan.json").write_text(json.dumps(
        {"env": b.env_info, "summary": rows, "loss_curves": losses, "runs": b.runs,
         "args": {k: str(v) for k, v in vars(a).items()}}, indent=1, default=str))
    print(f"\nenv: {json.dumps(b.env_info)}")
    print("\n| trainer | compile | tokens/s (best; all) | step s | MFU (trainctl conv.) | MFU (titan conv.) "
          "| peak mem GB | SDPA |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['trainer']} | {r['compile']} | error: {r['error'][-200:]} | | | | | |")
            continue
        print(f"| {r['trainer']} | {r['compile']} | {r['tokens_per_s']:,} ({r['all_tokens_per_s']}) | {r['step_s']} "
              f"| {r['mfu']} | {r['mfu_titan_convention']} | {r['peak_mem_gb']} | {r['sdpa']} |")
    for compile in (False, True):
        tc = next((r for r in rows if r["trainer"] == "trainctl" and r["compile"] == compile), {})
        tt = next((r for r in rows if r["trainer"] == "torchtitan" and r["compile"] == compile), {})
        if tc.get("tokens_per_s") and tt.get("tokens_per_s"):
            print(f"trainctl / torchtitan tokens/s, compile {compile}: {tc['tokens_per_s'] / tt['tokens_per_s']:.3f}")
    for r in b.runs:
        if r.get("sdpa_mode") not in (None, a.sdpa):
            print(f"{r['run']} (SDPA as torchtitan ships it, {r.get('sdpa')}): tokens/s {r.get('tokens_per_s')}, "
                  f"MFU {r.get('mfu')}, peak {r.get('peak_mem_gb')} GB {r.get('error', '')[-200:]}")
    if a.cpu_fsdp:  # per round, torchtitan's figure over trainctl's: above 1, trainctl is the faster
        for what, key in (("step time", "step_s_median"), ("rank 0's CPU seconds per step", "cpu_s_median")):
            per_round: dict[int, dict[str, float]] = {r["round"]: {} for r in b.runs}
            for r in b.runs:
                if r.get(key):
                    per_round[r["round"]][r["trainer"]] = r[key]
            ratios = [sides["torchtitan"] / sides["trainctl"] for sides in per_round.values() if len(sides) == 2]
            print(f"ZeRO-3 / FSDP2 over {a.cpu_fsdp} ranks, {what}, torchtitan / trainctl per round: "
                  f"{' '.join(f'{x:.3f}' for x in ratios)}"
                  + (f"; median {statistics.median(ratios):.3f}" if ratios else ""))
    for k, v in losses.items():
        print(f"loss curves (same initial weights and batches, eager), {k}: {json.dumps(v)}")


if __name__ == "__main__":
    main()
