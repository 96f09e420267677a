"""Pointer loads against TMA descriptor loads, side by side (issue 3)

    python -m sparseflash.experiments.studies.tma.tma_ab [--out DIR] [--head-dims 64 128] [--seqs 4096 16384]

Times `sparseflash.attention` in GPU time (CUDA-graph replays), the forward alone and forward +
backward, with ``tiles.TMA_MODE = "off"`` (pointer loads in every kernel, at their tiles),
``"on"`` (every kernel's tiles through tensor descriptors, at the TMA tiles where TMA was
measured faster) and ``"auto"`` (the default: `tiles.tma_plan`'s rules, e.g. pointer loads
for calls under ``tiles.TMA_MIN_WORK``), on the same inputs
and masks; it stops if an "on" call ran a kernel on pointer loads.
bf16, 16 heads, batch * seq = 16K tokens, head_dim 64 and 128, seq 4K and 16K, dense and a
random block mask at density ~0.1 (3 of 32 blocks of 128 per row at 4K, 13 of 128 at 16K).
Checks the two agree (max |diff| of the output and of dQ, dK, dV). Prints a table; with --out
writes tma_ab.json. (Until 953b949 it compared the forward only, "off" against "auto".)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["main"]


def _takes_tma(tiles, fn) -> list[bool]:
    """Each kernel launch's choice of TMA (the launcher's own decision) while ``fn()`` runs."""
    taken, real = [], tiles.tma_args

    def spy(*a):
        args, tma = real(*a)
        taken.append(tma)
        return args, tma

    tiles.tma_args = spy
    try:
        fn()
    finally:
        tiles.tma_args = real
    return taken


def _ab(args, rows, tiles, sparseflash, random_mask, graph_ms):
    """Time every setting both ways, appending rows."""
    for n in args.seqs:
        nb = n // 128
        sparse = random_mask(n, max(1, round(0.1 * nb)), block_size=128, seed=0, device="cuda")
        for d in args.head_dims:
            torch.manual_seed(0)
            q, k, v = (torch.randn(max(1, 16384 // n), 16, n, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            do = torch.randn_like(q)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def fwd_bwd(mask):
                o = sparseflash.attention(qg, kg, vg, mask=mask)
                return o, torch.autograd.grad(o, (qg, kg, vg), do)

            for name, mask in (("dense", None), ("random 0.1", sparse)):
                t, out = {}, {}
                for mode in ("off", "on", "auto"):
                    tiles.TMA_MODE = mode
                    o, grads = fwd_bwd(mask)
                    out[mode] = (o.detach(), *grads)
                    if mode == "on" and _takes_tma(tiles, lambda: fwd_bwd(mask)) != [True] * 3:
                        raise SystemExit(f"a kernel did not take the TMA path at N={n}, d={d} ({name})")
                    with torch.no_grad():
                        t[mode, "fwd"] = graph_ms(lambda: sparseflash.attention(q, k, v, mask=mask))
                    t[mode, "fwd+bwd"] = graph_ms(lambda: fwd_bwd(mask))
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out["off"], out["on"]))
                for what in ("fwd", "fwd+bwd"):
                    row = dict(seq=n, head_dim=d, mask=name, density=1.0 if mask is None else mask.density(),
                               what=what, pointer_ms=t["off", what], tma_ms=t["on", what], auto_ms=t["auto", what],
                               speedup=t["off", what] / t["on", what], max_diff=diff)
                    rows.append(row)
                    print(f"N={n:5d} d={d:3d} {name:10s} {what:7s} pointer {row['pointer_ms']:.4f} ms  "
                          f"tma {row['tma_ms']:.4f} ms  x{row['speedup']:.3f}  default (auto) {row['auto_ms']:.4f} ms  "
                          f"max |diff| {diff:.1e}", flush=True)


def main(argv=None) -> int:
    import sparseflash
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.flash import tiles
    from sparseflash.patterns import random as random_mask

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.tma.tma_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    saved = tiles.TMA_MODE
    # everything on a side stream: autograd runs the backward on its forward's stream, and one on
    # the legacy default stream cannot join the CUDA-graph capture (as in timing.measure)
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            _ab(args, rows, tiles, sparseflash, random_mask, graph_ms)
    finally:
        tiles.TMA_MODE = saved

    print("\nsparse rate as % of the dense rate at the same seq, head_dim and pass (the 80% bar):")
    for r in rows:
        if r["mask"] == "dense":
            continue
        dense = next(x for x in rows if x["mask"] == "dense"
                     and (x["seq"], x["head_dim"], x["what"]) == (r["seq"], r["head_dim"], r["what"]))
        pct = {key: 100 * dense[key] * r["density"] / r[key] for key in ("pointer_ms", "tma_ms", "auto_ms")}
        print(f"  N={r['seq']:5d} d={r['head_dim']:3d} {r['what']:7s} pointer {pct['pointer_ms']:.0f}%  "
              f"tma {pct['tma_ms']:.0f}%  default {pct['auto_ms']:.0f}%")
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tma_ab.json").write_text(json.dumps({"meta": environment(torch.device("cuda")), "rows": rows},
                                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
