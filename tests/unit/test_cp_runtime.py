"""Context parallelism's one-process parts: the chunk layout the loader deals (each CP rank chunks i and
2cp-1-i of the same sequences, inputs and targets alike), the positions of those chunks, and the bottom-right
causal mask of each query chunk. The multi-rank attention itself is held against one rank by the equivalence
matrix (tests/dist/test_layout_matrix.py, test_context_parallel_matches_one_rank)."""

from __future__ import annotations

import pytest
import torch

from trainctl.runtime.parallel.context_parallel import CPContext, _chunk_attention, reversed_causal_mask, split_sequence
from trainctl.runtime.train.loader import BatchLoader, SyntheticSource

T = 16


def loader(cp: CPContext) -> BatchLoader:
    return BatchLoader(SyntheticSource(3, 256, T + 1), global_batch=4, dp_rank=0, dp_size=1, micro_batch=2,
                       seq_len=T, seed=3, cp=cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_hold_chunks_i_and_2cp_minus_1_minus_i_of_the_same_sequences(cp: int) -> None:
    full_in, full_tg = loader(CPContext.single()).next_step()
    c = T // (2 * cp)
    pieces_in: dict[int, torch.Tensor] = {}
    pieces_tg: dict[int, torch.Tensor] = {}
    for i in range(cp):
        ctx = CPContext(None, cp, i)
        x, y = loader(ctx).next_step()
        assert x.shape == (2, 2, T // cp) and y.shape == x.shape
        for half, j in enumerate((i, 2 * cp - 1 - i)):
            pieces_in[j], pieces_tg[j] = x[..., half * c:(half + 1) * c], y[..., half * c:(half + 1) * c]
        pos = ctx.positions(T // cp)
        assert pos.tolist() == [*range(i * c, (i + 1) * c), *range((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
        assert torch.equal(x, full_in[..., pos]) and torch.equal(y, full_tg[..., pos])
    # every chunk held exactly once, and together they are the whole sequence (targets = inputs shifted)
    assert sorted(pieces_in) == list(range(2 * cp))
    assert torch.equal(torch.cat([pieces_in[j] for j in range(2 * cp)], -1), full_in)
    assert torch.equal(torch.cat([pieces_tg[j] for j in range(2 * cp)], -1), full_tg)


def test_causal_work_is_balanced() -> None:
    """Chunk j attends to j+1 chunks of keys: every rank does (i+1) + (2cp-i) = 2cp+1 chunk pairs."""
    for cp in (2, 4, 16):
        work = [sum(j + 1 for j in CPContext(None, cp, i).chunks()) for i in range(cp)]
        assert work == [2 * cp + 1] * cp


def test_mask_is_the_full_causal_mask_restricted_to_the_chunk() -> None:
    """Row r of chunk j's mask is query c-1-r (queries reversed); it must be the one-rank causal mask's rows
    of chunk j over the keys before the chunk's end, from a storage of a few values, not c x (j+1)c."""
    cp, c = 2, 4
    full = torch.ones(2 * cp * c, 2 * cp * c, dtype=torch.bool).tril()
    for j in range(2 * cp):
        mask = reversed_causal_mask(c, j, torch.float32, torch.device("cpu")).flip(0)
        want = full[j * c:(j + 1) * c, :(j + 1) * c]
        assert torch.equal(mask == 0, want) and bool(torch.isinf(mask[~want]).all())
        shared = reversed_causal_mask(c, j, torch.float32, torch.device("cpu"))
        assert shared.untyped_storage().nbytes() == 4 * (c + (j + 1) * c - 1)  # one vector seen through strides
        assert reversed_causal_mask(c, j, torch.float32, torch.device("cpu")) is shared  # shared by every layer


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-6),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a GPU (causal_lower_right)")),
])
def test_chunk_attention_equals_the_one_rank_rows(device: str, dtype: torch.dtype, tol: float) -> None:
    """A query chunk against its key prefix gives the rows of full causal attention (torch's own SDPA), values
    and gradients; on a GPU through causal_lower_right, on the CPU through the reversed strided mask."""
    torch.manual_seed(0)
    cp, c, d = 2, 8, 16
    T = 2 * cp * c
    q, k, v = (torch.randn(2, n, T, d, device=device, dtype=dtype, requires_grad=True) for n in (4, 2, 2))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    g = torch.randn_like(full)
    want = torch.autograd.grad(full, (q, k, v), g)
    for j in range(2 * cp):
        rows, keys = slice(j * c, (j + 1) * c), (j + 1) * c
        qj, kj, vj = (x.detach()[:, :, sl].requires_grad_() for x, sl in ((q, rows), (k, slice(0, keys)),
                                                                           (v, slice(0, keys))))
        got = _chunk_attention(qj, kj, vj, j, True)
        assert torch.allclose(got.float(), full[:, :, rows].float(), atol=tol)
        gq, gk, gv = torch.autograd.grad(got, (qj, kj, vj), g[:, :, rows])
        # the chunk's queries' own gradient; keys and values get this chunk's share of theirs
        assert torch.allclose(gq.float(), want[0][:, :, rows].float(), atol=tol)
        assert gk.shape == (2, 2, keys, d) and gv.shape == (2, 2, keys, d)


def test_split_refuses_a_sequence_that_does_not_cut_into_2cp_chunks() -> None:
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        split_sequence(torch.zeros(1, 10), CPContext(None, 2, 0))
