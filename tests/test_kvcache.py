"""`sparseflash.flash_attn_with_kvcache` (sparseflash/kvcache.py, kernel sparseflash/flash/decode.py):
flash-attn's documented semantics checked in float64 against SDPA on the keys of each batch row
(rotary written here as complex multiplication, not the module's code); the in-place append
(plain, cache_batch_idx, paged); then the split-KV kernel (interpreter on CPU) against the float64
reference within 2x PyTorch's own error, over splits, GQA, paging, leftpad, windows, softcap,
ALiBi and chunked query blocks; block-sparse decoding; rows attending nothing; the errors."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from _attn_check import assert_within_torch_error, flash_attn_allowed
from torch.overrides import TorchFunctionMode

import sparseflash
from sparseflash import BlockMask
from sparseflash.flash import binding
from sparseflash.kvcache import cache_blocks, decode_reference, window_pair


# Tests of the device-side bounds check and of the decode launches on CPU tensors: there the kernels run
# under the interpreter. On a GPU machine CPU tensors take the host path instead (no kernel runs on
# them), and a failing device-side assert would end the CUDA context for every later test, so these
# run where the interpreter does; the compiled path is covered by the CUDA tests below.
interpreted_kernels = pytest.mark.skipif(not sparseflash._env.interpreting(),
                                         reason="drives the decode kernels on CPU tensors under the interpreter")


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


def test_errors_name_the_argument(monkeypatch):
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
    if sparseflash._env.interpreting():  # the device check (CPU tensors without it: the host check below)
        with pytest.raises(RuntimeError, match=r"page ids in \[0, 2\); SPARSEFLASH_KVCACHE_HOST_CHECKS=1"):
            call(q, kc, vc, block_table=torch.full((2, 2), 5, dtype=torch.int32), cache_seqlens=3)
    with monkeypatch.context() as m:  # the values' bounds by name: the debug switch
        m.setattr(sparseflash.kvcache, "HOST_CHECKS", True)
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


# ----------------------------------------------------------------------------- bounds, plans, launches

_READS = (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__index__)


class _HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python (each a synchronisation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func in _READS
        return func(*args, **(kwargs or {}))


def _small(B=2, N=8, Hk=2, D=16, H=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=g)
    kc, vc = (torch.randn(B, N, Hk, D, generator=g) for _ in range(2))
    kn, vn = (torch.randn(B, 2, Hk, D, generator=g) for _ in range(2))
    return q, kc, vc, kn, vn


def test_device_check_messages_fit_a_cuda_assert():
    """torch._assert_async on CUDA takes messages of under 255 characters (a longer one is itself an
    error, before the check runs): every call shape's message fits, an over-long bound list is cut
    before the hint that names the debug switch."""
    from sparseflash.kvcache import _ASSERT_MAX, _assert_message

    hint = "; SPARSEFLASH_KVCACHE_HOST_CHECKS=1 names the value"
    long = _assert_message("x" * 400, hint)
    assert len(long) == _ASSERT_MAX < 255 and long.endswith("..." + hint)
    assert _assert_message("short", hint) == "short" + hint
    big = "flash_attn_with_kvcache: out of bounds: cache_seqlens + seqlen_new (123456) in [0, 1234567890]" \
          ", cache_leftpad in [0, cache_seqlens + seqlen_new], cache_batch_idx in [0, 123456789)"
    assert len(_assert_message(big, hint)) < 255


@interpreted_kernels
def test_bounds_are_checked_on_the_device_by_default():
    """Without the debug switch, a tensor cache_seqlens (and leftpad, batch index, page ids) is never
    read back: a call with good values makes no host read, and a bad value fails the call loudly with
    the device check's message (torch._assert_async, at once on a CPU) before the cache is written."""
    q, kc, vc, kn, vn = _small()
    call = sparseflash.flash_attn_with_kvcache
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    device_msg = r"out of bounds: cache_seqlens \+ seqlen_new .*SPARSEFLASH_KVCACHE_HOST_CHECKS=1"
    good = [dict(cache_seqlens=i32(3, 8)), dict(cache_seqlens=i32(3, 6), k=kn, v=vn),
            dict(cache_seqlens=i32(3, 5), cache_leftpad=i32(0, 5)), dict(cache_seqlens=i32(3, 5),
                                                                          cache_batch_idx=i32(1, 0))]
    bad = [dict(cache_seqlens=i32(3, 9)), dict(cache_seqlens=i32(-1, 3)), dict(cache_seqlens=i32(3, 7), k=kn, v=vn),
           dict(cache_seqlens=i32(-2, 3), k=kn, v=vn), dict(cache_seqlens=i32(3, 5), cache_leftpad=i32(0, 6)),
           dict(cache_seqlens=i32(3, 5), cache_leftpad=i32(-1, 0)), dict(cache_seqlens=i32(3, 5),
                                                                         cache_batch_idx=i32(0, 2))]
    for kw in good:
        a, b = kc.clone(), vc.clone()
        with _HostReads() as reads:
            out = call(q, a, b, **kw)
        assert reads.n == 0 and torch.isfinite(out).all(), kw
    for kw in bad:
        a, b = kc.clone(), vc.clone()
        with pytest.raises(RuntimeError, match=device_msg):
            call(q, a, b, **kw)
        assert torch.equal(a, kc) and torch.equal(b, vc), kw  # nothing appended
    # a paged cache: page ids in use are checked, those past a row's keys are not read
    kp, vp, table = _paged(kc, vc, 4)
    table[1, 1] = 99
    lens = i32(8, 5)
    with pytest.raises(RuntimeError, match=r"page ids in \[0, 6\); SPARSEFLASH_KVCACHE_HOST_CHECKS"):
        call(q, kp, vp, cache_seqlens=lens, block_table=table)
    lens = i32(8, 4)
    out = call(q, kp, vp, cache_seqlens=lens, block_table=table)
    torch.testing.assert_close(out, call(q, kc, vc, cache_seqlens=lens))


def test_host_checks_switch_names_the_values(monkeypatch):
    """SPARSEFLASH_KVCACHE_HOST_CHECKS (kvcache.HOST_CHECKS): the bounds read back and checked on the host,
    each error naming its argument (and cache_seqlens' values), as every call checked them before."""
    q, kc, vc, kn, vn = _small()
    call = sparseflash.flash_attn_with_kvcache
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    monkeypatch.setattr(sparseflash.kvcache, "HOST_CHECKS", True)
    with _HostReads() as reads:
        call(q, kc.clone(), vc.clone(), cache_seqlens=i32(3, 8))
    assert reads.n > 0
    with pytest.raises(sparseflash.kvcache.CacheBoundsError,
                       match=r"cache_seqlens \+ seqlen_new \(0\) must lie in \[0, 8\] \(the cache's length\), got \[3, 9\]"):
        call(q, kc, vc, cache_seqlens=i32(3, 9))
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new \(2\) must lie in \[0, 8\].*got \[-1, 3\]"):
        call(q, kc, vc, kn, vn, cache_seqlens=i32(-1, 3))
    with pytest.raises(ValueError, match=r"cache_leftpad must lie in \[0, cache_seqlens \+ seqlen_new\]"):
        call(q, kc, vc, cache_seqlens=i32(3, 5), cache_leftpad=i32(0, 6))
    with pytest.raises(ValueError, match="cache_batch_idx must index the cache's 2 rows"):
        call(q, kc, vc, cache_seqlens=i32(3, 5), cache_batch_idx=i32(0, 2))
    kp, vp, table = _paged(kc, vc, 4)
    table[1, 1] = 99
    with pytest.raises(ValueError, match=r"block_table holds page ids outside \[0, 6\) for keys in use"):
        call(q, kp, vp, cache_seqlens=i32(8, 5), block_table=table)


@interpreted_kernels
def test_paged_capacity_is_read_on_the_host_unless_switched_off(monkeypatch):
    """A paged cache's capacity is checked on the host (flash-attn reads max(cache_seqlens) there too and
    raises; test_cache_bounds_error_is_flash_attns); SPARSEFLASH_CHECK_KEY_LENGTHS=0 moves it to the device."""
    q, kc, vc, _, _ = _small()
    kp, vp, table = _paged(kc, vc, 4)
    lens = torch.tensor([8, 9], dtype=torch.int32)
    with _HostReads() as reads:
        sparseflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens - 1, block_table=table)
    assert reads.n > 0
    with pytest.raises(sparseflash.kvcache.CacheBoundsError, match="block_table's capacity"):
        sparseflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    monkeypatch.setattr(sparseflash.api, "CHECK_KEY_LENGTHS", False)
    with _HostReads() as reads:
        sparseflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens - 1, block_table=table)
    assert reads.n == 0
    with pytest.raises(RuntimeError, match=r"\(block_table's capacity: 2 pages of 4 tokens\).*SPARSEFLASH_KVCACHE_HOST_CHECKS=1"):
        sparseflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)


@interpreted_kernels
def test_plans_are_made_once_per_call_shape(monkeypatch):
    """A repeated call reuses its plan (no checks of shapes redone, no decode plan looked up); a call with
    another shape, dtype or flag gets its own; calls with masks share the decode plan of their shape."""
    from sparseflash.flash import decode

    made = {"call": 0, "decode": 0}
    for name, cls in (("call", sparseflash.kvcache.CallPlan), ("decode", decode.DecodePlan)):
        def counting(self, *a, _init=cls.__init__, _name=name, **kw):
            made[_name] += 1
            _init(self, *a, **kw)
        monkeypatch.setattr(cls, "__init__", counting)
    monkeypatch.setattr(sparseflash.kvcache, "PLANS", {})
    monkeypatch.setattr(decode, "PLANS", {})
    q, kc, vc, kn, vn = _small()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    call = sparseflash.flash_attn_with_kvcache
    first = call(q, kc, vc, cache_seqlens=lens)
    assert made == {"call": 1, "decode": 1}
    plan = next(iter(sparseflash.kvcache.PLANS.values()))
    assert torch.equal(call(q.clone(), kc, vc, cache_seqlens=lens.clone()), first)
    assert made == {"call": 1, "decode": 1} and list(sparseflash.kvcache.PLANS.values()) == [plan]
    call(q, kc, vc, cache_seqlens=lens, causal=True)  # another flag
    call(q[:1], kc, vc, cache_seqlens=lens[:1])  # another batch
    call(q.double(), kc.double(), vc.double(), cache_seqlens=lens)  # another dtype (the reference: no decode plan)
    assert made == {"call": 4, "decode": 3} and len(sparseflash.kvcache.PLANS) == 4
    bs = 16
    masks = [BlockMask.from_layout(torch.rand(2, 2, 1, 1, generator=torch.Generator().manual_seed(s)) < 2,
                                   block_size=(16, bs), seq_q=1, seq_k=8) for s in range(2)]
    for m in masks:  # a new mask each step: planned anew, one decode plan for both
        call(q, kc, vc, cache_seqlens=lens, mask=m)
    assert made == {"call": 6, "decode": 4} and len(sparseflash.kvcache.PLANS) == 4


class _Counting:
    """A kernel whose launches are counted and run."""

    def __init__(self, kernel, counts, name):
        self.kernel, self.counts, self.name = kernel, counts, name
        self.fn, self.pre_run_hooks = kernel.fn, []

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


@interpreted_kernels
@pytest.mark.parametrize("splits", [1, 3])
def test_one_split_launches_no_combine(splits, monkeypatch):
    """With one split the split kernel stores the answer (and lse) itself: no combine launch, no float32
    partials; with three, one combine. The split kernel checks a read's bounds (no bounds launch; with
    ``decode.OVERRIDES["check_in_split"] = False`` the check is its own launch). Both give the reference's
    answer."""
    from collections import Counter

    from sparseflash.flash import decode

    counts = Counter()
    for name in ("decode_split_kernel", "decode_combine_kernel", "decode_bounds_kernel"):
        monkeypatch.setattr(decode, name, _Counting(getattr(decode, name), counts, name))
    q, kc, vc, _, _ = _small(N=300)
    lens = torch.tensor([300, 123], dtype=torch.int32)
    out, lse = sparseflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits,
                                                  return_softmax_lse=True)
    assert counts == Counter(decode_split_kernel=1, **({"decode_combine_kernel": 1} if splits > 1 else {}))
    monkeypatch.setitem(decode.OVERRIDES, "check_in_split", False)
    counts.clear()
    again = sparseflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits,
                                                return_softmax_lse=True)
    assert counts == Counter(decode_split_kernel=1, decode_bounds_kernel=1,
                             **({"decode_combine_kernel": 1} if splits > 1 else {}))
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    plan = next(p for p in decode.PLANS.values() if p.splits == splits and p.shape == (2, 1, 4, 16))
    assert (plan.n_part == 0) == (splits == 1)
    ref_o, ref_lse = decode_reference(q.double(), kc.double(), vc.double(), torch.zeros(2, dtype=torch.int32), lens,
                                      scale=0.25, window=(-1, -1))
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-4, atol=1e-4)


@interpreted_kernels
def test_plan_launches_bound_after_the_first(monkeypatch):
    """On the bound route (faked here: stand-in kernels, a pretend stream), a plan's first call launches
    through Triton, later calls through the compiled launcher with the call's addresses; an address of
    another alignment binds once more; binding.FAST_LAUNCH off sends every launch through Triton."""
    from sparseflash.flash import decode

    launched, runs = [], []

    class Compiled:
        function, packed_metadata = 7, (4, 1, 0)

        def run(self, *args):
            runs.append(args)

    class Kernel:
        def __init__(self, real, name):
            self.fn, self.pre_run_hooks, self.name = real.fn, [], name

        def __getitem__(self, grid):
            def go(**kw):
                launched.append((self.name, kw))
                if "Ok" in kw:
                    kw["Ok"].fill_(1)  # the check's verdict (its bound launches reuse the buffer)
                return Compiled()
            return go

    for name in ("decode_split_kernel", "decode_combine_kernel", "decode_bounds_kernel"):
        monkeypatch.setattr(decode, name, Kernel(getattr(decode, name), name))
    monkeypatch.setattr(decode, "bound_launches", lambda device: True)
    monkeypatch.setattr(decode, "PLANS", {})
    monkeypatch.setattr(decode, "CHECKS", {})
    monkeypatch.setattr(sparseflash.kvcache, "PLANS", {})
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    monkeypatch.setattr(binding, "current_device", lambda: 0)
    monkeypatch.setattr(binding, "raw_stream", lambda index: 55)
    q, kc, vc, _, _ = _small(N=300)
    lens = torch.tensor([300, 123], dtype=torch.int32)
    call = lambda qq: sparseflash.flash_attn_with_kvcache(qq, kc, vc, cache_seqlens=lens, num_splits=2)  # noqa: E731
    call(q)  # (a read: the split kernel checks the bounds, no bounds launch)
    assert [n for n, _ in launched] == ["decode_split_kernel", "decode_combine_kernel"]
    assert not runs
    call(q)
    assert len(launched) == 2 and len(runs) == 2
    split = runs[0]
    assert split[:4] == (2, 2, 2, 55) and split[4:9] == (7, (4, 1, 0), None, None, None)
    names = list(inspect.signature(decode.decode_split_kernel.fn).parameters)
    args = dict(zip(names, split[9:]))
    assert args["Q"] == q.data_ptr() and args["K"] == kc.data_ptr() and args["seqlens"] == lens.data_ptr()
    assert args["leftpad"] is None and args["n_splits"] == 2 and args["Out"] is None  # (two splits: partials)
    assert args["O_part"] is not None and args["LSE_part"] is not None and args["strides"][1] == kc.stride()
    assert args["Ok"] is not None  # (the verdict, asserted after)
    q2 = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # 4 bytes off 16-byte alignment
    call(q2)
    call(q2)
    assert len(launched) == 3 and launched[-1][0] == "decode_split_kernel" and len(runs) == 2 + 1 + 2
    assert dict(zip(names, runs[-2][9:]))["Q"] == q2.data_ptr()
    monkeypatch.setattr(binding, "FAST_LAUNCH", False)
    call(q)
    assert len(launched) == 5 and len(runs) == 5
    monkeypatch.setitem(decode.OVERRIDES, "check_in_split", False)  # the bounds check its own launch, bound alike
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    call(q)
    call(q)
    assert [n for n, _ in launched[5:]] == ["decode_bounds_kernel", "decode_split_kernel", "decode_combine_kernel"]
    assert len(runs) == 5 + 3


def test_append_and_index_vectors_in_any_layout(device):
    """The in-place append (one launch) and the kernels read their inputs by their strides: new keys and
    values as strided views, rotary, int64 and strided cache_seqlens / batch index / block table give
    the contiguous int32 call's cache and output."""
    B, N, Hk, D, H = 3, 32, 2, 16, 4
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 2, H, D, generator=g).to(device)
    kc, vc = (torch.randn(B + 1, N, Hk, D, generator=g).to(device) for _ in range(2))
    kn_t, vn_t = (torch.randn(B, Hk, 2, D, generator=g).to(device) for _ in range(2))
    kn, vn = kn_t.transpose(1, 2), vn_t.transpose(1, 2)  # [B, 2, Hk, D], strided
    theta = torch.arange(N, dtype=torch.float32)[:, None] * 0.2 * torch.arange(4)
    rot = dict(rotary_cos=theta.cos().to(device), rotary_sin=theta.sin().to(device), causal=True)
    lens64 = torch.tensor([[4, 0], [30, 0], [11, 0]], device=device)[:, 0]  # int64, stride 2
    idx64 = torch.tensor([3, 0, 1], device=device)
    call = sparseflash.flash_attn_with_kvcache
    for kw in (dict(cache_batch_idx=idx64), dict(cache_batch_idx=idx64, **rot)):
        a, b = kc.clone(), vc.clone()
        got = call(q, a, b, kn, vn, cache_seqlens=lens64, **kw)
        a2, b2 = kc.clone(), vc.clone()
        kw32 = dict(kw, cache_batch_idx=idx64.to(torch.int32))
        want = call(q, a2, b2, kn.contiguous(), vn.contiguous(), cache_seqlens=lens64.to(torch.int32).contiguous(),
                    **kw32)
        assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(got, want)
    kp, vp, table = _paged(kc[:B].cpu(), vc[:B].cpu(), 8)
    wide = torch.zeros(B, 2 * table.shape[1], dtype=torch.int64)
    wide[:, ::2] = table
    for t in (table.long(), wide[:, ::2]):  # int64; int64 with stride 2
        a, b = kp.clone().to(device), vp.clone().to(device)
        got = call(q, a, b, kn, vn, cache_seqlens=lens64, block_table=t.to(device))
        a2, b2 = kp.clone().to(device), vp.clone().to(device)
        want = call(q, a2, b2, kn.contiguous(), vn.contiguous(), cache_seqlens=lens64.to(torch.int32),
                    block_table=table.to(device))
        assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_in_a_cuda_graph(paged, monkeypatch):
    """A decode step (append, rotary, leftpad or pages, the bounds check on the device) captured in a CUDA
    graph and replayed with new lengths and tokens gives the eager call's answer and cache; capture reads
    nothing back (a paged cache's capacity and the debug switch's checks then run on the device)."""
    monkeypatch.setattr(sparseflash.kvcache, "HOST_CHECKS", True)  # skipped while capturing: device checks
    B, H, Hk, D, N = 3, 8, 2, 128, 1024
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    kc, vc, q, kn, vn = randn(B, N, Hk, D), randn(B, N, Hk, D), randn(B, 1, H, D), randn(B, 1, Hk, D), randn(B, 1, Hk, D)
    theta = torch.arange(N, device="cuda", dtype=torch.float32)[:, None] * 0.01 * torch.arange(32, device="cuda")
    cos, sin = theta.cos(), theta.sin()
    lens = torch.tensor([5, 700, 1000], device="cuda", dtype=torch.int32)
    kw = dict(rotary_cos=cos, rotary_sin=sin, causal=True, return_softmax_lse=True)
    if paged:
        kc, vc, table = (t.cuda() for t in _paged(kc.cpu(), vc.cpu(), 64))
        kw["block_table"] = table
    else:
        kw["cache_leftpad"] = torch.tensor([0, 3, 100], device="cuda", dtype=torch.int32)
    graph_cache = (kc.clone(), vc.clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles and binds) beside the capture, as CUDA graphs want
        for _ in range(2):
            sparseflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparseflash.flash_attn_with_kvcache(q, *graph_cache, kn, vn, cache_seqlens=lens, **kw)
    for step in range(3):
        lens.add_(1)
        q.copy_(randn(B, 1, H, D))
        kn.copy_(randn(B, 1, Hk, D))
        graph.replay()
        want, want_lse = sparseflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, **kw)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        assert torch.equal(graph_cache[0], kc) and torch.equal(graph_cache[1], vc), step


_COMPILE_DECODE = r"""
import inspect
import sys
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"cannot compile for CUDA here: {e}")
    sys.exit(3)
from sparseflash.flash import decode

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}


def typ(a):
    if isinstance(a, torch.Tensor):
        return "*" + TYPES[a.dtype]
    if isinstance(a, tuple):  # (the split and combine kernels' strides)
        return tuple(typ(x) for x in a)
    return "i1" if isinstance(a, bool) else "i32" if isinstance(a, int) else "fp32"


def compile_launch(launch, tensors):
    fn = getattr(decode, launch.kernel)
    args = dict(launch.args)
    args.update((n, tensors[n]) for n in launch.names)
    opts = dict(num_warps=args.pop("num_warps"), num_stages=args.pop("num_stages", 3))
    sig, consts = {}, {}
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        value = args.pop(name, defaults[name])  # (an optional part the plan leaves off: its default, None)
        if p.is_constexpr or value is None:
            sig[name] = "constexpr"
            consts[(i,)] = value
        else:
            sig[name] = typ(value)
    assert not args, args
    ptx = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    print(launch.kernel, len(ptx.splitlines()), flush=True)


B, Hk, D = 2, 2, 128
i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)
kc = torch.zeros(B, 1024, Hk, D, dtype=torch.bfloat16)
pages = torch.zeros(40, 64, Hk, D, dtype=torch.float16)
table = i32(B, 16)
blocks = (i32(B, Hk, 3), i32(B, Hk), 128)
variants = [  # (q, cache, plan options)
    (torch.zeros(B, 1, 8, D, dtype=torch.bfloat16), kc, dict(num_splits=3)),
    (torch.zeros(B, 2, 8, D, dtype=torch.float16), pages.to(torch.float16), dict(
        num_splits=1, block_table=table, seqlens=False, seq_add=1024, store_lse=False, window=(16, 0), softcap=5.0,
        alibi=torch.zeros(8))),
    (torch.zeros(B, 40, 8, D, dtype=torch.bfloat16), kc, dict(
        num_splits=2, leftpad=True, batch_idx=True, blocks=blocks, seq_add=3, alibi=torch.zeros(B, 8))),
]
for q, cache, kw in variants:
    kw = dict(dict(scale=0.1, window=(-1, -1), max_len=1024, rows=64), **kw)
    p = decode.plan(q, cache, cache, **kw)
    named = dict(Q=q, K=cache, V=cache, O_part=torch.zeros(1), LSE_part=torch.zeros(1), Out=q, LSE=torch.zeros(1),
                 seqlens=i32(B), leftpad=i32(B), batch_idx=i32(B), block_table=table,
                 alibi=kw.get("alibi"), blk_idx=blocks[0], blk_cnt=blocks[1])
    for launch in p.launches():
        compile_launch(launch, named)
# the study switch fused_combine (decode.OVERRIDES): the split kernel merging its 33 splits, and checking the
# bounds (as it does by default for a read)
decode.OVERRIDES.update(fused_combine=True)
q = torch.zeros(B, 1, 8, D, dtype=torch.bfloat16)
p = decode.plan(q, kc, kc, scale=0.1, window=(-1, -1), max_len=1024, num_splits=33, leftpad=True, batch_idx=True,
                check=True)
decode.OVERRIDES.clear()
for launch in p.launches():
    compile_launch(launch, dict(Q=q, K=kc, V=kc, O_part=torch.zeros(1), LSE_part=torch.zeros(1), Out=q,
                                LSE=torch.zeros(1), seqlens=i32(B), leftpad=i32(B), batch_idx=i32(B),
                                Tickets=i32(B * Hk), Ok=i32(1)))
kn = torch.zeros(B, 3, Hk, D, dtype=torch.bfloat16)
for cache, kw in ((kc, dict(batch_idx=True)), (pages.to(torch.bfloat16), dict(block_table=table))):
    a = decode.append(kn, kn, cache, cache, **kw)
    compile_launch(a.launch, dict(K_new=kn, V_new=kn, K=cache, V=cache, seqlens=i32(B), batch_idx=i32(B),
                                  block_table=table))
for kw in (dict(leftpad=True, batch_idx=True), dict(block_table=table, page=64, seqlens=False)):
    c = decode.bounds_check(torch.device("cpu"), B, **dict(dict(seqlens=True, max_len=1024, n_rows=B, n_pages=40), **kw))
    compile_launch(c.launch, dict(Ok=i32(1), seqlens=i32(B), leftpad=i32(B), batch_idx=i32(B), block_table=table))
"""


def test_decode_kernels_compile_for_sm90():
    """The decode kernels' compiled path (the interpreter never compiles them) builds for sm_90 without a GPU, for
    plans of each kind: splits and their combine, one split (lse not stored), a paged cache read whole, leftpad,
    batch index, ALiBi, a window, softcap, block lists, chunked query blocks; with the study switch fused_combine
    on (its 33 splits merged in the kernel) and the bounds checked there (as by default for a read); the append
    into a cache by batch index and into pages;
    the bounds check with every bound.
    Triton's front end, its passes and the bundled ptxas, in a child process outside the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _COMPILE_DECODE], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-4000:]
    kernels = [line.split()[0] for line in r.stdout.splitlines()]
    # 3 splits: split + combine; one split: split; 40 x 4 rows in chunks of 64: (split + combine) x 3; two checks
    assert kernels == (["decode_split_kernel", "decode_combine_kernel", "decode_split_kernel"]
                       + ["decode_split_kernel", "decode_combine_kernel"] * 3 + ["decode_split_kernel"]
                       + ["decode_append_kernel"] * 2 + ["decode_bounds_kernel"] * 2), kernels


def test_decode_kernel_signatures():
    """The decode kernels take each tensor's strides as one tuple (stride_o: batch, token, head, column;
    the split kernel's three inputs' as one parameter, strides) and every optional part (the split
    kernel's outputs of one split or partials of several, the LSE, key lengths, leftpad, batch index,
    block table, ALiBi, block lists, softcap, the window's bounds, the study switches' tickets and bounds
    verdict; the check's and the append's vectors and table) as a named parameter defaulting to None after the required ones, the flag derived
    inside: no HAS_* flags, no placeholder tensors, no numeric stand-ins for "off"; BLOCK_D derived
    from HEAD_DIM."""
    from sparseflash.flash import decode

    flags = {"PAGED", "SPARSE", "DIRECT", "STORE_LSE", "BLOCK_D"}
    optional = {"Out", "stride_o", "LSE", "stride_lse", "O_part", "LSE_part", "seqlens", "leftpad", "batch_idx",
                "block_table", "stride_tb", "PAGE", "alibi", "stride_ab", "blk_idx", "stride_idx", "blk_cnt",
                "stride_cnt", "TILES_PER_BLOCK", "softcap", "left", "right", "n_rows", "n_pages", "n_table", "BLOCK_T",
                "Tickets", "BLOCK_S", "Ok", "bounds"}
    for name, most, strides in (("decode_split_kernel", 40, "strides"), ("decode_combine_kernel", 12, "stride_o"),
                                ("decode_bounds_kernel", 15, None), ("decode_append_kernel", 16, "stride_k_new")):
        ps = list(inspect.signature(getattr(decode, name).fn).parameters.values())
        names = [p.name for p in ps]
        assert len(ps) <= most, (name, len(ps))
        assert not [n for n in names if n.startswith("HAS_") or n in flags], name
        assert strides is None or strides in names, name
        per_dim = {f"stride_{t}{d}" for t in "qoklvicnw" for d in "bthnd"}  # (the strides one per parameter)
        assert not per_dim & set(names), name
        given = [p.default is inspect.Parameter.empty for p in ps]
        assert given == sorted(given, reverse=True), name  # the required ones first
        assert all(p.default is None for p in ps if not given[names.index(p.name)]), name
        assert {p.name for p in ps if not given[names.index(p.name)]} <= optional, name
