"""Attention dropout: the kernels' keep-mask against its NumPy definition, exact agreement of
outputs and gradients with the reference given that mask, statistics, and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from _attn_check import check_attention, make_qkv

import sparseflash
from sparseflash import BlockMask
from sparseflash.dropout import effective_p, keep_mask, next_seed_offset
from sparseflash.flash import TileConfig, launch, tile_config


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def test_keep_mask_statistics():
    p = 0.3
    pe = effective_p(p)  # 77 / 256: what the 8-bit threshold applies
    assert pe == 77 / 256
    keep = keep_mask(1234, 7, 2, 3, 256, 256, p)
    n = keep.numel()
    frac = keep.float().mean().item()
    assert abs(frac - (1 - pe)) < 5 * math.sqrt(pe * (1 - pe) / n)  # binomial 5-sigma bound
    # No row or column structure: per-row / per-column kept fractions spread like binomials.
    for dim in (-1, -2):
        per = keep.float().mean(dim=dim)
        sigma = math.sqrt(pe * (1 - pe) / keep.shape[dim])
        assert (per - (1 - pe)).abs().max().item() < 6 * sigma
        assert per.std().item() < 1.5 * sigma
    # Neighbours, and the elements one Philox call decides ({i, i + 8} x {j, j + 1, j + 8, j + 9,
    # j + 16, j + 17, j + 24, j + 25}: other bytes of the same words), are uncorrelated.
    x = keep.float() - (1 - pe)
    shifts = [(0, 1), (1, 0), (0, 8), (8, 0), (8, 8), (0, 16), (0, 24), (8, 16), (8, 25), (0, 32), (16, 0)]
    for di, dj in shifts:
        a = x[..., : x.shape[-2] - di, : x.shape[-1] - dj]
        b = x[..., di:, dj:]
        corr = (a * b).mean() / (x * x).mean()
        assert abs(corr.item()) < 0.02, (di, dj)
    # Different heads, offsets and seeds give different bits.
    assert not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep, keep_mask(1234, 8, 2, 3, 256, 256, p))
    assert not torch.equal(keep, keep_mask(1235, 7, 2, 3, 256, 256, p))


def test_keep_mask_definition():
    """keep_mask against a literal, element-by-element transcription of the documented rule."""

    def philox(c, k):
        c, k = list(c), list(k)
        for _ in range(7):
            p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
            c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k[1], p0 & 0xFFFFFFFF]
            k = [(k[0] + 0x9E3779B9) & 0xFFFFFFFF, (k[1] + 0xBB67AE85) & 0xFFFFFFFF]
        return c

    seed, offset, p = (5 << 31) | 77, 3, 0.25
    keep = keep_mask(seed, offset, 1, 2, 40, 70, p)
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        h, i, j = (int(torch.randint(0, n, (1,), generator=rng)) for n in (2, 40, 70))
        words = philox(((j // 32) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, h, offset), (77, 5))
        byte = (words[(j // 8) % 4] >> (8 * (2 * ((i // 8) % 2) + j % 2))) & 0xFF
        assert bool(keep[0, h, i, j]) == (byte >= round(p * 256)), (h, i, j)


@pytest.mark.parametrize("p", [1e-3, 0.999])
def test_p_below_resolution_is_refused(p):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="dropout_p"):
        sparseflash.attention(q, q, q, dropout_p=p)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_reference_with_same_keep_mask(causal, dtype, device):
    B, Hq, Hkv, N, D, p = 2, 2, 1, 70, 32, 0.25
    layout = torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(0)) < 0.7
    mask = BlockMask.from_layout(layout, block_size=32, seq_q=N).to(device)
    q, k, v, do = make_qkv(B, Hq, Hkv, N, N, D, dtype, device, seed=1)
    seed, offset = next_seed_offset(device, _gen(device, 99))
    keep = keep_mask(seed, offset, B, Hq, N, N, p, device=device)

    def impl(q, k, v):
        return sparseflash.attention(q, k, v, mask=mask, causal=causal, dropout_p=p, generator=_gen(device, 99),
                                     backend="triton")

    check_attention(impl, q, k, v, do, mask=mask, causal=causal, ref_kwargs=dict(dropout_p=p, dropout_keep=keep))


@pytest.mark.parametrize("tiles", [((16, 16), (16, 16), (16, 16)), ((64, 32), (32, 64), (16, 64)),
                                   ((16, 16), (16, 16, 4, 1, None, True), (16, 16)),
                                   ((64, 32), (32, 64, 4, 1, None, True), (16, 64))], ids=str)
def test_keep_mask_does_not_depend_on_tiles(tiles, device, monkeypatch):
    """Each kernel builds the mask from its own tiling (rows = keys in dK/dV, or queries with
    q_rows): all must agree with the NumPy definition, odd lengths and a 16-block mask included."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    B, H, Nq, Nk, D, p = 1, 2, 75, 90, 16, 0.4
    layout = torch.rand(1, 2, 5, 6, generator=torch.Generator().manual_seed(3)) < 0.6
    mask = BlockMask.from_layout(layout, block_size=16, seq_q=Nq, seq_k=Nk).to(device) if tiles[0][0] == 16 else None
    q, k, v, do = make_qkv(B, H, H, Nq, Nk, D, torch.float32, device, seed=4)
    seed, offset = next_seed_offset(device, _gen(device, 21))
    keep = keep_mask(seed, offset, B, H, Nq, Nk, p, device=device)
    cfg = [TileConfig(*t) if len(t) > 2 else TileConfig(*t, 4, 1) for t in tiles]

    def impl(q, k, v):
        with tile_config(*cfg):
            return sparseflash.attention(q, k, v, mask=mask, dropout_p=p, generator=_gen(device, 21), backend="triton")

    check_attention(impl, q, k, v, do, mask=mask, ref_kwargs=dict(dropout_p=effective_p(p), dropout_keep=keep))


def test_dense_dropout_and_dlse(device, monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    q, k, v, do = make_qkv(1, 2, 2, 50, 50, 16, torch.float32, device, seed=2)
    outs = []
    for backend in ("triton", "reference"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, lse = sparseflash.attention(qq, kk, vv, dropout_p=0.5, generator=_gen(device, 5), return_lse=True,
                                       backend=backend)
        ((o * do).sum() + lse.sum()).backward()
        outs.append((o, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_p0_is_bitwise_no_dropout(device):
    q, k, v, _ = make_qkv(1, 2, 2, 40, 40, 16, torch.float16, device)
    a = sparseflash.attention(q, k, v, dropout_p=0.0, backend="triton")
    b = sparseflash.attention(q, k, v, backend="triton")
    assert torch.equal(a, b)


def test_p1_gives_zero_without_nan(device):
    q, k, v, do = make_qkv(1, 2, 2, 40, 40, 16, torch.float32, device)
    for backend in ("triton", "reference"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = sparseflash.attention(qq, kk, vv, dropout_p=1.0, backend=backend)
        o.backward(do)
        assert torch.equal(o, torch.zeros_like(o)), backend
        for t in (qq, kk, vv):
            assert torch.equal(t.grad, torch.zeros_like(t.grad)), backend


def test_seed_reproducibility(device):
    q, k, v, _ = make_qkv(1, 2, 2, 40, 40, 16, torch.float32, device)
    run = lambda **kw: sparseflash.attention(q, k, v, dropout_p=0.2, backend="triton", **kw)  # noqa: E731
    assert torch.equal(run(generator=_gen(device, 3)), run(generator=_gen(device, 3)))
    assert not torch.equal(run(generator=_gen(device, 3)), run(generator=_gen(device, 4)))
    torch.manual_seed(11)
    a1, a2 = run(), run()  # two calls in one step get different bits
    torch.manual_seed(11)
    b1, b2 = run(), run()
    assert not torch.equal(a1, a2)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), "0.1"])
def test_invalid_p(p):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="dropout_p"):
        sparseflash.attention(q, q, q, dropout_p=p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_draw_fresh_bits(monkeypatch):
    """A forward+backward captured in a CUDA graph draws new dropout bits on every replay (the
    kernels read the draw from device memory), and each replay computes exactly what an eager call
    with that replay's draw computes."""
    from sparseflash import dropout
    from sparseflash.flash.autograd import FlashAttentionFunction

    q, k, v, do = make_qkv(2, 4, 2, 300, 300, 64, torch.bfloat16, "cuda", seed=8)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    mask = BlockMask.from_layout(torch.rand(3, 3, generator=torch.Generator().manual_seed(1)) < 0.7,
                                 block_size=128, seq_q=300, seq_k=300).to("cuda")
    drawn = []
    real = dropout.draw_rng
    monkeypatch.setattr(dropout, "draw_rng", lambda *a, **kw: drawn.append(real(*a, **kw)) or drawn[-1])

    def step():
        o = sparseflash.attention(q, k, v, mask=mask, dropout_p=0.3, backend="triton")
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    drawn.clear()
    with torch.cuda.graph(graph):
        outs = step()
    assert len(drawn) == 1, "one draw per forward"
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append((drawn[0].clone(), [t.clone() for t in outs]))
    assert not torch.equal(replays[0][0], replays[1][0]), "a replay reused the previous draw"
    assert not torch.equal(replays[0][1][0], replays[1][1][0])
    index = mask.index("cuda")
    for rng, got in replays:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = FlashAttentionFunction.apply(None, qq, kk, vv, None, index.kv_idx, index.q_idx, rng, None, None,
                                            64 ** -0.5, False, 128, 128, 0.3, -1.0)
        want = (o, *torch.autograd.grad(o, (qq, kk, vv), do))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), name


def test_launch_refuses_a_bad_rng(device):
    q = torch.randn(1, 1, 32, 16, device=device)
    for rng in (None, torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int32, device=device)):
        with pytest.raises(ValueError, match="rng must be an int64 tensor"):
            launch.fwd(q, q, q, None, None, 0.25, False, None, None, 0.1, rng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_reduce_overhead_draws_fresh_bits():
    """torch.compile(mode="reduce-overhead") (Inductor's CUDA graphs) around a model with dropout:
    the graphs are not skipped, and each step draws new dropout bits."""
    from torch._dynamo.utils import counters

    mask = BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=128, seq_q=256, seq_k=256).to("cuda")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):  # [B, H, N, D]
            return self.proj(sparseflash.attention(x, x, x, mask=mask, dropout_p=0.3))

    torch.manual_seed(0)
    model = Block().to("cuda", torch.bfloat16)
    x = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    outs, grads = [], []
    for _ in range(4):  # Inductor records the graph on a later call and replays it after
        out = compiled(x)
        (g,) = torch.autograd.grad(out.float().square().sum(), (x,))
        outs.append(out.detach().clone())
        grads.append(g.clone())
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    for a, b in zip(outs, outs[1:]):
        assert not torch.equal(a, b), "two steps drew the same dropout bits"
    assert all(torch.isfinite(g).all() for g in grads)


def test_compiled_reference_with_dropout_on_cpu():
    """torch.compile over the reference path with dropout: the function with
    fullgraph=True (the seed stays a tensor) and a module; the compiled function draws the same
    keep-mask as the eager call from the same generator state, and gradients flow."""
    import sparseflash
    from sparseflash.nn import SparseAttention

    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    fn = lambda q, k, v: sparseflash.attention(q, k, v, dropout_p=0.25, backend="reference")  # noqa: E731
    torch.manual_seed(3)
    eager = fn(q, k, v)
    torch.manual_seed(3)
    compiled = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    m = SparseAttention(32, 2, pattern="butterfly", dropout=0.1, block_size=16, backend="reference").train()
    y = torch.compile(m, backend="eager")(torch.randn(2, 40, 32))
    y.sum().backward()
    assert y.shape == (2, 40, 32) and m.parameters().__next__().grad is not None


def test_keep_mask_takes_tensor_seeds():
    seed, offset = (5 << 31) | 77, 3
    ints = keep_mask(seed, offset, 2, 1, 33, 47, 0.3)
    tensors = keep_mask(torch.tensor(seed), torch.tensor(offset), 2, 1, 33, 47, 0.3)
    assert torch.equal(ints, tensors) and ints.shape == (2, 1, 33, 47)
