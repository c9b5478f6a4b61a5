"""Helpers for the trainer's multi-process tests: a run directory with a tiny spec, its ranks started,
the metrics it wrote and its final weights gathered into full tensors by parameter name."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from paths import REPO as ROOT

VENV_BIN = Path(sys.executable).parent
TORCHRUN = str(VENV_BIN / "torchrun")
FORK_RANKS = Path(__file__).with_name("fork_ranks.py")

TINY: dict[str, Any] = {
    "name": "tiny",
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1},
    "train": {"global_batch": 8, "steps": 10, "lr": 1e-3, "warmup": 2, "precision": "fp32", "seed": 7,
              "grad_clip": 1.0},
    "data": {"synthetic": True},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
    "launcher": {"backend": "local"},
}


def deep_update(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in upd.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_run(root: Path, name: str, **sections: dict[str, Any]) -> tuple[Path, int]:
    """A run directory with spec.yaml = TINY updated by `sections`; returns (dir, world size)."""
    spec = deep_update(TINY, sections)
    p = spec["parallel"]
    world = p["tp"] * p.get("cp", 1) * p["pp"] * p.get("dp", 1)
    spec["cluster"]["gpus_per_node"] = world
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run, world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(run: Path, nproc: int, env: dict[str, str] | None = None, timeout: float = 300,
                dump: bool = True) -> subprocess.CompletedProcess:
    """The run's ranks, srun-style, forked from one interpreter that imported torch once (fork_ranks.py);
    exit status 0 when every rank exited 0, else 1 (as torchrun's)."""
    extra = {**(env or {}), **({"TRAINCTL_DUMP_WEIGHTS": "1"} if dump else {})}
    return fork_ranks(nproc, ["-m", "trainctl.runtime", str(run)], env=extra, timeout=timeout)


def fork_ranks(nproc: int, target: list[str], env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """NPROC ranks of `-m MODULE ARGS` or `SCRIPT ARGS` (fork_ranks.py), run from the repository root."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, str(FORK_RANKS), str(nproc), *target], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def processes_mentioning(text: str) -> list[int]:
    """Pids of the live (not zombie) processes other than this one whose command line contains `text` (e.g. a
    run directory: torchrun and its ranks)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmd and state not in ("Z", "X"):
            pids.append(int(p.name))
    return pids


def files_containing(root: Path, *needles: str) -> list[str]:
    """The files under `root` (a run directory) that hold any of `needles`, e.g. a credential's value."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                  and any(n.encode() in p.read_bytes() for n in needles))


def metrics(run: Path) -> list[dict[str, Any]]:
    from trainctl.rundir import read_jsonl

    return read_jsonl(run / "metrics.jsonl")


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


def final_weights(run: Path) -> dict[str, Any]:
    """name -> full tensor, TP shards concatenated with the model's own shard layout."""
    import torch

    from trainctl.runtime.tensor_parallel import unshard_tensors

    by_pp: dict[int, dict[int, dict[str, Any]]] = {}
    for f in sorted((run / "final_weights").glob("pp*-tp*.pt")):
        pp, tp = (int(x) for x in f.stem[2:].split("-tp"))
        by_pp.setdefault(pp, {})[tp] = torch.load(f, weights_only=False)
    out: dict[str, Any] = {}
    for tps in by_pp.values():
        ranks = [tps[t] for t in sorted(tps)]
        for name, spec in ranks[0]["shards"].items():
            out[name] = unshard_tensors([r["params"][name] for r in ranks], spec)
    return out


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
