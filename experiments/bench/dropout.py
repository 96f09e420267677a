"""What attention dropout costs: sparseflash with dropout_p = 0.1 against no dropout.

    python -m sparseflash.experiments.bench.dropout --out DIR [--seq-lens 4096 16384] [--head-dims 64 128]
        [--cuda-graph]

Dense (mask=None) and block-sparse (butterfly; random at ~25%), forward and forward+backward,
beside the fused dropout of PyTorch's SDPA flash (FlashAttention-2) and cuDNN backends (dense),
bf16, 16 heads, batch*seq = 16K tokens, do_bench medians (CUDA events) on one input set, or with
``--cuda-graph`` medians of CUDA-graph replays (GPU time, no host cost: short calls are
host-bound in eager mode, which hides what dropout costs the kernels; each replay draws fresh
dropout bits, as in training). Writes DIR/dropout.csv and .json and prints a table with the overhead in percent.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import subprocess

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command


def _call(provider, q, k, v, mask, p):
    """A zero-argument attention call with dropout p: sparseflash, or SDPA pinned to one backend."""
    import sparseflash

    if provider == "sparseflash":
        return lambda: sparseflash.attention(q, k, v, mask=mask, dropout_p=p)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[provider]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)

    return run


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.dropout", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dropout_out")
    ap.add_argument("--seq-lens", type=positive_int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (GPU time) instead of eager calls")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dropout benchmark: needs a CUDA GPU (nothing measured)")
        return 0
    check_output_dir(args.out)
    import triton

    from sparseflash.patterns import butterfly, random

    def bench(fn):
        if not args.cuda_graph:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()  # compile outside the capture
        with torch.cuda.stream(torch.cuda.Stream()):  # graphs are captured off the default stream
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))

    commit = os.environ.get("SPARSEFLASH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    rows = []
    for N in args.seq_lens:
        B, H = max(1, 16384 // N), 16
        nb = math.ceil(N / 128)
        masks = {"dense": None, "butterfly": butterfly(N).to("cuda"),
                 "random-25%": random(N, max(1, nb // 4), heads=H, seed=0).to("cuda")}
        for D in args.head_dims:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            cases = [("sparseflash", name, mask) for name, mask in masks.items()]
            cases += [(prov, "dense", None) for prov in ("sdpa-flash", "sdpa-cudnn")]  # the fused dropout others have
            for prov, name, mask in cases:
                row = dict(provider=prov, seq_len=N, batch=B, heads=H, head_dim=D, mask=name,
                           density=1.0 if mask is None else round(mask.density(), 4), p=args.p,
                           timing="cuda-graph" if args.cuda_graph else "eager")
                try:
                    for p in (0.0, args.p):
                        fwd = _call(prov, q, k, v, mask, p)
                        with torch.no_grad():
                            row[f"fwd_ms_p{p}"] = bench(fwd)
                        row[f"fwdbwd_ms_p{p}"] = bench(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
                except Exception as e:  # a backend without dropout support on this GPU / build
                    print(f"{prov} N={N} D={D}: unavailable ({str(e).splitlines()[0][:100]})", flush=True)
                    continue
                for mode in ("fwd", "fwdbwd"):
                    row[f"{mode}_overhead_pct"] = 100 * (row[f"{mode}_ms_p{args.p}"] / row[f"{mode}_ms_p0.0"] - 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dtype="bf16",
                command="python -m sparseflash.experiments.bench.dropout " + " ".join(argv or []))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dropout.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "dropout.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(meta))
        w.writeheader()
        for r in rows:
            w.writerow({**r, **meta})
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, bf16, dropout p={args.p} vs 0; ms "
          f"({'GPU time, CUDA-graph replays' if args.cuda_graph else 'eager'})")
    print(f"{'provider':>11} {'N':>6} {'D':>4} {'mask':>11} {'dens':>6} {'fwd p=0':>8} {'fwd p':>8} {'+%':>6} {'fb p=0':>8} {'fb p':>8} {'+%':>6}")
    for r in rows:
        print(f"{r['provider']:>11} {r['seq_len']:6d} {r['head_dim']:4d} {r['mask']:>11} {r['density']:6.3f} {r['fwd_ms_p0.0']:8.3f} "
              f"{r[f'fwd_ms_p{args.p}']:8.3f} {r['fwd_overhead_pct']:6.1f} {r['fwdbwd_ms_p0.0']:8.3f} "
              f"{r[f'fwdbwd_ms_p{args.p}']:8.3f} {r['fwdbwd_overhead_pct']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
