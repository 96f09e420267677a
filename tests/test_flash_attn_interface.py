"""flash-attn 2's interface (`sparseflash.flash_attn_func`, `flash_attn_varlen_func`): flash-attn's
documented semantics checked against SDPA in float64 on token masks built here from flash-attn's
formulas (per sequence for varlen, ``cu_seqlens_q != cu_seqlens_k``, bottom-right causal, windows),
then outputs and every gradient against the float64 reference within 2x PyTorch's own error
(reference backend, and the Triton kernels under the interpreter at tiny sizes); softcap and ALiBi
against a direct float64 formula (SDPA with ALiBi as an explicit additive bias; per sequence for
varlen, packed and per-sequence calls); return values, views instead of copies, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _attn_check import assert_within_torch_error, flash_attn_allowed

import sparseflash
from sparseflash import BlockMask, reference
from sparseflash.flash import launch
from sparseflash.segments import key_ranges_from_cu_seqlens


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)




def _sdpa(q, k, v, allowed, scale=None, alibi_slopes=None):
    """SDPA on [B, N, H, D] tensors (GQA by repeating k/v heads) with a bool token mask [Nq, Nk];
    rows with no key are 0 (SDPA's own value for them is not defined). ``alibi_slopes`` ([H] or
    [B, H]): flash-attn's documented bias -slope * |i + Nk - Nq - j| as an additive float mask."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2)
    allowed = allowed.to(q.device)
    empty = ~allowed.any(-1)
    fixed = allowed.clone()
    fixed[empty] = True
    attn_mask = fixed
    if alibi_slopes is not None:
        Nq, Nk = allowed.shape
        dist = (torch.arange(Nq)[:, None] + Nk - Nq - torch.arange(Nk)[None, :]).abs().to(q.device, q.dtype)
        bias = -alibi_slopes.to(q.dtype).reshape(-1, q.shape[2])[:, :, None, None] * dist
        attn_mask = bias.masked_fill(~fixed, float("-inf"))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale).transpose(1, 2)
    return o.masked_fill(empty[None, :, None, None], 0.0)


def _softcapped(q, k, v, allowed, softcap, alibi_slopes=None):
    """flash-attn's softcap written out: softmax(cap * tanh(q.k / sqrt(d) / cap) - slope |i + Nk - Nq - j|) v."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        Nq, Nk = allowed.shape
        dist = (torch.arange(Nq)[:, None] + Nk - Nq - torch.arange(Nk)[None, :]).abs().to(q.device, q.dtype)
        s = s - alibi_slopes.to(q.dtype).reshape(-1, q.shape[2])[:, :, None, None] * dist
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _grads(fn, tensors, do):
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*ts)
    out.backward(do.to(out.dtype))
    return [out.detach()] + [t.grad for t in ts]


def _check(name, got, pt, ref, dtype):
    for n, a, b, c in zip(("out", "dq", "dk", "dv"), got, pt, ref):
        assert_within_torch_error(f"{name} {n}", a, b, c, dtype)


# ---------------------------------------------------------------- flash_attn_func
CASES = [  # (B, Nq, Nk, H, Hk, D, causal, window)
    (2, 37, 37, 2, 2, 16, False, (-1, -1)),
    (1, 20, 45, 4, 2, 16, True, (-1, -1)),   # causal, seqlen_q < seqlen_k: bottom-right
    (2, 45, 20, 2, 1, 40, True, (-1, -1)),   # seqlen_q > seqlen_k: the first 25 rows see nothing
    (1, 50, 50, 2, 2, 16, False, (6, 3)),    # sliding window both ways
    (2, 33, 61, 2, 1, 16, True, (9, -1)),    # causal sliding window, Nq != Nk, GQA
    (1, 40, 30, 2, 2, 16, False, (-1, 0)),   # window (-1, 0) is causal
]


def _id(c):
    B, Nq, Nk, H, Hk, D, causal, w = c
    return f"B{B}-N{Nq}x{Nk}-H{H}/{Hk}-D{D}" + ("-causal" if causal else "") + ("" if w == (-1, -1) else f"-w{w[0]},{w[1]}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_func_semantics_equal_sdpa(case):
    """float64 (the reference backend): flash_attn_func is SDPA on flash-attn's token mask."""
    B, Nq, Nk, H, Hk, D, causal, window = case
    g = torch.Generator().manual_seed(Nq * Nk)
    q = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Nk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64)
    allowed = flash_attn_allowed(Nq, Nk, causal, window)
    got = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=window), (q, k, v), do)
    want = _grads(lambda a, b, c: _sdpa(a, b, c, allowed), (q, k, v), do)
    for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=n)
    empty = ~allowed.any(-1)
    assert torch.equal(got[0][:, empty], torch.zeros_like(got[0][:, empty]))


KERNEL_CASES = [(c, dt, "ranges") for dt in (torch.float16, torch.float32) for c in (CASES[1], CASES[2], CASES[4])] + [
    ((1, 300, 300, 2, 1, 16, True, (100, -1)), torch.float16, "mask")]


@pytest.mark.parametrize("case, dtype, route", KERNEL_CASES,
                         ids=[f"{_id(c)}-{str(dt)[6:]}-{r}" for c, dt, r in KERNEL_CASES])
def test_func_kernels_against_float64(case, dtype, route, device, monkeypatch):
    """The Triton kernels (interpreter on CPU): output and gradients within 2x PyTorch's own error;
    a window through the key-range test, or (route "mask") through its cached exact mask's bits."""
    fai = sparseflash.flash_attn_interface
    fai._WINDOW_MASKS.clear()
    monkeypatch.setattr(fai, "WINDOW_MASK_MIN", 16 if route == "mask" else 1 << 40)
    B, Nq, Nk, H, Hk, D, causal, window = case
    g = torch.Generator().manual_seed(Nq + Nk)
    q = torch.randn(B, Nq, H, D, generator=g)
    k, v = (torch.randn(B, Nk, Hk, D, generator=g) for _ in range(2))
    do = torch.randn(B, Nq, H, D, generator=g)
    allowed = flash_attn_allowed(Nq, Nk, causal, window)
    ref = _grads(lambda a, b, c: _sdpa(a, b, c, allowed), [t.double() for t in (q, k, v)], do.double())
    pt = _grads(lambda a, b, c: _sdpa(a, b, c, allowed), [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    # deterministic=True per call on every GPU (on Hopper: the portable backward for this call); the
    # window also as a 2-element int tensor, as flash-attn's tests pass it
    got = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=torch.tensor(window),
                                                             deterministic=True),
                 [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    if device == "cuda":  # bitwise repeatable
        again = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=window,
                                                                   deterministic=True),
                       [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
        assert all(torch.equal(x, y) for x, y in zip(got, again))
    if route == "mask":  # the window's cached mask ran, with its bits
        ((_, mask),) = fai._WINDOW_MASKS.values()
        assert mask.exact_bits(torch.device(device)) is not None and mask.partial.any()
    fai._WINDOW_MASKS.clear()
    _check(_id(case), [t.cpu() for t in got], [t.cpu() for t in pt], ref, dtype)


@pytest.fixture
def window_masks(monkeypatch):
    """flash_attn_func's window as a cached exact BlockMask from 16 tokens on (`WINDOW_MASK_MIN`), the
    cache emptied before and after."""
    fai = sparseflash.flash_attn_interface
    monkeypatch.setattr(fai, "WINDOW_MASK_MIN", 16)
    fai._WINDOW_MASKS.clear()
    yield fai._WINDOW_MASKS
    fai._WINDOW_MASKS.clear()


@pytest.mark.parametrize("case", [c for c in CASES if c[7] != (-1, -1)], ids=_id)
def test_func_window_mask_semantics(case, window_masks):
    """float64: a window through the cached exact mask is still SDPA on flash-attn's token mask, and
    the mask was built (once per shape)."""
    B, Nq, Nk, H, Hk, D, causal, window = case
    g = torch.Generator().manual_seed(Nq * Nk + 1)
    q = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Nk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64)
    allowed = flash_attn_allowed(Nq, Nk, causal, window)
    for _ in range(2):
        got = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=window),
                     (q, k, v), do)
    assert len(window_masks) == 1
    want = _grads(lambda a, b, c: _sdpa(a, b, c, allowed), (q, k, v), do)
    for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=n)


def test_func_window_mask_when(monkeypatch, window_masks):
    """Which calls take the cached window mask: a window on sequences of at least WINDOW_MASK_MIN
    tokens without mask=; shorter ones and calls with their own mask keep the key ranges; the cache
    keeps the last few shapes."""
    seen = []
    real = sparseflash.flash_attn_interface.attention

    def spy(*args, **kw):
        seen.append((args[3], kw.get("key_ranges"), kw.get("exact")))
        return real(*args, **kw)

    monkeypatch.setattr(sparseflash.flash_attn_interface, "attention", spy)
    q = torch.randn(1, 40, 2, 8, dtype=torch.float64)
    sparseflash.flash_attn_func(q, q, q, window_size=(5, 0))
    mask, kr, exact = seen[-1]
    assert isinstance(mask, BlockMask) and kr is None and exact is True
    sparseflash.flash_attn_func(q, q, q, window_size=(5, 0))
    assert seen[-1][0] is mask
    sparseflash.flash_attn_func(q[:, :10], q[:, :10], q[:, :10], window_size=(5, 0))  # under the minimum
    assert seen[-1][0] is None and seen[-1][1] is not None
    own = BlockMask.from_fn(lambda b, h, i, j: j <= i, 40, block_size=16)
    sparseflash.flash_attn_func(q, q, q, window_size=(5, 0), mask=own)  # the caller's mask: key ranges too
    assert seen[-1][0] is own and seen[-1][1] is not None
    monkeypatch.setattr(sparseflash.flash_attn_interface, "_WINDOW_MASKS_MAX", 2)
    for w in range(1, 5):
        sparseflash.flash_attn_func(q, q, q, window_size=(w, 0))
    assert len(window_masks) == 2 and list(window_masks)[-1][2] == (4, 0)


def test_func_returns_and_views(monkeypatch):
    """(out, softmax_lse, None) with flash-attn's shapes (+inf where a row attends nothing); q, k, v
    reach attention as views of the caller's tensors (also slices of a packed qkv); mask= passes on."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 30, 3, 2, 16, generator=g, dtype=torch.float64)
    q, k, v = qkv.unbind(2)
    seen = []
    real = sparseflash.flash_attn_interface.attention

    def spy(a, b, c, *args, **kw):
        seen.append((a, b, c))
        return real(a, b, c, *args, **kw)

    monkeypatch.setattr(sparseflash.flash_attn_interface, "attention", spy)
    out, lse, s = sparseflash.flash_attn_func(q, k[:, :20], v[:, :20], causal=True, return_attn_probs=True)
    assert s is None and out.shape == (2, 30, 2, 16) and out.is_contiguous() and lse.shape == (2, 2, 30)
    for a, b in zip(seen[0], (q, k, v)):
        assert a.data_ptr() == b.data_ptr() and a._base is not None  # a view, never a copy
    scores = torch.einsum("bihd,bjhd->bhij", q, k[:, :20]) / 4.0
    scores = scores.masked_fill(~flash_attn_allowed(30, 20, True), float("-inf"))
    want = torch.logsumexp(scores, -1)
    assert torch.isposinf(lse[..., :10]).all()  # flash-attn's value for rows that attend nothing
    torch.testing.assert_close(lse[..., 10:], want[..., 10:])
    # mask=: the same as attention's, on the transposed view
    layout = torch.tensor([[True, False], [True, True]])
    m = BlockMask.from_layout(layout, block_size=16, seq_q=30, seq_k=30)
    got = sparseflash.flash_attn_func(q, k, v, mask=m)
    want = sparseflash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_func_errors_name_the_option():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        sparseflash.flash_attn_func(q, q, q, softcap=-30.0)
    with pytest.raises(TypeError, match="softcap must be a float"):
        sparseflash.flash_attn_func(q, q, q, softcap=None)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[heads_q\] = \[2\]"):
        sparseflash.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes must have dtype float32"):
        sparseflash.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        sparseflash.flash_attn_func(q, q, q, window_size=4)
    with pytest.raises(TypeError, match="window_size must be a pair of ints.*a tensor must hold 2 integers"):
        sparseflash.flash_attn_func(q, q, q, window_size=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="window_size must be a pair of ints.*a tensor must hold 2 integers"):
        sparseflash.flash_attn_func(q, q, q, window_size=torch.tensor([1, 2, 3]))
    a = sparseflash.flash_attn_func(q, q, q, window_size=[3, 1])  # a list, a tensor and numpy ints: the same
    b = sparseflash.flash_attn_func(q, q, q, window_size=torch.tensor([3, 1], dtype=torch.int32))
    c = sparseflash.flash_attn_func(q, q, q, window_size=tuple(np.array([3, 1])))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seqlen_q, nheads, headdim\]"):
        sparseflash.flash_attn_func(q[0], q, q)
    with pytest.raises(TypeError, match="causal must be a bool"):
        sparseflash.flash_attn_func(q, q, q, causal=None)
    with pytest.raises(TypeError, match="mask must be a sparseflash.BlockMask.*from_fn"):
        sparseflash.flash_attn_func(q, q, q, mask=lambda b, h, i, j: j <= i)


# ---------------------------------------------------------------- flash_attn_varlen_func
# (L_q, L_k) per sequence: equal, L_q < L_k, L_q > L_k (rows that see nothing under causal),
# one query (decoding), an empty query sequence, an empty key sequence
VARLEN = [(9, 9), (5, 17), (20, 7), (1, 13), (0, 4), (6, 0), (11, 11)]


def _varlen_inputs(lengths, H, Hk, D, dtype, pad_q=0, pad_k=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    lq = torch.tensor([a for a, _ in lengths])
    lk = torch.tensor([b for _, b in lengths])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), lq.cumsum(0).int()])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lk.cumsum(0).int()])
    tq, tk = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    q = torch.randn(tq, H, D, generator=g, dtype=dtype)
    k, v = (torch.randn(tk, Hk, D, generator=g, dtype=dtype) for _ in range(2))
    do = torch.randn(tq, H, D, generator=g, dtype=dtype)
    return q, k, v, do, cu_q, cu_k


def _varlen_sdpa(q, k, v, cu_q, cu_k, causal, window=(-1, -1)):
    """flash-attn's definition, one sequence at a time through SDPA; tokens past cu_q[-1] get 0."""
    out = torch.zeros_like(q)
    for d in range(len(cu_q) - 1):
        a, b, c, e = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        if b == a:
            continue
        if e == c:
            continue  # no keys: the rows stay 0
        o = _sdpa(q[None, a:b], k[None, c:e], v[None, c:e], flash_attn_allowed(b - a, e - c, causal, window))[0]
        out = torch.cat([out[:a], o, out[b:]])
    return out


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (4, -1)), (False, (3, 2))],
                         ids=["full", "causal", "causal-w4", "w3,2"])
def test_varlen_semantics_equal_sdpa_per_sequence(causal, window):
    q, k, v, do, cu_q, cu_k = _varlen_inputs(VARLEN, 4, 2, 16, torch.float64, pad_q=3, pad_k=2, seed=7)
    mq, mk = 20, 17
    got = _grads(lambda a, b, c: sparseflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, mq, mk, causal=causal,
                                                                    window_size=window), (q, k, v), do)
    want = _grads(lambda a, b, c: _varlen_sdpa(a, b, c, cu_q, cu_k, causal, window), (q, k, v), do)
    for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=n)
    assert torch.equal(got[0][-3:], torch.zeros_like(got[0][-3:]))  # padding queries: 0


@pytest.fixture
def varlen_masks(monkeypatch):
    """flash_attn_varlen_func's cached exact masks from 8 packed tokens on (`VARLEN_MASK_MIN`), the cache
    emptied before and after."""
    fai = sparseflash.flash_attn_interface
    monkeypatch.setattr(fai, "VARLEN_MASK_MIN", 8)
    fai._VARLEN_MASKS.clear()
    yield fai._VARLEN_MASKS
    fai._VARLEN_MASKS.clear()


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (4, -1)), (False, (3, 2))],
                         ids=["full", "causal", "causal-w4", "w3,2"])
def test_varlen_mask_semantics(causal, window, varlen_masks):
    """float64: the varlen call through its cached exact mask is still SDPA per sequence (with
    cu_seqlens_q != cu_seqlens_k, empty sequences and padding), the second call reusing the mask."""
    q, k, v, do, cu_q, cu_k = _varlen_inputs(VARLEN, 4, 2, 16, torch.float64, pad_q=3, pad_k=2, seed=7)
    for _ in range(2):
        got = _grads(lambda a, b, c: sparseflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 20, 17, causal=causal,
                                                                        window_size=window), (q, k, v), do)
    assert len(varlen_masks) == 1
    want = _grads(lambda a, b, c: _varlen_sdpa(a, b, c, cu_q, cu_k, causal, window), (q, k, v), do)
    for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=n)


def test_varlen_mask_reuse_and_checks(monkeypatch, varlen_masks):
    """The cu_seqlens values are read and checked once per cu_seqlens tensors: the same unchanged
    tensors reuse the mask without a host read; a changed tensor (in place) or a new one is checked
    and built again; a bad cu_seqlens is refused either way; mask= or ALiBi keep the key ranges."""
    fai = sparseflash.flash_attn_interface
    reads = []
    real = fai._check_cu_seqlens
    monkeypatch.setattr(fai, "_check_cu_seqlens",
                        lambda *a, **kw: (reads.append(a[6] if len(a) > 6 else kw.get("values", True)), real(*a, **kw)))
    q, k, v, _, cu_q, cu_k = _varlen_inputs(VARLEN, 2, 2, 8, torch.float64, seed=1)
    call = lambda cq, ck, **kw: sparseflash.flash_attn_varlen_func(q, k, v, cq, ck, 20, 17, causal=True, **kw)
    first = call(cu_q, cu_k)
    assert reads.count(True) == 2 and len(varlen_masks) == 1
    reads.clear()
    again = call(cu_q, cu_k)
    assert reads.count(True) == 0 and torch.equal(first, again)  # no host read of the values
    (mask,) = [m for _, m in varlen_masks.values()]
    cu_k2 = cu_k.clone()
    call(cu_q, cu_k2)  # a new tensor, equal values: checked and built again
    assert reads.count(True) == 2 and len(varlen_masks) == 2
    reads.clear()
    cu_k2[-1] = cu_k2[-2]  # in place: the last sequence loses its keys
    out = call(cu_q, cu_k2)
    assert reads.count(True) == 2 and len(varlen_masks) == 3
    a = int(cu_q[-2])
    assert torch.equal(out[a:int(cu_q[-1])], torch.zeros_like(out[a:int(cu_q[-1])]))
    bad = cu_k.clone()
    bad[1] = 100
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease"):
        call(cu_q, bad)
    seen = []
    real_attention = fai.attention
    monkeypatch.setattr(fai, "attention", lambda *a, **kw: (seen.append(kw.get("key_ranges")), real_attention(*a, **kw))[1])
    own = BlockMask.from_fn(lambda b, h, i, j: j >= 0, q.shape[0], k.shape[0], block_size=16)
    call(cu_q, cu_k, mask=own)
    assert seen[0] is not None  # the caller's mask: the key ranges
    call(cu_q, cu_k, alibi_slopes=torch.ones(2))
    assert len(varlen_masks) == 3 and mask is not None  # neither built a mask


@pytest.mark.parametrize("dtype, route", [(torch.float16, "ranges"), (torch.bfloat16, "ranges"), (torch.float32, "ranges"),
                                          (torch.float16, "mask")], ids=lambda x: str(x)[6:] if isinstance(x, torch.dtype) else x)
def test_varlen_kernels_against_float64(dtype, route, device, monkeypatch):
    """The Triton kernels, causal bottom-right per sequence with cu_seqlens_q != cu_seqlens_k: output
    and gradients within 2x PyTorch's own error (the same computation in dtype: the reference);
    through the key-range test, and through the cached exact mask (its bit tiles; route "mask")."""
    from sparseflash.flash import autograd

    fai = sparseflash.flash_attn_interface
    fai._VARLEN_MASKS.clear()
    monkeypatch.setattr(fai, "VARLEN_MASK_MIN", 8 if route == "mask" else 1 << 40)
    if device == "cpu":
        monkeypatch.setattr(autograd, "SEGMENT_BLOCK", 32)  # several blocks to prune at this size
    q, k, v, do, cu_q, cu_k = _varlen_inputs(VARLEN, 2, 1, 40, torch.float32, pad_q=2, seed=3)
    ranges = key_ranges_from_cu_seqlens(cu_q, cu_k, q.shape[0], causal=True)

    def ref_fn(a, b, c, compute_dtype=None):
        o = reference.attention(a.unsqueeze(0).transpose(1, 2), b.unsqueeze(0).transpose(1, 2),
                                c.unsqueeze(0).transpose(1, 2), key_ranges=ranges, compute_dtype=compute_dtype)
        return o[0].transpose(0, 1)

    ref = _grads(ref_fn, [t.double() for t in (q, k, v)], do.double())
    pt = _grads(lambda a, b, c: ref_fn(a, b, c, dtype), [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    got = _grads(lambda a, b, c: sparseflash.flash_attn_varlen_func(a, b, c, cu_q.to(device), cu_k.to(device), 20, 17,
                                                                    causal=True),
                 [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    _check(f"varlen {dtype}", [t.cpu() for t in got], [t.cpu() for t in pt], ref, dtype)
    assert len(fai._VARLEN_MASKS) == (1 if route == "mask" else 0)
    fai._VARLEN_MASKS.clear()
    # the reference's definition is flash-attn's
    torch.testing.assert_close(ref[0], _varlen_sdpa(q.double(), k.double(), v.double(), cu_q, cu_k, True))


def test_varlen_returns_and_errors():
    q, k, v, do, cu_q, cu_k = _varlen_inputs(VARLEN, 2, 2, 16, torch.float64, seed=1)
    out, lse, s = sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 17, causal=True, return_attn_probs=True)
    assert s is None and out.shape == q.shape and out.is_contiguous() and lse.shape == (2, q.shape[0])
    # sequence 2 (L_q=20, L_k=7): its first 13 queries attend nothing -> lse +inf, out 0
    a = int(cu_q[2])
    assert torch.isposinf(lse[:, a:a + 13]).all() and torch.isfinite(lse[:, a + 13:a + 20]).all()
    assert not out[a:a + 13].any()
    with pytest.raises(ValueError, match="max_seqlen_q=19 is below the longest sequence of cu_seqlens_q"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 17)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k.flip(0), 20, 17)
    with pytest.raises(ValueError, match="same number of sequences"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:-1], 20, 17)
    with pytest.raises(ValueError, match=r"q must be 3-D \[total_q, nheads, headdim\]"):
        sparseflash.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 20, 17)
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 17, softcap=-5.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must be .* or \[batch, nheads\] = \[7, 2\]"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 17, alibi_slopes=torch.ones(2, 2))
    with pytest.raises(NotImplementedError, match="runs one call per sequence, which mask="):  # cu_q != cu_k
        m = BlockMask.from_layout(torch.ones(1, 1, dtype=torch.bool), block_size=64, seq_q=q.shape[0], seq_k=k.shape[0])
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 17, alibi_slopes=torch.ones(2), mask=m)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q.float(), cu_k, 20, 17)


def test_key_ranges_validation_and_segments_exclusive():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=r"key_ranges must have shape \[batch, seq_q, 2\]"):
        sparseflash.attention(q, q, q, key_ranges=torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="key_ranges must have an integer dtype"):
        sparseflash.attention(q, q, q, key_ranges=torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="segment_ids and key_ranges cannot be combined"):
        sparseflash.attention(q, q, q, key_ranges=torch.zeros(1, 8, 2, dtype=torch.int32),
                              segment_ids=torch.zeros(1, 8, dtype=torch.int32))


# ---------------------------------------------------------------- key ranges in the kernels, combined
def _ranges_case(device):
    q, k, v, do, cu_q, cu_k = _varlen_inputs(VARLEN, 2, 2, 32, torch.float32, pad_q=2, seed=5)
    ranges = key_ranges_from_cu_seqlens(cu_q, cu_k, q.shape[0], causal=True, window_size=(6, -1)).to(device)
    q, k, v, do = (t.unsqueeze(0).transpose(1, 2).contiguous().to(device) for t in (q, k, v, do))
    return q, k, v, do, ranges


def test_key_ranges_lse_dropout_and_determinism(device):
    """Key ranges with return_lse (and its gradient) and dropout: the reference's keep-mask, and a
    bitwise reproducible backward."""
    q, k, v, do, ranges = _ranges_case(device)
    dl = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    for backend in ("triton", "reference", "triton"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        g = torch.Generator(device=device).manual_seed(3)
        o, lse = sparseflash.attention(qq, kk, vv, return_lse=True, dropout_p=0.3, generator=g, key_ranges=ranges,
                                       backend=backend)
        ((o * do).sum() + (lse.masked_fill(lse.isinf(), 0) * dl).sum()).backward()
        runs.append((o, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(runs[0], runs[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    for a, b in zip(runs[0], runs[2]):
        assert torch.equal(a, b)


def test_key_ranges_with_mask_key_lengths_tma_and_q_rows(device, tma_on, monkeypatch):
    """Key ranges ANDed with a block mask, causal and key_lengths, in the TMA kernels' single loop and
    in both dK/dV tile orientations; the lists prune what no range reaches."""
    from _attn_check import check_attention

    from sparseflash.flash import TileConfig, tile_config

    q, k, v, do, ranges = _ranges_case(device)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    Nq, Nk = q.shape[2], k.shape[2]
    layout = torch.rand(2, -(-Nq // 32), -(-Nk // 32), generator=torch.Generator().manual_seed(2)) < 0.7
    mask = BlockMask.from_layout(layout, block_size=32, seq_q=Nq, seq_k=Nk)
    kl = torch.tensor([Nk - 5], device=device)
    for q_rows in (False, True):
        with tile_config(dkdv=TileConfig(32, 32, q_rows=q_rows)):
            check_attention(lambda a, b, c: sparseflash.attention(a, b, c, mask, causal=True, key_lengths=kl,
                                                                  key_ranges=ranges, backend="triton"),
                            q, k, v, do, mask=mask, causal=True, key_lengths=kl, ref_kwargs=dict(key_ranges=ranges))
    assert len(tma_on) == 6 and all(tma_on), f"a kernel did not take the TMA path: {tma_on}"
    from sparseflash.flash import autograd
    from sparseflash.segments import check_key_ranges, key_range_block_layout

    table = check_key_ranges(ranges, 1, Nq, Nk, ranges.device)
    kv_idx, _, bq, bk = autograd.segment_lists(None, table, mask, ranges.device, Nk)
    on = key_range_block_layout(table, Nk, 32, 32)
    assert bool((~on).any()) and int((kv_idx < kv_idx.shape[-1]).sum()) == int((mask.layout.to(on.device) & on).sum())
    # every attended pair lies in an on block of the pruned layout
    allowed = reference._token_mask_rows(None, torch.arange(Nq, device=ranges.device), Nk, False, Nq, None,
                                         ranges.device, key_ranges=ranges)[0, 0]
    blocks = on[0, 0].repeat_interleave(32, 0)[:Nq].repeat_interleave(32, 1)[:, :Nk]
    assert not bool((allowed & ~blocks).any())


# ---------------------------------------------------------------- softcap and ALiBi
SCORE_MOD_CASES = [CASES[0], CASES[2], CASES[4]]  # plain, Nq > Nk causal (empty rows), causal window Nq != Nk


@pytest.mark.parametrize("case", SCORE_MOD_CASES, ids=_id)
def test_func_softcap_alibi_semantics(case):
    """float64 (reference backend): ALiBi ([nheads] and [batch, nheads]) is SDPA with flash-attn's
    bias -slope |i + seqlen_k - seqlen_q - j| as an additive mask; softcap (alone and with ALiBi) is
    the formula written out; outputs and gradients."""
    B, Nq, Nk, H, Hk, D, causal, window = case
    g = torch.Generator().manual_seed(Nq * Nk + 1)
    q = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(B, Nk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, Nq, H, D, generator=g, dtype=torch.float64)
    allowed = flash_attn_allowed(Nq, Nk, causal, window)
    slopes = torch.rand(B, H, generator=g, dtype=torch.float64) * 0.5
    runs = [(dict(alibi_slopes=slopes[0]), lambda a, b, c: _sdpa(a, b, c, allowed, alibi_slopes=slopes[0])),
            (dict(alibi_slopes=slopes), lambda a, b, c: _sdpa(a, b, c, allowed, alibi_slopes=slopes)),
            (dict(softcap=2.0), lambda a, b, c: _softcapped(a, b, c, allowed, 2.0)),
            (dict(softcap=1.5, alibi_slopes=slopes), lambda a, b, c: _softcapped(a, b, c, allowed, 1.5, slopes))]
    for kw, want_fn in runs:
        got = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=window, **kw),
                     (q, k, v), do)
        want = _grads(want_fn, (q, k, v), do)
        for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"{n} {list(kw)}")
    plain = sparseflash.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert (got[0] - plain).abs().max() > 1e-3  # (the options change the answer)


@pytest.mark.parametrize("same_cu", [True, False], ids=["packed", "per-sequence"])
def test_varlen_alibi_softcap_semantics(same_cu):
    """float64: varlen ALiBi per sequence (each sequence's own seqlen_k - seqlen_q) with softcap,
    against the formula one sequence at a time. cu_seqlens_q == cu_seqlens_k with per-head slopes
    runs as one packed call; cu_seqlens_q != cu_seqlens_k and per-sequence slopes run per sequence."""
    lengths = [(a, a) for a, _ in VARLEN] if same_cu else VARLEN
    q, k, v, do, cu_q, cu_k = _varlen_inputs(lengths, 4, 2, 16, torch.float64, pad_q=3, pad_k=0 if same_cu else 2,
                                             seed=11)
    if same_cu:
        cu_k = cu_q
        k, v = k[:q.shape[0]], v[:q.shape[0]]
    g = torch.Generator().manual_seed(5)
    for slopes in (torch.rand(4, generator=g, dtype=torch.float64), torch.rand(len(VARLEN), 4, generator=g,
                                                                               dtype=torch.float64)):
        def want_fn(a, b, c):
            out = torch.zeros_like(a)
            for d in range(len(cu_q) - 1):
                s, e, s2, e2 = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
                if e > s and e2 > s2:
                    sl = slopes if slopes.dim() == 1 else slopes[d]
                    o = _softcapped(a[None, s:e], b[None, s2:e2], c[None, s2:e2], flash_attn_allowed(e - s, e2 - s2, True), 3.0, sl)
                    out = torch.cat([out[:s], o[0], out[e:]])
            return out

        got = _grads(lambda a, b, c: sparseflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 20, 20, causal=True,
                                                                        softcap=3.0, alibi_slopes=slopes), (q, k, v), do)
        want = _grads(want_fn, (q, k, v), do)
        for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"{n} slopes {tuple(slopes.shape)}")
        out, lse, _ = sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, causal=True, softcap=3.0,
                                                         alibi_slopes=slopes, return_attn_probs=True)
        assert lse.shape == (4, q.shape[0]) and torch.isposinf(lse[:, -3:]).all() and not out[-3:].any()


def test_varlen_alibi_packed_takes_one_call(monkeypatch):
    """cu_seqlens_q == cu_seqlens_k and per-head slopes: one attention call over the packed rows."""
    q, k, v, _, cu_q, _ = _varlen_inputs([(a, a) for a, _ in VARLEN], 2, 2, 16, torch.float64, seed=2)
    calls = []
    real = sparseflash.flash_attn_interface.attention
    monkeypatch.setattr(sparseflash.flash_attn_interface, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sparseflash.flash_attn_varlen_func(q, k[:q.shape[0]], v[:q.shape[0]], cu_q, cu_q, 20, 20, alibi_slopes=torch.ones(2))
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_func_softcap_alibi_kernels_against_float64(dtype, device):
    """The Triton kernels through flash_attn_func (causal sliding window, Nq != Nk, GQA, softcap and
    ALiBi): output and gradients within 2x PyTorch's own error (SDPA-free formula in dtype)."""
    B, Nq, Nk, H, Hk, D, causal, window = CASES[4]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, Nq, H, D, generator=g) * 2
    k, v = (torch.randn(B, Nk, Hk, D, generator=g) for _ in range(2))
    do = torch.randn(B, Nq, H, D, generator=g)
    slopes = torch.rand(H, generator=g)
    allowed = flash_attn_allowed(Nq, Nk, causal, window)
    ref = _grads(lambda a, b, c: _softcapped(a, b, c, allowed, 4.0, slopes.double()), [t.double() for t in (q, k, v)],
                 do.double())
    pt = _grads(lambda a, b, c: _softcapped(a, b, c, allowed.to(device), 4.0, slopes.to(device, dtype)),
                [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    got = _grads(lambda a, b, c: sparseflash.flash_attn_func(a, b, c, causal=causal, window_size=window, softcap=4.0,
                                                             alibi_slopes=slopes.to(device)),
                 [t.to(device, dtype) for t in (q, k, v)], do.to(device, dtype))
    _check(f"softcap-alibi {dtype}", [t.cpu() for t in got], [t.cpu() for t in pt], ref, dtype)


def test_packed_variants_are_views_with_gradients(monkeypatch):
    """The four packed functions pass views of the packed tensor (no copy) and equal the unpacked
    calls; gradients flow back into the packed tensor; a wrong packing is a clear error."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 12, 3, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    seen = []
    real = sparseflash.flash_attn_interface.attention

    def spy(a, b, c, *args, **kw):
        seen.append((a, b, c))
        return real(a, b, c, *args, **kw)

    monkeypatch.setattr(sparseflash.flash_attn_interface, "attention", spy)
    out = sparseflash.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, 0))
    assert all(t.data_ptr() == qkv.data_ptr() + i * qkv.stride(2) * qkv.element_size()
               for i, t in enumerate(seen[-1]))
    q, k, v = qkv.detach().unbind(2)
    torch.testing.assert_close(out, sparseflash.flash_attn_func(q, k, v, causal=True, window_size=(4, 0)))
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape and qkv.grad.abs().sum() > 0
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    out = sparseflash.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    assert len(out) == 3 and out[2] is None
    torch.testing.assert_close(out[0], sparseflash.flash_attn_func(q, k, v))
    out[0].sum().backward()
    assert kv.grad.abs().sum() > 0
    cu = torch.tensor([0, 5, 12, 24], dtype=torch.int32)
    flat = qkv.detach().flatten(0, 1).clone().requires_grad_()
    got = sparseflash.flash_attn_varlen_qkvpacked_func(flat, cu, 12, causal=True)
    fq, fk, fv = flat.detach().unbind(1)
    torch.testing.assert_close(got, sparseflash.flash_attn_varlen_func(fq, fk, fv, cu, cu, 12, 12, causal=True))
    got.sum().backward()
    assert flat.grad.abs().sum() > 0
    fkv = flat.detach()[:, 1:]
    got = sparseflash.flash_attn_varlen_kvpacked_func(fq, fkv, cu, cu, 12, 12)
    torch.testing.assert_close(got, sparseflash.flash_attn_varlen_func(fq, fk, fv, cu, cu, 12, 12))
    with pytest.raises(ValueError, match=r"qkv must be 5-D \[batch, seqlen, 3, nheads, headdim\] with 3 at dim -3"):
        sparseflash.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv must be 4-D \[total_k, 2, nheads_k, headdim\]"):
        sparseflash.flash_attn_varlen_kvpacked_func(fq, flat, cu, cu, 12, 12)


def test_varlen_block_table_reads_pages():
    """flash_attn_varlen_func(block_table=...): k, v in pages (shuffled page ids, a page size that does
    not divide the lengths) give what the packed keys give, with gradients into the pages."""
    g = torch.Generator().manual_seed(6)
    lens_k, page = [7, 13, 5], 4
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 20, 25], dtype=torch.int32)
    q = torch.randn(8, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(25, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    n_pages, max_pages = 12, 4
    perm = torch.randperm(n_pages, generator=g)
    table = torch.full((3, max_pages), -1, dtype=torch.int32)
    kp = torch.zeros(n_pages, page, 2, 16, dtype=torch.float64)
    vp = torch.zeros_like(kp)
    used = 0
    for b, n in enumerate(lens_k):
        for p in range(-(-n // page)):
            pid = int(perm[used])
            used += 1
            table[b, p] = pid
            lo = int(cu_k[b]) + p * page
            hi = min(lo + page, int(cu_k[b + 1]))
            kp[pid, : hi - lo], vp[pid, : hi - lo] = k[lo:hi], v[lo:hi]
    kp.requires_grad_()
    for causal in (False, True):
        want = sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 13, causal=causal)
        got = sparseflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 13, causal=causal, block_table=table)
        torch.testing.assert_close(got, want)
    got.sum().backward()
    assert kp.grad[perm[used:]].abs().sum() == 0 and kp.grad.abs().sum() > 0  # unused pages get nothing
    with pytest.raises(ValueError, match="block_table holds 1 pages of 4 tokens per sequence"):
        sparseflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 13, block_table=table[:, :1])
    with pytest.raises(TypeError, match=r"block_table must be an int32 tensor \[batch, max_blocks_per_seq\]"):
        sparseflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 13, block_table=table[0])
    with pytest.raises(ValueError, match=r"k with block_table must be a paged cache"):
        sparseflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 13, block_table=table)
