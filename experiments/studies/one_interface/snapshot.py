"""Bitwise before/after check for refactors of the host side: the outputs, LSE and gradients of a
fixed set of calls (every kernel family and feature the default paths take), saved from one commit
and compared with another's.

    python -m sparseflash.experiments.studies.one_interface.snapshot save OUT.pt [attention|decode]
    python -m sparseflash.experiments.studies.one_interface.snapshot compare BEFORE.pt AFTER.pt

``save`` runs both families unless one is named: attention (`sparseflash.attention`, forward and
backward) and decode (`flash_attn_with_kvcache`: the output, LSE and the cache after the append of
each `_decode_cases` call: dense and paged caches, block lists, GQA, softcap, ALiBi, windows, key
lengths or the whole cache, leftpad, batch index, one split or several, query chunks).

On a GPU the calls run the default dispatch (Hopper kernels on sm_90 where they take a call, the
portable ones elsewhere, the short path on repeated calls); on a CPU they run under the Triton
interpreter at the same shapes divided down. The Hopper backward adds dQ in arrival order, so its
dQ is compared within a bound (``DQ_RTOL``) rather than bitwise; everything else bitwise.
"""

from __future__ import annotations

import sys
import zlib

import torch

DQ_RTOL = 2e-2  # dQ of the Hopper backward: float32 sums in arrival order, then one bf16 rounding


def _cases(device: str):
    from sparseflash.mask import BlockMask
    from sparseflash.patterns import butterfly, local

    big = 4096 if device == "cuda" else 256
    small = 1000 if device == "cuda" else 200
    win = big // 8
    return [  # (name, (B, Hq, Hkv, Nq, Nk, D), dtype, kwargs, backward repeats)
        ("dense-d128-hopper", (1, 16, 16, big, big, 128), torch.bfloat16, {}),
        ("dense-d64-causal-hopper", (1, 16, 16, big, big, 64), torch.bfloat16, dict(causal=True)),
        ("dense-small-portable", (2, 4, 2, small, small + 37, 64), torch.float16, dict(causal=True)),
        ("keylen-gqa", (2, 8, 2, big, big, 128), torch.bfloat16, dict(key_lengths=[big, big // 3])),
        ("butterfly", (1, 8, 8, big, big, 128), torch.bfloat16, dict(mask=butterfly(big))),
        ("local-causal", (1, 8, 8, big, big, 64), torch.bfloat16, dict(mask=local(big, window=win), causal=True)),
        ("exact-window", (1, 4, 4, big, big, 128), torch.bfloat16,
         dict(mask=BlockMask.from_fn(lambda b, h, i, j: (i - j).abs() <= win // 3, big, block_size=128))),
        ("dropout", (2, 4, 4, small, small, 64), torch.bfloat16, dict(dropout_p=0.1)),
        ("segments", (2, 4, 4, small, small, 64), torch.bfloat16, dict(segment_ids="docs")),
        ("softcap-alibi", (1, 4, 4, small, small, 80), torch.float16, dict(softcap=20.0, alibi_slopes="slopes")),
        ("fp32-d40", (1, 2, 2, small, small, 40), torch.float32, dict(causal=True)),
        ("repeat-fast-path", (4, 4, 4, 1024 if device == "cuda" else 128, 1024 if device == "cuda" else 128, 64),
         torch.bfloat16, dict(repeat=3)),
    ]


def run(device: str) -> dict:
    import sparseflash

    out = {}
    for name, (B, Hq, Hkv, Nq, Nk, D), dtype, kw in _cases(device):
        kw = dict(kw)
        repeat = kw.pop("repeat", 1)
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        q = torch.randn(B, Hq, Nq, D, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(B, Hkv, Nk, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        do = torch.randn(B, Hq, Nq, D, device=device, dtype=dtype, generator=g)
        if "key_lengths" in kw:
            kw["key_lengths"] = torch.tensor(kw["key_lengths"], device=device, dtype=torch.int32)
        if kw.get("segment_ids") == "docs":
            cuts = torch.tensor([0, Nq // 5, Nq // 5 + 3, Nq // 2, Nq], device=device)
            ids = torch.bucketize(torch.arange(Nq, device=device), cuts[1:-1], right=True).to(torch.int32)
            kw["segment_ids"] = ids.expand(B, Nq).contiguous()
        if kw.get("alibi_slopes") == "slopes":
            kw["alibi_slopes"] = torch.linspace(0.01, 0.3, Hq, device=device, dtype=torch.float32)
        if "mask" in kw:
            kw["mask"] = kw["mask"].to(device) if hasattr(kw["mask"], "to") else kw["mask"]
        for _ in range(repeat):
            torch.manual_seed(7)
            ts = [t.clone().requires_grad_() for t in (q, k, v)]
            if repeat > 1:
                o = sparseflash.attention(*ts, **kw)
                lse = torch.zeros(1)
            else:
                o, lse = sparseflash.attention(*ts, return_lse=True, **kw)
            dq, dk, dv = torch.autograd.grad(o, ts, do)
        out[name] = {n: t.detach().cpu() for n, t in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))}
        print(f"{name:24s} done", flush=True)
    return out


def _decode_cases(device: str):
    big = 4096 if device == "cuda" else 256
    return [  # (name, (B, seq_q, H, Hk, cache, D), dtype, kwargs); "lens" the cache's lengths before the call
        ("kv-dense-split", (2, 1, 8, 2, big, 128), torch.bfloat16, dict(lens="tensor", num_splits=3, lse=True)),
        ("kv-direct-append-causal", (2, 1, 8, 2, big, 64), torch.float16,
         dict(lens="tensor", new=1, causal=True, num_splits=1)),
        ("kv-paged-softcap-alibi", (2, 1, 8, 2, big, 64), torch.bfloat16,
         dict(lens="tensor", page=16, softcap=20.0, alibi="heads", causal=True, num_splits=2, lse=True)),
        ("kv-paged-whole-window", (2, 1, 8, 2, big, 128), torch.bfloat16,
         dict(page=32, window_size=(16, 0), num_splits=1)),
        ("kv-leftpad-batchidx-alibi2d", (2, 2, 8, 2, big, 64), torch.bfloat16,
         dict(lens="tensor", leftpad=True, batch_idx=True, alibi="batch", window_size=(-1, 2), new=2,
              num_splits=2, lse=True)),
        ("kv-mask-split", (2, 1, 8, 2, big, 64), torch.bfloat16,
         dict(lens="tensor", mask=True, num_splits=2, lse=True)),
        ("kv-mask-direct-left", (2, 1, 8, 2, big, 128), torch.bfloat16,
         dict(lens="int", mask=True, window_size=(big // 3, -1), num_splits=1, lse=True)),
        ("kv-chunks-causal", (2, 40, 8, 2, big, 64), torch.bfloat16,
         dict(lens="tensor", causal=True, num_splits=2, lse=True)),
        ("kv-fp32-mha-auto", (2, 1, 4, 4, big, 64), torch.float32, dict(lens="tensor", lse=True)),
    ]


def run_decode(device: str) -> dict:
    import sparseflash
    from sparseflash.mask import BlockMask

    out = {}
    for name, (B, SQ, H, Hk, N, D), dtype, kw in _decode_cases(device):
        kw = dict(kw)
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        q = torch.randn(B, SQ, H, D, device=device, dtype=dtype, generator=g)
        rows = B + 1 if kw.pop("batch_idx", False) else B
        kc, vc = (torch.randn(rows, N, Hk, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        new = kw.pop("new", 0)
        if new:
            kw["k"], kw["v"] = (torch.randn(B, new, Hk, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        lens = torch.tensor([N - new - N // 3, N - new], device=device, dtype=torch.int32)
        how = kw.pop("lens", None)
        if how == "tensor":
            kw["cache_seqlens"] = lens
        elif how == "int":
            kw["cache_seqlens"] = int(lens[0])
        if kw.pop("leftpad", False):
            kw["cache_leftpad"] = torch.tensor([5, N // 4], device=device, dtype=torch.int32)
        if rows > B:
            kw["cache_batch_idx"] = torch.tensor([2, 0], device=device, dtype=torch.int32)
        alibi = kw.pop("alibi", None)
        if alibi is not None:
            slopes = torch.linspace(0.01, 0.3, H, device=device, dtype=torch.float32)
            kw["alibi_slopes"] = slopes if alibi == "heads" else torch.stack([slopes, slopes.flip(0)])
        if kw.pop("mask", False):
            nb = N // 64
            lay = torch.rand(B, Hk, 1, nb, generator=torch.Generator().manual_seed(3)) < 0.5
            lay[..., -1] = True
            kw["mask"] = BlockMask.from_layout(lay, block_size=(16, 64), seq_q=SQ, seq_k=N)
        page = kw.pop("page", None)
        if page is not None:
            per = N // page
            table = torch.randperm(B * per + 2, generator=torch.Generator().manual_seed(5))[:B * per].view(B, per)
            pk, pv = (torch.zeros(B * per + 2, page, Hk, D, device=device, dtype=dtype) for _ in range(2))
            for b in range(B):
                for i in range(per):
                    pk[table[b, i]], pv[table[b, i]] = kc[b, i * page:(i + 1) * page], vc[b, i * page:(i + 1) * page]
            kc, vc = pk, pv
            kw["block_table"] = table.to(device=device, dtype=torch.int32)
        lse = kw.pop("lse", False)
        got = sparseflash.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=lse, **kw)
        o, lse = got if lse else (got, torch.zeros(1))
        out[name] = {n: t.detach().cpu() for n, t in zip(("o", "lse", "k_cache", "v_cache"), (o, lse, kc, vc))}
        print(f"{name:24s} done", flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    bad = 0
    print(f"{'case':24s} {'tensor':6s} {'equal':6s} max|diff|")
    for name in before:
        for t in before[name]:
            a, b = before[name][t], after.get(name, {}).get(t)
            if b is None:
                print(f"{name:24s} {t:6s} MISSING")
                bad += 1
                continue
            eq = torch.equal(a, b)
            diff = float((a.double() - b.double()).abs().nan_to_num(0).max()) if a.numel() else 0.0
            ok = eq or (t == "dq" and diff <= DQ_RTOL * float(a.double().abs().max()))
            bad += not ok
            print(f"{name:24s} {t:6s} {str(eq):6s} {diff:.3g}{'' if ok else '  <-- differs'}")
    print(f"{bad} tensors differ beyond the rule")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save"] and len(argv) in (2, 3) and argv[2:] in ([], ["attention"], ["decode"]):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        which = argv[2] if len(argv) == 3 else "all"
        got = run(device) if which in ("all", "attention") else {}
        if which in ("all", "decode"):
            got.update(run_decode(device))
        torch.save(got, argv[1])
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        return compare(torch.load(argv[1], weights_only=True), torch.load(argv[2], weights_only=True))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
