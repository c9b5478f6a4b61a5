"""Where the planner's times come from: FLOP/s per rank and seconds per collective, in one place.

`AssumedRates` (no profile): the catalog peak x its GEMM efficiency (the layers' own rates come from the
operator model, plan/operators.py, through the Evaluator), and collectives as NCCL prices them (`nccl_seconds`):
a latency per call and per ring or tree step, the bus bandwidth of the link tier (NVLink, or the network at the
NICs of the group's ranks on one node), ring or tree, whichever is faster, from the catalog's cited constants.
estimate.compute_efficiency / comm_efficiency, when a spec sets them, replace these by a flat share of the peak
and of the link bandwidth without latency (what trainctl did before it priced operators). `MeasuredRates`: a
calibration profile's fits (`trainctl calibrate`): the measured FLOP/s at the layout's TP size and, per link
class and collective kind, latency per call + latency per ring step x the kind's steps in the group + bus
bytes / measured bandwidth, the kind's own fit at every group size (beyond the largest measured it
extrapolates, and the profile's check says so: calibration/fit.py); a link or collective the
profile lacks (inter-node links of a one-node profile) is priced as the assumed rates would. A profile's
measured DP overlap (the share of a gradient reduction that hid behind compute) takes the place of
estimate.dp_overlap's assumption unless the spec sets it. The Evaluator (plan/estimate.py) asks only these.

Which collective carries what, as (op, share of the bytes), each entry making the kind's calls:
  TP        all-reduce, or reduce-scatter + all-gather under sequence parallelism (same volume)
  PP        send/recv;  tied embedding: all-reduce;  EP (MoE token dispatch/combine): all-to-all
  CP        K/V all-gather (forward, and again under recompute) + reduce-scatter of their gradients
  expert DP the DP collectives of the ZeRO stage, over the expert-data-parallel group
  DP        each collective of plan/comm.py `dp_traffic` priced with its own bytes and calls: ZeRO-0
            all-reduce; ZeRO-1 a reduce-scatter of the gradients (all-reduce under PowerSGD) +
            all-gather of the weights; ZeRO-2 a reduce-scatter per micro-batch + all-gather; ZeRO-3
            reduce-scatter + two all-gathers, per FSDP unit and micro-batch
"""

from __future__ import annotations

from math import log2
from pathlib import Path
from typing import Any

from trainctl.hardware.catalog import BUS_EFFICIENCY, NCCL_BASE_LATENCY_S, NCCL_STEP_LATENCY_S, NCCL_TREE_BANDWIDTH
from trainctl.plan import record
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fixed import FixedWork
from trainctl.plan.calibration.shapes import INTER, INTRA, OPS
from trainctl.plan.comm import INTER_NODE, NVLINK, gather_bytes
from trainctl.spec.models import RunSpec

Ops = tuple[tuple[str, float], ...]
TP_OPS: dict[bool, Ops] = {False: (("all_reduce", 1.0),), True: (("reduce_scatter", 0.5), ("all_gather", 0.5))}
PP_OPS: Ops = (("send_recv", 1.0),)
PP_GATHER_OPS: Ops = (("all_gather", 1.0),)  # a scatter/gather pipeline send's pieces, gathered over the TP link
EMBEDDING_OPS: Ops = (("all_reduce", 1.0),)
EP_OPS: Ops = (("all_to_all", 1.0),)  # MoE token dispatch and combine
# context parallelism's K/V exchange: all-gather forward (and again under recompute), reduce-scatter backward
CP_OPS: dict[bool, Ops] = {False: (("all_gather", 1 / 2), ("reduce_scatter", 1 / 2)),
                           True: (("all_gather", 2 / 3), ("reduce_scatter", 1 / 3))}
PROFILE_LINK = {NVLINK: INTRA, INTER_NODE: INTER}  # the planner's link classes -> the profile's
UNCALIBRATED = ("on GPUs the operator model (catalog: GEMM efficiency, HBM bandwidth, flash-attention "
                "efficiency) and NCCL's latency and bus bandwidth per link tier, on CPUs no rate; `trainctl calibrate "
                "SPEC` measures them")
# collective steps of a ring over n ranks, per call
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
              "all_to_all": lambda n: n - 1, "send_recv": lambda n: 1}


class AssumedRates:
    calibrated = False
    fixed: FixedWork | None = None  # the work outside the layers is not modelled without a profile

    def __init__(self, peak_flops: float | None, link_bw: dict[str, float], compute_efficiency: float,
                 comm_efficiency: float | None, link: str = "nvlink", gpus_per_node: int = 8) -> None:
        self.flops = peak_flops * compute_efficiency if peak_flops else None
        self.flat_comm = comm_efficiency is not None
        # a flat share of the link without latency (estimate.comm_efficiency), else NCCL's bus bandwidth per tier
        intra_eff = comm_efficiency if self.flat_comm else BUS_EFFICIENCY.get(link, BUS_EFFICIENCY["nvlink"])
        net_eff = comm_efficiency if self.flat_comm else BUS_EFFICIENCY["net"]
        self.bw = {NVLINK: link_bw[NVLINK] * intra_eff, INTER_NODE: link_bw[INTER_NODE] * net_eff}
        self.intra = "pcie" if link == "pcie" else "nvlink"  # NCCL's hardware latency class inside a node
        self.gpus_per_node = gpus_per_node
        self.warnings: tuple[str, ...] = ()

    def compute(self, tp: int) -> float | None:
        """Achieved FLOP/s per rank at this TP size; None when unknown (no peak: a CPU without a profile)."""
        return self.flops

    def comm(self, link: str, ops: Ops, nbytes: float, calls: float = 0.0, group: int = 0, per_node: int = 0
             ) -> float:
        """Seconds for `nbytes` bus bytes per rank over `link`, in `calls` calls of each op among `group` ranks
        (0: unknown), `per_node` of them on each node (0: unknown, taken as 1 across nodes): NCCL's model
        (`nccl_seconds`), or bytes at the flat link rate when estimate.comm_efficiency is set."""
        if self.flat_comm:
            return nbytes / self.bw[link]
        return sum(self.nccl_seconds(link, op, share * nbytes, calls, group, per_node) for op, share in ops)

    def nccl_seconds(self, link: str, op: str, nbytes: float, calls: float, group: int, per_node: int) -> float:
        """One kind's `calls` collectives of `nbytes` bus bytes in all, as NCCL's cost model prices them
        (hardware/catalog.py: latencies and bandwidth factors of NVIDIA/nccl src/graph/tuning.cc): a ring of
        base + steps x step latency, the network's steps priced at the network's; for an all-reduce across nodes
        also the tree (2 x (ranks per node - 1) intra-node steps + 2 log2(nodes) network steps, 0.92 x the ring's
        bandwidth), whichever is faster. Across nodes the bus bandwidth is the NICs of the group's ranks on one
        node (one NIC per GPU), at most the NVLink's; inside a node the NVLink's."""
        n = max(group, 2)
        if link == NVLINK:
            ppn, nodes, bw = n, 1, self.bw[NVLINK]
        else:
            ppn = min(max(per_node, 1), n)
            nodes = max(n // ppn, 2)
            bw = min(self.bw[NVLINK], ppn * self.bw[INTER_NODE])
        if calls <= 0:
            return nbytes / bw
        size = nbytes / calls
        steps = RING_STEPS[op](n)
        net_steps = 0 if nodes == 1 else (2 if op == "all_reduce" else 1) * (nodes - 1)
        if op == "send_recv":
            net_steps = 0 if nodes == 1 else 1
        lat = NCCL_STEP_LATENCY_S["ring"]
        ring = (NCCL_BASE_LATENCY_S + (steps - net_steps) * lat[self.intra] + net_steps * lat["net"]) + size / bw
        best = ring
        if op == "all_reduce" and nodes > 1:
            tree_lat = NCCL_STEP_LATENCY_S["tree"]
            tree = (NCCL_BASE_LATENCY_S + 2 * ((ppn - 1) * tree_lat[self.intra] + log2(nodes) * tree_lat["net"])
                    + size / (bw * NCCL_TREE_BANDWIDTH))
            best = min(ring, tree)
        return calls * best

    def fsdp_unit(self, link: str, unit_bytes: float, dp: int) -> float | None:
        return None

    def tp_layer(self, link: str, tp: int, sp: bool, recompute: str) -> tuple[float, int] | None:
        return None

    def cp_layer(self, link: str, cp: int, recompute: str) -> tuple[float, int] | None:
        return None

    def dispatch_floor(self, recompute: str) -> float | None:
        """The least seconds a layer's forward + backward takes however little its work: unknown without a
        profile."""
        return None

    def dp_overlap(self, link: str) -> float | None:
        """The measured share of a DP reduction on `link` that hides behind compute: none without a profile
        (estimate.dp_overlap's assumption stands)."""
        return None


class MeasuredRates:
    calibrated = True

    def __init__(self, profile: prof.Profile, fallback: AssumedRates, warnings: list[str],
                 same_model: bool = True, overlap_set: bool = False) -> None:
        self.profile = profile
        # the DP overlap calibrate measured, per planner link, unless the spec sets estimate.dp_overlap
        self._overlap = {} if overlap_set else {
            link: x for link in PROFILE_LINK if (x := profile.dp_overlap(PROFILE_LINK[link])) is not None}
        self.fallback = fallback
        self.warnings = tuple(warnings)
        self.same_model = same_model  # the profile's layer was timed at the planned model: its TP layers apply
        self._fits = {(link, op): profile.link(PROFILE_LINK[link], op) for link in PROFILE_LINK for op in OPS}
        self._rates = {tp: profile.compute_rate(tp) for tp in profile.compute}
        self.fixed = profile.fixed

    def compute(self, tp: int) -> float:
        rate = self._rates.get(tp)
        if rate is None:
            rate = self._rates[tp] = self.profile.compute_rate(tp)
        return rate

    def comm(self, link: str, ops: Ops, nbytes: float, calls: float = 0.0, group: int = 0, per_node: int = 0
             ) -> float:
        """As AssumedRates.comm, by each kind's fit at the group's size (calibration/fit.py
        `LinkFit.latency_at`), a collective the profile lacks as without a profile."""
        total = 0.0
        for op, share in ops:
            fit = self._fits[link, op]
            total += (fit.seconds(share * nbytes, calls, group) if fit is not None
                      else self.fallback.comm(link, ((op, 1.0),), share * nbytes, calls, group, per_node))
        return total

    def fsdp_unit(self, link: str, unit_bytes: float, dp: int) -> float | None:
        """Seconds one FSDP2 unit of `unit_bytes` weights over `dp` ranks on `link` adds to a micro-batch's
        forward + backward (calibration.fixed.FixedWork.unit_seconds); None when the profile did not measure it."""
        fixed = self.fixed
        if fixed is None or fixed.fsdp_unit_s is None:
            return None
        mine = PROFILE_LINK[link]

        def gather(where: str, nbytes: float, n: int) -> float | None:
            fit = self.profile.link(where, "all_gather")
            return None if fit is None else fit.seconds(gather_bytes(nbytes, n), 1, n)

        here, there = gather(mine, unit_bytes, dp), gather(fixed.fsdp_link or mine, fixed.fsdp_bytes, fixed.fsdp_group)
        return fixed.unit_seconds(None if here is None or there is None else here - there)

    def tp_layer(self, link: str, tp: int, sp: bool, recompute: str) -> tuple[float, int] | None:
        """(seconds, tokens) of one layer on a TP rank as calibrate ran it in a TP group of `tp` inside a node,
        TP collectives included; None where not measured, at another model, or the layout's TP group leaves
        the node."""
        return self.profile.tp_layer(tp, sp, recompute) if link == NVLINK and self.same_model else None

    def cp_layer(self, link: str, cp: int, recompute: str) -> tuple[float, int] | None:
        """(seconds, tokens) of one layer on a CP rank as calibrate ran it in a CP group of `cp` inside a node,
        its K/V exchange included; None where not measured, at another model, or the CP group leaves the node."""
        return self.profile.cp_layer(cp, recompute) if link == NVLINK and self.same_model else None

    def dispatch_floor(self, recompute: str) -> float | None:
        """The host's seconds to issue one layer's forward + backward on a GPU (calibration.profile)."""
        return self.profile.dispatch_floor(recompute)

    def dp_overlap(self, link: str) -> float | None:
        """The share of a DP reduction on `link` that calibrate measured hiding behind compute (profile
        fits.dp_overlap); None where not measured or where the spec sets estimate.dp_overlap."""
        return self._overlap.get(link)

    def describe(self) -> dict[str, Any]:
        measured = sorted({f"{PROFILE_LINK[link]}.{op}" for (link, op), fit in self._fits.items() if fit})
        return {**self.profile.describe(), "compute_flops_per_s": {str(t): r for t, r in self.profile.compute.items()},
                "links_measured": measured, "warnings": list(self.warnings),
                "dp_overlap": {PROFILE_LINK[link]: x for link, x in self._overlap.items()}}


def measured_rates(spec: RunSpec, fallback: AssumedRates) -> MeasuredRates | None:
    """The rates of the spec's cluster.calibration profile (None without one); a profile of another
    accelerator is refused (UsageError); lesser differences and extrapolations come back as warnings."""
    if not spec.cluster.calibration:
        return None
    return rates_of(prof.load(Path(spec.cluster.calibration)), spec, fallback)


def rates_of(profile: prof.Profile, spec: RunSpec, fallback: AssumedRates) -> MeasuredRates:
    """The rates a loaded profile gives the spec: what `plan` and `mfu-report --calibration` price with (and
    `calibrate --from-run` while it fits a profile to a run)."""
    return MeasuredRates(profile, fallback, prof.check(profile, spec), prof.same_model(profile, spec),
                         overlap_set=spec.estimate.dp_overlap is not None)


def describe(rates: MeasuredRates | None) -> dict[str, Any]:
    """What `plan --json` says of where its times come from."""
    return rates.describe() if rates is not None else {"calibrated": False, "note": UNCALIBRATED}


def calibration_text(cal: dict[str, Any]) -> str:
    """Where a plan's time figures come from (its `calibration` entry), in one line."""
    if not cal.get("calibrated"):
        held = f"; {record.band_text(cal['record'])}" if cal.get("record") else ""
        return f"uncalibrated: {cal.get('note', UNCALIBRATED)}{held}"
    return (f"measured: {cal['path']} ({cal['source']}, {cal['device']}, {cal['ranks']} ranks, "
            f"{cal['created']})")
