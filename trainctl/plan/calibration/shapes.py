"""What a calibration measures for a spec: the model's GEMM shapes per TP size, the TP sizes, the message
sizes, and the bus bytes of each collective. Torch-free, so the shapes are the planner's own arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.model_shape import ModelShape
from trainctl.plan.comm import all_reduce_bytes, gather_bytes
from trainctl.spec.models import RunSpec

# Whole-tensor sizes timed for every collective: 4 KiB to 4 MiB covers a tiny model's TP activations up to
# the bulk of a DP bucket's bandwidth regime; a few points per decade are enough for a two-parameter fit.
MESSAGE_BYTES = (4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
INTRA, INTER = "intra_node", "inter_node"


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int  # tokens of a micro-batch
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def gemms(shape: ModelShape, tokens: int, tp: int) -> list[Gemm]:
    """The forward GEMMs of one layer and the LM head on one TP rank (column-parallel layers split their
    output, row-parallel ones their input, as trainctl/runtime/model/transformer.py does)."""
    h, f = shape.hidden, shape.ffn_hidden or 4 * shape.hidden
    qkv = (shape.heads + 2 * (shape.kv_heads or shape.heads)) * shape.head_dim
    up = 2 * f if shape.swiglu else f
    return [
        Gemm("qkv", tokens, h, qkv // tp),
        Gemm("attn_out", tokens, shape.heads * shape.head_dim // tp, h),
        Gemm("mlp_up", tokens, h, up // tp),
        Gemm("mlp_down", tokens, f // tp, h),
        Gemm("lm_head", tokens, h, shape.padded_vocab(tp) // tp),
    ]


def tp_sizes(spec: RunSpec) -> list[int]:
    """TP sizes worth measuring: every one `plan --auto` may pick (divides heads, kv_heads, the FFN and the
    world), which always includes 1 and the spec's own."""
    m, world = spec.model, spec.world_size
    kv, ffn = m.kv_heads or m.heads, m.ffn_hidden or 4 * m.hidden
    found = {t for t in range(1, world + 1) if world % t == 0 and not (m.heads % t or kv % t or ffn % t)}
    return sorted(found | {1, spec.parallel.tp})


def bus_bytes(op: str, message: float, n: int) -> float:
    """Bytes one rank sends for a collective over a whole tensor of `message` bytes among n ranks (ring)."""
    if op == "all_reduce":
        return all_reduce_bytes(message, n)
    if op == "send_recv":
        return message
    return gather_bytes(message, n)  # all-gather, reduce-scatter, all-to-all: (n-1)/n of the tensor
