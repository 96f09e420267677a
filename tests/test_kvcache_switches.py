"""The decode switches (`sparseflash.flash.decode.OVERRIDES`, their defaults `decode.SWITCH_DEFAULTS`):

- ``check_in_split`` (on by default; off: the previous default): a read without new keys or pages has its
  bounds checked by the split kernel, no bounds launch;
- ``fused_combine`` (a study switch, off by default): with several splits the split kernel merges them
  itself (the last program of each (batch, kv head) by a ticket), no combine launch;
- ``balanced_splits`` (on by default; off: the previous split count): `decode.pick_splits` spreads the
  programs evenly over the SMs.

The launch switches must give the answer of the path that launches the bounds check and the combine
(``BASE``: check_in_split off, fused_combine off) bit for bit (same arithmetic, same order) at the same
split count, launch only what they claim, leave the tickets at 0 after every call, and fail every bad bound
with the same message. The balanced split count sums in another order where it changes the count: its
answer is the reference's, and the same bits on every call. CPU: the kernels under the Triton interpreter
(programs run one after another, so the tickets' ordering between programs is only exercised on a GPU);
GPU: the same comparisons at the decode bench's shapes, repeated, and in a CUDA graph."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import sparseflash
from sparseflash import BlockMask
from sparseflash.flash import decode
from test_kvcache import _Counting  # (the kernel stand-in that counts its launches)

interpreted_kernels = pytest.mark.skipif(not sparseflash._env.interpreting(),
                                         reason="drives the decode kernels on CPU tensors under the interpreter")

# the reference path: the bounds check and the combine their own launches (the default before fdc55a7's H200
# measurement, but for the split count, which the CPU tests fix); and the launch switches compared with it
BASE = dict(check_in_split=False)
SWITCHES = {"fused": dict(fused_combine=True, check_in_split=False),  # the combine merged in the split kernel
            "check": {},  # the default: the bounds checked in the split kernel
            "both": dict(fused_combine=True)}  # both: one launch per read


def _on(switch: str, name: str) -> bool:
    """Whether the decode switch ``name`` is on under the variant SWITCHES[switch]."""
    return SWITCHES[switch].get(name, decode.SWITCH_DEFAULTS[name])


def _call(switches: dict, *args, **kw):
    """flash_attn_with_kvcache with ``switches`` in decode.OVERRIDES for this call only."""
    with decode.overridden(switches):
        return sparseflash.flash_attn_with_kvcache(*args, **kw)


def _tickets_at_zero():
    """Every fused plan's tickets, on every stream, are back at 0."""
    seen = 0
    for p in decode.PLANS.values():
        for _, _, tickets, _ in p.work.values():
            for t in tickets:
                if t is not None:
                    seen += 1
                    assert not t.any(), t
    return seen


def _inputs(B, SQ, H, Hk, D, N, seed, dtype=torch.float32, device="cpu", rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, SQ, H, D, generator=g).to(device, dtype)
    kc, vc = (torch.randn(rows or B, N, Hk, D, generator=g).to(device, dtype) for _ in range(2))
    return q, kc, vc


# (id, B, SQ, H, Hk, D, N, cache_seqlens, splits, extra): awkward on purpose (GQA, one and several
# splits, an empty row, leftpad, batch_idx, a window, query chunks, the lse not wanted)
CASES = [
    ("B1-Q1-S1", 1, 1, 4, 2, 16, 40, [33], 1, {}),
    ("B1-Q1-S2-gqa4", 1, 1, 8, 2, 16, 200, [200], 2, {}),
    ("B3-Q4-S5-leftpad-bidx-empty", 3, 4, 4, 2, 16, 160, [150, 0, 77], 5,
     dict(cache_leftpad=[3, 0, 70], cache_batch_idx=[2, 0, 3], causal=True)),
    ("B3-Q1-S3-window-nolse", 3, 1, 6, 3, 32, 96, [90, 5, 64], 3, dict(window_size=(20, 0), lse=False)),
    ("B2-Q9-S2-chunks", 2, 9, 8, 1, 16, 64, [60, 30], 2, dict(chunks=True)),
]


@interpreted_kernels
@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_switches_are_bitwise_the_default(case, switch, monkeypatch):
    """out and lse equal BASE's bit for bit; the launches are BASE's less the ones the switch removes (the
    combine with several splits; the bounds check of a read); tickets back at 0."""
    name, B, SQ, H, Hk, D, N, lens, splits, extra = case
    extra = dict(extra)
    lse = extra.pop("lse", True)
    if extra.pop("chunks", False):
        monkeypatch.setattr(sparseflash.kvcache, "MAX_ROWS", 16)  # 9 tokens x 8 heads: query chunks of 2 tokens
    rows = 4 if "cache_batch_idx" in extra else None
    q, kc, vc = _inputs(B, SQ, H, Hk, D, N, seed=N + B, rows=rows)
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), num_splits=splits, return_softmax_lse=lse,
              **{k: torch.tensor(v, dtype=torch.int32) if k.startswith("cache_") else v for k, v in extra.items()})
    want = _call(BASE, q, kc, vc, **kw)
    counts = Counter()
    for k in ("decode_split_kernel", "decode_combine_kernel", "decode_bounds_kernel"):
        monkeypatch.setattr(decode, k, _Counting(getattr(decode, k), counts, k))
    for _ in range(2):  # the second call reuses the plan, its tickets and verdict
        got = _call(SWITCHES[switch], q, kc, vc, **kw)
        for a, b in zip(got, want) if lse else ((got, want),):
            assert torch.equal(a, b), name
    chunks = -(-SQ // max(1, sparseflash.kvcache.MAX_ROWS // (H // Hk)))
    fused = _on(switch, "fused_combine")
    bounds = not _on(switch, "check_in_split")
    assert counts == Counter(decode_split_kernel=2 * chunks,
                             **({"decode_combine_kernel": 2 * chunks} if splits > 1 and not fused else {}),
                             **({"decode_bounds_kernel": 2} if bounds else {})), counts
    assert _tickets_at_zero() >= (chunks if splits > 1 and fused else 0)
    if lse:
        assert not torch.isnan(got[0]).any() and not torch.isnan(got[1]).any()
        if 0 in lens:  # a row that attends nothing: 0 and -inf, never NaN
            b = lens.index(0)
            assert not got[0][b].any() and torch.isneginf(got[1][b]).all()


@interpreted_kernels
@pytest.mark.parametrize("switch", ["fused", "both"])
def test_fused_merge_of_block_lists_paged_and_appends(switch):
    """The fused merge under the split kernel's other modes: block lists (mask=), a paged cache and an
    append (both keep the bounds launch: page ids are read only by the check, and an append writes at
    cache_seqlens before the split kernel runs), bit for bit BASE's, the cache appended alike."""
    from test_kvcache import _paged

    B, H, Hk, D, N, bs = 2, 4, 2, 16, 128, 16
    q, kc, vc = _inputs(B, 1, H, Hk, D, N, seed=7)
    lens = torch.tensor([100, 128], dtype=torch.int32)
    lay = torch.rand(B, Hk, 1, N // bs, generator=torch.Generator().manual_seed(1)) < 0.5
    mask = BlockMask.from_layout(lay, block_size=(16, bs), seq_q=1, seq_k=N)
    kw = dict(cache_seqlens=lens, mask=mask, num_splits=3, return_softmax_lse=True)
    for a, b in zip(_call(SWITCHES[switch], q, kc, vc, **kw), _call(BASE, q, kc, vc, **kw)):
        assert torch.equal(a, b)
    kp, vp, table = _paged(kc, vc, 8)
    kn, vn = (torch.randn(B, 2, Hk, D, generator=torch.Generator().manual_seed(s)) for s in (2, 3))
    lens = torch.tensor([40, 126], dtype=torch.int32)
    caches = []
    for sw in (SWITCHES[switch], BASE):
        a, b = kp.clone(), vp.clone()
        caches.append((a, b, _call(sw, q, a, b, kn, vn, cache_seqlens=lens, block_table=table, causal=True,
                                   num_splits=4, return_softmax_lse=True)))
    (a1, b1, got), (a2, b2, want) = caches
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert _tickets_at_zero() >= 2


def _i32(*x):
    return torch.tensor(x, dtype=torch.int32)


@interpreted_kernels
@pytest.mark.parametrize("switch", ["check", "both"])
def test_check_in_split_fails_every_bad_bound(switch, monkeypatch):
    """With the check in the split kernel, every bad cache_seqlens / leftpad / batch index BASE's
    device check fails (test_kvcache's, and each in the last of three rows, and in row 69 of 70, past
    the first 64 rows the check reads at once) fails the call with the same message, with no bounds
    launch for a read; good values make no host read. An append keeps its bounds launch before
    anything is written."""
    from test_kvcache import _HostReads, _small

    q, kc, vc, kn, vn = _small()
    sw = SWITCHES[switch]
    device_msg = r"out of bounds: cache_seqlens \+ seqlen_new .*SPARSEFLASH_KVCACHE_HOST_CHECKS=1"
    counts = Counter()
    monkeypatch.setattr(decode, "decode_bounds_kernel", _Counting(decode.decode_bounds_kernel, counts, "bounds"))
    good = [dict(cache_seqlens=_i32(3, 8)), dict(cache_seqlens=_i32(3, 5), cache_leftpad=_i32(0, 5)),
            dict(cache_seqlens=_i32(3, 5), cache_batch_idx=_i32(1, 0)), dict(cache_leftpad=_i32(2, 8))]
    bad = [dict(cache_seqlens=_i32(3, 9)), dict(cache_seqlens=_i32(-1, 3)),
           dict(cache_seqlens=_i32(3, 5), cache_leftpad=_i32(0, 6)),
           dict(cache_seqlens=_i32(3, 5), cache_leftpad=_i32(-1, 0)),
           dict(cache_seqlens=_i32(3, 5), cache_batch_idx=_i32(0, 2)),
           dict(cache_seqlens=_i32(3, 5), cache_batch_idx=_i32(-1, 0)), dict(cache_leftpad=_i32(0, 9))]
    for kw in good:
        with _HostReads() as reads:
            got = _call(sw, q, kc, vc, num_splits=2, **kw)
        assert reads.n == 0 and torch.equal(got, _call(BASE, q, kc, vc, num_splits=2, **kw)), kw
    for kw in bad:
        for splits in (1, 2):
            with pytest.raises(RuntimeError, match=device_msg):
                _call(sw, q, kc, vc, num_splits=splits, **kw)
    assert counts["bounds"] == len(good)  # (BASE's calls above)
    q3, kc3, vc3 = _inputs(3, 1, 4, 2, 16, 8, seed=1, rows=3)
    for kw in (dict(cache_seqlens=_i32(3, 5, 9)), dict(cache_seqlens=_i32(3, 5, 2), cache_leftpad=_i32(0, 0, 3)),
               dict(cache_seqlens=_i32(3, 5, 2), cache_batch_idx=_i32(0, 1, 3))):
        with pytest.raises(RuntimeError, match=device_msg):
            _call(sw, q3, kc3, vc3, num_splits=2, **kw)
    q70, kc70, vc70 = _inputs(70, 1, 2, 1, 16, 4, seed=2)
    lens = torch.full((70,), 4, dtype=torch.int32)
    _call(sw, q70, kc70, vc70, cache_seqlens=lens)
    lens[69] = 5
    with pytest.raises(RuntimeError, match=device_msg):
        _call(sw, q70, kc70, vc70, cache_seqlens=lens)
    for kw in (dict(cache_seqlens=_i32(3, 7)), dict(cache_seqlens=_i32(-2, 3))):  # appends: checked before
        a, b = kc.clone(), vc.clone()
        with pytest.raises(RuntimeError, match=device_msg):
            _call(sw, q, a, b, kn, vn, **kw)
        assert torch.equal(a, kc) and torch.equal(b, vc), kw  # nothing appended
    assert counts["bounds"] == len(good) + 2


@interpreted_kernels
def test_check_in_split_reads_within_the_cache():
    """Until the assert fails the call, the split kernel has run with the bad values: it clamps each
    row's key end to the cache's length and its cache row into the cache, so it reads nothing past
    them (here NaN lies just past the cache's rows and length, and every output stays finite) and
    writes verdict 0; good rows' outputs are unchanged."""
    B, H, Hk, D, N = 3, 4, 2, 16, 48
    q, _, _ = _inputs(B, 1, H, Hk, D, N, seed=5)
    g = torch.Generator().manual_seed(6)
    big_k, big_v = (torch.full((B + 2, N + 16, Hk, D), float("nan")) for _ in range(2))
    for t in (big_k, big_v):
        t[:B + 1, :N] = torch.randn(B + 1, N, Hk, D, generator=g)
    kc, vc = big_k[:B + 1, :N], big_v[:B + 1, :N]  # cache rows of N keys, NaN right after each
    lens, idx = _i32(48, 60, 20), _i32(0, 1, 4)  # row 1 too long, row 2's cache row past the cache
    for splits in (1, 3):
        p = decode.plan(q, kc, vc, scale=0.25, window=(-1, -1), batch_idx=True, num_splits=splits, max_len=N,
                        check=True)
        out, lse, ok = p(q, kc, vc, lens, None, idx)
        assert int(ok) == 0 and torch.isfinite(out).all() and torch.isfinite(lse).all()
        good, _, ok = p(q, kc, vc, _i32(48, 40, 20), None, _i32(0, 1, 2))
        assert int(ok) == 1 and torch.equal(out[0], good[0])


# ----------------------------------------------------------------------------- on the GPU

GPU_CASES = [  # (B, SQ, H, Hk, D, N, splits (0: the default count), dtype): the bench's shapes and awkward ones
    (1, 1, 32, 8, 128, 16384, 0, torch.bfloat16),  # 33 splits (132 SMs): the merge tile padded past BLOCK_N
    (16, 1, 32, 8, 128, 16384, 0, torch.bfloat16),  # 3 splits
    (1, 1, 32, 8, 128, 65536, 0, torch.bfloat16),
    (4, 1, 32, 8, 128, 16384, 0, torch.float16),  # 12 splits balanced (9 not): BLOCK_S 16 = BLOCK_M
    (3, 4, 16, 4, 64, 4096, 17, torch.bfloat16),
    (2, 1, 8, 8, 128, 8192, 65, torch.float16),
    (3, 2, 8, 2, 256, 2048, 5, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"B{c[0]}-Q{c[1]}-H{c[2]}/{c[3]}-D{c[4]}-N{c[5]}-S{c[6]}-{str(c[7])[6:]}"
                                                  for c in GPU_CASES])
def test_switches_are_bitwise_the_default_on_cuda(case, switch):
    """On CUDA (the compiled kernels, programs running at once: the tickets' ordering is exercised):
    out and lse bit for bit BASE's (the same split count), over 20 calls of each (a late or stale partial would show
    in some), an empty row and leftpad / batch index included; tickets back at 0."""
    B, SQ, H, Hk, D, N, splits, dtype = case
    q, kc, vc = _inputs(B, SQ, H, Hk, D, N, seed=B * N, dtype=dtype, device="cuda", rows=B + 1)
    lens = torch.randint(N // 2, N + 1, (B,), generator=torch.Generator().manual_seed(B), dtype=torch.int32)
    if B > 1:
        lens[1] = 0
    kw = dict(cache_seqlens=lens.cuda(), num_splits=splits, return_softmax_lse=True)
    if B > 2:
        kw.update(cache_leftpad=(lens // 4).cuda(), cache_batch_idx=torch.arange(B, 0, -1, dtype=torch.int32).cuda())
    want = _call(BASE, q, kc, vc, **kw)
    for _ in range(20):
        got = _call(SWITCHES[switch], q, kc, vc, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.cuda.synchronize()
    _tickets_at_zero()
    if B > 1:
        assert not got[0][1].any() and torch.isneginf(got[1][1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["fused", "both"])
def test_switches_in_a_cuda_graph(switch):
    """A decode step with the switches captured in a CUDA graph (its own tickets and verdict, zeroed when
    captured and put back to 0 by each replay) and replayed with new lengths gives BASE's eager call's
    out and lse bit for bit."""
    B, H, Hk, D, N = 2, 32, 8, 128, 16384
    q, kc, vc = _inputs(B, 1, H, Hk, D, N, seed=3, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([N - 100, 5000], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens, return_softmax_lse=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _call(SWITCHES[switch], q, kc, vc, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _call(SWITCHES[switch], q, kc, vc, **kw)
    for step in range(5):
        lens.sub_(7)
        graph.replay()
        want_o, want_lse = _call(BASE, q, kc, vc, **kw)
        assert torch.equal(out, want_o) and torch.equal(lse, want_lse), step


def test_balanced_splits_spread_the_programs_evenly(monkeypatch):
    """`balanced_splits` (`decode.pick_splits`; on by default, ``OVERRIDES["balanced_splits"] = False`` the
    previous count): on 132 SMs batch 4 x 8 kv heads takes 12 splits (384 programs, 2.91 an SM) where the
    previous count was 9 (288, 2.18: some SMs 3, some 2); counts that already spread evenly (batch 1, 16, 64)
    stay; a short cache's cap still holds. A call plans with the count of its switches (the plan's key holds
    them) and gives the reference's answer either way (another summation order), the same bits each call."""
    from sparseflash.kvcache import decode_reference

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    dev = torch.device("cpu")

    def counts():
        return {(B, n): decode.pick_splits(B, 8, n, dev) for B in (1, 4, 16, 64) for n in (64, 256, 4096)}

    got = {"default": counts()}
    for on in (False, True):
        with decode.overridden(dict(balanced_splits=on)):
            got[on] = counts()
    assert got["default"] == got[True]
    assert got[False][(4, 256)] == 9 and got[True][(4, 256)] == 12
    for key, s in got[True].items():
        B, n = key
        p = B * 8 * s / 132
        assert s >= got[False][key] and s <= max(1, min(n // 4, 128))
        assert p >= 0.95 * -(-p // 1) or s == got[False][key], key
        if B != 4:
            assert s == got[False][key], key
    monkeypatch.setattr(decode, "sm_count", lambda device: 4)  # (the interpreter's count)
    monkeypatch.setattr(decode, "PLANS", {})
    monkeypatch.setattr(sparseflash.kvcache, "PLANS", {})
    q = torch.randn(3, 1, 8, 64)  # 3 programs of one kv head: 4 splits balanced, 3 not (9 on 4 SMs)
    kc, vc = torch.randn(3, 1024, 1, 64), torch.randn(3, 1024, 1, 64)
    lens = torch.tensor([1024, 300, 7], dtype=torch.int32)
    ref_o, ref_lse = decode_reference(q.double(), kc.double(), vc.double(), torch.zeros(3, dtype=torch.int32), lens,
                                      scale=0.125, window=(-1, -1))
    for switches, splits in (({}, 4), (dict(balanced_splits=False), 3)):
        with decode.overridden(switches):
            assert decode.pick_splits(3, 1, 16, dev) == splits
        out, lse = _call(switches, q, kc, vc, cache_seqlens=lens, return_softmax_lse=True)
        torch.testing.assert_close(out.double(), ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)
        again = _call(switches, q, kc, vc, cache_seqlens=lens, return_softmax_lse=True)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
        if sparseflash._env.interpreting():  # (the kernel ran: its plan's split count)
            assert [p.splits for p in decode.PLANS.values() if p.shape == (3, 1, 8, 64)][-1] == splits


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4, 16])
def test_split_counts_give_the_reference_on_cuda(B):
    """On CUDA at the decode bench's shapes (a 16K cache, GQA 32/8, d 128, bf16, one query token): the default's
    balanced split count and the previous one (``balanced_splits`` off: on an H200 9 splits against 12 at B4)
    each give the plain-PyTorch reference's out and lse (`decode_reference`, float32 scores) within bf16
    rounding, the same bits over 10 calls; where the two counts agree, the same bits as each other."""
    from sparseflash.kvcache import decode_reference

    H, Hk, D, N = 32, 8, 128, 16384
    q, kc, vc = _inputs(B, 1, H, Hk, D, N, seed=B, dtype=torch.bfloat16, device="cuda")
    lens = torch.randint(N // 2, N + 1, (B,), generator=torch.Generator().manual_seed(B), dtype=torch.int32).cuda()
    kw = dict(cache_seqlens=lens, return_softmax_lse=True)
    ref_o, ref_lse = decode_reference(q, kc, vc, torch.zeros_like(lens), lens, scale=D ** -0.5, window=(-1, -1))
    splits, outs = {}, {}
    for name, switches in (("balanced", {}), ("unbalanced", dict(balanced_splits=False))):
        with decode.overridden(switches):
            splits[name] = decode.pick_splits(B, Hk, N // 64, q.device)
        out, lse = outs[name] = _call(switches, q, kc, vc, **kw)
        torch.testing.assert_close(out.float(), ref_o.float(), rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3)
        for _ in range(10):
            again = _call(switches, q, kc, vc, **kw)
            assert torch.equal(again[0], out) and torch.equal(again[1], lse), name
    if splits["balanced"] == splits["unbalanced"]:
        assert torch.equal(outs["balanced"][0], outs["unbalanced"][0])
    if decode.sm_count(q.device) == 132 and B == 4:  # (an H200)
        assert splits == dict(balanced=12, unbalanced=9)
