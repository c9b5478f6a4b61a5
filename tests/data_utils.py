"""Inputs a user of `trainctl data prepare --tokenizer` has, made offline for tests: a byte-level BPE
tokenizer.json trained on the shipped public-domain sample, and the sample's paragraphs as a .jsonl corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainctl.data.prep import sample_text_path


def write_bpe_tokenizer(path: Path, vocab_size: int = 500) -> Any:
    """A Hugging Face tokenizer.json (BPE, byte-level, <|endoftext|>) trained here: never a hub download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"],
                                  show_progress=False)
    tok.train([str(sample_text_path())], trainer)
    tok.save(str(path))
    return tok


def write_jsonl_corpus(path: Path) -> list[str]:
    """The sample's paragraphs, one {"text": ...} document per line (what Megatron's preprocess_data reads)."""
    paragraphs = [p for p in sample_text_path().read_text().split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return paragraphs
