"""The calibration profile: JSON schema, fits from raw figures, atomic write, load, and the check against a
spec. Torch-free (the planner loads profiles). A profile describes hardware, not a job: it prices any spec on
the same accelerator (`check`), naming what the plan extrapolates.

A profile holds where it was measured (cluster, device, ranks, ranks per node, precision, train.compile,
versions, date),
every raw figure (per rank) and every fit:
  fits.matmul[tp].flops_per_s   GEMMs at the model's shapes on one TP rank
  fits.layer                    one real layer's forward + backward (tp 1): its FLOP/s and its efficiency,
                                that rate over the tp-1 GEMM rate (norms, softmax, activations, autograd)
  fits.compute[tp]              what the planner charges per FLOP: matmul rate x layer efficiency
  fits.layer.tp_seconds[tp]     the layer as a TP rank runs it in a TP group inside a node (plain, sp): its
                                excess over its FLOPs at compute[tp] is the layer's exposed TP time
  fits.layer.cp_seconds[cp]     the layer as a CP rank runs it on its two chunks of the sequence in a CP group
                                inside a node: its excess over its FLOPs at compute[1] is the layer's exposed
                                CP time (the K/V exchange, the chunked attention's merging, their waits)
  fits.layer.dispatch_s[mode]   the layer's forward + backward on a few tokens, per recompute mode: on a GPU
                                the host's time to issue its kernels, the least a layer takes however little
                                its work (a CPU runs what it issues: no separate floor there)
  fits.layer.call_s             on a GPU, what each timed call of one layer pays once (the backward's start,
                                the wait for the last kernels): one layer less the extra layer of a stack
                                of two (`in_step`); the layer's rate, its TP seconds and the dispatch floor
                                are per layer as a step runs them, without it (0 on a CPU)
  fits.links[link][op]          per link class and collective kind, fitted over every group and message
                                size measured (fit.py): latency per call + latency per ring step x the
                                kind's steps at n + bus bytes / bandwidth, the group sizes measured
                                (`groups`, the largest `group_size`: beyond it the model extrapolates) and
                                the residuals against the measured points (`rms_rel_error`,
                                `max_rel_error`); the per-call latency includes what a small collective
                                costs more while the other ranks compute (raw.load) than idle
                                (`load_excess_s`; `idle_latency_s` before it); send/recv's, what a
                                pipeline hop between two ranks taking turns costs more than idle
  fits.dp_overlap[link]         the share of a gradient bucket's all-reduce that hid behind the layer's
                                forward + backward, every rank at once (0: none, running both took the sum
                                or longer; 1: all of it), in the smallest group of each link class: the
                                plan's estimate.dp_overlap where the spec does not set one
  fits.fixed                    the trainer's work outside the layers (fixed.FixedWork): the embedding's and
                                the LM head + loss's seconds per micro-batch beyond the head's FLOPs, the
                                optimizer step per tensor and per element, and what one FSDP2 unit adds to a
                                layer's forward + backward
A profile refitted from a run (trainctl/report/refit.py) has `source: run` and may lack links, matmul or
fixed (without a base profile: its rate then holds the fixed work; with one, the base's fixed work is kept).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.fileio import NotRegularFile, TooLarge, read_capped, write_atomic
from trainctl.hardware.catalog import resolve_fabric
from trainctl.model_shape import ModelShape
from trainctl.plan.calibration.fit import LinkFit, fit_collective, fit_quality, fit_rate, median_of
from trainctl.plan.calibration.fixed import FixedWork, fit_fixed
from trainctl.plan.calibration.shapes import INTER, INTRA, tp_sizes
from trainctl.plan.memory import compute_precision
from trainctl.spec.models import RunSpec

KIND = "trainctl-calibration"
SCHEMA = 3  # 2: fits.fixed (schema 1 priced no work outside the layers); 3: collectives fitted per kind over
#            group sizes, per-call + per-ring-step latency (schema 2 had one latency at one group size)
SCHEMA_CHANGES = {1: "it also measures the work outside the layers",
                  2: "it fits each collective's latency per call and per ring step over group sizes"}
STALE_DAYS = 30  # older than this: warned (drivers, firmware and neighbours change)
REDO = "run `trainctl calibrate SPEC --out {path}` again"
MAX_PROFILE_BYTES = 16 << 20  # a profile is tens of KB; a bound keeps /dev/zero or a huge file from being read


def build(meta: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The profile of one calibration: `meta` (where and what), `raw` (per-rank seconds), and the fits."""
    matmul: dict[str, dict[str, float]] = {}
    for tp in sorted({int(r["tp"]) for r in raw["matmul"]}):
        rate, err = fit_rate([(r["flops"], median_of(r["seconds"])) for r in raw["matmul"] if r["tp"] == tp])
        matmul[str(tp)] = {"flops_per_s": rate, "rms_rel_error": err}
    layer = raw["layer"]
    stack = layer.get("stack") or {}
    depth = int(stack.get("depth") or 0)
    seconds, call_s = in_step(layer["seconds"], stack.get("seconds"), depth)
    layer_rate = layer["flops"] / seconds
    efficiency = layer_rate / matmul["1"]["flops_per_s"]
    links = fit_links(raw)
    dispatch = {mode: in_step(s, (stack.get("dispatch") or {}).get(mode), depth)[0]
                for mode, s in (layer.get("dispatch") or {}).items()}
    fits = {
        "matmul": matmul,
        "layer": {"flops_per_s": layer_rate, "efficiency": efficiency, "recompute": layer["recompute"],
                  "tokens": layer["tokens"], "call_s": call_s,
                  "tp_seconds": _tp_layers(layer.get("tp", []), call_s),
                  "cp_seconds": {str(r["cp"]): _less_call(r["seconds"], call_s) for r in layer.get("cp", [])},
                  "dispatch_s": dispatch},
        "compute": {tp: v["flops_per_s"] * efficiency for tp, v in matmul.items()},
        "links": links,
    }
    if raw.get("overlap"):
        fits["dp_overlap"] = fit_overlap(raw["overlap"])
    if "fixed" in raw:
        fits["fixed"] = fit_fixed(raw["fixed"], fits["compute"]["1"]).as_dict()
    return {"kind": KIND, "schema": SCHEMA, "source": "micro-benchmarks", **meta, "raw": raw, "fits": fits}


def fit_links(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """link -> op -> the collective's fit over every group and message size measured (fit.fit_collective),
    its latency raised by what a small collective costs more while the other ranks compute (raw.load: every
    collective of the link pays the all-reduce's wait for a busy peer, send/recv the pipeline hop's where it
    was measured; `idle_latency_s` before it)."""
    links: dict[str, dict[str, dict[str, Any]]] = {}
    for link in sorted({r["link"] for r in raw["collectives"]}):
        for op in sorted({r["op"] for r in raw["collectives"] if r["link"] == link}):
            rows = [r for r in raw["collectives"] if r["link"] == link and r["op"] == op]
            fit = fit_collective(op, [(r["group_size"], r["bus_bytes"], median_of(r["seconds"])) for r in rows])
            links.setdefault(link, {})[op] = fit.as_dict()
    excess: dict[tuple[str, str], float] = {}
    # the all-reduce's wait stands for every collective of the link, so it comes first; the pipeline hop's
    # (measured by profiles since the hop was added) then replaces send/recv's, which the trainer posts
    # asynchronously
    for r in sorted(raw.get("load", []), key=lambda r: r["op"] != "all_reduce"):
        if not r["seconds"]:
            continue
        ops = links[r["link"]]
        idle = LinkFit.from_dict(ops[r["op"]]).seconds(r["bus_bytes"], 1, r["group_size"])
        wait = max(0.0, median_of(r["seconds"]) - idle)
        for op in ops if r["op"] == "all_reduce" else [r["op"]]:
            excess[r["link"], op] = wait
    for (link, op), wait in excess.items():
        fit = links[link][op]
        fit.update(idle_latency_s=fit["latency_s"], load_excess_s=wait, latency_s=fit["latency_s"] + wait)
    return links


def fit_overlap(rows: list[dict[str, Any]]) -> dict[str, float]:
    """link -> the share of the collective hidden behind the compute, from the medians over ranks of calibrate's
    (compute, collective, both) seconds: (compute + collective - both) / collective, clamped to [0, 1] (both
    together slower than the sum, as gloo's thread fighting the compute for a CPU's cores: none hidden)."""
    out = {}
    for r in rows:
        compute, collective, both = (median_of(r[k]) for k in ("compute_s", "collective_s", "together_s"))
        out[r["link"]] = min(1.0, max(0.0, (compute + collective - both) / collective)) if collective > 0 else 0.0
    return out


def in_step(one: list[float | None], stack: list[float | None] | None, depth: int) -> tuple[float, float]:
    """(seconds of a layer as a step runs it, seconds each timed call of one layer paid once on top) from the
    per-rank seconds of one layer and, on a GPU, of a stack of `depth` layers (calibrate's `_stack`): the stack's
    extra layers cost what a layer costs inside a step, whose layers follow each other in one queue. Without a
    usable stack (a CPU, an out-of-memory stack, a difference outside (0, one layer]): one layer's time, no
    call cost."""
    alone = median_of([x for x in one if x is not None])
    stacked = [x for x in stack or [] if x is not None]
    if depth < 2 or not stacked:
        return alone, 0.0
    layer = (median_of(stacked) - alone) / (depth - 1)
    return (layer, alone - layer) if 0.0 < layer <= alone else (alone, 0.0)


def _tp_layers(rows: list[dict[str, Any]], call_s: float) -> dict[str, dict[str, float]]:
    """tp -> {"plain" | "sp": one layer's forward + backward seconds on a TP rank, median over ranks, less what
    each timed call pays once (`in_step`: the same calls at tp 1)}."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        out.setdefault(str(r["tp"]), {})["sp" if r["sequence_parallel"] else "plain"] = _less_call(r["seconds"], call_s)
    return out


def _less_call(per_rank: list[float], call_s: float) -> float:
    """A layer figure measured in a group (TP, CP): its median over ranks, less what each timed call pays once."""
    return max(median_of(per_rank) - call_s, 0.0)


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
            worst = max(ops.values(), key=lambda f: f["max_rel_error"])
            parts.append(f"{link.replace('_', '-')} all-reduce {ar['latency_s'] * 1e6:.0f} us + "
                         f"{ar['step_latency_s'] * 1e6:.0f} us per ring step + {ar['bytes_per_s'] / 1e9:.3g} GB/s "
                         f"(fit of {worst['op'].replace('_', '-')}: {fit_quality(worst['max_rel_error'])})")
    for link, share in (fits.get("dp_overlap") or {}).items():
        parts.append(f"{link.replace('_', '-')} DP reduction {share:.0%} hidden behind compute")
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
    fixed: FixedWork | None = None  # the work outside the layers; None: a refit without a base (its rate holds it)

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

    def dp_overlap(self, link: str) -> float | None:
        """The share of a DP reduction on `link` (a profile link class) measured to hide behind compute; None
        where not measured (profiles before the measurement, a refit)."""
        x = (self.data.get("fits", {}).get("dp_overlap") or {}).get(link)  # parse checked it is in [0, 1]
        return None if x is None else float(x)

    def cp_layer(self, cp: int, recompute: str) -> tuple[float, int] | None:
        """(seconds, tokens of the whole sequence x micro-batch) of one layer's forward + backward on a CP rank
        of a `cp` group inside a node, as measured (its K/V exchange included; the rank held tokens / cp of
        them), or None where not measured (another recompute mode too)."""
        return self._group_layer(lambda layer: (layer.get("cp_seconds") or {}).get(str(cp)), recompute)

    def tp_layer(self, tp: int, sp: bool, recompute: str) -> tuple[float, int] | None:
        """(seconds, tokens) of one layer's forward + backward on a TP rank of a `tp` group inside a node, as
        measured (its collectives included), or None where not measured (another recompute mode too)."""
        return self._group_layer(
            lambda layer: (layer.get("tp_seconds") or {}).get(str(tp), {}).get("sp" if sp else "plain"), recompute)

    def _group_layer(self, pick: Callable[[dict[str, Any]], Any], recompute: str) -> tuple[float, int] | None:
        """(seconds `pick` finds in fits.layer, the measured micro-batch's tokens), or None where it is not a
        positive figure or the layer was measured at another recompute mode."""
        layer = self.data.get("fits", {}).get("layer") or {}
        seconds = pick(layer)
        if not _positive(seconds) or layer.get("recompute") != recompute or not layer.get("tokens"):
            return None
        return float(seconds), int(layer["tokens"])

    def dispatch_floor(self, recompute: str) -> float | None:
        """Seconds the host takes to issue one layer's forward + backward kernels at `recompute` on an
        asynchronous device (a GPU); None on a CPU (it runs what it issues, and the measured rate holds that)
        or where not measured."""
        if (self.data.get("device") or {}).get("type") != "cuda":
            return None
        seconds = ((self.data.get("fits", {}).get("layer") or {}).get("dispatch_s") or {}).get(recompute)
        return float(seconds) if _positive(seconds) else None

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
        text = read_capped(path, MAX_PROFILE_BYTES).decode("utf-8")
    except (NotRegularFile, TooLarge) as e:  # /dev/zero never ends, a FIFO never opens: refused unread
        what = (f"is {e.kind}, not a profile file" if isinstance(e, NotRegularFile) else
                f"larger than {MAX_PROFILE_BYTES >> 20} MiB, the most a profile may be")
        raise UsageError(f"calibration profile {path}: {what}",
                         hint="pass the .json file `trainctl calibrate SPEC` wrote") from e
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
        old = data.get("schema")
        since = "; ".join(SCHEMA_CHANGES[v] for v in range(old, SCHEMA) if v in SCHEMA_CHANGES) \
            if isinstance(old, int) else ""
        raise _bad(path, f"schema {data.get('schema')!r}; this trainctl reads schema {SCHEMA}"
                         + (f" ({since})" if since else ""))
    try:
        cluster, fits = data["cluster"], data["fits"]
        for key in ("gpu", "ranks", "ranks_per_node"):
            cluster[key]  # noqa: B018 - presence check
        compute = {int(tp): float(v) for tp, v in fits["compute"].items()}
        links = {link: {op: LinkFit.from_dict(f) for op, f in ops.items()}
                 for link, ops in (fits.get("links") or {}).items()}
        fixed = FixedWork.from_dict(fits["fixed"]) if fits.get("fixed") else None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"incomplete or malformed ({type(e).__name__}: {e})") from e
    if not compute or not all(_positive(v) and t >= 1 for t, v in compute.items()):
        raise _bad(path, "fits.compute holds no positive FLOP/s rate")
    for link, ops in links.items():
        for op, f in ops.items():
            if not (_positive(f.bytes_per_s) and f.latency_s >= 0 and math.isfinite(f.latency_s)
                    and f.step_latency_s >= 0 and math.isfinite(f.step_latency_s)):
                raise _bad(path, f"fits.links.{link}.{op} has a non-positive bandwidth or a negative latency")
    if fixed is not None and not fixed.valid():
        raise _bad(path, "fits.fixed holds a negative or non-finite figure")
    overlap = fits.get("dp_overlap") or {}
    if not isinstance(overlap, dict) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in overlap.values()):
        raise _bad(path, "fits.dp_overlap holds a share outside [0, 1]")
    return Profile(path, data, compute, links, fixed)


def _compiled(backend: Any) -> str:
    return f"compiled with {backend}" if backend else "eager"


def check(profile: Profile, spec: RunSpec) -> list[str]:
    """Refuse a profile of another accelerator (UsageError, one line): a profile describes hardware, and
    prices any spec on the same hardware (another node count, world size, layout or model). Return warnings:
    lesser differences, and each term the plan extrapolates beyond what was measured (`extrapolations`)."""
    c, path = spec.cluster, profile.path
    if c.gpu != profile.cluster.get("gpu"):
        raise UsageError(f"calibration profile {path} was measured on cluster.gpu = {profile.cluster.get('gpu')}, "
                         f"the spec has {c.gpu}", hint=f"calibrate this hardware: trainctl calibrate SPEC --out {path}")
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
    return [f"calibration profile {path}: {w}" for w in [*warnings, *extrapolations(profile, spec)]]


def same_model(profile: Profile, spec: RunSpec) -> bool:
    """Whether the profile's layers were timed at the spec's model (a profile without the record: assumed)."""
    model = profile.data.get("model")
    return not isinstance(model, dict) or model == asdict(ModelShape.from_spec(spec.model))


def extrapolations(profile: Profile, spec: RunSpec) -> list[str]:
    """What the plan of `spec` prices beyond what the profile measured, each with the rule it follows, once per
    link: larger groups (fit.LinkFit.latency_at), inter-node links on one node (the catalog's fabric), ranks
    per node, another model (plan/rates.py MeasuredRates)."""
    c, out = spec.cluster, []
    measured_per_node = profile.cluster.get("ranks_per_node")
    if measured_per_node != c.gpus_per_node:
        # a GPU computes alone whatever its neighbours do; CPU ranks divide the node's cores, and no rescaling
        # of the measured rates held (docs/design/calibration.md, "Calibration profile")
        why = ("on a CPU the ranks share the node's cores, so no rate measured then holds (more ranks per node: "
               "slower than priced, fewer: faster); price this spec from its own: trainctl calibrate SPEC"
               if c.gpu == "cpu" else "the compute rates are per rank as the node was shared then")
        out.append(f"measured with {measured_per_node} ranks per node, the spec has {c.gpus_per_node}: {why}")
    measured_tp = sorted(profile.compute)
    beyond = [t for t in tp_sizes(spec) if t > measured_tp[-1]]
    if beyond:
        out.append(f"tp {'/'.join(map(str, beyond))} priced at the compute rate of tp {measured_tp[-1]}, the largest "
                   f"measured (tp {'/'.join(map(str, measured_tp))}): their GEMM shapes were not timed")
    # the largest group the spec's cluster can form on each link class: a node; every rank across nodes
    largest = {INTRA: c.gpus_per_node, INTER: spec.world_size if c.nodes > 1 else 1}
    for link, n in largest.items():
        ops = {op: f for op, f in profile.links.get(link, {}).items() if op != "send_recv"}  # a pair is a pair
        where = link.replace("_", "-")
        if n < 2 or not profile.links:
            continue
        if not ops:
            fabric = resolve_fabric(c)
            how = ("x estimate.comm_efficiency, no latency" if c.gpu == "cpu" or spec.estimate.comm_efficiency
                   else "in NCCL's latency and bus-bandwidth model")
            out.append(f"{where} links: not calibrated (measured on one node), priced from the catalog's fabric "
                       f"({fabric.name}, {fabric.gbps_per_gpu:g} GB/s per GPU {how})")
            continue
        n0 = min(f.group_size for f in ops.values())
        if n > n0:
            one = [op for op, f in sorted(ops.items()) if len(f.groups) < 2]
            split = (f"; {', '.join(one).replace('_', '-')} measured at one group size: all its latency per step"
                     if one else "")
            out.append(f"{where} {', '.join(sorted(ops)).replace('_', '-')} in groups of up to {n} ranks beyond "
                       f"the largest measured ({n0}): each kind's fit extrapolated, latency per call + per ring "
                       f"step x steps(n) (all-reduce 2(n-1), the others n-1), bytes at (n-1)/n of the message per "
                       f"rank at the fitted bus bandwidth{split}")
    if not same_model(profile, spec):
        m, mine = profile.data["model"], ModelShape.from_spec(spec.model)
        out.append(f"measured at another model (hidden {m.get('hidden')}, {m.get('layers')} layers, vocab "
                   f"{m.get('vocab')}; the spec's {mine.hidden}, {mine.layers}, {mine.vocab}): compute at the "
                   f"calibrated GEMM shapes' rate x its layer efficiency, TP layers from the collective fits "
                   f"(the measured TP layers unused), the ends' work per token as measured")
    return out

