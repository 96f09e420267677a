"""The Hopper backward's scheduling knobs against the portable backward (issue 22, stages 5 and 6).

    python -m sparseflash.experiments.studies.hopper.bwd_knobs [--out DIR]

GPU time of the backward alone (CUDA-graph replays of `launch.bwd` with the arguments a real
fwd+bwd passed it), bf16, 16 heads, 16K tokens per batch (B = 16384 / N), side by side in one
process. Variants (module knobs of `sparseflash.flash.hopper.backward`):
- ``portable``: the two Triton kernels (MODE "off");
- ``hopper``: the one-pass kernel as it runs by default (MODE "on" here, so block-sparse masks
  run it too): HEAD_GROUPS and, for causal calls, tiles dealt in long/short pairs;
- ``nogroups``: the same with HEAD_GROUPS False (every head's key tile 0 first);
- ``dkdv``: the kernel without its dQ part (DQ_PARTS 0), what dQ costs by difference.
Prints a line per case and a table; writes bwd_knobs.json with --out. Also prints the largest
gradient difference of each variant that computes dQ from ``portable``. ``--variants`` and
``--cases`` (indices into CASES) run a subset; ``--case N,D,MASK`` adds any case (MASK as
`fwd_bench._mask` takes it, e.g. ``random13``: 13 random blocks a row).
"""

from __future__ import annotations

import json
import sys

import torch

from sparseflash.cmdline import ArgumentParser, run_command

CASES = [(16384, 128, "dense"), (16384, 128, "causal"), (16384, 64, "causal"), (8192, 128, "dense"),
         (8192, 128, "causal"), (1024, 64, "dense"), (16384, 128, "random"), (4096, 128, "random"),
         (4096, 128, "causal"), (16384, 64, "dense"), (4096, 64, "random"), (4096, 64, "causal")]
# (mode, knobs of the study copy experiments/studies/sparse_bwd/bwd_variants.py)
VARIANTS = {"portable": ("off", {}), "hopper": ("on", {}), "nogroups": ("on", dict(HEAD_GROUPS=False)),
            "dkdv": ("on", dict(DQ_PARTS=0))}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.bwd_knobs", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--cases", nargs="+", type=int, default=None, help="indices into CASES (default: all)")
    ap.add_argument("--case", nargs="+", default=[], help="more cases, each N,D,MASK (e.g. 16384,128,random13)")
    args = ap.parse_args(argv)
    variants = {k: VARIANTS[k] for k in dict.fromkeys(["portable"] + args.variants)}
    cases = CASES if args.cases is None and not args.case else [CASES[i] for i in args.cases or []]
    for c in args.case:
        n, d, kind = c.split(",")
        cases.append((int(n), int(d), kind))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.hopper.bwd_parts import captured_bwd_args
    from sparseflash.experiments.studies.hopper.fwd_bench import save_json
    from sparseflash.experiments.studies.sparse_bwd.bwd_variants import routed
    from sparseflash.flash import fast, launch, tiles

    fast.ENABLED, tiles.TMA_MODE = False, "on"  # every call takes descriptors, so the Hopper kernels
    rows = []
    for n, d, kind in cases:
        a, kw = captured_bwd_args(n, d, kind)
        times, grads = {}, {}
        for name, (mode, knobs) in variants.items():
            def step():
                with routed(mode, **knobs):
                    return launch.bwd(*a, **kw)
            grads[name] = step()
            torch.cuda.synchronize()
            times[name] = graph_ms(step)
        diff = {f"maxdiff_{nm}": max((x.float() - y.float()).abs().max().item()
                                     for x, y in zip(grads[nm], grads["portable"]))
                for nm in variants if nm != "portable" and grads[nm][0] is not None}
        rows.append(dict(n=n, d=d, mask=kind, **{k: round(v, 4) for k, v in times.items()}, **diff))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        save_json(args.out, "bwd_knobs.json", rows)
    print(f"{'case':22s} " + " ".join(f"{v:>9s}" for v in variants))
    for r in rows:
        print(f"{r['n']:>5} d{r['d']:<3} {r['mask']:10s} " + " ".join(f"{r[v]:9.3f}" for v in variants))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
