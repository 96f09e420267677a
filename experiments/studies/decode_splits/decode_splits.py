"""Dense decode at large batch: which split count, key tile, warps and pipeline depth read the cache fastest.

    python -m sparseflash.experiments.studies.decode_splits.decode_splits --out DIR

One query token (bf16, d 128, GQA 32/8) against dense caches where the default launch reached 86-88%
of the copy bandwidth and FlexAttention 97-100% (B64 x 4K/16K), and two reference points (B16 x 16K,
B1 x 256K). For each point: `flash_attn_with_kvcache` under every combination of ``num_splits``
(0 = the default's pick), the split kernel's ``num_warps``, ``num_stages`` and key tile
(`sparseflash.flash.decode.OVERRIDES`), beside SDPA and compiled Flex on the same cache; GPU time
from CUDA-graph replays (the decode bench's timer) and the bandwidth each reaches (K and V bytes
read / time). Writes DIR/decode_splits.csv, .json and .png (``--plot DIR`` redraws the figure from
DIR/decode_splits.json); prints each point's best settings last.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

POINTS = [(64, 4096), (64, 16384), (16, 16384), (1, 262144)]
SPLITS = [0, 1, 2, 4]
WARPS = [4, 8]
STAGES = [2, 3, 4]
TILES = [64, 128]


def plot(folder: Path) -> Path:
    """DIR/decode_splits.png: per point, our GPU time under each setting (sorted; the default and the
    two-stage one-split setting marked) against SDPA's and Flex's."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure, suptitle

    rows = json.loads((folder / "decode_splits.json").read_text())["rows"]
    meta = json.loads((folder / "decode_splits.json").read_text())["meta"]
    points = sorted({(r["batch"], r["cache_len"]) for r in rows}, key=lambda p: (-p[0], p[1]))
    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 3.6), squeeze=False)
    for ax, (B, N) in zip(axes[0], points):
        pr = [r for r in rows if (r["batch"], r["cache_len"]) == (B, N) and r["status"] == "ok"]
        ours = sorted((r for r in pr if r["provider"] == "sparseflash"), key=lambda r: r["ms"])
        if not ours:
            ax.set_title(f"B{B} x {N // 1024}K: no setting ran", fontsize=10)
            continue
        colors = ["tab:red" if (r["num_splits"], r["num_warps"], r["num_stages"], r["block_n"]) == (0, 4, 3, 64)
                  else "tab:green" if (r["num_splits"], r["num_warps"], r["num_stages"], r["block_n"]) == (0, 4, 2, 64)
                  else "0.7" for r in ours]
        ax.bar(range(len(ours)), [r["ms"] for r in ours], color=colors, width=0.9)
        for prov, style in (("sdpa", "-"), ("flex", "--")):
            ms = [r["ms"] for r in pr if r["provider"] == prov]
            if ms and ms[0] < 1.6 * ours[0]["ms"]:
                ax.axhline(ms[0], color="k", ls=style, lw=1, label=f"{prov} {ms[0]:.3f}")
            elif ms:  # off the axis: named in the legend
                ax.plot([], [], color="k", ls=style, lw=1, label=f"{prov} {ms[0]:.3f} (off the axis)")
        ax.set_ylim(0, 1.6 * ours[0]["ms"])
        ax.set_title(f"B{B} x {N // 1024}K", fontsize=10)
        ax.set_xlabel("settings, fastest first")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("GPU ms per call")
    suptitle(fig, "decode settings (red: the old default, 3 stages; green: 2 stages, the default's split count: "
                  f"the new default where that count is 1, at B64), {meta['commit']}",
             [dict(device_name=meta["device_name"], device=meta["device"])])
    return save_figure(fig, folder / "decode_splits.png", dpi=110)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.decode_splits.decode_splits",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the results (required unless --plot)")
    ap.add_argument("--plot", metavar="DIR", help="only redraw DIR/decode_splits.png from DIR/decode_splits.json")
    ap.add_argument("--quick", action="store_true", help="one small point, two settings (a CPU check of the script)")
    ap.add_argument("--points", default=None, help="BxN points, comma-separated (default: "
                    + ",".join(f"{b}x{n}" for b, n in POINTS) + ")")
    ints = dict(type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--splits", default=SPLITS, help=f"num_splits values (0: the default's pick; default {SPLITS})", **ints)
    ap.add_argument("--warps", default=WARPS, help=f"num_warps values (default {WARPS})", **ints)
    ap.add_argument("--stages", default=STAGES, help=f"num_stages values (default {STAGES})", **ints)
    ap.add_argument("--tiles", default=TILES, help=f"key tiles (default {TILES})", **ints)
    ap.add_argument("--no-flex", action="store_true", help="leave compiled FlexAttention out (SDPA stays)")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if not args.out:
        ap.error("--out is required")
    import torch.nn.functional as F

    import sparseflash
    from sparseflash.experiments.bench.decode import _time_ms
    from sparseflash.experiments.bench.results import environment, write_tidy
    from sparseflash.flash import decode

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H, Hk, D, dtype = 32, 8, 128, torch.bfloat16
    points = POINTS
    if args.points:
        try:
            points = [tuple(int(x) for x in p.lower().split("x")) for p in args.points.split(",")]
        except ValueError:
            ap.error(f"--points takes BxN points like 1x16384,4x16384, got {args.points!r}")
        if any(len(p) != 2 or min(p) < 1 for p in points):
            ap.error(f"--points takes BxN points with B, N >= 1, got {args.points!r}")
    settings = list(itertools.product(args.splits, args.warps, args.stages, args.tiles))
    if args.quick:
        points, settings, H, Hk, D = [(2, 256)], [(0, 4, 3, 64), (2, 4, 2, 32)], 4, 2, 16
    flex = None
    if dev.type == "cuda" and not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for B, N in points:
        g = torch.Generator(device=dev).manual_seed(B * N)
        q = torch.randn(B, 1, H, D, generator=g, device=dev, dtype=dtype)
        k = torch.randn(B, N, Hk, D, generator=g, device=dev, dtype=dtype)
        v = torch.randn(B, N, Hk, D, generator=g, device=dev, dtype=dtype)
        lens = torch.full((B,), N, dtype=torch.int32, device=dev)
        nbytes = 2 * B * N * Hk * D * 2
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        want = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True).transpose(1, 2)

        def add(provider, fn, **setting):
            try:
                err = (fn().float() - want).abs().max().item()
                ms = _time_ms(fn, dev)
                rows.append(dict(batch=B, cache_len=N, provider=provider, ms=ms, gb_per_s=nbytes / ms / 1e6,
                                 max_err=err, status="ok", **setting))
            except Exception as e:  # a setting that cannot run (e.g. shared memory) gives a row that says why
                rows.append(dict(batch=B, cache_len=N, provider=provider, ms=float("nan"), gb_per_s=float("nan"),
                                 max_err=float("nan"), status=f"error: {type(e).__name__}: {str(e)[:100]}", **setting))
            r = rows[-1]
            print(f"B{B:<3} N{N:<7} {provider:<12} {str(setting):<60} {r['ms']:.4f} ms {r['gb_per_s']:7.0f} GB/s "
                  f"{r['status']}", flush=True)

        if dev.type == "cuda":
            add("sdpa", lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2))
            if flex is not None:
                add("flex", lambda: flex(qt, kt, vt, enable_gqa=True).transpose(1, 2))
        for splits, warps, stages, tile in settings:
            decode.OVERRIDES.update(num_warps=warps, num_stages=stages, block_n=tile)
            try:
                add("sparseflash", lambda: sparseflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                                                 num_splits=splits),
                    num_splits=splits, num_warps=warps, num_stages=stages, block_n=tile)
            finally:
                decode.OVERRIDES.clear()
        del q, k, v, qt, kt, vt
    out = Path(args.out)
    write_tidy(rows, dict(bench="decode_splits", **environment(dev)), out, "decode_splits",
               "sparseflash.decode_splits/1")
    plot(out)
    print(f"\n{'point':<12} {'sdpa':>8} {'flex':>8} {'old dflt':>8} {'best':>8}  best setting (old default: 3 stages)")
    for B, N in points:
        pr = [r for r in rows if (r["batch"], r["cache_len"]) == (B, N) and r["status"] == "ok"]
        ms = {p: min((r["ms"] for r in pr if r["provider"] == p), default=float("nan")) for p in ("sdpa", "flex")}
        ours = [r for r in pr if r["provider"] == "sparseflash"]
        dflt = [r["ms"] for r in ours if (r["num_splits"], r["num_warps"], r["num_stages"], r["block_n"]) == (0, 4, 3, 64)]
        best = min(ours, key=lambda r: r["ms"]) if ours else None
        print(f"B{B}xN{N:<7} {ms['sdpa']:8.4f} {ms['flex']:8.4f} {dflt[0] if dflt else float('nan'):8.4f} "
              f"{best['ms'] if best else float('nan'):8.4f}  "
              + (f"splits {best['num_splits']} warps {best['num_warps']} stages {best['num_stages']} "
                 f"tile {best['block_n']}" if best else "-"))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
