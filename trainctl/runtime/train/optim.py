"""AdamW parameter groups and the learning-rate schedule (a pure function, so resume reproduces it)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from trainctl.spec.models import TrainSpec


def min_lr(train: TrainSpec) -> float:
    return train.lr / 10 if train.min_lr is None else train.min_lr


def lr_at(step: int, train: TrainSpec) -> float:
    """LR of optimizer step `step` (0-based): linear warmup to lr, then cosine/linear decay to min_lr."""
    if train.warmup and step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    if train.lr_schedule == "constant":
        return train.lr
    lo = min_lr(train)
    span = max(1, train.steps - train.warmup)
    frac = min(1.0, (step - train.warmup) / span)
    if train.lr_schedule == "linear":
        return train.lr - (train.lr - lo) * frac
    return lo + 0.5 * (train.lr - lo) * (1.0 + math.cos(math.pi * frac))


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices (linear and embedding weights) only, not on norms and biases."""
    return p.dim() >= 2 and not name.endswith("bias")


def adamw(groups: Iterable[tuple[list[torch.Tensor], bool]], train: TrainSpec) -> torch.optim.AdamW:
    """AdamW over (tensors, decays) groups; lr is set every step from lr_at(). Always torch's fused kernel,
    wherever the tensors live (calibrate times the same step): on a GPU one launch per group instead of
    foreach's passes (247 -> 236 ms per step of a 0.9B model on an H200); on a CPU 4-5x torch's default there,
    a loop over the tensors, which was what kept ZeRO-3 behind torchtitan's FSDP2 (also fused) on the CPU
    (bench/bench_titan.py --cpu-fsdp). Per element it computes the same wherever a tensor is cut (a ZeRO
    slice steps bitwise as the whole tensor does); it differs from the loop by about an ulp (docs/design/trainer.md,
    "Optimizer offload")."""
    param_groups = [{"params": ps, "weight_decay": train.weight_decay if dec else 0.0}
                    for ps, dec in groups if ps]
    return torch.optim.AdamW(param_groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             fused=True)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
