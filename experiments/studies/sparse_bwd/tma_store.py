"""The decided design's first two steps for the one-pass Hopper backward, measured against today's:
dK/dV stored through the dQ staging buffers with TMA (`bwd_variants.TMA_DKDV`) and the next key
tile's K/V loaded under the current tile's last steps (`bwd_variants.PREFETCH_KV`).

    python -m sparseflash.experiments.studies.sparse_bwd.tma_store --out DIR     (an H100/H200, ~3 min)
    python -m sparseflash.experiments.studies.sparse_bwd.tma_store --compile-only [--dump DIR] [--baseline DIR]

GPU run. Variants (the study copy patched in, MODE "on"): ``onepass`` (today's kernel, knobs
off), ``tma`` (TMA_DKDV), ``tma_prefetch`` (TMA_DKDV + PREFETCH_KV). First, per head dim, each
variant's dq/dk/dv at a small size (2K tokens, 2 heads, balanced columns and random rows, causal
dense) against the float64 reference: its error must be at most twice that of PyTorch's own
attention in bf16 (plus 1e-3); then, per case (16K tokens, 16 heads, bf16, K = 1, 4, 13, 32 q
blocks in every key column or in every query row), against the production kernel's gradients of
the same call: dK and dV within one bf16 ulp of their largest entry (the same sums in the same
order; whether they are bitwise equal is recorded), dQ within two (its float32 sums add in
arrival order). A variant that fails either check prints FAIL and is not timed. Times: one
backward call (`launch.bwd` with the arguments the real fwd+bwd passed it), CUDA-graph replays.
Writes DIR/tma_store.csv (one row per case x variant) and DIR/tma_store.json (environment, rows,
checks), prints a table last.

Compile-only (no GPU): builds the study copy for sm_90 for d 64 and 128 x dense, causal +
key_lengths, block lists of 128 and 256 (causal), exact bits (128; 256 causal + key_lengths) x the
knobs off, TMA_DKDV, PREFETCH_KV and both, on a GQA shape (4 q heads, 2 kv heads) whose CTAs take
several key tiles each (so the tile loop is compiled, not specialised away), and checks what each
knob must show in the PTX: TMA_DKDV two TMA stores (dK, dV) per consumer warpgroup and no more
shared memory; PREFETCH_KV at d=64 a second K/V pair (+32 KB), at d=128 the loader's V load before
its wait for K's release (the order of the TMA loads by descriptor); every build within the 227 KB
of an sm_90 CTA. ``--dump DIR`` writes each build's PTX (line records removed, as
`one_interface.ptx_same` does); ``--baseline DIR`` compares the knobs-off builds with a dump made
the same way from an earlier commit (exit 1 when one differs).
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

VARIANTS = {"onepass": {}, "tma": dict(TMA_DKDV=True), "tma_prefetch": dict(TMA_DKDV=True, PREFETCH_KV=True)}
COMPILE_VARIANTS = {"off": {}, "tma": dict(TMA_DKDV=True), "prefetch": dict(PREFETCH_KV=True),
                    "tma_prefetch": dict(TMA_DKDV=True, PREFETCH_KV=True)}
KS = (1, 4, 13, 32)
MASKS = ("balanced", "rows")
SMEM_LIMIT = 227 * 1024  # an sm_90 CTA's shared memory
# (label, dense, causal, key_lengths, mask block, exact bits): compile_check's cases
CASES = [("dense", True, False, False, 128, False), ("causal+keylen", True, True, True, 128, False),
         ("sparse128", False, False, False, 128, False), ("sparse256 causal", False, True, False, 256, False),
         ("exact128", False, False, False, 128, True), ("exact256 causal+keylen", False, True, True, 256, True)]


# ----------------------------------------------------------------------------- compile-only (CPU)
def compile_build(head_dim: int, case: tuple, knobs: dict, seq: int = 1000):
    """The CompiledKernel of the study copy with ``knobs`` for one backward call of ``case``
    (`CASES`), compiled for sm_90 without a GPU: 1 batch, 4 q heads, 2 kv heads, 4 SMs (so each
    CTA walks several key tiles and the tile loop is not specialised away)."""
    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.experiments.studies.sparse_bwd.bwd_variants import routed
    from sparseflash.flash.launch import hopper_bwd
    from sparseflash.patterns import random as random_mask

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: gluon kernels only compile; unset it")
    _, dense, causal, keylen, block, exact = case
    B, H, Hk, N, D = 1, 4, 2, seq, head_dim
    q, o, do = (torch.empty(B, H, N, D, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.empty(B, Hk, N, D, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(B, H, N)
    q_idx, bq, ex = None, None, None
    if exact:
        from sparseflash.flash.operands import ExactTiles
        from sparseflash.mask import BlockMask

        m = BlockMask.from_fn(lambda b, h, i, j: (i - j).abs() < max(2, N // 3), N, block_size=block)
        bits, index = m.exact_bits("cpu"), m.index("cpu")
        q_idx, bq = index.q_idx, block
        ex = ExactTiles((bits.bits, bits.kv_tile, bits.q_tile))
    elif not dense:
        q_idx, bq = random_mask(N, 3, block_size=block, heads=H, seed=0, device="cpu").index("cpu").q_idx, block
    kl = torch.full((B,), N - 5, dtype=torch.int32) if keylen else None
    with routed("on", **knobs):
        got = compile_launches(lambda: hopper_bwd(do, q, k, v, o, lse, None, q_idx, kl, D ** -0.5, causal, bq, bq,
                                                  num_sms=4, exact=ex))
    if "hopper_bwd_kernel" not in got:
        raise RuntimeError("the compile hook was not called (kernel already in the cache?)")
    return got["hopper_bwd_kernel"]


def _param_of_register(ptx: str) -> dict:
    """{%rd register: kernel parameter index} for the registers holding a parameter's address
    (`mov.b32 %r, ..._param_N` -> `cvt.u64.u32 %rd, %r` -> `cvta.param.u64 %rd', %rd`)."""
    movs = dict(re.findall(r"mov\.b32\s+(%r\d+),\s+\w+_param_(\d+);", ptx))
    cvts = {d: movs[s] for d, s in re.findall(r"cvt\.u64\.u32\s+(%rd\d+),\s+(%r\d+);", ptx) if s in movs}
    return {d: int(cvts[s]) for d, s in re.findall(r"cvta\.param\.u64\s+(%rd\d+),\s+(%rd\d+);", ptx) if s in cvts}


def load_events(ptx: str) -> list:
    """The PTX's TMA loads and mbarrier waits in text order: ("load", which descriptor: its rank
    among the kernel's parameters that TMA loads read, 0 Q, 1 K, 2 V, ...) and ("wait",). The
    loader warp's K and V loads show in it whether V is loaded before the wait for K's release."""
    regs = _param_of_register(ptx)
    rank = {p: i for i, p in enumerate(sorted(set(regs.values())))}
    out = []
    for line in ptx.splitlines():
        if "mbarrier.try_wait" in line:
            out.append(("wait",))
        m = re.search(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global\S*\s+\[[^\]]+\],\s+\[(%rd\d+),", line)
        if m:
            out.append(("load", rank.get(regs.get(m.group(1)), -1)))
    return out


def kv_order(ptx: str) -> str:
    """How the first tile's K (descriptor 1) and V (2) loads are issued: "K V" (one after the
    other, today's), "V wait K" (V, then a wait, then K: PREFETCH_KV with one buffer), ..."""
    ev = [e for e in load_events(ptx) if e[0] == "wait" or e[1] in (1, 2)]
    first = next((i for i, e in enumerate(ev) if e[0] == "load"), None)
    if first is None:
        return ""
    words, last = [], None
    for e in ev[first:]:
        w = "wait" if e[0] == "wait" else ("K" if e[1] == 1 else "V")
        if w != last:
            words.append(w)
        last = w
        if words.count("K") and words.count("V"):
            break
    return " ".join(words)


def check_build(d: int, variant: str, r: dict, off: dict | None) -> list[str]:
    """What is wrong with build ``r`` (`gluon_report` plus ``kv_order``) of ``variant`` against the
    knobs-off build ``off`` of the same case; [] when it shows what the knobs must."""
    bad = []
    if not 0 < r["shared"] <= SMEM_LIMIT:
        bad.append(f"shared {r['shared']} over {SMEM_LIMIT}")
    knobs = COMPILE_VARIANTS[variant]
    want_stores = 4 if knobs.get("TMA_DKDV") else 0  # dK and dV in each of the two consumer warpgroups
    if r["tma_stores"] != want_stores:
        bad.append(f"{r['tma_stores']} TMA stores, expected {want_stores}")
    if off is None:
        return bad
    # PREFETCH_KV with one K/V buffer: K is loaded from two places (in the walk after the first
    # STAGES steps' Q/dO, or after a shorter walk), 2 instructions each (two 64-column boxes)
    split = bool(knobs.get("PREFETCH_KV")) and d > 64
    if r["wgmma"] != off["wgmma"] or r["tma_loads"] != off["tma_loads"] + 2 * split:
        bad.append(f"wgmma {r['wgmma']} or TMA loads {r['tma_loads']} changed")
    # TMA_DKDV: each consumer waits for both staging buffers (2 x 2), the reducer hands one back at
    # a tile's end (+1 arrive); PREFETCH_KV with one K/V buffer: the loader waits for V's release
    # and for K's at a second place (+2), each consumer hands V back in its walk or at the tile's
    # end (2 x 2 arrives)
    want = (off["mbarrier_waits"] + 4 * bool(knobs.get("TMA_DKDV")) + 2 * split,
            off["mbarrier_arrives"] + bool(knobs.get("TMA_DKDV")) + 4 * split)
    if (r["mbarrier_waits"], r["mbarrier_arrives"]) != want:
        bad.append(f"mbarrier waits/arrives {r['mbarrier_waits']}/{r['mbarrier_arrives']}, "
                   f"expected {want[0]}/{want[1]}")
    extra = r["shared"] - off["shared"]
    kv_pair = 2 * 128 * d * 2  # another K and V tile, bf16
    if knobs.get("PREFETCH_KV") and d <= 64:
        if not kv_pair - 64 <= extra <= kv_pair + 64:
            bad.append(f"shared +{extra} B, expected a second K/V pair (+{kv_pair})")
    elif extra > 64:
        bad.append(f"shared +{extra} B")
    if knobs.get("PREFETCH_KV") and d > 64 and r["kv_order"] != "V wait K":
        bad.append(f"loader issues {r['kv_order']!r}, expected 'V wait K'")
    if not knobs.get("PREFETCH_KV") and r["kv_order"] != "K V":
        bad.append(f"loader issues {r['kv_order']!r}, expected 'K V'")
    return bad


def compile_only(head_dims, dump=None, baseline=None, cases=None, variants=tuple(COMPILE_VARIANTS)) -> int:
    from sparseflash.experiments.bench.inspect_kernels import gluon_report
    from sparseflash.experiments.studies.one_interface.ptx_same import normalised

    ok = True
    rows = []
    for d in head_dims:
        for case in CASES:
            if cases and case[0] not in cases:
                continue
            off = None
            for variant, knobs in COMPILE_VARIANTS.items():
                if variant not in variants:
                    continue
                ck = compile_build(d, case, knobs)
                ptx = ck.asm["ptx"]
                r = dict(gluon_report(ck), kv_order=kv_order(ptx))
                bad = check_build(d, variant, r, off)
                name = f"bwd-d{d}-{case[0].replace(' ', '_')}-{variant}.ptx"
                if dump:
                    Path(dump).mkdir(parents=True, exist_ok=True)
                    Path(dump, name).write_text(normalised(ptx))
                if variant == "off":
                    off = r
                    if baseline:
                        old = Path(baseline, name)
                        if not old.exists() or old.read_text() != normalised(ptx):
                            bad.append(f"PTX differs from {old}")
                ok &= not bad
                rows.append(dict(head_dim=d, case=case[0], variant=variant, **r, problems="; ".join(bad)))
                print(f"d={d:3d} {case[0]:22s} {variant:12s} {'ok  ' if not bad else 'FAIL'} shared={r['shared']} "
                      f"stack={r['stack']} tma_loads={r['tma_loads']} tma_stores={r['tma_stores']} "
                      f"waits={r['mbarrier_waits']} arrives={r['mbarrier_arrives']} kv={r['kv_order']!r}"
                      + (f"  {'; '.join(bad)}" if bad else ""), flush=True)
    if dump:
        Path(dump, "builds.json").write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


# ----------------------------------------------------------------------------- the GPU run
def _grads(a, kw, variant: str | None):
    """(dq, dk, dv) of `launch.bwd` on captured arguments: the study copy with ``variant``'s knobs,
    or the production kernel (None), both with MODE "on"."""
    from sparseflash.experiments.studies.sparse_bwd import bwd_variants as bv
    from sparseflash.flash import launch
    from sparseflash.flash.hopper import backward as production

    if variant is None:
        saved, calls = (production.MODE, production.bwd), []

        def spy(*args, **kwargs):
            calls.append(1)
            return saved[1](*args, **kwargs)
        production.MODE, production.bwd = "on", spy
        try:
            out = [t.clone() for t in launch.bwd(*a, **kw)]
        finally:
            production.MODE, production.bwd = saved
        if not calls:
            raise RuntimeError("the production one-pass kernel did not run this call: nothing to compare with")
        return out
    bv.last_launch.clear()
    with bv.routed("on", **VARIANTS[variant]):
        out = [t.clone() for t in launch.bwd(*a, **kw)]
        ran = dict(bv.last_launch)
    want = VARIANTS[variant]
    if ran.get("TMA_DKDV") != bool(want.get("TMA_DKDV")) or ran.get("PREFETCH_KV") != bool(want.get("PREFETCH_KV")):
        raise RuntimeError(f"{variant}: the kernel ran with {ran}, not as named")
    return out


def against_production(got, ref) -> tuple[bool, dict]:
    """Everything finite; dK and dV within one bf16 ulp of their largest entry (the same sums in
    the same order: expected equal, ``dk_equal``/``dv_equal`` say whether they are), dQ within two
    (its float32 sums add in arrival order)."""
    names = ("dq", "dk", "dv")
    diff = {n: float((x.float() - y.float()).abs().max()) for n, x, y in zip(names, got, ref)}
    top = {n: float(y.float().abs().max()) for n, y in zip(names, ref)}
    finite = all(bool(torch.isfinite(t).all()) for t in got)
    ok = finite and all(diff[n] <= (2 if n == "dq" else 1) * 2.0 ** -7 * top[n] for n in names)
    return ok, dict(finite=finite, dk_equal=diff["dk"] == 0.0, dv_equal=diff["dv"] == 0.0,
                    **{f"{n}_maxdiff": v for n, v in diff.items()})


def reference_check(d: int, variants) -> dict:
    """{variant: (ok, detail)} at a small size against the float64 reference: each gradient's
    largest error at most twice that of the same computation in bf16 (`reference.attention` with
    compute_dtype bf16, as the tests bound the kernels), plus 1e-3."""
    import sparseflash
    from sparseflash import reference
    from sparseflash.experiments.studies.sparse_bwd import bwd_variants as bv
    from sparseflash.experiments.studies.sparse_bwd.decompose import column_mask

    n, h = 2048, 2
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    cases = [("balanced K=3", column_mask(n, 3, h), False), ("rows K=3", column_mask(n, 3, h, rows=True), False),
             ("causal dense", None, True)]

    def grads(fn, dtype):
        ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*ts), ts, do.to(dtype))

    out = {name: (True, {}) for name in variants}
    for label, mask, causal in cases:
        r64 = grads(lambda a, b, c: reference.attention(a, b, c, mask=mask, causal=causal), torch.float64)
        r16 = grads(lambda a, b, c: reference.attention(a, b, c, mask=mask, causal=causal,
                                                        compute_dtype=torch.bfloat16), torch.bfloat16)
        bound = [2 * float((x.double() - y).abs().max()) + 1e-3 for x, y in zip(r16, r64)]
        for name in variants:
            prev_ok, detail = out[name]
            bv.last_launch.clear()
            try:
                with bv.routed("on", **VARIANTS[name]):
                    got = grads(lambda a, b, c: sparseflash.attention(a, b, c, mask=mask, causal=causal),
                                torch.bfloat16)
            except Exception as e:  # noqa: BLE001 - a variant that does not build or run fails; the others go on
                detail[label] = dict(error=f"{type(e).__name__}: {e}"[:2000])
                out[name] = (False, detail)
                continue
            if not bv.last_launch:
                detail[label] = dict(error="the call did not run the study copy")
                out[name] = (False, detail)
                continue
            err = [float((x.double() - y).abs().max()) for x, y in zip(got, r64)]
            ok = all(e <= b for e, b in zip(err, bound)) and all(bool(torch.isfinite(t).all()) for t in got)
            detail[label] = dict(err=err, bound=bound)
            out[name] = (prev_ok and ok, detail)
    return out


def _capture(n: int, d: int, k: int, rows: bool):
    """(args, kwargs) of `launch.bwd` in one fwd+bwd at 16 heads (`decompose.captured`)."""
    from sparseflash.experiments.studies.sparse_bwd.decompose import captured

    return captured(n, d, k, rows=rows)


def _time(name: str, a, kw) -> float:
    """GPU ms of one `launch.bwd` call with variant ``name``, CUDA-graph replays."""
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.sparse_bwd import bwd_variants as bv
    from sparseflash.flash import launch

    with bv.routed("on", **VARIANTS[name]):
        return graph_ms(lambda: launch.bwd(*a, **kw))


def measure(n: int, d: int, k: int, mask: str, variants, failed: set) -> list[dict]:
    """One row per variant for one case: time, or FAIL (and no time) when a check fails."""
    a, kw = _capture(n, d, k, mask == "rows")
    ref = _grads(a, kw, None)
    rows = []
    for name in variants:
        row = dict(seq=n, head_dim=d, blocks=k, mask=mask, variant=name)
        if name in failed:
            row.update(status="FAIL (float64 reference check)")
            rows.append(row)
            continue
        try:
            ok, detail = against_production(_grads(a, kw, name), ref)
        except Exception as e:  # noqa: BLE001 - a variant that does not build or run fails; the others go on
            ok, detail = False, dict(error=f"{type(e).__name__}: {e}"[:300])
        row.update(detail)
        if not ok:
            row.update(status="FAIL (against the production kernel)")
        else:
            row.update(status="ok", ms=_time(name, a, kw))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.sparse_bwd.tma_store",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for tma_store.csv / .json (the GPU run)")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[64, 128])
    ap.add_argument("--ks", type=int, nargs="+", default=list(KS))
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--compile-only", action="store_true", help="no GPU: build every knob for sm_90 and check the PTX")
    ap.add_argument("--dump", default=None, help="(compile-only) write each build's PTX here")
    ap.add_argument("--baseline", default=None, help="(compile-only) compare the knobs-off PTX with this dump")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c[0] for c in CASES], help="(compile-only)")
    ap.add_argument("--compile-variants", nargs="+", default=list(COMPILE_VARIANTS), choices=list(COMPILE_VARIANTS),
                    help="(compile-only) which builds; 'off' alone also compiles a copy without the knobs")
    args = ap.parse_args(argv)
    if any(k < 1 or k > args.seq // 128 for k in args.ks):
        ap.error(f"--ks: blocks a column must be 1 .. {args.seq // 128} (seq / 128)")
    if args.compile_only:
        return compile_only(args.head_dims, args.dump, args.baseline, args.cases, args.compile_variants)
    if args.out is None:
        ap.error("--out DIR is required for the GPU run")
    problem = _gpu_problem()
    if problem:
        ap.error(problem)
    from sparseflash.flash import fast, tiles

    saved = fast.ENABLED, tiles.TMA_MODE
    fast.ENABLED, tiles.TMA_MODE = False, "on"  # (the one-pass kernel's launch route, as decompose runs it)
    try:
        return _run(args)
    finally:
        fast.ENABLED, tiles.TMA_MODE = saved


def _gpu_problem() -> str | None:
    """Why this machine cannot run the measurement, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (or --compile-only)"
    from sparseflash.flash.hopper.common import GLUON_ERROR

    if GLUON_ERROR is not None or torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU with Gluon (this: {torch.cuda.get_device_name()}, {GLUON_ERROR or 'gluon ok'})"
    return None


def _run(args) -> int:
    from sparseflash.experiments.bench.results import environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    checks, rows = {}, []
    for d in args.head_dims:
        res = reference_check(d, args.variants)
        checks[d] = {name: dict(ok=ok, detail=detail) for name, (ok, detail) in res.items()}
        failed = {name for name, (ok, _) in res.items() if not ok}
        for name, (ok, detail) in res.items():
            print(f"d={d} {name:13s} float64 check {'ok' if ok else 'FAIL'}", json.dumps(detail) if not ok else "",
                  flush=True)
        for mask in args.masks:
            for k in args.ks:
                rows += measure(args.seq, d, k, mask, args.variants, failed)
                print("  ".join(f"{r['variant']}={r.get('ms', float('nan')):.3f}" if r["status"] == "ok"
                                else f"{r['variant']}={r['status']}" for r in rows[-len(args.variants):]),
                      f"(d={d} {mask} K={k})", flush=True)
                fields = ["seq", "head_dim", "blocks", "mask", "variant", "status", "ms", "finite", "dq_maxdiff",
                          "dk_maxdiff", "dv_maxdiff", "dk_equal", "dv_equal", "error"]
                with open(out / "tma_store.csv", "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=fields + list(env))
                    w.writeheader()
                    w.writerows({**env, **r} for r in rows)
    (out / "tma_store.json").write_text(json.dumps(dict(env=env, checks=checks, rows=rows), indent=1, default=str))
    print("\n d  mask      K  " + "  ".join(f"{v:>12s}" for v in args.variants) + "   (ms, one backward)")
    for d in args.head_dims:
        for mask in args.masks:
            for k in args.ks:
                got = {r["variant"]: r for r in rows if (r["head_dim"], r["mask"], r["blocks"]) == (d, mask, k)}
                cells = [f"{got[v]['ms']:12.3f}" if got[v]["status"] == "ok" else f"{'FAIL':>12s}"
                         for v in args.variants]
                base = got.get("onepass", {}).get("ms")
                gain = [f"{v} {base / got[v]['ms']:.2f}x" for v in args.variants
                        if v != "onepass" and base and got[v].get("ms")]  # speed-up over today's
                print(f"{d:3d} {mask:9s} {k:3d}  " + "  ".join(cells) + ("   " + ", ".join(gain) if gain else ""))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_command(main))
