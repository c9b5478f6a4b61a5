"""What the trainer measures and reports about itself while it trains.

    metrics.py        the per-step line: tokens/s, TFLOP/s, MFU (rank 0)
    tracking.py       TensorBoard and W&B sinks of that line
    profiling.py      torch.profiler traces of a window of steps
    memory_meter.py   exact bytes of weights, gradients, optimizer state and saved activations
    peak.py           the peak FLOP/s MFU is read against
    stragglers.py     per-rank step times
    watchdog.py       a hung rank named, its stacks dumped, the job ended
"""
