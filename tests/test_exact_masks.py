"""Token-exact masks inside partial blocks: a mask built from a token-level definition (`from_fn`,
`from_dense`, `from_flex`) is applied pair by pair inside its partial blocks, forward and
backward, by the Triton kernels (EXACT), checked against the float64 reference on
``mask.to_dense(exact=True)``'s pairs within 2x PyTorch's own error in the same dtype; and
``exact=False`` keeps the block-level numbers. Sizes are small: the interpreter runs them on CPU."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from _attn_check import check_attention, make_qkv
from _hopper import compile_sm90

import sparseflash
from sparseflash import BlockMask
from sparseflash.flash import TileConfig, dispatch, launch, tile_config

EXACT_REF = dict(exact=True)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def triton_impl(mask, **kw):
    def f(q, k, v):
        return sparseflash.attention(q, k, v, mask, backend="triton", **kw)

    return f


def _id(p):
    return str(p).replace("torch.", "")


def sliding_causal(window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


# ---------------------------------------------------------------- masks against the reference
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_id)
def test_sliding_window(dtype, device):
    """Causal window of 40 over 64-blocks walked in 32-wide tiles (the bits' sub-rectangles),
    100 tokens (a tail block), GQA, head_dim 40."""
    mask = BlockMask.from_fn(sliding_causal(40), 100, block_size=64).to(device)
    assert not mask.is_exact
    q, k, v, do = make_qkv(1, 2, 1, 100, 100, 40, dtype, device, seed=1)
    check_attention(triton_impl(mask), q, k, v, do, mask=mask, ref_kwargs=EXACT_REF)


def test_documents_seq_q_ne_seq_k(device):
    """Document ids over queries and keys of different lengths, non-square blocks, plus causal."""
    g = torch.Generator().manual_seed(2)
    Nq, Nk = 70, 100
    doc_q = torch.sort(torch.randint(0, 4, (Nq,), generator=g)).values.to(device)
    doc_k = torch.sort(torch.randint(0, 4, (Nk,), generator=g)).values.to(device)

    def doc_mod(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_k[kv_idx]

    mask = BlockMask.from_fn(doc_mod, Nq, Nk, block_size=(32, 64), device=device)
    assert not mask.is_exact
    q, k, v, do = make_qkv(1, 2, 2, Nq, Nk, 16, torch.float32, device, seed=2)
    check_attention(triton_impl(mask, causal=True), q, k, v, do, mask=mask, causal=True, ref_kwargs=EXACT_REF)


def test_random_token_mask_per_batch_and_head(device):
    """from_dense of a random [B, H, Nq, Nk] token mask (per batch and head, GQA, head_dim 24), with
    a query row that attends nothing: 0 output and 0 gradients, not NaN."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Nq, Nk = 2, 2, 1, 50, 70
    tok = torch.rand(B, Hq, Nq, Nk, generator=g) < 0.3
    tok[1, 1, 5] = False  # row 5 of (batch 1, head 1) attends nothing; its block row stays on
    mask = BlockMask.from_dense(tok, block_size=32).to(device)
    assert mask.shape[:2] == (B, Hq) and bool(mask.layout[1, 1, 0].any())
    q, k, v, do = make_qkv(B, Hq, Hkv, Nq, Nk, 24, torch.float16, device, seed=3)
    check_attention(triton_impl(mask), q, k, v, do, mask=mask, ref_kwargs=EXACT_REF)
    qg = q.detach().clone().requires_grad_()
    o = sparseflash.attention(qg, k, v, mask, backend="triton")
    o.backward(do)
    assert not torch.isnan(o).any()
    assert o[1, 1, 5].abs().max() == 0 and qg.grad[1, 1, 5].abs().max() == 0


def test_per_head_mask_mod(device):
    """A from_fn mask whose window depends on batch and head (broadcast dims of the mask), over
    GQA, and a Flex-style mask_mod made with torch's and_masks."""
    lengths = torch.tensor([70, 41], device=device)

    def per_head(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 8 + 12 * h) & (kv_idx < lengths[b])

    mask = BlockMask.from_fn(per_head, 70, block_size=32, batch=2, heads=2, device=device)
    assert mask.shape[:2] == (2, 2)
    q, k, v, do = make_qkv(2, 2, 1, 70, 70, 32, torch.float32, device, seed=4)
    check_attention(triton_impl(mask), q, k, v, do, mask=mask, ref_kwargs=EXACT_REF)


def test_flex_block_mask(device):
    """Torch's FlexAttention BlockMask, passed as it is: its mask_mod runs inside partial blocks."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < 20

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    N = 64
    fm = flex.create_block_mask(flex.or_masks(prefix_lm, causal), None, None, N, N, device=device, BLOCK_SIZE=32)
    mask = BlockMask.from_flex(fm)
    assert not mask.is_exact
    q, k, v, do = make_qkv(1, 2, 2, N, N, 16, torch.float32, device, seed=5)
    check_attention(triton_impl(fm), q, k, v, do, mask=mask, ref_kwargs=EXACT_REF)


# ---------------------------------------------------------------- combinations
def _window_mask(N, device, block=32):
    return BlockMask.from_fn(lambda b, h, qi, kv: (qi - kv).abs() < 24, N, block_size=block).to(device)


COMBOS = ["causal-key_lengths", "segment_ids", "key_ranges", "dropout", "softcap-alibi"]


@pytest.mark.parametrize("combo", COMBOS)
def test_combinations(combo, device):
    N = 70
    mask = _window_mask(N, device)
    q, k, v, do = make_qkv(2, 2, 1, N, N, 16, torch.float32, device, seed=6)
    kw, ref = {}, dict(EXACT_REF)
    if combo == "causal-key_lengths":
        kw = dict(causal=True, key_lengths=torch.tensor([70, 37], device=device))
        check_attention(triton_impl(mask, **kw), q, k, v, do, mask=mask, causal=True, key_lengths=kw["key_lengths"],
                        ref_kwargs=ref)
        return
    if combo == "segment_ids":
        seg = torch.tensor([[0] * 20 + [1] * 35 + [2] * 15, [0] * 44 + [1] * 26], device=device, dtype=torch.int32)
        ref["segment_ids"] = seg
        kw = dict(segment_ids=seg)
    elif combo == "key_ranges":
        i = torch.arange(N, device=device)
        kr = torch.stack([(i - 30).clamp(min=0), i + 1], dim=-1)[None].to(torch.int32)  # [1, N, 2]
        kw = dict(key_ranges=kr)
        ref["key_ranges"] = kr
    elif combo == "softcap-alibi":
        slopes = torch.tensor([0.3, 0.05], device=device)
        kw = dict(softcap=2.0, alibi_slopes=slopes)
        ref.update(softcap=2.0, alibi_slopes=slopes)
    else:  # dropout: the kernels' keep-mask, reproduced for the reference
        from sparseflash.dropout import keep_mask, next_seed_offset

        p = 0.25
        seed, offset = next_seed_offset(device, torch.Generator(device=device).manual_seed(9))
        ref.update(dropout_p=p, dropout_keep=keep_mask(seed, offset, 2, 2, N, N, p, device=device))
        kw = dict(dropout_p=p, generator=torch.Generator(device=device).manual_seed(9))
    check_attention(triton_impl(mask, **kw), q, k, v, do, mask=mask, ref_kwargs=ref)


@pytest.mark.parametrize("tiles", [(16, 16), (16, 64, True)],
                         ids=lambda t: f"tile{t[0]}x{t[1]}" + ("-qrows" if len(t) > 2 else ""))
def test_tilings(tiles, device):
    """Kernel tiles smaller than the 64-blocks in both dims, and dK/dV in both orientations."""
    mask = BlockMask.from_fn(sliding_causal(50), 100, block_size=64).to(device)
    q, k, v, do = make_qkv(1, 1, 1, 100, 100, 16, torch.float32, device, seed=7)
    cfg = TileConfig(*tiles[:2])
    with tile_config(fwd=cfg, dkdv=TileConfig(*tiles[:2], q_rows=len(tiles) > 2), dq=cfg):
        check_attention(triton_impl(mask), q, k, v, do, mask=mask, ref_kwargs=EXACT_REF)


def test_tma_loads(device, tma_on):
    """Every kernel on TMA descriptor loads (one loop, the element mask from a tile on) with bits."""
    mask = BlockMask.from_fn(sliding_causal(40), 100, block_size=32).to(device)
    q, k, v, do = make_qkv(1, 2, 1, 100, 100, 16, torch.bfloat16, device, seed=14)
    check_attention(triton_impl(mask, causal=True), q, k, v, do, mask=mask, causal=True, ref_kwargs=EXACT_REF)
    assert len(tma_on) == 3 and all(tma_on), f"a kernel did not take the TMA path: {tma_on}"


# ---------------------------------------------------------------- exact=False, the short path, errors
def test_exact_false_is_block_level(device):
    """exact=False gives the old block-level numbers bit for bit (those of mask.block_level()),
    and the default differs from them where blocks are partial."""
    mask = BlockMask.from_fn(sliding_causal(30), 80, block_size=32).to(device)
    q, k, v, _ = make_qkv(1, 2, 2, 80, 80, 16, torch.float32, device, seed=8)
    block = sparseflash.attention(q, k, v, mask.block_level(), backend="triton")
    assert torch.equal(sparseflash.attention(q, k, v, mask, backend="triton", exact=False), block)
    exact = sparseflash.attention(q, k, v, mask, backend="triton")
    ref = sparseflash.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    torch.testing.assert_close(exact.double(), ref, atol=1e-5, rtol=1e-5)
    assert (exact - block).abs().max() > 0.1


def test_repeated_calls_stay_exact(device):
    """The short path of repeated calls declines calls that need bits: every call is exact, and
    block-level calls on the same mask keep theirs."""
    mask = BlockMask.from_fn(sliding_causal(20), 64, block_size=32).to(device)
    q, k, v, _ = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, device, seed=9)
    ref = sparseflash.attention(q, k, v, mask, backend="reference")
    block = sparseflash.attention(q, k, v, mask, backend="reference", exact=False)
    for _ in range(2):
        torch.testing.assert_close(sparseflash.attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sparseflash.attention(q, k, v, mask, exact=False), block, atol=1e-5, rtol=1e-5)


def test_flash_attn_interface_passes_exact(device):
    from sparseflash.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    mask = BlockMask.from_fn(sliding_causal(20), 64, block_size=32).to(device)
    q, k, v, _ = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, device, seed=10)
    for exact in (True, False):
        want = sparseflash.attention(q, k, v, mask, exact=exact, backend="reference").transpose(1, 2)
        got = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask, exact=exact)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
        got = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 64, 64,
                                     mask=mask, exact=exact)
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_torch_compile(device):
    """fullgraph torch.compile traces an exact call once the bits exist (built outside the graph,
    as the index is); before that the error says what to do."""
    mask = BlockMask.from_fn(sliding_causal(20), 64, block_size=32).to(device)
    q, k, v, do = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, device, seed=12)

    def f(q, k, v):
        return sparseflash.attention(q, k, v, mask, backend="triton")

    with pytest.raises(RuntimeError, match=r"exact_bits\(device\) once outside"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    mask.exact_bits(device)
    check_attention(torch.compile(f, fullgraph=True, backend="aot_eager"), q, k, v, do, mask=mask,
                    ref_kwargs=EXACT_REF)


def test_bits_keep_the_hopper_kernels_out(device, monkeypatch):
    """The one place that sends calls with bits to the portable kernels: with HOPPER_EXACT "off" the
    Hopper layouts are never asked for (forward and backward)."""
    def refuse(*a, **k):
        raise AssertionError("the Hopper kernels were considered for a call with bits")

    monkeypatch.setattr(dispatch, "HOPPER_EXACT", "off")
    monkeypatch.setattr(dispatch, "fwd_layouts", refuse)
    monkeypatch.setattr(dispatch, "bwd_layouts", refuse)
    mask = BlockMask.from_fn(sliding_causal(20), 64, block_size=32).to(device)
    q, k, v, do = make_qkv(1, 1, 1, 64, 64, 16, torch.bfloat16, device, seed=13)
    q.requires_grad_()
    sparseflash.attention(q, k, v, mask, backend="triton").backward(do)
    assert q.grad is not None and not torch.isnan(q.grad).any()


def test_bits_take_the_hopper_kernels_only_when_switched_on(monkeypatch):
    """HOPPER_EXACT "on" (the default) lets calls with bits ask for the Hopper layouts, forward and
    backward; "off" never; a value other than on / off is refused, naming the switch."""
    asked = []
    monkeypatch.setattr(dispatch, "fwd_layouts", lambda *a: asked.append("fwd") or "lay")
    monkeypatch.setattr(dispatch, "bwd_layouts", lambda *a: asked.append(("bwd", a[-1])) or "lays")
    q = torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16)
    bits = object()  # (the dispatch looks only at whether there are bits)
    plan = functools.partial(dispatch.hopper_plan, q, q, q, 128, 128, -1.0, scale=0.125, exact=bits)
    monkeypatch.setattr(dispatch, "HOPPER_EXACT", "off")
    assert plan() is None and asked == []
    monkeypatch.setattr(dispatch, "HOPPER_EXACT", "on")
    assert plan() == "lay" and asked == ["fwd"]
    assert plan(do=q, o=q, lists=True) == "lays" and asked == ["fwd", ("bwd", True)]  # (told: the call has bits)
    assert plan(softcap=5.0) is None  # the Hopper kernels still have no softcap
    monkeypatch.setattr(dispatch, "HOPPER_EXACT", "yes")
    with pytest.raises(ValueError, match="SPARSEFLASH_HOPPER_EXACT"):
        plan()


def test_masks_without_partial_blocks_need_no_bits():
    aligned = BlockMask.from_fn(lambda b, h, qi, kv: qi // 32 >= kv // 32, 128, block_size=32)
    assert aligned.is_exact and aligned.exact_bits() is None
    layout_only = BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), block_size=32)
    assert layout_only.exact_bits() is None


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_exact_is_refused(bad):
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(TypeError, match="exact must be a bool"):
        sparseflash.attention(q, q, q, exact=bad)


@pytest.mark.slow
def test_exact_kernels_compile_for_sm90():
    """The EXACT variants of the three kernels (causal window, lists, bits) compile for sm_90 here,
    without a GPU (tests/_compile_sm90.py; about a minute on 2 cores, hence slow)."""
    out = compile_sm90("exact-causal", timeout=900)
    assert out.count("lines of PTX") == 4, out


# ---------------------------------------------------------------- memory
def test_long_sliding_window_bits_are_proportional_to_partial_blocks():
    """A 128K-token causal window of 1024 at block 128: bits only for the partial blocks (the
    diagonal and the window's far edge), never N x N; spot checks against the mask_mod."""
    N, W, B = 131072, 1024, 128
    nb = N // B
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    layout = (j <= i) & (j >= i - W // B)
    full = (j < i) & (j > i - W // B)
    fn = sliding_causal(W)
    mask = BlockMask(layout, B, N, full=full, mask_mod=fn)
    eb = mask.exact_bits()
    n_partial = nb + (nb - W // B)
    assert eb.bits.shape == (n_partial, B, B // 32) and eb.bits.dtype == torch.int32
    assert eb.bits.numel() * 4 == n_partial * B * B // 8  # 4.2 MB; N x N bits would be 2 GB
    assert eb.kv_tile.shape == mask.index().kv_idx.shape and eb.q_tile.shape == mask.index().q_idx.shape
    assert mask.exact_bits() is eb  # cached
    for blk in (0, 500, nb - 1):
        for qi, kj in ((blk, blk), (blk, blk - W // B)):
            if kj < 0:
                continue
            t = int(eb.tile_of[0, 0, qi, kj])
            words = eb.bits[t]
            on = ((words[:, :, None] >> torch.arange(32)) & 1).bool().reshape(B, B)
            rows = torch.arange(qi * B, qi * B + B)[:, None]
            cols = torch.arange(kj * B, kj * B + B)[None, :]
            assert torch.equal(on, fn(0, 0, rows, cols))


@pytest.mark.parametrize("seq_q, seq_k, block, batch", [(200, 200, 16, 1), (90, 130, (16, 32), 2), (64, 40, 16, 1)])
def test_from_key_ranges_is_the_token_mask(seq_q, seq_k, block, batch):
    """`BlockMask.from_key_ranges` equals `from_dense` of the ranges' token mask: the layout, the
    full blocks and every partial block's bits; per batch row, with empty and out-of-range ranges."""
    g = torch.Generator().manual_seed(seq_q + seq_k)
    i = torch.arange(seq_q)
    start = i - 50 + torch.randint(-2, 3, (batch, seq_q), generator=g)  # a jittered window
    end = i + 1 + torch.randint(-2, 3, (batch, seq_q), generator=g)
    odd = torch.rand(batch, seq_q, generator=g) < 0.05  # a few rows anywhere
    start = torch.where(odd, torch.randint(-5, seq_k, (batch, seq_q), generator=g), start)
    end = torch.where(odd, start + torch.randint(-3, 60, (batch, seq_q), generator=g), end)
    start[:, :3] = 7  # empty ranges
    end[:, :3] = 7
    end[:, -2:] = seq_k + 9  # past the end: clamped
    kr = torch.stack([start, end], -1)
    mask = BlockMask.from_key_ranges(kr, seq_k, block_size=block)
    j = torch.arange(seq_k)
    tok = (j >= start.clamp(0, seq_k)[..., None]) & (j < end.clamp(0, seq_k)[..., None])  # [B, seq_q, seq_k]
    want = BlockMask.from_dense(tok[:, None], block_size=block)
    assert torch.equal(mask.layout.expand_as(want.layout), want.layout)
    assert torch.equal(mask.full.expand_as(want.full), want.full)
    assert mask.partial.any() and mask.full.any()
    assert torch.equal(mask.to_dense(exact=True).expand_as(want.to_dense(exact=True)), want.to_dense(exact=True))
    assert torch.equal(mask.exact_bits().bits, want.exact_bits().bits)


@pytest.mark.parametrize("bad, err", [(torch.zeros(10, 2, dtype=torch.int32), ValueError),
                                      (torch.zeros(1, 10, 3, dtype=torch.int32), ValueError),
                                      (torch.zeros(1, 10, 2), TypeError), ([[0, 1]], TypeError)])
def test_from_key_ranges_refuses_bad_input(bad, err):
    with pytest.raises(err, match="key_ranges"):
        BlockMask.from_key_ranges(bad, 10)


def _bits_masks():
    from sparseflash.patterns import butterfly, stack

    g = torch.Generator().manual_seed(11)
    fn = BlockMask.from_fn(lambda b, h, qi, kv: (qi * 7 + kv * 3) % 5 < 2, 70, 90, block_size=(16, 48))
    dense = BlockMask.from_dense(torch.rand(2, 3, 40, 50, generator=g) < 0.2, block_size=16)
    window = BlockMask.from_fn(sliding_causal(20), 96, block_size=16, heads=2)
    return {"from_fn": fn, "from_dense-per-batch-head": dense, "and-butterfly": window & butterfly(96, block_size=16),
            "or-butterfly": window | butterfly(96, block_size=16), "stacked-heads": stack([window, butterfly(96, block_size=16)])}


@pytest.mark.parametrize("name", list(_bits_masks()))
def test_exact_bits_match_the_token_mask(name):
    """Every partial block's bits are its pairs of to_dense(exact=True) (tail pairs 0), and the
    tables follow the lists: combined and stacked masks too (their mask_mods called blockwise)."""
    mask = _bits_masks()[name]
    eb = mask.exact_bits()
    assert eb is not None
    tok = mask.to_dense(exact=True)
    bq, bk = mask.block_size
    for p, (b, h, i, j) in enumerate(mask.partial.nonzero().tolist()):
        on = ((eb.bits[p][:, :, None] >> torch.arange(32)) & 1).bool().reshape(bq, -1)[:, :bk]
        want = torch.zeros(bq, bk, dtype=torch.bool)
        part = tok[b, h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        want[:part.shape[0], :part.shape[1]] = part
        assert torch.equal(on, want), (p, b, h, i, j)
    index = mask.index()
    for idx, table, tile_of in ((index.kv_idx, eb.kv_tile, eb.tile_of), (index.q_idx, eb.q_tile,
                                                                          eb.tile_of.transpose(-1, -2))):
        n = tile_of.shape[-1]
        want = torch.where(idx < n, tile_of.gather(-1, idx.clamp(max=n - 1).long()), -1)
        assert torch.equal(table, want.to(torch.int32))


# ---------------------------------------------------------------- the benchmark's CPU mode
def test_exact_bench_cpu_mode(tmp_path, device):
    """The exact-mask benchmark end to end in its tiny CPU mode: rows labelled as CPU, the exact
    provider equal to the reference, the block-level one not."""
    if device != "cpu":
        pytest.skip("the CPU mode; the GPU run is the lead's command")
    import json

    from sparseflash.experiments.bench import exact

    assert exact.main(["--device", "cpu", "--out", str(tmp_path), "--tokens", "64", "--window", "20",
                       "--masks", "sliding-window"]) == 0
    rows = json.loads((tmp_path / "exact.json").read_text())["rows"]
    assert [r["provider"] for r in rows] == ["sparseflash-exact", "sparseflash-block"]
    assert all(r["status"] == "ok" and r["device"] == "cpu" and r["note"] for r in rows)
    assert rows[0]["max_diff_vs_reference"] < 1e-5 < rows[1]["max_diff_vs_reference"]
    assert rows[0]["partial_blocks"] > 0 and rows[0]["block_overcount"] > 1 and rows[0]["fwdbwd_ms"] > 0
    assert (tmp_path / "exact.csv").read_text().startswith("bench,provider")
    # the same exact masks from the kernels' predicates (key ranges for the window, segment ids for
    # the documents) instead of bits: equal to the reference too
    assert exact.main(["--device", "cpu", "--out", str(tmp_path / "pred"), "--tokens", "64", "--window", "20",
                       "--doc-len", "16", "--providers", "sparseflash-predicate", "sparseflash-block"]) == 0
    rows = json.loads((tmp_path / "pred" / "exact.json").read_text())["rows"]
    assert [(r["mask"], r["provider"]) for r in rows] == [
        ("sliding-window", "sparseflash-predicate"), ("sliding-window", "sparseflash-block"),
        ("documents", "sparseflash-predicate"), ("documents", "sparseflash-block")]
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["max_diff_vs_reference"] < 1e-5 for r in rows if r["provider"] == "sparseflash-predicate")
    assert all(r["max_diff_vs_reference"] > 1e-5 for r in rows if r["provider"] == "sparseflash-block")
