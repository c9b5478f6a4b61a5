"""The calibration profile: JSON schema, fits from raw figures, atomic write, load, and the check against a
spec. Torch-free (the planner loads profiles).

A profile holds where it was measured (cluster, device, ranks, ranks per node, precision, train.compile,
versions, date),
every raw figure (per rank) and every fit:
  fits.matmul[tp].flops_per_s   GEMMs at the model's shapes on one TP rank
  fits.layer                    one real layer's forward + backward (tp 1): its FLOP/s and its efficiency,
                                that rate over the tp-1 GEMM rate (norms, softmax, activations, autograd)
  fits.compute[tp]              what the planner charges per FLOP: matmul rate x layer efficiency
  fits.layer.tp_seconds[tp]     the layer as a TP rank runs it in a TP group inside a node (plain, sp): its
                                excess over its FLOPs at compute[tp] is the layer's exposed TP time
  fits.links[link][op]          latency + bus bytes / bandwidth, per link class and collective; the latency
                                includes what a small collective costs more while the other ranks compute
                                (raw.load) than idle (`load_excess_s`; `idle_latency_s` before it)
  fits.fixed                    the trainer's work outside the layers (fixed.FixedWork): the embedding's and
                                the LM head + loss's seconds per micro-batch beyond the head's FLOPs, the
                                optimizer step per tensor and per element, and what one FSDP2 unit adds to a
                                layer's forward + backward
A profile refitted from a run (trainctl/report/refit.py) has `source: run` and may lack links, matmul or
fixed (its rate already holds the fixed work).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.fileio import write_atomic
from trainctl.model_shape import ModelShape
from trainctl.plan.calibration.fit import LinkFit, fit_latency_bandwidth, fit_rate, median_of
from trainctl.plan.calibration.fixed import FixedWork, fit_fixed
from trainctl.plan.memory import compute_precision
from trainctl.spec.models import RunSpec

KIND = "trainctl-calibration"
SCHEMA = 2  # 2: fits.fixed (schema 1 profiles priced no work outside the layers)
STALE_DAYS = 30  # older than this: warned (drivers, firmware and neighbours change)
REDO = "run `trainctl calibrate SPEC --out {path}` again"


def build(meta: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The profile of one calibration: `meta` (where and what), `raw` (per-rank seconds), and the fits."""
    matmul: dict[str, dict[str, float]] = {}
    for tp in sorted({int(r["tp"]) for r in raw["matmul"]}):
        rate, err = fit_rate([(r["flops"], median_of(r["seconds"])) for r in raw["matmul"] if r["tp"] == tp])
        matmul[str(tp)] = {"flops_per_s": rate, "rms_rel_error": err}
    layer = raw["layer"]
    layer_rate = layer["flops"] / median_of(layer["seconds"])
    efficiency = layer_rate / matmul["1"]["flops_per_s"]
    links: dict[str, dict[str, dict[str, Any]]] = {}
    for link in sorted({r["link"] for r in raw["collectives"]}):
        for op in sorted({r["op"] for r in raw["collectives"] if r["link"] == link}):
            pts = [(r["bus_bytes"], median_of(r["seconds"])) for r in raw["collectives"]
                   if r["link"] == link and r["op"] == op]
            links.setdefault(link, {})[op] = fit_latency_bandwidth(pts).as_dict()
    for r in raw.get("load", []):  # every op of the link pays the same wait for a busy peer
        ops = links[r["link"]]
        idle = LinkFit(**ops[r["op"]]).seconds(r["bus_bytes"], 1)
        excess = max(0.0, median_of(r["seconds"]) - idle)
        for fit in ops.values():
            fit.update(idle_latency_s=fit["latency_s"], load_excess_s=excess, latency_s=fit["latency_s"] + excess)
    fits = {
        "matmul": matmul,
        "layer": {"flops_per_s": layer_rate, "efficiency": efficiency, "recompute": layer["recompute"],
                  "tokens": layer["tokens"], "tp_seconds": _tp_layers(layer.get("tp", []))},
        "compute": {tp: v["flops_per_s"] * efficiency for tp, v in matmul.items()},
        "links": links,
    }
    if "fixed" in raw:
        fits["fixed"] = fit_fixed(raw["fixed"], fits["compute"]["1"]).as_dict()
    return {"kind": KIND, "schema": SCHEMA, "source": "micro-benchmarks", **meta, "raw": raw, "fits": fits}


def _tp_layers(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """tp -> {"plain" | "sp": one layer's forward + backward seconds on a TP rank, median over ranks}."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        out.setdefault(str(r["tp"]), {})["sp" if r["sequence_parallel"] else "plain"] = median_of(r["seconds"])
    return out


def spec_meta(spec: RunSpec) -> dict[str, Any]:
    """What a profile records of the spec it was measured for: the cluster it must match, the model."""
    c = spec.cluster
    return {"spec_name": spec.name, "cluster": {"gpu": c.gpu, "nodes": c.nodes, "ranks_per_node": c.gpus_per_node,
                                                "ranks": spec.world_size, "backend": spec.backend},
            "model": asdict(ModelShape.from_spec(spec.model)), "micro_batch": spec.parallel.micro_batch,
            "tp": spec.parallel.tp, "compile": spec.train.compile_with, **versions(), "created": now_iso()}


def summary(profile: dict[str, Any]) -> str:
    """One line of a profile's fits, for the console."""
    fits = profile["fits"]
    tp, rate = min(fits["compute"].items(), key=lambda kv: int(kv[0]))
    layer = fits.get("layer")
    parts = [f"compute {rate / 1e9:.3g} GFLOP/s per rank at tp {tp}"
             + (f" (layer efficiency {layer['efficiency']:.0%} of the GEMM rate)" if layer else "")]
    fixed = fits.get("fixed")
    if fixed:
        parts.append(f"ends {(fixed['embedding_s'] + fixed['head_extra_s']) * 1e3:.3g} ms per micro-batch, optimizer "
                     f"{fixed['tensor_s'] * 1e6:.0f} us per tensor + {fixed['element_s'] * 1e9:.3g} ns per element")
    for link, ops in fits.get("links", {}).items():
        ar = ops.get("all_reduce")
        if ar:
            parts.append(f"{link.replace('_', '-')} all-reduce {ar['latency_s'] * 1e6:.0f} us + "
                         f"{ar['bytes_per_s'] / 1e9:.3g} GB/s")
    return "; ".join(parts)


def run_precision(spec: RunSpec) -> str:
    """What the trainer computes in on the spec's cluster (the planner's rule: a CPU runs fp32 unless asked)."""
    return compute_precision(spec.train.precision, spec.cluster.gpu == "cpu", spec.train.low_precision_on_cpu)


def versions() -> dict[str, str | None]:
    """trainctl's and the installed torch's version, without importing torch."""
    from trainctl import __version__

    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"trainctl_version": __version__, "torch_version": torch_version}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def save(path: Path, profile: dict[str, Any]) -> None:
    """Write atomically and durably (trainctl.fileio): a reader never sees half a profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(profile, indent=1) + "\n", fsync=True)


@dataclass(frozen=True)
class Profile:
    """A loaded, schema-checked profile."""

    path: Path
    data: dict[str, Any]
    compute: dict[int, float]  # tp -> FLOP/s per rank the planner charges
    links: dict[str, dict[str, LinkFit]]
    fixed: FixedWork | None = None  # the work outside the layers; None: a refit profile (its rate holds it)

    @property
    def cluster(self) -> dict[str, Any]:
        return self.data["cluster"]

    @property
    def peak_flops(self) -> float | None:
        """The peak the trainer's MFU divides by (trainctl/runtime/observe/peak.py), measured where it runs."""
        p = self.data.get("peak_flops_per_rank")
        return float(p) if p else None

    def compute_rate(self, tp: int) -> float:
        """The rate at `tp`, else at the measured TP size nearest on a log scale (the GEMMs change shape)."""
        if tp in self.compute:
            return self.compute[tp]
        return self.compute[min(self.compute, key=lambda t: (abs(math.log(t / tp)), t))]

    def tp_layer(self, tp: int, sp: bool, recompute: str) -> tuple[float, int] | None:
        """(seconds, tokens) of one layer's forward + backward on a TP rank of a `tp` group inside a node, as
        measured (its collectives included), or None where not measured (another recompute mode too)."""
        layer = self.data.get("fits", {}).get("layer") or {}
        seconds = (layer.get("tp_seconds") or {}).get(str(tp), {}).get("sp" if sp else "plain")
        if not _positive(seconds) or layer.get("recompute") != recompute or not layer.get("tokens"):
            return None
        return float(seconds), int(layer["tokens"])

    def link(self, link: str, op: str) -> LinkFit | None:
        return self.links.get(link, {}).get(op)

    def describe(self) -> dict[str, Any]:
        d, c = self.data, self.cluster
        return {"calibrated": True, "path": str(self.path), "source": d.get("source"), "created": d.get("created"),
                "device": (d.get("device") or {}).get("name"), "gpu": c.get("gpu"), "ranks": c.get("ranks"),
                "ranks_per_node": c.get("ranks_per_node"), "precision": d.get("precision")}


def _bad(path: Path, what: str) -> UsageError:
    return UsageError(f"calibration profile {path}: {what}", hint=REDO.format(path=path))


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def load(path: Path) -> Profile:
    """Read and schema-check a profile; a missing, corrupt, truncated or foreign file is a UsageError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"calibration profile {path}: cannot read it ({e.strerror or e})",
                         hint="check cluster.calibration / --calibration, or run `trainctl calibrate SPEC`") from e
    except UnicodeDecodeError as e:
        raise _bad(path, "not a text file (corrupt)") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(path, f"not valid JSON at line {e.lineno} column {e.colno} (truncated or corrupt)") from e
    return parse(path, data)


def parse(path: Path, data: Any) -> Profile:
    """Schema-check a profile's JSON data (`path` names it in errors)."""
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise _bad(path, f"not a trainctl calibration profile (no \"kind\": \"{KIND}\")")
    if data.get("schema") != SCHEMA:
        raise _bad(path, f"schema {data.get('schema')!r}; this trainctl reads schema {SCHEMA} (it also measures the "
                         "work outside the layers)")
    try:
        cluster, fits = data["cluster"], data["fits"]
        for key in ("gpu", "ranks", "ranks_per_node"):
            cluster[key]  # noqa: B018 - presence check
        compute = {int(tp): float(v) for tp, v in fits["compute"].items()}
        links = {link: {op: LinkFit(float(f["latency_s"]), float(f["bytes_per_s"]), int(f["points"]),
                                    float(f["rms_rel_error"])) for op, f in ops.items()}
                 for link, ops in (fits.get("links") or {}).items()}
        fixed = FixedWork.from_dict(fits["fixed"]) if fits.get("fixed") else None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"incomplete or malformed ({type(e).__name__}: {e})") from e
    if not compute or not all(_positive(v) and t >= 1 for t, v in compute.items()):
        raise _bad(path, "fits.compute holds no positive FLOP/s rate")
    for link, ops in links.items():
        for op, f in ops.items():
            if not (_positive(f.bytes_per_s) and f.latency_s >= 0 and math.isfinite(f.latency_s)):
                raise _bad(path, f"fits.links.{link}.{op} has a non-positive bandwidth or a negative latency")
    if fixed is not None and not fixed.valid():
        raise _bad(path, "fits.fixed holds a negative or non-finite figure")
    return Profile(path, data, compute, links, fixed)


def _compiled(backend: Any) -> str:
    return f"compiled with {backend}" if backend else "eager"


def check(profile: Profile, spec: RunSpec) -> list[str]:
    """Refuse a profile measured on another cluster (UsageError); return warnings for lesser differences."""
    c, p = spec.cluster, profile.cluster
    path = profile.path
    hint = f"calibrate this cluster: trainctl calibrate SPEC --out {path}"
    for name, mine, theirs in (("cluster.gpu", c.gpu, p.get("gpu")), ("ranks", spec.world_size, p.get("ranks")),
                               ("ranks per node (cluster.gpus_per_node)", c.gpus_per_node, p.get("ranks_per_node"))):
        if mine != theirs:
            raise UsageError(f"calibration profile {path} was measured with {name} = {theirs}, the spec has {mine}",
                             hint=hint)
    warnings = []
    precision = run_precision(spec)
    if profile.data.get("precision") not in (None, precision):
        warnings.append(f"measured in {profile.data.get('precision')}, the run computes in {precision}")
    if "compile" in profile.data and profile.data["compile"] != spec.train.compile_with:  # older: no key
        warnings.append(f"its layers ran {_compiled(profile.data['compile'])}, the run's "
                        f"{_compiled(spec.train.compile_with)}: other kernels, another rate")
    mine_versions = versions()
    for key in ("trainctl_version", "torch_version"):
        if profile.data.get(key) and mine_versions[key] and profile.data[key] != mine_versions[key]:
            warnings.append(f"measured with {key.split('_')[0]} {profile.data[key]}, this is {mine_versions[key]}")
    created = profile.data.get("created")
    try:
        age = (datetime.now(timezone.utc) - datetime.fromisoformat(str(created))).days
    except (TypeError, ValueError):
        warnings.append(f"no valid measurement date ({created!r})")
    else:
        if age > STALE_DAYS:
            warnings.append(f"measured {age} days ago ({created}); hardware, drivers and neighbours change")
    model = profile.data.get("model")
    if isinstance(model, dict) and model != asdict(ModelShape.from_spec(spec.model)):
        warnings.append("measured at another model's GEMM shapes; rates at this model's shapes may differ")
    return [f"calibration profile {path}: {w}" for w in warnings]

