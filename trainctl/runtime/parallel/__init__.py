"""Parallelism: process groups and what splits the model, the sequence or the batch across them.

    process_groups.py   rank variables, process-group start-up from the plan's placement, a clean exit
    placement_proof.py  where every rank really runs, checked against the plan at start-up
    tensor_parallel.py  Megatron-style TP and SP layers, written by hand
    context_parallel.py exact causal attention over a sequence split across a CP group
    data_parallel.py    bucketed gradient reduction, ZeRO-1/2, FSDP2 for ZeRO-3, optimizer offload
    expert_sync.py      gradients under expert parallelism (dense over DP, experts over expert-DP)
    powersgd.py         PowerSGD compression of the DP all-reduce
    pipeline_schedules.py  forward/backward over one step's micro-batches (accumulation or a PP schedule)
    comm_wait.py        time spent waiting in TP collectives and pipeline receives (for stragglers)
"""
