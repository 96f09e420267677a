"""`sparseflash.flash_attn_with_kvcache` (sparseflash/kvcache.py, kernel sparseflash/flash/decode.py):
flash-attn's documented semantics checked in float64 against SDPA on the keys of each batch row
(rotary written here as complex multiplication, not the module's code); the in-place append
(plain, cache_batch_idx, paged); then the split-KV kernel (interpreter on CPU) against the float64
reference within 2x PyTorch's own error, over splits, GQA, paging, leftpad, windows, softcap,
ALiBi and chunked query blocks; block-sparse decoding; rows attending nothing; the errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _attn_check import assert_within_torch_error, flash_attn_allowed

import sparseflash
from sparseflash import BlockMask
from sparseflash.kvcache import cache_blocks, decode_reference, window_pair


def _rotary_complex(x, cos, sin, pos, interleaved):
    """Rotary as complex multiplication: channel pairs times exp(i * theta[pos])."""
    r = 2 * cos.shape[1]
    xr = x[..., :r].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., : r // 2], xr[..., r // 2:])
    rot = z * torch.complex(cos[pos].double(), sin[pos].double())[:, :, None, :]
    parts = torch.stack((rot.real, rot.imag), -1).flatten(-2) if interleaved else torch.cat((rot.real, rot.imag), -1)
    return torch.cat((parts.to(x.dtype), x[..., r:]), -1)




def _cache(B, N, Hk, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, Hk, D, generator=g, dtype=dtype) for _ in range(2)]


SEM_CASES = [  # (causal, window, rotary interleaved or None, leftpad, batch_idx)
    (False, (-1, -1), None, False, False),
    (True, (-1, -1), True, False, True),
    (False, (6, 2), False, True, False),
    (True, (9, -1), True, True, True),
]


@pytest.mark.parametrize("causal, window, rotary, leftpad, bidx", SEM_CASES)
def test_semantics_equal_sdpa_per_row(causal, window, rotary, leftpad, bidx):
    """flash-attn's kvcache semantics, float64 (reference path): the cache after the append, and
    each batch row's output = SDPA over its keys [leftpad, cache_seqlens + seqlen_new) with the
    bottom-right mask; rotary at cache_seqlens + i (q: + i only with causal or a window)."""
    B, SQ, SN, H, Hk, D, N = 3, 3, 2, 4, 2, 16, 40
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, SQ, H, D, generator=g, dtype=torch.float64)
    kn, vn = (torch.randn(B, SN, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    kc, vc = _cache(B + 1, N, Hk, D)
    seqlens = torch.tensor([5, 0, 30], dtype=torch.int32)
    lp = torch.tensor([2, 0, 11], dtype=torch.int32) if leftpad else None
    bi = torch.tensor([3, 0, 1], dtype=torch.int32) if bidx else None
    rows = bi.long() if bidx else torch.arange(B)
    cos = sin = None
    if rotary is not None:
        theta = torch.arange(N, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(4, dtype=torch.float64)
        cos, sin = theta.cos(), theta.sin()
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = sparseflash.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_batch_idx=bi,
        cache_leftpad=lp, causal=causal, window_size=window, rotary_interleaved=bool(rotary),
        return_softmax_lse=True)
    local = causal or window != (-1, -1)
    for b in range(B):
        s, r = int(seqlens[b]), int(rows[b])
        pos = torch.arange(s, s + SN)[None]
        k_new = _rotary_complex(kn[b:b + 1], cos, sin, pos, rotary)[0] if rotary is not None else kn[b]
        want_k = kc0[r].clone()
        want_k[s:s + SN] = k_new
        want_v = vc0[r].clone()
        want_v[s:s + SN] = vn[b]
        torch.testing.assert_close(kc[r], want_k, rtol=0, atol=0)
        torch.testing.assert_close(vc[r], want_v, rtol=0, atol=0)
        qb = q[b:b + 1]
        if rotary is not None:
            qpos = (torch.arange(s, s + SQ) if local else torch.full((SQ,), s))[None]
            qb = _rotary_complex(qb, cos, sin, qpos, rotary)
        start, end = (int(lp[b]) if leftpad else 0), s + SN
        keys, vals = want_k[start:end], want_v[start:end]
        allowed = flash_attn_allowed(SQ, end - start, causal, window)
        kk = keys.repeat_interleave(H // Hk, 1).transpose(0, 1)
        vv = vals.repeat_interleave(H // Hk, 1).transpose(0, 1)
        scores = torch.einsum("qhd,hkd->hqk", qb[0], kk) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        want = F.scaled_dot_product_attention(qb[0].transpose(0, 1), kk, vv, attn_mask=allowed).transpose(0, 1)
        torch.testing.assert_close(out[b], want)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1).float())
    untouched = torch.ones(B + 1, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(kc[untouched], kc0[untouched])


def _paged(kc, vc, page, seed=3):
    """A cache [B, N, Hk, D] as shuffled pages of ``page`` tokens and its block table."""
    B, N = kc.shape[:2]
    per = -(-N // page)
    perm = torch.randperm(B * per + 2, generator=torch.Generator().manual_seed(seed))
    table = perm[: B * per].view(B, per).to(torch.int32)
    kp = torch.zeros(B * per + 2, page, *kc.shape[2:], dtype=kc.dtype)
    vp = torch.zeros_like(kp)
    for b in range(B):
        for p in range(per):
            n = min(page, N - p * page)
            kp[table[b, p], :n] = kc[b, p * page:p * page + n]
            vp[table[b, p], :n] = vc[b, p * page:p * page + n]
    return kp, vp, table


def test_paged_cache_equals_contiguous():
    """block_table: pages of any size (here 8, shuffled) give the contiguous cache's output, and the
    append lands in the right pages."""
    B, SQ, H, Hk, D, N = 2, 2, 4, 2, 16, 48
    kc, vc = _cache(B, N, Hk, D)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, SQ, H, D, generator=g, dtype=torch.float64)
    kn, vn = (torch.randn(B, 3, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([9, 40], dtype=torch.int32)
    kp, vp, table = _paged(kc, vc, 8)
    want = sparseflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    got = sparseflash.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seqlens, causal=True,
                                             block_table=table)
    torch.testing.assert_close(got, want)
    back = kp[table.long()].flatten(1, 2)[:, :N]
    torch.testing.assert_close(back, kc, rtol=0, atol=0)


# (B, SQ, H, Hk, D, N, page or 0, seqlens, new, causal, window, leftpad, softcap, alibi, splits, dtype)
KERNEL_CASES = [
    (1, 1, 8, 2, 64, 300, 0, [300], 0, False, (-1, -1), False, 0.0, False, 0, torch.float16),
    (2, 4, 4, 1, 40, 130, 0, [17, 101], 3, True, (-1, -1), True, 0.0, False, 3, torch.bfloat16),
    (3, 2, 6, 3, 16, 96, 16, [0, 50, 90], 2, False, (20, 0), False, 4.0, True, 0, torch.float16),
    (2, 16, 8, 2, 32, 80, 32, [10, 60], 4, True, (-1, -1), False, 0.0, False, 2, torch.float32),
]


def _id(c):
    B, SQ, H, Hk, D, N, page = c[:7]
    return f"B{B}-Q{SQ}-H{H}/{Hk}-D{D}-N{N}-P{page}-{str(c[-1])[6:]}" + ("-causal" if c[9] else "") \
        + ("-win" if c[10] != (-1, -1) else "") + ("-leftpad" if c[11] else "") + ("-softcap" if c[12] else "") \
        + ("-alibi" if c[13] else "") + f"-S{c[14]}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[_id(c) for c in KERNEL_CASES])
def test_kernel_against_float64(case, device, monkeypatch):
    """The split-KV kernel: out within 2x PyTorch's error (the reference computed in the input dtype)
    of the float64 reference, lse close; chunked query blocks (MAX_ROWS lowered) included."""
    B, SQ, H, Hk, D, N, page, seqlens, SN, causal, window, leftpad, softcap, alibi, splits, dtype = case
    if SQ * H // Hk > 16:
        monkeypatch.setattr(sparseflash.kvcache, "MAX_ROWS", 16)  # runs the query block in chunks
    g = torch.Generator().manual_seed(N + SQ)
    q = torch.randn(B, SQ, H, D, generator=g)
    kc, vc = _cache(B, N, Hk, D, torch.float32, seed=N)
    kn, vn = (torch.randn(B, SN, Hk, D, generator=g) for _ in range(2))
    sl = torch.tensor(seqlens, dtype=torch.int32)
    lp = (sl // 3).to(torch.int32) if leftpad else None
    slopes = torch.rand(B, H, generator=g) * 0.3 if alibi else None
    table = None
    if page:
        kc, vc, table = _paged(kc, vc, page)
        table = table.to(device)
    kw = dict(cache_seqlens=sl.to(device), cache_leftpad=None if lp is None else lp.to(device), causal=causal,
              window_size=window, softcap=softcap, alibi_slopes=None if slopes is None else slopes.to(device),
              block_table=table, return_softmax_lse=True)

    def run(dt, where, **extra):
        a, b = kc.to(where, dt), vc.to(where, dt)
        o, lse = sparseflash.flash_attn_with_kvcache(q.to(where, dt), a, b, kn.to(where, dt) if SN else None,
                                                     vn.to(where, dt) if SN else None, **{**kw, **extra})
        return o.cpu(), lse.cpu(), a.cpu()

    ref_o, ref_lse, ref_cache = run(torch.float64, "cpu", **({} if not page else {"block_table": table.cpu()}),
                                    cache_seqlens=sl, cache_leftpad=lp, alibi_slopes=slopes)
    got_o, got_lse, got_cache = run(dtype, device, num_splits=splits)
    # PyTorch in the same dtype: the reference's formula computed in that dtype
    pt_in = [t.to(dtype) for t in (q, kc, vc)]
    pt_o = _pt_same_dtype(pt_in, kn.to(dtype), vn.to(dtype), kw, sl, lp, slopes, table, dtype)
    assert_within_torch_error(_id(case), got_o.float(), pt_o.float(), ref_o, dtype)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(got_lse))
    torch.testing.assert_close(got_lse[fin], ref_lse[fin].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_cache.double(), ref_cache.to(dtype).double(), rtol=0, atol=0)


def _pt_same_dtype(qkv, kn, vn, kw, sl, lp, slopes, table, dtype):
    """`decode_reference` with every step in ``dtype`` (after the same append)."""
    q, kc, vc = (t.clone() for t in qkv)
    SN = kn.shape[1]
    B = q.shape[0]
    pos = sl.long()[:, None] + torch.arange(SN)
    if table is not None:
        table = table.cpu()
        page = table.long().gather(1, pos // kc.shape[1])
        kc[page, pos % kc.shape[1]], vc[page, pos % kc.shape[1]] = kn, vn
    else:
        rows = torch.arange(B)[:, None].expand(B, SN)
        kc[rows, pos], vc[rows, pos] = kn, vn
    left, right = (w if w >= 0 else -1 for w in window_pair(kw["window_size"]))
    if kw["causal"]:
        right = 0
    start = lp if lp is not None else torch.zeros(B, dtype=torch.int32)
    o, _ = decode_reference(q, kc, vc, start, (sl + SN).to(torch.int32), scale=1 / math.sqrt(q.shape[-1]),
                            window=(left, right), softcap=kw["softcap"] or None,
                            alibi=None if slopes is None else slopes.expand(B, -1), block_table=table,
                            compute_dtype=dtype)
    return o


def test_block_sparse_decoding(device):
    """mask=: only the listed cache blocks are read (the others hold NaN and the output stays finite)
    and the result equals the reference restricted to them; a mask of every block equals no mask;
    a per-head mask (equal within each GQA group) equals its per-kv-head form."""
    B, SQ, H, Hk, D, N, bs = 2, 1, 4, 2, 16, 128, 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, SQ, H, D, generator=g)
    kc, vc = _cache(B, N, Hk, D, torch.float32, seed=4)
    sl = torch.tensor([100, 128], dtype=torch.int32)
    scores = torch.randn(B, Hk, N // bs, generator=g)
    top = scores.topk(3, dim=-1).indices
    layout = torch.zeros(B, Hk, 1, N // bs, dtype=torch.bool).scatter_(-1, top[:, :, None], True)
    mask = BlockMask.from_layout(layout, block_size=(16, bs), seq_q=SQ, seq_k=N)
    poisoned_k, poisoned_v = kc.clone(), vc.clone()
    off = ~layout[:, :, 0].repeat_interleave(bs, -1)  # [B, Hk, N]
    poisoned_k.permute(0, 2, 1, 3)[off] = float("nan")
    poisoned_v.permute(0, 2, 1, 3)[off] = float("nan")
    got, lse = sparseflash.flash_attn_with_kvcache(q.to(device), poisoned_k.to(device), poisoned_v.to(device),
                                                  cache_seqlens=sl.to(device), mask=mask, return_softmax_lse=True,
                                                  num_splits=2)
    assert torch.isfinite(got).all()
    keep = ~off.repeat_interleave(H // Hk, 1)  # [B, H, N]
    qd, kd, vd = q.double(), kc.double().repeat_interleave(2, 2), vc.double().repeat_interleave(2, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / 4.0
    ok = keep[:, :, None, :] & (torch.arange(N) < sl[:, None, None, None])
    s = s.masked_fill(~ok, float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vd)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(s, -1), rtol=1e-4, atol=1e-4)
    every = BlockMask.from_layout(torch.ones(1, 1, 1, N // bs, dtype=torch.bool), block_size=(16, bs), seq_q=SQ,
                                  seq_k=N)
    dense = sparseflash.flash_attn_with_kvcache(q.to(device), kc.to(device), vc.to(device),
                                               cache_seqlens=sl.to(device))
    torch.testing.assert_close(sparseflash.flash_attn_with_kvcache(
        q.to(device), kc.to(device), vc.to(device), cache_seqlens=sl.to(device), mask=every), dense)
    per_head = BlockMask.from_layout(layout.repeat_interleave(2, 1), block_size=(16, bs), seq_q=SQ, seq_k=N)
    torch.testing.assert_close(sparseflash.flash_attn_with_kvcache(
        q.to(device), kc.to(device), vc.to(device), cache_seqlens=sl.to(device), mask=per_head),
        sparseflash.flash_attn_with_kvcache(q.to(device), kc.to(device), vc.to(device),
                                            cache_seqlens=sl.to(device), mask=mask))
    # a mask reused over decoding steps builds its block lists once per call shape, and keeps giving them
    assert len(mask.decode_lists) == 1 and len(per_head.decode_lists) == 1
    again = sparseflash.flash_attn_with_kvcache(poisoned_k.new_tensor(q).to(device), poisoned_k.to(device),
                                               poisoned_v.to(device), cache_seqlens=sl.to(device), mask=mask,
                                               num_splits=2)
    assert torch.equal(again, got) and len(mask.decode_lists) == 1


def test_cache_bounds_error_is_flash_attns():
    """cache_seqlens (+ the new keys) past a paged cache's block table: flash-attn raises a RuntimeError
    naming block_table (its test_flash_attn_kvcache_paged_block_table_bounds); ours is that and a ValueError."""
    q = torch.randn(1, 1, 1, 16)
    pages = torch.zeros(4, 16, 1, 16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    for new, lens in ((None, 17), (torch.zeros(1, 1, 1, 16), 16)):
        for kind in (RuntimeError, ValueError):
            with pytest.raises(kind, match=r"block_table's capacity: 1 pages of 16 tokens"):
                sparseflash.flash_attn_with_kvcache(q, pages, pages, new, new, block_table=table,
                                                    cache_seqlens=torch.tensor([lens], dtype=torch.int32))


@pytest.mark.parametrize("heads", [2, 4])  # per kv head, and per query head equal within each GQA group
def test_cache_blocks_lists_the_selected_blocks_in_order(heads):
    g = torch.Generator().manual_seed(3)
    lay = torch.rand(3, 2, 1, 11, generator=g) < 0.4
    lay[0, 0] = False  # a row with no block
    lay[1, 1] = True  # a row with every block
    full = lay.repeat_interleave(heads // 2, 1)
    idx, cnt, bk = cache_blocks(BlockMask.from_layout(full, block_size=(16, 32), seq_q=1, seq_k=352), 3, 4, 2, 1,
                                352, torch.device("cpu"))
    want = torch.where(lay[:, :, 0], torch.arange(11), 11).sort(-1).values  # ascending, padded with nblocks
    assert idx.dtype == cnt.dtype == torch.int32 and bk == 32 and idx.is_contiguous()
    assert torch.equal(idx.long(), want) and cnt.tolist() == lay[:, :, 0].sum(-1).tolist()


def test_rows_attending_nothing_are_zero(device):
    """An empty cache row (seqlens 0, no new keys), a leftpad at the end, and a window that reaches
    no key give 0 and lse -inf, never NaN, through the kernel and the reference."""
    B, H, D, N = 3, 2, 16, 32
    kc, vc = _cache(B, N, 1, D, torch.float32)
    q = torch.randn(B, 2, H, D)
    sl = torch.tensor([0, 20, 20], dtype=torch.int32)
    lp = torch.tensor([0, 20, 0], dtype=torch.int32)
    for where in ("cpu", device):
        o, lse = sparseflash.flash_attn_with_kvcache(q.to(where), kc.to(where), vc.to(where),
                                                    cache_seqlens=sl.to(where), cache_leftpad=lp.to(where),
                                                    return_softmax_lse=True, num_splits=3)
        assert not torch.isnan(o).any()
        assert (o[:2] == 0).all() and torch.isneginf(lse[:2]).all()
        assert torch.isfinite(lse[2]).all()
    # causal with the keys starting at 4 of 5: the first query (position 3) sees none, the second one key
    o, lse = sparseflash.flash_attn_with_kvcache(q.to(device), kc.to(device), vc.to(device), cache_seqlens=5,
                                                cache_leftpad=torch.full((B,), 4, dtype=torch.int32, device=device),
                                                causal=True, return_softmax_lse=True)
    assert (o[:, 0] == 0).all() and torch.isneginf(lse[:, :, 0]).all()
    torch.testing.assert_close(o[:, 1].cpu(), vc[:, 4].expand(B, H, D))


def test_errors_name_the_argument():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    call = sparseflash.flash_attn_with_kvcache
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new \(2\) must lie in \[0, 8\]"):
        call(q, kc, vc, torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2, 16), cache_seqlens=7)
    with pytest.raises(ValueError, match="k and v must be given together"):
        call(q, kc, vc, torch.zeros(2, 1, 2, 16))
    with pytest.raises(ValueError, match=r"q's nheads \(4\) must be a multiple of the cache's nheads_k \(3\)"):
        call(q, torch.zeros(2, 8, 3, 16), torch.zeros(2, 8, 3, 16))
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int32 tensor \[batch\] = \[2\]"):
        call(q, kc, vc, cache_seqlens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="not supported with block_table"):
        call(q, kc, vc, block_table=torch.zeros(2, 1, dtype=torch.int32), cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="rotary_cos / rotary_sin rotate the new k and q"):
        call(q, kc, vc, rotary_cos=torch.ones(8, 4), rotary_sin=torch.ones(8, 4))
    with pytest.raises(ValueError, match=r"rotary_cos must be \[seqlen_ro >= 8"):
        call(q, kc, vc, torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 2, 16), cache_seqlens=1,
             rotary_cos=torch.ones(4, 4), rotary_sin=torch.ones(4, 4))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        call(q, kc, vc, window_size=3)
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        call(q, kc, vc, num_splits=-1)
    with pytest.raises(ValueError, match=r"alibi_slopes must be a float32 tensor \[nheads\] = \[4\]"):
        call(q, kc, vc, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="block_table holds page ids outside"):
        call(q, kc, vc, block_table=torch.full((2, 2), 5, dtype=torch.int32), cache_seqlens=3)
    with pytest.raises(ValueError, match="mask: decoding applies a mask at block level"):
        call(q, kc, vc, mask=BlockMask.from_fn(lambda b, h, i, j: j >= 0, 1, 8, block_size=(16, 16)))
    with pytest.raises(ValueError, match="mask must be built for"):
        call(q, kc, vc, mask=BlockMask.from_layout(torch.ones(1, 1, dtype=torch.bool), block_size=16, seq_q=1,
                                                   seq_k=16))
    with pytest.raises(ValueError, match="differs within a group"):
        lay = torch.tensor([True, False, True, True]).view(1, 4, 1, 1)
        call(q, kc, vc, mask=BlockMask.from_layout(lay, block_size=16, seq_q=1, seq_k=8))
    with pytest.raises(ValueError, match="cache block size must be a multiple of 16"):
        call(q, kc, vc, mask=BlockMask.from_layout(torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=(16, 8),
                                                   seq_q=1, seq_k=8))
