"""Is the fixed cost of short rows the block list or the row itself? (issue 3's 4K shortfall)

    python -m sparseflash.experiments.bench.short_rows [--out DIR]

Times, in GPU time (CUDA-graph replays), the same work three ways, for each head_dim and a few
row lengths (r key blocks of 128 per q-block row, 4K queries, batch 4, 16 heads, bf16):
- ``sparse``: a random block mask on 4K x 4K with r blocks per row (the kernel reads each row's
  list, then its K/V tiles);
- ``dense-short``: the dense kernel (no list) on 4K queries x r*128 keys: the same tiles per row;
- ``dense-full``: the dense kernel on 4K x 4K, whose rate is the reference.
If ``dense-short`` is as slow as ``sparse``, the fixed cost belongs to short rows themselves
(Q load, pipeline fill, epilogue), not to reading the list; if it is much faster, the list load
at the head of each program is what to hide. Forward and backward (backward alone, the forward
made outside the graph). Prints a table; with --out writes short_rows.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparseflash.experiments.bench.timing import graph_ms as _ms

__all__ = ["main"]


def _time(q, k, v, mask, mode: str) -> float:
    import sparseflash

    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                sparseflash.attention(q, k, v, mask=mask)

        return _ms(fwd)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # the forward on a side stream, so its backward can join the capture
        out = sparseflash.attention(q, k, v, mask=mask)
        do = torch.randn_like(out)
        s.synchronize()

        def bwd():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        return _ms(bwd)


def main(argv=None) -> int:
    from sparseflash.experiments.bench.results import environment
    from sparseflash.patterns import random as random_mask

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 3, 6, 12])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    B, H, N, blk = 4, 16, 4096, 128
    rows = []
    torch.manual_seed(0)
    for d in args.head_dims:
        mk = lambda n: torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
        q, kf, vf = mk(N), mk(N), mk(N)
        for mode in ("fwd", "bwd"):
            full = _time(q, kf, vf, None, mode)
            for r in args.blocks:
                mask = random_mask(N, r, block_size=blk, seed=r, device="cuda")
                ks, vs = mk(r * blk), mk(r * blk)
                t_sparse = _time(q, kf, vf, mask, mode)
                t_short = _time(q, ks, vs, None, mode)
                row = dict(head_dim=d, mode=mode, blocks_per_row=r, sparse_ms=t_sparse, dense_short_ms=t_short,
                           dense_full_ms=full, sparse_pct_of_full_rate=100 * full * r / (N // blk) / t_sparse,
                           short_pct_of_full_rate=100 * full * r / (N // blk) / t_short)
                rows.append(row)
                print(f"d={d:3d} {mode} r={r:2d}: sparse {t_sparse:.4f} ms ({row['sparse_pct_of_full_rate']:.0f}% "
                      f"of the dense rate), dense on {r * blk} keys {t_short:.4f} ms "
                      f"({row['short_pct_of_full_rate']:.0f}%), dense 4K {full:.4f} ms", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        env = environment(torch.device("cuda"))
        (out / "short_rows.json").write_text(json.dumps({"meta": env, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
