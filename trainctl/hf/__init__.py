"""Hugging Face interop without torch: the format, what `model.init_from` points at, `trainctl export`.

    format.py         the transformers class, config.json and weight names of a model shape
    init_source.py    `model.init_from` (an HF directory, a run, a checkpoint) checked against the spec
    export.py         `trainctl export`'s checks; the export itself is runtime/model/hf_weights.py
"""
