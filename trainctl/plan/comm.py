"""Communication volumes: bytes each GPU sends per collective, and which link class carries them.

Ring algorithms (Patarasuk & Yuan 2009; NCCL's ring): with n ranks and a tensor of M bytes, an
all-reduce sends 2*(n-1)/n*M per rank, a reduce-scatter or an all-gather (n-1)/n*M. Megatron's
sequence parallelism replaces each TP all-reduce by a reduce-scatter + all-gather pair: same volume.

Link classes: a collective runs at the pace of its slowest link, so a group is "nvlink" only if every
group of its kind lies inside one NVLink domain, otherwise "inter_node" (the per-GPU NIC bandwidth).
The closed forms below follow from the Megatron rank order of `trainctl.plan.placement` (tp fastest,
then dp, then pp); tests check them against the explicit groups.
"""

from __future__ import annotations

from trainctl.hardware.topology import aligned_groups_fit

NVLINK = "nvlink"
INTER_NODE = "inter_node"


def all_reduce_bytes(message: float, n: int) -> float:
    return 2 * (n - 1) / n * message if n > 1 else 0.0


def gather_bytes(message: float, n: int) -> float:
    """Reduce-scatter or all-gather of a tensor of `message` bytes (whole, before sharding)."""
    return (n - 1) / n * message if n > 1 else 0.0


def tp_link(tp: int, world: int, domain: int) -> str:
    """TP groups are aligned runs of tp consecutive ranks."""
    return NVLINK if aligned_groups_fit(tp, world, domain) else INTER_NODE


def dp_link(tp: int, dp: int, world: int, domain: int) -> str:
    """A DP group strides by tp inside an aligned block of tp*dp ranks; every group stays in one domain
    exactly when those blocks do (or the groups are single ranks)."""
    if dp == 1:
        return NVLINK
    return NVLINK if aligned_groups_fit(tp * dp, world, domain) else INTER_NODE


def cp_link(tp: int, cp: int, world: int, domain: int) -> str:
    """A CP group is cp ranks at stride tp inside an aligned block of tp*cp ranks (tp-cp-ep-dp-pp order)."""
    if cp == 1:
        return NVLINK
    return NVLINK if aligned_groups_fit(tp * cp, world, domain) else INTER_NODE


def ep_link(tp: int, ep: int, world: int, domain: int) -> str:
    """An EP group is ep ranks at stride tp inside an aligned block of tp*ep ranks (tp-cp-ep-dp-pp order)."""
    if ep == 1:
        return NVLINK
    return NVLINK if aligned_groups_fit(tp * ep, world, domain) else INTER_NODE


def expert_dp_link(tp: int, dp: int, ep: int, world: int, domain: int) -> str:
    """An expert-data-parallel group is dp/ep ranks at stride tp*ep inside the aligned block of tp*dp ranks
    that holds one DP group: inside one domain exactly when those blocks are (or the groups are single)."""
    return NVLINK if dp // ep == 1 else dp_link(tp, dp, world, domain)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, act_bytes: int, ep: int, passes: int = 4) -> float:
    """Bytes one GPU sends in one MoE layer's token exchange over its EP group, per micro-batch.

    Each of the rank's `tokens` goes to top_k experts, a hidden-wide vector each; with experts spread evenly
    over ep ranks, (ep-1)/ep of those copies leave the rank. Four exchanges per layer: dispatch and combine
    in the forward pass, and their gradients (combine, dispatch) in backward; full recompute repeats the
    forward two (passes = 6). Megatron-Core's alltoall dispatcher; capacity padding not counted."""
    if ep == 1:
        return 0.0
    return passes * tokens * top_k * hidden * act_bytes * (ep - 1) / ep


def cp_exchange_bytes(seq_len: int, micro_batch: int, kv_width: float, act_bytes: int, cp: int,
                      passes: int = 2) -> float:
    """Bytes one GPU sends in one layer's K/V exchange over its CP group, per micro-batch, as the trainer
    exchanges them (runtime/parallel/context_parallel.py): an all-gather of K and V, which are kv_width values per
    token each (this TP rank's KV heads) and seq_len*micro_batch tokens for the whole sequence, so each rank
    sends (cp-1)/cp of 2*s*b*kv_width values; backward reduce-scatters their gradients (the same volume);
    recompute gathers them again (passes = 3). A ring (ring attention) sends the same K/V blocks forward,
    in cp-1 steps, and K/V plus their gradients around again in backward: 3 passes without recompute."""
    if cp == 1:
        return 0.0
    return passes * gather_bytes(2 * seq_len * micro_batch * kv_width * act_bytes, cp)


def pp_link(pp: int, world: int, domain: int) -> str:
    """Neighbouring stages are tp*dp ranks apart; some neighbour pair crosses a domain boundary unless
    the whole job is one domain (for pp > 1)."""
    if pp == 1:
        return NVLINK
    return NVLINK if world <= domain else INTER_NODE


def dp_traffic(params: float, zero: int, dp: int, micro_batches: int, grad_bytes: float, weight_bytes: float,
               units: int = 1, powersgd: tuple[float, float] | None = None, kept: float = 0.0
               ) -> list[tuple[str, float, float]]:
    """(collective, bytes one GPU sends, calls) per optimizer step for data parallelism over `params` local
    parameters, as the trainer communicates: gradients of `grad_bytes` each (fp32, or bf16 with
    parallel.grad_reduce_dtype: bf16), weights of `weight_bytes` (what the all-gather moves: bf16 parameters
    under bf16 ZeRO-1/2, FSDP2's gathered dtype under ZeRO-3). Calls count collectives, not buckets.

    ZeRO paper (Rajbhandari et al. 2020, Sec. 7): an all-reduce of the gradients is 2*Psi per rank, a
    reduce-scatter plus an all-gather the same. ZeRO-0 accumulates every micro-batch into its full gradient
    buffer and all-reduces it once per step; ZeRO-1 accumulates into its full buffer too but reduce-scatters
    it once per step (each rank steps only its slice: Megatron's distributed optimizer), then all-gathers
    the updated weights: (grad_bytes + weight_bytes) * Psi * (dp-1)/dp, 6 bytes per parameter with fp32
    gradients and bf16 weights, 4 with grad_reduce_dtype bf16; ZeRO-2 keeps no full buffer, so it
    reduce-scatters every micro-batch's gradients (DeepSpeed's stage 2), then all-gathers the weights;
    ZeRO-3 (FSDP2) gathers the weights for every micro-batch's forward and again for its backward, per FSDP
    unit, and reduce-scatters the gradients accumulated over the step's micro-batches once, after the last;
    `kept` of the `params` (the final norm and LM head: `fsdp_head_unit`) form a unit that stays gathered from
    its forward to its backward, which follows at once, so they are gathered once per micro-batch.

    `powersgd` (ZeRO-0/1; plan/powersgd.py): (elements of the compressed matrices, elements of their P and Q
    factors). The all-reduce then carries the rest of the gradients and, in two more calls, the fp32 factors;
    ZeRO-1 all-reduces then too (compression needs whole matrices on every rank).
    """
    if dp == 1 or params <= 0:  # no parameters (the expert-DP group of a dense model): no collective
        return []
    grads, weights = params * grad_bytes, params * weight_bytes
    reduce = [("all_reduce", all_reduce_bytes(grads, dp), 1.0)]
    if powersgd is not None and zero <= 1:
        matrices, factors = powersgd
        reduce = [("all_reduce", all_reduce_bytes((params - matrices) * grad_bytes + factors * 4, dp), 3.0)]
    elif zero == 1:
        reduce = [("reduce_scatter", gather_bytes(grads, dp), 1.0)]
    if zero == 0:
        return reduce
    if zero == 1:
        return [*reduce, ("all_gather", gather_bytes(weights, dp), 1.0)]
    if zero == 2:
        return [("reduce_scatter", micro_batches * gather_bytes(grads, dp), float(micro_batches)),
                ("all_gather", gather_bytes(weights, dp), 1.0)]
    # FSDP2 as the trainer drives it: the gradient sync is off until the step's last micro-batch
    # (schedules.Accumulate; pipelining's stage does the same), so one reduce-scatter per unit per step.
    # Every unit but the head's, the root included, is gathered for forward and again for backward: the
    # trainer passes reshard_after_forward=True, which FSDP2 then applies to the root too (docs/design/checked-facts.md,
    # "Checked facts: PyTorch distributed on CPU/gloo")
    calls = float(micro_batches * units)
    regathered = float(micro_batches * (units - (kept > 0)))
    return [("reduce_scatter", gather_bytes(grads, dp), float(units)),
            ("all_gather", micro_batches * gather_bytes(weights, dp), calls),  # forward
            ("all_gather", micro_batches * gather_bytes((params - kept) * weight_bytes, dp), regathered)]  # backward


def fsdp_head_unit(final_norm_params: float, head_params: float, tied: bool) -> float:
    """Parameters of the last stage's FSDP2 unit that stays gathered from forward to backward under ZeRO-3: the
    final norm and the LM head (runtime/parallel/data_parallel.py `apply_fsdp`, as torchtitan wraps them); 0 with
    tied embeddings, whose head is the embedding's weight, left in the root unit (resharded after forward)."""
    return 0.0 if tied else final_norm_params + head_params


def fsdp_units(layers: int, first: bool, last: bool, tied: bool) -> int:
    """FSDP2 units holding parameters on one pipeline rank under ZeRO-3 (`apply_fsdp`): one per layer, and the
    ends: untied, the embedding's unit on the first stage and the final norm + LM head's on the last (the root
    then holds none); tied, the root holding the embedding (and the final norm) on either."""
    return layers + ((first or last) if tied else first + last)
