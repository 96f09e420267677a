"""Where should the Hopper kernels start taking eager calls? (a GPU study, sm_90)

    python -m sparseflash.experiments.studies.hopper_threshold.threshold --out DIR [--head-dims 64 128]
        [--seqs 4096 16384] [--blocks 1 2 4 8 16 32] [--modes fwd fwdbwd]

Today the Hopper kernels take a call only where the launchers give it TMA descriptors
(`sparseflash.flash.dispatch`): `tiles.TMA_MODE` "auto" asks for an estimated forward work of at
least `tiles.TMA_MIN_WORK` FLOPs, a rule tuned for the portable kernels' descriptors, whose host
cost triton 3.6 pays per launch. Hopper calls also never take the short path (the fast path takes
no TMA plan), so below some size the portable kernels with the short path and their C++ launches
must win, and above it the Hopper kernels. This measures the two side by side on the same calls:

- ``auto``: the default dispatch (TMA_MODE "auto");
- ``hopper``: TMA_MODE "on", so the Hopper kernels take every call they can (block-sparse
  backward columns shorter than `hopper.backward.LIST_MIN_BLOCKS` still take the portable pair);
- ``portable``: TMA_MODE "off" (the portable kernels, the short path where it applies).

Calls: bf16, 16 heads, 16K tokens a batch (B = 16384 / N), random masks of ``--blocks`` 128-blocks
a row, and dense, for each head dim. Each row: eager ms (calls back to back, `bench.timing.stream_ms`:
host cost included where the host is slower) and GPU ms (CUDA-graph replays), the estimated work
(`flash.autograd.estimate_work`), and which kernels ran (the dispatch's answer for the call). The
answer the study looks for: the smallest work from which ``hopper`` beats ``portable`` eagerly, per
head dim and mode, against today's threshold. Writes DIR/threshold.csv and DIR/threshold.json and
prints the table last; about 3 minutes on an H200 at the defaults.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, positive_int, run_command

SETTINGS = {"auto": "auto", "hopper": "on", "portable": "off"}


def _which(q, k, v, mask, work: float) -> str:
    """The forward kernels the dispatch picks for this call under the current TMA_MODE."""
    from sparseflash.flash import dispatch

    bq = None if mask is None else mask.block_size[0]
    lay = dispatch.hopper_plan(q, k, v, bq, bq, work, scale=q.shape[-1] ** -0.5)
    return "hopper" if lay is not None else "portable"


def run(head_dims, seqs, blocks, modes, heads: int = 16, tokens: int = 16384, progress=print) -> list[dict]:
    import sparseflash
    from sparseflash.experiments.bench.timing import graph_ms, stream_ms
    from sparseflash.flash import tiles
    from sparseflash.flash.autograd import estimate_work
    from sparseflash.patterns import random as random_mask

    dev = torch.device("cuda")
    rows = []
    saved = tiles.TMA_MODE
    try:
        for d in head_dims:
            for n in seqs:
                b = max(1, tokens // n)
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v, do = (torch.randn(b, heads, n, d, device=dev, dtype=torch.bfloat16, generator=g)
                               for _ in range(4))
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                nb = math.ceil(n / 128)
                for kb in [None] + [x for x in blocks if x < nb]:
                    mask = None if kb is None else random_mask(n, kb, block_size=128, seed=0, device=dev)
                    density = 1.0 if kb is None else kb / nb
                    work = estimate_work(q, k, density)
                    for mode in modes:
                        for name, setting in SETTINGS.items():
                            tiles.TMA_MODE = setting
                            if mode == "fwd":
                                def step():
                                    with torch.no_grad():
                                        sparseflash.attention(q, k, v, mask=mask)
                            else:
                                def step():
                                    torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=mask), (qg, kg, vg), do)
                            row = dict(head_dim=d, seq_len=n, batch=b, heads=heads, mask="dense" if kb is None else
                                       f"random{kb}", density=density, work=work, mode=mode, setting=name,
                                       kernels=_which(q, k, v, mask, work))
                            try:
                                step()
                                row["eager_ms"] = stream_ms(step, calls=5)
                                row["gpu_ms"] = graph_ms(step)
                                row["status"] = "ok"
                            except Exception as e:  # noqa: BLE001 - a row that cannot run says why
                                row.update(eager_ms=None, gpu_ms=None, status=f"{type(e).__name__}: {e}"[:200])
                            rows.append(row)
                            progress(f"d={d} N={n} {row['mask']:>9} {mode:<6} {name:<8} {row['kernels']:<8} "
                                     f"eager {row['eager_ms'] or float('nan'):.4f} gpu {row['gpu_ms'] or float('nan'):.4f}")
    finally:
        tiles.TMA_MODE = saved
    return rows


def crossovers(rows: list[dict]) -> list[dict]:
    """Per head dim and mode: the smallest work from which ``hopper`` is faster than ``portable``
    eagerly at every larger work measured (None: never, or not measured)."""
    out = []
    for d in sorted({r["head_dim"] for r in rows}):
        for mode in sorted({r["mode"] for r in rows}):
            pairs = {}
            for r in rows:
                if r["head_dim"] == d and r["mode"] == mode and r["status"] == "ok":
                    pairs.setdefault((r["work"], r["seq_len"], r["mask"]), {})[r["setting"]] = r["eager_ms"]
            pts = sorted((w, p["hopper"] < p["portable"]) for (w, _, _), p in pairs.items()
                         if "hopper" in p and "portable" in p)
            cross = None
            for w, wins in reversed(pts):
                if not wins:
                    break
                cross = w
            out.append(dict(head_dim=d, mode=mode, hopper_wins_from_work=cross, points=len(pts)))
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper_threshold.threshold",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=positive_int, nargs="+", default=[4096, 16384])
    ap.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                    help="128-blocks a row of the random masks (a dense row is always measured)")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error("this study measures the Hopper kernels: it needs an sm_90 GPU (H100 / H200)")
    from sparseflash.experiments.bench.results import environment
    from sparseflash.flash import tiles

    rows = run(args.head_dims, args.seqs, args.blocks, args.modes)
    cross = crossovers(rows)
    meta = dict(environment(torch.device("cuda")), args=vars(args), tma_min_work=tiles.TMA_MIN_WORK)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "threshold.json").write_text(json.dumps(dict(meta=meta, rows=rows, crossovers=cross), indent=1))
    keys = list(rows[0]) if rows else []
    import csv

    with open(out / "threshold.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + ["device_name", "torch", "triton", "commit", "date"],
                           extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, **{k: meta.get(k) for k in ("device_name", "torch", "triton", "commit", "date")}})
    print(f"\ntoday's threshold: {tiles.TMA_MIN_WORK:.3g} FLOPs")
    for c in cross:
        wk = c["hopper_wins_from_work"]
        print(f"d={c['head_dim']:<4} {c['mode']:<7} hopper faster eagerly from work "
              f"{'never' if wk is None else f'{wk:.3g}'} ({c['points']} points)")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
