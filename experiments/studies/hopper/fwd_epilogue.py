"""The Hopper forward's epilogue variants against cuDNN (issue 22, stage 6).

    python -m sparseflash.experiments.studies.hopper.fwd_epilogue [--out DIR]

Forward GPU time (CUDA-graph replays, `bench.timing.graph_ms`), bf16, 16 heads, 16K tokens per
batch, the median of two rounds with the variants interleaved. Variants ("store": `hopper.o_layout` answering None):
``store`` (O from registers to global memory), ``tma`` (through shared memory and a TMA store),
and SDPA cuDNN on dense and causal cases. (The recorded run also had a variant without the O
store, since removed: the compiler dropped the O arithmetic with it, so it bounded nothing.) ``tma_vs_store_maxdiff`` is the outputs'
largest difference. Writes fwd_epilogue.json with --out.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from sparseflash.cmdline import ArgumentParser, run_command

CASES = [(4096, 128, "causal"), (4096, 128, "dense"), (4096, 64, "causal"), (4096, 64, "dense"),
         (16384, 128, "dense"), (16384, 64, "dense"), (16384, 128, "causal"), (4096, 128, "random"),
         (16384, 64, "random"), (4096, 64, "butterfly")]
VARIANTS = ("store", "tma", "cudnn")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.fwd_epilogue", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import sparseflash
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.hopper.fwd_bench import _call, _mask, save_json
    from sparseflash.flash import fast, tiles
    from sparseflash.flash.hopper import forward as hopper

    fast.ENABLED, tiles.TMA_MODE = False, "on"  # every call takes descriptors, so the Hopper kernel
    rows = []
    for n, d, kind in CASES:
        B, H = max(1, 16384 // n), 16
        g = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        mask, causal = _mask(kind, n), kind == "causal"
        times, outs = {}, {}
        for rnd in range(2):
            for var in VARIANTS:
                if var == "cudnn":
                    if mask is not None:
                        continue
                    fn = _call("sdpa-cudnn", None, causal, d ** -0.5)

                    def step():
                        return fn(q, k, v)
                else:
                    def step(var=var):
                        saved = hopper.o_layout
                        if var == "store":  # O stored from registers, as a layout without a descriptor
                            hopper.o_layout = lambda o: None
                        try:
                            with torch.no_grad():
                                return sparseflash.attention(q, k, v, mask=mask, causal=causal)
                        finally:
                            hopper.o_layout = saved
                if rnd == 0:
                    outs[var] = step().clone()
                torch.cuda.synchronize()
                times.setdefault(var, []).append(graph_ms(step))
        rows.append(dict(n=n, d=d, mask=kind, **{k: round(statistics.median(v), 4) for k, v in times.items()},
                         tma_vs_store_maxdiff=(outs["tma"].float() - outs["store"].float()).abs().max().item()))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        save_json(args.out, "fwd_epilogue.json", rows)
    print(f"{'case':20s} " + " ".join(f"{v:>8s}" for v in VARIANTS))
    for r in rows:
        print(f"{r['n']:5d} d{r['d']:<3d} {r['mask']:9s} " + " ".join(f"{r.get(v, float('nan')):8.4f}" for v in VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
