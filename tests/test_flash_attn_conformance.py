"""Conformance with flash-attn 2's own test suite (``tests/test_flash_attn.py`` upstream), written here.

flash-attn's test cases are ported as facts, not code: each family's shapes (sequence-length pairs,
head dims, batch and head counts, MHA / MQA / GQA), flags (causal, a random window
``torch.randint(0, seqlen_k, (2,))`` passed as a tensor, ALiBi slopes ``rand(batch, nheads) * 0.3``,
softcap 0 / 50, deterministic, packed q/kv/qkv, padding masks for varlen, paged k/v with pages of
256 / 512, ``num_splits`` 0 / 1, rotary fractions 0 / 0.5 / 1 interleaved or not, leftpad, cache
batch index, new k/v) and error bounds (output within ``OUT_MULT`` times PyTorch's own error,
gradients within ``GRAD_MULT`` times, PyTorch's error being the same formula computed in the input
dtype, both against float64; kvcache 3x, 5x with ALiBi). Dropout is left out: its bits differ from
flash-attn's by design (the same law; README).

The float64 reference here is written from flash-attn's documented semantics (token masks per
sequence, bottom-right aligned), independently of `sparseflash.reference`.

Lanes: on CPU a small sample of every family (short sequences, few heads) under the Triton
interpreter; on a GPU a seeded sample of ``SPARSEFLASH_CONFORMANCE_N`` cases per family (default 64),
or flash-attn's whole grid with ``SPARSEFLASH_CONFORMANCE=full`` (hours). One command runs the GPU
sample over several processes and writes a summary per family:
``python -m sparseflash.experiments.studies.flash_attn_upstream.conformance OUT_DIR``.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import zlib

import pytest
import torch
from _attn_check import assert_within_torch_error, flash_attn_allowed

import sparseflash

HAS_CUDA = torch.cuda.is_available()

# ---------------------------------------------------------------- flash-attn's grids (facts)
HEADDIMS = [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256]
HEADDIMS_CAUSAL = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLENS_OUTPUT = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
                  (1023, 1024), (1024, 1023), (2048, 2048)]
SEQLENS_VARLEN = [(1, 147)] + SEQLENS_OUTPUT
SEQLENS_QKVPACKED = [97, 128, 200, 384, 768, 1024, 1025, 2048]
SEQLENS_CAUSAL = [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256),
                  (256, 512), (1023, 1024)]
SEQLENS_SPLITKV = [(1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200), (256, 256),
                   (257, 257), (384, 384), (512, 512), (768, 768), (1024, 1024)]
SEQLENS_KVCACHE = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                   (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
HEADDIMS_KVCACHE = [32, 59, 64, 80, 128, 256]
MHA = {"mha": lambda h: h, "mqa": lambda h: 1, "gqa": lambda h: 3}
OUT_MULT, GRAD_MULT = 2.0, 3.0  # flash-attn's bounds: output 2x PyTorch's error, gradients 3x
KVCACHE_MULT, KVCACHE_ALIBI_MULT = 3.0, 5.0


def _grid(family: str):
    """flash-attn's full parameter grid of one family as case dicts (before sampling)."""
    if family == "output":
        for dtype, local, det, alibi, causal, d, (sq, sk), softcap, pack, mha in itertools.product(
                ("float16", "bfloat16"), (False, True), (False, True), (False, True), (False, True), HEADDIMS,
                SEQLENS_OUTPUT, (0.0, 50.0), ("none", "kv"), MHA):
            yield dict(family=family, dtype=dtype, local=local, det=det, alibi=alibi, causal=causal, d=d, sq=sq, sk=sk,
                       softcap=softcap, pack=pack, B=4, H=9, Hk=MHA[mha](9), varlen=False, page=None)
    elif family == "qkvpacked":
        for dtype, local, det, alibi, causal, d, s in itertools.product(
                ("float16", "bfloat16"), (False, True), (False, True), (False, True), (False, True),
                [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256], SEQLENS_QKVPACKED):
            for varlen in (False, True):
                yield dict(family=family, dtype=dtype, local=local, det=det, alibi=alibi, causal=causal, d=d, sq=s,
                           sk=s, softcap=0.0, pack="qkv", B=4 if varlen else 13, H=9, Hk=9, varlen=varlen, page=None)
    elif family == "varlen":
        for dtype, local, det, alibi, causal, d, (sq, sk), softcap, pack, mha in itertools.product(
                ("float16", "bfloat16"), (False, True), (False, True), (False, True), (False, True), HEADDIMS,
                SEQLENS_VARLEN, (0.0, 50.0), ("none", "kv"), MHA):
            yield dict(family=family, dtype=dtype, local=local, det=det, alibi=alibi, causal=causal, d=d, sq=sq, sk=sk,
                       softcap=softcap, pack=pack, B=4, H=9, Hk=MHA[mha](9), varlen=True, page=None)
    elif family in ("causal", "varlen_causal"):
        pages = (None, 256, 512) if family == "varlen_causal" else (None,)
        for dtype, local, d, (sq, sk), swap, page in itertools.product(
                ("float16", "bfloat16"), (False, True), HEADDIMS_CAUSAL, SEQLENS_CAUSAL, (False, True), pages):
            if swap:
                sq, sk = sk, sq
            yield dict(family=family, dtype=dtype, local=local, det=False, alibi=False, causal=True, d=d, sq=sq, sk=sk,
                       softcap=0.0, pack="none", B=8, H=9, Hk=9, varlen=family == "varlen_causal", page=page)
    elif family == "splitkv":
        for dtype, local, det, alibi, causal, d, (sq, sk) in itertools.product(
                ("float16", "bfloat16"), (False, True), (False, True), (False, True), (False, True), HEADDIMS,
                SEQLENS_SPLITKV):
            yield dict(family=family, dtype=dtype, local=local, det=det, alibi=alibi, causal=causal, d=d, sq=sq, sk=sk,
                       softcap=0.0, pack="none", B=1, H=12, Hk=12, varlen=False, page=None)
    elif family == "kvcache":
        for (num_splits, mha, new_kv, alibi, local, causal, eq, inter, frac, page, leftpad, bidx, d,
             (sq, sk)) in itertools.product((1, 0), MHA, (False, True), (False, True), (False, True), (False, True),
                                            (True, False), (False, True), (0.0, 0.5, 1.0), (None, 256), (False, True),
                                            (False, True), HEADDIMS_KVCACHE, SEQLENS_KVCACHE):
            if page is not None and (leftpad or bidx):
                continue  # flash-attn: a paged cache takes neither
            yield dict(family=family, dtype="float16", num_splits=num_splits, H=6, Hk=MHA[mha](6), new_kv=new_kv,
                       alibi=alibi, local=local, causal=causal, seqlen_new_eq=eq, interleaved=inter, frac=frac,
                       page=page, leftpad=leftpad, bidx=bidx, d=d, sq=sq, sk=sk, B=2)


# The CPU lane: flash-attn's flags over its shortest shapes, with fewer heads and a smaller batch.
CPU_CASES = [
    dict(family="output", dtype="float16", local=True, det=True, alibi=False, causal=False, d=40, sq=113, sk=203,
         softcap=0.0, pack="kv", B=1, H=3, Hk=1, varlen=False, page=None),
    dict(family="output", dtype="bfloat16", local=False, det=False, alibi=True, causal=True, d=59, sq=128, sk=217,
         softcap=50.0, pack="none", B=1, H=2, Hk=2, varlen=False, page=None),
    dict(family="qkvpacked", dtype="float16", local=False, det=False, alibi=False, causal=True, d=32, sq=97, sk=97,
         softcap=0.0, pack="qkv", B=2, H=2, Hk=2, varlen=True, page=None),
    dict(family="varlen", dtype="bfloat16", local=True, det=False, alibi=True, causal=True, d=32, sq=1, sk=147,
         softcap=0.0, pack="none", B=2, H=3, Hk=1, varlen=True, page=None),
    dict(family="varlen", dtype="float16", local=False, det=False, alibi=False, causal=False, d=64, sq=113, sk=203,
         softcap=50.0, pack="kv", B=2, H=2, Hk=1, varlen=True, page=None),
    dict(family="causal", dtype="float16", local=False, det=False, alibi=False, causal=True, d=80, sq=239, sk=1,
         softcap=0.0, pack="none", B=2, H=2, Hk=2, varlen=False, page=None),
    dict(family="varlen_causal", dtype="bfloat16", local=True, det=False, alibi=False, causal=True, d=40, sq=3,
         sk=799, softcap=0.0, pack="none", B=2, H=1, Hk=1, varlen=True, page=256),
    dict(family="splitkv", dtype="float16", local=False, det=True, alibi=True, causal=True, d=111, sq=3, sk=799,
         softcap=0.0, pack="none", B=1, H=2, Hk=2, varlen=False, page=None),
    dict(family="kvcache", dtype="float16", num_splits=0, H=6, Hk=3, new_kv=True, alibi=False, local=False,
         causal=True, seqlen_new_eq=False, interleaved=False, frac=0.5, page=None, leftpad=True, bidx=True, d=64,
         sq=3, sk=1024, B=2),
    dict(family="kvcache", dtype="float16", num_splits=1, H=6, Hk=1, new_kv=True, alibi=True, local=True,
         causal=False, seqlen_new_eq=True, interleaved=True, frac=1.0, page=256, leftpad=False, bidx=False, d=32,
         sq=16, sk=339, B=2),
    dict(family="kvcache", dtype="float16", num_splits=0, H=6, Hk=6, new_kv=False, alibi=False, local=False,
         causal=False, seqlen_new_eq=True, interleaved=False, frac=0.0, page=None, leftpad=False, bidx=False, d=59,
         sq=1, sk=128, B=2),
]
FAMILIES = ["output", "qkvpacked", "varlen", "causal", "varlen_causal", "splitkv", "kvcache"]


def _gpu_cases():
    n = int(os.environ.get("SPARSEFLASH_CONFORMANCE_N", "64"))
    full = os.environ.get("SPARSEFLASH_CONFORMANCE") == "full"
    out = []
    for fam in FAMILIES:
        grid = list(_grid(fam))
        out += grid if full else random.Random(57).sample(grid, min(n, len(grid)))
    # SPARSEFLASH_CONFORMANCE_SHARD=i/k keeps every k-th case from the i-th: the runner spreads the
    # sample over processes, since compiling each case's kernels, not running them, takes the time
    i, k = (int(x) for x in os.environ.get("SPARSEFLASH_CONFORMANCE_SHARD", "0/1").split("/"))
    return out[i::k]


def _case_id(c):
    s = f"{c['family']}-{c['dtype']}-B{c['B']}-H{c['H']}/{c['Hk']}-d{c['d']}-{c['sq']}x{c['sk']}"
    for flag in ("causal", "local", "alibi", "det", "varlen", "leftpad", "bidx", "new_kv"):
        if c.get(flag):
            s += f"-{flag}"
    if c.get("softcap"):
        s += "-softcap"
    if c.get("pack", "none") != "none":
        s += f"-{c['pack']}packed"
    if c.get("page"):
        s += f"-page{c['page']}"
    if "num_splits" in c:
        s += f"-splits{c['num_splits']}-rot{c['frac']}{'i' if c['interleaved'] else ''}"
    return s


CASES = _gpu_cases() if HAS_CUDA else CPU_CASES


# ---------------------------------------------------------------- the float64 reference (flash-attn's semantics)


def _attend(q, k, v, allowed, rel, *, softcap, slopes, ct):
    """Attention over padded tensors in ``ct``: q [B, Sq, H, D], k, v [B, Sk, Hk, D]; allowed [B, Sq, Sk];
    rel [B, Sq, Sk] = query position - key position for ALiBi. Rows that attend nothing give 0."""
    H, Hk = q.shape[2], k.shape[2]
    q, k, v = q.to(ct), k.to(ct).repeat_interleave(H // Hk, 2), v.to(ct).repeat_interleave(H // Hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q / math.sqrt(q.shape[-1]), k)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s - slopes.to(ct)[:, :, None, None] * rel.abs().to(ct)[:, None]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _lengths(gen, S: int, B: int, varlen: bool) -> list[int]:
    """flash-attn's 'random' padding: lengths in [max(1, S - 20), S]."""
    if not varlen:
        return [S] * B
    return [int(x) for x in torch.randint(max(1, S - 20), S + 1, (B,), generator=gen)]


@pytest.mark.parametrize("case", [c for c in CASES if c["family"] != "kvcache"],
                         ids=[_case_id(c) for c in CASES if c["family"] != "kvcache"])
def test_attention_families(case, device):
    """output / qkvpacked / varlen / causal / varlen_causal (paged) / splitkv: output and gradients
    within flash-attn's bounds of the float64 reference."""
    c = case
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator().manual_seed(zlib.crc32(_case_id(c).encode()))
    B, H, Hk, D, Sq, Sk = c["B"], c["H"], c["Hk"], c["d"], c["sq"], c["sk"]
    q = torch.randn(B, Sq, H, D, generator=gen)
    k, v = (torch.randn(B, Sk, Hk, D, generator=gen) for _ in range(2))
    do = torch.randn(B, Sq, H, D, generator=gen)
    window = tuple(int(x) for x in torch.randint(0, Sk, (2,), generator=gen)) if c["local"] else (-1, -1)
    slopes = torch.rand(B, H, generator=gen) * 0.3 if c["alibi"] else None
    lq = _lengths(gen, Sq, B, c["varlen"])
    lk = lq if c["pack"] == "qkv" else _lengths(gen, Sk, B, c["varlen"])
    allowed = torch.zeros(B, Sq, Sk, dtype=torch.bool)
    rel = torch.zeros(B, Sq, Sk, dtype=torch.long)
    for b in range(B):
        allowed[b, :lq[b], :lk[b]] = flash_attn_allowed(lq[b], lk[b], c["causal"], window)
        rel[b] = torch.arange(Sq)[:, None] + lk[b] - lq[b] - torch.arange(Sk)[None, :]
    qmask = (torch.arange(Sq)[None, :] < torch.tensor(lq)[:, None])[..., None, None]

    def ref(ct, where):
        leaves = [t.to(where, ct).requires_grad_() for t in (q, k, v)]
        o = _attend(*leaves, allowed.to(where), rel.to(where), softcap=c["softcap"],
                    slopes=None if slopes is None else slopes.to(where), ct=ct) * qmask.to(where)
        o = o.to(ct)
        o.backward(do.to(where, ct))
        return [o.detach().cpu()] + [t.grad.cpu() for t in leaves]

    want = ref(torch.float64, device)  # float64 on the device: the same arithmetic, seconds instead of minutes
    pt = ref(dtype, device)
    got = _ours(c, q, k, v, do, window, slopes, lq, lk, dtype, device)
    for name, g, p, r in zip(("out", "dq", "dk", "dv"), got, pt, want):
        mult = OUT_MULT if name == "out" else GRAD_MULT
        assert_within_torch_error(f"{_case_id(c)} {name}", g.float(), p.float(), r, dtype, mult)


def _ours(c, q, k, v, do, window, slopes, lq, lk, dtype, device):
    """The call flash-attn's test makes, on sparseflash; returns padded (out, dq, dk, dv)."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    wt = torch.tensor(window)  # flash-attn's tests pass the window as a tensor of two ints
    kw = dict(causal=c["causal"], window_size=wt, softcap=c["softcap"], deterministic=c["det"],
              alibi_slopes=None if slopes is None else slopes.to(device))
    if c["pack"] == "qkv":
        leaf = torch.stack((q, k, v), 2).to(device, dtype).requires_grad_()
        qs, ks, vs = leaf.unbind(2)
    elif c["pack"] == "kv":
        qs = q.to(device, dtype).requires_grad_()
        leaf = torch.stack((k, v), 2).to(device, dtype).requires_grad_()
        ks, vs = leaf.unbind(2)
    else:
        qs, ks, vs = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
        leaf = None
    if not c["varlen"]:
        if c["pack"] == "qkv":
            out = sparseflash.flash_attn_qkvpacked_func(leaf, **kw)
        elif c["pack"] == "kv":
            out = sparseflash.flash_attn_kvpacked_func(qs, leaf, **kw)
        else:
            out = sparseflash.flash_attn_func(qs, ks, vs, **kw)
    else:
        qi = torch.cat([torch.arange(lq[b]) + b * Sq for b in range(B)]).to(device)
        ki = torch.cat([torch.arange(lk[b]) + b * Sk for b in range(B)]).to(device)
        cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32, device=device)
        q_un, k_un, v_un = qs.flatten(0, 1)[qi], ks.flatten(0, 1)[ki], vs.flatten(0, 1)[ki]
        if c["pack"] == "qkv":
            o_un = sparseflash.flash_attn_varlen_qkvpacked_func(leaf.flatten(0, 1)[qi], cu_q, max(lq), **kw)
        elif c["pack"] == "kv":
            o_un = sparseflash.flash_attn_varlen_kvpacked_func(q_un, leaf.flatten(0, 1)[ki], cu_q, cu_k, max(lq),
                                                               max(lk), **kw)
        elif c["page"]:
            page = c["page"]
            per = [-(-n // page) for n in lk]
            n_pages = sum(per) + 3
            perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1))
            table = torch.zeros(B, max(per), dtype=torch.int32)
            rows = []
            used = 0
            for b in range(B):
                table[b, :per[b]] = perm[used:used + per[b]].to(torch.int32)
                used += per[b]
                p = torch.arange(lk[b])
                rows.append(table[b, p // page].long() * page + p % page)
            rows = torch.cat(rows).to(device)
            kp = torch.zeros(n_pages * page, *k_un.shape[1:], device=device, dtype=dtype).index_put((rows,), k_un)
            vp = torch.zeros(n_pages * page, *v_un.shape[1:], device=device, dtype=dtype).index_put((rows,), v_un)
            o_un = sparseflash.flash_attn_varlen_func(q_un, kp.view(n_pages, page, *k_un.shape[1:]),
                                                      vp.view(n_pages, page, *k_un.shape[1:]), cu_q, cu_k, max(lq),
                                                      max(lk), block_table=table.to(device), **kw)
        else:
            o_un = sparseflash.flash_attn_varlen_func(q_un, k_un, v_un, cu_q, cu_k, max(lq), max(lk), **kw)
        out = torch.zeros(B * Sq, *o_un.shape[1:], device=device, dtype=dtype).index_put((qi,), o_un).view(
            B, Sq, *o_un.shape[1:])
    out.backward(do.to(device, dtype))
    if c["pack"] == "qkv":
        grads = list(leaf.grad.unbind(2))
    elif c["pack"] == "kv":
        grads = [qs.grad] + list(leaf.grad.unbind(2))
    else:
        grads = [qs.grad, ks.grad, vs.grad]
    return [out.detach().cpu()] + [g.cpu() for g in grads]


@pytest.mark.parametrize("case", [c for c in CASES if c["family"] == "kvcache"],
                         ids=[_case_id(c) for c in CASES if c["family"] == "kvcache"])
def test_kvcache_family(case, device):
    """flash_attn_with_kvcache as flash-attn's test calls it; the reference rebuilt from its documented
    semantics (append, rotary at cache_seqlens, leftpad, batch index, bottom-right masks); output within
    3x PyTorch's error (5x with ALiBi), and the cache updated as the reference updates it."""
    c = case
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator().manual_seed(zlib.crc32(_case_id(c).encode()))
    B, H, Hk, D, Sq, Sk = c["B"], c["H"], c["Hk"], c["d"], c["sq"], c["sk"]
    Bc = 5 if c["bidx"] else B
    sn = Sq if c["seqlen_new_eq"] else int(torch.randint(1, Sq + 1, (1,), generator=gen))
    if not c["new_kv"]:
        sn = 0
    rot = math.floor(int(c["frac"] * D) / 16) * 16 if c["new_kv"] else 0
    q = torch.randn(B, Sq, H, D, generator=gen)
    kn, vn = (torch.randn(B, sn, Hk, D, generator=gen) for _ in range(2))
    if c["page"]:
        cap = -(-Sk // c["page"]) * c["page"]
    else:
        cap = Sk
    kc, vc = (torch.randn(Bc, cap, Hk, D, generator=gen) for _ in range(2))
    local_or_causal = c["causal"] or c["local"]
    hi = Sk - (Sq if local_or_causal and rot > 1 else sn) + 1
    sl = torch.randint(0, max(hi, 1), (B,), generator=gen, dtype=torch.int32)
    lp = (torch.stack([torch.randint(0, int(s), (1,), generator=gen)[0] if s > 0 else torch.tensor(0) for s in sl])
          .to(torch.int32) if c["leftpad"] else None)
    bidx = torch.randperm(Bc, generator=gen)[:B].to(torch.int32) if c["bidx"] else None
    window = tuple(int(x) for x in torch.randint(0, Sk, (2,), generator=gen)) if c["local"] else (-1, -1)
    slopes = torch.rand(B, H, generator=gen) * 0.3 if c["alibi"] else None
    cos = sin = None
    if rot:
        angle = torch.rand(cap, rot // 2, generator=gen) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)  # in the input dtype, as flash-attn's test

    # the reference cache after the append, rotary as complex multiplication
    rows = bidx.long() if bidx is not None else torch.arange(B)
    k_ref, v_ref = kc[rows].double(), vc[rows].double()
    q_ref = q.double()
    pos_new = sl.long()[:, None] + torch.arange(sn)
    kn_ref = kn.double()
    if rot:
        kn_ref = _rotary64(kn_ref, cos, sin, pos_new, c["interleaved"])
        qpos = sl.long()[:, None] + (torch.arange(Sq) if local_or_causal else torch.zeros(Sq, dtype=torch.long))
        q_ref = _rotary64(q_ref, cos, sin, qpos, c["interleaved"])
    if sn:
        k_ref[torch.arange(B)[:, None], pos_new] = kn_ref
        v_ref[torch.arange(B)[:, None], pos_new] = vn.double()
    end = sl.long() + sn
    start = lp.long() if lp is not None else torch.zeros(B, dtype=torch.long)
    j = torch.arange(cap)
    qpos_abs = end[:, None] - Sq + torch.arange(Sq)  # [B, Sq]
    rel = qpos_abs[:, :, None] - j  # [B, Sq, cap]
    allowed = ((j >= start[:, None, None]) & (j < end[:, None, None])).expand(B, Sq, cap).clone()
    left, right = window
    if c["causal"]:
        right = 0
    if right >= 0:
        allowed &= rel >= -right
    if left >= 0:
        allowed &= rel <= left
    want = _attend(q_ref.to(device), k_ref.to(device), v_ref.to(device), allowed.to(device), rel.to(device),
                   softcap=0.0, slopes=None if slopes is None else slopes.to(device), ct=torch.float64).cpu()
    pt = _attend(q_ref.to(dtype).to(device), k_ref.to(dtype).to(device), v_ref.to(dtype).to(device),
                 allowed.to(device), rel.to(device), softcap=0.0,
                 slopes=None if slopes is None else slopes.to(device), ct=dtype).cpu()

    kc_d, vc_d = kc.to(device, dtype), vc.to(device, dtype)
    table = None
    if c["page"]:
        page, per = c["page"], cap // c["page"]
        n_pages = per * B * 3
        perm = torch.randperm(n_pages, generator=gen)[: B * per]
        table = perm.view(B, per).to(torch.int32)
        kp = torch.zeros(n_pages, page, Hk, D, dtype=dtype)
        vp = torch.zeros_like(kp)
        kp[table.long()] = kc.to(dtype).view(B, per, page, Hk, D)
        vp[table.long()] = vc.to(dtype).view(B, per, page, Hk, D)
        kc_d, vc_d, table = kp.to(device), vp.to(device), table.to(device)
    out = sparseflash.flash_attn_with_kvcache(
        q.to(device, dtype), kc_d, vc_d, kn.to(device, dtype) if sn else None, vn.to(device, dtype) if sn else None,
        rotary_cos=None if cos is None else cos.to(device), rotary_sin=None if sin is None else sin.to(device),
        cache_seqlens=sl.to(device), cache_batch_idx=None if bidx is None else bidx.to(device),
        cache_leftpad=None if lp is None else lp.to(device), block_table=table, causal=c["causal"],
        window_size=torch.tensor(window), rotary_interleaved=c["interleaved"],
        alibi_slopes=None if slopes is None else slopes.to(device), num_splits=c["num_splits"])
    mult = KVCACHE_ALIBI_MULT if c["alibi"] else KVCACHE_MULT
    assert_within_torch_error(_case_id(c), out.cpu().float(), pt.float(), want, dtype, mult)
    # the cache rows now hold what the reference appended (rotary in the input dtype: within its rounding)
    got_k = kc_d[table.long()].flatten(1, 2).cpu() if table is not None else kc_d.cpu()[rows]
    torch.testing.assert_close(got_k.double(), k_ref, atol=2e-2, rtol=1e-2)


def _rotary64(x, cos, sin, pos, interleaved):
    r = 2 * cos.shape[1]
    xr = x[..., :r]
    z = torch.complex(xr[..., 0::2], xr[..., 1::2]) if interleaved else torch.complex(xr[..., : r // 2], xr[..., r // 2:])
    z = z * torch.complex(cos[pos].double(), sin[pos].double())[:, :, None]
    parts = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((parts, x[..., r:]), -1)
