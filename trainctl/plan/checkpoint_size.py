"""The bytes of one checkpoint of a run, as the bundled trainer writes it: the planner's one figure. No torch.

A checkpoint (docs/design/checkpoints.md, "Checkpoint format and commit protocol") holds every parameter once,
whatever the layout (DCP keeps one copy of what DP replicas share; TP and ZeRO shards add up to the whole):
the fp32 weights and AdamW's two fp32 moments, 12 bytes per parameter in any `train.precision` (the trainer
keeps fp32 weights and autocasts the compute: the memory model's weights + optimizer bytes, section "Memory
model", summed over the ranks that hold distinct shards). The embedding is saved with the padded vocabulary
(padded to a multiple of tp). DCP frames every tensor item it writes (torch.save's zip container, ~1.6 KB
measured) and lists it in its metadata (~0.3 KB): counted per item as ~(12 tensors per layer + 6) x tp x 3
(weight and two moments), an over-count for most models and negligible beside the payload of a large one.
Beside DCP's shards each rank writes a small state file (RNG streams, data position; 14.6 KB measured), and
rank 0 the manifest and the marker.

Checked against the tiny recipe (TP=2 x PP=2 x DP=2): 2.61 MB of tensors, 3.02 MB written, 3.42 MB predicted
(an upper bound: what the check before training needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainctl.model_shape import ModelShape, param_counts

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

BYTES_PER_PARAM = 4 + 8  # fp32 weights + AdamW exp_avg and exp_avg_sq (fp32)
RANK_STATE_BYTES = 16 * 1024  # per rank: python, numpy and torch RNG states, the loader position
ITEM_BYTES = 1900  # per DCP tensor item: torch.save framing in its .distcp file + its entry in .metadata
TENSORS_PER_LAYER = 12  # an upper bound: 4 matmul weights, their biases, 2 norms with weight and bias
OTHER_TENSORS = 6  # token and position embeddings, final norm (weight, bias), LM head and its bias
METADATA_BYTES = 64 * 1024  # rank 0: manifest.json (a line per file), the commit marker


def checkpoint_bytes(spec: RunSpec) -> int:
    """Bytes one committed checkpoint of `spec`'s run takes on disk (an upper bound to within a few KiB)."""
    shape = ModelShape.from_spec(spec.model)
    tp = spec.parallel.tp
    params = param_counts(shape, vocab=shape.padded_vocab(tp)).total
    items = 3 * (TENSORS_PER_LAYER * shape.layers + OTHER_TENSORS) * tp
    return params * BYTES_PER_PARAM + items * ITEM_BYTES + spec.world_size * RANK_STATE_BYTES + METADATA_BYTES


def save_seconds(spec: RunSpec) -> tuple[float, float]:
    """(seconds a save blocks training, seconds until it is committed), at the estimate.* bandwidths.

    DCP writes each distinct shard once, spread over the ranks: a node writes 1/nodes of the checkpoint at
    `checkpoint_write_gbps`. An async save blocks only for the copy of a GPU's 1/world share to host memory
    (`checkpoint_stage_gbps`), then writes in the background; a synchronous save blocks for the whole write.
    """
    total = checkpoint_bytes(spec)
    e = spec.estimate
    write = total / spec.cluster.nodes / (e.checkpoint_write_gbps * 1e9)
    stage = total / spec.world_size / (e.checkpoint_stage_gbps * 1e9)
    return (stage, stage + write) if spec.checkpoint.async_save else (write, write)
