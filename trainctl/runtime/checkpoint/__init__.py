"""The trainer's checkpoints: storage, content, policy. The on-disk format is trainctl/checkpoint/'s.

    storage.py        sharded, async, atomic saves and loads with torch.distributed.checkpoint (DCP)
    state.py          what a checkpoint holds, keyed to load into another layout
    policy.py         when the trainer saves and what it resumes from (start, every step, end)
"""
