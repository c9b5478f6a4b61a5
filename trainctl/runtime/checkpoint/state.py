"""What a checkpoint holds, keyed so that it loads into another DP size, ZeRO stage or pipeline split.

Layout of the DCP part (`app_state`), every key independent of dp, pp, zero and the bucket layout:

    model.<name>[@tp<r>of<t>]          the fp32 weights in the parameter's (TP-local) shape: the parameter,
                                       replicated over DP so DCP keeps one copy (ZeRO-0); FSDP2's DTensor
                                       (ZeRO-3); under ZeRO-1/2 the fp32 master, a ShardedTensor whose chunks
                                       are the rectangles that this DP rank's [lo, hi) of the flattened
                                       parameter covers (the parameters may be bf16: the master is the truth)
    optim.<name>[@tp..].exp_avg        AdamW moments, always FLATTENED to 1-D (numel of the TP-local
    optim.<name>[@tp..].exp_avg_sq     parameter): plain tensors under ZeRO-0, ShardedTensors whose chunks
                                       are this DP rank's [lo, hi) range under ZeRO-1/2 (a slice of a flat
                                       bucket) and ZeRO-3 (FSDP2's row shard); DCP reshards chunk to chunk
    extra                              step, AdamW step count, loader position (global sequence slots),
                                       loss-scaler state: small Python values, identical on every rank

`@tp<r>of<t>` marks TP-sharded parameters (TP-replicated ones have no suffix). A TP shard is not a plain
slice (fused QKV and gate-up are split per part, the vocab is padded to a multiple of tp), so a resume
with another tp loads every old TP shard of this rank's parameters and moments, rebuilds the full
tensor with the model's own ShardSpec and takes this rank's new shard: `app_state(from_tp=...)` leaves the
TP-sharded entries out, then `tp_reshard_batches` groups them so that each batch's old shards (weights
and moments, read whole) stay under a byte budget, and each batch is loaded (`old_shards_state`) and moved
into place (`apply_old_shards`) before the next is read. Host memory for the reshard is one batch per rank.
Per-rank state (RNG streams) goes beside DCP as rank_state (DCP would dedup it).

Under ZeRO-1/2 the model's weights are saved from, and loaded into, the fp32 master slices; the parameters
are then written from them (`GradSync.after_step`), so a bf16 ZeRO-1 checkpoint resumed at ZeRO-0 loses
nothing (its parameters are fp32 again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from trainctl.runtime.checkpoint.storage import rng_state
from trainctl.runtime.model.moe import is_expert_param
from trainctl.runtime.parallel import data_parallel
from trainctl.runtime.parallel.expert_sync import ExpertSplitSync
from trainctl.runtime.parallel.process_groups import Parallel
from trainctl.runtime.parallel.tensor_parallel import ParamMeta, shard_tensor, unshard_tensors
from trainctl.runtime.train.loader import BatchLoader

MOMENTS = ("exp_avg", "exp_avg_sq")


class ScalerState(Protocol):
    """The loss scaler's state (trainer.LossScaler): saved in `extra`, set back on restore."""

    scale: float
    good: int


@dataclass(frozen=True)
class TrainState:
    """The parts of a trainer that a checkpoint saves and restores, handed over by the trainer so that no
    checkpoint code sees (or writes into) the Trainer. Restoring fills these objects in place.

    The LR schedule is a function of the step (runtime/train/optim.lr_at), so the saved step restores it; the RNG
    streams are this process's own (rank_state)."""

    par: Parallel  # this rank's coordinates: checkpoint keys and ZeRO/FSDP ranges follow from them
    modules: list[nn.Module]  # this rank's model stages
    opt: torch.optim.Optimizer
    sync: data_parallel.GradSync | data_parallel.FsdpSync | ExpertSplitSync  # ZeRO buckets, fp32 master slices
    loader: BatchLoader  # the data position
    scaler: ScalerState


@dataclass
class Entry:
    """One parameter of this rank under its checkpoint key, with its optimizer tensor(s) and 1-D range."""

    key: str
    name: str  # global parameter name (the key without its TP suffix)
    meta: ParamMeta | None  # how the parameter is TP-sharded; None: not known, treated as replicated
    param: Tensor  # the model parameter (plain or DTensor)
    opt_param: Tensor  # what AdamW steps: the parameter, or its fp32 master fragment (ZeRO-1/2)
    master: Tensor | None  # ZeRO-1/2: this rank's fp32 master fragment, [lo, hi) of the parameter (maybe empty)
    numel: int  # full (TP-local) numel of the parameter: the length of the flattened state
    lo: int  # this rank's range of the flattened state
    hi: int
    chunks: list[tuple[int, int, int]]  # every DP peer's (lo, hi, global rank); [] when not sharded


def param_key(name: str, meta: Any, tp_rank: int, tp: int) -> str:
    if tp > 1 and meta is not None and meta.shard is not None:
        return f"{name}@tp{tp_rank}of{tp}"
    return name


def parse_param_key(key: str) -> tuple[str, int, int]:
    """(parameter name, TP rank, tp) of a key param_key wrote; (name, 0, 1) for a TP-replicated one."""
    name, _, suffix = key.partition("@tp")
    if not suffix:
        return name, 0, 1
    r, t = suffix.split("of")
    return name, int(r), int(t)


def _syncs(sync: Any) -> list[Any]:
    """The gradient syncs behind the trainer's (two under expert parallelism: runtime/parallel/expert_sync.py), each
    with its own data-parallel group in its `par`."""
    return sync.parts() if isinstance(sync, ExpertSplitSync) else [sync]


def _dp_group_of(par: Parallel, name: str) -> tuple[list[int], int]:
    """(global ranks of the group that replicates parameter `name`, this rank's index in it): the expert-DP
    group for a routed expert under expert parallelism, else the DP group."""
    if par.ep > 1 and is_expert_param(name):
        return par.ranks["expert_dp"], par.edp_rank
    return par.dp_ranks, par.dp_rank  # data x context parallel


def _zero_entries(sync: data_parallel.GradSync, names: dict[int, tuple[str, str, ParamMeta | None]],
                  seen: set[str], copies: list[Entry]) -> list[Entry]:
    """The parameters of a ZeRO-1/2 GradSync, with the flat range of each bucket its DP rank owns (a second
    parameter under a key already seen goes to `copies`)."""
    par = sync.par
    out = []
    for b in sync.buckets:
        a, e = b.shard
        per = b.numel // par.dp
        for info, off in zip(b.params, b.offsets, strict=True):
            key, name, meta = names[id(info.param)]
            dest = copies if key in seen else out
            seen.add(key)
            n = info.param.numel()
            lo, hi = max(off, a) - off, min(off + n, e) - off
            lo, hi = (lo, hi) if lo < hi else (0, 0)  # this rank owns none of it
            master = next((m for i, m, _g in b.fragments if i is info), None)
            chunks = []
            for r, grank in enumerate(par.dp_ranks):
                c_lo, c_hi = max(off, r * per) - off, min(off + n, (r + 1) * per) - off
                if c_lo < c_hi:
                    chunks.append((c_lo, c_hi, grank))
            assert b.master is not None
            dest.append(Entry(key, name, meta, info.param, master if master is not None else info.param,
                              master if master is not None else b.master[:0], n, lo, hi, chunks))
    return out


def entries(ts: TrainState) -> list[Entry]:
    """Every parameter this rank holds, once per key (a tied copy on the last stage shares its key)."""
    return _entries(ts)[0]


def _entries(ts: TrainState) -> tuple[list[Entry], list[Entry]]:
    """(entries, copies): the copies are second parameters under a key this rank already holds, the LM head's
    tied embedding on a rank that also holds the first stage (ZBV's V placement). They are not saved (their
    values equal the first copy's) and are set from it after a load (`restore`)."""
    par = ts.par
    names: dict[int, tuple[str, str, ParamMeta | None]] = {}  # id(param) -> (key, name, meta)
    out: list[Entry] = []
    copies: list[Entry] = []
    seen: set[str] = set()
    for m in ts.modules:
        meta = m.named_param_meta()
        for name, q in m.named_parameters():
            names[id(q)] = (param_key(name, meta.get(name), par.tp_rank, par.tp), name, meta.get(name))
    in_buckets: set[int] = set()
    for sync in _syncs(ts.sync):
        if isinstance(sync, data_parallel.GradSync) and sync.zero >= 1:
            out += _zero_entries(sync, names, seen, copies)
            in_buckets |= {id(i.param) for i in sync.infos}
    fsdp = isinstance(ts.sync, data_parallel.FsdpSync)
    for m in ts.modules:
        for _name, q in m.named_parameters():
            key, name, meta = names[id(q)]
            if id(q) in in_buckets:
                continue
            dest = copies if key in seen else out
            seen.add(key)
            if fsdp:
                dp_ranks, dp_rank = _dp_group_of(par, name)
                rows = q.shape[0]
                cols = q.numel() // rows if rows else 0
                size = -(-rows // len(dp_ranks))  # torch.chunk / DTensor Shard(0) split of the rows
                chunks = []
                for r, grank in enumerate(dp_ranks):
                    r0, r1 = min(r * size, rows), min((r + 1) * size, rows)
                    if r0 < r1:
                        chunks.append((r0 * cols, r1 * cols, grank))
                mine = min(dp_rank * size, rows) * cols, min((dp_rank + 1) * size, rows) * cols
                local = q.to_local()
                if local.numel() != mine[1] - mine[0]:
                    raise RuntimeError(f"{key}: FSDP shard has {local.numel()} elements, expected {mine}")
                dest.append(Entry(key, name, meta, q, q, None, q.numel(), mine[0], mine[1], chunks))
            else:
                dest.append(Entry(key, name, meta, q, q, None, q.numel(), 0, q.numel(), []))
    return out, copies


def _flat_local(t: Tensor) -> Tensor:
    """1-D view of this rank's part of an optimizer tensor (a DTensor's local shard under FSDP2)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.view(-1)


def _sharded(local: Tensor, e: Entry, shape: tuple[int, ...] | None = None) -> Tensor:
    """`local` (this rank's [lo, hi) of a flattened state of e.numel elements) as a DCP-reshardable
    ShardedTensor: 1-D, or in `shape` (1-D or 2-D) as the rectangles that each rank's range covers."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shape = shape or (e.numel,)
    dev = str(local.device)  # checked against the local shard only (peers may use another index)
    mds = [ShardMetadata(off, size, f"rank:{r}/{dev}") for lo, hi, r in e.chunks
           for off, size, _, _ in _rectangles(lo, hi, shape)]
    meta = ShardedTensorMetadata(mds, torch.Size(shape), TensorProperties(dtype=local.dtype))
    rank = torch.distributed.get_rank()
    shards = [Shard(local[a - e.lo:b - e.lo].view(size), ShardMetadata(off, size, f"rank:{rank}/{dev}"))
              for off, size, a, b in _rectangles(e.lo, e.hi, shape)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def _rectangles(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[list[int], list[int], int, int]]:
    """[lo, hi) of the row-major flattening of a 1-D or 2-D `shape` as (offsets, sizes, flat lo, flat hi) of
    at most three rectangles: the rest of a first partial row, whole rows, the start of a last row."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [([lo], [hi - lo], lo, hi)]
    if len(shape) != 2:
        raise ValueError(f"ZeRO checkpoint chunks of a {len(shape)}-D parameter are not supported")
    cols = shape[1]
    out = []
    r0, c0 = divmod(lo, cols)
    if c0 and lo + (cols - c0) > hi:  # inside one row
        return [([r0, c0], [1, hi - lo], lo, hi)]
    if c0:
        out.append(([r0, c0], [1, cols - c0], lo, lo + cols - c0))
        lo, r0 = lo + cols - c0, r0 + 1
    r1 = hi // cols
    if r1 > r0:
        out.append(([r0, 0], [r1 - r0, cols], lo, r1 * cols))
    if hi > r1 * cols:
        out.append(([r1, 0], [1, hi - r1 * cols], r1 * cols, hi))
    return out


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's lazily-made state (as its first step would) so a checkpoint can be loaded into it."""
    from torch.optim.optimizer import _get_scalar_dtype

    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                # the fused kernel (runtime/train/optim.py adamw) wants the step on the parameter's device
                step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)
                opt.state[p] = {"step": step,
                                **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS}}


def optimizer_step_count(opt: torch.optim.Optimizer) -> float:
    for st in opt.state.values():
        if "step" in st:
            return float(st["step"])
    return 0.0


def _tp_sharded(e: Entry) -> bool:
    return e.meta is not None and e.meta.shard is not None


def _old_tp_keys(e: Entry, old_tp: int) -> list[str]:
    return [param_key(e.name, e.meta, r, old_tp) for r in range(old_tp)]


def app_state(ts: TrainState, step: int, from_tp: int | None = None) -> dict[str, Any]:
    """The DCP state of this rank (views of the live tensors: dcp.load writes into them in place).

    `from_tp`: a checkpoint written with another tp; its TP-sharded entries are left out (see the module
    docstring: they are loaded and resharded in batches)."""
    model: dict[str, Tensor] = {}
    optim: dict[str, Tensor] = {}
    retp = from_tp is not None and from_tp != ts.par.tp
    for e in entries(ts):
        if retp and _tp_sharded(e):
            continue
        if e.master is not None:
            # a rank that owns none of it leaves the key out, as for the moments (DCP drops a ShardedTensor
            # without local shards, and a dropped key that the checkpoint has sends its loader down the
            # pre-2.4 key format path)
            if e.hi > e.lo:
                model[e.key] = _sharded(e.master, e, tuple(e.param.shape))
        else:
            model[e.key] = e.param.detach() if not hasattr(e.param, "to_local") else e.param
        st = ts.opt.state.get(e.opt_param, {})
        for k in _moments(ts, e):
            local = _flat_local(st[k])
            optim[f"{e.key}.{k}"] = _sharded(local, e) if e.chunks else local
    sc = ts.scaler
    extra = {"step": step, "optimizer_step": optimizer_step_count(ts.opt), "loader": ts.loader.state_dict(),
             "scaler": {"scale": sc.scale, "good": sc.good}}
    return {"model": model, "optim": optim, "extra": extra}


def _moments(ts: TrainState, e: Entry) -> list[str]:
    st = ts.opt.state.get(e.opt_param, {})
    return [k for k in MOMENTS if k in st]


def _old_shape(e: Entry, old_tp: int) -> tuple[int, ...]:
    assert e.meta is not None and e.meta.shard is not None
    return e.meta.shard.for_tp(old_tp).local_shape(e.meta.full_shape, old_tp)


def _saved_like(e: Entry) -> Tensor:
    """A tensor of the dtype and device the checkpoint holds `e` in: the fp32 master, or the parameter."""
    return e.master if e.master is not None else _flat_local(e.param)


def _old_shards_bytes(ts: TrainState, e: Entry, old_tp: int) -> int:
    """Bytes of every old TP shard of `e`, weights and moments: what reading it whole allocates."""
    numel = math.prod(_old_shape(e, old_tp)) * old_tp
    return numel * _saved_like(e).element_size() * (1 + len(_moments(ts, e)))


def tp_reshard_batches(ts: TrainState, old_tp: int, budget_bytes: int) -> list[list[Entry]]:
    """This rank's TP-sharded entries in batches of at most `budget_bytes` of old shards (an entry larger
    than the budget is a batch by itself)."""
    batches: list[list[Entry]] = []
    size = 0
    for e in entries(ts):
        if not _tp_sharded(e):
            continue
        b = _old_shards_bytes(ts, e, old_tp)
        if not batches or size + b > budget_bytes:
            batches.append([])
            size = 0
        batches[-1].append(e)
        size += b
    return batches


def batch_bytes(ts: TrainState, batch: list[Entry], old_tp: int) -> int:
    return sum(_old_shards_bytes(ts, e, old_tp) for e in batch)


def old_shards_state(ts: TrainState, batch: list[Entry], old_tp: int) -> dict[str, Any]:
    """Fresh buffers, under the old keys, for every old TP shard of the entries in `batch` (full, not
    DP-chunked: DCP assembles them)."""
    model: dict[str, Tensor] = {}
    optim: dict[str, Tensor] = {}
    for e in batch:
        like, shape = _saved_like(e), _old_shape(e, old_tp)
        for key in _old_tp_keys(e, old_tp):
            model[key] = like.new_empty(shape)
            for k in _moments(ts, e):
                optim[f"{key}.{k}"] = like.new_empty(math.prod(shape))
    return {"model": model, "optim": optim}


@torch.no_grad()
def apply_old_shards(ts: TrainState, batch: list[Entry], state: dict[str, Any], old_tp: int) -> None:
    """Move the old shards loaded into `state` (old_shards_state) into this rank's parameters and moments."""
    tp, tp_rank = ts.par.tp, ts.par.tp_rank
    for e in batch:
        assert e.meta is not None and e.meta.shard is not None
        old, new = e.meta.shard.for_tp(old_tp), e.meta.shard.for_tp(tp)
        shape = _old_shape(e, old_tp)
        keys = _old_tp_keys(e, old_tp)

        def mine(shards: list[Tensor], old: Any = old, new: Any = new) -> Tensor:
            """This rank's new shard, flattened, of the tensor whose old shards are `shards`."""
            return shard_tensor(unshard_tensors(shards, old), new, tp_rank, tp).reshape(-1)

        flat = mine([state["model"][k] for k in keys])
        # The ZeRO-1/2 master and a DTensor (FSDP2) hold [lo, hi) of the flattened TP shard; a plain parameter
        # all of it (restore() writes ZeRO's parameters from the master).
        if e.master is not None:
            e.master.copy_(flat[e.lo:e.hi])
        else:
            _flat_local(e.param).copy_(flat[e.lo:e.hi] if hasattr(e.param, "to_local") else flat)
        st = ts.opt.state.get(e.opt_param, {})
        for k in _moments(ts, e):
            _flat_local(st[k]).copy_(mine([state["optim"][f"{key}.{k}"].view(shape) for key in keys])[e.lo:e.hi])


def restore(ts: TrainState, state: dict[str, Any]) -> int:
    """After dcp.load filled `state` (built by app_state after ensure_optimizer_state), and any TP reshard:
    set what is not loaded in place. Returns the step to continue from."""
    extra = state["extra"]
    step_t = float(extra["optimizer_step"])
    for st in ts.opt.state.values():
        if "step" in st:
            st["step"].fill_(step_t)
    _set_copies(ts)
    ts.sync.after_step()  # ZeRO-1/2: the parameters from the loaded fp32 master slices (a collective)
    ts.loader.load_state_dict(extra["loader"])
    ts.scaler.scale = float(extra["scaler"]["scale"])
    ts.scaler.good = int(extra["scaler"]["good"])
    return int(extra["step"])


@torch.no_grad()
def _set_copies(ts: TrainState) -> None:
    """Each tied copy (see `_entries`) from the loaded entry of its key: weights (the ZeRO-1/2 master) and
    moments. Both copies are sliced alike (one bucket each, same padding and DP shard; FSDP's same rows)."""
    loaded, copies = _entries(ts)
    by_key = {e.key: e for e in loaded}
    for c in copies:
        e = by_key[c.key]
        if c.master is not None and e.master is not None:
            c.master.copy_(e.master)
        else:
            _flat_local(c.param).copy_(_flat_local(e.param))
        src, dst = ts.opt.state.get(e.opt_param, {}), ts.opt.state.get(c.opt_param, {})
        for k in _moments(ts, e):
            _flat_local(dst[k]).copy_(_flat_local(src[k]))


def rank_state(ts: TrainState) -> dict[str, Any]:
    """Per-rank state beside DCP: every RNG stream of this process (TP dropout derives from them), and
    PowerSGD's Q and error feedback of each gradient sync (the error differs between DP ranks)."""
    out = {"rng": rng_state(cuda=ts.par.device.type == "cuda"), "dp_rank": ts.par.dp_rank,
           "loader": ts.loader.state_dict()}
    psgd = [s.powersgd.state_dict() for s in _syncs(ts.sync) if getattr(s, "powersgd", None) is not None]
    if psgd:
        out["powersgd"] = psgd
    return out


def restore_powersgd(ts: TrainState, saved: dict[str, Any] | None) -> bool | None:
    """PowerSGD's state from a rank_state of this layout (None: another layout or none saved). Returns None
    without compression, else whether every sync's state was restored (False: they start afresh, e = 0 and Q
    drawn again, which is where a run that turns compression on starts too)."""
    syncs = [s.powersgd for s in _syncs(ts.sync) if getattr(s, "powersgd", None) is not None]
    if not syncs:
        return None
    states = (saved or {}).get("powersgd") or []
    if len(states) != len(syncs):
        return False
    return all([c.load_state_dict(st) for c, st in zip(syncs, states, strict=True)])
