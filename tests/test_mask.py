"""BlockMask: construction, validation, density and pair counts, algebra, dense round trips, and
the compressed index form against a brute-force listing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparseflash import BlockMask


def rand_layout(*shape, p=0.4, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


# ---------------------------------------------------------------- construction
def test_from_layout_shapes_and_defaults():
    m = BlockMask.from_layout(rand_layout(4, 3), block_size=16)
    assert m.shape == (1, 1, 4, 3) and (m.seq_q, m.seq_k) == (64, 48) and m.block_size == (16, 16)
    m = BlockMask.from_layout(rand_layout(2, 8, 8), seq_q=1000)
    assert m.shape == (1, 2, 8, 8) and m.seq_k == 1000 and m.block_size == (128, 128)
    m = BlockMask.from_layout(rand_layout(3, 2, 4, 2), block_size=(32, 64), seq_q=100, seq_k=70)
    assert m.shape == (3, 2, 4, 2) and m.num_blocks == (4, 2)
    m = BlockMask.from_layout(np.ones((2, 2), dtype=bool), block_size=32, seq_q=40)
    assert m.layout.dtype == torch.bool


@pytest.mark.parametrize("bad, exc, match", [
    (torch.ones(2, 2), TypeError, "torch.bool"),
    (torch.ones(2, 2, dtype=torch.int64), TypeError, "torch.bool"),
    ([[True]], TypeError, "torch.Tensor"),
    (torch.ones(2, dtype=torch.bool), ValueError, "q_blocks, k_blocks"),
    (torch.ones(1, 1, 1, 2, 2, dtype=torch.bool), ValueError, "q_blocks, k_blocks"),
    (torch.ones(0, 2, dtype=torch.bool), ValueError, "at least one block"),
])
def test_from_layout_bad_layouts(bad, exc, match):
    with pytest.raises(exc, match=match):
        BlockMask.from_layout(bad, block_size=16, seq_q=32)


def test_lengths_must_match_grid():
    with pytest.raises(ValueError, match=r"does not match seq_q=300"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=128, seq_q=300)
    with pytest.raises(ValueError, match="seq_k=500"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=128, seq_q=256, seq_k=500)
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=0, seq_q=10)
    with pytest.raises(TypeError, match="block_size"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=(16, 16, 16), seq_q=10)
    with pytest.raises(ValueError, match="seq_q must be positive"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=16, seq_q=0)
    with pytest.raises(TypeError, match="seq_q must be an int"):
        BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=16, seq_q=32.0)


@pytest.mark.parametrize("Nq, Nk, block", [(100, 100, 32), (65, 130, (16, 64)), (1, 7, 16), (128, 128, 128)])
def test_from_dense_pools_any_and_round_trips(Nq, Nk, block):
    g = torch.Generator().manual_seed(Nq)
    tok = torch.rand(2, Nq, Nk, generator=g) < 0.01
    m = BlockMask.from_dense(tok, block_size=block)
    bq, bk = (block, block) if isinstance(block, int) else block
    assert m.num_blocks == (math.ceil(Nq / bq), math.ceil(Nk / bk))
    for h in range(2):
        for i in range(m.num_blocks[0]):
            for j in range(m.num_blocks[1]):
                want = bool(tok[h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any())
                assert bool(m.layout[0, h, i, j]) == want
    dense = m.to_dense()
    assert dense.shape == (1, 2, Nq, Nk)
    assert bool((dense | ~tok).all())  # every on token pair lies in an on block
    assert BlockMask.from_dense(dense[0], block_size=block).equal(m)  # blocks -> tokens -> blocks


def test_from_dense_errors():
    with pytest.raises(TypeError, match="torch.bool"):
        BlockMask.from_dense(torch.ones(4, 4))
    with pytest.raises(ValueError, match="seq_q, seq_k"):
        BlockMask.from_dense(torch.ones(4, dtype=torch.bool))


# ---------------------------------------------------------------- density and counts
def test_density_and_token_density_with_tails():
    layout = torch.tensor([[True, False], [True, True]])
    m = BlockMask.from_layout(layout, block_size=64, seq_q=100, seq_k=80)  # blocks 64 + 36 rows, 64 + 16 cols
    assert m.density() == 0.75
    pairs = 64 * 64 + 36 * 64 + 36 * 16
    assert int(m.attended_pairs()) == pairs
    assert m.token_density() == pytest.approx(pairs / (100 * 80))
    assert m.token_density() == pytest.approx(m.to_dense().float().mean().item())


@pytest.mark.parametrize("Nq, Nk, block", [(100, 100, 32), (100, 37, 16), (37, 100, (32, 16)), (129, 129, 64)])
def test_causal_pair_counts_match_brute_force(Nq, Nk, block):
    m = BlockMask.from_layout(rand_layout(*(math.ceil(n / b) for n, b in zip((Nq, Nk), (block, block) if isinstance(block, int) else block)), p=0.6, seed=Nq),
                              block_size=block, seq_q=Nq, seq_k=Nk)
    i = torch.arange(Nq)[:, None]
    j = torch.arange(Nk)[None, :]
    tok = m.to_dense()[0, 0] & (j <= i + Nk - Nq)
    assert int(m.attended_pairs(causal=True)) == int(tok.sum())
    assert m.token_density(causal=True) == pytest.approx(tok.float().mean().item())


# ---------------------------------------------------------------- algebra
def test_or_and_broadcast_and_laws():
    a = BlockMask.from_layout(rand_layout(2, 4, 4, seed=1), block_size=16)
    b = BlockMask.from_layout(rand_layout(4, 4, seed=2), block_size=16)
    c = BlockMask.from_layout(rand_layout(1, 4, 4, seed=3), block_size=16)
    assert (a | b).shape == (1, 2, 4, 4)
    assert torch.equal((a | b).layout, a.layout | b.layout)
    assert torch.equal((a & b).layout, a.layout & b.layout)
    assert (a | b).equal(b | a) and (a & b).equal(b & a)
    assert ((a | b) | c).equal(a | (b | c))
    assert (a & (b | c)).equal((a & b) | (a & c))
    assert (a | (a & b)).equal(a) and (a & a).equal(a)


def test_combine_errors():
    a = BlockMask.from_layout(rand_layout(4, 4), block_size=16)
    with pytest.raises(ValueError, match="cannot combine"):
        a | BlockMask.from_layout(rand_layout(4, 4), block_size=16, seq_q=60)
    with pytest.raises(ValueError, match="do not broadcast"):
        BlockMask.from_layout(rand_layout(2, 4, 4), block_size=16) & BlockMask.from_layout(rand_layout(3, 4, 4), block_size=16)
    with pytest.raises(TypeError):
        a | torch.ones(4, 4, dtype=torch.bool)


# ---------------------------------------------------------------- index form
def brute_force_lists(layout):
    rows, cols = {}, {}
    B, H, QB, KB = layout.shape
    for b in range(B):
        for h in range(H):
            for i in range(QB):
                rows[b, h, i] = [j for j in range(KB) if layout[b, h, i, j]]
            for j in range(KB):
                cols[b, h, j] = [i for i in range(QB) if layout[b, h, i, j]]
    return rows, cols


@pytest.mark.parametrize("shape", [(7, 5), (3, 6, 6), (2, 3, 4, 9), (1, 1)])
def test_index_form_matches_brute_force(shape):
    layout = rand_layout(*shape, p=0.35, seed=sum(shape))
    layout[..., 0, :] = False  # an empty row
    layout[..., :, -1] = False  # an empty column
    m = BlockMask.from_layout(layout, block_size=16)
    idx = m.index()
    rows, cols = brute_force_lists(m.layout)
    B, H, QB, KB = m.shape
    for (b, h, i), want in rows.items():
        n = int(idx.kv_num[b, h, i])
        assert n == len(want) and idx.kv_idx[b, h, i, :n].tolist() == want
        assert (idx.kv_idx[b, h, i, n:] == KB).all()
    for (b, h, j), want in cols.items():
        n = int(idx.q_num[b, h, j])
        assert n == len(want) and idx.q_idx[b, h, j, :n].tolist() == want
    assert idx.kv_idx.dtype == torch.int32 and idx.q_num.dtype == torch.int32
    assert m.index() is idx  # cached


def test_to_and_repr():
    m = BlockMask.from_layout(rand_layout(2, 40, 40), block_size=16, seq_q=630)
    assert m.to("cpu") is m
    text = repr(m)
    assert "seq_q=630" in text and "density=" in text and "head 0" in text and "blocks, on if any is on" in text
    assert len(text.splitlines()) >= 20
    assert m.expand_as_heads(3, 2).shape == (3, 2, 40, 40)
    with pytest.raises(ValueError, match="does not broadcast"):
        m.expand_as_heads(1, 3)
