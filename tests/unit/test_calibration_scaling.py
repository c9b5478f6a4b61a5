"""A calibration profile describes hardware, not a job (docs/design/calibration.md, "Calibration profile"): one
measured on 2 ranks of one node prices an 8-rank spec and a 2-node spec on the same hardware, each term it
extrapolates named in a warning, and only another accelerator is refused. Independent arithmetic: the
profile is built by `profile.build` from synthetic raw figures of a known latency and bandwidth, and the
plan's collective times are recomputed from the ring's rule (latency per ring step x the kind's steps,
2(n-1) for all-reduce and n-1 for the others, bus bytes at the fitted bandwidth) and, off the profile's
links, from the catalog's fabric."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cli_utils import trainctl
from paths import REPO

from trainctl.errors import UsageError
from trainctl.model_shape import ModelShape
from trainctl.plan import comm
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fit import LinkFit, fit_collective, ring_steps
from trainctl.plan.calibration.shapes import INTER, INTRA, MESSAGE_BYTES, OPS, bus_bytes
from trainctl.plan.estimate import DEFAULT_COMM_EFFICIENCY, Evaluator
from trainctl.plan.plan import candidate_from_spec, context_from_spec
from trainctl.spec import RunSpec, load_spec

TINY = REPO / "recipes" / "tiny-cpu.yaml"
LATENCY, BUS_BW, RATE = 2e-4, 5e8, 2e9  # what the synthetic calibration "measured"
TWO_RANKS = ["cluster.gpus_per_node=2", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2",
             "parallel.sequence_parallel=false"]
PURE_DP = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "parallel.zero=0", "parallel.sequence_parallel=false"]
TWO_NODES = ["cluster.nodes=2", "cluster.gpus_per_node=4", "launcher.backend=slurm"]


def _raw(groups: list[tuple[str, int]]) -> dict[str, Any]:
    """Raw figures of a calibration whose collectives take LATENCY + bus bytes / BUS_BW at every size in
    `groups` ((link, group size)), whose GEMMs run at RATE, and whose TP-2 layer took 20 ms."""
    collectives = [{"op": op, "link": link, "group_size": 2 if op == "send_recv" else n, "bytes": nbytes,
                    "bus_bytes": bus_bytes(op, nbytes, 2 if op == "send_recv" else n),
                    "seconds": [LATENCY + bus_bytes(op, nbytes, 2 if op == "send_recv" else n) / BUS_BW]}
                   for link, n in groups for op in OPS for nbytes in MESSAGE_BYTES]
    return {"matmul": [{"tp": tp, "flops": f, "seconds": [f / RATE]} for tp in (1, 2) for f in (1e6, 1e8)],
            "layer": {"flops": 1e8, "seconds": [1e8 / RATE], "recompute": "none", "tokens": 256,
                      "tp": [{"tp": 2, "sequence_parallel": sp, "seconds": [0.02]} for sp in (False, True)]},
            "collectives": collectives}


def _profile(tmp_path: Path, measured_on: list[str], groups: list[tuple[str, int]]) -> Path:
    """A profile as `trainctl calibrate` of the tiny recipe with `measured_on` would write it."""
    spec = load_spec(TINY, overrides=measured_on)
    meta = {**prof.spec_meta(spec), "precision": prof.run_precision(spec), "device": {"type": "cpu"}}
    path = tmp_path / "calibration.json"
    prof.save(path, prof.build(meta, _raw(groups)))
    return path


def _plan(profile: Path, sets: list[str]) -> tuple[Any, RunSpec, list[str]]:
    """(estimate, spec, calibration warnings) of the tiny recipe with `sets`, priced with `profile`."""
    spec = load_spec(TINY, overrides=sets).with_calibration(profile)
    ctx = context_from_spec(spec)
    assert ctx.rates is not None
    return Evaluator(ctx).evaluate(candidate_from_spec(spec)), spec, list(ctx.rates.warnings)


def _dp_traffic(est: Any, spec: RunSpec) -> list[tuple[str, float, float]]:
    """ZeRO-0 over dp ranks of one pipeline stage: the planner's own DP collectives of the run."""
    return comm.dp_traffic(est.ranks[0].params, 0, spec.parallel.dp, est.micro_batches, 4, 4,
                           spec.model.layers + 1)


def test_the_ring_latency_grows_per_step_and_the_per_call_part_does_not() -> None:
    fit = LinkFit(latency_s=3e-4, bytes_per_s=1e9, points=5, rms_rel_error=0.0, group_size=2, load_excess_s=1e-4,
                  step_latency_s=2e-4, op="all_gather", groups=(2,))
    assert fit.latency_at(2) == fit.latency_at(0) == pytest.approx(5e-4)  # at the largest measured group
    assert fit.latency_at(8) == pytest.approx(3e-4 + 2e-4 * 7)
    assert fit.seconds(1e9, 2, 8) == pytest.approx(2 * (3e-4 + 2e-4 * 7) + 1.0)
    assert replace(fit, op="all_reduce").latency_at(8) == pytest.approx(3e-4 + 2e-4 * 14)
    assert replace(fit, op="send_recv").latency_at(8) == pytest.approx(5e-4)  # a pair is a pair


PER_CALL, PER_STEP = 5e-5, 2e-5  # a synthetic link's latencies


def _points(op: str, groups: tuple[int, ...], noise: float = 0.0) -> list[tuple[int, float, float]]:
    """(n, bus bytes, seconds) of `op` on the synthetic link, each time off by +-noise alternately."""
    pts = [(n, bus_bytes(op, b, n), PER_CALL + PER_STEP * ring_steps(op, n) + bus_bytes(op, b, n) / BUS_BW)
           for n in groups for b in MESSAGE_BYTES]
    return [(n, x, t * (1 + noise * (-1) ** i)) for i, (n, x, t) in enumerate(pts)]


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_the_fit_recovers_the_latencies_and_bandwidth_of_each_kind(op: str) -> None:
    fit = fit_collective(op, _points(op, (2, 4, 8)))
    assert fit.latency_s == pytest.approx(PER_CALL, rel=1e-6)
    assert fit.step_latency_s == pytest.approx(PER_STEP, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(BUS_BW, rel=1e-6) and fit.groups == (2, 4, 8) and fit.group_size == 8
    assert fit.rms_rel_error < 1e-9 and fit.max_rel_error < 1e-9
    # fitted at 2 and 4 ranks with 2% noise: 16 ranks predicted from the ring's shape within the noise's reach
    noisy = fit_collective(op, _points(op, (2, 4), noise=0.02))
    assert 0.015 < noisy.max_rel_error < 0.03  # the residuals report the noise
    for n, x, t in _points(op, (16,)):
        assert noisy.seconds(x, 1, n) == pytest.approx(t, rel=0.1)
    # one group size: per call and per step cannot be told apart, all of it per step (the ring's growth)
    one = fit_collective(op, _points(op, (2,)))
    assert one.latency_s == 0 and one.step_latency_s == pytest.approx((PER_CALL + PER_STEP * ring_steps(op, 2))
                                                                      / ring_steps(op, 2), rel=1e-6)


def test_a_negative_term_is_dropped_not_kept() -> None:
    """Times that fall with the group size (noise, or a tree): no negative per-step latency, the fit keeps
    the per-call latency and the bandwidth, both positive, and reports its residuals."""
    pts = [(n, x, PER_CALL + 2e-4 / n + x / BUS_BW) for n, x, _ in _points("all_reduce", (2, 4, 8))]
    fit = fit_collective("all_reduce", pts)
    assert fit.step_latency_s == 0 and fit.latency_s > 0 and fit.bytes_per_s > 0 and fit.max_rel_error > 0


def test_build_fits_each_kind_over_its_group_sizes(tmp_path: Path) -> None:
    path = _profile(tmp_path, TWO_NODES, [(INTRA, 2), (INTRA, 4), (INTER, 2)])
    data = prof.load(path)
    assert {op: f.group_size for op, f in data.links[INTRA].items()} == {**dict.fromkeys(OPS, 4), "send_recv": 2}
    assert {op: f.groups for op, f in data.links[INTRA].items()} == {**dict.fromkeys(OPS, (2, 4)), "send_recv": (2,)}
    assert {op: f.group_size for op, f in data.links[INTER].items()} == dict.fromkeys(OPS, 2)
    fits = data.links[INTRA]  # the same latency at 2 and 4 ranks: all of it per call
    assert fits["all_reduce"].latency_s == pytest.approx(LATENCY, rel=1e-6)
    assert fits["all_reduce"].step_latency_s == pytest.approx(0, abs=1e-12)
    assert fits["all_reduce"].bytes_per_s == pytest.approx(BUS_BW, rel=1e-6)
    assert data.links[INTER]["all_reduce"].latency_at(2) == pytest.approx(LATENCY, rel=1e-6)


@pytest.mark.parametrize("hop_first", [False, True])
def test_the_pipeline_hops_wait_is_send_recvs_alone_and_the_all_reduces_every_other_kinds(hop_first: bool) -> None:
    """raw.load: an all-reduce between forwards that took 3 ms where idle it takes LATENCY + its bytes, and a
    pipeline hop that took 1 ms: every collective's latency carries the all-reduce's 3 ms excess but send/recv's,
    which carries the hop's; a profile without the hop (from before it) gives send/recv the all-reduce's too,
    and the pipeline's price follows."""
    raw = _raw([(INTRA, 2)])
    wait = {"op": "all_reduce", "link": INTRA, "group_size": 2, "bytes": 4096,
            "bus_bytes": bus_bytes("all_reduce", 4096, 2), "seconds": [3e-3, 3e-3]}
    hop = {"op": "send_recv", "link": INTRA, "group_size": 2, "bytes": 4096,
           "bus_bytes": bus_bytes("send_recv", 4096, 2), "seconds": [1e-3]}
    links = prof.fit_links({**raw, "load": [hop, wait] if hop_first else [wait, hop]})[INTRA]
    older = prof.fit_links({**raw, "load": [wait]})[INTRA]
    excess = 3e-3 - (LATENCY + wait["bus_bytes"] / BUS_BW)
    for op, fit in links.items():
        own = 1e-3 - (LATENCY + hop["bus_bytes"] / BUS_BW) if op == "send_recv" else excess
        assert fit["load_excess_s"] == pytest.approx(own, rel=1e-6)
        assert fit["latency_s"] == pytest.approx(fit["idle_latency_s"] + own, rel=1e-9)
        assert older[op]["load_excess_s"] == pytest.approx(excess, rel=1e-6)
    send = LinkFit.from_dict(links["send_recv"])
    # three hops of 1e6 bytes in all: each hop's latency is what the measured hop took beyond its own bytes
    assert send.seconds(1e6, 3, 2) == pytest.approx(3 * (1e-3 - hop["bus_bytes"] / BUS_BW) + 1e6 / BUS_BW, rel=1e-6)


def test_a_profile_of_the_previous_schema_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    old = json.loads(path.read_text())
    old["schema"] = 2
    with pytest.raises(UsageError) as refused:
        prof.parse(path, old)
    assert "schema 2; this trainctl reads schema 3 (it fits each collective's latency per call and per ring step" \
        in str(refused.value) and "\n" not in str(refused.value)


def test_the_plan_prices_each_dp_collective_by_its_own_kinds_fit(tmp_path: Path) -> None:
    """ZeRO-1 among 8 ranks: the gradients' reduce-scatter at the reduce-scatter fit and the weights'
    all-gather at the all-gather fit, each with its own latencies and bandwidth, measured at 2 and 4 ranks."""
    raw = _raw([(INTRA, 2), (INTRA, 4)])
    kinds = {"reduce_scatter": (1e-4, 3e-5, 4e8), "all_gather": (2e-5, 1e-5, 9e8)}  # per call, per step, bus B/s
    for r in raw["collectives"]:
        if r["op"] in kinds:
            call, step, bw = kinds[r["op"]]
            r["seconds"] = [call + step * ring_steps(r["op"], r["group_size"]) + r["bus_bytes"] / bw]
    spec = load_spec(TINY, overrides=["cluster.gpus_per_node=4", "parallel.tp=1", "parallel.pp=1", "parallel.dp=4",
                                      "parallel.sequence_parallel=false"])
    path = tmp_path / "calibration.json"
    prof.save(path, prof.build({**prof.spec_meta(spec), "precision": prof.run_precision(spec),
                                "device": {"type": "cpu"}}, raw))
    est, spec, warnings = _plan(path, [*PURE_DP[:3], "parallel.zero=1", "parallel.sequence_parallel=false"])
    traffic = comm.dp_traffic(est.ranks[0].params, 1, 8, est.micro_batches, 4, 4, spec.model.layers + 1)
    assert [op for op, _, _ in traffic] == ["reduce_scatter", "all_gather"]
    expected = 0.0
    for op, nbytes, calls in traffic:
        call, step, bw = kinds[op]
        expected += calls * (call + step * ring_steps(op, 8)) + nbytes / bw
    assert est.dp_time == pytest.approx(expected, rel=1e-6)
    text = "\n".join(warnings)
    assert text.count("intra-node") == 1  # once per link, naming the rule
    assert ("intra-node all-gather, all-reduce, all-to-all, reduce-scatter in groups of up to 8 ranks beyond the "
            "largest measured (4): each kind's fit extrapolated") in text


def test_a_two_rank_profile_prices_an_eight_rank_spec_by_the_ring_rule(tmp_path: Path) -> None:
    profile = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    est, spec, warnings = _plan(profile, PURE_DP)
    assert spec.world_size == 8 and est.step_time > 0
    # every DP collective among 8 ranks: 7 ring steps of the latency fitted among 2, its bus bytes at the fit
    expected = sum(calls * LATENCY * 7 + nbytes / BUS_BW for _, nbytes, calls in _dp_traffic(est, spec))
    assert est.dp_time == pytest.approx(expected, rel=1e-6)
    text = "\n".join(warnings)
    assert ("intra-node all-gather, all-reduce, all-to-all, reduce-scatter in groups of up to 8 ranks beyond the "
            "largest measured (2): each kind's fit extrapolated, latency per call + per ring step x steps(n) "
            "(all-reduce 2(n-1), the others n-1), bytes at (n-1)/n of the message per rank at the fitted bus "
            "bandwidth; all-gather, all-reduce, all-to-all, reduce-scatter measured at one group size: all its "
            "latency per step") in text
    assert ("measured with 2 ranks per node, the spec has 8: on a CPU the ranks share the node's cores, so no rate "
            "measured then holds") in text
    assert "tp 4 priced at the compute rate of tp 2, the largest measured (tp 1/2)" in text  # --auto may pick tp 4
    assert "inter-node" not in text and "another model" not in text


def test_a_one_node_profile_prices_the_two_node_cluster_from_the_catalogs_fabric(tmp_path: Path) -> None:
    profile = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    est, spec, warnings = _plan(profile, [*TWO_NODES, *PURE_DP])
    assert est.comm_link["dp"] == comm.INTER_NODE and est.step_time > 0
    ctx = context_from_spec(spec)
    # no latency: as without a profile, where CPU ranks get a flat share of the link
    fabric_bw = ctx.hw.inter_node_bw * DEFAULT_COMM_EFFICIENCY
    assert est.dp_time == pytest.approx(sum(nbytes for _, nbytes, _ in _dp_traffic(est, spec)) / fabric_bw)
    text = "\n".join(warnings)
    assert ("inter-node links: not calibrated (measured on one node), priced from the catalog's fabric "
            "(InfiniBand NDR 400G, 50 GB/s per GPU x estimate.comm_efficiency, no latency)") in text
    assert "intra-node all-gather, all-reduce, all-to-all, reduce-scatter in groups of up to 4 ranks beyond" in text


def test_a_two_node_profile_prices_more_nodes_with_its_inter_node_fits(tmp_path: Path) -> None:
    profile = _profile(tmp_path, TWO_NODES, [(INTRA, 2), (INTRA, 4), (INTER, 2)])
    est, spec, warnings = _plan(profile, ["cluster.nodes=4", "cluster.gpus_per_node=4", "launcher.backend=slurm",
                                          "parallel.tp=1", "parallel.pp=1", "parallel.dp=16", "parallel.zero=0",
                                          "parallel.sequence_parallel=false", "train.global_batch=32"])
    assert est.comm_link["dp"] == comm.INTER_NODE
    expected = sum(calls * LATENCY * 15 + nbytes / BUS_BW for _, nbytes, calls in _dp_traffic(est, spec))
    assert est.dp_time == pytest.approx(expected, rel=1e-6)
    text = "\n".join(warnings)
    assert "inter-node all-gather, all-reduce, all-to-all, reduce-scatter in groups of up to 16 ranks beyond the " \
        "largest measured (2)" in text
    assert "intra-node" not in text and "ranks per node" not in text  # the node as calibrated


def test_the_spec_it_was_measured_for_has_no_extrapolation_warning(tmp_path: Path) -> None:
    profile = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    _, _, warnings = _plan(profile, TWO_RANKS)
    assert warnings == []


def test_another_model_keeps_the_rates_and_prices_tp_from_the_fits(tmp_path: Path) -> None:
    profile = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    tp2 = ["parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]
    same, _, _ = _plan(profile, [*TWO_RANKS, *tp2])
    spec = load_spec(TINY, overrides=[*TWO_RANKS, *tp2, "model.hidden=128"]).with_calibration(profile)
    ctx = context_from_spec(spec)
    assert ctx.rates is not None
    assert same.tp_exposed_time > 0
    assert ctx.rates.tp_layer(comm.NVLINK, 2, True, "none") is None  # the 20 ms layer was the calibrated model's
    text = "\n".join(ctx.rates.warnings)
    assert "measured at another model (hidden 64" in text and "spec's 128" in text
    assert "TP layers from the collective fits (the measured TP layers unused)" in text


OVERLAP_SPEC = ["cluster.nodes=2", "cluster.gpus_per_node=1", "launcher.backend=slurm", "parallel.tp=1",
                "parallel.pp=1", "parallel.dp=2", "parallel.zero=0", "parallel.sequence_parallel=false"]


def _overlap_row(together: float) -> dict[str, Any]:
    """calibrate's figures of a bucket's all-reduce behind the layer: compute 4 ms, collective 2 ms, both
    `together` (three ranks; the third a straggler the medians leave out)."""
    return {"link": INTER, "group_size": 2, "bytes": 1 << 20, "compute_s": [4e-3, 4e-3, 9e-3],
            "collective_s": [2e-3, 2e-3, 7e-3], "together_s": [together, together, 1.0]}


@pytest.mark.parametrize(("together", "share"), [(5.5e-3, 0.25), (4e-3, 1.0), (3e-3, 1.0), (6e-3, 0.0),
                                                 (7e-3, 0.0)])
def test_the_dp_overlap_is_the_share_of_the_collective_that_hid_behind_compute(together: float, share: float
                                                                               ) -> None:
    # (compute + collective - both) / collective, within [0, 1]: slower than the sum (a CPU's cores fought
    # over) hides nothing, as fast as the compute alone hides it all
    assert prof.fit_overlap([_overlap_row(together)]) == {INTER: pytest.approx(share)}


def test_a_measured_dp_overlap_replaces_the_assumption_unless_the_spec_sets_one(tmp_path: Path) -> None:
    raw = {**_raw([(INTRA, 2), (INTER, 2)]), "overlap": [_overlap_row(5.5e-3)]}  # a quarter hidden
    spec = load_spec(TINY, overrides=OVERLAP_SPEC)
    path = tmp_path / "calibration.json"
    prof.save(path, prof.build({**prof.spec_meta(spec), "precision": prof.run_precision(spec),
                                "device": {"type": "cpu"}}, raw))
    measured, spec, _ = _plan(path, OVERLAP_SPEC)
    assert measured.comm_link["dp"] == comm.INTER_NODE and measured.dp_time > 0
    # the window (a slot of this tiny model's compute at 2 GFLOP/s) is far longer than the reduction: the
    # hidden part is the share x the DP time
    assert measured.dp_exposed_time == pytest.approx(0.75 * measured.dp_time)
    set_, _, _ = _plan(path, [*OVERLAP_SPEC, "estimate.dp_overlap=0.8"])  # the spec's own figure wins
    assert set_.dp_exposed_time == pytest.approx(0.2 * measured.dp_time)
    rates = context_from_spec(spec.with_calibration(path)).rates
    assert rates is not None and rates.describe()["dp_overlap"] == {INTER: pytest.approx(0.25)}
    shown = trainctl("plan", str(TINY), "--calibration", str(path), *[f"--set={x}" for x in OVERLAP_SPEC])
    assert shown.returncode == 0, shown.stderr
    assert "dp_overlap measured by calibrate (inter-node 0.25; other links" in " ".join(shown.stdout.split())
    bad = json.loads(path.read_text())
    bad["fits"]["dp_overlap"] = {INTER: 1.5}
    path.write_text(json.dumps(bad))
    with pytest.raises(UsageError, match="fits.dp_overlap holds a share outside"):
        prof.load(path)


def test_ranks_per_node_on_a_gpu_keep_the_rates_per_gpu_and_on_a_cpu_send_the_user_to_calibrate(tmp_path: Path
                                                                                                ) -> None:
    profile = prof.load(_profile(tmp_path, TWO_RANKS, [(INTRA, 2)]))
    cpu = " ".join(prof.extrapolations(profile, load_spec(TINY)))
    assert "measured with 2 ranks per node, the spec has 8: on a CPU" in cpu and "trainctl calibrate SPEC" in cpu
    on_gpu = replace(profile, data={**profile.data, "cluster": {**profile.cluster, "gpu": "h100-sxm"}})
    gpu = " ".join(prof.extrapolations(on_gpu, load_spec(TINY, overrides=["cluster.gpu=h100-sxm",
                                                                          "launcher.backend=slurm"])))
    assert "measured with 2 ranks per node, the spec has 8: the compute rates are per rank" in gpu
    assert "CPU" not in gpu


def test_only_another_accelerator_is_refused(tmp_path: Path) -> None:
    path = _profile(tmp_path, TWO_RANKS, [(INTRA, 2)])
    profile = prof.load(path)
    other = replace(profile, data={**profile.data, "cluster": {**profile.cluster, "gpu": "h100-sxm"}})
    with pytest.raises(UsageError, match="measured on cluster.gpu = h100-sxm, the spec has cpu") as refused:
        prof.check(other, load_spec(TINY))
    assert "\n" not in str(refused.value)
    for sets in ([], TWO_NODES, ["cluster.gpus_per_node=4", "parallel.dp=1"]):  # other sizes: priced
        prof.check(profile, load_spec(TINY, overrides=sets))


def test_a_gpu_layer_is_priced_from_a_stack_without_what_each_timed_call_pays_once() -> None:
    """On a GPU calibrate also times a stack of two layers: the second layer's time is a layer as a step runs
    it, and one layer less that is what each timed call pays once; the rate, the TP and CP layers and the
    dispatch floor are priced without it. Where the difference is not a layer's (the stack is missing, or costs less
    than one layer or more than two), one layer's time stands, with no call cost."""
    call, layer = 0.5e-3, 1e8 / RATE  # one call costs a layer + 0.5 ms; the stack, two layers + 0.5 ms
    raw = _raw([(INTRA, 2)])
    raw["layer"].update(seconds=[layer + call, layer + call], dispatch={"none": [3e-3]},
                        stack={"depth": 2, "seconds": [2 * layer + call, None], "dispatch": {"none": [5e-3]}},
                        cp=[{"cp": 2, "seconds": [0.03, 0.03]}])
    fits = prof.build({"device": {"type": "cuda"}}, raw)["fits"]["layer"]
    assert fits["flops_per_s"] == pytest.approx(RATE)
    assert fits["call_s"] == pytest.approx(call)
    assert fits["dispatch_s"] == {"none": pytest.approx(2e-3)}
    assert fits["tp_seconds"]["2"] == {"plain": pytest.approx(0.02 - call), "sp": pytest.approx(0.02 - call)}
    assert fits["cp_seconds"] == {"2": pytest.approx(0.03 - call)}
    for stack in ([layer], [3 * layer + 2 * call], [None]):  # less than one layer, over two, none measured
        assert prof.in_step([layer + call], stack, 2) == (layer + call, 0.0)
    assert prof.in_step([layer + call], [2 * layer + call], 0) == (layer + call, 0.0)  # a CPU: no stack


def test_calibrate_times_a_layer_on_the_residual_stream_the_trainer_feeds_it() -> None:
    """The layer and the LM head calibrate times take their input in the dtype the trainer's embedding stage
    hands on (bf16 under bf16 autocast, fp32 with model.fp32_residual or without autocast): an fp32 input
    under a bf16 stream ran every norm and residual add at twice the bytes (a layer on an H100 7.5 ms where
    the step's took about 6.5)."""
    import torch

    from trainctl.runtime.model.transformer import build_stage
    from trainctl.runtime.workers.microbench import Ends, Layer

    for sets, autocast in [([], torch.bfloat16), (["model.fp32_residual=true"], torch.bfloat16), ([], None)]:
        shape = ModelShape.from_spec(load_spec(TINY, overrides=sets).model)
        first = build_stage(shape, range(0, 0), first=True, last=False, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            handed_on = first(torch.zeros(1, 8, dtype=torch.long)).dtype
        layer = Layer(shape, 1, "none", autocast, torch.device("cpu"), seed=1, seq_len=8)
        ends = Ends(shape, 1, autocast, torch.device("cpu"), seed=1)
        assert layer.x.dtype == ends.x.dtype == handed_on, sets
