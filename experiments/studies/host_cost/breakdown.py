"""Where the time goes: one setting's forward and backward, split into kernels and host overhead.

    python -m sparseflash.experiments.studies.host_cost.breakdown [--seq-len 4096] [--head-dim 64] [--densities 1 0.25 0.1]

For each density (a `random` mask with that many blocks per row, plus mask=None) it reports, in
ms: the eager call as a user makes it (do_bench), the same work replayed from a CUDA graph (no
host overhead: the GPU time), and each kernel's own time from the torch profiler. Eager minus
graph is what Python, autograd and kernel launches cost. Also times the sparse forward under a
few tile configs. Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import json
import math
import os

import torch

from sparseflash.cmdline import ArgumentParser, run_command


def _graph_ms(fn, bench):
    """do_bench of a CUDA-graph replay of ``fn`` (captured after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def _kernel_ms(fn, reps=20):
    """Mean GPU time per call of each kernel fn launches, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t > 0:
            out[evt.key[:60]] = t / reps / 1000
    return out


def main(argv=None) -> int:
    from sparseflash.experiments.bench.config import add_shape_args

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.host_cost.breakdown", description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.25, 0.1])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="also time the sparse forward under several tiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import triton

    import sparseflash
    from sparseflash.flash import launch
    from sparseflash.flash.tiles import TileConfig, tile_config
    from sparseflash.patterns import random as random_mask

    N, D, H = args.seq_len, args.head_dim, args.heads
    B = max(1, args.tokens // N)
    nb = math.ceil(N / 128)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    rows = []
    for dens in [None] + args.densities:
        mask = None if dens is None else random_mask(N, max(1, round(dens * nb)), heads=H, seed=0).to("cuda")
        if mask is not None:
            mask.index("cuda")
        fwd = lambda: sparseflash.attention(q, k, v, mask=mask, causal=args.causal)  # noqa: E731

        def fwdbwd():
            torch.autograd.grad(fwd(), (q, k, v), do)

        if mask is None:
            flops = 4 * B * H * D * N * N * (0.5 if args.causal else 1.0)
        else:  # attended pairs summed over the layout's slices, scaled to batch x heads
            slices = mask.layout.shape[0] * mask.layout.shape[1]
            flops = 4 * D * float(mask.attended_pairs(args.causal).sum()) * B * H / slices
        r = dict(density="dense" if dens is None else round(mask.density(), 4), B=B, H=H, N=N, D=D)
        with torch.no_grad():
            r["fwd_eager"] = bench(fwd)
            r["fwd_graph"] = _graph_ms(fwd, bench)
        r["fwdbwd_eager"] = bench(fwdbwd)
        r["fwdbwd_graph"] = _graph_ms(fwdbwd, bench)
        r["fwd_tflops_graph"] = flops / r["fwd_graph"] * 1e-9
        r["fwdbwd_tflops_graph"] = 3.5 * flops / r["fwdbwd_graph"] * 1e-9
        r["kernels"] = _kernel_ms(fwdbwd)
        if dens is not None and args.tiles:
            idx = mask.index("cuda")
            tiles = {}
            for cfg in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3)):
                with tile_config(fwd=TileConfig(*cfg)), torch.no_grad():
                    tiles[str(cfg)] = bench(lambda: launch.fwd(q, k, v, idx.kv_idx, None, D ** -0.5,
                                                               args.causal, 128, 128, 0.0, None))
            r["fwd_tiles"] = tiles
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
          f"B={B} H={H} N={N} D={D} causal={args.causal}; ms (graph = GPU time without host overhead)")
    print(f"{'density':>8} {'fwd eager':>10} {'fwd graph':>10} {'fb eager':>10} {'fb graph':>10} {'fwd TF':>7} {'fb TF':>7}")
    for r in rows:
        print(f"{str(r['density']):>8} {r['fwd_eager']:10.4f} {r['fwd_graph']:10.4f} {r['fwdbwd_eager']:10.4f} "
              f"{r['fwdbwd_graph']:10.4f} {r['fwd_tflops_graph']:7.0f} {r['fwdbwd_tflops_graph']:7.0f}")
        print("         kernels: " + ", ".join(f"{k.split('(')[0]} {v:.4f}" for k, v in r["kernels"].items()))
        if "fwd_tiles" in r:
            print("         fwd tiles: " + ", ".join(f"{k} {v:.4f}" for k, v in r["fwd_tiles"].items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "breakdown.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           causal=args.causal, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
