"""Reference attention against a float64 naive softmax, and the public API's validation."""

from __future__ import annotations

import math

import pytest
import torch

import sparseflash
from sparseflash import BlockMask, reference


def token_mask(mask, Nq, Nk, causal, key_lengths, B):
    allowed = torch.ones(B, 1, Nq, Nk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask.to_dense()
    if causal:
        i = torch.arange(Nq)[:, None]
        j = torch.arange(Nk)[None, :]
        allowed = allowed & (j <= i + Nk - Nq)
    if key_lengths is not None:
        allowed = allowed & (torch.arange(Nk)[None, :] < key_lengths[:, None])[:, None, None, :]
    return allowed


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, block, causal, key_lengths
    (2, 4, 2, 100, 100, 16, 32, False, None),
    (1, 2, 1, 37, 90, 8, (16, 32), True, None),
    (1, 2, 2, 90, 37, 8, 16, True, None),  # causal with seq_q > seq_k: empty leading rows
    (3, 2, 2, 50, 61, 8, None, False, [0, 20, 61]),
    (2, 3, 3, 33, 33, 4, 16, True, [5, 33]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}/{}-N{}x{}-D{}-blk{}-c{}-kl{}".format(*c))
def test_reference_against_naive(case):
    B, Hq, Hkv, Nq, Nk, D, block, causal, kl = case
    g = torch.Generator().manual_seed(Nq * Nk)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if block is not None:
        bq, bk = (block, block) if isinstance(block, int) else block
        layout = torch.rand(B, Hq, math.ceil(Nq / bq), math.ceil(Nk / bk), generator=g) < 0.6
        layout[:, :, 1] = False  # empty rows
        mask = BlockMask.from_layout(layout, block_size=block, seq_q=Nq, seq_k=Nk)
    kl = None if kl is None else torch.tensor(kl)
    allowed = token_mask(mask, Nq, Nk, causal, kl, B)
    do = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)

    # small chunks exercise the chunked + checkpointed path
    out, lse = reference.attention(q, k, v, mask, causal=causal, key_lengths=kl, return_lse=True, chunk_rows=7)
    grads = torch.autograd.grad(out, (q, k, v), do)
    naive = reference.naive_attention(q, k, v, allowed)
    grads_naive = torch.autograd.grad(naive, (q, k, v), do)
    torch.testing.assert_close(out, naive)
    for a, b in zip(grads, grads_naive):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b)
    empty = ~allowed.any(-1).expand(B, Hq, Nq)
    assert bool(torch.isneginf(lse[empty]).all()) and bool(torch.isfinite(lse[~empty]).all())
    assert bool((out[empty] == 0).all())
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(Hq // Hkv, 1)) / math.sqrt(D)
    torch.testing.assert_close(lse[~empty], torch.logsumexp(s.masked_fill(~allowed, -math.inf), -1)[~empty])


def test_reference_dtype_and_api_dispatch():
    q = torch.randn(1, 2, 20, 16, dtype=torch.bfloat16)
    o = sparseflash.attention(q, q, q)  # CPU without the interpreter env -> reference (or triton in the test env)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    ref = reference.attention(q, q, q)
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    from sparseflash.api import resolve_backend

    assert resolve_backend("reference", torch.device("cuda")) == "reference"
    assert resolve_backend("auto", torch.device("cuda"), torch.float64) == "reference"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        sparseflash.attention(q, q, q, backend="cuda")


def test_reference_processes_long_sequences_in_row_chunks(monkeypatch):
    """At 16K keys no call materialises more than _CHUNK_ELEMS scores (rows are chunked)."""
    N, D = 16384, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, D, generator=g) for _ in range(3))
    q = q[:, :, :5000]
    seen = []
    real_chunk = reference._chunk

    def spy(qc, *args):
        seen.append(qc.shape[0] * qc.shape[1] * qc.shape[2] * N)
        return real_chunk(qc, *args)

    monkeypatch.setattr(reference, "_chunk", spy)
    out = reference.attention(q, k, v, causal=True)
    assert len(seen) > 1 and max(seen) <= reference._CHUNK_ELEMS
    torch.testing.assert_close(out[:, :, -3:], reference.naive_attention(q[:, :, -3:], k, v, (
        torch.arange(N)[None, :] <= torch.arange(5000 - 3, 5000)[:, None] + N - 5000)))


def _qkv(B=2, Hq=4, Hkv=2, Nq=64, Nk=64, D=16, dtype=torch.float32):
    return torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype)


@pytest.mark.parametrize("make, exc, match", [
    (lambda q, k, v: (q[0], k, v, {}), ValueError, r"q must be 4-D \[batch, heads, seq, head_dim\]"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8], {}), ValueError, "head_dim 16"),
    (lambda q, k, v: (q, k, v[:, :, :10], {}), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q[:, :3], k, v, {}), ValueError, "multiple of heads of k/v"),
    (lambda q, k, v: (q[:1], k, v, {}), ValueError, "batch 1"),
    (lambda q, k, v: (q.long(), k, v, {}), TypeError, "q must be a floating tensor"),
    (lambda q, k, v: (q.half(), k, v, {}), TypeError, "share one dtype"),
    (lambda q, k, v: (q, k, v, dict(mask=torch.ones(1, 1, dtype=torch.bool))), TypeError, "BlockMask"),
    (lambda q, k, v: (q, k, v, dict(mask=BlockMask.from_layout(torch.ones(1, 1, dtype=torch.bool), block_size=128, seq_q=100))),
     ValueError, "mask was built for seq_q=100"),
    (lambda q, k, v: (q, k, v, dict(mask=BlockMask.from_layout(torch.ones(3, 1, 1, dtype=torch.bool), block_size=64, seq_q=64))),
     ValueError, "does not broadcast to 2x4"),
    (lambda q, k, v: (q, k, v, dict(key_lengths=torch.tensor([1.0, 2.0]))), TypeError, "integer dtype"),
    (lambda q, k, v: (q, k, v, dict(key_lengths=torch.tensor([1]))), ValueError, r"shape \[batch\] = \[2\]"),
    (lambda q, k, v: (q, k, v, dict(key_lengths=torch.tensor([1, 65]))), ValueError, r"\[0, seq_k=64\]"),
    (lambda q, k, v: (q, k, v, dict(causal=1)), TypeError, "causal must be a bool"),
    (lambda q, k, v: (q, k, v, dict(scale="x")), TypeError, "scale"),
    (lambda q, k, v: ("q", k, v, {}), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q[:, :, :, :0], k[..., :0], v[..., :0], {}), ValueError, "non-empty"),
])
def test_api_bad_inputs(make, exc, match):
    q, k, v, kw = make(*_qkv())
    with pytest.raises(exc, match=match):
        sparseflash.attention(q, k, v, **kw)


def test_api_check_key_lengths_per_call(monkeypatch):
    # the per-call choice overrides the module default both ways; unchecked, nothing reads the lengths
    q, k, v = _qkv()
    bad = torch.tensor([1, 65])
    monkeypatch.setattr(sparseflash.api, "CHECK_KEY_LENGTHS", False)
    with pytest.raises(ValueError, match=r"\[0, seq_k=64\]"):
        sparseflash.attention(q, k, v, key_lengths=bad, check_key_lengths=True)
    monkeypatch.setattr(sparseflash.api, "CHECK_KEY_LENGTHS", True)
    calls = []
    monkeypatch.setattr(torch, "aminmax", lambda *a, **kw: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    ok = torch.tensor([10, 64])
    out = sparseflash.attention(q, k, v, key_lengths=ok, check_key_lengths=False, backend="reference")
    assert not calls
    monkeypatch.undo()
    torch.testing.assert_close(out, sparseflash.attention(q, k, v, key_lengths=ok, backend="reference"))


def test_api_full_mask_equals_dense():
    q, k, v = _qkv()
    m = BlockMask.from_layout(torch.ones(1, 1, dtype=torch.bool), block_size=64, seq_q=64)
    a = sparseflash.attention(q, k, v, mask=m, backend="reference")
    b = sparseflash.attention(q, k, v, backend="reference")
    torch.testing.assert_close(a, b)
