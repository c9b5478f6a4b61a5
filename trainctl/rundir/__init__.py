"""The run directory's records and what they say: file names, JSONL, the run's state, step times. No torch.

    paths.py          the name of every file in a run directory; reading and appending JSONL
    runstate.py       one truth about a run's state, derived from its records and its backend
    steptimes.py      per-rank step times: own work, peers, persistent stragglers
"""
