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


# ---------------------------------------------------------------- from_fn: token-level functions
def _full_token_mask(fn, B, H, Nq, Nk):
    """fn on the whole [B, H, Nq, Nk] index grid at once (the N x N way from_fn avoids)."""
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = torch.arange(Nq).view(1, 1, Nq, 1), torch.arange(Nk).view(1, 1, 1, Nk)
    return fn(b, h, q, kv).expand(B, H, Nq, Nk)


def _doc_fn(Nk, seed, device=None):
    g = torch.Generator().manual_seed(seed)
    docs = torch.cumsum(torch.rand(2, Nk, generator=g) < 0.03, dim=1).to(device)  # per-batch document ids

    def fn(b, h, q_idx, kv_idx):
        return (docs[b, q_idx.clamp(max=Nk - 1)] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    return fn


MASK_FNS = {
    "causal-window": (lambda b, h, q, kv: (kv <= q) & (q - kv <= 37), None, None),
    "per-head-window": (lambda b, h, q, kv: (q - kv).abs() <= 9 * (h + 1), None, 3),
    "documents": (None, 2, None),  # built per shape: docs captured in a closure, indexed by b
    "hash": (lambda b, h, q, kv: ((q * 7 + kv * 13 + b * 5) % 11) == 0, 2, None),
}


@pytest.mark.parametrize("Nq, Nk, block", [(100, 100, 16), (130, 70, (16, 32)), (1, 33, 8), (257, 300, 32)],
                         ids=["N100-b16", "Nq130-Nk70-b16x32", "Nq1-Nk33-b8", "Nq257-Nk300-b32"])
@pytest.mark.parametrize("name", list(MASK_FNS))
def test_from_fn_equals_from_dense(monkeypatch, name, Nq, Nk, block):
    import sparseflash.mask as mask_mod

    monkeypatch.setitem(mask_mod._FN_CHUNK_ELEMS, "cpu", 3000)  # many chunks, uneven
    fn, batch, heads = MASK_FNS[name]
    if fn is None:
        fn = _doc_fn(Nk, Nq)
    tok = _full_token_mask(fn, batch or 1, heads or 1, Nq, Nk)
    want = BlockMask.from_dense(tok, block_size=block)
    m = BlockMask.from_fn(fn, Nq, Nk, block_size=block, batch=batch, heads=heads)
    assert m.equal(want) and torch.equal(m.full.expand_as(want.full), want.full)
    assert torch.equal(m.to_dense(exact=True).expand_as(tok), tok)
    assert bool((m.to_dense() | ~tok).all())  # block level covers every pair fn attends
    assert m.mask_mod is fn
    # brute force on the block grid: full = every real pair on, partial = on but not full
    bq, bk = m.block_size
    for i in range(m.num_blocks[0]):
        for j in range(m.num_blocks[1]):
            tile = tok[..., i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            lb, lh = m.full.shape[:2]
            assert torch.equal(m.full[..., i, j], tile.all(-1).all(-1)[:lb, :lh] & tile.any(-1).any(-1)[:lb, :lh])
    assert torch.equal(m.partial, m.layout & ~m.full)
    assert m.is_exact == (not bool(m.partial.any()))


def test_from_fn_keeps_shared_dims_and_checks():
    m = BlockMask.from_fn(lambda b, h, q, kv: kv <= q, 64, block_size=16, batch=3, heads=2)
    assert m.shape == (1, 1, 4, 4)  # fn ignores b and h: stored shared
    m = BlockMask.from_fn(lambda b, h, q, kv: (kv <= q) | (h == 1), 64, block_size=16, batch=3, heads=2)
    assert m.shape == (1, 2, 4, 4) and bool(m.layout[0, 1].all()) and m.is_exact is False
    aligned = BlockMask.from_fn(lambda b, h, q, kv: (q // 16) >= (kv // 16), 64, block_size=16)
    assert aligned.is_exact and not bool(aligned.partial.any())
    with pytest.raises(TypeError, match="fn must be callable"):
        BlockMask.from_fn(None, 64)
    with pytest.raises(TypeError, match="bool torch.Tensor"):
        BlockMask.from_fn(lambda b, h, q, kv: q - kv, 64, block_size=16)
    with pytest.raises(TypeError, match="bool torch.Tensor"):
        BlockMask.from_fn(lambda b, h, q, kv: True, 64, block_size=16)
    with pytest.raises(ValueError, match="does not broadcast"):
        BlockMask.from_fn(lambda b, h, q, kv: torch.ones(5, dtype=torch.bool), 64, block_size=16)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        BlockMask.from_fn(lambda b, h, q, kv: kv <= q, 64, batch=0)
    with pytest.raises(ValueError, match="seq_q must be positive"):
        BlockMask.from_fn(lambda b, h, q, kv: kv <= q, 0)


def test_from_fn_takes_flex_mask_mods():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 40

    def sink(b, h, q_idx, kv_idx):
        return kv_idx < 4

    fn = flex.or_masks(flex.and_masks(causal, window), flex.and_masks(causal, sink))
    tok = flex.create_mask(fn, None, None, 300, 300, device="cpu")
    m = BlockMask.from_fn(fn, 300, block_size=32)
    assert m.equal(BlockMask.from_dense(tok, block_size=32))
    assert torch.equal(m.to_dense(exact=True)[0, 0], tok[0, 0])
    # the zoo's exact pooled window agrees at block level
    from sparseflash.patterns import global_tokens, local

    zoo = local(300, 40, block_size=32, causal=True) | global_tokens(300, [0, 1, 2, 3], block_size=32, causal=True)
    assert m.equal(zoo & BlockMask.from_layout(torch.ones(10, 10, dtype=torch.bool).tril(), block_size=32, seq_q=300))


def test_partial_blocks_are_computed_whole_with_exact_false():
    """attention(exact=False) is block-level: a partial block counts every pair; the default applies
    mask_mod inside it (the docstrings' promise)."""
    import sparseflash

    fn = MASK_FNS["causal-window"][0]
    m = BlockMask.from_fn(fn, 100, block_size=16)
    assert not m.is_exact
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = sparseflash.attention(q, k, v, m, backend="reference", exact=False)

    def masked(allowed):
        s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
        return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v

    torch.testing.assert_close(out, masked(m.to_dense()))
    assert (out - masked(m.to_dense(exact=True))).abs().max() > 1e-3
    assert sparseflash.attention(q, k, v, m.block_level(), backend="reference").equal(out)
    torch.testing.assert_close(sparseflash.attention(q, k, v, m, backend="reference"), masked(m.to_dense(exact=True)))


def test_combined_masks_keep_the_token_level_definition():
    from sparseflash.patterns import butterfly

    a = BlockMask.from_fn(MASK_FNS["per-head-window"][0], 96, block_size=16, heads=3)
    b = butterfly(96, block_size=16)
    tok_a = a.to_dense(exact=True)
    for op in ("&", "|"):
        c = (a & b) if op == "&" else (a | b)
        want = (tok_a & b.to_dense()) if op == "&" else (tok_a | b.to_dense())
        assert torch.equal(c.to_dense(exact=True), want), op
        # blocks called full really are full (pooling an & is conservative, never wrong)
        truly_full = BlockMask.from_dense(want, block_size=16).full
        assert bool((truly_full | ~c.full).all()), op
    assert (b & b).mask_mod is None and (b & b).is_exact
    from sparseflash.patterns import stack

    s = stack([a, b])
    assert s.shape == (1, 4, 6, 6)
    assert torch.equal(s.to_dense(exact=True), torch.cat([tok_a, b.to_dense()], dim=1))
    assert torch.equal(s.partial[:, 3:], torch.zeros_like(s.partial[:, 3:]))
    moved = a.to("meta")
    assert moved.mask_mod is a.mask_mod and moved.full.device.type == "meta"


# ---------------------------------------------------------------- FlexAttention round trip
def _flex():
    return pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("case", ["shared", "per-batch-head", "tails-rect", "from-fn"])
def test_flex_round_trip(case):
    _flex()
    if case == "shared":
        m = BlockMask.from_layout(rand_layout(6, 6, seed=1), block_size=16)
    elif case == "per-batch-head":
        m = BlockMask.from_layout(rand_layout(2, 3, 6, 5, seed=2), block_size=(16, 32), seq_q=90, seq_k=150)
    elif case == "tails-rect":
        m = BlockMask.from_layout(rand_layout(1, 2, 7, 3, seed=3), block_size=(32, 64), seq_q=200, seq_k=130)
    else:
        m = BlockMask.from_fn(_doc_fn(150, 9), 150, block_size=32, batch=2)
    fb = m.to_flex()
    assert tuple(fb.BLOCK_SIZE) == m.block_size and tuple(fb.seq_lengths) == (m.seq_q, m.seq_k)
    back = BlockMask.from_flex(fb)
    assert back.equal(m) and torch.equal(back.full, m.full) and back.mask_mod is m.mask_mod
    assert torch.equal(back.to_dense(exact=True), m.to_dense(exact=True))
    # Flex's own view: every on block listed once, full blocks in the full lists
    assert int(fb.kv_num_blocks.sum() + fb.full_kv_num_blocks.sum()) == int(m.layout.sum())
    assert int(fb.full_kv_num_blocks.sum()) == int(m.full.sum())


def test_from_flex_of_create_block_mask():
    flex = _flex()
    fn = _doc_fn(200, 4)
    fb = flex.create_block_mask(fn, 2, None, 200, 200, device="cpu", BLOCK_SIZE=32)
    m = BlockMask.from_flex(fb)
    assert m.equal(BlockMask.from_fn(fn, 200, block_size=32, batch=2))
    assert m.mask_mod is fn and torch.equal(m.to_dense(exact=True), flex.create_mask(fn, 2, 1, 200, 200, "cpu"))
    # Flex never calls a tail block full; inside the grid its full blocks are ours
    ours = BlockMask.from_fn(fn, 200, block_size=32, batch=2).full
    assert torch.equal(m.full[..., :-1, :-1], ours[..., :-1, :-1]) and not bool(m.full[..., -1, :].any())
    # a noop mask_mod: every listed block is full
    plain = flex.BlockMask.from_kv_blocks(*[t for t in fb.as_tuple()[2:4]], BLOCK_SIZE=32, seq_lengths=(200, 200))
    p = BlockMask.from_flex(plain)
    assert p.mask_mod is None and p.is_exact
    with pytest.raises(TypeError, match="flex_attention.BlockMask"):
        BlockMask.from_flex(m)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq, Nk", [(96, 96), (80, 150)])
def test_flex_attention_equals_sparseflash(causal, Nq, Nk):
    """Eager flex_attention (CPU) on mask.to_flex() against sparseflash's reference: the same function
    for block-level masks; for a from_fn mask, to_flex is exact and block_level() matches ours."""
    flex = _flex()
    import sparseflash

    g = torch.Generator().manual_seed(Nk)
    q = torch.randn(2, 4, Nq, 16, generator=g)
    k, v = torch.randn(2, 4, Nk, 16, generator=g), torch.randn(2, 4, Nk, 16, generator=g)
    layout = rand_layout(2, 4, math.ceil(Nq / 16), math.ceil(Nk / 32), p=0.5, seed=Nq)
    layout[..., -1] = True  # no empty rows (flex and sparseflash differ there: NaN-free 0 vs 0)
    m = BlockMask.from_layout(layout, block_size=(16, 32), seq_q=Nq, seq_k=Nk)
    want = sparseflash.attention(q, k, v, m, causal=causal, backend="reference")
    got = flex.flex_attention(q, k, v, block_mask=m.to_flex(causal))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    fm = BlockMask.from_fn(lambda b, h, qi, kv: (qi - kv).abs() <= 20 + 10 * h, Nq, Nk, block_size=16, heads=4)
    exact = flex.flex_attention(q, k, v, block_mask=fm.to_flex(causal))
    allowed = fm.to_dense(exact=True)
    if causal:
        allowed = allowed & (torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None] + Nk - Nq)
    s = (q @ k.transpose(-1, -2)) / 4.0
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(exact, p @ v, rtol=1e-5, atol=1e-5)
    block = flex.flex_attention(q, k, v, block_mask=fm.block_level().to_flex(causal))
    torch.testing.assert_close(block, sparseflash.attention(q, k, v, fm, causal=causal, backend="reference",
                                                            exact=False), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exact, sparseflash.attention(q, k, v, fm, causal=causal, backend="reference"),
                               rtol=1e-5, atol=1e-5)


def test_to_flex_other_block_sizes():
    flex = _flex()
    fn = MASK_FNS["causal-window"][0]
    m = BlockMask.from_fn(fn, 200, block_size=16)
    tok = m.to_dense(exact=True)
    for tile in (64, 48, (32, 80)):
        fb = m.to_flex(block_size=tile)
        assert tuple(fb.BLOCK_SIZE) == ((tile, tile) if isinstance(tile, int) else tile)
        back = BlockMask.from_flex(fb)
        want = BlockMask.from_dense(tok, block_size=tile)
        assert back.equal(want), tile  # coarse layout = exact pooling of the token mask
        assert bool((want.full | ~back.full).all()), tile  # never calls a block full that is not
        assert torch.equal(back.to_dense(exact=True), tok), tile
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=g) for _ in range(3))
    a = flex.flex_attention(q, k, v, block_mask=m.to_flex())
    b = flex.flex_attention(q, k, v, block_mask=m.to_flex(block_size=128))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the benchmark's lean form: no lookup in mask_mod, the same block lists
    lean = m.block_level().to_flex(True, layout_in_mask_mod=False)
    assert lean.mask_mod.__name__ == "_causal_mod"
    assert m.block_level().to_flex(layout_in_mask_mod=False).mask_mod is flex.noop_mask


@pytest.mark.gpu
def test_from_fn_64k_causal_window_cuda():
    """64K x 64K causal sliding window (4.3e9 pairs) from its mask_mod, on the GPU, well under a second;
    the layout equals the zoo's exact pooled window, its full blocks are the interior of the band."""
    import time

    from sparseflash.patterns import local

    n, w = 65536, 1000

    def fn(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= w)

    BlockMask.from_fn(fn, 4096, device="cuda")  # CUDA context and kernels warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = BlockMask.from_fn(fn, n, device="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"from_fn 64K x 64K causal window: {seconds * 1000:.1f} ms")
    assert seconds < 1.0
    assert m.equal(local(n, w, causal=True, device="cuda"))
    i = torch.arange(512, device="cuda")[:, None]
    d = i - torch.arange(512, device="cuda")[None, :]  # block offsets: pairs in block (i, j) span d*128 +- 127
    band_full = (d >= 1) & (d * 128 + 127 <= w)
    assert torch.equal(m.full[0, 0], band_full)


# ---------------------------------------------------------------- mask= of attention: Flex masks and other types
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_takes_flex_block_mask(backend, device):
    """A torch FlexAttention BlockMask as mask= is converted by from_flex: the same output and
    gradients as the converted mask, once per Flex mask object; a block-level Flex mask (noop
    mask_mod) is exact, so flex_attention itself agrees."""
    flex = _flex()
    import sparseflash
    from sparseflash.mask import as_block_mask

    Nq, Nk = 70, 100
    dtype = torch.float32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, Nq, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(2, 1, Nk, 16, generator=g).to(device, dtype) for _ in range(2))
    fn = _doc_fn(100, 3, device)
    fb = flex.create_block_mask(lambda b, h, qi, kv: fn(b, h, qi + 30, kv), 2, None, Nq, Nk, device=device,
                                BLOCK_SIZE=32)
    conv = as_block_mask(fb)
    assert isinstance(conv, BlockMask) and as_block_mask(fb) is conv  # cached per Flex mask
    assert conv.equal(BlockMask.from_flex(fb)) and torch.equal(conv.full, BlockMask.from_flex(fb).full)
    for causal in (False, True):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
        a = sparseflash.attention(qa, ka, va, fb, causal=causal, backend=backend)
        b = sparseflash.attention(qb, kb, vb, BlockMask.from_flex(fb), causal=causal, backend=backend)
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
        for x, y in ((qa, qb), (ka, kb), (va, vb)):
            assert torch.equal(x.grad, y.grad)
    # block-level: every listed block full, so attention is exactly Flex's
    layout = rand_layout(2, 1, 3, 4, p=0.6, seed=3)
    layout[..., -1] = True  # no empty rows
    m = BlockMask.from_layout(layout, block_size=32, seq_q=Nq, seq_k=Nk).to(device)
    lean = m.to_flex(layout_in_mask_mod=False)  # the block lists only (eager Flex reads just mask_mod)
    assert as_block_mask(lean).is_exact and as_block_mask(lean).equal(m)
    want = flex.flex_attention(q.double(), k.double(), v.double(), block_mask=m.to_flex(), enable_gqa=True)
    got = sparseflash.attention(q, k, v, lean, backend=backend)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_attention_mask_of_another_type_says_how_to_build_one():
    import sparseflash

    q = torch.randn(1, 1, 64, 16)
    causal_fn = lambda b, h, qi, kv: kv <= qi  # noqa: E731
    for bad, what in [(causal_fn, "function"), (torch.ones(64, 64, dtype=torch.bool), "tensor"),
                      (np.ones((1, 1), dtype=bool), "ndarray"), ("causal", "str")]:
        for backend in ("reference", "auto"):
            with pytest.raises(TypeError, match="mask must be a sparseflash.BlockMask") as e:
                sparseflash.attention(q, q, q, bad, backend=backend)
            msg = str(e.value)
            assert what in msg and all(f"BlockMask.{c}" in msg for c in ("from_fn", "from_dense", "from_flex")), msg
    # a Flex mask built for other lengths: the lengths error
    flex = _flex()
    fb = flex.create_block_mask(causal_fn, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="mask was built for seq_q=32, seq_k=32"):
        sparseflash.attention(q, q, q, fb)


def test_token_mod_is_the_exact_truth():
    """`BlockMask.token_mod` evaluated on every pair gives `to_dense(exact=True)`, for a mask with a
    token-level definition and for a layout-only one (its blocks)."""
    n = 70
    with_fn = BlockMask.from_fn(lambda b, h, i, j: (i >= j) & (i - j < 9), n, block_size=16)
    layout_only = BlockMask.from_layout(torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0]], dtype=torch.bool), block_size=32)
    for mask, seq in ((with_fn, n), (layout_only, 96)):
        i = torch.arange(seq).view(1, 1, -1, 1)
        j = torch.arange(seq).view(1, 1, 1, -1)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        got = mask.token_mod()(zero, zero, i, j).expand(1, 1, seq, seq)
        assert torch.equal(got, mask.to_dense(exact=True).expand(1, 1, seq, seq))


def test_dynamic_layout_index_is_sync_free_form():
    """from_layout(dynamic=True): the same lists as a plain mask, ranked without a sort, and no density
    read back (None), even outside a trace; the plain mask's index keeps its density."""
    from sparseflash.mask import ranked_lists, sorted_nonzero

    lay = torch.rand(2, 3, 6, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    dyn, plain = BlockMask.from_layout(lay, 16, dynamic=True), BlockMask.from_layout(lay, 16)
    a, b = dyn.index(), plain.index()
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("kv_num", "kv_idx", "q_num", "q_idx"))
    assert a.density is None and dyn.index().density is None and b.density == plain.density()
    assert dyn.dynamic and not plain.dynamic
    empty = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    assert torch.equal(ranked_lists(empty)[1], sorted_nonzero(empty)[1]) and (ranked_lists(empty)[1] == 4).all()
