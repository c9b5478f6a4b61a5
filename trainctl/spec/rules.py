"""Consistency rules across spec sections.

Each rule yields one problem string: `<field> = <value>: <what is wrong>. Fix: <what to do>`.
Warnings (legal but probably unintended) are the planner's job, not these rules'.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from trainctl.data.files import megatron_prefix
from trainctl.hardware.catalog import ACCELERATORS, FABRICS
from trainctl.hardware.topology import aligned_groups_fit, nvlink_domain_size
from trainctl.spec import time_limit
from trainctl.spec.models import NCCL_VARIABLES, RunSpec
from trainctl.units import count

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_NAME_FIX = "use letters, digits and underscores, not starting with a digit (e.g. MY_SETTING)"
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$|^(infinite|UNLIMITED)$")


def problem(field: str, value: object, what: str, fix: str) -> str:
    return f"{field} = {value!r}: {what}. Fix: {fix}"


def _divisors(n: int, limit: int = 8) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in divs[:limit]) + (", ..." if len(divs) > limit else "")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


@dataclass(frozen=True)
class Unchecked:
    """A rule that could not judge `field` because another mistake leaves a value it needs undefined."""

    field: str
    why: str

    def line(self) -> str:
        return f"{self.field}: not checked: {self.why}"


@dataclass(frozen=True)
class Findings:
    """What the rules found: problems (one line each, field, value and fix) and the rules another mistake kept
    from judging (one line each, saying which)."""

    problems: list[str]
    not_checked: list[str]


Finding = str | Unchecked


def check(spec: RunSpec, tp_unsettled: bool = False) -> Findings:
    """Every independent problem at once. A rule that needs a value another mistake leaves undefined says it
    was not checked. An invalid tensor-parallel size (or one set aside as invalid: `tp_unsettled`) is one
    problem, not one per rule that uses tp: the other rules are judged with each tp the model allows, and a
    problem counts only when it stands with every one of them."""
    own = [] if tp_unsettled else list(_tp_fit(spec))
    if not own and not tp_unsettled:
        return _findings(list(_judged(spec)))
    choices = [t for t in range(1, spec.model.heads + 1) if not list(_tp_fit(_with_tp(spec, t)))]
    runs = {t: list(_judged(_with_tp(spec, t))) for t in choices}
    failed = {t: {field_of(f): f for f in found if isinstance(f, str)} for t, found in runs.items()}
    skipped = {t: {f.field: f for f in found if isinstance(f, Unchecked)} for t, found in runs.items()}
    # in the order the rules judge them (a field's earliest place in any tp's findings)
    place = {}
    for t in choices:
        for i, f in enumerate(failed[t]):
            place[f] = min(i, place.get(f, i))
    fields = sorted(place, key=place.__getitem__)
    # a problem whatever tp stands in (or where none let its rule judge): not tp's
    independent = [f for f in fields if all(f in failed[t] or f in skipped[t] for t in choices)]
    problems = [_with_every({t: failed[t][f] for t in choices if f in failed[t]}, choices) for f in independent]
    fit = [t for t in choices if not set(failed[t]) - set(independent)]
    if own:
        problems.insert(0, _tp_line(spec, own, choices, fit))
    never = [f for f in dict.fromkeys(f for t in choices for f in skipped[t]) if all(f in skipped[t] for t in choices)]
    return Findings(problems, [skipped[choices[0]][f].line() for f in never])


def _judged(spec: RunSpec) -> Iterator[Finding]:
    groups = (_name, _hardware, _model_vs_tp, _context_parallel, _layout, _offload, _moe, _grad_compression, _training,
              _stages, _data_and_launcher, _launcher_environment, _elastic)
    for group in groups:
        yield from group(spec)


def _findings(found: list[Finding]) -> Findings:
    return Findings([f for f in found if isinstance(f, str)], [f.line() for f in found if isinstance(f, Unchecked)])


def field_of(line: str) -> str:
    """The field a problem line names (`problem` starts every line with `field = value:`)."""
    return line.split(" = ", 1)[0]


def _with_tp(spec: RunSpec, tp: int) -> RunSpec:
    return spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"tp": tp})})


def _with_every(lines: dict[int, str], choices: list[int]) -> str:
    """One problem found with each tp the model allows that let its rule judge (`lines`, by tp): its line, and
    which tp it was judged with where that matters (the lines differ, or some tp left the rule unchecked)."""
    texts = list(lines.values())
    if len(set(texts)) == 1 and len(lines) == len(choices):
        return texts[0]
    judged = list(lines)
    if judged == choices:
        return f"{texts[0]} (judged with each tp the model allows: {_listed(choices)})"
    return (f"{texts[0]} (judged with tp {_listed(judged)}: of the tp values the model allows, {_listed(choices)}, "
            f"{'the only one' if len(judged) == 1 else 'those'} that let this rule judge)")


def _listed(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _tp_fit(spec: RunSpec) -> Iterator[tuple[str, str]]:
    """What rules tp's own fit to the model and the NVLink domain (what is wrong, the fix), judged alone."""
    m, p, c = spec.model, spec.parallel, spec.cluster
    if m.heads % p.tp:
        yield f"model.heads={m.heads} is not divisible by tp", f"use a tp that divides {m.heads}: {_divisors(m.heads)}"
    if m.kv_heads is not None and m.kv_heads % p.tp:
        yield (f"model.kv_heads={m.kv_heads} is not divisible by tp",
               f"use tp <= kv_heads that divides it: {_divisors(m.kv_heads)}")
    domain = nvlink_domain_size(c)
    if not p.allow_tp_across_nodes and not aligned_groups_fit(p.tp, c.world_size, domain):
        acc = ACCELERATORS.get(c.gpu)
        if acc is not None and acc.link == "pcie" and domain == 1:
            why = (f"{c.gpu} has no NVLink: TP's all-reduces, several per layer, would cross PCIe through the "
                   "host (or the inter-node fabric) and dominate the step")
        else:
            where = "a node" if domain == c.gpus_per_node else f"an NVLink domain of {domain} GPUs"
            why = (f"TP groups would not fit inside {where} ({c.gpu}); TP all-reduces every layer and across the "
                   "slower inter-node fabric it dominates the step")
        yield why, (f"use a tp that divides {domain} (e.g. {_largest_divisor_at_most(domain, p.tp)}) and add pp, "
                    "or set parallel.allow_tp_across_nodes: true if you really mean it")


def _tp_line(spec: RunSpec, own: list[tuple[str, str]], choices: list[int], fit: list[int]) -> str:
    """tp's one problem line: everything it does not fit, and the tp values that fit."""
    whats, fixes = zip(*own, strict=True)
    fix = fixes[0] if len(own) == 1 else f"use a tp that fits them all: {_listed(choices)}"
    if fit and fit != choices:
        fix += f" (of these, {_listed(fit)} also {'fits' if len(fit) == 1 else 'fit'} every other rule that uses tp)"
    return problem("parallel.tp", spec.parallel.tp, "; ".join(whats), fix)


def _stages(spec: RunSpec) -> Iterator[str]:
    """train.stages: each stage's tokens whole steps at its shape, the shape a valid layout (the layout rules run
    on the stage's spec; only what they find beyond the spec's own problems is said), the total the steps."""
    stages = spec.train.stages
    if not stages:
        return
    t = spec.train
    if t.tokens is not None:
        yield problem("train.tokens", t.tokens, "given beside train.stages, which set the run's tokens stage by stage",
                      "remove train.tokens (or train.stages)")
    total = sum(spec.stage_steps(st) for st in stages)
    if t.steps != total:
        yield problem("train.steps", t.steps, f"disagrees with train.stages, whose tokens make {total:,} steps",
                      "remove train.steps (it is derived from the stages) or fix the stages' tokens")
    names = [st.name for st in stages]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        yield problem("train.stages", ", ".join(twice), "stage names repeat", "give each stage its own name")
    own = set(_shape_lines(spec))
    for i, st in enumerate(stages):
        where = f"train.stages[{i}] ({st.name})"
        per_step = spec.stage_batch_tokens(st)
        if st.tokens % per_step:
            down, up = st.tokens // per_step * per_step, (st.tokens // per_step + 1) * per_step
            yield problem(f"{where}.tokens", st.tokens, f"not a multiple of the stage's {per_step:,} tokens per step "
                          "(its global_batch x seq_len)",
                          f"use {down:,} or {up:,} ({_apart(down, up)})" if down else f"use {up:,} (one step)")
        if st.nodes is not None and st.nodes > spec.cluster.nodes:
            yield problem(f"{where}.nodes", st.nodes, f"more than the cluster's {spec.cluster.nodes:,} nodes",
                          f"use at most {spec.cluster.nodes:,} (cluster.nodes), or raise cluster.nodes")
            continue
        shaped = spec.stage_spec(st)
        gpn = spec.cluster.gpus_per_node
        gpus = shaped.model_parallel * shaped.parallel.dp if shaped.parallel.dp != "auto" else 0
        needed = gpus // gpn if gpus and gpus % gpn == 0 and gpus // gpn <= spec.cluster.nodes else None
        nodes_fix = f"or give the stage nodes: {needed}" if needed else "or give the stage its own nodes"
        for line in _shape_lines(shaped):
            if line not in own:
                # a stage's world is its own: the fix is its dp or nodes, not the cluster's
                line = line.replace("set parallel.dp to", "set the stage's dp to").replace(
                    "or change cluster.nodes", nodes_fix)
                yield f"{where}: {line}"


def _shape_lines(spec: RunSpec) -> list[str]:
    """The problems of a spec's shape and layout (the rule groups a stage's batch, length and cp can break)."""
    return [line for group in (_model_vs_tp, _context_parallel, _layout, _moe) for line in group(spec)
            if isinstance(line, str)]


def _name(spec: RunSpec) -> Iterator[str]:
    # shown on terminals (status, runs, the Slurm queue): an escape sequence there would act, not print
    if any(not ch.isprintable() for ch in spec.name):
        yield problem("name", spec.name, "holds control characters, which a terminal would act on (an escape "
                      "sequence clears the screen)", "use printable characters")


def _hardware(spec: RunSpec) -> Iterator[str]:
    c = spec.cluster
    if c.gpu not in ACCELERATORS and (c.peak_tflops is None or c.memory_gb is None):
        yield problem("cluster.gpu", c.gpu, "not in the hardware catalog",
                      f"use one of {', '.join(sorted(ACCELERATORS))} (see `trainctl hardware`), or give "
                      "cluster.peak_tflops and cluster.memory_gb for a custom accelerator")
    acc = ACCELERATORS.get(c.gpu)
    if spec.train.precision == "fp8" and c.gpu != "cpu" and (acc is None or acc.peak_fp8_tflops is None):
        fp8_parts = ", ".join(k for k, a in sorted(ACCELERATORS.items()) if a.peak_fp8_tflops)
        yield problem("train.precision", "fp8", f"{c.gpu} has no FP8 tensor cores the trainer can use",
                      f"train in bf16 (or fp16 on a V100), or run fp8 on {fp8_parts}")
    if c.interconnect not in FABRICS and c.inter_node_gbps is None:
        yield problem("cluster.interconnect", c.interconnect, "not a known fabric",
                      f"use one of {', '.join(sorted(FABRICS))} or set cluster.inter_node_gbps")
    if c.time is not None and not _SLURM_TIME.match(c.time):
        yield problem("cluster.time", c.time, "not a Slurm time limit",
                      'write minutes ("90"), "HH:MM:SS" or "D-HH:MM:SS"')
    limit = time_limit.limit_s(c.time)
    grace = spec.launcher.grace_s
    if limit is not None and grace >= limit:
        yield problem("launcher.grace_s", grace, f"not shorter than cluster.time = {c.time!r} ({limit} s): Slurm's "
                      "stop warning would come as every attempt starts, and the job would stop before training",
                      f"lower launcher.grace_s well below {limit} (the time a checkpoint takes, e.g. "
                      f"{max(1, limit // 10)}) or raise cluster.time")


def _model_vs_tp(spec: RunSpec) -> Iterator[str]:
    """The model's shape against a tp that fits it (check() judges tp's own fit, _tp_fit, first)."""
    m, p = spec.model, spec.parallel
    if m.hidden % m.heads:
        yield problem("model.hidden", m.hidden, f"not divisible by model.heads={m.heads}",
                      "pick hidden = heads * head_dim")
    if m.kv_heads is not None and m.heads % m.kv_heads:
        yield problem("model.kv_heads", m.kv_heads, f"does not divide model.heads={m.heads}",
                      f"use a divisor of {m.heads}: {_divisors(m.heads)}")
    if m.ffn_hidden % p.tp:
        yield problem("model.ffn_hidden", m.ffn_hidden, f"the MLP is split over tp={p.tp} ranks but it does not "
                      "divide", f"use an ffn_hidden divisible by {p.tp}, e.g. {p.tp * -(-m.ffn_hidden // p.tp)}")
    if m.position == "rope" and m.hidden % m.heads == 0 and (m.hidden // m.heads) % 2:
        yield problem("model.hidden", m.hidden, "rotary embeddings need an even head_dim",
                      "choose hidden/heads even")
    if p.sequence_parallel and m.seq_len % (p.tp * p.cp):
        where = f"each CP rank's {m.seq_len}/cp tokens" if p.cp > 1 else "the sequence"
        yield problem("model.seq_len", m.seq_len,
                      f"sequence_parallel splits {where} over tp={p.tp} ranks but it does not divide",
                      f"use a seq_len divisible by {p.tp * p.cp}" + (f" (tp*cp = {p.tp}*{p.cp})" if p.cp > 1 else ""))


def _context_parallel(spec: RunSpec) -> Iterator[str]:
    """Context parallelism (runtime/parallel/context_parallel.py; docs/design/trainer.md, "Context parallelism")."""
    m, p = spec.model, spec.parallel
    if p.cp == 1:
        return
    chunks = 2 * p.cp
    if m.seq_len % chunks:
        lo = chunks * max(1, m.seq_len // chunks)
        yield problem("model.seq_len", m.seq_len,
                      f"context parallelism splits each sequence into 2*cp = {chunks} chunks (CP rank i holds "
                      f"chunks i and {chunks - 1}-i, so causal attention work is balanced) but it does not divide",
                      f"use a seq_len divisible by {chunks}, e.g. {lo} or {lo + chunks}, or a smaller parallel.cp")
    if m.dropout:
        yield problem("model.dropout", m.dropout,
                      f"context parallelism (cp={p.cp}) supports causal attention without dropout: each CP rank "
                      "holds other tokens, and the trainer draws no per-CP-rank dropout masks",
                      "set model.dropout: 0 (as Llama-style pretraining does), or parallel.cp: 1")
    if m.moe is not None:
        yield problem("parallel.cp", p.cp,
                      "context parallelism with a mixture-of-experts model is not supported yet (the MoE trainer "
                      "and CP are combined after both land)", "set parallel.cp: 1 for an MoE model")


def _layout(spec: RunSpec) -> Iterator[Finding]:
    """World size, then the batch (which needs dp), then the pipeline's shape (which needs neither)."""
    dp = yield from _world(spec)
    if dp is None:
        yield Unchecked("train.global_batch", "its divisibility by micro_batch*dp, and the micro-batches the "
                        "pipeline needs, wait for a data-parallel size that fits the GPUs (see parallel above)")
    else:
        yield from _batch(spec, dp)
    yield from _pipeline_shape(spec)


def _world(spec: RunSpec) -> Generator[Finding, None, int | None]:
    """The world-size rule; returns dp, or None where this mistake leaves it undefined."""
    p, c = spec.parallel, spec.cluster
    world = c.world_size
    model_parallel = spec.model_parallel
    # the product as the user wrote it: cp appears only when it is used
    names, values = ("tp*cp*pp", f"{p.tp}*{p.cp}*{p.pp}") if p.cp > 1 else ("tp*pp", f"{p.tp}*{p.pp}")
    if p.dp == "auto":
        if world % model_parallel:
            yield problem("parallel", f"tp={p.tp} {f'cp={p.cp} ' if p.cp > 1 else ''}pp={p.pp}",
                          f"{names} = {model_parallel} does not divide the {world:,} GPUs "
                          f"(cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node})",
                          f"choose {names} among the divisors of {world}: {_divisors(world)}")
            return None
    elif model_parallel * p.dp != world:
        yield problem("parallel.dp", p.dp,
                      f"{names}*dp = {values}*{p.dp} = {model_parallel * p.dp} but the cluster has "
                      f"{count(c.nodes, 'node')} x {c.gpus_per_node} GPUs = {world:,}",
                      f"set parallel.dp to {world // model_parallel if world % model_parallel == 0 else 'auto'}"
                      " or change cluster.nodes")
        return None
    return spec.dp


def _batch(spec: RunSpec, dp: int) -> Iterator[str]:
    """The global batch against dp: whole micro-batches, enough of them for the pipeline's schedule."""
    p, t = spec.parallel, spec.train
    per_step = p.micro_batch * dp
    if t.global_batch % per_step:
        lo = per_step * max(1, t.global_batch // per_step)
        yield problem("train.global_batch", t.global_batch,
                      f"not divisible by micro_batch*dp = {p.micro_batch}*{dp} = {per_step}",
                      f"use a multiple of {per_step}, e.g. {lo} or {lo + per_step}")
        return  # micro-batch counts below would be meaningless
    micro_batches = t.global_batch // per_step
    if p.pp > 1 and micro_batches < p.pp:
        yield problem("train.global_batch", t.global_batch,
                      f"gives {micro_batches} micro-batches per replica but pipeline needs at least pp={p.pp}",
                      f"raise global_batch to >= {p.pp * per_step} or lower parallel.micro_batch")
    # torch's interleaved schedules run rounds of pp micro-batches; ZBV has no such rounds (it pads its
    # own order to 2*pp-1 micro-batches and drops the padding)
    if p.schedule in ("interleaved", "zero-bubble") and p.pp > 1 and micro_batches % p.pp:
        yield problem("parallel.schedule", p.schedule,
                      f"the {p.schedule} schedule needs micro-batches ({micro_batches}) divisible by pp={p.pp}",
                      f"choose global_batch so global_batch/(micro_batch*dp) is a multiple of {p.pp}")


def _pipeline_shape(spec: RunSpec) -> Iterator[str]:  # noqa: C901 - schedule, stages and layers, in that order
    m, p = spec.model, spec.parallel
    stages = p.pp * p.virtual_stages
    if p.schedule == "interleaved" and p.virtual_stages < 2:
        yield problem("parallel.virtual_stages", p.virtual_stages,
                      "the interleaved schedule needs at least 2 model chunks per pipeline rank",
                      "set virtual_stages >= 2, or schedule: 1f1b")
    if p.schedule in ("interleaved", "zero-bubble", "zbv"):
        if p.pp < 2:
            yield problem("parallel.schedule", p.schedule, f"the {p.schedule} schedule needs pipeline parallelism",
                          "set parallel.pp >= 2 or schedule: 1f1b")
    elif p.virtual_stages > 1:
        yield problem("parallel.virtual_stages", p.virtual_stages,
                      f"virtual stages only apply to the interleaved, zero-bubble and zbv schedules (got "
                      f"{p.schedule})", "set schedule: interleaved or virtual_stages: 1")
    if p.schedule == "zbv" and p.virtual_stages != 2:
        # torch's ScheduleZBVZeroBubble: exactly two stages per rank, the V (rank r: stages r and 2*pp-1-r)
        yield problem("parallel.virtual_stages", p.virtual_stages,
                      "the zbv schedule places exactly 2 stages on each pipeline rank (a V)",
                      "set virtual_stages: 2 or leave it out (zbv's default)")
        return  # the stage count below would be this mistake's echo
    if p.stage_layers is not None:
        if len(p.stage_layers) != stages:
            yield problem("parallel.stage_layers", p.stage_layers,
                          f"has {len(p.stage_layers)} entries but there are pp*virtual_stages = {stages} stages",
                          f"give exactly {stages} layer counts")
        elif sum(p.stage_layers) != m.layers:
            yield problem("parallel.stage_layers", p.stage_layers,
                          f"sums to {sum(p.stage_layers)} but model.layers = {m.layers}",
                          "make the counts add up to model.layers")
        elif any(n == 0 for n in p.stage_layers[1:-1]):
            yield problem("parallel.stage_layers", p.stage_layers, "an inner stage has no layers",
                          "only the first and last stages (embedding, LM head) may hold 0 layers")
    elif m.layers < stages:
        yield problem("model.layers", m.layers, f"fewer layers than pipeline stages ({stages})",
                      "lower parallel.pp, or use schedule: 1f1b (zbv runs 2 stages per rank)" if p.schedule == "zbv"
                      else "lower parallel.pp or virtual_stages")


def _offload(spec: RunSpec) -> Iterator[str]:
    p = spec.parallel
    if p.offload == "optimizer" and p.zero == 0:
        # ZeRO-0 keeps fp32 weights that are their own master: there is no separate optimizer state to move
        yield problem("parallel.offload", p.offload, "optimizer offload needs a sharded optimizer",
                      "set parallel.zero 1, 2 or 3")


def _moe(spec: RunSpec) -> Iterator[str]:  # noqa: C901 - a flat list of independent MoE rules
    m, p = spec.model, spec.parallel
    moe = m.moe
    if moe is None:
        if p.ep > 1:
            yield problem("parallel.ep", p.ep, "expert parallelism needs a mixture-of-experts model (model.moe is "
                          "absent: the model is dense)", "set parallel.ep: 1, or describe the experts in model.moe")
        return
    E = moe.num_experts
    if E < 1:
        yield problem("model.moe.num_experts", E, "an MoE block without experts",
                      "set model.moe.num_experts >= 1 (Mixtral 8, OLMoE 64), or remove model.moe for a dense model")
        return  # top_k and ep against 0 experts would only repeat this
    if not 1 <= moe.top_k <= E:
        yield problem("model.moe.top_k", moe.top_k, f"each token must go to between 1 and num_experts = {E} experts",
                      f"use 1 <= top_k <= {E} (Mixtral 2 of 8, OLMoE 8 of 64)")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        yield problem("model.moe.capacity_factor", moe.capacity_factor, "an expert's capacity must be positive",
                      "use a factor > 0 (1.0-1.25 is usual), or null for dropless routing")
    if E % p.ep:
        yield problem("parallel.ep", p.ep, f"does not divide model.moe.num_experts = {E}: each EP rank holds "
                      "num_experts/ep whole experts", f"use an ep that divides {E}: {_divisors(E)}")
    if not any(moe.is_moe_layer(i) for i in range(m.layers)):
        yield problem("model.moe.first_dense", moe.first_dense, f"with every = {moe.every} no layer of the "
                      f"{m.layers} is an MoE layer", f"use first_dense < {m.layers}, or remove model.moe")
    for field, size in (("expert_ffn_hidden", moe.expert_ffn_hidden), ("shared_ffn_hidden", moe.shared_ffn_hidden)):
        shared_own = moe.shared_experts and moe.shared_ffn_hidden != moe.expert_ffn_hidden  # else said once
        if size and size % p.tp and (field == "expert_ffn_hidden" or shared_own):
            yield problem(f"model.moe.{field}", size, f"experts are split over tp={p.tp} ranks (expert TP = tp) "
                          "but it does not divide", f"use a size divisible by {p.tp}, e.g. {p.tp * -(-size // p.tp)}")
    world = spec.cluster.world_size
    if p.ep > 1 and (p.dp != "auto" or world % spec.model_parallel == 0):  # else dp is undefined (_layout says so)
        dp = spec.dp
        if dp % p.ep:
            yield problem("parallel.ep", p.ep, f"expert parallelism is carved from the data-parallel group, and "
                          f"ep does not divide dp = {dp}", f"use an ep that divides both {dp} and {E}: "
                          f"{', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0 and E % d == 0)}")


def _grad_compression(spec: RunSpec) -> Iterator[str]:
    """parallel.grad_compression.powersgd (runtime/parallel/powersgd.py): it replaces the once-per-step all-reduce of
    plain DP and ZeRO-1; ZeRO-2/3 reduce-scatter every micro-batch, which a low-rank all-reduce cannot replace."""
    p = spec.parallel
    ps = p.powersgd
    if ps is None:
        return
    field = "parallel.grad_compression.powersgd"
    if ps.rank < 1:
        yield problem(f"{field}.rank", ps.rank, "an approximation needs rank >= 1",
                      "use rank >= 1 (1-4 is usual; higher is closer to the uncompressed gradient)")
    if ps.start_step < 1:
        yield problem(f"{field}.start_step", ps.start_step, "steps count from 1",
                      "use start_step >= 1 (1 compresses from the first step; later gives an uncompressed warm-up)")
    if p.zero >= 2:
        yield problem("parallel.zero", p.zero, "PowerSGD compresses the plain-DP and ZeRO-1 all-reduce",
                      "use parallel.zero 0 or 1, or grad_reduce_dtype: bf16 for ZeRO-2/3")
    if p.grad_reduce_dtype == "bf16":
        yield problem("parallel.grad_reduce_dtype", p.grad_reduce_dtype, "PowerSGD reduces its low-rank factors "
                      "in fp32 (bf16 would round their orthogonalisation) and the rest of the gradients with them",
                      "set grad_reduce_dtype: fp32 with grad_compression, or remove grad_compression")


def _apart(a: int, b: int) -> str:
    """`a or b` in the fewest significant digits that tell them apart: 1.5e+13 or 1.500000004e+13."""
    digits = next((d for d in range(4, 18) if f"{a:.{d}g}" != f"{b:.{d}g}"), 18)
    return f"{a:.{digits}g} or {b:.{digits}g}"


def _training(spec: RunSpec) -> Iterator[str]:
    t = spec.train
    implied = spec.steps_for_tokens
    if implied is not None and t.tokens % spec.batch_tokens:
        down, up = implied * spec.batch_tokens, (implied + 1) * spec.batch_tokens
        yield problem("train.tokens", t.tokens, f"not a multiple of the {spec.batch_tokens:,} tokens of one step "
                      f"(train.global_batch x model.seq_len)", f"use {down:,} or {up:,} ({_apart(down, up)})")
    elif implied is not None and t.steps != implied:
        yield problem("train.steps", t.steps, f"disagrees with train.tokens = {t.tokens:,}, which is {implied:,} "
                      f"steps of {spec.batch_tokens:,} tokens", "give one of them: --set train.tokens=N or "
                      "train.steps=N replaces the other")
    if t.warmup > t.steps:
        yield problem("train.warmup", t.warmup, f"longer than train.steps = {t.steps}",
                      "use warmup <= steps")
    if t.min_lr is not None and t.min_lr > t.lr:
        yield problem("train.min_lr", t.min_lr, f"above train.lr = {t.lr}", "use min_lr <= lr")
    yield from _divergence(spec)
    yield from _profile(spec)


def _profile(spec: RunSpec) -> Iterator[str]:
    """train.profile (runtime/observe/profiling.py): a window of steps the run has, on ranks the job has."""
    prof, steps, world = spec.train.profile, spec.train.steps, spec.world_size
    if prof is None:
        return
    if not 1 <= prof.start_step <= steps:
        yield problem("train.profile.start_step", prof.start_step, f"not a step of the run (1..train.steps = {steps})",
                      f"pick a step from 1 to {steps}, e.g. {min(steps, 3)} (after the first steps' warm-up)")
    elif prof.steps < 1:
        yield problem("train.profile.steps", prof.steps, "a trace needs at least one step", "use 1 or more")
    elif prof.last_step > steps:
        yield problem("train.profile.steps", prof.steps, f"the window {prof.start_step}..{prof.last_step} runs past "
                      f"train.steps = {steps}", f"use steps <= {steps - prof.start_step + 1}, or an earlier start_step")
    if not prof.ranks:
        yield problem("train.profile.ranks", [], "no rank would write a trace",
                      "list the global ranks to profile, e.g. [0] (the default), or drop train.profile")
    bad = [r for r in prof.ranks if not 0 <= r < world]
    if bad:
        yield problem("train.profile.ranks", bad, f"not ranks of this job (world size {world}: ranks 0..{world - 1})",
                      f"use global ranks from 0 to {world - 1} (`trainctl plan --ranks` shows where each runs)")
    if len(set(prof.ranks)) != len(prof.ranks):
        yield problem("train.profile.ranks", prof.ranks, "a rank is listed twice", "list each rank once")


def _divergence(spec: RunSpec) -> Iterator[str]:
    d = spec.train.divergence
    if d.max_consecutive_skips < 1:
        yield problem("train.divergence.max_consecutive_skips", d.max_consecutive_skips,
                      "the guard stops (or rolls back) after this many non-finite steps in a row; it must be at "
                      "least 1", "use 1 or more (default 5); 1 stops at the first NaN/inf loss or gradient norm")
    if d.max_rollbacks < 0:
        yield problem("train.divergence.max_rollbacks", d.max_rollbacks, "a count of rollbacks cannot be negative",
                      "use 0 or more (default 2), or train.divergence.rollback: false to stop instead")
    elif d.rollback and d.max_rollbacks == 0:
        yield problem("train.divergence.max_rollbacks", 0, "train.divergence.rollback is true but no rollback is "
                      "allowed", "set max_rollbacks >= 1 (default 2), or rollback: false to stop at divergence")
    if d.rollback and spec.checkpoint.every_steps is None and spec.checkpoint.every_minutes is None:
        yield problem("train.divergence.rollback", True, "a rollback reloads the last checkpoint, but the run "
                      "saves none", "set checkpoint.every_steps (PaLM restarted about 100 steps before a spike), "
                      "or rollback: false")


def _data_and_launcher(spec: RunSpec) -> Iterator[str]:
    m, c = spec.model, spec.cluster
    # Token ids run 0..vocab-1; uint16 holds up to 65535, so a larger vocabulary would wrap silently.
    for i, src in enumerate(spec.data.sources()):
        field = "data.dtype" if spec.data.path else f"data.blend[{i}].dtype"
        megatron = src.format == "megatron" or (src.format == "auto" and megatron_prefix(src.path) is not None)
        if not megatron and src.dtype == "uint16" and m.vocab > 65536:  # a Megatron index names its own dtype
            yield problem(field, "uint16", f"cannot hold token ids of model.vocab = {m.vocab} (max 65535)",
                          f"set {field}: uint32 (and write the token file as uint32)")
    if spec.launcher.mode == "srun" and spec.backend != "slurm":
        yield problem("launcher.mode", "srun", "srun needs the Slurm backend",
                      "set launcher.backend: slurm or launcher.mode: torchrun")
    if spec.launcher.backend == "local" and c.nodes > 1:
        yield problem("cluster.nodes", c.nodes, "the local backend runs on this one machine",
                      "set cluster.nodes: 1 or launcher.backend: slurm")
    # every backend writes these names into a shell script (launch.sh, the batch script): only a name a shell
    # can export is one, so nothing of a name runs as code
    for name in spec.launcher.env:
        if not _ENV_NAME.fullmatch(name):
            yield problem("launcher.env", name, "not an environment variable name", _ENV_NAME_FIX)
    for name in spec.launcher.env_passthrough:
        if not _ENV_NAME.fullmatch(name):
            yield problem("launcher.env_passthrough", name, "not an environment variable name", _ENV_NAME_FIX)
        elif name in spec.launcher.env:
            yield problem("launcher.env_passthrough", name, "also set in launcher.env",
                          f"keep one: launcher.env.{name} sets a value, env_passthrough takes it from your "
                          "environment")



def _launcher_environment(spec: RunSpec) -> Iterator[str]:
    """launcher.python, launcher.container and launcher.nccl (docs/design/launch.md, "Containers and environment")."""
    lz = spec.launcher
    if lz.python is not None and not lz.python.strip():
        yield problem("launcher.python", lz.python, "an empty interpreter",
                      "give the path or name of the python that starts the trainer, or leave launcher.python out")
    for field, variable in NCCL_VARIABLES.items():
        value = getattr(lz.nccl, field)
        if value is None:
            continue
        if variable in lz.env:
            yield problem(f"launcher.env.{variable}", lz.env[variable], f"also set by launcher.nccl.{field} = "
                          f"{value!r}", f"keep one: drop launcher.env.{variable}, or launcher.nccl.{field}")
        if variable in lz.env_passthrough:
            yield problem("launcher.env_passthrough", variable, f"also set by launcher.nccl.{field} = {value!r}",
                          f"keep one: drop {variable} from env_passthrough, or launcher.nccl.{field}")
    c = lz.container
    if c is None:
        return
    if spec.backend != "slurm":
        yield problem("launcher.container", c.image, "containers run through Slurm's pyxis plugin (srun "
                      "--container-image); the local backend runs the trainer on this machine as it is",
                      "set launcher.backend: slurm, or remove launcher.container for a local run")
    for i, mount in enumerate(c.mounts):
        parts = mount.split(":")
        if "," in mount or not 1 <= len(parts) <= 3 or not all(parts):
            yield problem(f"launcher.container.mounts[{i}]", mount, "not one SRC[:DST[:FLAGS]] mount",
                          "give one mount per item, e.g. /lustre:/lustre or /data:/data:ro (flags joined with +)")
        elif not all(p.startswith("/") for p in parts[:2]):
            yield problem(f"launcher.container.mounts[{i}]", mount, "a relative path: the job's working directory "
                          "is not yours", "give absolute paths, e.g. /scratch/me:/scratch/me")
    if c.workdir is not None and not c.workdir.startswith("/"):
        yield problem("launcher.container.workdir", c.workdir, "a relative path inside the container",
                      "give an absolute path, e.g. /workspace")


def _elastic(spec: RunSpec) -> Iterator[str]:
    """cluster.min_nodes (docs/design/launch.md, "Elastic node ranges"); which node counts the layout can
    shrink to is the planner's (plan/elastic.py), checked again by the trainer on the world it finds."""
    c, lz = spec.cluster, spec.launcher
    if c.min_nodes is None:
        return
    if not 1 <= c.min_nodes <= c.nodes:
        what = "fewer than one node" if c.min_nodes < 1 else f"more than cluster.nodes = {c.nodes}"
        yield problem("cluster.min_nodes", c.min_nodes, what,
                      f"give 1..{c.nodes} (the fewest nodes the run may continue on), or leave it out")
        return
    if not c.elastic:
        return
    if lz.mode != "torchrun":
        yield problem("cluster.min_nodes", c.min_nodes, f"an elastic run (below cluster.nodes = {c.nodes}) needs "
                      "torchrun's rendezvous, not launcher.mode srun", "set launcher.mode: torchrun")
    if lz.max_restarts < 1:
        yield problem("cluster.min_nodes", c.min_nodes, "torchrun restarts the workers on the nodes left only "
                      "with launcher.max_restarts > 0 (a lost node is a failed worker group)",
                      "set launcher.max_restarts: 3 (each lost node uses one)")
