"""The preflight's verdict (trainctl/launch/node_health.py) and the node-exclusion bookkeeping
(trainctl/launch/exclusions.py, the Slurm script that reads it): pure functions and rendering, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainctl.errors import UsageError
from trainctl.launch import exclusions
from trainctl.launch.node_health import Thresholds, bad_nodes, enough_left, judge
from trainctl.launch.slurm.sbatch_template import SbatchRequest, render
from trainctl.rundir.paths import RunPaths


def rank(r: int, node: str, flops: float, **kw: object) -> dict:
    return {"rank": r, "local_rank": 0, "node": node, "matmul_flops": flops,
            "memory": {"bytes": 1 << 20, "ok": True, "error": None}, **kw}


def test_a_device_below_its_peers_median_is_named_with_its_ratio() -> None:
    result = {"nodes": ["n1", "n2", "n3"], "ranks": [rank(0, "n1", 10e12), rank(1, "n2", 9e12), rank(2, "n3", 3e12)]}
    v = judge(result, Thresholds())
    assert bad_nodes(v) == ["n3"]
    # against the others' median (9.5), not the fleet's (9), which would count the slow device itself
    assert "0.316x the other ranks' median 9.5" in v[2].reasons[0] and v[2].matmul_ratio == pytest.approx(3 / 9.5)
    # of two nodes, the fleet median is their mean: a node at 0.45x the other measures 0.62x of it and would
    # pass a 0.6 threshold; against its one peer it does not
    v = judge({"nodes": ["n1", "n2"], "ranks": [rank(0, "n1", 10e12), rank(1, "n2", 4.5e12)]}, Thresholds(0.6))
    assert bad_nodes(v) == ["n2"] and v[0].matmul_ratio == pytest.approx(10 / 4.5)


def windows(best: float, spread: float) -> list[float]:
    """8 matmul windows whose best is `best` and whose median is `spread` below it."""
    return [best, best * (1 - spread / 2), *[best * (1 - spread)] * 6]


def test_a_ratio_below_the_threshold_by_less_than_the_measured_spread_is_a_note_not_a_verdict() -> None:
    """A loaded host: every device's windows spread 10%. A device at 0.795x its peers (0.8 threshold) is as
    likely the moment's load as the device: noted with three digits, not judged bad; one at 0.5x is bad."""
    loaded = [rank(i, f"n{i}", 10e12, matmul_windows=windows(10e12, 0.10)) for i in range(3)]
    slow = {**loaded[2], "matmul_flops": 7.95e12, "matmul_windows": windows(7.95e12, 0.10)}
    v = judge({"nodes": ["n0", "n1", "n2"], "ranks": [*loaded[:2], slow]}, Thresholds())
    assert bad_nodes(v) == [] and v[2].matmul_spread == pytest.approx(0.10)
    assert "0.795x the other ranks' median 10 (threshold 0.8, measured spread 10.0%): below the threshold by " \
           "less than the spread, not judged bad" in v[2].notes[0]
    slow = {**slow, "matmul_flops": 5e12, "matmul_windows": windows(5e12, 0.10)}
    v = judge({"nodes": ["n0", "n1", "n2"], "ranks": [*loaded[:2], slow]}, Thresholds())
    assert bad_nodes(v) == ["n2"] and "0.500x" in v[2].reasons[0] and "measured spread 10.0%" in v[2].reasons[0]
    # a throttled device's own spread does not excuse it: judged with its peers' (quiet: 0.2%)
    quiet = [rank(i, f"n{i}", 10e12, matmul_windows=windows(10e12, 0.002)) for i in range(2)]
    noisy_slow = rank(2, "n2", 7.95e12, matmul_windows=windows(7.95e12, 0.5))
    assert bad_nodes(judge({"nodes": ["n0", "n1", "n2"], "ranks": [*quiet, noisy_slow]}, Thresholds())) == ["n2"]
    # a quiet host (windows within 0.2%): the same 0.795x is judged bad
    quiet = [rank(i, f"n{i}", 10e12, matmul_windows=windows(10e12, 0.002)) for i in range(2)]
    slow = rank(2, "n2", 7.95e12, matmul_windows=windows(7.95e12, 0.002))
    assert bad_nodes(judge({"nodes": ["n0", "n1", "n2"], "ranks": [*quiet, slow]}, Thresholds())) == ["n2"]


def test_ring_names_the_node_all_of_whose_links_are_slow_or_else_the_link() -> None:
    ranks = [rank(i, f"n{i + 1}", 1e12) for i in range(4)]
    pair = lambda a, b, bw: {"a": a, "b": b, "bytes_per_s": bw}  # noqa: E731
    slow_node = [pair("n1", "n2", 10e9), pair("n2", "n3", 1e9), pair("n3", "n4", 10e9), pair("n4", "n1", 10e9)]
    slow_node[0]["bytes_per_s"] = 1e9  # n1-n2 and n2-n3: every link of n2
    v = judge({"nodes": ["n1", "n2", "n3", "n4"], "ranks": ranks, "inter_node": slow_node}, Thresholds())
    assert bad_nodes(v) == ["n2"] and "every link of the ring is slow" in v[1].reasons[0]
    one_link = [pair("n1", "n2", 1e9), pair("n2", "n3", 10e9), pair("n3", "n4", 10e9), pair("n4", "n1", 10e9)]
    v = judge({"nodes": ["n1", "n2", "n3", "n4"], "ranks": ranks, "inter_node": one_link}, Thresholds())
    assert bad_nodes(v) == ["n1", "n2"] and all("link n1 <-> n2" in x.reasons[0] for x in v[:2])


def test_memory_nvml_and_checkpoint_directory_problems_are_reasons() -> None:
    ranks = [rank(0, "n1", 1e12, memory={"bytes": 4, "ok": False, "error": "3 int32 values read back wrong"}),
             rank(1, "n2", 1e12, nvml={"throttle_reasons": 0x40 | 0x1, "ecc_uncorrected_volatile": 2,
                                       "sm_clock_mhz": 900, "sm_clock_max_mhz": 1980, "temperature_c": 91})]
    ck = {"path": "/ck", "nodes": [{"node": "n1", "free_bytes": 10**12, "error": None, "missing": ["n2"]},
                                   {"node": "n2", "free_bytes": 10**9, "error": None, "missing": []}]}
    v = judge({"nodes": ["n1", "n2"], "ranks": ranks, "checkpoint": ck}, Thresholds(), needed_bytes=10**10)
    assert any("read back wrong" in r for r in v[0].reasons) and any("not shared storage" in r for r in v[0].reasons)
    assert any("uncorrected ECC" in r for r in v[1].reasons) and any("hardware thermal" in r for r in v[1].reasons)
    assert any("GB free, the run needs" in r for r in v[1].reasons)


def test_gpu_far_below_its_catalog_peak_is_bad_even_when_the_fleet_agrees() -> None:
    ranks = [rank(0, "n1", 50e12, peak_flops=989e12), rank(1, "n2", 50e12, peak_flops=989e12)]
    assert bad_nodes(judge({"nodes": ["n1", "n2"], "ranks": ranks}, Thresholds())) == ["n1", "n2"]


@pytest.mark.parametrize("field", ["matmul_ratio", "link_ratio", "peak_fraction"])
def test_out_of_range_threshold_is_one_usage_line(field: str) -> None:
    with pytest.raises(UsageError, match=f"{Thresholds.OPTIONS[field]} 1.5 is out of range"):
        Thresholds(**{field: 1.5}).check()


def test_too_few_healthy_nodes_stops_the_launch_with_the_reason() -> None:
    v = judge({"nodes": ["n1", "n2"], "ranks": [rank(0, "n1", 1e12), rank(1, "n2", 0.1e12)]}, Thresholds())
    assert enough_left(v, 1) is None
    assert enough_left(v, 2).startswith("only 1 healthy node(s) of 2 checked, the spec needs 2 (cluster.nodes): n2:")


def failed_start(node_of_rank1: str, error: str = "RuntimeError: boom") -> list[dict]:
    return [{"event": "placement", "ranks": [["n1", 0], [node_of_rank1, 0]]},
            {"event": "failure", "rank": 1, "host": "vm", "error": error},
            {"event": "failure", "rank": 0, "host": "vm", "error": "Connection closed by peer"}]


def test_a_node_named_by_two_failed_starts_is_excluded_and_feeds_the_next_exclude(tmp_path: Path) -> None:
    once = failed_start("n2")
    assert exclusions.crash_nodes(once) == {}
    twice = failed_start("n2") + [{"event": "placement", "ranks": [["n1", 0], ["n2", 0]]}, {"event": "hang",
                                  "rank": 1, "idle_s": 60, "step": 3}]
    named = exclusions.crash_nodes(twice)
    assert list(named) == ["n2"] and "2 trainer starts failed there first" in named["n2"]
    echoes = [{"event": "placement", "ranks": [["n1", 0], ["n2", 0]]},
              {"event": "failure", "rank": 1, "error": "Connection closed by peer"}] * 2
    assert exclusions.crash_nodes(echoes) == {}  # a lost peer is not a cause
    paths = RunPaths(tmp_path)
    paths.events.write_text("".join(json.dumps(e) + "\n" for e in twice))
    assert exclusions.update(paths) == ["n2"]
    assert exclusions.add(paths, {"n2": "again"}, exclusions.PREFLIGHT) == []  # kept with its first reason
    assert exclusions.read(paths)["n2"]["source"] == exclusions.FAILURES
    assert exclusions.merged("n9", ["n2"]) == "n9,n2" and exclusions.merged(None, []) is None


def test_batch_script_reads_the_record_each_attempt_and_before_requeueing() -> None:
    script = render(SbatchRequest(run_dir="/r", job_name="j", nodes=2, gpus_per_node=1, mode="srun",
                                  python="python3", exclude="n2")).script
    assert "#SBATCH --exclude=n2" in script
    check = \
        script.index('-m trainctl.launch.exclusions "$RUN_DIR"')
    assert check < script.index("srun --nodes")  # at the start of the attempt, before the step
    assert 'scontrol update jobid="$SLURM_JOB_ID" ExcNodeList="$excluded"' in script
    assert script.count("then exclude_next; exit 0; fi") == 2  # an excluded node allocated; any requeue


def test_a_resubmission_renders_the_record_into_sbatch_exclude(tmp_path: Path) -> None:
    from trainctl.launch.slurm.render import render_launch
    from trainctl.spec import load_spec_text

    spec = load_spec_text("name: r\nmodel: {preset: tiny}\ntrain: {global_batch: 2, steps: 2}\n"
                          "data: {synthetic: true}\ncluster: {nodes: 2, gpus_per_node: 1, gpu: cpu, exclude: n7}\n"
                          "launcher: {backend: slurm}\n")
    exclusions.add(RunPaths(tmp_path), {"n2": "crashed twice"}, exclusions.FAILURES)
    launch = render_launch(spec, tmp_path, grace_s=60, python=None, trainer_module="trainctl.runtime")
    assert "--exclude=n7,n2" in launch.rendered.options
