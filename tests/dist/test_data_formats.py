"""Tokenizers and data formats people already have: a local tokenizer.json, Megatron's indexed dataset
(.bin + .idx), and weighted blends of several sources, with the exact-resume guarantee kept."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from cli_utils import trainctl
from data_utils import write_bpe_tokenizer, write_jsonl_corpus
from resume_utils import assert_resumed_bitwise, curve, straight_and_resumed
from trainer_utils import make_run, metrics, run_trainer

from trainctl.data.files import open_token_file, read_megatron_index
from trainctl.data.prep import check_token_file
from trainctl.errors import UsageError


def megatron_dataset_by_hand(prefix: Path, documents: list[list[int]], dtype: str = "uint16") -> None:
    """An indexed dataset written from Megatron-Core's description of `_IndexWriter`, independently of
    trainctl's writer: magic, version 1, dtype code (uint16 = 8, int32 = 4), sequence count, document-index
    count, int32 lengths, int64 byte pointers, int64 document indices (with the final sentinel)."""
    code, item = {"uint16": (8, 2), "int32": (4, 4)}[dtype]
    sizes = [len(d) for d in documents]
    pointers = [item * sum(sizes[:i]) for i in range(len(sizes))]
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=f"<{'u2' if dtype == 'uint16' else 'i4'}").tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(sizes) + 1))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers))
        f.write(struct.pack(f"<{len(sizes) + 1}q", *range(len(sizes) + 1)))


def documents(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, rng.integers(20, 200)).tolist() + [vocab - 1] for _ in range(n)]


def test_megatron_dataset_reads_as_its_documents_in_order(tmp_path: Path) -> None:
    docs = documents(50, 0)
    megatron_dataset_by_hand(tmp_path / "corpus_text_document", docs)
    for named in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        tf = open_token_file(tmp_path / named)
        assert tf.format == "megatron" and tf.dtype == "uint16"
        assert tf.tokens().tolist() == [t for d in docs for t in d]
    index = read_megatron_index(tmp_path / "corpus_text_document.idx")
    assert index.sizes.tolist() == [len(d) for d in docs] and index.document_indices.tolist() == list(range(51))
    # int32 ids (Megatron's dtype for vocabularies > 65535) and a negative id caught by the full scan
    wide = documents(5, 1, vocab=100_000)
    wide[3][7] = -5
    megatron_dataset_by_hand(tmp_path / "wide", wide, "int32")
    with pytest.raises(UsageError, match=r"token id -5 at token offset [\d,]+ .* is negative"):
        check_token_file(tmp_path / "wide", "uint16", 16, 100_000)


def test_a_broken_megatron_pair_is_refused(tmp_path: Path) -> None:
    megatron_dataset_by_hand(tmp_path / "a", documents(10, 2))
    (tmp_path / "a.idx").write_bytes((tmp_path / "a.idx").read_bytes()[:-8])
    with pytest.raises(UsageError, match="truncated or not an index"):
        open_token_file(tmp_path / "a")
    megatron_dataset_by_hand(tmp_path / "b", documents(10, 3))
    with open(tmp_path / "b.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UsageError, match=r"2166 bytes but its index describes 1082 uint16 tokens") as e:
        open_token_file(tmp_path / "b")
    assert "do not belong together" in (e.value.hint or "")
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "c.bin").write_bytes(b"\0" * 8)
    with pytest.raises(UsageError, match="not a Megatron indexed-dataset index"):
        open_token_file(tmp_path / "c")


def test_blend_deals_slots_in_proportion_and_in_blocks() -> None:
    from trainctl.runtime.train.loader import BlendedSource

    class Fake:
        seq_len = 1

        def __init__(self, tag: int) -> None:
            self.tag = tag

        def windows(self, slots: np.ndarray) -> np.ndarray:
            return np.stack([np.full(len(slots), self.tag), slots], axis=1)

    blend = BlendedSource([Fake(0), Fake(1), Fake(2)], [0.5, 0.3, 0.2])  # type: ignore[list-item]
    out = blend.windows(np.arange(10_000))
    tags, inner = out[:, 0], out[:, 1]
    assert np.bincount(tags).tolist() == [5000, 3000, 2000]
    for tag in range(3):  # each source's own slots are 0, 1, 2, ... in order: nothing skipped or repeated
        assert inner[tags == tag].tolist() == list(range(int((tags == tag).sum())))
    # O(1) per slot: any slot alone gives what it gave inside the run
    some = np.array([0, 999, 1000, 7777, 123_456_789])
    assert blend.windows(some).tolist() == [blend.windows(np.array([s]))[0].tolist() for s in some]


@pytest.mark.slow
def test_megatron_and_flat_blend_trains_and_resumes_exactly(tmp_path: Path) -> None:
    megatron_dataset_by_hand(tmp_path / "web_text_document", documents(200, 4))
    flat = tmp_path / "code.bin"
    np.asarray([t for d in documents(100, 5) for t in d], dtype="<u2").tofile(flat)
    data = {"synthetic": False, "blend": [{"path": str(tmp_path / "web_text_document"), "weight": 0.7},
                                          {"path": str(flat), "weight": 0.3, "dtype": "uint16"}]}
    straight, resumed = straight_and_resumed(tmp_path, {"dp": 2}, 6, data=data)
    assert_resumed_bitwise(straight, resumed, 6)  # the loader state is one slot counter
    assert all(np.isfinite(loss) for _, loss, _ in curve(straight))


@pytest.mark.slow
def test_bpe_tokenizer_prepares_the_sample_and_a_run_trains_on_it(tmp_path: Path) -> None:
    tok = write_bpe_tokenizer(tmp_path / "tokenizer.json")  # offline: the shipped public-domain sample
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")

    jsonl = tmp_path / "docs.jsonl"
    paragraphs = write_jsonl_corpus(jsonl)
    for fmt, out in (("flat", tmp_path / "sample.bin"), ("megatron", tmp_path / "sample_text_document")):
        r = trainctl("data", "prepare", str(jsonl), str(out), "--tokenizer", str(tmp_path / "tokenizer.json"),
                     "--format", fmt)
        assert r.returncode == 0, r.stderr
        assert f"{len(paragraphs):,} documents" in r.stdout and f"model.vocab >= {vocab}" in r.stdout
        ids = open_token_file(out).tokens()
        assert int((ids == eot).sum()) == len(paragraphs)  # every document ends with the end-of-text token
        first = tok.encode(paragraphs[0], add_special_tokens=False).ids
        assert ids[: len(first) + 1].tolist() == [*first, eot]

    run, world = make_run(tmp_path, "bpe", model={"vocab": vocab},
                          data={"synthetic": False, "path": str(tmp_path / "sample_text_document")},
                          train={"steps": 4})
    r = run_trainer(run, world, dump=False)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
