"""Data: byte tokenizer, `trainctl data prepare`, token-file checks, and the trainer's batch loader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_utils import trainctl

from trainctl.data.prep import BYTE_VOCAB, check_token_file, decode, encode, prepare, sample_text_path
from trainctl.errors import UsageError
from trainctl.runtime.train.loader import SyntheticSource, build_loader
from trainctl.spec import load_spec_text

SEQ = 16


def make_spec(data: str, *, global_batch: int = 8, micro_batch: int = 1, vocab: int = 256, seq: int = SEQ):
    return load_spec_text(f"""
name: data-test
model: {{layers: 1, hidden: 32, heads: 2, vocab: {vocab}, seq_len: {seq}}}
parallel: {{micro_batch: {micro_batch}}}
train: {{global_batch: {global_batch}, steps: 10}}
data: {data}
cluster: {{nodes: 1, gpus_per_node: 1, gpu: cpu}}
""")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "sample.bin"
    prepare(sample_text_path(), out)
    return out


def file_spec(path: Path, **kw):
    return make_spec(f"{{path: {path}, dtype: uint16}}", **kw)


def global_batches(spec, dp: int, steps: int, seed: int = 7) -> list[torch.Tensor]:
    """Per step: the concatenation over DP ranks of every rank's sequences, in rank order."""
    loaders = [build_loader(spec, r, dp, seed) for r in range(dp)]
    out = []
    for _ in range(steps):
        parts = []
        for loader in loaders:
            x, y = loader.next_step()
            assert x.dtype == y.dtype == torch.int64
            assert x.shape == (spec.train.global_batch // dp // spec.parallel.micro_batch,
                               spec.parallel.micro_batch, spec.model.seq_len)
            assert torch.equal(x[..., 1:], y[..., :-1])  # targets are inputs shifted by one
            parts.append(torch.cat([x.reshape(-1, x.shape[-1]), y[..., -1:].reshape(-1, 1)], dim=1))
        out.append(torch.cat(parts))
    return out


# --- tokenizer and prepare -------------------------------------------------------------------------

def test_byte_tokenizer_round_trip() -> None:
    text = "Grüße, 世界! \n\t"
    ids = encode(text)
    assert max(ids) < BYTE_VOCAB and decode(ids) == text


def test_sample_text_ships_and_is_large_enough() -> None:
    size = sample_text_path().stat().st_size
    assert 50_000 <= size <= 200_000
    sample_text_path().read_text(encoding="utf-8")  # valid UTF-8


def test_prepare_writes_flat_tokens(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("héllo\n", encoding="utf-8")
    for dtype, np_dtype in (("uint16", "<u2"), ("uint32", "<u4")):
        res = prepare(src, tmp_path / f"out-{dtype}.bin", dtype)
        assert res.tokens == len("héllo\n".encode())
        assert np.fromfile(res.path, dtype=np_dtype).tolist() == list("héllo\n".encode())
        assert f"path: {res.path}" in res.spec_block() and f"dtype: {dtype}" in res.spec_block()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp files left


def test_prepare_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        prepare(tmp_path / "missing.txt", tmp_path / "o.bin")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UsageError, match="is empty"):
        prepare(tmp_path / "empty.txt", tmp_path / "o.bin")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(UsageError, match="not a token dtype"):
        prepare(tmp_path / "t.txt", tmp_path / "o.bin", "int8")
    assert not (tmp_path / "o.bin").exists()


def test_cli_data_prepare(tmp_path: Path) -> None:
    out = tmp_path / "tokens.bin"
    r = trainctl("data", "prepare", str(sample_text_path()), str(out))
    assert r.returncode == 0, r.stderr
    # the text's documents (paragraphs), one blank line between them, byte by byte
    text = re.sub(r"\n\n+", "\n\n", sample_text_path().read_text(encoding="utf-8")).encode()
    n = len(text)
    assert np.fromfile(out, dtype="<u2").tolist() == list(text)
    documents = text.count(b"\n\n") + 1
    assert f"wrote {documents:,} documents, {n:,} tokens" in r.stdout
    assert f"data:\n  path: {out.resolve()}\n  dtype: uint16" in r.stdout

    r = trainctl("data", "prepare", str(sample_text_path()), str(tmp_path / "t32.bin"), "--dtype", "uint32")
    assert r.returncode == 0 and (tmp_path / "t32.bin").stat().st_size == 4 * n


def test_cli_data_prepare_bytes_reads_documents_as_every_tokenizer_does(tmp_path: Path) -> None:
    """Without --tokenizer a .jsonl's documents are the --json-key field's text, not its JSON lines, and a
    file that is not UTF-8 text is refused at the first bad byte."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "body": f"doc {i}: é"}) + "\n" for i in range(3)))
    out = tmp_path / "out.bin"
    r = trainctl("data", "prepare", str(corpus), str(out), "--json-key", "body")
    assert r.returncode == 0, r.stderr
    assert "wrote 3 documents, 32 tokens" in r.stdout
    assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)) == "doc 0: é\n\ndoc 1: é\n\ndoc 2: é\n".encode()
    r = trainctl("data", "prepare", str(corpus), str(tmp_path / "o.bin"))  # the default key is absent
    assert r.returncode == 2 and "corpus.jsonl:1: not a JSON object with a 'text' string" in r.stderr
    binary = tmp_path / "random.txt"
    binary.write_bytes(b"ok line\nsecond " + bytes([0xFF, 0x00, 0x81]) + b"\n")
    r = trainctl("data", "prepare", str(binary), str(tmp_path / "b.bin"))
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and errors == [f"error: input text {binary}: not UTF-8: byte 0xff at offset 15 (line 2)"]
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_cli_data_prepare_errors(tmp_path: Path, case: str) -> None:
    src = tmp_path / "in.txt"
    if case == "empty":
        src.write_bytes(b"")
    r = trainctl("data", "prepare", str(src), str(tmp_path / "o.bin"))
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(src) in errors[0]
    assert "Traceback" not in r.stderr


# --- token-file checks -----------------------------------------------------------------------------

def test_check_token_file_errors(tmp_path: Path, token_file: Path) -> None:
    with pytest.raises(UsageError, match="no such file") as e:
        check_token_file(tmp_path / "nope.bin", "uint16", SEQ, 256)
    assert "trainctl data prepare" in (e.value.hint or "")

    small = tmp_path / "small.bin"
    np.arange(SEQ, dtype="<u2").tofile(small)  # one token short of a window
    with pytest.raises(UsageError, match="fewer than one training window"):
        check_token_file(small, "uint16", SEQ, 256)

    odd = tmp_path / "odd.bin"
    np.arange(101, dtype="<u2").tofile(odd)  # 202 bytes: not whole uint32 tokens
    with pytest.raises(UsageError, match="not a whole number of uint32 tokens"):
        check_token_file(odd, "uint32", SEQ, 256)

    with pytest.raises(UsageError, match=r"token id 1\d\d at token offset [\d,]+ \(byte [\d,]+\) is >= "
                                         r"model.vocab 100") as e:
        check_token_file(token_file, "uint16", SEQ, 100)  # ASCII letters up to 122 in a 100 vocab
    assert "set data.dtype" not in (e.value.hint or "")  # it is not a dtype mix-up: no dtype advice

    wide = tmp_path / "wide.bin"
    np.fromfile(token_file, dtype="<u2").astype("<u4").tofile(wide)
    with pytest.raises(UsageError, match="looks like uint32") as e:
        check_token_file(wide, "uint16", SEQ, 256)  # uint32 read as uint16
    assert e.value.hint == "set data.dtype: uint32"
    with pytest.raises(UsageError, match=">= model.vocab") as e:
        check_token_file(token_file, "uint32", SEQ, 256)  # uint16 read as uint32
    assert "uint16" in (e.value.hint or "")
    assert check_token_file(wide, "uint32", SEQ, 256).count == token_file.stat().st_size // 2


def test_build_loader_reports_data_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        build_loader(file_spec(tmp_path / "missing.bin"), 0, 1, 0)
    with pytest.raises(UsageError, match="not divisible by dp 3"):
        build_loader(make_spec("{synthetic: true}", global_batch=8), 0, 3, 0)


# --- the loader ------------------------------------------------------------------------------------

def test_file_batches_are_windows_of_the_file(token_file: Path) -> None:
    spec = file_spec(token_file, global_batch=4, micro_batch=2)
    raw = np.fromfile(token_file, dtype="<u2").astype(np.int64)
    loader = build_loader(spec, 0, 1, seed=3)
    x, y = loader.next_step()
    assert x.shape == (2, 2, SEQ)
    for seq_in, seq_tgt in zip(x.reshape(-1, SEQ), y.reshape(-1, SEQ), strict=True):
        window = np.concatenate([seq_in.numpy(), seq_tgt.numpy()[-1:]])
        start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(raw, SEQ + 1)[::SEQ]
                                          == window, axis=1))[0]) * SEQ
        assert start % SEQ == 0 and np.array_equal(raw[start: start + SEQ + 1], window)


@pytest.mark.parametrize("source", ["synthetic", "file"])
def test_global_batch_is_the_same_for_every_dp_size(source: str, token_file: Path) -> None:
    spec = make_spec("{synthetic: true}", global_batch=8) if source == "synthetic" else \
        file_spec(token_file, global_batch=8)
    reference = global_batches(spec, 1, 4)
    for dp in (2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(reference, global_batches(spec, dp, 4), strict=True)), dp
    # micro-batch size only regroups the same sequences
    spec_mb = make_spec("{synthetic: true}", global_batch=8, micro_batch=2) if source == "synthetic" else \
        file_spec(token_file, global_batch=8, micro_batch=2)
    assert all(torch.equal(a, b) for a, b in zip(reference, global_batches(spec_mb, 2, 4), strict=True))
    assert not torch.equal(reference[0], reference[1])  # steps differ


def test_file_epochs_cover_every_window_once_and_reshuffle(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    np.arange(10 * SEQ + 1, dtype="<u2").tofile(path)  # exactly 10 windows; ids are their positions
    spec = file_spec(path, global_batch=5, vocab=65536)
    loader = build_loader(spec, 0, 1, seed=11)
    starts = []
    for _ in range(4):  # 4 steps x 5 = 2 epochs
        x, _ = loader.next_step()
        starts += x[:, 0, 0].tolist()
    epoch0, epoch1 = starts[:10], starts[10:]
    assert sorted(epoch0) == sorted(epoch1) == [i * SEQ for i in range(10)]
    assert epoch0 != epoch1  # a fresh permutation per epoch
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("source", ["synthetic", "file"])
def test_state_dict_resumes_exactly(source: str, token_file: Path) -> None:
    spec = make_spec("{synthetic: true}") if source == "synthetic" else file_spec(token_file)
    straight = build_loader(spec, 1, 2, seed=5)
    expected = [straight.next_step() for _ in range(6)]

    first = build_loader(spec, 1, 2, seed=5)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # small and JSON-able
    assert state["step"] == 3 and state["seed"] == 5
    resumed = build_loader(spec, 1, 2, seed=5)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = resumed.next_step()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_load_state_dict_rejects_another_seed() -> None:
    spec = make_spec("{synthetic: true}")
    state = build_loader(spec, 0, 1, seed=5).state_dict()
    with pytest.raises(UsageError, match="seed 5"):
        build_loader(spec, 0, 1, seed=6).load_state_dict(state)


def test_synthetic_is_deterministic_per_slot_and_learnable() -> None:
    a = SyntheticSource(seed=1, vocab=1000, window=SEQ + 1)
    b = SyntheticSource(seed=1, vocab=1000, window=SEQ + 1)
    slots = np.array([0, 5, 10**12])
    wa = a.windows(slots)
    assert np.array_equal(wa, b.windows(slots))
    assert np.array_equal(wa[1], a.windows(np.array([5]))[0])  # a slot does not depend on its batch
    assert not np.array_equal(wa, SyntheticSource(seed=2, vocab=1000, window=SEQ + 1).windows(slots))
    assert wa.min() >= 0 and wa.max() < 1000
    # learnable: each row repeats a motif of period <= 32
    long = SyntheticSource(seed=1, vocab=1000, window=100).windows(np.arange(20))
    for row in long:
        assert any(np.array_equal(row[p:], row[:-p]) for p in range(4, 33))
    # spread over the vocab (every vocab-parallel shard sees targets)
    assert long.max() > 500


def test_every_token_is_checked_not_a_sample(tmp_path: Path) -> None:
    """8.4M ids with 1.1M out of range away from the head, middle and tail that a sample would read."""
    from trainctl.data.check import scan_cached

    ids = np.random.default_rng(0).integers(0, 256, 8_400_000, dtype="<u2")
    ids[3_000_000:4_100_000] = 60000
    bad = tmp_path / "bad.bin"
    ids.tofile(bad)
    with pytest.raises(UsageError) as e:
        check_token_file(bad, "uint16", SEQ, 256)
    msg = str(e.value)
    assert str(bad) in msg and "token id 60000 at token offset 3,000,000 (byte 6,000,000)" in msg
    assert "1,100,000 of 8,400,000 ids are out of range" in msg
    assert "set data.dtype" not in (e.value.hint or "")  # 60000 is no dtype mix-up
    # the failing result is never cached: a relaunch says where again
    assert not (tmp_path / "bad.bin.trainctl-scan.json").exists()
    assert scan_cached(bad, "uint16", 256).first_bad_offset == 3_000_000


def test_scan_is_cached_by_size_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.data import check as data_check

    path = tmp_path / "ok.bin"
    np.random.default_rng(1).integers(0, 256, 100_000, dtype="<u2").tofile(path)
    assert check_token_file(path, "uint16", SEQ, 256).count == 100_000
    calls: list[str] = []
    real_scan = data_check.scan
    monkeypatch.setattr(data_check, "scan", lambda *a, **k: calls.append("scan") or real_scan(*a, **k))
    check_token_file(path, "uint16", SEQ, 256)
    assert calls == []  # a relaunch reads the cache, not the file
    np.random.default_rng(2).integers(0, 256, 100_001, dtype="<u2").tofile(path)  # changed: rescanned
    check_token_file(path, "uint16", SEQ, 256)
    assert calls == ["scan"]


def test_loader_guards_each_batch_against_a_file_changed_after_the_check(tmp_path: Path) -> None:
    import os

    path = tmp_path / "tokens.bin"
    np.full(10_000, 5, dtype="<u2").tofile(path)
    loader = build_loader(file_spec(path), 0, 1, 0)  # checked (and cached) here
    st = path.stat()
    np.full(10_000, 9999, dtype="<u2").tofile(path)  # same size, rewritten in place ...
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old mtime: the cache still says ok
    with pytest.raises(UsageError, match=r"token id 9999 at token offset [\d,]+ is outside 0..255 = model.vocab - 1 "
                                         r"\(the file changed after it was checked\)"):
        loader.next_step()


def test_every_file_of_a_blend_has_an_identity_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.data import identity as data_identity

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    np.full(1000, 1, dtype="<u2").tofile(a)
    np.full(3000, 2, dtype="<u2").tofile(b)
    spec = make_spec(f"{{blend: [{{path: {a}}}, {{path: {b}, weight: 2}}, {{path: {a}}}]}}")
    hashed: list[str] = []
    real = data_identity.file_digest
    monkeypatch.setattr(data_identity, "file_digest", lambda p: hashed.append(str(p)) or real(p))
    ids = data_identity.of_spec(spec)
    assert [(i.path, i.size) for i in ids] == [(str(a), 2000), (str(b), 6000)] and hashed == [str(a), str(b)]
    assert data_identity.of_spec(spec) == ids and len(hashed) == 2  # read from the cache beside each file
    np.full(1000, 3, dtype="<u2").tofile(a)  # same size, other content
    now = data_identity.of_spec(spec)
    assert hashed[2:] == [str(a)]
    assert [(p, w.split(" (")[0]) for p, w in data_identity.changes(ids, now)] == [(str(a), "same size, other content")]
    assert data_identity.of_spec(make_spec("{synthetic: true}")) == []  # no file: nothing to record


def test_data_check_command(tmp_path: Path) -> None:
    good = tmp_path / "good.bin"
    np.random.default_rng(3).integers(0, 256, 50_000, dtype="<u2").tofile(good)
    r = trainctl("data", "check", str(good), "--vocab", "256")
    assert r.returncode == 0 and "50,000 uint16 tokens, min 0, max 255" in r.stdout and "ok" in r.stdout
    assert r.stdout.startswith(f"{good}: ")  # piped: no blank line where a progress bar would have been
    r = trainctl("data", "check", str(good), "--vocab", "200")
    assert r.returncode == 1 and "ids are outside 0..199" in r.stdout and "--dtype" not in r.stdout
    r = trainctl("data", "check", str(good), "--vocab", "256", "--dtype", "uint32")
    assert r.returncode == 1 and "try --dtype uint16" in r.stdout
    wide = tmp_path / "wide.bin"
    np.fromfile(good, dtype="<u2").astype("<u4").tofile(wide)
    r = trainctl("data", "check", str(wide), "--vocab", "256")
    assert r.returncode == 1 and "looks like uint32" in r.stdout
    r = trainctl("data", "check", str(tmp_path / "missing.bin"), "--vocab", "256")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
