"""What the learning rate would be under the field's batch-size scaling rules, for a run whose global batch
changes (resume with --set train.global_batch, or an elastic resize) while train.lr stays as it was.

Linear scaling (Goyal et al., "Accurate, Large Minibatch SGD", 2017, sec. 2.1): lr x k for a batch x k,
derived for SGD. Square-root scaling (Hoffer et al. 2017; Malladi et al., "On the SDEs and Scaling Rules
for Adaptive Gradient Algorithms", NeurIPS 2022): lr x sqrt(k), the rule for Adam-type optimizers such as
the trainer's AdamW. Neither is applied silently: the user decides, trainctl says what each would give.
"""

from __future__ import annotations

import math


def lr_unchanged_warning(old_batch: int, new_batch: int, old_lr: float, new_lr: float) -> str | None:
    """A line when the global batch changed but the learning rate did not; None otherwise."""
    if old_batch == new_batch or old_lr != new_lr:
        return None
    k = new_batch / old_batch
    return (f"train.global_batch {old_batch} -> {new_batch} (x{k:g}) with train.lr unchanged at {old_lr:g}: "
            f"the square-root rule for AdamW (Malladi et al. 2022) gives {old_lr * math.sqrt(k):.3g}, the linear "
            f"rule (Goyal et al. 2017, SGD) {old_lr * k:.3g}; keep it only if that is meant "
            "(--set train.lr=... and train.min_lr=... otherwise)")
