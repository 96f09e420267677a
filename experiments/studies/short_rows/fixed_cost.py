"""Where the time goes at low density: a fixed cost per q-block row plus a cost per computed block.

    python -m sparseflash.experiments.studies.short_rows.fixed_cost RESULTS [RESULTS ...] [--out DIR]

RESULTS: `sparseflash bench sparsity` output (CSV/JSON files or their directories), ideally a
sweep of one pattern over many densities, e.g.

    sparseflash bench sparsity --pattern random --seq-len 4096 16384 --head-dim 64 128 \\
        --mode fwd bwd --providers sparseflash --cuda-graph \\
        --densities 1/32 2/32 3/32 4/32 6/32 8/32 12/32 16/32 1

For each (provider, pattern, shape, mode) it fits ``ms = fixed + per_block * blocks_per_row`` by
least squares over the sparse points (density below 1; blocks_per_row = rel_density x key blocks
per row), and reports the fixed part in units of blocks of work per row: the number of extra
blocks each row costs whatever its length. The share of the fitted block rate reached at
``blocks_per_row = n`` is then ``n / (n + fixed_blocks)``; issue 3's bar (80% of dense at
density ~0.1, 3 of 32 blocks at 4K) needs ``fixed_blocks <= 0.75``. Writes fixed_cost.json and
fixed_cost.png (time against blocks per row, measured points and the fitted lines).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["fit_fixed_cost", "main"]


def _key(r: dict) -> tuple:  # rows as load_results gives them (typed, from CSV or JSON)
    return r["provider"], r["pattern"], r["seq_len"], r["head_dim"], r["mode"], r["dtype"], bool(r["causal"])


def fit_fixed_cost(rows: list[dict], min_points: int = 3) -> list[dict]:
    """One fit per (provider, pattern, seq_len, head_dim, mode, dtype, causal) with at least
    ``min_points`` measured sparse points; dense rows of the group (rel_density 1) are kept as
    the reference rate but left out of the fit."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("status") != "ok" or r.get("pattern") == "dense":
            continue
        ms, rel, block = r.get("ms"), r.get("rel_density"), r.get("block_size")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (ms, rel)) or not block:
            continue
        groups[_key(r)].append(r)
    fits = []
    for key, g in sorted(groups.items()):
        provider, pattern, n, d, mode, dtype, causal = key
        kblocks = math.ceil(n / int(g[0]["block_size"]))
        pts = sorted((float(r["rel_density"]) * kblocks, float(r["ms"]), float(r["tflops"])) for r in g)
        sparse = [p for p in pts if p[0] < kblocks - 1e-9]
        if len(sparse) < min_points or len({round(x, 6) for x, _, _ in sparse}) < 2:
            continue
        xs, ys = [p[0] for p in sparse], [p[1] for p in sparse]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        per_block = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        fixed = my - per_block * mx
        full = [p for p in pts if p[0] >= kblocks - 1e-9]
        fits.append(dict(
            provider=provider, pattern=pattern, seq_len=n, head_dim=d, mode=mode, dtype=dtype, causal=causal,
            key_blocks=kblocks, fixed_ms=fixed, per_block_ms=per_block,
            fixed_blocks=fixed / per_block if per_block > 0 else float("nan"),
            max_rel_residual=max(abs(y - (fixed + per_block * x)) / y for x, y in zip(xs, ys)),
            points=[dict(blocks_per_row=x, ms=y, tflops=t) for x, y, t in pts],
            full_tflops=full[0][2] if full else None,
        ))
    return fits


def _plot(fits: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(f["seq_len"], f["head_dim"]) for f in fits})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 4.0), squeeze=False)
    for ax, (n, d) in zip(axes[0], shapes):
        for i, f in enumerate(f for f in fits if (f["seq_len"], f["head_dim"]) == (n, d)):
            c = plt.get_cmap("tab10")(i)
            xs = [p["blocks_per_row"] for p in f["points"]]
            ax.plot(xs, [p["ms"] for p in f["points"]], "o", color=c, ms=4)
            top = max(xs)
            ax.plot([0, top], [f["fixed_ms"], f["fixed_ms"] + f["per_block_ms"] * top], "-", color=c, lw=1,
                    label=f"{f['provider']} {f['pattern']} {f['mode']}: fixed = {f['fixed_blocks']:.1f} blocks")
        ax.set_title(f"N={n}, d={d}")
        ax.set_xlabel("computed key blocks per q-block row")
        ax.set_ylabel("ms")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("time = fixed cost per row + cost per block (least-squares fit over sparse points)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from sparseflash.experiments.bench.results import load_results

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.short_rows.fixed_cost", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench sparsity CSV/JSON files or directories")
    ap.add_argument("--out", default=None, help="write fixed_cost.json, fixed_cost.csv and fixed_cost.png here")
    ap.add_argument("--min-points", type=int, default=3)
    args = ap.parse_args(argv)
    rows, _ = load_results(args.results)
    fits = fit_fixed_cost(rows, args.min_points)
    if not fits:
        print("no group with enough sparse points to fit (need --min-points densities below 1)")
        return 1
    print(f"{'provider':>12s} {'pattern':>9s} {'N':>6s} {'d':>4s} {'mode':>6s} {'fixed ms':>9s} "
          f"{'ms/block':>9s} {'fixed blocks':>12s} {'max resid':>9s}")
    for f in fits:
        print(f"{f['provider']:>12s} {f['pattern']:>9s} {f['seq_len']:6d} {f['head_dim']:4d} {f['mode']:>6s} "
              f"{f['fixed_ms']:9.4f} {f['per_block_ms']:9.5f} {f['fixed_blocks']:12.2f} {f['max_rel_residual']:9.1%}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for f in fits:  # every fit says where and when its points ran
            group = [r for r in rows if all(r.get(k) == f[k] for k in ("provider", "pattern", "seq_len", "head_dim", "mode"))]
            for k in ("device_name", "torch", "triton", "sparseflash", "commit", "date"):
                f[k] = "; ".join(sorted({str(r[k]) for r in group if r.get(k) not in (None, "")}))
        (out / "fixed_cost.json").write_text(json.dumps({"sources": args.results, "fits": fits}, indent=1))
        with open(out / "fixed_cost.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=[k for k in fits[0] if k != "points"], extrasaction="ignore")
            w.writeheader()
            w.writerows(fits)
        _plot(fits, out / "fixed_cost.png")
        print(f"wrote {out / 'fixed_cost.json'} and {out / 'fixed_cost.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
