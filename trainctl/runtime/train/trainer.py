"""The training loop: build this rank's stages, parallelize them (runtime/parallelize.py), step, clip, log."""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainctl import terminal
from trainctl.fileio import fsync_path
from trainctl.hardware import oom_kills
from trainctl.model_shape import ModelShape
from trainctl.plan.memory import compute_precision
from trainctl.plan.pipeline import spec_stages_of_pp_rank, stage_layer_ranges
from trainctl.rundir.paths import RunPaths, append_jsonl, read_jsonl, record_event
from trainctl.rundir.runstate import restart_cause
from trainctl.runtime.checkpoint.policy import Checkpointing, run_dir_deleted
from trainctl.runtime.checkpoint.state import TrainState
from trainctl.runtime.model.moe import A2A, is_expert_param
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import StageModule, build_stage, loss_fn, params_built, params_record
from trainctl.runtime.observe import memory_meter, metrics, peak, profiling, stragglers, tracking, watchdog
from trainctl.runtime.parallel.comm_wait import COMM, PP_WAIT, time_pipeline_receives
from trainctl.runtime.parallel.pipeline_schedules import Accumulate, Executor, Pipelined
from trainctl.runtime.parallel.process_groups import Parallel
from trainctl.runtime.parallelize import parallelize
from trainctl.runtime.train import divergence, faults, optim
from trainctl.runtime.train.loader import build_loader
from trainctl.spec.models import RunSpec

# metrics.jsonl is fsynced this often (and at the last step): a step's fsync can take milliseconds on a shared
# file system, and a crash loses at most this much of the log, which a resume writes again from its checkpoint
METRICS_FSYNC_S = 10.0
MEMORY_STEPS = 2  # memory is measured on the 2nd step of each attempt (optimizer state exists after the 1st)
# a failed run's exit waits this long at most for its save in flight to commit (CheckpointManager.settle): a
# 0.9B model's async write took 34 s on a GPU machine's disk
SETTLE_ON_FAILURE_S = 120.0


class InjectedFailure(RuntimeError):
    """Raised by the fail_at_step fault (runtime/train/faults.py)."""


class LossScaler:
    """Dynamic loss scaling for fp16 (GradScaler's rule). Hand-written because the overflow check is the
    global grad norm we compute across every parallel group anyway, which GradScaler cannot see."""

    def __init__(self, enabled: bool, init: float = 2.0**16, interval: int = 2000):
        self.enabled = enabled
        self.scale = init if enabled else 1.0
        self.interval = interval
        self.good = 0

    def update(self, finite: bool) -> bool:
        """Returns whether the step may be applied."""
        if not self.enabled:
            return True
        if not finite:
            self.scale /= 2
            self.good = 0
            return False
        self.good += 1
        if self.good % self.interval == 0:
            self.scale *= 2
        return True


def record_compiled(paths: RunPaths, backend: str, first_step: dict[str, Any]) -> None:
    """After the first step of an attempt under train.compile: what Dynamo made of the blocks (the graphs it
    compiled, the breaks that split them: each one a return to Python) and the step that paid for it."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    record_event(paths, "compiled", backend=backend, graphs=int(counters["stats"]["unique_graphs"]),
                 graph_breaks=sum(breaks.values()), break_reasons=[r[:200] for r in list(breaks)[:5]],
                 first_step_s=first_step.get("step_time_s"))


def deterministic_kernels() -> None:
    """Only kernels that give the same bits on every run (train.deterministic). cuBLAS reads its workspace
    setting when its handle is made, at the first matmul, which comes after this. Not warn_only: with it,
    cuDNN attention keeps its non-deterministic backward (seen on an H200, torch 2.11); an op with no
    deterministic kernel stops the run with its name instead."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class Trainer:
    def __init__(self, spec: RunSpec, par: Parallel, paths: RunPaths):
        self.spec, self.par, self.paths = spec, par, paths
        self._metrics_synced = float("-inf")  # when metrics.jsonl was last fsynced (monotonic)
        t, p = spec.train, spec.parallel
        self.log = par.rank == 0
        torch.manual_seed(t.seed)  # same stream on every rank: replicated dropout masks agree over TP
        if t.deterministic and par.device.type == "cuda":
            deterministic_kernels()
        self.precision = compute_precision(t.precision, par.device.type != "cuda", t.low_precision_on_cpu)
        self.autocast_dtype, self.scaler = self._precision()
        self.cfg = ModelShape.from_spec(spec.model)
        self.micro_batches = spec.micro_batches
        # build: this rank's stages, their layers holding its TP and CP groups and its experts
        self.ctx = ParallelContext.of_rank(par, self.cfg, sequence_parallel=p.sequence_parallel)
        ranges = stage_layer_ranges(spec)
        n_stages = len(ranges)
        self.stage_ids = spec_stages_of_pp_rank(par.pp_rank, spec)
        self.modules: list[StageModule] = [
            build_stage(self.cfg, ranges[s], first=s == 0, last=s == n_stages - 1, seed=t.seed, ctx=self.ctx,
                        recompute=t.recompute, device=par.device)
            for s in self.stage_ids]
        self.params = self._params_record()  # before FSDP turns the parameters into shards
        self._init_from()  # before ZeRO/FSDP, which start from the parameters
        # parallelize: compile, FSDP, gradient sync (runtime/parallelize.py)
        parallel = parallelize(self.modules, spec, par, precision=self.precision, micro_batches=self.micro_batches)
        self.sync = parallel.sync
        # loop: the optimizer over the sync's parameter groups, what runs a step's micro-batches, the data
        self.opt = optim.adamw(self.sync.optimizer_groups(), t)
        self.executor = self._executor(n_stages, fsdp=parallel.fsdp)
        self.holds_last = (n_stages - 1) in self.stage_ids
        self.loader = build_loader(spec, par.replica, par.replicas, t.seed, self.ctx.cp)
        self.flops: metrics.FlopsModel | None = None
        self.steptimes: stragglers.StepTimeLog | None = None  # this rank's step times (set by run())
        self.straggler = stragglers.InjectedStraggler(par.rank)  # the slow_rank and slow_work faults
        COMM.use_cuda(par.device.type == "cuda")
        PP_WAIT.use_cuda(par.device.type == "cuda")
        A2A.use_cuda(par.device.type == "cuda")  # the EP all-to-all's share of COMM (runtime/model/moe.py)
        if par.pp > 1:
            time_pipeline_receives()
        self.ckpt_block_s = 0.0  # checkpoint-save blocking since the last metrics line (outside step time)
        # measured memory (memory_meter): the first MEMORY_STEPS steps of each attempt; run() moves the window
        self.saved = memory_meter.SavedTensorMeter()
        self.memory_steps = range(0, MEMORY_STEPS)
        self._activation_peak = 0
        self._memory_rec: dict[str, Any] | None = None  # waits for the next metrics line
        self.guard = divergence.DivergenceGuard(spec, paths, par, self.scaler.enabled)  # non-finite steps
        self.tracking = tracking.Tracking()  # TensorBoard / W&B beside metrics.jsonl (rank 0; opened by run())
        prof = t.profile
        self.compact_step_line = terminal.compact()  # the launcher's terminal is narrow
        # steps any rank profiles run slower on every rank: their metrics lines say so
        self.profiled_steps = range(prof.start_step, prof.last_step + 1) if prof is not None else range(0)

    # -- set-up helpers ----------------------------------------------------------------------------
    def _executor(self, n_stages: int, *, fsdp: bool) -> Executor:
        """What runs one step's micro-batches forward and backward: accumulation, or the pipeline schedule."""
        par = self.par

        def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(logits, targets, cfg=self.cfg, tp=self.ctx.tp) * self.scaler.scale

        if par.pp == 1:
            return Accumulate(self.modules[0], scaled_loss, micro_batches=self.micro_batches, device=par.device,
                              autocast_dtype=self.autocast_dtype, fsdp=fsdp, on_backward=self.sync.backward_done)
        return Pipelined(self.modules, self.stage_ids, n_stages=n_stages, schedule=self.spec.parallel.schedule,
                         loss_fn=scaled_loss, micro_batches=self.micro_batches, device=par.device,
                         pp_group=par.pp_group, autocast_dtype=self.autocast_dtype,
                         on_backward=self.sync.backward_done)

    def _init_from(self) -> None:
        """model.init_from into this rank's parameters, unless the run has a checkpoint of its own: a resume
        restores from that (Checkpointing.resume), never from the source again. Every rank looks at the
        checkpoint directory itself (nothing writes to it before the first step)."""
        if not self.spec.model.init_from:
            return
        from trainctl.hf import init_source
        from trainctl.runtime.model.hf_weights import load_init

        source = init_source.check(self.spec, self.paths.root)  # SpecError (exit 2) when it no longer fits
        if source is None:
            return
        t0 = time.perf_counter()
        n = load_init(self.modules, source, self.cfg, self.ctx.tp)
        if self.log:
            record_event(self.paths, "init_from", source=source.kind, family=source.family, path=str(source.path),
                         load_s=round(time.perf_counter() - t0, 4))
            print(f"trainctl: initialised from {source.path} ({source.family or 'trainctl checkpoint'}); rank 0 "
                  f"loaded its {n} parameters in {time.perf_counter() - t0:.1f} s", flush=True)

    def _precision(self) -> tuple[torch.dtype | None, LossScaler]:
        t = self.spec.train
        prec = self.precision
        if t.precision == "fp8" and prec == "fp32" and self.log:
            metrics.warn(f"train.precision=fp8 on CPU: the linear layers' GEMMs in FP8 ({t.fp8_recipe} scales, "
                         "emulated, slow), the rest in fp32 (train.low_precision_on_cpu: true runs it in bf16)")
        elif prec not in (t.precision, "bf16") and self.log:
            metrics.warn(f"train.precision={t.precision} on CPU: training in fp32 (no fast {t.precision} matmuls "
                         f"here; train.low_precision_on_cpu: true runs {t.precision} autocast anyway)")
        if prec == "bf16":
            return torch.bfloat16, LossScaler(False)  # fp32 master weights, bf16 autocast compute
        if prec == "fp16":
            return torch.float16, LossScaler(True)
        return None, LossScaler(False)

    def _params_record(self) -> dict[str, Any]:
        """The parameters this layout really built (model.params_record), gathered over the pipeline (and over
        the EP group, whose ranks build different experts)."""
        local, names = params_built(self.modules)
        if self.par.ep_group is not None:
            peers: list[dict[str, int]] = [{}] * self.par.ep
            dist.all_gather_object(peers, names, group=self.par.ep_group)
            names = {k: v for peer in peers for k, v in peer.items()}
        mine = (self.par.pp_rank, (local, names))
        every = [mine]
        if self.par.pp_group is not None:
            every = [None] * self.par.pp
            dist.all_gather_object(every, mine, group=self.par.pp_group)
        return params_record(dict(every))

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Train; the exit status (0, or 75 after a stop signal: checkpointed, requeue me)."""
        spec, par = self.spec, self.par
        peak_flops, source = (peak.peak_flops_per_rank(spec, par.device) if self.log else (0.0, ""))
        self.flops = metrics.FlopsModel.from_spec(spec, par.world_size, peak_flops, source)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if self.log and restart and (why := restart_cause(read_jsonl(self.paths.events))) is not None:
            # one line in the job's log naming what failed; the lost peers' tracebacks stay in their own logs
            print(f"trainctl: torchrun restarted the workers (restart {restart}): {why}", flush=True)
        if self.log:
            # The attempt counters make every restart explicit in events.jsonl (torchrun: worker restarts;
            # Slurm: requeues), which goodput and `trainctl status` count.
            record_event(self.paths, "start", world_size=par.world_size, nodes=spec.cluster.nodes, tp=par.tp,
                         cp=par.cp, pp=par.pp, dp=par.replicas, ep=par.ep, micro_batches=self.micro_batches,
                         zero=spec.parallel.zero, schedule=spec.parallel.schedule, peak_source=source,
                         params=self.params,
                         torchrun_restart=restart,
                         slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT", 0)))
        parts = TrainState(par, self.modules, self.opt, self.sync, self.loader, self.scaler)  # what a checkpoint holds
        ckpt = Checkpointing(spec, self.paths, parts)  # CheckpointError: the checkpoint dir is unusable
        first = ckpt.resume().step  # the newest valid checkpoint, if any (0: a fresh start)
        stop: int | None = ckpt.stop_before_first_step(first)  # Ctrl-C / SIGTERM during start-up
        self.memory_steps = range(first, first + MEMORY_STEPS)
        fail_step, fail_rank = _fail_knob(par.world_size)
        oom = oom_kills.InjectedOom(par.rank, faults.get("oom_at_step"))
        oom.join()  # before the counters: the injected kill is counted in the cgroup the rank is in
        oom_kills.record(self.paths.oom_counters(par.rank))  # a later SIGKILL is told apart from a kill -9
        self.steptimes = stragglers.StepTimeLog(self.paths, par.rank, par.env.local_rank, str(par.device))
        hang_at = watchdog.hang_step(par.rank)
        wd_timeout = watchdog.timeout_from(spec)
        wd = (watchdog.Watchdog(self.paths, par.rank, wd_timeout, world_size=par.world_size).start() if wd_timeout
              else None)
        if self.log:
            self.tracking = tracking.open_tracking(spec, self.paths, first)
        profiler = profiling.for_rank(spec, self.paths, par.rank, par.device, first)
        last: dict[str, Any] = {}
        step = first
        ok = False
        try:
            while stop is None and step < spec.train.steps:
                if step + 1 == fail_step and par.rank == fail_rank:
                    raise InjectedFailure(f"fault fail_at_step={fail_step}: failing rank {par.rank} on purpose")
                if step + 1 == hang_at:
                    watchdog.hang_forever()  # the hang fault: the watchdog must end this
                if step == first and par.rank == 0:
                    faults.start_crash_clock(self.paths.root)
                oom.at(step + 1)
                with profiler.step(step + 1):
                    last = self.train_step(step)
                if step == first and self.log and spec.train.compile_with:
                    record_compiled(self.paths, spec.train.compile_with, last)
                if wd is not None:
                    wd.beat(step + 1)
                action = self.guard.action(ckpt.schedule.last_step)  # the same on every rank
                if action == "stop":
                    ckpt.mgr.wait()  # an async save in flight (of a finite state) commits before the exit
                    stop = self.guard.stop(step + 1, ckpt.schedule.last_step)
                    break
                if action == "rollback":
                    step = self.guard.rollback(step + 1, ckpt, self.loader)
                    continue
                # saves when due (never a diverging state); a stop signal -> checkpoint + exit code
                stop = ckpt.after_step(step + 1, lambda s=step + 1: self._may_save(s))
                self.ckpt_block_s += ckpt.take_blocked_s()
                if stop is not None:
                    break
                step += 1
            if stop is None:
                ckpt.finish(spec.train.steps, lambda: self._may_save(spec.train.steps, scheduled=False))
            self.steptimes.close()
            ok = True
        finally:
            if not ok:  # a failure after a save began: that save's state is good, let it commit first
                ckpt.mgr.settle(SETTLE_ON_FAILURE_S)
            self.steptimes.flush()  # a failing rank still leaves its step times for the report
            profiler.close()  # stopped inside the window: the steps it finished
            self.tracking.close(ok)
            if wd is not None:
                wd.stop()
        if stop is not None:
            return stop
        if os.environ.get("TRAINCTL_DUMP_WEIGHTS") == "1":
            self.dump_weights(self.paths.final_weights)
        if self.log:
            record_event(self.paths, "finish", steps=spec.train.steps, loss=last.get("loss"),
                         **divergence.summary(self.guard))
        return 0

    def train_step(self, step: int) -> dict[str, Any]:
        spec, par = self.spec, self.par
        cuda = par.device.type == "cuda"
        t0, c0 = time.perf_counter(), time.process_time()
        lr = optim.lr_at(step, spec.train)
        optim.set_lr(self.opt, lr)
        # On GPU the host does not wait for kernels, so the parts are timed with CUDA events: the start, the end of
        # forward and backward, the end of the gradient sync and the norm's all-reduce (before the optimizer step),
        # and around ZeRO's weight all-gather after it
        ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(5)) if cuda else None
        if ev is not None:
            ev[0].record()
        COMM.take()  # from here on: this step's time in TP collectives and pipeline receives
        PP_WAIT.take()
        td = time.perf_counter()
        inputs, targets = self.loader.next_step()
        data_wait = time.perf_counter() - td
        self.straggler.before_work()
        self.sync.start_step(step + 1)
        if (moe := self.ctx.moe) is not None:  # the aux losses' backward starts as the LM loss's does (model/moe.py)
            moe.aux_grad_scale = self.scaler.scale / self.micro_batches
            moe.stats.start_step()
        # the window's last step only: the first step of an attempt also runs the pipeline's shape inference
        measuring = step == self.memory_steps.stop - 1
        with self.saved.measuring() if measuring else contextlib.nullcontext():
            loss = self.executor.run(inputs.to(par.device), targets.to(par.device))
        self.straggler.after_work()
        if ev is not None:
            ev[1].record()
        ts = time.perf_counter()
        self.sync.finish()
        self.guard.poison(self.loader.consumed // self.loader.global_batch, self.sync.all_grads())  # test fault
        norm, loss_value, skipped = self._norm_and_loss(loss, step + 1)
        sync_s = time.perf_counter() - ts  # gradient sync + the final all-reduce: includes waiting for peers
        if ev is not None:
            ev[2].record()
        finite = math.isfinite(norm)
        gathered = False
        if self.scaler.update(finite) and finite and not skipped:
            self._clip(norm)
            self.sync.before_step()  # offload: the gradient slices to the host
            self.opt.step()
            tg = time.perf_counter()
            if ev is not None:
                ev[3].record()
            self.sync.after_step()
            if ev is not None:
                ev[4].record()
            # ZeRO's all-gather of the updated weights is DP sync too, as the plan's DP time counts it
            sync_s += time.perf_counter() - tg
            gathered = True
        else:
            self.sync.reset_compression()  # the same decision on every rank: Q stays equal over DP
        if cuda:
            torch.cuda.synchronize(par.device)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if ev is not None:  # the same spans as on the CPU: not the optimizer step
            sync_s = (ev[1].elapsed_time(ev[2]) + (ev[3].elapsed_time(ev[4]) if gathered else 0.0)) / 1e3
        routing = self._routing_record() if self.ctx.moe is not None else None  # a collective: every rank, every step
        comm_s = COMM.take()  # waits inside the step: counted apart from this rank's own work
        pp_s = PP_WAIT.take()  # the pipeline receives' part of comm_s
        if self.steptimes is not None:
            self.steptimes.record(step + 1, dt, sync_s, comm_s, pp_s)
        if measuring:
            self._activation_peak = max(self._activation_peak, self.saved.peak)
            if step + 1 == self.memory_steps.stop:
                self._memory_rec = self._measured_memory()
        rec: dict[str, Any] = {}
        if self.log and ((step + 1) % spec.train.log_every == 0 or step + 1 == spec.train.steps or skipped):
            rec = metrics.step_record(step + 1, spec.train.steps, loss_value, lr, norm, dt, self.flops,
                                      metrics.peak_memory_bytes(par.device))
            if skipped:
                rec["skipped"], rec["skip_reason"] = True, skipped  # no optimizer update (runtime/train/divergence.py)
            rec["cpu_time_s"] = cpu  # this process's CPU time: robust to a busy shared machine (benchmarks)
            rec["data_wait_s"] = data_wait  # inside step_time_s
            rec["ckpt_block_s"], self.ckpt_block_s = self.ckpt_block_s, 0.0  # outside step_time_s
            if routing is not None:
                rec["moe"] = routing
            if self._memory_rec is not None:
                rec["memory"], self._memory_rec = self._memory_rec, None
            if step + 1 in self.profiled_steps:
                rec["profiled"] = True  # the profiler's overhead is in step_time_s (the report leaves it out)
            # the record (the tracking sinks mirror it), durable every METRICS_FSYNC_S and at the run's last step
            now = time.monotonic()
            durable = now - self._metrics_synced >= METRICS_FSYNC_S or step + 1 == spec.train.steps
            try:
                append_jsonl(self.paths.metrics, rec, fsync=durable)
            except FileNotFoundError as e:  # its directory is gone: one line, not a traceback
                raise run_dir_deleted(self.paths, step + 1) from e
            self._metrics_synced = now if durable else self._metrics_synced
            self.tracking.write(rec)
            print(metrics.step_line(rec, compact=self.compact_step_line,
                                    per="rank" if par.device.type == "cpu" else "gpu"), flush=True)
            if rec.get("mfu_bug"):
                metrics.warn(f"MFU {rec['mfu']:.1%} > 100% at step {step + 1}: a FLOPs/timing accounting "
                             "bug, not a result")
                record_event(self.paths, "mfu_bug", step=step + 1, mfu=rec["mfu"])
        return rec

    def _routing_record(self) -> dict[str, Any]:
        """The step's MoE routing, reduced over every rank (runtime/model/moe.py MoEStats): aux and z losses, tokens
        per expert, imbalance, dropped tokens, seconds in the EP all-to-all."""
        assert self.ctx.moe is not None
        return self.ctx.moe.stats.reduce(self.micro_batches, self.par.world_group, self.par.device, self.par.world_size)

    def _measured_memory(self) -> dict[str, Any] | None:
        """This rank's exact model-state bytes and activation peak, gathered from every rank (a collective);
        rank 0 gets {"per_rank": [...], "max": {...}}, the others None."""
        held = self.sync.held()
        mine = {
            "weights": memory_meter.tensor_bytes(q for m in self.modules for q in m.parameters()),
            "gradients": memory_meter.tensor_bytes(held["gradients"]),
            "optimizer": memory_meter.tensor_bytes([*memory_meter.optimizer_tensors(self.opt), *held["master"]]),
            "activations_peak": self._activation_peak,  # bytes saved for backward, at their peak
        }
        if held["host"]:  # ZeRO-1/2 offload: the master, moments and gradient copies live in host memory
            mine["host"] = mine["optimizer"] + memory_meter.tensor_bytes(held["host"])
            mine["optimizer"] = 0
        if self.par.device.type == "cuda":
            mine["allocator_peak"] = torch.cuda.max_memory_allocated(self.par.device)
        ranks: list[dict[str, int]] = [mine]
        if self.par.world_size > 1:
            ranks = [{}] * self.par.world_size
            dist.all_gather_object(ranks, mine, group=self.par.world_group)
        if not self.log:
            return None
        return {"per_rank": ranks, "max": {k: max(r.get(k, 0) for r in ranks) for k in mine}}

    def _norm_and_loss(self, loss: torch.Tensor | None, step: int) -> tuple[float, float, str | None]:
        """Global grad norm, global mean loss and whether the step is skipped (a non-finite one on any rank),
        in one all-reduce (divergence.reduce_norm_and_loss): every rank decides alike."""
        r = divergence.reduce_norm_and_loss(list(self.sync.norm_pieces()), loss, self.par, self.scaler.scale)
        if self.scaler.enabled:
            torch._foreach_mul_(self.sync.all_grads(), 1.0 / self.scaler.scale)  # unscale before clipping
        return r.norm, r.loss, self.guard.check(step, r)

    def _may_save(self, step: int, scheduled: bool = True) -> bool:
        """No checkpoint of a diverging or non-finite state (collective; divergence.DivergenceGuard.may_save)."""
        held = self.sync.held()["master"]
        tensors = [q.to_local() if hasattr(q, "to_local") else q for m in self.modules for q in m.parameters()]
        if self.log:  # the log up to a checkpoint is as durable as the checkpoint: a resume never writes it again
            with contextlib.suppress(OSError):
                fsync_path(self.paths.metrics)
                self._metrics_synced = time.monotonic()
        return self.guard.may_save(step, [t.detach() for t in tensors] + list(held), self.par.device,
                                   scheduled=scheduled)

    def _clip(self, norm: float) -> None:
        clip = self.spec.train.grad_clip
        if clip is None:
            return
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(self.sync.all_grads(), coef)

    # -- test support ----------------------------------------------------------------------------
    def dump_weights(self, out: Path) -> None:
        """Full-over-DP, per-TP-shard final weights of this (pp, tp) rank, with their TP shard layout."""
        params: dict[str, torch.Tensor] = {}
        shards: dict[str, Any] = {}
        masters = self.sync.full_master()  # bf16 ZeRO-1/2: the fp32 truth, not the bf16 parameters
        for m in self.modules:
            meta = m.named_param_meta()
            tied_copy = bool(m.last and not m.first and m.tied_parameters())
            for name, q in m.named_parameters():
                full = masters.get(id(q))
                if full is None:
                    full = q.full_tensor() if hasattr(q, "full_tensor") else q.detach()  # collective under FSDP
                if tied_copy and name in m.tied_parameter_names():
                    continue
                params[name] = full.detach().cpu().clone()
                shards[name] = meta[name].shard if name in meta else None
        if self.par.ep_group is not None and self.par.edp_rank == 0:  # the other EP ranks' experts
            mine = {n: (params[n], shards[n]) for n in params if is_expert_param(n)}
            peers: list[dict[str, Any]] = [{}] * self.par.ep
            dist.all_gather_object(peers, mine, group=self.par.ep_group)
            for peer in peers:
                for n, (t, sh) in peer.items():
                    params[n], shards[n] = t, sh
        if self.par.dp_rank == 0:
            out.mkdir(exist_ok=True)
            torch.save({"params": params, "shards": shards}, out / f"pp{self.par.pp_rank}-tp{self.par.tp_rank}.pt")


def _fail_knob(world: int) -> tuple[int, int]:
    """(step, rank) of the fail_at_step fault; step 0: none (or not in the fail_attempt it names)."""
    step = faults.get_int("fail_at_step")
    rank = faults.get_int("fail_rank", world - 1)
    only = faults.get("fail_attempt")  # so that a torchrun restart can succeed
    if only and int(only) != int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        step = 0
    return step, rank
