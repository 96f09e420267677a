"""Tests of the pattern zoo (sparseflash.patterns).

Every token-level pattern is checked against a brute-force construction on tokens pooled with
`BlockMask.from_dense` (awkward lengths, rectangular blocks, seq_q != seq_k, causal variants);
block-level patterns against their closed forms; plus structure, seeds, algebra and errors.
"""

import itertools
import math
import time

import pytest
import torch

from sparseflash import BlockMask
from sparseflash.patterns import (
    bigbird, butterfly, causal, dense, dilated, fixed, global_tokens, local, longformer, random, stack, strided,
)

# (seq_q, seq_k, block_size): multiples and non-multiples of the block, grids that are not powers
# of two, a single token, rectangular blocks, more and fewer keys than queries.
SHAPES = [
    (64, 64, 8), (100, 100, 16), (77, 77, 8), (1, 1, 8), (130, 130, 13), (96, 96, (8, 16)),
    (50, 90, 8), (90, 50, 16), (13, 200, 8), (200, 13, (16, 4)),
]
SHAPE_IDS = [f"q{q}-k{k}-b{b if isinstance(b, int) else 'x'.join(map(str, b))}" for q, k, b in SHAPES]


def positions(seq_q, seq_k):
    """Token grid: query position p = i + seq_k - seq_q (bottom-right aligned) and key j."""
    i = torch.arange(seq_q)[:, None]
    j = torch.arange(seq_k)[None, :]
    return i + seq_k - seq_q, j


def pooled(token_mask, block_size):
    return BlockMask.from_dense(token_mask, block_size)


def same(mask, ref):
    assert mask.seq_q == ref.seq_q and mask.seq_k == ref.seq_k and mask.block_size == ref.block_size
    assert mask.equal(ref), f"\n{mask.picture()}\n!=\n{ref.picture()}"


def tok_local(p, j, w, is_causal):
    d = p - j
    return (d >= 0) & (d <= w) if is_causal else d.abs() <= w


def tok_global(p, j, g, is_causal):
    g = torch.as_tensor(g, dtype=torch.int64)
    m = torch.isin(p, g) | torch.isin(j, g)
    return m & (j <= p) if is_causal else m.expand(p.shape[0], j.shape[1])


# ---------------------------------------------------------------- exactness vs token definitions
@pytest.mark.parametrize("seq_q,seq_k,bs", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_local_dilated_equal_pooled_tokens(seq_q, seq_k, bs, is_causal):
    p, j = positions(seq_q, seq_k)
    for w in (0, 1, 7, 8, 15, 33, 300):
        same(local(seq_q, w, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(tok_local(p, j, w, is_causal), bs))
        for dil in (1, 2, 3, 8, 16, 40):
            ref = tok_local(p, j, w, is_causal) & ((p - j) % dil == 0)
            same(dilated(seq_q, w, dil, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(ref, bs))


@pytest.mark.parametrize("seq_q,seq_k,bs", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["bidir", "causal"])
def test_sparse_transformer_equal_pooled_tokens(seq_q, seq_k, bs, is_causal):
    p, j = positions(seq_q, seq_k)
    for l in (1, 2, 5, 8, 16, 24, 50):
        if is_causal:
            ref = ((p - l < j) & (j <= p)) | (((p - j) % l == 0) & (j <= p))
        else:
            ref = ((p - j).abs() < l) | ((p - j) % l == 0)
        same(strided(seq_q, l, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(ref, bs))
        for c in sorted({0, 1, l // 2, l}):
            ref = (torch.div(p, l, rounding_mode="floor") == j // l) | (j % l >= l - c)
            if is_causal:
                ref = ref & (j <= p)
            same(fixed(seq_q, l, c, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(ref, bs))


@pytest.mark.parametrize("seq_q,seq_k,bs", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_global_longformer_causal_dense_equal_pooled_tokens(seq_q, seq_k, bs, is_causal):
    p, j = positions(seq_q, seq_k)
    lists = [[0], [seq_k - 1], [0, 3 % seq_k, 17 % seq_k, seq_k // 2], list(range(0, seq_k, 29)), []]
    for g in lists:
        same(global_tokens(seq_q, g, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(tok_global(p, j, g, is_causal), bs))
    for count in (0, 1, min(5, seq_k)):
        same(global_tokens(seq_q, count, block_size=bs, seq_k=seq_k, causal=is_causal),
             pooled(tok_global(p, j, list(range(count)), is_causal), bs))
    for w, dil, g in ((0, 1, [0]), (9, 1, min(3, seq_k)), (12, 4, [seq_k // 3, seq_k - 1])):
        gl = list(range(g)) if isinstance(g, int) else g
        ref = (tok_local(p, j, w, is_causal) & ((p - j) % dil == 0)) | tok_global(p, j, gl, is_causal)
        same(longformer(seq_q, w, g, dilation=dil, block_size=bs, seq_k=seq_k, causal=is_causal), pooled(ref, bs))
    same(causal(seq_q, block_size=bs, seq_k=seq_k), pooled(j <= p, bs))
    same(dense(seq_q, block_size=bs, seq_k=seq_k), pooled(torch.ones(seq_q, seq_k, dtype=torch.bool), bs))


@pytest.mark.parametrize("seq_q,seq_k,bs", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_bigbird_and_random_structure(seq_q, seq_k, bs, is_causal):
    p, j = positions(seq_q, seq_k)
    allowed = pooled(j <= p, bs).layout[0, 0] if is_causal else torch.ones(causal(seq_q, block_size=bs, seq_k=seq_k).num_blocks, dtype=torch.bool)
    for w, g, k in ((0, 0, 1), (8, min(2, seq_k), 2), (20, [seq_k - 1], 3), (5, 1, 1000)):
        gl = list(range(g)) if isinstance(g, int) else g
        base = pooled(tok_local(p, j, w, is_causal) | tok_global(p, j, gl, is_causal), bs).layout[0, 0]
        m = bigbird(seq_q, w, g, k, block_size=bs, seq_k=seq_k, heads=3, seed=5, causal=is_causal)
        assert m.shape[:2] == (1, 3)
        extra = m.layout[0] & ~base
        assert (m.layout[0] >= base).all()  # window + global part is the exact pooled definition
        assert not (extra & ~allowed).any()
        want = (allowed & ~base).sum(-1).clamp(max=k)
        assert torch.equal(extra.sum(-1), want.expand(3, -1))
    diag = pooled(p == j, bs).layout[0, 0]
    for k in (0, 1, 3):
        m = random(seq_q, k, block_size=bs, seq_k=seq_k, heads=2, seed=1, causal=is_causal)
        assert not (m.layout & ~allowed).any()
        assert torch.equal(m.blocks_per_row()[0], allowed.sum(-1).clamp(max=k).expand(2, -1))
        md = random(seq_q, k, block_size=bs, seq_k=seq_k, heads=2, seed=1, diagonal=True, causal=is_causal)
        assert (md.layout[0] >= diag).all()
        assert torch.equal((md.layout[0] & ~diag).sum(-1), (allowed & ~diag).sum(-1).clamp(max=k).expand(2, -1))


@pytest.mark.parametrize("n,bs", [(2048, 32), (1000, 24), (1500, (32, 64))])
def test_exact_at_medium_size(n, bs):
    p, j = positions(n, n)
    same(strided(n, 256, block_size=bs), pooled(((p - 256 < j) & (j <= p)) | (((p - j) % 256 == 0) & (j <= p)), bs))
    same(fixed(n, 200, 24, block_size=bs, causal=False), pooled((p // 200 == j // 200) | (j % 200 >= 176), bs))
    ref = (tok_local(p, j, 100, False) & ((p - j) % 64 == 0)) | tok_global(p, j, [5, 999], False)
    same(longformer(n, 100, [5, 999], dilation=64, block_size=bs), pooled(ref, bs))


# ---------------------------------------------------------------- closed forms and structure
@pytest.mark.parametrize("nb", [1, 2, 4, 8, 16, 64, 256])
def test_butterfly_power_of_two(nb):
    m = butterfly(nb * 16, block_size=16)
    lg = int(math.log2(nb))
    assert torch.equal(m.blocks_per_row(), torch.full((1, 1, nb), 1 + lg))
    assert m.density() == pytest.approx((1 + lg) / nb)
    L = m.layout[0, 0]
    assert torch.equal(L, L.T) and L.diagonal().all()
    i, j = torch.meshgrid(torch.arange(nb), torch.arange(nb), indexing="ij")
    ref = torch.zeros(nb, nb, dtype=torch.bool)
    ref |= i == j
    for k in range(lg):
        ref |= (i ^ j) == (1 << k)
    assert torch.equal(L, ref)
    for nf in range(lg + 1):
        assert torch.equal(butterfly(nb * 16, block_size=16, n_factors=nf).blocks_per_row(), torch.full((1, 1, nb), 1 + nf))


@pytest.mark.parametrize("seq_len,bs", [(5 * 64, 64), (12 * 32 - 7, 32), (1000, 128), (9 * 8 + 1, 8), (1, 128)])
def test_butterfly_crop_stretch_global_causal(seq_len, bs):
    nb = math.ceil(seq_len / bs)
    P = 1 << max(0, (nb - 1).bit_length())
    full = butterfly(P * bs, block_size=bs).layout[0, 0]
    m = butterfly(seq_len, block_size=bs)
    assert torch.equal(m.layout[0, 0], full[:nb, :nb])
    assert m.seq_q == m.seq_k == seq_len
    for size in (s for s in (1, 2, 4) if P % s == 0):
        small = butterfly(size * bs, block_size=bs).layout[0, 0]
        stretched = small.repeat_interleave(P // size, 0).repeat_interleave(P // size, 1)[:nb, :nb]
        assert torch.equal(butterfly(seq_len, block_size=bs, butterfly_size=size).layout[0, 0], stretched)
    g = min(2, nb)
    mg = butterfly(seq_len, block_size=bs, global_blocks=g).layout[0, 0]
    assert mg[:g].all() and mg[:, :g].all() and torch.equal(mg[g:, g:], m.layout[0, 0][g:, g:])
    mc = butterfly(seq_len, block_size=bs, causal=True)
    same(mc, m & causal(seq_len, block_size=bs))
    assert not mc.layout[0, 0].triu(1).any()


@pytest.mark.parametrize("nb,b", [(8, 16), (13, 16), (40, 8)])
@pytest.mark.parametrize("w", [0, 1, 16, 17, 48])
def test_local_blocks_per_row(nb, b, w):
    m = local(nb * b, w, block_size=b)
    r = math.ceil(w / b)
    per_row = m.blocks_per_row()[0, 0]
    assert (per_row[r:nb - r] == min(2 * r + 1, nb)).all()
    assert m.layout.sum() == nb + 2 * sum(nb - d for d in range(1, min(r, nb - 1) + 1))
    mc = local(nb * b, w, block_size=b, causal=True)
    assert (mc.blocks_per_row()[0, 0][r:] == min(r + 1, nb)).all()


@pytest.mark.parametrize("nb,s", [(32, 4), (30, 3), (9, 2), (16, 1)])
def test_sparse_transformer_blocks(nb, s):
    b = 16
    I, J = torch.meshgrid(torch.arange(nb), torch.arange(nb), indexing="ij")
    D = I - J
    ref = ((D >= 0) & (D <= s)) | ((D >= 0) & (D % s == 0))
    assert torch.equal(strided(nb * b, s * b, block_size=b).layout[0, 0], ref)
    ref_bi = (D.abs() <= s) | (D % s == 0)
    assert torch.equal(strided(nb * b, s * b, block_size=b, causal=False).layout[0, 0], ref_bi)
    ref_fixed = ((I // s == J // s) | (J % s == s - 1)) & (D >= 0)
    assert torch.equal(fixed(nb * b, s * b, b // 2, block_size=b).layout[0, 0], ref_fixed)
    # a stride below two blocks puts a multiple of it in every tile
    assert torch.equal(strided(nb * b, b, block_size=b).layout[0, 0], D >= 0)


def test_causal_dense_global_counts():
    for nb in (1, 2, 7, 16):
        m = causal(nb * 32, block_size=32)
        assert m.density() == pytest.approx((nb + 1) / (2 * nb))
        assert torch.equal(m.layout[0, 0], torch.ones(nb, nb, dtype=torch.bool).tril())
        assert dense(nb * 32 - 5, block_size=32).density() == 1.0
    # 250 queries after 1000 keys (a KV cache): bottom-right aligned, so the last row sees every key
    m = causal(250, seq_k=1000, block_size=50)
    assert m.num_blocks == (5, 20) and m.layout[0, 0, -1].all() and m.blocks_per_row()[0, 0].tolist() == [16, 17, 18, 19, 20]
    g = global_tokens(64 * 10, [64 * 3 + 5], block_size=64)
    assert g.blocks_per_row()[0, 0].tolist() == [1, 1, 1, 10, 1, 1, 1, 1, 1, 1]


CAUSAL_BUILDERS = {
    "local": lambda n, k, b: local(n, 13, block_size=b, seq_k=k, causal=True),
    "dilated": lambda n, k, b: dilated(n, 40, 3, block_size=b, seq_k=k, causal=True),
    "strided": lambda n, k, b: strided(n, 24, block_size=b, seq_k=k),
    "fixed": lambda n, k, b: fixed(n, 24, 4, block_size=b, seq_k=k),
    "global": lambda n, k, b: global_tokens(n, [0, k - 1], block_size=b, seq_k=k, causal=True),
    "longformer": lambda n, k, b: longformer(n, 10, 2, block_size=b, seq_k=k, causal=True),
    "bigbird": lambda n, k, b: bigbird(n, 10, 2, 2, block_size=b, seq_k=k, heads=2, causal=True),
    "random": lambda n, k, b: random(n, 3, block_size=b, seq_k=k, heads=2, causal=True),
    "causal": lambda n, k, b: causal(n, block_size=b, seq_k=k),
}


@pytest.mark.parametrize("name", list(CAUSAL_BUILDERS))
def test_causal_variants_stay_below_bottom_right_diagonal(name):
    for n, k, b in ((100, 100, 8), (60, 150, 16), (150, 60, 8), (97, 97, (8, 16))):
        m = CAUSAL_BUILDERS[name](n, k, b)
        p, j = positions(n, k)
        allowed = pooled(j <= p, b).layout
        assert not (m.layout & ~allowed).any()
        assert (m & causal(n, block_size=b, seq_k=k)).equal(m)
        # through the token view: no attended pair lies above the diagonal unless its block straddles it
        above = m.to_dense() & (j > p)
        assert not (above & ~pooled(j <= p, b).to_dense()).any()


# ---------------------------------------------------------------- seeds, heads, stacking, devices
def test_random_seeded_and_per_head():
    a = random(4096, 4, block_size=64, heads=4, seed=7)
    assert a.equal(random(4096, 4, block_size=64, heads=4, seed=7))
    assert not a.equal(random(4096, 4, block_size=64, heads=4, seed=8))
    heads = a.layout[0]
    assert all(not torch.equal(heads[h], heads[0]) for h in range(1, 4))
    b = bigbird(4096, 64, 128, 3, block_size=64, heads=2, seed=3)
    assert b.equal(bigbird(4096, 64, 128, 3, block_size=64, heads=2, seed=3))
    assert not b.equal(bigbird(4096, 64, 128, 3, block_size=64, heads=2, seed=4))
    # roughly uniform: every key block is drawn about equally often over many rows and heads
    counts = random(8192, 8, block_size=32, heads=64, seed=0).layout.sum(dim=(0, 1, 2)).double()
    assert counts.std() / counts.mean() < 0.15


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_random_subsets_are_uniform(is_causal):
    """Every k-subset of a row's candidates is equally likely (chi-square over 4000 heads)."""
    from scipy.stats import chisquare

    heads = 4000
    m = random(6 * 8, 2, block_size=8, heads=heads, seed=123, causal=is_causal).layout[0]  # [heads, 6, 6]
    for row in range(6):
        n_cand = row + 1 if is_causal else 6
        subsets = [c for c in itertools.combinations(range(n_cand), min(2, n_cand))]
        code = {sum(1 << j for j in c): i for i, c in enumerate(subsets)}
        keys = (m[:, row].long() * (1 << torch.arange(6))).sum(-1).tolist()
        counts = torch.bincount(torch.tensor([code[k] for k in keys]), minlength=len(subsets))
        if len(subsets) > 1:
            assert chisquare(counts.numpy()).pvalue > 1e-4, (row, counts.tolist())


@pytest.mark.gpu
def test_cuda_matches_cpu():
    for build in (
        lambda d: random(65536, 5, heads=3, seed=11, device=d),
        lambda d: bigbird(65536, 128, 256, 3, heads=2, seed=2, causal=True, device=d),
        lambda d: fixed(65536 - 100, 1024, 32, block_size=(64, 128), device=d),
        lambda d: longformer(5000, 300, [7, 4000], dilation=2, block_size=32, seq_k=9000, device=d),
        lambda d: butterfly(65536, global_blocks=1, device=d),
    ):
        gpu = build("cuda")
        assert gpu.device.type == "cuda"
        assert gpu.equal(build("cpu"))


def test_stack():
    n = 1024
    parts = [local(n, 63, block_size=32, causal=True), dilated(n, n, 64, block_size=32, causal=True), random(n, 2, block_size=32, heads=2)]
    s = stack(parts)
    assert s.shape == (1, 4, 32, 32)
    assert torch.equal(s.layout[0, 0], parts[0].layout[0, 0]) and torch.equal(s.layout[0, 1], parts[1].layout[0, 0])
    assert torch.equal(s.layout[0, 2:], parts[2].layout[0])
    assert stack([parts[0]]).equal(parts[0])
    with pytest.raises(ValueError, match="seq_q"):
        stack([local(n, 1, block_size=32), local(n + 1, 1, block_size=32)])
    with pytest.raises(ValueError, match="at least one"):
        stack([])
    with pytest.raises(TypeError, match="list or tuple"):
        stack(parts[0])
    with pytest.raises(TypeError, match=r"masks\[1\]"):
        stack([parts[0], parts[0].layout])


# ---------------------------------------------------------------- algebra
def _law_masks():
    n, b = 777, 32
    return [
        local(n, 40, block_size=b), butterfly(n, block_size=b), strided(n, 128, block_size=b),
        random(n, 3, block_size=b, seed=0), random(n, 5, block_size=b, heads=3, seed=1),
        global_tokens(n, [0, 500], block_size=b), causal(n, block_size=b),
    ]


def test_union_intersection_laws():
    ms = _law_masks()
    full, empty = dense(777, block_size=32), ms[0] & BlockMask(torch.zeros(25, 25, dtype=torch.bool), 32, 777)
    for a in ms:
        assert (a | a).equal(a) and (a & a).equal(a)  # idempotence
        assert (a | full).equal(full) and (a & full).equal(a) and (a | empty).equal(a) and (a & empty).equal(empty)
    for a, b in itertools.permutations(ms, 2):
        assert (a | b).equal(b | a) and (a & b).equal(b & a)  # commutativity
        assert (a | (a & b)).equal(a) and (a & (a | b)).equal(a)  # absorption
    for a, b, c in itertools.permutations(ms, 3):
        assert ((a | b) | c).equal(a | (b | c)) and ((a & b) & c).equal(a & (b & c))
        assert (a & (b | c)).equal((a & b) | (a & c)) and (a | (b & c)).equal((a | b) & (a | c))
    # union/intersection act on tokens exactly as on blocks
    a, b = ms[0], ms[2]
    assert torch.equal((a | b).to_dense(), a.to_dense() | b.to_dense())
    assert torch.equal((a & b).to_dense(), a.to_dense() & b.to_dense())
    # the composite generators are unions of their parts
    assert longformer(777, 40, [0, 500], block_size=32).equal(ms[0] | ms[5])


# ---------------------------------------------------------------- speed: never a token-level N x N tensor
def test_64k_builds_without_a_token_level_tensor():
    builders = [
        lambda: butterfly(65536), lambda: local(65536, 512, causal=True), lambda: dilated(65536, 4096, 256),
        lambda: strided(65536, 2048), lambda: fixed(65536, 2048, 32), lambda: global_tokens(65536, 256),
        lambda: random(65536, 8, heads=4), lambda: bigbird(65536, 128, 256, 3, heads=4),
        lambda: longformer(65536, 256, [0, 100]), lambda: causal(65536), lambda: dense(65536),
    ]
    import tracemalloc

    from torch.profiler import ProfilerActivity, profile

    limit = 256 * 2**20  # a token-level 64K x 64K bool tensor is 4 GiB; the block layout 256 KiB
    for build in builders:
        tracemalloc.start()  # NumPy's allocations
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # torch's
                t0 = time.perf_counter()
                m = build()
                ms = (time.perf_counter() - t0) * 1e3  # shown, not asserted: it depends on the machine's load
            numpy_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        torch_max = max([e.cpu_memory_usage for e in prof.events()] + [0])
        assert m.num_blocks == (512, 512)
        assert torch_max < limit and numpy_peak < limit, (f"{m!r}: largest torch allocation {torch_max / 2**20:.0f} MiB, "
                                                          f"NumPy peak {numpy_peak / 2**20:.0f} MiB ({ms:.0f} ms)")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,exc,match", [
    (lambda: local(100, -1), ValueError, "window"),
    (lambda: local(0, 1), ValueError, "seq_len"),
    (lambda: local(100, 1, block_size=0), ValueError, "block_size"),
    (lambda: local(100, 1, block_size=-8), ValueError, "block_size"),
    (lambda: local(100, 1, seq_k=0), ValueError, "seq_k"),
    (lambda: local(100, 1.5), TypeError, "window"),
    (lambda: local(100, 1, causal="yes"), TypeError, "causal"),
    (lambda: local(100.0, 1), TypeError, "seq_len"),
    (lambda: dilated(100, 4, 0), ValueError, "dilation"),
    (lambda: dilated(100, -4, 2), ValueError, "window"),
    (lambda: strided(100, 0), ValueError, "stride"),
    (lambda: fixed(100, 0, 0), ValueError, "stride"),
    (lambda: fixed(100, 8, 9), ValueError, "summary"),
    (lambda: fixed(100, 8, -1), ValueError, "summary"),
    (lambda: global_tokens(100, [100]), ValueError, "positions"),
    (lambda: global_tokens(100, [-1]), ValueError, "positions"),
    (lambda: global_tokens(100, 101), ValueError, "count"),
    (lambda: global_tokens(100, [1.0]), TypeError, "ints"),
    (lambda: global_tokens(100, "abc"), TypeError, "ints"),
    (lambda: global_tokens(100, None), TypeError, "sequence"),
    (lambda: global_tokens(100, torch.tensor([[1]])), TypeError, "1-D"),
    (lambda: random(100, -1), ValueError, "blocks_per_row"),
    (lambda: random(100, 1, heads=0), ValueError, "heads"),
    (lambda: random(100, 1, seed=-1), ValueError, "seed"),
    (lambda: random(100, 1, seed=1.0), TypeError, "seed"),
    (lambda: bigbird(100, 8, 2, -1), ValueError, "random_blocks_per_row"),
    (lambda: bigbird(100, -8, 2, 1), ValueError, "window"),
    (lambda: longformer(100, 8, 2, dilation=0), ValueError, "dilation"),
    (lambda: butterfly(0), ValueError, "seq_len"),
    (lambda: butterfly(1024, block_size=0), ValueError, "block_size"),
    (lambda: butterfly(1024, block_size=(64, 128)), ValueError, "square"),
    (lambda: butterfly(1024, block_size=128, butterfly_size=3), ValueError, "butterfly_size"),
    (lambda: butterfly(1024, block_size=128, butterfly_size=16), ValueError, "butterfly_size"),
    (lambda: butterfly(1024, block_size=128, n_factors=4), ValueError, "n_factors"),
    (lambda: butterfly(1024, block_size=128, global_blocks=9), ValueError, "global_blocks"),
    (lambda: butterfly(1024, block_size=128, global_blocks=-1), ValueError, "global_blocks"),
    (lambda: causal(-5), ValueError, "seq_len"),
    (lambda: dense(10, block_size=True), TypeError, "block_size"),
])
def test_bad_parameters(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_repr_is_readable():
    text = repr(bigbird(4096, 128, 256, 3, heads=2))
    assert text.startswith("BlockMask(seq_q=4096, seq_k=4096, block_size=(128, 128), grid=32x32, batch x heads=1x2")
    assert "(slice batch 0, head 0)" in text and len(text.splitlines()) == 2 + 32
