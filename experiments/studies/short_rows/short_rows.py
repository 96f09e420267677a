"""Is the fixed cost of short rows the block list, the row itself, or ours? (issue 3's 4K shortfall)

    python -m sparseflash.experiments.studies.short_rows.short_rows [--providers ...] [--out DIR]

Times, in GPU time (CUDA-graph replays), the same work three ways, for each implementation, head_dim
and a few row lengths (r key blocks of 128 per q-block row, 4K queries, batch 4, 16 heads, bf16):
- ``sparse``: a random block mask on 4K x 4K with r blocks per row (sparseflash and FlexAttention,
  which read each row's block list, then its K/V tiles);
- ``dense-short``: the implementation's dense kernel on 4K queries x r*128 keys: the same tiles
  per row, with no list and contiguous K/V;
- ``row-keys``: its dense kernel with every q tile of 128 rows given its own r*128 keys (the batch
  is B*H*32 single-tile "sequences"): no q tile shares K/V with another;
- ``dense-full``: its dense kernel on 4K x 4K, whose rate is the reference.
A random block mask shares each key block among ~r q tiles of its head: more reuse than
``row-keys``, less than ``dense-short`` (all 32), so the two bracket what a block-sparse row could
do. Each rate is a share of the same implementation's own 4K x 4K rate, so SDPA flash
(FlashAttention-2) and cuDNN, which take no block mask, still say how much any kernel loses on
rows of r blocks. If ``dense-short`` is as slow as ``sparse``, the list is not the cost. (In the
backward, ``row-keys`` also makes every key column one q tile long: a low bound there.) Forward and backward (backward alone, the forward made outside the graph).
Prints a table; with --out writes short_rows.json and short_rows.png (redrawn from the JSON by
``--plot DIR``, any machine).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command
from sparseflash.experiments.bench.timing import graph_ms as _ms

__all__ = ["main", "plot", "IMPLEMENTATIONS"]

# implementation -> (provider of its dense kernel, provider of its block-sparse kernel or None)
IMPLEMENTATIONS = {
    "sparseflash": ("sparseflash-dense", "sparseflash"),
    "flex": ("flex-dense", "flex"),
    "sdpa-flash": ("sdpa-flash", None),
    "sdpa-cudnn": ("sdpa-cudnn", None),
}


def _time(provider_name: str, q, k, v, mask, mode: str) -> float:
    from sparseflash.experiments.bench.providers import PROVIDERS, Setting

    p = PROVIDERS[provider_name]
    B, H, N, d = q.shape
    s = Setting(q.device, q.dtype, B, H, N, d, False, mode, mask)
    if (why := p.check(s)) is not None:
        raise RuntimeError(f"{provider_name} cannot run here: {why}")
    ctx = p.prepare(s)
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                p.forward(ctx, s, q, k, v)

        return _ms(fwd)
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):  # the forward on a side stream, so its backward can join the capture
        out = p.forward(ctx, s, q, k, v)
        do = torch.randn_like(out)
        st.synchronize()

        def bwd():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        return _ms(bwd)


def plot(out_dir) -> Path:
    """short_rows.png in ``out_dir`` from its short_rows.json: one panel per head_dim and mode, each
    implementation's share of its own 4K x 4K rate against blocks per row, solid for block-sparse
    rows, dashed for its dense kernel on the same number of keys, dotted for the row-keys layout
    (rows measured before it existed have none); the 80% bar drawn across."""
    from sparseflash.experiments.bench.plots import _color, _grid, suptitle

    out_dir = Path(out_dir)
    data = json.loads((out_dir / "short_rows.json").read_text())
    rows, meta = data["rows"], data["meta"]
    panels = sorted({(r["head_dim"], r["mode"]) for r in rows}, key=lambda k: (k[1] != "fwd", k[0]))
    fig, axes = _grid(1, len(panels))
    for ax, (d, mode) in zip(axes[0], panels):
        for impl in dict.fromkeys(r["provider"] for r in rows):
            mine = sorted((r for r in rows if (r["provider"], r["head_dim"], r["mode"]) == (impl, d, mode)),
                          key=lambda r: r["blocks_per_row"])
            if not mine:
                continue
            x = [r["blocks_per_row"] for r in mine]
            color = _color(IMPLEMENTATIONS[impl][1] or IMPLEMENTATIONS[impl][0])
            ax.plot(x, [r["short_pct_of_full_rate"] for r in mine], "--o", color=color, ms=3,
                    label=f"{impl}, dense on r x 128 keys")
            if mine[0].get("row_keys_pct_of_full_rate") is not None:
                ax.plot(x, [r["row_keys_pct_of_full_rate"] for r in mine], ":^", color=color, ms=3,
                        label=f"{impl}, own r x 128 keys per q tile")
            if mine[0]["sparse_pct_of_full_rate"] is not None:
                ax.plot(x, [r["sparse_pct_of_full_rate"] for r in mine], "-s", color=color, ms=4,
                        label=f"{impl}, block-sparse (4K keys)")
        ax.axhline(80, color="gray", lw=0.8, ls=":")
        ax.set_title(f"d={d}, {'forward' if mode == 'fwd' else 'backward'}", fontsize=9)
        ax.set_xlabel("key blocks of 128 per q-block row (r)")
        ax.set_ylabel("% of its own 4K x 4K rate")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["blocks_per_row"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(20, 102)
    axes[0][0].legend(fontsize=6, loc="lower right")
    suptitle(fig, f"Short rows: rate against row length, 4K queries, B=4, H=16, bf16, GPU time "
                   f"(commit {meta.get('commit')})", [meta])
    path = out_dir / "short_rows.png"
    fig.savefig(path, dpi=130)
    return path


def main(argv=None) -> int:
    from sparseflash.experiments.bench.results import environment
    from sparseflash.patterns import random as random_mask

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.short_rows.short_rows", description=__doc__.splitlines()[0])
    ap.add_argument("--providers", nargs="+", default=["sparseflash", "sdpa-cudnn", "sdpa-flash", "flex"],
                    choices=list(IMPLEMENTATIONS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 12])
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", metavar="DIR", help="only redraw DIR/short_rows.png from DIR/short_rows.json")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    B, H, N, blk = 4, 16, 4096, 128
    rows = []
    torch.manual_seed(0)
    mk = lambda n, d: torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    inputs = {d: (mk(N, d), mk(N, d), mk(N, d), {r: (mk(r * blk, d), mk(r * blk, d)) for r in args.blocks})
              for d in args.head_dims}
    tiles = B * H * (N // blk)  # q tiles, each its own "sequence" in the row-keys layout
    mk_rows = lambda n, d: torch.randn(tiles, 1, n, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                       requires_grad=True)
    masks = {r: random_mask(N, r, block_size=blk, seed=r, device="cuda") for r in args.blocks}
    for impl in args.providers:  # FlexAttention last: it compiles once per shape and mode
        dense_p, sparse_p = IMPLEMENTATIONS[impl]
        for d in args.head_dims:
            q, kf, vf, shorts = inputs[d]
            for mode in args.modes:
                full = _time(dense_p, q, kf, vf, None, mode)
                for r in args.blocks:
                    share = lambda t: 100 * full * r / (N // blk) / t  # noqa: E731
                    t_short = _time(dense_p, q, *shorts[r], None, mode)
                    t_rows = _time(dense_p, mk_rows(blk, d), mk_rows(r * blk, d), mk_rows(r * blk, d), None, mode)
                    row = dict(provider=impl, head_dim=d, mode=mode, blocks_per_row=r, dense_full_ms=full,
                               dense_short_ms=t_short, short_pct_of_full_rate=share(t_short),
                               row_keys_ms=t_rows, row_keys_pct_of_full_rate=share(t_rows),
                               sparse_ms=None, sparse_pct_of_full_rate=None)
                    text = (f"dense on {r * blk} keys {t_short:.4f} ms ({row['short_pct_of_full_rate']:.0f}%), "
                            f"own keys per q tile {t_rows:.4f} ms ({row['row_keys_pct_of_full_rate']:.0f}%)")
                    if sparse_p is not None:
                        t_sparse = _time(sparse_p, q, kf, vf, masks[r], mode)
                        row.update(sparse_ms=t_sparse, sparse_pct_of_full_rate=share(t_sparse))
                        text = f"sparse {t_sparse:.4f} ms ({row['sparse_pct_of_full_rate']:.0f}%), " + text
                    rows.append(row)
                    print(f"{impl:11s} d={d:3d} {mode} r={r:2d}: {text}, dense 4K {full:.4f} ms", flush=True)
        if args.out:  # after each implementation, so a run cut short keeps what it measured
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            meta = environment(torch.device("cuda"))
            stamp = {k: meta.get(k) for k in ("device_name", "torch", "triton", "sparseflash", "commit", "date")}
            stamped = [dict(r, **stamp) for r in rows]  # every row says where and when it ran
            (out / "short_rows.json").write_text(json.dumps({"meta": meta, "rows": stamped}, indent=1, default=str))
            with open(out / "short_rows.csv", "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in stamped for k in r)))
                w.writeheader()
                w.writerows(stamped)
    print("\nshare of each implementation's own 4K x 4K rate (%), sparse / dense on r*128 keys / "
          "own r*128 keys per q tile:")
    for d in args.head_dims:
        for mode in args.modes:
            for r in args.blocks:
                cells = []
                for row in rows:
                    if (row["head_dim"], row["mode"], row["blocks_per_row"]) == (d, mode, r):
                        sp = "-" if row["sparse_pct_of_full_rate"] is None else f"{row['sparse_pct_of_full_rate']:.0f}"
                        cells.append(f"{row['provider']} {sp}/{row['short_pct_of_full_rate']:.0f}/"
                                     f"{row['row_keys_pct_of_full_rate']:.0f}")
                print(f"  d={d:3d} {mode:3s} r={r:2d}  " + "  ".join(cells))
    if args.out:
        print(plot(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
