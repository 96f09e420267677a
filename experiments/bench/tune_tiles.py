"""Search kernel tile configs on a GPU: each of fwd, dK/dV and dQ alone, per head_dim, beside SDPA.

    python -m sparseflash.experiments.bench.tune_tiles --out DIR [--seq-len 4096] [--head-dims 64 128]

Times each kernel with triton.testing.do_bench (median) on bf16 [B, 16, N, D] with B*N = 16K
tokens, dense non-causal and causal, writes DIR/tune_tiles.json and prints the best config per
kernel and head_dim; launch.py's defaults are set from these results.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
       (64, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4)]
DKDV = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2),
        (128, 128, 8, 2), (16, 128, 4, 3), (64, 128, 8, 3)]
DQ = [(128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2),
      (128, 128, 8, 2), (128, 64, 8, 3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tune_out")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    import triton

    from sparseflash.flash import launch
    from sparseflash.flash.launch import TileConfig, tile_config

    os.makedirs(args.out, exist_ok=True)
    N, H = args.seq_len, args.heads
    B = max(1, 16384 // N)
    rows = []
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for D in args.head_dims:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = 1 / math.sqrt(D)
        flops = 4 * B * H * N * N * D * (0.5 if args.causal else 1.0)
        o, lse = launch.fwd(q, k, v, None, None, None, scale, args.causal, None, None, 0.0, 0, 0)
        delta = launch.bwd_preprocess(o, do, lse, None)
        bargs = (do, q, k, v, lse, delta, None, scale, args.causal, None, None, 0.0, 0, 0)
        for kind, cfgs, f_mult, call in (
            ("fwd", FWD, 1.0, lambda: launch.fwd(q, k, v, None, None, None, scale, args.causal, None, None, 0.0, 0, 0)),
            ("dkdv", DKDV, 2.0, lambda: launch.bwd_dkdv(*bargs, None, None)),   # 4 matmuls: S recompute, dV, dP, dK
            ("dq", DQ, 1.5, lambda: launch.bwd_dq(*bargs, None, None)),          # 3 matmuls: S recompute, dP, dQ
        ):
            for cfg in cfgs:
                tc = TileConfig(*cfg)
                try:
                    with tile_config(**{kind: tc}):
                        ms = bench(call)
                    rows.append(dict(kind=kind, D=D, N=N, cfg=cfg, ms=ms, tflops=f_mult * flops / ms * 1e-9))  # executed FLOPs
                except Exception as e:  # out of resources etc.
                    rows.append(dict(kind=kind, D=D, N=N, cfg=cfg, ms=None, error=str(e).splitlines()[0][:120]))
                r = rows[-1]
                print(f"{kind:5s} D={D:3d} {cfg}: " + (f"{r['ms']:.3f} ms {r['tflops']:.0f} TF" if r["ms"] else r["error"]), flush=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=args.causal)  # noqa: E731
                    ms_f = bench(f)
                    out = f()
                    ms_b = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
                rows.append(dict(kind=name, D=D, N=N, fwd_ms=ms_f, bwd_ms=ms_b, fwd_tflops=flops / ms_f * 1e-9,
                                 bwd_tflops=2.5 * flops / ms_b * 1e-9))
                print(f"{name} D={D}: fwd {ms_f:.3f} ms ({flops / ms_f * 1e-9:.0f} TF), bwd {ms_b:.3f} ms "
                      f"({2.5 * flops / ms_b * 1e-9:.0f} TF)", flush=True)
            except Exception as e:
                print(f"{name}: unavailable ({e})")
    with open(os.path.join(args.out, "tune_tiles.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       causal=args.causal, rows=rows), f, indent=1)
    print("\nbest per kernel:")
    for D in args.head_dims:
        for kind in ("fwd", "dkdv", "dq"):
            ok = [r for r in rows if r["kind"] == kind and r["D"] == D and r.get("ms")]
            if ok:
                b = min(ok, key=lambda r: r["ms"])
                print(f"  {kind:5s} D={D:3d} best {b['cfg']} {b['ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
