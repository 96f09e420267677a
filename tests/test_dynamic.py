"""Per-call masks: `BlockMask.from_indices`, ``from_layout(dynamic=True)``, `sparseflash.topk_blocks`
and SparseAttention's per-step selection. CPU lane: small sizes, the kernels under the interpreter;
the GPU tests (graph capture with changing inputs, CUDA sync-debug mode) are skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

import sparseflash
from sparseflash import BlockMask, topk_blocks
from sparseflash.mask import ranked_lists, sorted_nonzero
from tests._attn_check import check_attention, make_qkv

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _random_indices(shape, kb, seed=0, pad=0.3, dup=0.3):
    """Key-block ids of ``shape`` [.., QB, K]: random, with -1 padding and repeats."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, kb, shape, generator=g)
    ids = torch.where(torch.rand(shape, generator=g) < dup, ids[..., :1].expand(shape), ids)
    return torch.where(torch.rand(shape, generator=g) < pad, -1, ids)


def _layout_of(ids: torch.Tensor, kb: int) -> torch.Tensor:
    """The bool layout that ids mean, built by a plain loop."""
    while ids.dim() < 4:
        ids = ids.unsqueeze(0)
    lay = torch.zeros(*ids.shape[:3], kb, dtype=torch.bool)
    for b, h, i, j in torch.cartesian_prod(*(torch.arange(n) for n in ids.shape)).tolist():
        v = int(ids[b, h, i, j])
        if v >= 0:
            lay[b, h, i, v] = True
    return lay


# ------------------------------------------------------------------ from_indices / ranked lists
def test_ranked_lists_equal_sorted_nonzero():
    lay = torch.rand(2, 3, 9, 7, generator=torch.Generator().manual_seed(1)) < 0.4
    lay[0, 0, 2] = False  # an empty row
    lay[1, 2, 3] = True  # a full one
    for t in (lay, lay.transpose(-1, -2)):
        (c1, i1), (c2, i2) = ranked_lists(t), sorted_nonzero(t)
        assert torch.equal(c1, c2) and torch.equal(i1, i2) and i1.dtype == torch.int32


@pytest.fixture(params=["torch", "kernel"])
def index_path(request, monkeypatch):
    """from_indices through its torch ops or through the Triton index kernel (on CPU under the
    interpreter: `index_kernels.ON_CPU`; on a GPU the kernel is what CUDA ids take anyway)."""
    from sparseflash import index_kernels

    if request.param == "kernel":
        if DEV == "cpu" and not sparseflash._env.interpreting():
            pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
        monkeypatch.setattr(index_kernels, "ON_CPU", True)
    elif DEV == "cuda":
        monkeypatch.setattr(index_kernels, "takes", lambda ids: False)
        monkeypatch.setattr(index_kernels, "select_takes", lambda q, kb, width: False)
    return request.param


@pytest.mark.parametrize("hq,hk,nq,nk,d,block,dtype", [
    (2, 2, 256, 256, 16, 64, torch.float32),            # whole blocks
    (4, 2, 200, 300, 40, (64, 32), torch.bfloat16),     # GQA, tail blocks, rectangular, head dim not a power of 2
    (1, 1, 17, 130, 24, 128, torch.float16),            # one partial query block
], ids=["whole", "gqa-tails-rect", "one-partial"])
def test_pool_pair_matches_pool_blocks(hq, hk, nq, nk, d, block, dtype):
    """The selection's one-launch pooling (`index_kernels.pool_pair`) gives `pool_blocks`' block means
    (tail blocks over their real tokens) for q and k of any strides, in float32 to rounding."""
    if DEV == "cpu" and not sparseflash._env.interpreting():
        pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
    from sparseflash.dynamic import pool_blocks
    from sparseflash.index_kernels import pool_pair

    bq, bk = (block, block) if isinstance(block, int) else block
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, nq, hq, d, generator=g).to(dtype).to(DEV).transpose(1, 2)  # [B, H, N, D] view of BNHD
    k = (torch.randn(2, hk, nk, d, generator=g) + 3).to(dtype).to(DEV)
    qp, kp = pool_pair(q, k, bq, bk)
    for got, x, b in ((qp, q, bq), (kp, k, bk)):
        want = pool_blocks(x, b)
        assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,seq_q,seq_k,block", [
    ((1, 1, 4, 3), 64, 64, 16),            # square, shared
    ((2, 3, 5, 6), 70, 100, (16, 32)),     # batch x heads, partial tail blocks, rectangular
    ((3, 4, 2), 128, 130, (32, 16)),       # 3-D (heads), rectangular the other way
    ((4, 1), 64, 64, 16),                  # 2-D, K = 1
], ids=["B1H1", "B2H3-rect", "H3-rect", "2d-K1"])
def test_from_indices_matches_from_layout(shape, seq_q, seq_k, block, index_path):
    bq, bk = (block, block) if isinstance(block, int) else block
    kb = math.ceil(seq_k / bk)
    ids = _random_indices(shape, kb)
    ids[..., 0, :] = -1  # a query block that attends nothing
    m = BlockMask.from_indices(ids.to(torch.int32).to(DEV), seq_q, seq_k, block)
    want = BlockMask.from_layout(_layout_of(ids, kb).to(DEV), block, seq_q, seq_k)
    assert m.density_bound == min(ids.shape[-1], kb) / kb >= want.density()
    assert m.dynamic and m.equal(want) and m.block_size == (bq, bk) and (m.seq_q, m.seq_k) == (seq_q, seq_k)
    got, ref = m.index(), want.index()
    for name in ("kv_num", "kv_idx", "q_num", "q_idx"):
        a, b = getattr(got, name), getattr(ref, name)
        assert torch.equal(a, b.expand_as(a)) and a.dtype == torch.int32, name
    assert got.density is None and ref.density == want.density()  # a dynamic mask never reads it back
    # both paths leave the state a constructed mask has (the kernel path builds it without __init__)
    plain = BlockMask.from_layout(m.layout, block, seq_q, seq_k, dynamic=True)
    for name in BlockMask.__slots__:
        if name not in ("layout", "_index_cache", "density_bound"):
            assert getattr(m, name) == getattr(plain, name), name
    assert list(m._index_cache) == [m.layout.device]


def test_index_kernel_awkward_ids(index_path):
    """Strided ids (a transposed view), int8 and int64 ids far outside int32 (ignored with check=False,
    never wrapped onto a real block), a row of only -1, K wider than the key blocks, one query block."""
    from sparseflash.mask import ranked_lists

    g = torch.Generator().manual_seed(5)
    base = torch.randint(-1, 6, (2, 7, 3, 12), generator=g)
    cases = [(base.transpose(1, 2), 6), (base[:, :2].to(torch.int8), 6), (base[:1, :1, :1], 6),
             (base[:1, :1].clamp(min=0).to(torch.uint8), 6)]
    far = base[:1, :1].clone()
    far[..., 0, :3] = torch.tensor([2**32 + 1, -(2**40), 2**31])  # would alias blocks 1 and 0 if cast to int32
    cases.append((far, 6))
    for ids, kb in cases:
        ids = ids.to(DEV)
        m = BlockMask.from_indices(ids, ids.shape[2] * 16, kb * 16, 16, check=False)
        ok = (ids >= 0) & (ids < kb)
        lay = torch.zeros(*ids.shape[:3], kb + 1, dtype=torch.bool, device=ids.device)
        lay.scatter_(-1, torch.where(ok, ids.long(), kb), True)
        lay = lay[..., :kb]
        assert torch.equal(m.layout, lay)
        got = m.index()
        for (num, idx), t in (((got.kv_num, got.kv_idx), lay), ((got.q_num, got.q_idx), lay.transpose(-1, -2))):
            want_num, want_idx = ranked_lists(t)
            assert torch.equal(num, want_num) and torch.equal(idx, want_idx)
            assert idx.is_contiguous() and idx.dtype == torch.int32


def test_from_indices_int64_and_broadcasting():
    """Any integer dtype; [1, H] and [B, 1] broadcast like layouts do; seq_k defaults to seq_q."""
    ids = _random_indices((1, 2, 4, 5), 4, seed=3)
    a = BlockMask.from_indices(ids, 64, block_size=16)
    b = BlockMask.from_indices(ids.to(torch.int16), 64, 64, 16)
    assert a.equal(b) and a.shape == (1, 2, 4, 4)
    a.check_broadcast(3, 2)
    with pytest.raises(ValueError, match="broadcast"):
        a.check_broadcast(3, 4)


@pytest.mark.parametrize("bad,err,match", [
    (torch.zeros(4, 2), TypeError, "indices must be an integer"),
    (torch.zeros(4, 2, dtype=torch.bool), TypeError, "indices must be an integer"),
    ([[0, 1]], TypeError, "indices must be an integer"),
    (torch.zeros(4, dtype=torch.long), ValueError, r"indices must be \[q_blocks, K\]"),
    (torch.zeros(1, 1, 1, 4, 2, dtype=torch.long), ValueError, r"indices must be \[q_blocks, K\]"),
    (torch.zeros(3, 2, dtype=torch.long), ValueError, "indices has 3 query blocks"),
    (torch.full((4, 2), 4), ValueError, r"key-block ids in \[0, 4\) or -1"),
    (torch.full((4, 2), -2), ValueError, r"got -2 at \(0, 0, 0, 0\)"),
], ids=["float", "bool", "list", "1d", "5d", "rows", "too-big", "below--1"])
def test_from_indices_rejects_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        BlockMask.from_indices(bad, 64, 64, 16)


def test_from_indices_block_and_check_options():
    ids = torch.zeros(4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="multiples of 16"):
        BlockMask.from_indices(ids, 40, 40, 10)
    with pytest.raises(TypeError, match="check must be a bool"):
        BlockMask.from_indices(ids, 64, 64, 16, check=1)
    with pytest.raises(ValueError, match="seq_q must be positive"):
        BlockMask.from_indices(ids, 0, 64, 16)
    # check=False: out-of-range ids are ignored, never read or written out of bounds
    m = BlockMask.from_indices(torch.tensor([[7, 1], [-5, -1], [0, 0], [3, 99]]), 64, 64, 16, check=False)
    assert m.layout[0, 0].int().tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        BlockMask.from_layout(torch.eye(2, dtype=torch.bool), 16, dynamic="yes")


def test_dynamic_flag_survives_moves():
    m = BlockMask.from_indices(torch.tensor([[0], [1]]), 32, 32, 16)
    assert m.to("meta").dynamic and m.block_level().dynamic
    assert m.to("meta").index("meta").density is None


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_from_indices_mask(causal):
    """The kernels (interpreter on CPU) with a from_indices mask against the float64 reference,
    rectangular blocks, GQA, an empty query block, duplicates and -1 padding."""
    B, Hq, Hk, N, D = 1, 4, 2, 96, 16
    q, k, v, do = make_qkv(B, Hq, Hk, N, N, D, torch.float32, DEV, seed=5)
    bq, bk = 32, 16
    ids = _random_indices((B, Hq, N // bq, 4), N // bk, seed=7)
    ids[:, 1, 2] = -1
    mask = BlockMask.from_indices(ids.to(DEV), N, N, (bq, bk))
    o = sparseflash.attention(q, k, v, mask, causal=causal)
    assert not torch.isnan(o).any() and (o[:, 1, 2 * bq:3 * bq] == 0).all()  # the empty query block: 0
    check_attention(lambda q, k, v: sparseflash.attention(q, k, v, mask, causal=causal), q, k, v, do,
                    mask=mask, causal=causal)


# ------------------------------------------------------------------ topk_blocks
def _topk_loop(q, k, num, bq, bk, causal, group=1, sinks=0):
    """The top-k layout, one query block at a time, from the definition in sparseflash.dynamic."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    qb, kb = math.ceil(Nq / bq), math.ceil(Nk / bk)
    off = Nk - Nq
    lay = torch.zeros(B, Hq, qb, kb, dtype=torch.bool)
    for b in range(B):
        for s in range(Hq // group):
            heads = range(s * group, (s + 1) * group)
            n = num if isinstance(num, int) else num[s]
            for i in range(qb):
                rows = range(i * bq, min(Nq, (i + 1) * bq))
                score = torch.zeros(kb, dtype=torch.float64)
                for h in heads:
                    qm = q[b, h, i * bq:(i + 1) * bq].double().mean(0)
                    for j in range(kb):
                        km = k[b, h // (Hq // Hk), j * bk:(j + 1) * bk].double().mean(0)
                        score[j] += float(qm @ km) / group
                on = set()
                cand = list(range(kb))
                if causal:
                    own = {j for j in range(kb) for r in rows if j * bk <= r + off < (j + 1) * bk}
                    on |= own
                    first = min(own) if own else (0 if rows[0] + off < 0 else kb)
                    cand = [j for j in cand if j < first]
                    visible = [j for j in range(kb) if j * bk <= rows[-1] + off]
                    on |= {j for j in range(min(sinks, kb)) if j in visible}
                else:
                    on |= set(range(min(sinks, kb)))
                cand = [j for j in cand if j >= sinks]
                cand.sort(key=lambda j: -score[j])
                on |= set(cand[:n])
                for h in heads:
                    for j in on:
                        lay[b, h, i, j] = True
    return lay


@pytest.mark.parametrize("case", [
    dict(Nq=128, Nk=128, block=16, num=3, causal=False),
    dict(Nq=128, Nk=128, block=16, num=3, causal=True),
    dict(Nq=100, Nk=130, block=(32, 16), num=2, causal=True),       # partial tails, rectangular, offset
    dict(Nq=96, Nk=96, block=(16, 32), num=1, causal=True),         # query block narrower than key block
    dict(Nq=128, Nk=128, block=16, num=20, causal=True),            # more than allowed: all of them
    dict(Nq=128, Nk=128, block=16, num=2, causal=True, sinks=2),
    dict(Nq=128, Nk=128, block=16, num=2, causal=False, sinks=1),
    dict(Nq=128, Nk=128, block=16, num=2, causal=True, group=2),    # GQA groups share a selection
    dict(Nq=128, Nk=128, block=16, num=[0, 1, 3, 5], causal=True),  # per-head counts
    dict(Nq=128, Nk=128, block=16, num=0, causal=False),            # nothing selected
], ids=["plain", "causal", "rect-offset", "rect-narrow", "all", "sinks-causal", "sinks", "groups", "per-head",
        "zero"])
def test_topk_blocks_against_loop(case, index_path):
    """The selection (and the index) through the torch ops and through the Triton kernels
    (`index_kernels.topk_ids`, `lists_from_ids`) against a plain loop over blocks."""
    case = dict(case)
    group, sinks = case.pop("group", 1), case.pop("sinks", 0)
    B, Hq, Hk, D = 2, 4, 2, 8
    q, k, _, _ = make_qkv(B, Hq, Hk, case["Nq"], case["Nk"], D, torch.float32, "cpu", seed=11)
    bq, bk = (case["block"],) * 2 if isinstance(case["block"], int) else case["block"]
    m = topk_blocks(q.to(DEV), k.to(DEV), case["num"], case["block"], case["causal"], group_size=group,
                    sink_blocks=sinks)
    want = _topk_loop(q, k, case["num"], bq, bk, case["causal"], group, sinks)
    assert m.shape == tuple(want.shape) and m.dynamic
    assert torch.equal(m.layout.cpu(), want), (m.layout.cpu() ^ want).nonzero()[:5]


def test_topk_blocks_counts_per_row():
    """Causal, square blocks, seq_q == seq_k: row i holds min(i, n) selected blocks + its own."""
    q, k, _, _ = make_qkv(1, 2, 2, 256, 256, 8, torch.float32, "cpu", seed=2)
    m = topk_blocks(q, k, 4, 16, causal=True)
    rows = m.blocks_per_row()[0, 0]
    assert rows.tolist() == [min(i, 4) + 1 for i in range(16)]
    assert m.layout.diagonal(dim1=-2, dim2=-1).all()
    assert not m.layout.triu(1).any()


@pytest.mark.parametrize("kw,err,match", [
    (dict(num_blocks=-1), ValueError, "num_blocks must be >= 0"),
    (dict(num_blocks=1.5), TypeError, "num_blocks must be an int"),
    (dict(num_blocks=[1, 2]), ValueError, "one count per selection"),
    (dict(num_blocks=2, group_size=3), ValueError, "group_size must be a positive divisor"),
    (dict(num_blocks=2, sink_blocks=-1), ValueError, "sink_blocks must be an int >= 0"),
    (dict(num_blocks=2, causal=1), TypeError, "causal must be a bool"),
    (dict(num_blocks=2, block_size=8), ValueError, "multiples of 16"),
])
def test_topk_blocks_rejects_bad_arguments(kw, err, match):
    q, k, _, _ = make_qkv(1, 4, 2, 64, 64, 8, torch.float32, "cpu")
    with pytest.raises(err, match=match):
        topk_blocks(q, k, **{"block_size": 16, **kw})


def test_topk_blocks_rejects_bad_tensors():
    q, k, _, _ = make_qkv(1, 4, 2, 64, 64, 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match="k must be a floating-point tensor"):
        topk_blocks(q, k[0], 2, 16)
    with pytest.raises(ValueError, match="must divide q's heads"):
        topk_blocks(q, k[:, :1].expand(1, 3, 64, 8), 2, 16)
    with pytest.raises(ValueError, match="share batch and head_dim"):
        topk_blocks(q, k[..., :4], 2, 16)


# ------------------------------------------------------------------ torch.compile, nn
def test_compile_fullgraph_selection_index_and_attention():
    """topk_blocks + from_indices + attention in one torch.compile(fullgraph=True) graph (CPU: the
    eager backend runs the traced graph, the kernels under the interpreter): no graph break, and
    the result of the eager call."""
    q, k, v, _ = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, DEV, seed=4)

    def step(q, k, v):
        mask = topk_blocks(q, k, 1, 16, causal=True)
        return sparseflash.attention(q, k, v, mask, causal=True)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(q, k, v)
    assert torch.equal(got, step(q, k, v))


def test_sparse_attention_topk_option():
    from sparseflash.nn import SparseAttention

    torch.manual_seed(0)
    attn = SparseAttention(32, 4, 2, causal=True, block_size=16, topk=2, topk_sinks=1, topk_share_kv=True)
    x = torch.randn(2, 80, 32)
    y = attn(x)
    q, k, v = attn.project(x)
    mask = topk_blocks(q, k, 2, 16, causal=True, group_size=2, sink_blocks=1)
    want = attn.output(sparseflash.attention(q, k, v, mask, causal=True, backend="reference"))
    assert torch.allclose(y, want, atol=1e-6)
    y.sum().backward()
    assert attn.qkv.weight.grad is not None and torch.isfinite(attn.qkv.weight.grad).all()
    with pytest.raises(ValueError, match="topk and pattern"):
        SparseAttention(32, 4, pattern="local", topk=2)
    with pytest.raises(ValueError, match="topk must be"):
        SparseAttention(32, 4, topk=-1)


# ------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu
def test_sync_free_under_sync_debug_mode():
    """from_indices, its index and the attention forward and backward make no host synchronisation."""
    q, k, v, do = make_qkv(1, 4, 4, 1024, 1024, 64, torch.bfloat16, "cuda")
    q.requires_grad_(True)
    sparseflash.attention(q, k, v, topk_blocks(q, k, 2, 128, causal=True), causal=True).backward(do)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = topk_blocks(q, k, 2, 128, causal=True)
        mask = BlockMask.from_indices(torch.topk(torch.randn(1, 4, 8, 8, device="cuda"), 3).indices, 1024)
        o = sparseflash.attention(q, k, v, mask, causal=True)
        o.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
def test_from_indices_on_cuda_takes_the_kernel():
    """CUDA ids build the lists in the one launch (the index is there before anyone asks), the same as
    the torch path's, for top-k ids as they come (best first, int64)."""
    q, k, _, _ = make_qkv(2, 4, 4, 1000, 1000, 64, torch.bfloat16, "cuda")
    from sparseflash.dynamic import topk_indices

    ids = topk_indices(q, k, 3, 64, causal=True)
    m = BlockMask.from_indices(ids, 1000, block_size=64)
    assert m._index_cache and m.density_bound == min(ids.shape[-1], 16) / 16
    assert torch.equal(m.layout.cpu(), _layout_of(ids.cpu(), 16))
    want = BlockMask.from_layout(m.layout.clone(), 64, 1000)
    got, ref = m.index(), want.index()
    for name in ("kv_num", "kv_idx", "q_num", "q_idx"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@gpu
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, group_size=2, sink_blocks=1),
                                dict(causal=False, num_blocks=[1, 2, 5, 9])])
def test_selection_on_cuda_takes_the_kernel(kw, monkeypatch):
    """CUDA inputs select in the one launch (`index_kernels.topk_ids`), giving the torch ops' ids
    (best first) on random data, GQA, shared selections, sinks and per-head counts included."""
    from sparseflash import index_kernels
    from sparseflash.dynamic import topk_indices

    kw = dict(kw)
    num = kw.pop("num_blocks", 6)
    q, k, _, _ = make_qkv(2, 4, 2, 2000, 2100, 128, torch.bfloat16, "cuda", seed=5)
    calls = []
    orig = index_kernels.topk_ids
    monkeypatch.setattr(index_kernels, "topk_ids", lambda *a, **k_: calls.append(1) or orig(*a, **k_))
    got = topk_indices(q, k, num, 128, **kw)
    monkeypatch.setattr(index_kernels, "select_takes", lambda q, kb, width: False)
    want = topk_indices(q, k, num, 128, **kw)
    assert calls and got.shape == want.shape and torch.equal(got < 0, want < 0)
    if not torch.equal(got, want):  # only where two scores tie to float32 rounding (products summed in another order)
        from sparseflash.dynamic import block_scores

        g = kw.get("group_size", 1)
        sc = block_scores(q, k, 128, g).repeat_interleave(g, dim=1)  # [B, Hq, QB, KB]
        pick = lambda ids: sc.gather(-1, ids.clamp(min=0))  # noqa: E731
        torch.testing.assert_close(pick(got), pick(want), rtol=1e-5, atol=1e-6)


@gpu
def test_cuda_graph_replay_with_changing_inputs():
    """One captured graph: topk selection + from_indices + attention, replayed with new q, k, v; each
    replay equals an eager call on the same inputs."""
    N = 1024
    q, k, v, _ = make_qkv(1, 4, 2, N, N, 64, torch.bfloat16, "cuda")

    def step():
        mask = topk_blocks(q, k, 2, 128, causal=True, group_size=2)
        return sparseflash.attention(q, k, v, mask, causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2, 3):
        nq, nk, nv, _ = make_qkv(1, 4, 2, N, N, 64, torch.bfloat16, "cuda", seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        want = step()  # eager, the new inputs' own selection (a stale mask would differ by O(0.1))
        assert (out.float() - want.float()).abs().max() < 2e-2, seed
        ref = sparseflash.attention(nq.double(), nk.double(), nv.double(),
                                    topk_blocks(nq, nk, 2, 128, causal=True, group_size=2), causal=True,
                                    backend="reference")
        assert (out.double() - ref).abs().max() < 3e-2, seed


# ------------------------------------------------------------------ scripts (CPU smoke runs)
def test_topk_train_script_runs(tmp_path):
    import csv

    from sparseflash.experiments import topk_train

    assert topk_train.main(["--out", str(tmp_path), "--steps", "2", "--seq-len", "32", "--d-model", "16",
                            "--batch", "2", "--layers", "1"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "topk_train.csv")))
    assert [r["variant"] for r in rows] == ["dense", "dense", "local", "local", "topk", "topk"]
    assert all(math.isfinite(float(r["loss"])) for r in rows) and (tmp_path / "topk_train.png").stat().st_size


def test_dynamic_bench_cpu_smoke(tmp_path):
    import json

    from sparseflash.experiments.bench import dynamic

    assert dynamic.main(["--device", "cpu", "--out", str(tmp_path), "--tokens", "64", "--block", "16", "--heads", "1",
                           "--ks", "2"]) == 0
    rows = json.loads((tmp_path / "dynamic.json").read_text())["rows"]
    assert {r["provider"] for r in rows} == {"select", "index", "fixed", "per-call"}
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["max_diff"] == 0.0 for r in rows if r["provider"] == "per-call")  # the same mask, the same kernels
    assert (tmp_path / "dynamic.png").stat().st_size and (tmp_path / "dynamic.csv").stat().st_size
    # --merge: a run of other (head_dim, K) pairs keeps the earlier rows; a run of the same pairs replaces them
    new = [dict(r, k_blocks=1) for r in rows]
    merged = dynamic.merge_rows(tmp_path / "dynamic.json", new)
    assert merged == rows + new
    assert dynamic.merge_rows(tmp_path / "dynamic.json", rows[:1]) == rows[:1]


def test_from_indices_check_under_compile():
    """Inside torch.compile the value check is torch._assert_async (no host read): good ids trace to
    the eager lists, a bad id fails with the message naming the range."""
    def lists(ids):
        return BlockMask.from_indices(ids, 64, 64, 16).index().kv_idx

    ids = torch.tensor([[0, 1], [2, -1], [3, 3], [1, 0]])
    torch._dynamo.reset()
    compiled = torch.compile(lists, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids), lists(ids))
    with pytest.raises(RuntimeError, match=r"key-block ids in \[0, 4\) or -1"):
        compiled(ids + 5)


def test_per_call_step_op_counts():
    """The host cost of an eager per-call step, as ops dispatched (experiments/studies/dynamic_host):
    a repeated selection launches only its data-dependent ops, and the shape-only ones it caches are
    never handed out for writing."""
    from sparseflash.experiments.studies.dynamic_host.host_breakdown import count_ops
    from sparseflash.dynamic import topk_indices

    q, k = (torch.randn(1, 2, 256, 16, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    first = topk_indices(q, k, 1, 32, causal=True)
    n_ops, ops = count_ops(lambda: topk_indices(q, k, 1, 32, causal=True))
    assert n_ops <= 20 and "arange" not in ops and "constant_pad_nd" not in ops, ops
    first.fill_(7)  # writing into one call's ids leaves the next call's alone
    assert torch.equal(topk_indices(q, k, 1, 32, causal=True), topk_indices(q, k, 1, 32, causal=True))
    assert int(topk_indices(q, k, 1, 32, causal=True).max()) < 8
    no_k = topk_indices(q, k, 0, 32, causal=True)  # only the cached own blocks: a copy of them
    no_k.fill_(5)
    assert int(topk_indices(q, k, 0, 32, causal=True)[0, 0, 0, 0]) == 0


_COMPILE_INDEX_KERNEL = """
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"cannot compile for CUDA here: {e}")
    sys.exit(3)
from sparseflash.index_kernels import _lists_kernel
for ids in ("*i64", "*i32", "*u8"):
    sig = dict(IDS=ids, LAYOUT="*u8", KV_NUM="*i32", KV_IDX="*i32", Q_NUM="*i32", Q_IDX="*i32", stride_ib="i32",
               stride_ih="i32", stride_iq="i32", stride_ik="i32", H="i32", QB="i32", KB="i32", K="i32",
               BLOCK_J="constexpr", BLOCK_I="constexpr", BLOCK_K="constexpr")
    src = ASTSource(_lists_kernel, sig, constexprs={"BLOCK_J": 128, "BLOCK_I": 128, "BLOCK_K": 16})
    print(ids, len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
from sparseflash.index_kernels import _topk_kernel
for causal, per_sel, kb in ((True, False, 128), (False, True, 256)):
    sig = dict(QP="*fp32", KP="*fp32", FIXED="*i64", PER_SEL="*i64", OUT="*i64", stride_qb="i32", stride_qh="i32",
               stride_qm="i32", stride_kb="i32", stride_kh="i32", stride_kn="i32", n_sel="i32", group="i32",
               heads_per_kv="i32", QB="i32", KB="i32", n_fixed="i32", width="i32", bq="i32", bk="i32", off="i32",
               sinks="i32", inv_group="fp32", D="constexpr", BLOCK_R="constexpr", BLOCK_KB="constexpr",
               BLOCK_D="constexpr", BLOCK_F="constexpr", CAUSAL="constexpr", HAS_PER_SEL="constexpr")
    src = ASTSource(_topk_kernel, sig, constexprs=dict(D=128, BLOCK_R=16, BLOCK_KB=kb, BLOCK_D=64, BLOCK_F=4,
                                                       CAUSAL=causal, HAS_PER_SEL=per_sel))
    print("topk", causal, len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
from sparseflash.index_kernels import _pool_kernel
for dq, dk, d in (("*bf16", "*bf16", 128), ("*fp16", "*fp32", 80)):
    sig = dict(Q=dq, K=dk, QP="*fp32", KP="*fp32", Hq="i32", Hk="i32", NQ="i32", NK="i32", QB="i32", KB="i32",
               bq="i32", bk="i32", stride_qb="i32", stride_qh="i32", stride_qn="i32", stride_qd="i32",
               stride_kb="i32", stride_kh="i32", stride_kn="i32", stride_kd="i32", D="constexpr",
               BLOCK_T="constexpr", BLOCK_D="constexpr")
    src = ASTSource(_pool_kernel, sig, constexprs=dict(D=d, BLOCK_T=32, BLOCK_D=128))
    print("pool", dq, dk, len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
"""


def test_index_kernel_compiles_for_sm90():
    """The index and selection kernels' compiled path (which the interpreter never takes) builds for sm_90 without a
    GPU: Triton's front end, its passes and the bundled ptxas, in a child process outside the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _COMPILE_INDEX_KERNEL], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("\n") == 7
