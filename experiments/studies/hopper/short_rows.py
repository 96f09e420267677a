"""The Hopper forward against the portable one on short rows (issue 22).

    python -m sparseflash.experiments.studies.hopper.short_rows [--rounds 3] [--out DIR]

Until stage 7 `hopper.SHORT_ROWS` sent calls whose rows held under 4 key blocks at head_dim 64 to
the portable forward (measured before the TMA-store epilogue). This times the forward alone (no
grad, CUDA-graph replays, bf16, 16 heads, 16K tokens per batch) of both kernels on the same calls
(`hopper.MODE` "auto" and "off"), over random masks of 1 to 13 blocks a row at d=64 and d=128,
the kernels interleaved over ``--rounds`` rounds (median kept, every round in the JSON).
``ratio`` = portable ms / Hopper ms: above 1 the Hopper kernel is faster. Writes DIR/short_rows.json.
"""

from __future__ import annotations

import statistics

import torch

from sparseflash.cmdline import ArgumentParser, run_command

# (tokens per sequence, 128-key blocks per row of a random mask)
CASES = [(1024, 1), (1024, 2), (2048, 2), (4096, 1), (4096, 2), (4096, 3), (4096, 4), (4096, 6), (16384, 3),
         (16384, 6), (16384, 13)]


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.short_rows", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import sparseflash
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.hopper.fwd_bench import save_json
    from sparseflash.flash.hopper import forward as hopper
    from sparseflash.patterns import random as random_mask

    saved = hopper.MODE
    rows = []
    try:
        for d in args.head_dims:
            for n, nblk in CASES:
                B, H = max(1, 16384 // n), 16
                g = torch.Generator(device="cuda").manual_seed(n + d + nblk)
                q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                mask = random_mask(n, nblk, block_size=128, seed=0, device="cuda")
                times = {"hopper": [], "portable": []}

                def run(mode):
                    def f():
                        hopper.MODE = mode
                        with torch.no_grad():
                            sparseflash.attention(q, k, v, mask=mask)
                    return f
                for _ in range(args.rounds):
                    for prov, mode in (("hopper", "auto"), ("portable", "off")):
                        f = run(mode)
                        f()
                        torch.cuda.synchronize()
                        times[prov].append(round(graph_ms(f), 5))
                hop, por = statistics.median(times["hopper"]), statistics.median(times["portable"])
                row = dict(seq=n, batch=B, heads=H, head_dim=d, blocks_per_row=nblk, hopper_ms=hop, portable_ms=por,
                           ratio=por / hop, hopper_rounds=times["hopper"], portable_rounds=times["portable"])
                rows.append(row)
                print(f"d={d:3d} N={n:5d} blocks={nblk:2d} hopper {hop:.4f} portable {por:.4f} ms  ratio {por / hop:.3f}",
                      flush=True)
                if args.out:
                    save_json(args.out, "short_rows.json", rows)
    finally:
        hopper.MODE = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
