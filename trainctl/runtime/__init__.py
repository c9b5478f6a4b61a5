"""What every rank runs (`python -m trainctl.runtime RUN_DIR`): the only layer that imports torch.

    entry.py          a rank's main: read the run directory, build, train, leave with the right exit code
    model/            the plain model: transformer, MoE block, initialisation, Hugging Face weights
    parallel/         process groups and everything that splits the model or the batch across them
    parallelize.py    applies compile, FSDP2 and the gradient sync to the built stages (build -> parallelize -> loop)
    train/            the training loop: trainer, optimizer, data loader, stop signals, divergence guard
    checkpoint/       DCP storage of a checkpoint, what it holds, and when the trainer saves or resumes
    observe/          metrics, tracking sinks, profiler, memory meter, peak FLOP/s, stragglers, watchdog
    workers/          the measuring jobs' ranks: calibrate, preflight and their micro-benchmarks
"""
