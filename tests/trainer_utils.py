"""Helpers for the trainer's multi-process tests: a run directory with a tiny spec, its ranks started,
the metrics it wrote and its final weights gathered into full tensors by parameter name."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from paths import REPO as ROOT
from spec_utils import TINY, deep_update, world_size, write_spec

VENV_BIN = Path(sys.executable).parent
TORCHRUN = str(VENV_BIN / "torchrun")
FORK_RANKS = Path(__file__).with_name("fork_ranks.py")


def make_run(root: Path, name: str, **sections: dict[str, Any]) -> tuple[Path, int]:
    """A run directory with spec.yaml = TINY updated by `sections`; returns (dir, world size)."""
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    spec = deep_update(TINY, sections)
    write_spec(run / "spec.yaml", base=spec, one_node=True)
    return run, world_size(spec["parallel"])


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test starts ranks in: this one, one OpenMP thread per rank (the ranks share the
    cores), the repository importable ahead of what PYTHONPATH already held (packages installed with
    --target, as on a lent GPU machine), then `extra`."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


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
    """NPROC ranks of `-m MODULE ARGS` or `SCRIPT ARGS`, run from the repository root, forked by the session's
    warmed fork_ranks.py server (its imports paid once per session, not once per call)."""
    e = rank_env(env)
    args = [str(nproc), *target]
    with tempfile.TemporaryDirectory(prefix="fork-ranks-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"nproc": nproc, "target": target, "env": e, "cwd": str(ROOT), "out": str(out), "err": str(err)}
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(_fork_server()))
            s.sendall(json.dumps(request).encode() + b"\n")
            replies = s.makefile()
            pid = json.loads(replies.readline())["pid"]
            s.settimeout(timeout)
            try:
                code = json.loads(replies.readline())["code"]
            except BaseException as e:  # our timeout, pytest-timeout, Ctrl-C: no rank outlives the call
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text()) from None
                raise
        return subprocess.CompletedProcess(args, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


_server: tuple[subprocess.Popen, Path] | None = None


def _fork_server() -> Path:
    """The socket of this session's fork_ranks.py --serve (started on first use, again if it died)."""
    global _server
    if _server is None or _server[0].poll() is not None:
        # /tmp, not $TMPDIR: a Unix socket path must stay under 108 bytes
        sock = Path(tempfile.mkdtemp(prefix="fork-server-", dir="/tmp" if os.path.isdir("/tmp") else None)) / "socket"
        with open(sock.with_name("server.log"), "w") as log:
            proc = subprocess.Popen([sys.executable, str(FORK_RANKS), "--serve", str(sock)], cwd=ROOT, env=rank_env(),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        atexit.register(lambda: (proc.kill(), shutil.rmtree(sock.parent, ignore_errors=True)))
        deadline = time.monotonic() + 120
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fork_ranks.py --serve did not start (exit {proc.poll()}): "
                                   f"{sock.with_name('server.log').read_text()[-2000:]}")
            time.sleep(0.02)
        _server = (proc, sock)
    return _server[1]


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
    from trainctl.rundir.paths import read_jsonl

    return read_jsonl(run / "metrics.jsonl")


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


def final_weights(run: Path) -> dict[str, Any]:
    """name -> full tensor, TP shards concatenated with the model's own shard layout."""
    import torch

    from trainctl.runtime.parallel.tensor_parallel import unshard_tensors

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
