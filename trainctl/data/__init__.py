"""Token files: their formats, their preparation, their checks and their identity. No torch.

    files.py          the formats (flat ids, Megatron indexed datasets) and how `data.path` resolves
    prep.py           the byte-level tokenizer, `trainctl data prepare`, the checks launch runs first
    check.py          every token checked against the vocabulary
    identity.py       each file's size and content hash, recorded so a changed file never resumes silently
    sidecar.py        facts computed once and cached beside a data file
    sample.txt        the text the embedded default trains on
"""
