"""Rich tables for `trainctl mfu-report`: one column per run, so several runs read side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainctl.plan.cadence import lost_text
from trainctl.report.divergence import cell as divergence_cell
from trainctl.report.projection import lines as projection_lines
from trainctl.report.scaling import WARN_BELOW
from trainctl.report.sweep import table as sweep_table
from trainctl.terminal import escape, prose
from trainctl.units import count, dur, pct, si, size, tflops

Row = tuple[str, Callable[[dict[str, Any]], Any]]  # a cell: str (escaped) or rich Text


def _summary_rows() -> list[Row]:
    def s(r: dict[str, Any]) -> dict[str, Any]:
        return r["summary"]

    def mfu(key: str) -> Callable[[dict[str, Any]], Any]:
        def f(r: dict[str, Any]) -> Any:
            if s(r)["mfu_bug"]:
                return Text("BUG (>100%)", style="red")
            v = s(r)[key] or {}
            return f"{pct(v.get('median'))} / {pct(v.get('best10'))}"
        return f

    def plan(r: dict[str, Any]) -> str:
        p = s(r)["plan"]
        if not p.get("available"):
            return {"no_prediction": "no prediction (CPU peak is measured)", "no_plan": "no plan",
                    "other_hardware": f"not comparable: ran on {p.get('ran_on')}, planned for {p.get('planned_for')}",
                    }.get(p.get("reason", ""), p.get("note", "-"))
        gap = p.get("mfu_gap_points")
        return f"{pct(p['mfu'])} (gap {gap:+.2f} pts)" if gap is not None else pct(p["mfu"])

    def plan_step(r: dict[str, Any]) -> str:
        p = s(r)["plan"]
        if not p.get("available"):
            return "-"
        ratio = p.get("measured_over_predicted_step")
        return f"{dur(p.get('step_time_s'))}" + (f" (measured {ratio:.2f}x)" if ratio else "")

    def gp(r: dict[str, Any]) -> str:
        g = r["goodput"]
        return pct(g.get("goodput"), 1) if g.get("available") else "-"

    return [
        ("attempts in the figures below", lambda r: f"{r['covers']} ({r['layout']})" if r.get("layout")
         else r["covers"]),
        ("steps", lambda r: f"{s(r)['steps_completed']}/{s(r)['steps_target'] or '?'}"),
        ("wall time (all attempts)", lambda r: dur(r["goodput"].get("wall_s"))),
        ("attempts / restarts", lambda r: f"{r['goodput'].get('attempts', 1)} / "
                                          f"{len(r['goodput'].get('restarts', []))}"),
        ("goodput", gp),
        ("step time median", lambda r: dur(s(r)["step_time_s"]["median"])),
        ("step time p10 / p90", lambda r: f"{dur(s(r)['step_time_s']['p10'])} / {dur(s(r)['step_time_s']['p90'])}"),
        ("tokens/s (per GPU)", lambda r: f"{si(s(r)['tokens_per_s'])} ({si(s(r)['tokens_per_s_per_gpu'])})"),
        ("TFLOP/s per GPU", lambda r: tflops(s(r)["tflops_per_gpu"])),
        ("MFU median / best 10%", mfu("mfu")),
        ("HFU median / best 10%", mfu("hfu")),
        ("peak TFLOP/s per GPU", lambda r: tflops(s(r)["peak"]["tflops_per_gpu"])),
        ("peak source", lambda r: s(r)["peak"]["source"]),
        ("MFU convention", lambda r: s(r)["peak"].get("convention", "-")),
        ("plan: predicted MFU", plan),
        ("plan: predicted step", plan_step),
        ("final loss", lambda r: "-" if s(r)["final_loss"] is None else f"{s(r)['final_loss']:.4f}"),
        ("skipped steps / loss spikes", lambda r: divergence_cell(r["divergence"]) if "divergence" in r else "-"),
    ]


def _table(title: str, runs: list[dict[str, Any]], rows: list[Row]) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    t.add_column("")
    for r in runs:
        t.add_column(escape(r["label"]), overflow="fold")
    for label, fn in rows:
        # Text cells carry our styling; every other value (error text, paths) is escaped, not parsed as markup
        t.add_row(label, *(c if isinstance(c, Text) else escape(c) for c in (fn(r) for r in runs)))
    return t


def _breakdown_rows(runs: list[dict[str, Any]]) -> list[Row]:
    names: list[str] = []
    for r in runs:
        names += [i["name"] for i in r["time_breakdown"]["items"] if i["name"] not in names]

    def cell(name: str) -> Callable[[dict[str, Any]], str]:
        def f(r: dict[str, Any]) -> str:
            it = next((i for i in r["time_breakdown"]["items"] if i["name"] == name), None)
            if it is None or it["seconds"] is None:
                return "-" if it is None else f"- ({it['source']})"
            if it.get("per") == "save":
                return f"{dur(it['seconds'])} per save ({it['source']})"
            if it.get("kind") == "predicted":  # the plan's seconds: beside the measured step, not a part of it
                share = f", {pct(it['fraction'], 1)} of the planned step" if it.get("fraction") is not None else ""
                return f"{dur(it['seconds'])}{share} ({it['source']})"
            return f"{dur(it['seconds'])} ({pct(it['fraction'], 1)})"
        return f

    def step(r: dict[str, Any]) -> str:
        b = r["time_breakdown"]
        over = f"mean over {b['ranks']} ranks" if b.get("ranks") else "rank 0"
        return f"{dur(b['step_time_s'])} (measured, {over}, {r['covers']})"

    rows: list[Row] = [("median step", step)]
    rows += [(n, cell(n)) for n in names]
    rows.append(("start-up (launch to first step)", lambda r: dur(r["time_breakdown"]["startup_s"])))
    return rows


def _goodput_rows() -> list[Row]:
    # restarts: a failure's and a user's resume alike (the idle wait before a resume is shown apart)
    labels = {"queueing": "queueing", "startup": "start-up", "restarts": "restarts (each one's stop and start-up)",
              "replayed_steps": "replayed steps", "checkpoint_stalls": "checkpoint stalls",
              "shutdown": "shutdown", "other": "other (between steps, logging)"}

    def lost(key: str) -> Callable[[dict[str, Any]], str]:
        def f(r: dict[str, Any]) -> str:
            g = r["goodput"]
            if not g.get("available"):
                return "-"
            v = g["lost_s"].get(key)
            if v is None:
                return "unknown" if key == "queueing" else "-"
            meant = g["wall_s"] - (g.get("idle_s") or 0.0)  # goodput's denominator
            return f"{dur(v)} ({pct(v / meant, 1)})" if meant > 0 else dur(v)
        return f

    def cadence(key: str) -> Callable[[dict[str, Any]], str]:
        def f(r: dict[str, Any]) -> str:
            c = r["checkpoint_cadence"]
            if not c.get("available"):
                return "-"
            if key == "save":
                return f"blocks {dur(c['cost_s'])}, committed after {dur(c['save_s'])} ({c['saves']} saves)"
            if key == "configured":
                return "none scheduled" if c["configured_s"] is None else (
                    f"{dur(c['configured_s'])}: {lost_text(c['loss_configured'])}")
            steps = f" (~{count(c['optimal_steps'], 'step')})" if c["optimal_steps"] else ""
            return f"{dur(c['optimal_s'])}{steps}: {lost_text(c['loss_optimal'])} (MTBF {dur(c['mtbf_s'])})"
        return f

    def idle(r: dict[str, Any]) -> str:
        v = r["goodput"].get("idle_s")
        return "-" if v is None else f"{dur(v)} (not lost, not in the goodput)" if v else "0 s"

    rows: list[Row] = [("productive step time", lambda r: dur(r["goodput"].get("productive_s"))),
                       ("wall time", lambda r: dur(r["goodput"].get("wall_s"))),
                       ("idle: finished or stopped, until resumed", idle),
                       ("goodput", lambda r: pct(r["goodput"].get("goodput"), 1))]
    rows += [(f"lost: {v}", lost(k)) for k, v in labels.items()]
    return rows + [("checkpoint save", cadence("save")), ("checkpoint interval", cadence("configured")),
                   ("Young/Daly interval", cadence("optimal"))]


def _render_scaling_fit(con: Console, f: dict[str, Any]) -> None:
    """The sweep's loss-against-compute fit (report/scaling_law.py) and the points it used."""
    if not f["fitted"]:
        prose(con, escape(f["note"]), "[bold]scaling fit:[/bold] ")
        return
    prose(con, escape(f["line"]), "[bold]scaling fit:[/bold] ")
    for p in f["points"]:
        values = " ".join(f"{k}={v}" for k, v in p["values"].items())
        prose(con, escape(f"{p['dir']} ({values}): C {p['compute']:.4g} FLOPs, final loss {p['loss']:.4f} "
                          f"(measured), fit {p['fitted_loss']:.4f}"), "  ")


def render(report: dict[str, Any], console: Console | None = None) -> None:
    con = console or Console(emoji=False)
    runs = report["runs"]
    for r in runs:
        for w in r["warnings"]:
            prose(con, escape(w), f"[bold red]warning[/bold red] ({escape(r['label'])}): ")
    for x in report.get("scaling", []):
        prose(con, escape(x["line"] + (f", below {WARN_BELOW:.0%}" if x["warning"] else "")),
              "[bold red]warning[/bold red]: " if x["warning"] else "scaling: ")
    for sweep in report.get("sweeps", []):  # mfu-report SWEEP: its runs compared first (report/sweep.py)
        con.print(sweep_table(sweep))
        if sweep["not_measured"]:
            con.print(f"[dim]not measured yet: {escape(', '.join(sweep['not_measured']))}[/dim]")
        if sweep.get("scaling_fit"):
            _render_scaling_fit(con, sweep["scaling_fit"])
    con.print(_table("MFU report", runs, _summary_rows()))
    for r in runs:
        s = r["summary"]
        prose(con, f"[dim]stats over {s['steps_in_stats']} steps ({s['stats_note']}); MFU = model FLOPs / (step "
                   f"time x {s['world_size']} ranks x peak)[/dim]", f"[dim]{escape(r['label'])}:[/dim] ")
        if not s["plan"].get("available"):
            prose(con, f"[dim]{escape(s['plan']['note'])}[/dim]", f"[dim]{escape(r['label'])}:[/dim] ")
    con.print(_table("Where the time of a median step went", runs, _breakdown_rows(runs)))
    _render_step_vs_plan(con, runs)
    con.print(_table("Goodput (whole run: every attempt, across restarts)", runs, _goodput_rows()))
    for r in runs:
        for x in r["goodput"].get("restarts", []):
            cause = x["cause"] if len(x["cause"]) < 300 else x["cause"][:300] + "..."
            idle = f", after {dur(x['idle_s'])} idle" if x.get("idle_s") else ""
            prose(con, escape(f"restart -> attempt {x['attempt']} (resumed after step {x['resumed_at_step']}, gap "
                              f"{dur(x['gap_s'])}{idle}, {x['replayed_steps']} steps replayed): {cause}"),
                  f"  {escape(r['label'])}: ")
    con.print("[bold]On track (measured so far, the rest projected)[/bold]")
    for r in runs:
        for line in projection_lines(r["projection"]):
            prose(con, escape(line), f"  {escape(r['label'])}: ")
    _render_nodes(con, runs)
    _render_memory(con, runs)
    moe = [r for r in runs if (r.get("routing") or {}).get("available")]
    if moe:
        con.print(_table("Mixture-of-experts routing", moe, _routing_rows()))
    _render_profile(con, runs)
    con.print("[bold]Stragglers[/bold]")
    for r in runs:
        st = r["stragglers"]
        if not st.get("available"):
            prose(con, escape(st["note"]), f"  {escape(r['label'])}: ")
        elif not st["stragglers"]:
            prose(con, f"none over {st['steps_sampled']} steps x {st['ranks']} ranks (median rank busy "
                       f"{dur(st['median_busy_s'])} per step)", f"  {escape(r['label'])}: ")
        if st.get("logging_overhead_s_per_step") is not None:
            prose(con, f"[dim]per-rank step-time logging cost at most {dur(st['logging_overhead_s_per_step'])} per "
                       "step on a rank[/dim]", f"  [dim]{escape(r['label'])}:[/dim] ")
        for x in st.get("stragglers", []):
            prose(con, f"[yellow]{escape(x['where'])}[/yellow]: busy {dur(x['busy_median_s'])} per step vs median "
                       f"{dur(st['median_busy_s'])}, above in {x['steps_above']}/{st['steps_sampled']} steps; cost "
                       f"{dur(x['cost_s'])} ({pct(x['cost_fraction'], 1)} of the step time)",
                  f"  {escape(r['label'])}: ")
            if x.get("note"):
                prose(con, escape(x["note"]), f"    ranks {', '.join(map(str, x['ranks']))}: ")


def _render_nodes(con: Console, runs: list[dict[str, Any]]) -> None:
    """Elastic runs: the node count of each attempt and its throughput (report/nodes.py); every run: the nodes
    its later jobs keep out of (launch/exclusions.py)."""
    for r in runs:
        for node, why in (r.get("excluded_nodes") or {}).items():
            prose(con, escape(f"{node} excluded from later jobs ({why.get('source')}): {why.get('reason')}"),
                  f"  {escape(r['label'])}: ")
        nodes = r.get("nodes") or {}
        if not nodes.get("available"):
            continue
        t = Table(title=f"Nodes over time ({escape(r['label'])})", title_justify="left")
        for col in ("attempt", "from", "nodes", "ranks", "dp x micro-batches", "steps", "tokens/s"):
            t.add_column(col, justify="left" if col in ("from", "steps") else "right")
        for x in nodes["segments"]:
            steps = f"{x['steps'][0]}-{x['steps'][1]}" if x["steps"] else "-"
            t.add_row(str(x["attempt"]), dur(x["from_s"]), str(x["nodes"]), str(x["world_size"]),
                      f"{x['dp']} x {x['micro_batches']}", steps, si(x["tokens_per_s"]))
        con.print(t)
        for e in nodes["resizes"]:
            prose(con, escape(str(e.get("message") or "")), f"  {escape(r['label'])}: ")


def _routing_rows() -> list[Row]:
    def m(r: dict[str, Any]) -> dict[str, Any]:
        return r["routing"]

    def trend(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: f"{m(r)[key]['first']:.3f} -> {m(r)[key]['last']:.3f}"

    return [
        ("imbalance (busiest expert / mean), median / max",
         lambda r: f"{m(r)['imbalance']['median']:.2f} / {m(r)['imbalance']['max']:.2f} "
                   + ("(no plan)" if m(r)['imbalance']['planned'] is None
                      else f"(planned {m(r)['imbalance']['planned']:.2f})")),
        ("imbalance first -> last step", trend("imbalance")),
        ("tokens per expert per step, min / max", lambda r: f"{m(r)['tokens_per_expert']['min']:.0f} / "
                                                            f"{m(r)['tokens_per_expert']['max']:.0f} (mean "
                                                            f"{m(r)['tokens_per_expert']['mean']:.0f})"),
        ("balance loss first -> last (1 = even)", trend("aux_loss")),
        ("router z-loss first -> last", trend("z_loss")),
        ("dropped tokens (capacity)", lambda r: f"{m(r)['dropped']:,}"),
        ("EP all-to-all per step (share)", lambda r: f"{dur(m(r)['a2a_s'])} ({pct(m(r)['a2a_share'], 1)})"),
    ]


def _held_against_plans(r: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(which attempts and layout, step vs plan, memory) for each layout the run ran under, in order."""
    if not r.get("layouts"):
        return [(r["covers"], r["step_vs_plan"], r.get("memory") or {})]
    return [(f"{x['attempts']}: {x['layout']}", x["step_vs_plan"], x["memory"]) for x in r["layouts"]]


def _render_step_vs_plan(con: Console, runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for covers, v, _ in _held_against_plans(r):
            _step_vs_plan_table(con, r["label"], covers, v)


def _step_vs_plan_table(con: Console, run_name: str, covers: str, v: dict[str, Any]) -> None:
    name = escape(run_name)
    if v["measured"] is None:
        prose(con, f"[dim]no per-rank step times for {escape(covers)} in the run directory[/dim]",
              f"[dim]{name}: step vs plan:[/dim] ")
        return
    pred, meas = v["prediction"], v["measured"]
    t = Table(title=f"Step time, predicted vs measured ({name}, {covers}, mean over {meas['ranks']} ranks)",
              title_justify="left")
    for col in ("component", "predicted", "measured", "difference", "measured as"):
        t.add_column(col, justify="right" if col in ("predicted", "measured", "difference") else "left")
    outside = (pred or {}).get("outside_layers")
    for x in v["rows"]:
        diff = "-" if x["error_s"] is None else ("+" if x["error_s"] >= 0 else "-") + dur(abs(x["error_s"]))
        t.add_row(x["component"], dur(x["predicted_s"]), dur(x["measured_s"]), diff, x["measured_as"])
        if x["component"] == "compute" and outside:  # a part of compute the run does not time apart
            t.add_row("  of it outside the layers (ends + optimizer step)", dur(outside["total_s"]), "-", "-",
                      "predicted only (calibrate measured it)")
    step_diff = "-" if v["step_error"] is None else f"{v['step_error']:+.1%}"
    t.add_row("[bold]step[/bold]", dur(pred["step_time_s"]) if pred else "-", dur(meas["step_time_s"]), step_diff,
              "measured: step")
    if v["checkpoint_saves"]:
        t.add_row("checkpoint blocking (per save, outside the step)", "0 s", dur(v["checkpoint_block_s_per_save"]),
                  f"{v['checkpoint_saves']} save" + ("s" if v["checkpoint_saves"] != 1 else ""),
                  "measured: ckpt_block_s")
    con.print(t)
    if v["priced_with"]:
        prose(con, f"[dim]{escape(v['priced_with'])}[/dim]", f"  [dim]{name}: times priced with:[/dim] ")
    if v["no_prediction"]:
        prose(con, f"[dim]{escape(v['no_prediction'])}[/dim]", f"  [dim]{name}: no prediction:[/dim] ")
    if meas.get("note"):
        prose(con, f"[dim]{escape(meas['note'])}[/dim]", f"  [dim]{name}:[/dim] ")
    if v["largest_gap"]:
        prose(con, escape(v["largest_gap"]), f"  {name}: largest gap: ")


def _render_memory(con: Console, runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for covers, _, mem in _held_against_plans(r):
            name = escape(r["label"])
            if not mem.get("available"):
                prose(con, f"[dim]{escape(mem.get('note', 'not measured'))}[/dim]",
                      f"[dim]{name}: memory ({escape(covers)}):[/dim] ")
                continue
            t = Table(title=f"Memory per GPU, predicted vs measured ({escape(r['label'])}, {escape(covers)})",
                      title_justify="left")
            for col in ("pipeline rank", "component", "predicted", "measured", "error"):
                t.add_column(col, justify="left" if col == "component" else "right")
            for x in mem["rows"]:
                err = "-" if x["error"] is None else f"{x['error']:+.1%}"
                t.add_row(str(x["pp_rank"]), x["component"], size(x["predicted_bytes"]), size(x["measured_bytes"]),
                          err)
            con.print(t)
            if mem.get("largest_gap"):
                prose(con, escape(f"{covers}: {mem['largest_gap']}"), f"  {name}: ")


def _render_profile(con: Console, runs: list[dict[str, Any]]) -> None:
    """train.profile's files, one line each: what, rank, steps, path."""
    for r in runs:
        files = r.get("profile") or []
        if not files:
            continue
        con.print(f"[bold]Profiler traces[/bold] ({escape(r['label'])}: chrome://tracing or ui.perfetto.dev; memory "
                  "snapshots: pytorch.org/memory_viz)")
        for f in files:
            what = "trace" if f["kind"] == "trace" else "memory snapshot"
            steps = (f"step {f['first_step']}" if f["first_step"] == f["last_step"]
                     else f"steps {f['first_step']}-{f['last_step']}")
            con.print(f"  rank {f['rank']}, {steps}: {what} {escape(f['path'])} ({size(f['bytes'])})", soft_wrap=True)
