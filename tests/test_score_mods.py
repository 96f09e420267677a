"""Score modifications of `sparseflash.attention`: ``softcap`` (tanh soft-capping) and
``alibi_slopes`` (ALiBi). The float64 reference against a direct formula written here; the Triton
kernels (interpreter on CPU, at tiny sizes) against the float64 reference within 2x PyTorch's own
error, outputs and dq, dk, dv, each combined with the other options (GQA, causal with
seq_q != seq_k and empty rows, block masks, key_lengths, segments, key ranges, dropout, the
log-sum-exp, torch.compile, TMA loads and both dK/dV orientations); calls with them take the
portable kernels; bad arguments are named."""

from __future__ import annotations

import math

import pytest
import torch
from _attn_check import check_attention, make_qkv
from _hopper import compile_sm90

import sparseflash
from sparseflash import BlockMask, reference
from sparseflash.flash import TileConfig, dispatch, launch, tile_config
from sparseflash.segments import key_ranges_from_cu_seqlens


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _slopes(B, H, per_batch, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = 2.0 ** (-8.0 * (torch.arange(1, H + 1) / H))  # the ALiBi paper's geometric slopes ...
    s = s * (0.5 + torch.rand(H, generator=g))         # ... jittered, so heads differ arbitrarily
    return (s[None] * (0.5 + torch.rand(B, 1, generator=g)) if per_batch else s).to(device)


def _direct(q, k, v, softcap, slopes, allowed, scale=None):
    """The definition written out: s = scale q.k; s = cap tanh(s / cap); s -= slope |i + Nk - Nq - j|;
    softmax over the allowed keys ([Nq, Nk] or broadcastable), rows with none are 0."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(D))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        dist = (torch.arange(Nq)[:, None] + Nk - Nq - torch.arange(Nk)[None, :]).abs().to(s.dtype)
        s = s - slopes.reshape(-1, Hq)[:, :, None, None].to(s.dtype) * dist
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 23, 16), (1, 2, 1, 23, 9, 8)], ids=["Nq<Nk-GQA", "Nq>Nk-MQA"])
def test_reference_is_the_formula(shape, causal):
    """float64, outputs and gradients: the reference's softcap, ALiBi ([H] and [B, H]) and both together
    are the formula (flash-attn's order: cap, then bias), on rows that see nothing too (0, no NaN)."""
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v, do = make_qkv(B, Hq, Hkv, Nq, Nk, D, torch.float64, "cpu", seed=Nq)
    q = q * 3  # scores past the cap, where tanh bends
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None] + Nk - Nq
    for softcap, slopes in ((2.5, None), (None, _slopes(B, Hq, False, "cpu")), (1.5, _slopes(B, Hq, True, "cpu"))):
        got, want = [], []
        for fn, out in ((lambda a, b, c: reference.attention(a, b, c, causal=causal, softcap=softcap, alibi_slopes=slopes),
                         got),
                        (lambda a, b, c: _direct(a, b, c, softcap, slopes, allowed), want)):
            ts = [t.clone().requires_grad_() for t in (q, k, v)]
            o = fn(*ts)
            o.backward(do)
            out += [o.detach()] + [t.grad for t in ts]
        for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{n} softcap={softcap} alibi={slopes is not None}")
        assert not got[0].isnan().any()
    # the modifications change the answer (the comparison above could not pass by ignoring them)
    plain = reference.attention(q, k, v, causal=causal)
    assert (reference.attention(q, k, v, causal=causal, softcap=1.5) - plain).abs().max() > 1e-3
    assert (reference.attention(q, k, v, causal=causal, alibi_slopes=_slopes(B, Hq, False, "cpu")) - plain).abs().max() > 1e-3


# ---------------------------------------------------------------- the kernels against float64
KERNEL_CASES = [  # id, (B, Hq, Hkv, Nq, Nk, D), dtype, options
    ("softcap-GQA-D40-f16", (2, 4, 2, 33, 50, 40), torch.float16, dict(softcap=3.0)),
    ("alibi-causal-empty-rows-bf16", (1, 2, 2, 45, 20, 16), torch.bfloat16, dict(alibi=False, causal=True)),
    ("both-BH-slopes-mask-keylen-f32", (2, 2, 1, 40, 56, 32), torch.float32,
     dict(softcap=2.0, alibi=True, causal=True, mask=True, key_lengths=True)),
    ("both-segments-f16", (2, 2, 2, 48, 48, 16), torch.float16, dict(softcap=4.0, alibi=True, segments=True)),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernels_against_float64(case, device):
    _, (B, Hq, Hkv, Nq, Nk, D), dtype, opt = case
    q, k, v, do = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device, seed=Nq + Nk)
    q = (q.float() * 2).to(dtype)  # scores reach past the caps
    kw = {}
    if "softcap" in opt:
        kw["softcap"] = opt["softcap"]
    if "alibi" in opt:
        kw["alibi_slopes"] = _slopes(B, Hq, opt["alibi"], device)
    kw["causal"] = opt.get("causal", False)
    if opt.get("mask"):
        g = torch.Generator().manual_seed(1)
        layout = torch.rand(B, Hq, -(-Nq // 16), -(-Nk // 16), generator=g) < 0.6
        layout[0, 0, 1] = False  # an empty block row: rows that attend nothing
        kw["mask"] = BlockMask.from_layout(layout, block_size=16, seq_q=Nq, seq_k=Nk)
    if opt.get("key_lengths"):
        kw["key_lengths"] = torch.tensor([Nk - 7, Nk], device=device)[:B]
    ref_kw = dict(kw)
    mask = ref_kw.pop("mask", None)
    if opt.get("segments"):
        seg = torch.tensor([0] * 13 + [1] * 20 + [2] * (Nq - 33), dtype=torch.int32, device=device)
        seg = torch.stack([seg, seg.flip(0)])[:B]  # ids need not be sorted
        kw["segment_ids"] = ref_kw["segment_ids"] = seg
    check_attention(lambda a, b, c: sparseflash.attention(a, b, c, backend="triton", **kw), q, k, v, do, mask=mask,
                    ref_kwargs={n: x for n, x in ref_kw.items() if n not in ("causal", "key_lengths")},
                    causal=kw["causal"], key_lengths=kw.get("key_lengths"))


def _ranges_case(device, dtype):
    """Flash-attn's varlen sequences as key ranges (causal, a window), packed in one row."""
    lengths = [(9, 9), (5, 17), (20, 7), (0, 4), (11, 11)]
    cu_q = torch.tensor([0] + [a for a, _ in lengths]).cumsum(0).int()
    cu_k = torch.tensor([0] + [b for _, b in lengths]).cumsum(0).int()
    Nq, Nk = int(cu_q[-1]) + 2, int(cu_k[-1])
    ranges = key_ranges_from_cu_seqlens(cu_q, cu_k, Nq, causal=True, window_size=(6, -1)).to(device)
    q, k, v, do = make_qkv(1, 2, 1, Nq, Nk, 16, dtype, device, seed=4)
    return q, k, v, do, ranges


def test_key_ranges_dropout_and_lse(device):
    """Both modifications with key ranges, dropout and return_lse (its gradient too): the Triton
    kernels match the reference given the same keep-mask."""
    q, k, v, do, ranges = _ranges_case(device, torch.float32)
    slopes = _slopes(1, 2, False, device)
    dl = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    for backend in ("triton", "reference"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        g = torch.Generator(device=device).manual_seed(3)
        o, lse = sparseflash.attention(qq, kk, vv, return_lse=True, dropout_p=0.25, generator=g, key_ranges=ranges,
                                       softcap=2.0, alibi_slopes=slopes, backend=backend)
        ((o * do).sum() + (lse.masked_fill(lse.isinf(), 0) * dl).sum()).backward()
        runs.append((o, lse, qq.grad, kk.grad, vv.grad))
    assert runs[1][1].isinf().any()  # rows with an empty range: lse -inf, out 0
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], runs[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)


def test_tma_and_both_dkdv_orientations(device, tma_on):
    """Both modifications in the kernels' TMA single loops and in both dK/dV tile orientations
    ([keys, queries] tiles with TRANS ALiBi distances, [queries, keys] with Q_ROWS), with key ranges."""
    q, k, v, do, ranges = _ranges_case(device, torch.bfloat16)
    slopes = _slopes(1, 2, False, device, seed=1)
    kw = dict(softcap=3.0, alibi_slopes=slopes, key_ranges=ranges)
    for q_rows in (False, True):
        with tile_config(dkdv=TileConfig(32, 32, q_rows=q_rows)):
            check_attention(lambda a, b, c: sparseflash.attention(a, b, c, backend="triton", **kw), q, k, v, do,
                            ref_kwargs=kw)
    assert len(tma_on) == 6 and all(tma_on), f"a kernel did not take the TMA path: {tma_on}"


def test_portable_kernels_only(device, monkeypatch):
    """Calls with softcap or ALiBi never reach the Hopper kernels' dispatch nor the short path of
    repeated calls (neither implements them); a plain call does (the control). The default plans
    carry neither the cap nor the slopes (their compiled kernels are the ones of before)."""
    from sparseflash.flash import fast

    seen = []
    monkeypatch.setattr(dispatch, "fwd_layouts", lambda *a, **kw: seen.append("fwd"))
    monkeypatch.setattr(dispatch, "bwd_layouts", lambda *a, **kw: seen.append("bwd"))
    real_lookup = fast.lookup
    monkeypatch.setattr(fast, "lookup", lambda *a: seen.append("fast") or real_lookup(*a))
    q, k, v, do = make_qkv(1, 2, 2, 20, 20, 16, torch.float16, device)
    monkeypatch.setattr(launch, "PLANS", {})
    for kw in (dict(softcap=5.0), dict(alibi_slopes=_slopes(1, 2, False, device))):
        qq = q.clone().requires_grad_()
        sparseflash.attention(qq, k, v, backend="triton", **kw).backward(do)
        assert seen == [], kw
    # each plan has exactly one of the two: a cap (SOFTCAP) or the slopes' pointer (ALIBI is derived from it)
    assert all(("SOFTCAP" in p.args) != (p.args["alibi"] is not None) for p in launch.PLANS.values())
    monkeypatch.setattr(launch, "PLANS", {})
    qq = q.clone().requires_grad_()
    sparseflash.attention(qq, k, v, backend="triton").backward(do)
    assert "fast" in seen
    o, _ = sparseflash.attention(qq, k, v, backend="triton", return_lse=True)  # the general path
    o.backward(do)
    assert "fwd" in seen and "bwd" in seen
    assert not any("SOFTCAP" in p.args or p.args["alibi"] is not None for p in launch.PLANS.values())


def test_bad_arguments_are_named():
    q = torch.randn(2, 4, 8, 16)
    k = torch.randn(2, 2, 8, 16)
    cases = [
        (dict(softcap=0.0), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap="30"), TypeError, "softcap must be a float > 0 or None"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a float32 torch.Tensor"),
        (dict(alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes must have shape \[heads_q\] = \[4\]"),
        (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"or \[batch, heads_q\] = \[2, 4\]"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes must have dtype float32"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.int32)), TypeError, "alibi_slopes must have dtype float32"),
    ]
    for kw, err, msg in cases:
        for backend in ("reference", "triton"):
            with pytest.raises(err, match=msg):
                sparseflash.attention(q, k, k, backend=backend, **kw)


def test_torch_compile_traces_them(device):
    """softcap and ALiBi through the custom ops under torch.compile(fullgraph=True): no graph break,
    the eager output and gradient."""
    slopes = _slopes(1, 2, False, device)

    def f(x):
        return sparseflash.attention(x, x, x, causal=True, softcap=3.0, alibi_slopes=slopes, backend="triton").sum()

    x = torch.randn(1, 2, 40, 16, device=device, requires_grad=True)
    eager = f(x)
    eager.backward()
    g_eager, x.grad = x.grad.clone(), None
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    out.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, g_eager)


def test_kernels_compile_for_sm90():
    """The compiled code path, which the interpreter never takes (libdevice's tanh, every branch
    typed by the compiler): forward, dQ and both dK/dV orientations with softcap, ALiBi and packed
    segment ids compile for sm_90 here, without a GPU (tests/_compile_sm90.py; run it with every
    variant's name to compile the others)."""
    out = compile_sm90("alibi-segments-softcap", timeout=600)
    assert out.count("lines of PTX") == 4, out
