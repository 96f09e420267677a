"""The forward with and without TMA descriptor loads, side by side (issue 3)

    python -m sparseflash.experiments.bench.tma_ab [--out DIR]

Times `sparseflash.attention`'s forward in GPU time (CUDA-graph replays) with
``launch.TMA_MODE = "off"`` (pointer loads) and ``"auto"`` (Q, K and V through tensor
descriptors on sm_90+; at 0c3f1e8, the first measured version, K/V of the mask-free tiles only),
on the same inputs and masks, and stops if a TMA row did not take the descriptor path: bf16, 16 heads, batch * seq = 16K
tokens, head_dim 64 and 128, seq 4K and 16K, dense and a random block mask at density ~0.1
(3 of 32 blocks of 128 per row at 4K, 13 of 128 at 16K). Checks the two outputs agree (max |diff|).
Prints a table; with --out writes tma_ab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

__all__ = ["main"]


def _takes_tma(launch, q, k, v, mask) -> bool:
    """Whether a forward call on these inputs launches with TMA (the launcher's own decision)."""
    taken, real = [], launch._tma_args

    def spy(*a):
        args, tma = real(*a)
        taken.append(tma)
        return args, tma

    launch._tma_args = spy
    try:
        import sparseflash

        sparseflash.attention(q, k, v, mask=mask)
    finally:
        launch._tma_args = real
    return taken == [True]


def main(argv=None) -> int:
    import sparseflash
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.flash import launch
    from sparseflash.patterns import random as random_mask

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    saved = launch.TMA_MODE
    try:
        for n in args.seqs:
            nb = n // 128
            sparse = random_mask(n, max(1, round(0.1 * nb)), block_size=128, seed=0, device="cuda")
            for d in args.head_dims:
                torch.manual_seed(0)
                q, k, v = (torch.randn(max(1, 16384 // n), 16, n, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                for name, mask in (("dense", None), ("random 0.1", sparse)):
                    t, out = {}, {}
                    for mode in ("off", "auto"):
                        launch.TMA_MODE = mode
                        with torch.no_grad():
                            out[mode] = sparseflash.attention(q, k, v, mask=mask)
                            if mode == "auto" and not _takes_tma(launch, q, k, v, mask):
                                raise SystemExit(f"the TMA path was not taken at N={n}, d={d} ({name})")
                            t[mode] = graph_ms(lambda: sparseflash.attention(q, k, v, mask=mask))
                    row = dict(seq=n, head_dim=d, mask=name, density=1.0 if mask is None else mask.density(),
                               pointer_ms=t["off"], tma_ms=t["auto"], speedup=t["off"] / t["auto"],
                               max_diff=float((out["off"].float() - out["auto"].float()).abs().max()))
                    rows.append(row)
                    print(f"N={n:5d} d={d:3d} {name:10s} pointer {t['off']:.4f} ms  tma {t['auto']:.4f} ms  "
                          f"x{row['speedup']:.3f}  max |diff| {row['max_diff']:.1e}", flush=True)
    finally:
        launch.TMA_MODE = saved
    print("\nsparse rate as % of the dense rate at the same seq and head_dim (the 80% bar):")
    for r in rows:
        if r["mask"] == "dense":
            continue
        dense = next(x for x in rows if x["mask"] == "dense" and (x["seq"], x["head_dim"]) == (r["seq"], r["head_dim"]))
        for key in ("pointer_ms", "tma_ms"):
            pct = 100 * dense[key] * r["density"] / r[key]
            print(f"  N={r['seq']:5d} d={r['head_dim']:3d} {key[:-3]:7s}: {pct:.0f}%")
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tma_ab.json").write_text(json.dumps({"meta": environment(torch.device("cuda")), "rows": rows},
                                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
