"""`trainctl plan SPEC`: layout, memory, FLOPs, communication, bubble, predicted MFU; `--auto` search.

Exit codes: 0 when the plan was computed, even if the layout does not fit (the tables say so in red);
with `--strict`, 1 when the plan has an error-level warning (does not fit, or a broken estimate);
2 for usage and spec errors. The planner is imported inside the command so `trainctl --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt, OptionalSpecArg, SetOpt, read_spec
from trainctl.errors import UsageError
from trainctl.terminal import prose
from trainctl.units import count, decimal_size, dur, energy, figure, pct, tflops
from trainctl.units import days as days_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from trainctl.plan.auto import AutoResult
    from trainctl.plan.plan import Plan
    from trainctl.plan.scale import Sweep

LEVEL_STYLE = {"info": "cyan", "warning": "yellow", "severe": "bold red", "error": "bold white on red"}
RANKS_FULL_LIMIT = 64  # print every rank up to this world size; summarise above


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "unknown"
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _bytes(x: float | None) -> str:
    return "unknown" if x is None else decimal_size(x)


def _s(x: float | None) -> str:
    return "unknown" if x is None else dur(x)


def _outside_layers(o: dict[str, Any]) -> str:
    """The plan's work outside the layers (prediction.outside_layers), measured by calibrate, in one line."""
    return (f"{_s(o['per_micro_batch_s'])} per micro-batch (embedding, LM head + loss) x {o['micro_batches']} + "
            f"optimizer step {_s(o['optimizer_step_s'])} = {_s(o['total_s'])} (measured by calibrate; the ends are "
            f"in compute, the optimizer step after it)")


def _pct(x: float | None, digits: int = 1) -> str:
    return "unknown" if x is None else f"{x:.{digits}%}"


def _title(console: Console, title: str) -> None:
    """A table's title on its own lines: rich would neither wrap it (soft_wrap) nor cut it to the table."""
    prose(console, f"[italic]{title}[/italic]")


def _print_kv(console: Console, title: str, rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    _title(console, title)
    t = Table(show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _stage_summary(layers: list[int]) -> str:
    if len(layers) <= 16:
        return " ".join(map(str, layers))
    return " ".join(map(str, layers[:6])) + f" … ({len(layers)} stages) … " + " ".join(map(str, layers[-3:]))


def _where(j: dict[str, Any]) -> str:
    """The header's machine: GPUs with their NVLink domain and fabric, or CPU ranks (shared memory, and the
    network between nodes: gloo has no NVLink or InfiniBand transport)."""
    L, hw = j["layout"], j["hardware"]
    nodes = count(L["nodes"], "node")
    cp = f"cp {L['cp']} x " if L["cp"] > 1 else ""
    grid = f"tp {L['tp']} x {cp}pp {L['pp']} x dp {L['dp']}"
    if hw["gpu"] == "cpu":
        return (f"{j['world_size']:,} CPU ranks = {grid} on {nodes} x {L['gpus_per_node']} ranks (gloo: shared "
                f"memory inside a node{', the network between nodes' if L['nodes'] > 1 else ''})")
    return (f"{j['world_size']:,} GPUs = {grid} on {nodes} x {L['gpus_per_node']} {hw['gpu']} (NVLink domain "
            f"{L['nvlink_domain']}, fabric {hw['fabric']})")


def render_plan(plan: Plan, console: Console, ranks: bool) -> None:
    from rich.table import Table

    j = plan.to_json()
    L, hw = j["layout"], j["hardware"]
    per = "rank" if hw["gpu"] == "cpu" else "GPU"  # a CPU rank is no GPU
    prose(console, f"[bold]{escape(plan.name)}[/bold]: {_where(j)}")

    sched = L["schedule"] + (f", {L['virtual_stages']} chunks per rank" if L["virtual_stages"] > 1 else "")
    _print_kv(console, "Layout", [
        ("tensor parallel", f"{L['tp']}" + (" + sequence parallel" if L["sequence_parallel"] else "")
         + ("" if L["tp_fits_nvlink"] else "  [red](crosses the NVLink domain)[/red]")),
        *([("context parallel", _cp_line(j["context_parallel"], hw))] if "context_parallel" in j else []),
        ("pipeline parallel", f"{L['pp']} ({sched})"),
        ("data parallel", f"{L['dp']}, ZeRO-{L['zero']}"
         + (", optimizer offloaded to host memory" if L["offload"] == "optimizer" else "")
         + (f"; expert parallel {L['ep']} x expert-data-parallel {L['expert_dp']}" if L["ep"] > 1 else "")),
        *([("gradient compression", _powersgd_line(j["grad_compression"]))] if "grad_compression" in j else []),
        ("batch", f"global {L['global_batch']} = micro-batch {L['micro_batch']} x {L['micro_batches']} "
                  f"micro-batches x dp {L['dp']}"),
        *([("elastic (cluster.min_nodes)", j["elastic"]["summary"])] if "elastic" in j else []),
        ("precision / recompute", f"{L['precision']} / {L['recompute']}"),
        ("layers per stage", _stage_summary(L["stage_layers"])),
        ("vocabulary (padded)", f"{plan.ctx.shape.vocab:,} ({L['padded_vocab']:,})"),
    ])

    p, f = j["params"], j["flops"]
    _print_kv(console, "Model and FLOPs", [
        ("parameters", f"{p['total']:,} ({_si(p['total'])})"),
        *([("active parameters per token (MoE)", f"{p['active']:,} ({_si(p['active'])}); "
            f"{j['moe']['num_experts']} experts, top-{j['moe']['top_k']}, {j['moe']['moe_layers']} MoE layers")]
          if "moe" in j else []),
        ("matmul weights N (incl. LM head)", f"{p['matmul']:,}"),
        ("model FLOPs per token (6N + 12Lhs)", _si(f["model_per_token"], "FLOP")),
        ("model FLOPs per step", _si(f["model_per_step"], "FLOP")),
        ("hardware FLOPs per step (+ recompute)", _si(f["hardware_per_step"], "FLOP")),
        ("tokens per step", f"{f['tokens_per_step']:,}"),
    ])

    mem = j["memory"]
    fits = mem["fits"]
    head = mem["headroom_fraction"]
    head_style = "red" if not fits else ("yellow" if head is not None and head < 0.10 else "green")
    rows = [
        ("weights", _bytes(mem["weights"])), ("gradients", _bytes(mem["gradients"])),
        ("optimizer state", _bytes(mem["optimizer"])), ("model states", _bytes(mem["model_states"])),
        ("activations", _bytes(mem["activations"])), ("transient buffers", _bytes(mem["transient"])),
        ("total", f"[bold]{_bytes(mem['total'])}[/bold]"),
        ("capacity", _bytes(mem["capacity"]) if mem["capacity"] else "unknown (no fit check)"),
    ]
    if mem["host_per_gpu"]:
        host_ok = "fits" if mem["host_fits"] else "[red]DOES NOT FIT[/red]"
        rows.append(("host memory (offload)", f"{_bytes(mem['host_per_gpu'])} per {per}, "
                     f"{_bytes(mem['host_per_node'])} per node of {_bytes(mem['host_capacity_per_node'])} — {host_ok}"))
    if mem["capacity"]:
        verdict = "fits" if fits else "DOES NOT FIT"
        rows.append(("headroom", f"[{head_style}]{_bytes(mem['headroom'])} ({_pct(head)}) — {verdict}[/{head_style}]"))
    _print_kv(console, f"Memory per {per} (worst: pipeline rank {mem['worst_pp_rank']}, "
                       f"{mem['params_per_gpu']:,.0f} params)", rows)

    c = j["communication"]
    _title(console, f"Communication per {per} per step (busiest {per} of each kind)")
    ct = Table()
    for col in ("kind", "link", "bytes", "time at link rate"):
        ct.add_column(col, justify="left" if col in ("kind", "link") else "right")
    names = {"tp": "TP collectives", "pp": "PP point-to-point", "dp": f"DP (ZeRO-{L['zero']})",
             "embedding": "tied-embedding sync", "ep": "EP all-to-all (MoE)",
             "expert_dp": f"expert DP (ZeRO-{L['zero']}, dp/ep = {L['expert_dp']})",
             "cp": "CP K/V all-gather", "pp_gather": "PP pieces gathered (scatter/gather)"}
    for kind, v in c["per_kind"].items():
        if v["bytes"]:
            link = hw["intra_domain_link"] if v["link"] == "nvlink" else f"inter-node ({hw['fabric']})"
            ct.add_row(names[kind], link, _bytes(v["bytes"]), _s(v["seconds"]))
    for link, b in c["per_link"].items():
        name = hw["intra_domain_link"] if link == "nvlink" else link.replace("_", "-")
        ct.add_row(f"[bold]total {name}[/bold]", "", f"[bold]{_bytes(b)}[/bold]", "")
    console.print(ct)

    pr, pl = j["prediction"], j["pipeline"]
    pred = [
        ("pipeline bubble", f"{_pct(pl['bubble_fraction'])} of the pipelined time "
                            f"({_pct(pl['bubble_over_ideal'])} of the ideal compute time)"),
        ("stage imbalance", f"busiest pipeline rank {_pct(pl['stage_imbalance'])} above the mean"),
        ("compute", _s(pr["compute_s"])), ("TP exposed", _s(pr["tp_exposed_s"])),
        *([("CP K/V exchange", _s(pr["cp_s"]))] if L["cp"] > 1 else []),
        ("PP point-to-point", _s(pr["p2p_s"])), ("bubble", _s(pr["bubble_s"])),
        ("DP exposed", f"{_s(pr['dp_exposed_s'])} of {_s(pr['dp_s'])}"),
        *([("outside the layers", _outside_layers(pr["outside_layers"]))] if pr.get("outside_layers") else []),
        *[(k, _s(v)) for k, v in (pr["breakdown_s"] or {}).items() if k in ("FSDP2 units", "weight passes")],
        *([("offload: copies + CPU AdamW", f"{_s(pr['offload_copy_s'])} + {_s(pr['offload_step_s'])}")]
          if L["offload"] == "optimizer" else []),
        ("step time", f"[bold]{_s(pr['step_time_s'])}[/bold]"),
        *([("dominated by", f"{pr['dominant']['part']}: {_s(pr['dominant']['seconds'])} "
                            f"({_pct(pr['dominant']['share'])} of the step)")] if pr["dominant"] else []),
        ("tokens/s", "unknown" if pr["tokens_per_s"] is None else f"{pr['tokens_per_s']:,.0f}"),
        (f"model TFLOP/s per {per}", "unknown" if pr["model_flops_per_s_per_gpu"] is None
         else tflops(pr["model_flops_per_s_per_gpu"] / 1e12)),
        ("MFU (HFU)", f"[bold]{_pct(pr['mfu'])}[/bold] ({_pct(pr['hfu'])})"),
    ]
    peak = hw["peak_flops"]
    pred.append(("calibration", calibration_line(j["calibration"])))
    _print_kv(console, "Prediction (roofline)", pred)
    prose(console, f"peak {_si(peak, 'FLOP/s') if peak else 'unknown (measured at run time)'} "
                   + (f"dense {'TF32' if L['precision'] == 'fp32' else 'BF16'} per GPU" if per == "GPU"
                      else "per rank: the matmul rate where the ranks run")
                   + (f"; the linear layers' FP8 GEMMs at {hw['gemm_speedup']:.1f}x it (the FP8 peak), MFU against "
                      "it (docs/design/memory.md, \"MFU convention\")" if hw.get("gemm_speedup", 1.0) != 1.0 else ""))

    _print_kv(console, "Checkpoints", checkpoint_rows(j["checkpoint"]))

    a = j["assumptions"]
    prose(console, f"[bold]Assumptions[/bold] (estimate.* in the spec): {rates_text(a)}, "
                   f"{dp_overlap_text(a, j['calibration'])}, tp_overlap {a['tp_overlap']}"
                   + (f" (TP communication overlap, as Megatron-Core's --tp-comm-overlap, would hide up to "
                      f"{j['prediction']['tp_exposed_s']:.3g} s of the step)"
                      if a["tp_overlap"] == 0 and j["prediction"].get("tp_exposed_s") else "")
                   + (f", offload_pcie_gbps {a['offload_pcie_gbps']}, host_adam_gbps {a['host_adam_gbps']}"
                      if L["offload"] == "optimizer" else "")
                   + (f", moe_imbalance {a['moe_imbalance']}" if "moe" in j and j["moe"]["capacity_factor"] is None
                      else ""))
    for line in [a["roofline"], *a["notes"]]:
        prose(console, f"[dim]{escape(line)}[/dim]", "  [dim]-[/dim] ")

    if plan.warnings:
        console.print("[bold]Warnings[/bold]")
        for w in plan.warnings:
            style = LEVEL_STYLE[w.level]
            prose(console, f"{w.code}: {escape(w.message)}", f"  [{style}]{w.level.upper():8}[/{style}] ")
    if not fits:
        console.print("[bold red]This layout does not fit in GPU memory.[/bold red]")
    if ranks:
        render_ranks(plan, console)


def _cp_line(cpj: dict, hw: dict) -> str:
    link = hw["intra_domain_link"] if cpj["link"] == "nvlink" else f"inter-node ({hw['fabric']})"
    return (f"{cpj['cp']}: {cpj['chunks']} chunks of {cpj['chunk_tokens']:,} tokens, {cpj['tokens_per_rank']:,} per "
            f"GPU (causal work max/mean {cpj['causal_balance']:.2f}; a contiguous split: "
            f"{cpj['contiguous_split_balance']:.2f}); K/V all-gather on {link}; gradients over dp x cp = "
            f"{cpj['dp_cp']}")


def checkpoint_rows(ck: dict[str, Any]) -> list[tuple[str, str]]:
    """One save's size and time, the interval asked for and the Young/Daly one (plan/cadence.py)."""
    from trainctl.plan.cadence import lost_text

    cad = ck["cadence"]
    asked = [f"every {ck['every_steps']} steps"] if ck["every_steps"] else []
    asked += [f"every {ck['every_minutes']:g} min"] if ck["every_minutes"] else []
    configured = (" or ".join(asked) or "none scheduled") + (
        f" = {dur(cad['configured_s'])}" if cad["configured_s"] else "")
    if cad["loss_configured"] is not None:
        configured += f"; {lost_text(cad['loss_configured'])}"
    steps = f" (~{count(cad['optimal_steps'], 'step')})" if cad["optimal_steps"] else ""
    return [
        ("size", _bytes(ck["bytes"])),
        ("save", f"blocks training {dur(ck['blocking_s'])}" + (f", written in {dur(ck['save_s'])} (async)"
                 if ck["async"] else " (synchronous)") + f" at {ck['write_gbps_per_node']:g} GB/s per node"),
        ("interval", configured),
        ("Young/Daly interval", f"{dur(cad['optimal_s'])}{steps}; {lost_text(cad['loss_optimal'])}, "
                                f"MTBF {dur(cad['mtbf_s'])} ({cad['mtbf_source']})"),
    ] + whole_run_rows(ck["whole_run"])


def whole_run_rows(run: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The whole run under failures and time limits (plan/whole_run.py; formulas in --json's
    checkpoint.whole_run.formulas)."""
    if run is None:  # no predicted step time: a CPU's peak is measured at run time, not in the catalog
        return [("whole run", "unknown without a predicted step time: `trainctl calibrate SPEC` measures this "
                              "hardware, then `trainctl plan SPEC --calibration PROFILE` prices the whole run")]
    stages = run["stages"] or []
    shape = (f"in {count(len(stages), 'stage')}" if stages else f"x {run['tokens'] / run['steps']:,.0f} tokens")
    length = (f"{count(run['steps'], 'step')} {shape} = {run['tokens']:.4g} tokens (from {run['given']}); "
              f"compute {dur(run['compute_s'])}")
    if not run["finishes"]:
        return [("whole run", f"{length}: not expected to finish: {run['not_finishing']}")]
    days = {k: v * 86400.0 for k, v in run["wall_days"].items()}
    cost = f", cost {figure(run['cost'])}" if run["cost"] is not None else ""
    energy_row = f", at most {energy(run['energy_mwh'])}" if run["energy_mwh"] is not None else ""
    parts = run["restart_parts_s"]
    restart = (f"{dur(run['restart_s'])} restart (requeue {dur(parts['requeue'])}, start-up {dur(parts['startup'])}, "
               f"checkpoint load {dur(parts['checkpoint_load'])}: estimate.requeue_s, startup_s, "
               "checkpoint_read_gbps)")
    limit = run["time_limit"]
    limit_rows = [] if limit is None else [(
        "time limits", f"~{count(limit['stops'], 'requeue')} at cluster.time {dur(limit['limit_s'])} "
                       f"({dur(limit['train_per_attempt_s'])} of training per attempt after the grace and start-up), "
                       f"{dur(limit['cost_each_s'])} each (the stop's save and a restart): {dur(limit['total_s'])}; "
                       "not failures")]
    hours = run["maintenance"]["hours_per_week"]
    maintenance = (f"{hours:g} h a week (cluster.maintenance_hours_per_week): "
                   f"{dur(run['maintenance']['total_s'])} of the wall clock" if hours
                   else "none assumed (cluster.maintenance_hours_per_week 0)")
    own_nodes = len({st["nodes"] for st in stages}) > 1  # stages on nodes of their own: say each one's
    own_micro = len({st["micro_batch"] for st in stages}) > 1  # likewise their micro-batches

    def nodes_of(st: dict[str, Any]) -> str:
        return (f", micro-batch {st['micro_batch']}" if own_micro else "") + (
            f", {st['nodes']:,} nodes" if own_nodes else "")

    held = " (each stage's on its own GPUs)" if own_nodes else ""
    stage_rows = [(f"stage {st['name']}", (
        f"{count(st['steps'], 'step')} x {st['global_batch']:,} x {st['seq_len']:,} tokens (cp {st['cp']}, dp "
        f"{st['dp']}{nodes_of(st)}) at {dur(st['step_time_s'])} a step (predicted): {dur(st['compute_s'])}"
        + ("" if st["fits"] else "; out of memory"))) for st in stages]
    return [
        *stage_rows,
        ("whole run", f"{length}; {count(run['saves'], 'save')} blocking {dur(run['save_blocking_s'])}, last write "
                      f"{dur(run['last_write_s'])}"),
        ("interruptions", f"~{figure(run['expected_interruptions'])} failures expected, each redoing the work since "
                          f"the last save plus a {restart}; ETTR {pct(run['ettr'], 1)}"),
        *limit_rows,
        ("maintenance", maintenance),
        ("wall clock", f"P10 {days_text(days['p10'])} / P50 {days_text(days['p50'])} / P90 {days_text(days['p90'])} "
                       f"(closed form); {figure(run['gpu_hours'])} GPU-hours{held}{energy_row}{cost}"),
        *record_rows(run.get("record_range")),
        ("best interval", f"{dur(run['optimal_interval_s'])} minimises the expected wall clock"),
    ]


def record_rows(rec: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The whole run again at the two ends of the published record's range on this GPU part (plan/record.py)."""
    return [] if rec is None else [("record range", record_range_text(rec))]


def record_range_text(rec: dict[str, Any]) -> str:
    """A whole run at the record's two ends (plan's record_range, the node sweep's): the days, GPU-hours and cost
    if the step is off as far as the published runs on this GPU part were from the uncalibrated plan."""
    lo, hi = rec["step_ratio"]

    def span(pair: list[float | None], show: Callable[[float], str]) -> str:
        return " to ".join(show(x) if x is not None else "not finishing" for x in pair)

    cost = f", cost {span(rec['cost'], figure)}" if all(c is not None for c in rec["cost"]) else ""
    wall = span([d * 86400.0 if d is not None else None for d in rec["wall_days"]], days_text)
    return (f"if the step is {lo:.2f}x-{hi:.2f}x the predicted one, as on {rec['runs']} published {rec['gpu']} runs "
            f"(docs/validation.md): {wall}, {span(rec['gpu_hours'], figure)} GPU-hours{cost}")


def render_ranks(plan: Plan, console: Console) -> None:
    from rich.table import Table

    from trainctl.plan.placement import Groups, placement

    layout = plan.layout
    world = layout.world_size
    info = placement(layout)[: world if world <= RANKS_FULL_LIMIT else layout.gpus_per_node]
    cp = ("cp",) if layout.cp > 1 else ()
    _title(console, "Rank placement (Megatron-Core order: tp fastest, then cp, then dp, then pp; ep is the fast "
           "part of dp)" + ("" if world <= RANKS_FULL_LIMIT else f" — first node of {layout.nodes}; the full map "
                            "is in --json"))
    t = Table()
    moe = ("ep", "edp") if layout.ep > 1 else ()  # EP is carved from DP: dp = ep + ep_size * edp
    for col in ("rank", "node", "gpu", "tp", *cp, "dp", *moe, "pp", "nvlink domain"):
        t.add_column(col, justify="right")
    for r in info:
        t.add_row(*(str(x) for x in (r.rank, r.node, r.local_gpu, r.tp, *((r.cp,) if cp else ()), r.dp,
                                     *((r.ep, r.edp) if moe else ()), r.pp, r.nvlink_domain)))
    console.print(t)
    inner = layout.tp * layout.cp  # ranks of one (dp, pp) position
    for kind, stride, size, groups in (("tp", 1, layout.tp, world // layout.tp),
                                      *((("cp", layout.tp, layout.cp, world // layout.cp),) if cp else ()),
                                      ("dp", inner, layout.dp, world // layout.dp),
                                      *((("dp_cp", layout.tp, layout.dp * layout.cp, layout.tp * layout.pp),)
                                        if cp else ()),
                                      ("pp", inner * layout.dp, layout.pp, world // layout.pp),
                                      *((("ep", inner, layout.ep, world // layout.ep),
                                         ("expert_dp", inner * layout.ep, layout.edp, world // layout.edp))
                                        if moe else ())):
        first = getattr(Groups(layout), kind)[0] if world <= RANKS_FULL_LIMIT else list(range(0, stride * size, stride))
        shown = ", ".join(map(str, first[:8])) + (", …" if len(first) > 8 else "")
        label = {"dp_cp": "DP x CP (gradient reduction, ZeRO)"}.get(kind, kind.upper())
        prose(console, f"{groups} of {size} ranks, stride {stride}; the first: \\[{shown}]", f"  {label} groups: ")


def _powersgd_line(g: dict[str, Any]) -> str:
    """The plan's PowerSGD figures in one line (plan/powersgd.py)."""
    return (f"PowerSGD rank {g['rank']}: {g['compressed_params_per_gpu']:,.0f} parameters per GPU sent as "
            f"{g['factor_elements_per_gpu']:,.0f} factor values, {g['extra_flops_per_step'] / 1e9:,.2f} GFLOP "
            f"extra per step")


def calibration_line(cal: dict[str, Any]) -> str:
    """Where the time figures come from, in one line (yellow when uncalibrated)."""
    from trainctl.plan.rates import calibration_text

    text = escape(calibration_text(cal))
    return text if cal.get("calibrated") else f"[yellow]{text}[/yellow]"


SCHEDULE_ABBREV = {"interleaved": "il", "zero-bubble": "zb", "zbv": "zbv"}  # --auto's table: the column stays narrow


def render_auto(res: AutoResult, console: Console, on_cpu: bool = False) -> None:
    from rich import box
    from rich.table import Table

    prose(console, f"[bold]{escape(res.name)}[/bold] --auto: {res.evaluated:,} valid layouts evaluated on "
                   f"{res.world:,} {'CPU ranks' if on_cpu else 'GPUs'}, {res.fitting:,} fit in "
                   f"memory ({res.elapsed_s * 1e3:.0f} ms). Ranked by predicted MFU, ties by less memory.")
    if not res.peak_known:
        prose(console, "[yellow]Peak FLOP/s unknown for this accelerator: ranked with a nominal 1 TFLOP/s; "
                       "MFU and step times are not shown (set cluster.peak_tflops, or calibrate).[/yellow]")
    prose(console, calibration_line(res.calibration), "Times: ")
    _title(console, "Best layouts (sp: sequence parallel; il v: interleaved, v chunks per rank; zb: zero-bubble; "
                    "m: micro-batches; +off: optimizer offloaded to host memory)")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in ("#", "tp/cp/pp/dp", "sched", "ZeRO", "mb/m", "recomp", "GB/GPU", "bubble", "step", "MFU"):
        t.add_column(col, justify="left" if col in ("sched", "recomp") else "right", no_wrap=True)
    for i, (s, _, _codes) in enumerate(res.top, 1):
        c, e = s.cand, s.est
        chunks = c.virtual_stages > 1 and c.schedule != "zbv"  # zbv always runs 2
        sched = SCHEDULE_ABBREV.get(c.schedule, c.schedule) + (f" {c.virtual_stages}" if chunks else "")
        t.add_row(str(i), f"{c.tp}{'sp' if c.sequence_parallel else ''}/{c.cp}/{c.pp}/{c.dp}"
                  + (f" ep{c.ep}" if c.ep > 1 else ""), sched, f"{c.zero}{'+off' if c.offload else ''}",
                  f"{c.micro_batch}/{e.micro_batches}", c.recompute, f"{e.memory_total / 1e9:.1f}",
                  _pct(e.bubble_fraction), f"{e.step_time:.3g} s" if res.peak_known and e.step_time else "—",
                  _pct(s.mfu) if res.peak_known else "—")
    console.print(t)
    by_codes: dict[tuple[str, ...], list[str]] = {}
    for i, (_, _, codes) in enumerate(res.top, 1):
        if codes:
            by_codes.setdefault(tuple(codes), []).append(f"#{i}")
    for codes, rows in by_codes.items():
        prose(console, ", ".join(codes), f"  [yellow]{' '.join(rows)}:[/yellow] ")
    for i, levers in res.levers.items():
        if res.peak_known:
            before = res.top[i][0].est.step_time or 0.0
            prose(console, escape("; ".join(x.text(before) for x in levers)),
                  f"  [cyan]#{i + 1} DP-bound, predicted with[/cyan] ")
    if res.pulled is not None and res.peak_known:
        s, lever = res.pulled
        prose(console, escape(f"{s.cand.describe()} with {lever.setting}: step {lever.step_time:.3g} s, "
                              f"{lever.saving_s / (s.est.step_time or 1):.0%} less than without it, faster than #1"),
              "  [cyan]Communication lever:[/cyan] ")
    if not res.top:
        console.print("[bold red]No valid layout fits in memory on this cluster.[/bold red]")
    if res.rejected:
        console.print("[bold]Best-looking layouts rejected[/bold]")
        for s, why in res.rejected:
            mfu = f"MFU {_pct(s.mfu)}" if res.peak_known else "relative"
            prose(console, escape(f"{s.cand.describe()} ({mfu}): {why}"), "  [red]✗[/red] ")
    if res.skipped:
        skipped = "; ".join(f"{k} ({v})" for k, v in sorted(res.skipped.items()))
        prose(console, f"[dim]Combinations left out by the spec rules: {escape(skipped)}.[/dim]")
    if res.invalid:
        console.print(f"[bold red]{len(res.invalid)} enumerated layouts failed validation (a planner bug); not "
                      "shown.[/bold red]")
    a = res.assumptions
    prose(console, f"[dim]Assumptions: {rates_text(a)}, {dp_overlap_text(a, res.calibration)}, "
                   f"tp_overlap {a['tp_overlap']}. "
                   "Run `trainctl plan SPEC --set parallel.tp=...` on a row for its full plan.[/dim]")


def render_sweep(res: Sweep, console: Console) -> None:
    """plan --auto --nodes: the Pareto front of days against GPU-hours (cost), then the answer."""
    from rich.table import Table

    prose(console, f"[bold]{escape(res.name)}[/bold]: {count(len(res.points), 'node count')} of {res.node_range[0]}.."
                   f"{res.node_range[1]} searched, each at its best layout (`plan --auto` there); the Pareto "
                   "front of days against GPU-hours (no other count is both faster and cheaper):")
    t = Table()
    in_days = all(p.days >= 2 for p in res.front)  # else durations: 0.0 days would hide a short run's figure
    for col in ("nodes", "GPUs", "layout", "days" if in_days else "time", "GPU-hours",
                *(("cost",) if res.priced else ()), "MFU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for p in res.front:
        d = p.as_dict()
        took = f"{p.days:,.1f}" if in_days else dur(p.days * 86400)
        t.add_row(f"{p.nodes:,}", f"{d['gpus']:,}", escape(d["layout"]), took, figure(p.gpu_hours),
                  *((figure(p.cost),) if p.cost is not None else ()), _pct(p.mfu))
    console.print(t)
    if res.answer is not None:
        a = res.answer
        cost = f", cost {figure(a.cost)}" if a.cost is not None else ""
        prose(console, f"{a.nodes:,} nodes: {days_text(a.days * 86400)}, {figure(a.gpu_hours)} GPU-hours{cost}, MFU "
                       f"{_pct(a.mfu)} ({res.why}).", "[bold green]Answer:[/bold green] ")
        if res.record_range is not None:
            prose(console, escape(record_range_text(res.record_range)) + ".", "[dim]Record range:[/dim] ")
    if res.not_finishing:
        shown = ", ".join(map(str, res.not_finishing[:6])) + (", …" if len(res.not_finishing) > 6 else "")
        prose(console, f"[yellow]Not expected to finish at {count(len(res.not_finishing), 'node count')} "
                       f"({shown}): left out (plan SPEC --set cluster.nodes=N says why).[/yellow]")
    if res.empty:
        shown = ", ".join(map(str, res.empty[:6])) + (", …" if len(res.empty) > 6 else "")
        prose(console, f"[dim]No layout at {count(len(res.empty), 'node count')} ({shown}): the spec rules leave "
                       "none that fits there (global_batch bounds dp x pp: micro-batches >= pp).[/dim]")
    prose(console, f"[dim]Wall clock: the whole run's expected, with interruptions and restarts (plan's "
                   f"whole-run block); {sum(p.scored for p in res.points):,} of "
                   f"{sum(p.candidates for p in res.points):,} layouts scored, the rest could not beat a count's "
                   f"best; {res.elapsed_s:.1f} s.[/dim]")


def _sweep_progress() -> Callable[[int, int, int], None]:
    """Progress on stderr once the sweep has taken a second, at most once a second."""
    import sys
    import time

    start = time.monotonic()
    shown = [start]

    def report(done: int, total: int, nodes: int) -> None:
        now = time.monotonic()
        if now - start >= 1.0 and (now - shown[0] >= 1.0 or done == total):
            shown[0] = now
            print(f"plan --auto: {done}/{total} node counts searched (last: {nodes:,} nodes)", file=sys.stderr)

    return report


def rates_text(a: dict) -> str:
    """How the plan priced compute and collectives: the operator and NCCL models, or the spec's flat shares."""
    compute = (f"compute_efficiency {a['compute_efficiency']}" if a.get("compute_efficiency") is not None
               else "compute: operator model (catalog GEMM, HBM and attention figures)")
    links = (f"comm_efficiency {a['comm_efficiency']}" if a.get("comm_efficiency") is not None
             else "collectives: NCCL's latency and bus-bandwidth model")
    kernel = a.get("attention_kernel")  # the trainer's own (flash2, auto) goes without saying
    accumulation = a.get("grad_accumulation", "auto")
    # the trainer's own (eager elementwise ops, auto accumulation) go without saying; another stack's are named
    stack = ((", elementwise fused" if a.get("elementwise") == "fused" else "")
             + (f", grad_accumulation {accumulation}" if accumulation != "auto" else "")
             + (", pp_scatter_gather" if a.get("pp_scatter_gather") else ""))
    return f"{compute}, {links}" + (f", attention_kernel {kernel}" if kernel not in (None, "auto", "flash2") else
                                    "") + stack


def dp_overlap_text(assumptions: dict[str, Any], calibration: dict[str, Any]) -> str:
    """estimate.dp_overlap as the plan used it: the profile's measured share per link class where it has one."""
    measured = calibration.get("dp_overlap") or {}
    share = assumptions["dp_overlap"]
    own = "the trainer's own (its gradient buckets)" if share is None else share
    if not measured:
        return f"dp_overlap {own}"
    shares = ", ".join(f"{link.replace('_', '-')} {x:.2f}" for link, x in sorted(measured.items()))
    return f"dp_overlap measured by calibrate ({shares}; other links {own})"


@app.command()
def plan(
    spec: Path | None = OptionalSpecArg,
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
    ranks: bool = typer.Option(False, "--ranks", help="Show the rank placement map and process groups."),
    auto: bool = typer.Option(False, "--auto", help="Search every valid layout; rank those that fit by MFU."),
    top: int = typer.Option(10, "--top", min=1, max=1000, help="With --auto: how many layouts to show."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 if the layout does not fit (error-level warning)."),
    calibration: Path | None = typer.Option(None, "--calibration", metavar="PROFILE", help="Price the plan with "
                                            "this `trainctl calibrate` profile (overrides cluster.calibration)."),
    nodes: str | None = typer.Option(None, "--nodes", metavar="LO..HI", help="With --auto: search node counts "
                                     "LO..HI (at most --counts, geometric) and show the Pareto front of days against "
                                     "GPU-hours."),
    counts: int = typer.Option(64, "--counts", min=2, max=1000, help="With --nodes: how many node counts to try."),
    objective: str = typer.Option("time", "--objective", metavar="time|cost|gpu-hours", help="With --nodes: the "
                                  "answer is the fewest days (time) or GPU-hours (cost needs cluster.gpu_hour_price)."),
    deadline: str | None = typer.Option(None, "--deadline", metavar="30d", help="With --nodes: the cheapest count "
                                        "that finishes the run within this many days (or hours: 36h)."),
    budget: str | None = typer.Option(None, "--budget", metavar="2e6gpuh", help="With --nodes: the fastest count "
                                      "within this many GPU-hours (2e6gpuh), or this much money (needs "
                                      "cluster.gpu_hour_price)."),
) -> None:
    """Plan a run: memory per GPU, FLOPs, communication, pipeline bubble and predicted MFU."""
    run = read_spec(spec, set_)
    if calibration is not None:
        run = run.with_calibration(calibration)
    console = make_console()
    if nodes is not None or deadline is not None or budget is not None or objective != "time":
        from trainctl.plan import scale

        if not auto:
            raise UsageError("--nodes, --objective, --deadline and --budget search node counts: add --auto")
        if deadline is not None and budget is not None:
            raise UsageError("give --deadline or --budget, not both")
        span = scale.parse_nodes(nodes) if nodes is not None else (run.cluster.nodes, run.cluster.nodes)
        res = scale.sweep(run, nodes=span, counts=counts, objective=objective,
                          deadline_days=scale.parse_deadline(deadline) if deadline is not None else None,
                          budget=scale.parse_budget(budget, run.cluster.gpu_hour_price) if budget is not None else None,
                          progress=None if as_json else _sweep_progress())
        if as_json:
            print_json(res.to_json())
        else:
            render_sweep(res, console)
        return
    if auto:
        from trainctl.plan.auto import search

        res = search(run, top=top)
        if as_json:
            print_json(res.to_json())
        else:
            render_auto(res, console, on_cpu=run.cluster.gpu == "cpu")
        if strict and not res.top:
            raise typer.Exit(1)
        return

    from trainctl import api

    p = api.plan_of(run)
    if as_json:
        out: dict[str, Any] = p.to_json(ranks=ranks)  # what api.plan returns
        # With --ranks the rank lists dominate (millions of numbers at 16k GPUs): print them compactly.
        print_json(out, compact=ranks and p.world > RANKS_FULL_LIMIT)
    else:
        render_plan(p, console, ranks)
    if strict and p.errors:
        raise typer.Exit(1)


__all__ = ["plan"]
