"""The trainer's data: a deterministic, resumable, layout-independent batch loader.

Every optimizer step k owns the global sequence slots g = k*global_batch + j, j < global_batch. DP
rank r of dp takes the contiguous slots [r*per_rank, (r+1)*per_rank), per_rank = global_batch/dp, split
into micro-batches in order. So the global batch of a step is the same sequences in the same order for
every layout, which is what makes a DP=4 run reproduce a single-process run.

A slot maps to its sequence in O(1) (no replay), so the loader state is just the slot counter:
- token file: slot g is window perm_e[g mod W] of epoch e = g // W, where W = (tokens-1) // seq_len
  non-overlapping windows of seq_len+1 tokens and perm_e is a permutation seeded by (seed, e);
- synthetic: slot g's tokens are a pure function of (seed, g), a counter-based hash.

Under context parallelism the CP ranks of one replica read the same slots and keep their own chunks of each
sequence, inputs and targets alike (runtime/parallel/context_parallel.split_sequence): the data position is the same
counter whatever cp is, so a resume may change cp.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from trainctl.data.prep import check_token_file
from trainctl.errors import UsageError
from trainctl.runtime.parallel.context_parallel import CPContext, split_sequence
from trainctl.spec import RunSpec

STATE_VERSION = 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over uint64 arrays (wraps mod 2**64): a cheap counter-based hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(*keys: np.ndarray | int) -> np.ndarray:
    """Hash of a tuple of keys (broadcast): wrap-around is the point, so overflow warnings are off."""
    h = np.zeros((), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in keys:
            h = _mix(h ^ (np.asarray(k, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)))
    return h


class SyntheticSource:
    """Learnable synthetic sequences: a short motif repeated to fill the window.

    The motif (period 4..32) is a walk on a fixed sparse Markov chain over 64 ids spread evenly over
    the vocab (each id has 4 successors), so a model first learns the id set and the chain (loss
    towards ln 4) and then to copy the motif (towards 0): the loss visibly falls within a few steps
    (tiny preset: about 6.2 -> 3.8 in 20 steps of 16 sequences).
    """

    BRANCH = 4
    ACTIVE = 64
    MIN_PERIOD, MAX_PERIOD = 4, 32

    def __init__(self, seed: int, vocab: int, window: int) -> None:
        self.seed, self.vocab, self.window = seed, vocab, window
        self.active = min(vocab, self.ACTIVE)
        self.stride = vocab // self.active  # spread the ids over the vocab: every TP shard sees targets
        ids = np.arange(self.active, dtype=np.uint64)[:, None]
        branches = np.arange(self.BRANCH, dtype=np.uint64)[None, :]
        self.successors = (_hash(seed, 4, ids, branches) % np.uint64(self.active)).astype(np.int64)

    def windows(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), window] int64 token ids, each row a pure function of (seed, slot)."""
        key = slots.astype(np.uint64)[:, None]
        seed = np.uint64(self.seed)
        span = np.uint64(self.MAX_PERIOD - self.MIN_PERIOD + 1)
        period = np.minimum(self.MIN_PERIOD + (_hash(seed, key, 1) % span).astype(np.int64), self.window)
        steps = np.arange(self.MAX_PERIOD, dtype=np.uint64)[None, :]
        branch = (_hash(seed, key, 2, steps) % np.uint64(self.BRANCH)).astype(np.int64)
        motif = np.empty((len(slots), self.MAX_PERIOD), dtype=np.int64)
        motif[:, 0] = (_hash(seed, key, 3) % np.uint64(self.active)).astype(np.int64)[:, 0]
        for i in range(1, self.MAX_PERIOD):  # the chain walk is sequential; vectorised over slots
            motif[:, i] = self.successors[motif[:, i - 1], branch[:, i]]
        pos = np.arange(self.window, dtype=np.int64)[None, :] % period
        return np.take_along_axis(motif, pos, axis=1) * self.stride


class TokenFileSource:
    """Windows of seq_len+1 tokens from a token file (flat or Megatron), shuffled per epoch.

    Each window is read with pread, not through a memory map: a file truncated under the running rank is then a
    short read, named here, where a mapped page past the new end would kill the rank with SIGBUS."""

    def __init__(self, path: str, dtype: str, seq_len: int, vocab: int, seed: int, fmt: str = "auto") -> None:
        tf = check_token_file(path, dtype, seq_len, vocab, fmt)  # every token checked (cached beside the file)
        n = tf.count
        self.file, self.dtype = tf.path, np.dtype(tf.dtype).newbyteorder("<")
        self.fd = os.open(tf.path, os.O_RDONLY)  # held for the process's life: the windows are read from it
        self.size = os.fstat(self.fd).st_size
        self.path, self.vocab = path, vocab
        self.seq_len, self.seed = seq_len, seed
        self.num_windows = (n - 1) // seq_len  # window i covers tokens [i*seq_len, i*seq_len + seq_len]
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # cached: a step's slots almost always share one epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def windows(self, slots: np.ndarray) -> np.ndarray:
        out = np.empty((len(slots), self.seq_len + 1), dtype=np.int64)
        for i, g in enumerate(slots.tolist()):
            epoch, index = divmod(g, self.num_windows)
            start = int(self._permutation(epoch)[index]) * self.seq_len
            out[i] = self._read(start)
        # The whole file was checked at start (data_check); this guards against a file changed since.
        if out.size and (int(out.max()) >= self.vocab or int(out.min()) < 0):
            row, col = divmod(int(np.argmax((out >= self.vocab) | (out < 0))), self.seq_len + 1)
            epoch, index = divmod(int(slots[row]), self.num_windows)
            offset = int(self._permutation(epoch)[index]) * self.seq_len + col
            raise UsageError(f"data.path {self.path}: token id {int(out[row, col])} at token offset {offset:,} "
                             f"is outside 0..{self.vocab - 1} = model.vocab - 1 (the file changed after it was "
                             "checked)",
                             hint=f"run `trainctl data check {self.path} --vocab {self.vocab}`")
        return out

    def _read(self, start: int) -> np.ndarray:
        """Tokens [start, start + seq_len] of the file."""
        want = (self.seq_len + 1) * self.dtype.itemsize
        raw = os.pread(self.fd, want, start * self.dtype.itemsize)
        if len(raw) < want:
            raise UsageError(f"data file {self.file} was truncated under the running run: it is "
                             f"{os.fstat(self.fd).st_size:,} bytes, {self.size:,} when this rank started (reading "
                             f"token offset {start:,})",
                             hint="put the original file back; `trainctl resume` continues from the newest checkpoint")
        return np.frombuffer(raw, dtype=self.dtype)

    def epoch_of(self, slot: int) -> int:
        return slot // self.num_windows


class BlendedSource:
    """A weighted blend of token sources, still O(1) per slot and layout-independent.

    Slots are dealt out in blocks of BLOCK: within every block, slot i goes to the source that is furthest
    below its share after i slots (the greedy rule of Megatron's blended dataset), so each block holds
    round(weight * BLOCK) slots of each source in the same order. Slot g is then block g // BLOCK,
    position g % BLOCK, and its index inside its source is (g // BLOCK) * count + rank within the block:
    a pure function of g, so the loader state stays one counter and resume is exact."""

    BLOCK = 1000

    def __init__(self, sources: list[TokenFileSource], weights: list[float]) -> None:
        total = sum(weights)
        shares = [w / total for w in weights]
        self.sources = sources
        self.of_position = np.empty(self.BLOCK, dtype=np.int64)
        self.rank_in_block = np.empty(self.BLOCK, dtype=np.int64)
        taken = [0] * len(sources)
        for i in range(self.BLOCK):
            d = max(range(len(sources)), key=lambda k: (shares[k] * (i + 1) - taken[k], -k))
            self.of_position[i], self.rank_in_block[i] = d, taken[d]
            taken[d] += 1
        self.per_block = np.array(taken, dtype=np.int64)

    def windows(self, slots: np.ndarray) -> np.ndarray:
        block, pos = np.divmod(slots.astype(np.int64), self.BLOCK)
        which = self.of_position[pos]
        inner = block * self.per_block[which] + self.rank_in_block[pos]
        out = np.empty((len(slots), self.sources[0].seq_len + 1), dtype=np.int64)
        for d, src in enumerate(self.sources):
            rows = np.nonzero(which == d)[0]
            if len(rows):
                out[rows] = src.windows(inner[rows])
        return out


class BatchLoader:
    """Yields this DP rank's share of each optimizer step's global batch; its state is one counter."""

    def __init__(self, source: SyntheticSource | TokenFileSource | BlendedSource, *, global_batch: int, dp_rank: int,
                 dp_size: int, micro_batch: int, seq_len: int, seed: int, cp: CPContext | None = None) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise UsageError(f"data loader: dp_rank {dp_rank} is not in 0..{dp_size - 1}")
        if global_batch % (dp_size * micro_batch):
            raise UsageError(f"train.global_batch {global_batch} is not divisible by dp {dp_size} x "
                             f"parallel.micro_batch {micro_batch}",
                             hint="make global_batch a multiple of dp * micro_batch")
        self.source = source
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.per_rank = global_batch // dp_size
        self.micro_batch, self.micro_batches = micro_batch, self.per_rank // micro_batch
        self.seq_len, self.seed = seq_len, seed
        self.cp = cp or CPContext.single()  # this rank keeps its context-parallel chunks of each sequence
        self.step = 0  # optimizer steps consumed
        self.consumed = 0  # global sequence slots consumed (all ranks); the next step starts here

    def batch_at(self, first_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for the global batch starting at `first_slot` (no state change)."""
        start = first_slot + self.dp_rank * self.per_rank
        slots = np.arange(start, start + self.per_rank, dtype=np.int64)
        win = torch.from_numpy(self.source.windows(slots))
        win = win.view(self.micro_batches, self.micro_batch, self.seq_len + 1)
        return split_sequence(win[..., :-1], self.cp).contiguous(), split_sequence(win[..., 1:], self.cp).contiguous()

    def next_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [micro_batches, micro_batch, seq_len/cp]; targets are inputs shifted by one
        (before this rank's chunks are taken)."""
        out = self.batch_at(self.consumed)
        self.consumed += self.global_batch
        self.step += 1
        return out

    @property
    def epoch(self) -> int:
        src = self.source
        return src.epoch_of(self.consumed) if isinstance(src, TokenFileSource) else 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "step": self.step, "consumed": self.consumed,
                "epoch": self.epoch, "seed": self.seed,
                "source": "synthetic" if isinstance(self.source, SyntheticSource) else "file"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where a saved run stopped: the next step starts at the saved slot counter."""
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"data loader state version {state.get('version')!r} is not {STATE_VERSION}",
                             hint="resume with the trainctl version that wrote the checkpoint")
        if int(state["seed"]) != self.seed:
            raise UsageError(f"data loader state has seed {state['seed']}, this run has {self.seed}",
                             hint="resume with the same train.seed as the checkpointed run")
        self.step = int(state["step"])
        self.consumed = int(state["consumed"])


def build_loader(spec: RunSpec, dp_rank: int, dp_size: int, seed: int, cp: CPContext | None = None) -> BatchLoader:
    """The loader for one DP replica (and CP rank); micro_batches = global_batch / (dp_size * micro_batch)."""
    seq_len = spec.model.seq_len
    source: SyntheticSource | TokenFileSource | BlendedSource
    if spec.data.synthetic:
        source = SyntheticSource(seed, spec.model.vocab, seq_len + 1)
    elif spec.data.blend:
        # each source shuffles with its own seed, so two blended copies of one file do not move in lockstep
        parts = [TokenFileSource(s.path, s.dtype, seq_len, spec.model.vocab, seed + 7919 * (i + 1), s.format)
                 for i, s in enumerate(spec.data.blend)]
        source = BlendedSource(parts, [s.weight for s in spec.data.blend])
    else:
        assert spec.data.path is not None  # the spec model guarantees one source
        source = TokenFileSource(spec.data.path, spec.data.dtype, seq_len, spec.model.vocab, seed, spec.data.format)
    return BatchLoader(source, global_batch=spec.train.global_batch, dp_rank=dp_rank, dp_size=dp_size,
                       micro_batch=spec.parallel.micro_batch, seq_len=seq_len, seed=seed, cp=cp)
