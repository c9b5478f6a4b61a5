"""The training loop and what it steps with.

    trainer.py        build -> parallelize -> loop: one rank's training
    optim.py          AdamW parameter groups and the learning-rate schedule
    loader.py         the deterministic, resumable, layout-independent batch loader
    signals.py        stop requests (SIGTERM, SIGUSR1, ...) turned into a save and exit 75
    divergence.py     the divergence guard: skip, stop or roll back on non-finite steps
    faults.py         test-only fault injection behind TRAINCTL_FAULTS
"""
