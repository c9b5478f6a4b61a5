"""The trainer's work outside the transformer layers, as `trainctl calibrate` measures it (phase 5), and its
price. Torch-free: the planner imports it.

Per micro-batch, on the rank holding that end: the embedding's forward + backward, and the final norm + LM
head + the trainer's loss beyond the head's FLOPs (the planner already charges those at the compute rate):
softmax, cross-entropy, the vocab-parallel bookkeeping and the autograd calls, measured at the profile's
micro-batch.
Per optimizer step, on every rank: the gradient norm, clipping and the AdamW step (torch's default on a
CPU is a loop over tensors), priced as seconds per tensor + seconds per element of the tensors the rank
steps. Fitted from AdamW over one flat tensor of N and of 4N elements (the per-element cost) and over one
real layer's parameter list (what each tensor adds).
ZeRO-3: what making a layer one FSDP2 unit adds to its forward + backward (the all-gathers before forward
and backward, FSDP2's CPU work, and waiting for the group), measured on one real layer in the smallest DP
group calibrate forms; other group sizes and the layout's TP shard are priced from there with the
all-gather fit (`unit_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from trainctl.plan.calibration.fit import fit_latency_bandwidth, median_of


@dataclass(frozen=True)
class FixedWork:
    micro_batch: int  # the micro-batch the ends were timed at
    embedding_s: float  # per micro-batch, on the rank holding the embedding
    head_extra_s: float  # per micro-batch, on the rank holding the LM head, beyond its FLOPs at the rate
    tensor_s: float  # optimizer step, per tensor
    element_s: float  # optimizer step, per element
    layer_tensors: int  # parameter tensors of one layer, the embedding stage and the head stage (the model's)
    embedding_tensors: int
    head_tensors: int
    fsdp_unit_s: float | None = None  # ZeRO-3: one unit's extra seconds per micro-batch (None: not measured)
    fsdp_link: str | None = None  # where it was measured: link class, group size, bytes of the unit's weights
    fsdp_group: int = 0
    fsdp_bytes: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FixedWork:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def valid(self) -> bool:
        nums = [self.embedding_s, self.head_extra_s, self.tensor_s, self.element_s, self.fsdp_unit_s or 0.0]
        return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in nums)

    def ends_seconds(self, first: bool, last: bool) -> float:
        """Seconds per micro-batch a pipeline rank spends on the ends it holds, beyond their FLOPs."""
        return first * self.embedding_s + last * self.head_extra_s

    def optimizer_seconds(self, tensors: float, elements: float) -> float:
        """Seconds of one optimizer step over `tensors` tensors of `elements` elements in all."""
        return tensors * self.tensor_s + elements * self.element_s

    def stage_tensors(self, layers: int, first: bool, last: bool) -> int:
        return layers * self.layer_tensors + first * self.embedding_tensors + last * self.head_tensors

    def unit_seconds(self, gather_shift_s: float | None) -> float:
        """One FSDP2 unit's extra seconds per micro-batch in a layout: the measured figure, moved by what two
        all-gathers (forward, backward) of the layout's unit cost more or less than the measured unit's;
        `gather_shift_s` is that difference for one all-gather (None: no fit to tell)."""
        base = self.fsdp_unit_s or 0.0
        if gather_shift_s is None or not self.fsdp_group:
            return base
        return max(0.0, base + 2 * gather_shift_s)


def fit_fixed(raw: dict[str, Any], compute_rate: float) -> FixedWork:
    """The fits of calibrate's phase 5 (`raw`: per-rank seconds, see trainctl/runtime/workers/calibrate.py);
    `compute_rate` is the planner's tp-1 FLOP/s, at which it charges the head's FLOPs."""
    opt = raw["optimizer"]
    flat = fit_latency_bandwidth([(o["elements"], median_of(o["seconds"])) for o in opt if o["tensors"] == 1])
    element_s = 1.0 / flat.bytes_per_s
    model = max(opt, key=lambda o: o["tensors"])
    tensor_s = max(0.0, (median_of(model["seconds"]) - model["elements"] * element_s) / model["tensors"])
    fsdp = raw.get("fsdp")
    unit = max(0.0, median_of(fsdp["sharded_s"]) - median_of(fsdp["plain_s"])) if fsdp else None
    t = raw["tensors"]
    return FixedWork(
        micro_batch=int(raw["micro_batch"]), embedding_s=median_of(raw["embedding_s"]),
        head_extra_s=max(0.0, median_of(raw["head_s"]) - raw["head_flops"] / compute_rate),
        tensor_s=tensor_s, element_s=element_s, layer_tensors=int(t["layer"]),
        embedding_tensors=int(t["embedding"]), head_tensors=int(t["head"]), fsdp_unit_s=unit,
        fsdp_link=fsdp["link"] if fsdp else None, fsdp_group=int(fsdp["group_size"]) if fsdp else 0,
        fsdp_bytes=float(fsdp["unit_bytes"]) if fsdp else 0.0)
