"""Packed variable-length sequences (segment_ids): the reference against a naive token mask, the
block lists the segments prune, and the Triton kernels against the float64 reference (output
and every gradient within 2x PyTorch's own error, outputs poisoned with NaN), combined with
block masks, causal, key_lengths, GQA, dropout and return_lse. CPU (interpreter) at small sizes;
on a GPU the same files plus real sizes."""

from __future__ import annotations

import math

import pytest
import torch
from _attn_check import check_attention, make_qkv

import sparseflash
from sparseflash import BlockMask, reference
from sparseflash.flash import TileConfig, autograd, launch, tile_config
from sparseflash.mask import sorted_nonzero
from sparseflash.segments import check_segment_ids, segment_block_layout, segments_from_cu_seqlens

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


@pytest.fixture
def small_blocks(monkeypatch, device):
    """On CPU, lists of 32-token blocks when segments alone prune (mask=None), so that rows of a
    hundred tokens have several blocks to skip; on a GPU the default (128)."""
    if device == "cpu":
        monkeypatch.setattr(autograd, "SEGMENT_BLOCK", 32)


def _id(p):
    return str(p).replace("torch.", "")


def packed_ids(lengths, device="cpu", pad_to=None, pad_id=None) -> torch.Tensor:
    """int32 [N]: document d repeated lengths[d] times (then padding up to pad_to)."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if pad_to is not None and pad_to > len(ids):
        ids = torch.cat([ids, torch.full((pad_to - len(ids),), len(lengths) if pad_id is None else pad_id)])
    return ids.to(device=device, dtype=torch.int32)


def random_lengths(total: int, mean: float, seed: int, min_len: int = 1) -> list[int]:
    """Document lengths summing to ``total``: exponential with this mean (so length-1 documents
    occur), the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        n = max(min_len, int(-mean * math.log(1.0 - float(torch.rand(1, generator=g)))))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def _seg_batch(lengths_per_row, device):
    return torch.stack([packed_ids(l, device) for l in lengths_per_row])


def _naive_mask(seg_q, seg_k, Nq, Nk, causal, key_lengths=None):
    m = seg_q[:, :, None] == seg_k[:, None, :]
    if causal:
        m = m & (torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None] + Nk - Nq)
    if key_lengths is not None:
        m = m & (torch.arange(Nk)[None, None, :] < key_lengths[:, None, None])
    return m[:, None]


# ---------------------------------------------------------------- conversion and validation
def test_segments_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)  # an empty document (index 1)
    assert segments_from_cu_seqlens(cu).tolist() == [[0, 0, 0, 2, 3, 3, 3, 3, 3]]
    padded = segments_from_cu_seqlens(cu, total=12)
    assert padded.dtype == torch.int32 and padded.shape == (1, 12)
    assert padded[0, 9:].tolist() == [4, 4, 4]  # padding: a fresh id after the last document
    for bad in ([1, 3], [0, 5, 4], [0, 20]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            segments_from_cu_seqlens(torch.tensor(bad), total=10)
    with pytest.raises(TypeError, match="integer"):
        segments_from_cu_seqlens(torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="at least one document"):
        segments_from_cu_seqlens(torch.tensor([0]))


def test_clear_errors(device):
    q, k, v, _ = make_qkv(2, 1, 1, 20, 30, 16, torch.float32, device)
    seg_q, seg_k = torch.zeros(2, 20, dtype=torch.int32, device=device), torch.zeros(2, 30, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="self-attention"):
        sparseflash.attention(q, k, v, segment_ids=seg_q)
    with pytest.raises(TypeError, match="integer dtype"):
        sparseflash.attention(q, k, v, segment_ids=(seg_q.float(), seg_k))
    with pytest.raises(ValueError, match=r"segment_ids\[1\] \(keys\) must have shape"):
        sparseflash.attention(q, k, v, segment_ids=(seg_q, seg_q))
    with pytest.raises(ValueError, match="shape"):
        sparseflash.attention(q, k, v, segment_ids=(seg_q[:, None], seg_k))
    with pytest.raises(TypeError, match="pair"):
        sparseflash.attention(q, k, v, segment_ids=[seg_q])
    with pytest.raises(ValueError, match="fit in int32"):
        sparseflash.attention(q, k, v, segment_ids=(seg_q.long() + 2**40, seg_k))
    # a leading 1 broadcasts over the batch; int64 is converted
    s = check_segment_ids((seg_q[:1].long(), seg_k), 2, 20, 30, q.device)
    assert s[0].dtype == torch.int32 and s[0].shape == (1, 20)


# ---------------------------------------------------------------- the reference
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_naive_mask(causal):
    B, H, Nq, Nk, D = 2, 2, 40, 50, 16
    q, k, v, _ = make_qkv(B, H, 1, Nq, Nk, D, torch.float64, "cpu", seed=1)
    seg_k = _seg_batch([[10, 1, 20, 19], [50]], "cpu")
    seg_q = seg_k[:, Nk - Nq:]  # the last Nq positions as queries: bottom-right causal inside documents
    kl = torch.tensor([45, 50])
    mask = BlockMask.from_layout(torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0)) < 0.7,
                                 block_size=16, seq_q=Nq, seq_k=Nk)
    got = reference.attention(q, k, v, mask, causal=causal, key_lengths=kl, segment_ids=(seg_q, seg_k), chunk_rows=7)
    tok = _naive_mask(seg_q, seg_k, Nq, Nk, causal, kl) & mask.to_dense()
    want = reference.naive_attention(q, k, v, tok)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_packed_equals_separate_documents():
    """Packing is only a layout: each document's rows equal attention over that document alone."""
    lengths = [5, 1, 17, 9]
    N = sum(lengths)
    q, k, v, _ = make_qkv(1, 2, 2, N, N, 16, torch.float64, "cpu", seed=2)
    seg = packed_ids(lengths)[None]
    out = reference.attention(q, k, v, causal=True, segment_ids=seg)
    s = 0
    for n in lengths:
        sl = slice(s, s + n)
        alone = reference.attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True)
        torch.testing.assert_close(out[:, :, sl], alone, rtol=1e-12, atol=1e-12)
        s += n


# ---------------------------------------------------------------- block lists
def _pooled(seg_q, seg_k, bq, bk):
    tok = (seg_q[:, :, None] == seg_k[:, None, :])[:, None]
    return BlockMask.from_dense(tok, block_size=(bq, bk)).layout


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (64, 32)])
def test_segment_block_layout(blocks):
    """For ids that never decrease the layout is exactly the pooled token mask (blocks sharing a
    document); for ids in any order it covers it (never drops a pair)."""
    bq, bk = blocks
    seg = _seg_batch([random_lengths(150, 20, seed=3), [16] * 9 + [6], random_lengths(150, 5, seed=4)], "cpu")
    assert torch.equal(segment_block_layout(seg, seg, bq, bk), _pooled(seg, seg, bq, bk))
    seg_q = seg[:, 150 - 70:]  # cross lengths, non-multiples of the blocks
    assert torch.equal(segment_block_layout(seg_q, seg, bq, bk), _pooled(seg_q, seg, bq, bk))
    shuffled = seg[:, torch.randperm(150, generator=torch.Generator().manual_seed(5))]
    got, want = segment_block_layout(shuffled, shuffled, bq, bk), _pooled(shuffled, shuffled, bq, bk)
    assert bool((got | ~want).all())
    # padding marked -1 after the documents widens the range of the block where it starts (the
    # last): that block overlaps every other; as a fresh id (n + 1) it overlaps only its documents
    pad = torch.cat([seg[:1, :145], torch.full((1, 5), -1, dtype=torch.int32)], dim=1)
    assert bool(segment_block_layout(pad, pad, bq, bk)[0, 0, -1].all())
    pad[0, 145:] = seg[0, 144] + 1
    assert torch.equal(segment_block_layout(pad, pad, bq, bk), _pooled(pad, pad, bq, bk))


def test_segment_lists_are_the_pruned_layout(device):
    """The lists the kernels walk: the mask's layout AND the segments' block layout, per batch row
    and per head, sorted with padding; mask=None: every block at SEGMENT_BLOCK."""
    seg = _seg_batch([random_lengths(200, 30, seed=6), [200]], device)
    mask = BlockMask.from_layout(torch.rand(1, 3, 7, 7, generator=torch.Generator().manual_seed(7)) < 0.6,
                                 block_size=32, seq_q=200).to(device)
    kv_idx, q_idx, bq, bk = autograd.segment_lists((seg, seg), None, mask, torch.device(device))
    assert (bq, bk) == (32, 32) and kv_idx.shape == (2, 3, 7, 7) and q_idx.shape == (2, 3, 7, 7)
    want = mask.layout.cpu() & _pooled(seg.cpu(), seg.cpu(), 32, 32)
    assert torch.equal(kv_idx.cpu(), sorted_nonzero(want)[1]) and torch.equal(q_idx.cpu(), sorted_nonzero(want.transpose(-1, -2))[1])
    assert torch.equal(want[1], mask.layout.cpu()[0])  # one document: the mask itself
    kv_idx, q_idx, bq, bk = autograd.segment_lists((seg, seg), None, None, torch.device(device))
    nb = math.ceil(200 / autograd.SEGMENT_BLOCK)
    assert (bq, bk) == (autograd.SEGMENT_BLOCK,) * 2 and kv_idx.shape == (2, 1, nb, nb)
    assert torch.equal(kv_idx.cpu(), sorted_nonzero(_pooled(seg.cpu(), seg.cpu(), bq, bk))[1])


# ---------------------------------------------------------------- kernels against the reference
def triton_impl(mask=None, **kw):
    def f(q, k, v):
        return sparseflash.attention(q, k, v, mask=mask, backend="triton", **kw)

    return f


def random_mask(Hm, Bm, Nq, Nk, block, density, seed):
    g = torch.Generator().manual_seed(seed)
    bq, bk = (block, block) if isinstance(block, int) else block
    layout = torch.rand(Bm, Hm, math.ceil(Nq / bq), math.ceil(Nk / bk), generator=g) < density
    return BlockMask.from_layout(layout, block_size=(bq, bk), seq_q=Nq, seq_k=Nk)


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, documents per row ("r<mean>": random lengths), mask block (None: none), causal
    (2, 2, 1, 100, 100, 32, ["r12", "r4"], None, True),  # GQA, many short documents, length-1 ones
    (1, 2, 2, 128, 128, 16, [[32, 32, 64]], None, False),  # boundaries exactly on 32-token block edges
    (2, 4, 2, 100, 100, 40, [[1, 30, 5, 64], [33, 67]], 32, True),  # per-head, per-batch mask; boundaries inside blocks
    (1, 2, 2, 70, 130, 32, ["r25"], (16, 32), True),  # seq_q < seq_k (the last 70 positions as queries)
]


def _case_ids(c):
    return "B{}-H{}/{}-N{}x{}-D{}-blk{}-{}".format(*c[:6], c[7], "causal" if c[8] else "full")


def _segments_for(docs, B, Nq, Nk, device, seed):
    rows = []
    for b in range(B):
        d = docs[b % len(docs)]
        lengths = random_lengths(Nk, int(d[1:]), seed=seed + b) if isinstance(d, str) else d
        rows.append(lengths)
    seg_k = _seg_batch(rows, device)
    return seg_k if Nq == Nk else (seg_k[:, Nk - Nq:].contiguous(), seg_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("case", CASES, ids=_case_ids)
def test_kernels(case, dtype, device, small_blocks):
    B, Hq, Hkv, Nq, Nk, D, docs, block, causal = case
    seg = _segments_for(docs, B, Nq, Nk, device, seed=Nq + D)
    mask = None if block is None else random_mask(Hq, B, Nq, Nk, block, 0.7, seed=D).to(device)
    q, k, v, do = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device, seed=3)
    check_attention(triton_impl(mask, causal=causal, segment_ids=seg), q, k, v, do, mask=mask, causal=causal,
                    ref_kwargs=dict(segment_ids=seg))


@pytest.mark.parametrize("tiles", [(16, 32), (32, 16, True), (32, 32)],
                         ids=lambda t: f"tile{t[0]}x{t[1]}" + ("-qrows" if len(t) > 2 else ""))
def test_tilings_key_lengths_and_padding(tiles, device):
    """Kernel tiles smaller than and equal to 32-blocks (uniform and mixed tiles in every kernel,
    dK/dV in both orientations), with key_lengths masking each row's padding (its own id from
    position 83 on): padding queries attend to nothing (0, zero gradients)."""
    cfg = TileConfig(*tiles[:2])
    B, N, n = 2, 100, 83
    seg = torch.stack([packed_ids([32, 16, 1, 34], device, pad_to=N), packed_ids([70, 13], device, pad_to=N)])
    kl = torch.tensor([n, n], device=device)
    mask = random_mask(1, 1, N, N, 32, 0.9, seed=5).to(device)
    q, k, v, do = make_qkv(B, 2, 1, N, N, 32, torch.float32, device, seed=4)
    with tile_config(fwd=cfg, dkdv=TileConfig(*tiles[:2], q_rows=len(tiles) > 2), dq=cfg):
        check_attention(triton_impl(mask, causal=True, key_lengths=kl, segment_ids=seg), q, k, v, do, mask=mask,
                        causal=True, key_lengths=kl, ref_kwargs=dict(segment_ids=seg))
        if tiles != (32, 32):
            return
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = sparseflash.attention(qq, kk, vv, causal=True, key_lengths=kl, segment_ids=seg, backend="triton")
        o.backward(do)
    assert torch.equal(o[:, :, n:], torch.zeros_like(o[:, :, n:]))
    assert torch.equal(qq.grad[:, :, n:], torch.zeros_like(qq.grad[:, :, n:]))
    assert torch.equal(kk.grad[:, :, n:], torch.zeros_like(kk.grad[:, :, n:]))


def test_queries_without_keys_of_their_segment(device):
    """Cross attention where some query ids occur in no key: those rows are 0, their lse -inf,
    their gradients 0, nothing NaN; the rest matches the reference."""
    Nq, Nk = 60, 90
    seg_q = packed_ids([20, 20, 20], device)[None] * 2  # ids 0, 2, 4
    seg_k = packed_ids([30, 30, 30], device)[None]  # ids 0, 1, 2: queries of id 4 see nothing
    q, k, v, do = make_qkv(1, 2, 2, Nq, Nk, 32, torch.float32, device, seed=6)
    check_attention(triton_impl(segment_ids=(seg_q, seg_k)), q, k, v, do, ref_kwargs=dict(segment_ids=(seg_q, seg_k)))
    qq = q.detach().clone().requires_grad_()
    o, lse = sparseflash.attention(qq, k, v, segment_ids=(seg_q, seg_k), return_lse=True, backend="triton")
    o.backward(do)
    assert torch.equal(o[:, :, 40:], torch.zeros_like(o[:, :, 40:])) and bool(torch.isneginf(lse[:, :, 40:]).all())
    assert torch.isfinite(lse[:, :, :40]).all() and torch.equal(qq.grad[:, :, 40:], torch.zeros_like(qq.grad[:, :, 40:]))


def test_one_segment_equals_no_segments(device, small_blocks):
    """Every token in one segment: the same attention as without segment_ids (uniform tiles skip
    the comparison; the list of every block walks the dense order)."""
    q, k, v, _ = make_qkv(2, 2, 2, 100, 100, 32, torch.float32, device, seed=7)
    seg = torch.full((1, 100), 7, dtype=torch.int32, device=device)
    for causal in (False, True):
        a = sparseflash.attention(q, k, v, causal=causal, segment_ids=seg, backend="triton")
        b = sparseflash.attention(q, k, v, causal=causal, backend="triton")
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_lse_dropout_and_determinism(device, small_blocks):
    """return_lse and its gradient, dropout (the same keep-mask as the reference's) and a bitwise
    reproducible backward, with segments."""
    seg = _seg_batch([random_lengths(80, 15, seed=8)], device)
    q, k, v, do = make_qkv(1, 2, 2, 80, 80, 32, torch.float32, device, seed=9)
    dl = torch.randn(1, 2, 80, generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    for backend in ("triton", "reference", "triton"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        g = torch.Generator(device=device).manual_seed(3)
        o, lse = sparseflash.attention(qq, kk, vv, causal=True, return_lse=True, dropout_p=0.3, generator=g,
                                       segment_ids=seg, backend=backend)
        ((o * do).sum() + (lse * dl).sum()).backward()
        runs.append((o, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(runs[0], runs[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    for a, b in zip(runs[0], runs[2]):
        assert torch.equal(a, b)


def test_tma_kernels(device, tma_on, small_blocks):
    """Segments in the TMA kernels' single loop (element masks from a tile index on, the segment
    test on every tile)."""
    seg = _seg_batch([random_lengths(100, 10, seed=10), [50, 50]], device)
    q, k, v, do = make_qkv(2, 2, 1, 100, 100, 32, torch.bfloat16, device, seed=11)
    kl = torch.tensor([90, 100], device=device)
    for q_rows in (False, True):
        with tile_config(dkdv=TileConfig(32, 32, q_rows=q_rows)):
            check_attention(triton_impl(causal=True, key_lengths=kl, segment_ids=seg), q, k, v, do, causal=True,
                            key_lengths=kl, ref_kwargs=dict(segment_ids=seg))
    assert len(tma_on) == 6 and all(tma_on), f"a kernel did not take the TMA path: {tma_on}"


def test_cu_seqlens_end_to_end(device):
    cu = torch.tensor([0, 7, 8, 40, 64], device=device)
    seg = segments_from_cu_seqlens(cu, total=70)  # 6 tokens of padding
    q, k, v, do = make_qkv(1, 2, 2, 70, 70, 16, torch.float16, device, seed=12)
    check_attention(triton_impl(causal=True, segment_ids=seg), q, k, v, do, causal=True,
                    ref_kwargs=dict(segment_ids=seg))


def test_torch_compile_no_graph_break(device):
    seg = _seg_batch([[20, 1, 43]], device)

    def f(x, seg):
        return sparseflash.attention(x, x, x, causal=True, segment_ids=seg).sum()

    x = torch.randn(1, 2, 64, 32, device=device, requires_grad=True)
    eager = f(x, seg)
    eager.backward()
    g_eager = x.grad.clone()
    x.grad = None
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, seg)
    out.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, g_eager)


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("N,D,mean,causal", [(4096, 64, 512, True), (4096, 128, 100, False), (16384, 128, 2048, True)])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "butterfly"])
def test_gpu_real_sizes(N, D, mean, causal, masked):
    from sparseflash.patterns import butterfly

    dtype = torch.bfloat16
    B = max(1, 8192 // N)
    seg = _seg_batch([random_lengths(N, mean, seed=b) for b in range(B)], "cuda")
    mask = butterfly(N).to("cuda") if masked else None
    q, k, v, do = make_qkv(B, 4, 2, N, N, D, dtype, "cuda", seed=13)
    check_attention(triton_impl(mask, causal=causal, segment_ids=seg), q, k, v, do, mask=mask, causal=causal,
                    ref_kwargs=dict(segment_ids=seg))


# ---------------------------------------------------------------- the benchmark's CPU mode
def test_packed_bench_cpu_mode(tmp_path, device):
    """The packed-documents benchmark end to end in its tiny CPU mode: files, columns, the figure,
    and the sparseflash output checked against the reference."""
    if device != "cpu":
        pytest.skip("the CPU mode; the GPU run is the lead's command")
    import json

    from sparseflash.experiments.bench import packed

    assert packed.main(["--device", "cpu", "--out", str(tmp_path), "--tokens", "64", "--mean-lens", "9",
                        "--providers", "sparseflash-segments"]) == 0
    rows = json.loads((tmp_path / "packed.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["device"] == "cpu"
    r = rows[0]
    assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["max_diff_vs_reference"] < 1e-5
    assert 0 < r["token_density"] < 1 and r["docs_per_row"] > 1
    assert (tmp_path / "packed.csv").read_text().startswith("bench,provider")
    assert (tmp_path / "packed.png").stat().st_size > 1000


def test_bench_pair_count_and_visited_blocks():
    from sparseflash.experiments.bench import packed

    seg = packed_ids([3, 1, 4])[None]
    assert packed.attended_pairs(seg, causal=False) == 9 + 1 + 16
    assert packed.attended_pairs(seg, causal=True) == 6 + 1 + 10
    ids = packed.document_ids(1000, 50, seed=0, device="cpu")
    assert ids.shape == (1000,) and bool((ids[1:] >= ids[:-1]).all()) and int(ids.max()) > 5
    seg = torch.cat([torch.zeros(256, dtype=torch.int32), torch.ones(256, dtype=torch.int32)])[None]
    assert packed.visited_block_fraction(seg, causal=False) == 0.5  # two 2x2 diagonal squares of a 4x4 grid
    assert packed.visited_block_fraction(seg, causal=True) == 6 / 10
