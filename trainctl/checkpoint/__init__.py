"""The on-disk checkpoint format, shared by the CLI, the launcher and the trainer. No torch.

Checksums and fsynced writes are trainctl/fileio.py's.

    format.py     names, manifest, commit marker, validity, listing, the newest valid checkpoint
    retention.py  which old checkpoints may go (keep the newest K and milestones)
    save_schedule.py  SaveSchedule: when the trainer saves
    meta.py       the layout and model shape a checkpoint records, compared with a spec
    location.py   resolve_checkpoint_dir: where a run's checkpoints live

The trainer's side (DCP storage, what a checkpoint holds, the save/resume policy) is in trainctl/runtime/checkpoint/
(docs/design/checkpoints.md, "Checkpoint format and commit protocol").
"""

from trainctl.checkpoint.format import (
    DCP_INDEX,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    CheckpointError,
    CheckpointInfo,
    abandoned_dirname,
    code_version,
    digest_problem,
    find_step,
    inspect_checkpoint,
    latest_valid,
    list_checkpoints,
    manifest_bytes,
    marker_bytes,
    newest_valid,
    parse_step,
    rank_state_filename,
    read_manifest,
    staging_dirname,
    stale_dirs,
    step_dirname,
    trash_dirname,
    validate,
)
from trainctl.checkpoint.location import resolve_checkpoint_dir
from trainctl.checkpoint.meta import (
    describe_layout,
    different_model,
    layout_changes,
    layout_of,
    model_differences,
    model_of,
    same_layout,
)
from trainctl.checkpoint.retention import is_milestone, to_delete
from trainctl.checkpoint.save_schedule import SaveSchedule
from trainctl.fileio import HASH, file_digest, fsync_path, write_durable

__all__ = [
    "DCP_INDEX", "FORMAT_VERSION", "HASH", "MANIFEST", "MARKER", "CheckpointError", "CheckpointInfo", "SaveSchedule",
    "abandoned_dirname", "code_version", "describe_layout", "different_model", "digest_problem", "file_digest",
    "find_step", "fsync_path", "inspect_checkpoint", "is_milestone", "latest_valid", "layout_changes", "layout_of",
    "list_checkpoints", "manifest_bytes", "marker_bytes", "model_differences", "model_of", "newest_valid",
    "parse_step", "rank_state_filename", "read_manifest", "resolve_checkpoint_dir", "same_layout", "stale_dirs",
    "staging_dirname", "step_dirname", "to_delete", "trash_dirname", "validate", "write_durable",
]
