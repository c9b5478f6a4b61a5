"""The ranks of the measuring jobs (`trainctl calibrate`, `trainctl preflight`); verdicts are launch/'s.

    worker_main.py    their common entry: read the frozen spec, start the process group, leave cleanly
    calibrate.py      what every rank runs for `trainctl calibrate`
    preflight.py      what every rank runs for `trainctl preflight`
    microbench.py     the timed GEMMs, collectives and layer passes both use
"""
