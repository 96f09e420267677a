"""sparseflash.nn.SparseAttention: projections and head layout, patterns of every form, GQA, padding,
dropout, the mask cache; against an explicit softmax(QK^T)V with the same token mask."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from sparseflash import BlockMask
from sparseflash.nn import SparseAttention, padding_to_lengths, resolve_pattern
from sparseflash.patterns import butterfly, dense, local, stack


def _explicit(attn: SparseAttention, x, allowed):
    """The module's function spelt out: allowed bool broadcastable to [B, H, N, N]."""
    B, N, _ = x.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w = attn.qkv(x)
    q = w[..., : H * hd].view(B, N, H, hd).transpose(1, 2)
    k = w[..., H * hd: (H + Hkv) * hd].view(B, N, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = w[..., (H + Hkv) * hd:].view(B, N, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return attn.proj((p @ v).transpose(1, 2).reshape(B, N, H * hd))


def _x(B=2, N=100, d=48, seed=0):
    return torch.randn(B, N, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("form", ["none", "name", "blockmask", "callable", "per-head", "from_fn"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_patterns_and_gqa_match_explicit(form, gqa):
    torch.manual_seed(0)
    N, H = 100, 4
    pattern, kw = {
        "none": (None, None),
        "name": ("local", {"window": 20}),
        "blockmask": (butterfly(N, block_size=16), None),
        "callable": (functools.partial(local, window=30, block_size=16), None),
        "per-head": (["butterfly", None, functools.partial(local, window=10, block_size=16), "butterfly"], None),
        "from_fn": (lambda n: BlockMask.from_fn(lambda b, h, q, k: (q - k).abs() <= 16, n, block_size=16), None),
    }[form]
    attn = SparseAttention(48, H, 2 if gqa else None, pattern=pattern, pattern_kwargs=kw, block_size=16,
                           causal=form == "name", backend="reference").double()
    x = _x(N=N)
    mask = attn.mask_for(N, "cpu")
    # the token-level truth: a from_fn mask is applied exactly inside its partial blocks
    allowed = torch.ones(1, H, N, N, dtype=torch.bool) if mask is None else mask.to_dense(exact=True)
    if form == "per-head":
        assert mask.shape[1] == H and bool(mask.layout[0, 1].all())
    if attn.causal:
        allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(attn(x), _explicit(attn, x, allowed))
    assert attn.mask_for(N, "cpu") is mask  # cached per (length, device)


def test_padding_and_training_dropout():
    torch.manual_seed(0)
    attn = SparseAttention(48, 4, pattern="butterfly", block_size=16, dropout=0.25, backend="reference").double()
    x = _x(B=3, N=64)
    lengths = torch.tensor([64, 40, 7])
    pad = torch.arange(64)[None, :] >= lengths[:, None]
    attn.eval()
    allowed = attn.mask_for(64, "cpu").to_dense() & ~pad[:, None, None, :]
    out = attn(x, key_lengths=lengths)
    torch.testing.assert_close(out, _explicit(attn, x, allowed))
    torch.testing.assert_close(attn(x, key_padding_mask=pad), out)
    scrambled = torch.where(pad[..., None], torch.randn_like(x), x)  # padded keys cannot matter
    torch.testing.assert_close(attn(scrambled, key_lengths=lengths)[~pad], out[~pad])
    attn.train()
    a, b = attn(x, key_lengths=lengths), attn(x, key_lengths=lengths)
    assert not torch.equal(a, b)
    a.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


def test_resolve_and_errors():
    assert resolve_pattern("dense", 64) is None and resolve_pattern([None, None], 64, n_heads=2) is None
    m = resolve_pattern([None, "butterfly"], 64, block_size=16, n_heads=2)
    assert m.equal(stack([dense(64, block_size=16), butterfly(64, block_size=16)]))
    with pytest.raises(ValueError, match="unknown pattern 'nope'"):
        SparseAttention(32, 2, pattern="nope")
    with pytest.raises(ValueError, match="one entry per query head"):
        SparseAttention(32, 2, pattern=["butterfly"])
    with pytest.raises(ValueError, match="n_kv_heads"):
        SparseAttention(32, 4, 3)
    with pytest.raises(ValueError, match="divisible"):
        SparseAttention(30, 4)
    with pytest.raises(ValueError, match="dropout"):
        SparseAttention(32, 2, dropout=1.0)
    attn = SparseAttention(32, 2, pattern=butterfly(64, block_size=16))
    with pytest.raises(ValueError, match="for seq_q=64"):
        attn(torch.randn(1, 50, 32))
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model=32\]"):
        attn(torch.randn(1, 64, 31))
    with pytest.raises(ValueError, match="rejected its arguments"):
        SparseAttention(32, 2, pattern="local", pattern_kwargs={"wrong": 1})(torch.randn(1, 64, 32))
    with pytest.raises(TypeError, match="pattern callable returned"):
        SparseAttention(32, 2, pattern=lambda n: 3)(torch.randn(1, 64, 32))
    assert torch.equal(padding_to_lengths(torch.tensor([[False, True], [False, False]])), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="right padding"):
        padding_to_lengths(torch.tensor([[True, False]]))


def test_state_dict_layout():
    attn = SparseAttention(64, 8, 2, bias=False)
    assert set(attn.state_dict()) == {"qkv.weight", "proj.weight"}
    assert attn.qkv.weight.shape == ((8 + 2 * 2) * 8, 64) and attn.proj.weight.shape == (64, 64)
    assert "n_kv_heads=2" in repr(attn)


@pytest.mark.gpu
def test_sparse_attention_cuda_bf16():
    """On the GPU through the Triton kernels in bf16 autocast, against the fp32 module on the reference.
    Bound: twice the error of the same function in plain PyTorch bf16, plus a small floor."""
    torch.manual_seed(0)
    attn = SparseAttention(256, 4, 2, pattern="butterfly", causal=True).cuda()
    x = torch.randn(2, 1000, 256, device="cuda")
    lengths = torch.tensor([1000, 613], device="cuda")
    attn.backend = "reference"
    ref = attn(x, key_lengths=lengths)
    attn.backend = "auto"
    allowed = attn.mask_for(1000, "cuda").to_dense() & torch.ones(1000, 1000, dtype=torch.bool, device="cuda").tril()
    allowed = allowed & (torch.arange(1000, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = attn(x, key_lengths=lengths).float()
        torch_bf16 = _explicit(attn, x, allowed).float()
    assert (got - ref).abs().max() <= 2 * (torch_bf16 - ref).abs().max() + 1e-2
