"""The verdict of a preflight: which nodes are fit to train, and why not. Pure functions over what the
preflight worker measured (RUN/preflight.json, trainctl/runtime/workers/preflight.py); no torch, no I/O.

Rates are judged against the median of their peers, the fleet without the device or node judged (one
throttled GPU among healthy ones stands out whatever the hardware; leaving it out keeps a small fleet's
median from leaning towards it: of two nodes, the fleet median is their mean), and on a GPU also against its
catalog peak (a fleet that is slow as a whole). A node pair of the
ring whose link is slow names the node when all of that node's pairs are slow, else the link: both of its
ends are then suspect. docs/design/launch.md, "Preflight and node exclusion".
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainctl.errors import UsageError

# NVML throttle reasons that mean the GPU is slowed by a fault, not by being idle or by an application
# setting (nvml.h: HW_SLOWDOWN 0x8, SW_THERMAL 0x20, HW_THERMAL 0x40, HW_POWER_BRAKE 0x80).
BAD_THROTTLE = {0x8: "hardware slowdown", 0x20: "software thermal", 0x40: "hardware thermal",
                0x80: "power brake"}


@dataclass(frozen=True)
class Thresholds:
    matmul_ratio: float = 0.8  # a device's matmul rate below this x its peers' median is bad
    link_ratio: float = 0.5  # an intra-node all-reduce or a node pair's link below this x its peers' median
    peak_fraction: float = 0.2  # GPU: a matmul rate below this x the catalog's dense peak is bad

    OPTIONS = {"matmul_ratio": "--min-matmul-ratio", "link_ratio": "--min-link-ratio",
               "peak_fraction": "--min-peak-fraction"}

    def check(self) -> None:
        for name, flag in self.OPTIONS.items():
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise UsageError(f"{flag} {value} is out of range", hint=f"give a fraction in (0, 1], e.g. "
                                 f"{getattr(Thresholds, name)}")


@dataclass
class NodeVerdict:
    node: str
    ranks: int = 0
    matmul_flops: float | None = None  # the node's slowest device
    matmul_ratio: float | None = None  # ... over its peers' median
    matmul_spread: float | None = None  # the measured spread the ratio is judged with (its peers' window_spread)
    memory_bytes: int = 0  # verified, summed over the node's devices
    intra_bytes_per_s: float | None = None
    links: list[str] = field(default_factory=list)  # "n2 4.1 GB/s" per pair of the ring
    free_bytes: int | None = None
    reasons: list[str] = field(default_factory=list)  # why the node is bad; empty: healthy
    notes: list[str] = field(default_factory=list)  # worth saying, not a reason to exclude it

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ok": self.ok, "ranks": self.ranks, "matmul_flops": self.matmul_flops,
                "matmul_ratio": self.matmul_ratio, "matmul_spread": self.matmul_spread,
                "memory_bytes": self.memory_bytes, "intra_bytes_per_s": self.intra_bytes_per_s,
                "links": self.links, "free_bytes": self.free_bytes, "reasons": self.reasons, "notes": self.notes}


def peer_median(values: list[float], i: int) -> float | None:
    """The median of every value but values[i]: what the i-th is judged against (None: it has no peers)."""
    others = values[:i] + values[i + 1:]
    return statistics.median(others) if others else None


def window_spread(rank: dict[str, Any]) -> float:
    """How far a device's median matmul window fell below its best, as a fraction of the best (0 without
    windows). On a loaded host a best window can miss by that much."""
    w = rank.get("matmul_windows") or []
    return (max(w) - statistics.median(w)) / max(w) if w and max(w) > 0 else 0.0


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s"


def judge(result: dict[str, Any], th: Thresholds, *, needed_bytes: int | None = None) -> list[NodeVerdict]:
    """One verdict per node, in the order the worker found them. `needed_bytes`: what the run's checkpoints
    need free at their peak. A rank's `peak_flops` is its GPU's catalog peak (None on a CPU)."""
    out = {n: NodeVerdict(n) for n in result.get("nodes", [])}
    ranks = result.get("ranks", [])
    measured = [r for r in ranks if r.get("matmul_flops")]
    rates = [r["matmul_flops"] for r in measured]
    spreads = [window_spread(r) for r in measured]
    for r in ranks:
        v = out.setdefault(r["node"], NodeVerdict(r["node"]))
        v.ranks += 1
        rate = r.get("matmul_flops")
        median = peer_median(rates, measured.index(r)) if rate else None
        if rate and median:
            # judged with its peers' spread, as their median is: a ratio within it of the threshold may be the
            # moment's load; a throttled device's own spread (slow in every window) does not excuse it
            spread = peer_median(spreads, measured.index(r)) or 0.0
            ratio = rate / median
            if v.matmul_ratio is None or ratio < v.matmul_ratio:
                v.matmul_flops, v.matmul_ratio, v.matmul_spread = rate, ratio, spread
            if ratio < th.matmul_ratio:
                what = (f"rank {r['rank']} (local {r.get('local_rank')}): matmul {rate / 1e12:.3g} TFLOP/s, "
                        f"{ratio:.3f}x the other ranks' median {median / 1e12:.3g} (threshold {th.matmul_ratio}, "
                        f"measured spread {spread:.1%})")
                if ratio * (1 + spread) < th.matmul_ratio:
                    v.reasons.append(what)
                else:  # as likely the load of the moment as the device: a verdict would flip between runs
                    v.notes.append(f"{what}: below the threshold by less than the spread, not judged bad; "
                                   "measure again on a quieter host to tell")
        peak_flops = r.get("peak_flops")
        if rate and peak_flops and rate < th.peak_fraction * peak_flops:
            v.reasons.append(f"rank {r['rank']}: matmul {rate / 1e12:.3g} TFLOP/s is {rate / peak_flops:.0%} of "
                             f"the catalog peak {peak_flops / 1e12:.3g} (threshold {th.peak_fraction:.0%})")
        mem = r.get("memory") or {}
        v.memory_bytes += int(mem.get("bytes") or 0)
        if mem and not mem.get("ok"):
            v.reasons.append(f"rank {r['rank']}: memory check failed: {mem.get('error')}")
        _nvml(v, r)
    _intra(out, result.get("intra_node", []), th)
    _links(out, result.get("inter_node", []), th)
    _checkpoint(out, result.get("checkpoint"), needed_bytes)
    return list(out.values())


def _nvml(v: NodeVerdict, r: dict[str, Any]) -> None:
    nv = r.get("nvml")
    if not nv:
        return
    if nv.get("error"):
        v.notes.append(f"rank {r['rank']}: {nv['error']}")
        return
    if nv.get("ecc_uncorrected_volatile"):
        v.reasons.append(f"rank {r['rank']}: {nv['ecc_uncorrected_volatile']} uncorrected ECC errors since boot")
    bits = int(nv.get("throttle_reasons") or 0)
    bad = [name for bit, name in BAD_THROTTLE.items() if bits & bit]
    if bad:
        v.reasons.append(f"rank {r['rank']}: clocks throttled ({', '.join(bad)}): SM {nv.get('sm_clock_mhz')} of "
                         f"{nv.get('sm_clock_max_mhz')} MHz, {nv.get('temperature_c')} C")


def _intra(out: dict[str, NodeVerdict], rows: list[dict[str, Any]], th: Thresholds) -> None:
    rates = [row["bus_bytes_per_s"] for row in rows]
    for i, row in enumerate(rows):
        median = peer_median(rates, i)
        v = out.setdefault(row["node"], NodeVerdict(row["node"]))
        v.intra_bytes_per_s = row["bus_bytes_per_s"]
        if median and row["bus_bytes_per_s"] < th.link_ratio * median:
            v.reasons.append(f"all-reduce inside the node {_gb(row['bus_bytes_per_s'])}, "
                             f"{row['bus_bytes_per_s'] / median:.2f}x the other nodes' median "
                             f"(threshold {th.link_ratio})")


def _links(out: dict[str, NodeVerdict], pairs: list[dict[str, Any]], th: Thresholds) -> None:
    rates = [p["bytes_per_s"] for p in pairs]
    median = statistics.median(rates) if rates else None
    slow = [p for p in pairs if median and p["bytes_per_s"] < th.link_ratio * median]
    of_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in pairs:
        for end, other in ((p["a"], p["b"]), (p["b"], p["a"])):
            of_node[end].append(p)
            out.setdefault(end, NodeVerdict(end)).links.append(f"{other} {_gb(p['bytes_per_s'])}")
    culprits = {n for n, ps in of_node.items() if len(ps) > 1 and all(p in slow for p in ps)}
    for n in culprits:
        out[n].reasons.append(f"every link of the ring is slow ({', '.join(out[n].links)}; median pair "
                              f"{_gb(median or 0)}, threshold {th.link_ratio})")
    for p in slow:
        if p["a"] in culprits or p["b"] in culprits:
            continue  # explained by a bad node
        for end in (p["a"], p["b"]):
            out[end].reasons.append(f"link {p['a']} <-> {p['b']} {_gb(p['bytes_per_s'])}, "
                                    f"{p['bytes_per_s'] / (median or 1):.2f}x the median pair (threshold "
                                    f"{th.link_ratio}): one of its two ends")


def _checkpoint(out: dict[str, NodeVerdict], ck: dict[str, Any] | None, needed_bytes: int | None) -> None:
    if not ck:
        return
    for row in ck.get("nodes", []):
        v = out.setdefault(row["node"], NodeVerdict(row["node"]))
        v.free_bytes = row.get("free_bytes")
        if row.get("error"):
            v.reasons.append(f"checkpoint directory: {row['error']}")
        elif row.get("missing"):
            v.reasons.append(f"checkpoint directory {ck.get('path')}: does not see the token file of "
                             f"{', '.join(row['missing'])}: it is not shared storage")
        if needed_bytes and v.free_bytes is not None and v.free_bytes < needed_bytes:
            v.reasons.append(f"checkpoint directory {ck.get('path')}: {v.free_bytes / 1e9:.3g} GB free, the run "
                             f"needs {needed_bytes / 1e9:.3g} GB")


def bad_nodes(verdicts: list[NodeVerdict]) -> list[str]:
    return [v.node for v in verdicts if not v.ok]


def enough_left(verdicts: list[NodeVerdict], needed: int) -> str | None:
    """Why a launch cannot go on without the bad nodes (one line), or None when enough healthy ones remain."""
    healthy = [v.node for v in verdicts if v.ok]
    if len(healthy) >= needed:
        return None
    bad = "; ".join(f"{v.node}: {v.reasons[0]}" for v in verdicts if not v.ok)
    return (f"only {len(healthy)} healthy node(s) of {len(verdicts)} checked, the spec needs {needed} "
            f"(cluster.nodes): {bad}")
