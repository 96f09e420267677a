"""Search kernel tile configs on a GPU: each of fwd, dK/dV and dQ alone, dense and block-sparse.

    python -m sparseflash.experiments.bench.tune_tiles --out DIR [--seq-lens 4096] [--head-dims 64 128]
        [--densities 1 0.1] [--kinds fwd dkdv dq] [--jobs 16] [--sdpa]

For every kernel, head_dim, sequence length and density (1: dense, mask=None; below 1: a
`random` mask with round(density * blocks) of the 128-blocks per row) it times each candidate config of the
kernel alone, in GPU time (``do_bench_cudagraph``: replays of a CUDA graph, no host overhead),
on bf16 [B, 16, N, D] with B*N = 16K tokens. Effective TFLOP/s count only computed blocks. All
variants are compiled first in ``--jobs`` processes in parallel (Triton's on-disk cache then
serves the timing process), so a full search fits in one short GPU session. Writes
DIR/tune_tiles.json and prints the best config per setting; launch.py's defaults come from these
results (experiments/studies/kernel-tuning/results/).
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command

# (block_m, block_n, num_warps, num_stages[, maxnreg]); fwd/dq: block_m = q tile held, block_n = k
# tile streamed; dkdv: block_n = k tile held, block_m = q tile streamed. A register cap (maxnreg)
# lets more programs share an SM, which hides the per-program start and end of short rows.
FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
       (64, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3),
       (64, 64, 4, 2, 168), (64, 64, 4, 3, 168), (64, 32, 4, 3, 168), (64, 64, 4, 3, 128)]
DKDV = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2),
        (128, 128, 8, 2), (16, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 2),
        (64, 64, 4, 2, 168), (32, 64, 4, 3, 128),
        # q_rows: S and dP as [queries, keys] tiles (the forward's orientation, so dropout bits need no shuffle)
        (128, 64, 8, 2, None, True), (128, 64, 8, 3, None, True), (64, 64, 4, 3, None, True),
        (64, 64, 4, 2, None, True), (128, 32, 4, 3, None, True), (64, 32, 4, 3, None, True)]
DQ = [(128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2),
      (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 4, 2, 168), (64, 32, 4, 3, 128)]
CONFIGS = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}


CONFIG_FORMAT = "M,N,WARPS,STAGES[,MAXNREG[,Q_ROWS]]"


def parse_config(spec: str) -> tuple:
    """CONFIG_FORMAT -> a TileConfig tuple (empty MAXNREG: no cap; Q_ROWS 0/1)."""
    c = tuple(int(x) if x else None for x in spec.split(","))
    if not 4 <= len(c) <= 6 or None in c[:4]:
        raise ValueError(f"a tile config is {CONFIG_FORMAT} (4 to 6 fields), got {spec!r}")
    if len(c) > 5:
        c = c[:5] + (bool(c[5]),)
    return c


MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}  # per tile pair: fwd S, PV; dK/dV S, dV, dP, dK; dQ S, dP, dQ


def _setting(kind, D, N, bpr, heads, batch, device, dtype=torch.bfloat16, seed=0, dropout=0.0):
    """Inputs and a zero-argument call running one kernel (with its current tile config)."""
    from sparseflash.flash import launch
    from sparseflash.patterns import random as random_mask

    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(batch, heads, N, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    scale = 1 / math.sqrt(D)
    if bpr:
        mask = random_mask(N, bpr, seed=seed, device=device)
        idx = mask.index(device)
        kv_idx, q_idx, mb = idx.kv_idx, idx.q_idx, 128
        pairs = mask.attended_pairs()
    else:
        kv_idx = q_idx = mb = None
        pairs = N * N
    flops = 2 * MATMULS[kind] * batch * heads * float(pairs) * D
    from sparseflash.dropout import draw_rng

    rng = draw_rng(device, torch.Generator(device=device).manual_seed(seed))
    fwd = lambda: launch.fwd(q, k, v, kv_idx, None, scale, False, mb, mb, dropout, rng)  # noqa: E731
    if kind == "fwd":
        return fwd, flops
    o, lse = fwd()
    delta = torch.empty_like(lse)
    bargs = (do, q, k, v, lse, delta, None, scale, False, mb, mb, dropout, rng)
    launch.bwd_dq(*bargs, kv_idx, o=o)  # fills delta
    if kind == "dkdv":
        return (lambda: launch.bwd_dkdv(*bargs, q_idx)), flops
    return (lambda: launch.bwd_dq(*bargs, kv_idx, o=o)), flops


def _compile_one(spec):
    """Worker: compile one (kind, D, N, blocks per row, config) by running it once at batch 1."""
    kind, D, N, bpr, cfg, dropout = spec
    try:
        from sparseflash.flash.tiles import TileConfig, tile_config

        with tile_config(**{kind: TileConfig(*cfg)}):
            call, _ = _setting(kind, D, N, bpr, heads=16, batch=1, device="cuda", dropout=dropout)  # as timed
            call()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # out of resources etc.: reported again by the timing pass
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _precompile(specs, jobs):
    if jobs <= 1:
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        failed = sum(r is not None for r in ex.map(_compile_one, specs))
    print(f"compiled {len(specs)} variants in {jobs} processes in {time.time() - t0:.0f} s ({failed} failed)", flush=True)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.tune_tiles", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tune_out")
    ap.add_argument("--seq-lens", type=positive_int, nargs="+", default=[4096])
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.1],
                    help="1: dense (mask=None); below 1: random mask with that share of 128-blocks per row")
    ap.add_argument("--kinds", nargs="+", default=["fwd", "dkdv", "dq"], choices=["fwd", "dkdv", "dq"])
    ap.add_argument("--heads", type=positive_int, default=16)
    ap.add_argument("--jobs", type=positive_int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--rep", type=float, default=60.0, help="do_bench_cudagraph budget per config, ms")
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0], help="dropout_p values to time each config at")
    ap.add_argument("--configs", nargs="+", default=None, metavar=CONFIG_FORMAT,
                    help="time only these configs (an empty MAXNREG: none; Q_ROWS 1: dK/dV in the forward's "
                         "orientation)")
    ap.add_argument("--sdpa", action="store_true", help="also time SDPA flash / cuDNN dense (fwd, bwd)")
    args = ap.parse_args(argv)
    check_output_dir(args.out)
    import triton
    import triton.testing

    from sparseflash.flash.tiles import TileConfig, tile_config

    os.makedirs(args.out, exist_ok=True)
    if args.configs:
        cfgs = [parse_config(c) for c in args.configs]
        for kind in args.kinds:
            CONFIGS[kind] = cfgs
    settings = [(kind, D, N, 0 if d >= 1 else max(1, round(d * math.ceil(N / 128))))
                for kind in args.kinds for D in args.head_dims for N in args.seq_lens for d in args.densities]
    settings = [s + (p,) for s in settings for p in args.dropout]
    _precompile([(kind, D, N, bpr, cfg, p) for kind, D, N, bpr, p in settings for cfg in CONFIGS[kind]], args.jobs)
    rows = []
    for kind, D, N, bpr, p in settings:
        B = max(1, 16384 // N)
        for cfg in CONFIGS[kind]:
            r = dict(kind=kind, D=D, N=N, blocks_per_row=bpr, dropout_p=p, cfg=cfg)
            try:
                with tile_config(**{kind: TileConfig(*cfg)}):
                    call, flops = _setting(kind, D, N, bpr, args.heads, B, "cuda", dropout=p)
                    call()
                    s = torch.cuda.Stream()
                    with torch.cuda.stream(s):
                        ms = float(triton.testing.do_bench_cudagraph(call, rep=args.rep, return_mode="median"))
                r.update(ms=ms, tflops=flops / ms * 1e-9)
            except Exception as e:
                r.update(ms=None, error=str(e).splitlines()[0][:160])
            rows.append(r)
            print(f"{kind:5s} D={D:3d} N={N:5d} bpr={bpr:2d} p={p:g} {cfg}: "
                  + (f"{r['ms']:.4f} ms {r['tflops']:.0f} TF" if r["ms"] else r["error"]), flush=True)
            torch.cuda.empty_cache()
    if args.sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for D in args.head_dims:
            for N in args.seq_lens:
                B = max(1, 16384 // N)
                q, k, v, do = (torch.randn(B, args.heads, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 4 * B * args.heads * N * N * D
                for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                            f = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)  # noqa: E731
                            ms_f = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
                            out = f()
                            ms_b = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True),
                                                           warmup=25, rep=100, return_mode="median")
                        rows.append(dict(kind=name, D=D, N=N, fwd_ms=ms_f, bwd_ms=ms_b, fwd_tflops=flops / ms_f * 1e-9,
                                         bwd_tflops=2.5 * flops / ms_b * 1e-9))
                        print(f"{name} D={D} N={N}: fwd {ms_f:.3f} ms, bwd {ms_b:.3f} ms", flush=True)
                    except Exception as e:
                        print(f"{name}: unavailable ({e})")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("SPARSEFLASH_COMMIT", "unknown"), date=time.strftime("%Y-%m-%d"),
                timing="do_bench_cudagraph median (GPU time)", heads=args.heads, tokens=16384)
    with open(os.path.join(args.out, "tune_tiles.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"\nbest per setting ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; GPU time):")
    for kind, D, N, bpr, p in settings:
        ok = [r for r in rows if (r["kind"], r["D"], r["N"], r["blocks_per_row"], r["dropout_p"]) == (kind, D, N, bpr, p)
              and r.get("ms")]
        if ok:
            b = min(ok, key=lambda r: r["ms"])
            print(f"  {kind:5s} D={D:3d} N={N:5d} bpr={bpr:2d} p={p:g} best {b['cfg']} {b['ms']:.4f} ms {b['tflops']:.0f} TF")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
