"""`python -m trainctl.runtime.workers.preflight RUN_DIR`: what every rank runs for `trainctl preflight`.

Measures only; the verdict is trainctl/launch/preflight.py's (torch-free). Every rank at once: (1) a matmul
rate in each of a few windows (a window spans many CPU-quota periods, so a throttled node cannot hide in one
lucky window; the best one drops a neighbour's burst of load, and their spread says how much load there
was); (2) a device-memory allocate-and-verify pass (on a CPU a host buffer); (3) an all-reduce inside each
node; (4) a ping-pong between the first ranks of each node pair of a ring (node i with i+1), one pair at a
time, so a slow link is named; (5) on GPUs the NVML state; (6) the checkpoint directory: free space, and
every node writes a token file that every node must then see. Rank 0 gathers everything into
RUN/preflight.json. Exit status: 0, 1 on a failure, 2 spec error.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainctl.fileio import write_atomic
from trainctl.hardware.hostname import this_host
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.parallel.process_groups import RankEnv
from trainctl.runtime.workers import microbench as mb
from trainctl.runtime.workers.worker_main import worker_main
from trainctl.spec.models import RunSpec

MODULE = "trainctl.runtime.workers.preflight"
PROGRESS = "preflight: "  # how rank 0 starts each progress line (trainctl/launch/preflight.py echoes them)
WINDOWS = 8  # matmul windows; the best counts (another job on the same cores spoils some)
WINDOW_S = 0.1  # ten 10 ms CPU-quota periods, a few hundred CPU matmuls
REPEATS = 5  # timed calls per collective figure; the best counts
CPU_MATMUL_N, GPU_MATMUL_N = 192, 8192
CPU_BUFFER_BYTES = 64 << 20  # the host buffer a CPU rank allocates and verifies
GPU_MEMORY_FRACTION = 0.5  # of the free device memory, in chunks
CHUNK_BYTES = 256 << 20
MESSAGE_BYTES = 4 << 20  # all-reduce and ping-pong size
TOKENS = ".trainctl-preflight"  # under the checkpoint directory, removed afterwards


def node_name() -> str:
    """As the ranks report it for placement (trainctl/runtime/parallel/placement_proof.py): Slurm's node name first."""
    return os.environ.get("SLURMD_NODENAME") or this_host()


class Preflight:
    def __init__(self, spec: RunSpec, env: RankEnv, device: torch.device, run_dir: Path) -> None:
        self.spec, self.env, self.device, self.run_dir = spec, env, device, run_dir
        self.nodes, self.per_node = spec.cluster.nodes, spec.cluster.gpus_per_node
        self.node = node_name()

    def say(self, text: str) -> None:
        if self.env.rank == 0:
            print(f"{PROGRESS}{text}", flush=True)

    def gather(self, mine: Any) -> list[Any]:
        every: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, mine)
        return every

    def run(self) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        nodes = self.gather(self.node)
        # the node index of every rank, by where the ranks really are (rendezvous order is not node order)
        names = list(dict.fromkeys(nodes))
        mine: dict[str, Any] = {"rank": self.env.rank, "local_rank": self.env.local_rank, "node": self.node,
                                "device": self.device_name()}
        self.say(f"{self.env.world_size} ranks on {len(names)} node(s): {', '.join(names)}")
        mine["matmul_windows"] = self.matmul()
        mine["matmul_flops"] = max(mine["matmul_windows"])
        mine["peak_flops"] = self.catalog_peak()
        self.say(f"[1/6] matmul rate ({WINDOWS} windows of {WINDOW_S * 1e3:.0f} ms: the best, and their spread)")
        mine["memory"] = self.memory()
        self.say("[2/6] memory allocated and verified")
        intra = self.intra_node(nodes)
        self.say("[3/6] all-reduce inside each node" if intra is not None else "[3/6] one rank per node: no "
                 "intra-node collective")
        pairs = self.ring(nodes, names)
        self.say(f"[4/6] {len(pairs)} node pair(s) of the ring" if pairs else "[4/6] one node: no inter-node link")
        mine["nvml"] = self.nvml()
        self.say("[5/6] NVML state" if self.device.type == "cuda" else "[5/6] NVML skipped: CPU ranks")
        checkpoint = self.checkpoint_dir(nodes, names)
        self.say("[6/6] checkpoint directory: free space, a token file from every node")
        ranks = self.gather(mine)
        intra_all = self.gather(intra)
        pair_all = self.gather(pairs)
        if self.env.rank != 0:
            return None
        return {"nodes": names, "ranks": ranks, "ranks_per_node": self.per_node,
                "intra_node": [x for x in intra_all if x is not None],
                "inter_node": [p for ps in pair_all for p in ps], "checkpoint": checkpoint,
                "matmul": {"n": self.matmul_n(), "dtype": str(self.dtype()).removeprefix("torch.")},
                "elapsed_s": round(time.perf_counter() - t0, 3)}

    def device_name(self) -> str:
        from trainctl.runtime.observe.peak import cpu_model, gpu_product_name

        if self.device.type == "cuda":
            return gpu_product_name(self.env.local_rank) or "cuda"
        return cpu_model()

    def catalog_peak(self) -> float | None:
        """The catalog's dense BF16 peak of this GPU (the matmul runs in bf16); None on a CPU or off-catalog."""
        if self.device.type != "cuda":
            return None
        from trainctl.hardware.catalog import ACCELERATORS
        from trainctl.hardware.detect import catalog_key_for

        acc = ACCELERATORS.get(catalog_key_for(self.device_name()) or self.spec.cluster.gpu)
        return acc.peak_bf16_tflops * 1e12 if acc is not None and acc.peak_bf16_tflops else None

    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def matmul_n(self) -> int:
        return GPU_MATMUL_N if self.device.type == "cuda" else CPU_MATMUL_N

    # --- (1) compute -------------------------------------------------------------------------------------
    def matmul(self) -> list[float]:
        """FLOP/s of each window: the verdict takes the best, and judges it with their spread."""
        n = self.matmul_n()
        a = torch.randn(n, n, device=self.device, dtype=self.dtype())
        b = torch.randn(n, n, device=self.device, dtype=self.dtype())
        return [2 * n**3 / mb.windowed(lambda: torch.mm(a, b), self.device, 1, window_s=WINDOW_S)
                for _ in range(WINDOWS)]

    # --- (2) memory --------------------------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        """Fill buffers with a pattern that differs per chunk and read it back: a bad cell or a failing
        allocation shows here, not at step 1."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            total = int(free * GPU_MEMORY_FRACTION)
        else:
            total = CPU_BUFFER_BYTES
        chunks, done = [], 0
        try:
            while done < total:
                numel = min(CHUNK_BYTES, total - done) // 4
                chunk = torch.empty(numel, dtype=torch.int32, device=self.device)
                chunk.copy_(torch.arange(numel, dtype=torch.int32, device=self.device) ^ len(chunks))
                chunks.append(chunk)
                done += numel * 4
            for i, chunk in enumerate(chunks):
                expect = torch.arange(chunk.numel(), dtype=torch.int32, device=self.device) ^ i
                if not torch.equal(chunk, expect):
                    bad = int((chunk != expect).sum())
                    return {"bytes": done, "ok": False, "error": f"{bad} int32 values read back wrong in chunk {i}"}
        except RuntimeError as e:  # out of memory, a device error
            return {"bytes": done, "ok": False, "error": str(e).splitlines()[0]}
        finally:
            del chunks
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return {"bytes": done, "ok": True, "error": None}

    # --- (3) and (4) links -------------------------------------------------------------------------------
    def intra_node(self, nodes: list[str]) -> dict[str, Any] | None:
        """The bus bandwidth of an all-reduce over each node's ranks (every node's group at once)."""
        lists = [[r for r, n in enumerate(nodes) if n == name] for name in dict.fromkeys(nodes)]
        if all(len(members) < 2 for members in lists):
            return None
        group, _ = dist.new_subgroups_by_enumeration(lists)
        members = next(m for m in lists if self.env.rank in m)
        n = len(members)
        numel = mb.fp32_numel(MESSAGE_BYTES, n)
        call = mb.collective_call("all_reduce", numel, group, n, self.device)
        dist.barrier()
        seconds = min(mb.timed(call, self.device, 1) for _ in range(REPEATS))
        if self.env.rank != members[0]:
            return None
        return {"node": self.node, "ranks": n, "bytes": numel * 4, "seconds": seconds,
                "bus_bytes_per_s": 2 * (n - 1) / n * numel * 4 / seconds}

    def ring(self, nodes: list[str], names: list[str]) -> list[dict[str, Any]]:
        """Half a round trip between the first ranks of node i and node i+1 (mod the node count), one pair at
        a time: a pair measured alone is that link's figure, not the fabric's. The first end records it."""
        firsts = [nodes.index(name) for name in names]
        count = len(names) if len(names) > 2 else len(names) - 1  # two nodes: one pair, not twice
        out = []
        for i in range(max(count, 0)):
            a, b = firsts[i], firsts[(i + 1) % len(names)]
            dist.barrier()
            if self.env.rank not in (a, b):
                continue
            call = mb.ping_pong(MESSAGE_BYTES // 4, b if self.env.rank == a else a, self.env.rank == a, self.device)
            seconds = min(mb.timed(call, self.device, 1) for _ in range(REPEATS)) / 2
            if self.env.rank == a:
                out.append({"a": names[i], "b": names[(i + 1) % len(names)], "bytes": MESSAGE_BYTES,
                            "seconds": seconds, "bytes_per_s": MESSAGE_BYTES / seconds})
        return out

    # --- (5) NVML ----------------------------------------------------------------------------------------
    def nvml(self) -> dict[str, Any] | None:
        if self.device.type != "cuda":
            return None
        try:
            import pynvml  # lazily, as trainctl/hardware/detect.py
        except ImportError:
            return {"error": "nvidia-ml-py is not installed"}
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as e:
            return {"error": f"NVML: {e}"}
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
            out: dict[str, Any] = {
                "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)}
            try:
                out["ecc_uncorrected_volatile"] = int(pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
            except pynvml.NVMLError as e:  # ECC off or not supported: nothing to count
                out["ecc_note"] = str(e)
            return out
        except pynvml.NVMLError as e:
            return {"error": f"NVML: {e}"}
        finally:
            pynvml.nvmlShutdown()

    # --- (6) checkpoint directory ------------------------------------------------------------------------
    def checkpoint_dir(self, nodes: list[str], names: list[str]) -> dict[str, Any] | None:
        """Free space and visibility, from the first rank of each node: a token per node in a directory of
        its own beside (or in) the checkpoint directory, read back by every node, then removed."""
        from trainctl.checkpoint.space import existing_ancestor, free_bytes

        target = Path(self.spec.checkpoint.dir or self.run_dir / "checkpoints")
        base = target if target.is_dir() else existing_ancestor(target)
        tokens = base / f"{TOKENS}-{os.environ.get('SLURM_JOB_ID') or os.getpid()}"
        first = self.env.rank == nodes.index(self.node)
        mine: dict[str, Any] | None = None
        if first:
            mine = {"node": self.node, "free_bytes": free_bytes(target), "error": None, "missing": []}
            try:
                tokens.mkdir(exist_ok=True)
                (tokens / self.node).write_text(self.node, encoding="utf-8")
            except OSError as e:
                mine["error"] = f"cannot write a file under {base}: {e}"
        dist.barrier()
        if first and mine is not None and mine["error"] is None:
            mine["missing"] = [n for n in names if not (tokens / n).is_file()]
        every = self.gather(mine)
        dist.barrier()
        if first:
            for n in (tokens / self.node, tokens):
                with contextlib.suppress(OSError):  # another node's token still there: the last node removes it
                    n.unlink() if n.is_file() else n.rmdir()
        return {"path": str(target), "nodes": [x for x in every if x is not None]}


def _preflight(spec: RunSpec, env: RankEnv, device: torch.device, paths: RunPaths) -> None:
    result = Preflight(spec, env, device, paths.root).run()
    if result is not None:
        write_atomic(paths.preflight, json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> NoReturn:
    worker_main(MODULE, "preflight", _preflight, argv)


if __name__ == "__main__":
    main()
