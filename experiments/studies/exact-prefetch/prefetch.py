"""Where the Hopper kernels load a partial block's bits: after a step's scores, or ahead of them.

    python -m sparseflash.experiments.studies.exact-prefetch.prefetch --out DIR [--tokens 16384]
        [--heads 16] [--head-dims 64 128] [--masks sliding-window documents] [--rounds 2]

(run as ``python experiments/studies/exact-prefetch/prefetch.py``: the directory name has a dash.)

GPU time (CUDA-graph replays, `timing.graph_ms`), bf16, the token-exact masks of
`experiments/bench/exact.py` (a causal sliding window of 1024, causal documents of mean length
2048; 128-blocks), side by side in one process, rounds interleaved, medians reported:
- forward with `hopper.EXACT_PREFETCH` False (the bits' tile index and words loaded after the
  step's scores) and True (before the step waits for its K tile and its turn);
- forward+backward (forward prefetching) with `hopper_bwd.EXACT_PREFETCH` 0 (index and words after
  the step's S^T), 1 (both before the step waits for its Q), 2 (the index before, the words once the
  step's two wgmmas are issued), 3 (the index before, the words after S^T);
- the same mask block-level (``exact=False``) and compiled FlexAttention on the same mask_mod,
  for the ratios the exact-mask goals are stated in.
Every variant's output and gradients are compared with the first variant's (``maxdiff_*``: the
forward must be bitwise equal; dQ's float32 sums arrive in any order, so gradients may differ in
the last bits). Writes DIR/prefetch.json and prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from sparseflash.cli import ArgumentParser, run_command

FWD = {"fwd_after": False, "fwd_ahead": True}
BWD = {"bwd_after": 0, "bwd_ahead": 1, "bwd_issued": 2, "bwd_index": 3}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="prefetch.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--masks", nargs="+", default=["sliding-window", "documents"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import sparseflash
    from sparseflash.experiments.bench.exact import build_mask
    from sparseflash.experiments.bench.providers import _flex_compiled
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.flash import fast, hopper, hopper_bwd

    fast.ENABLED = False  # (every call through the general launcher, which reads the knobs)
    dev = torch.device("cuda")
    flex = _flex_compiled()
    rows = []
    for kind in args.masks:
        mask, label, _ = build_mask(kind, args.tokens, 1024, 2048, 128, dev)
        mask.exact_bits(dev)
        flex_mask = mask.to_flex(layout_in_mask_mod=False)
        for D in args.head_dims:
            g = torch.Generator(device=dev).manual_seed(D)
            q, k, v, do = (torch.randn(1, args.heads, args.tokens, D, device=dev, dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()

            def fwd_call(exact=True):
                return lambda: sparseflash.attention(q, k, v, mask, exact=exact)

            def fb(fn):
                return lambda: torch.autograd.grad(fn(), (q, k, v), do)

            # name -> (fn, knobs, fwd+bwd?)
            variants = {}
            for nm, pf in FWD.items():
                variants[nm] = (fwd_call(), dict(fwd=pf, bwd=3), False)
            for nm, pf in BWD.items():
                variants[nm] = (fb(fwd_call()), dict(fwd=True, bwd=pf), True)
            variants["block_fwd"] = (fwd_call(False), dict(fwd=True, bwd=3), False)
            variants["block_fwdbwd"] = (fb(fwd_call(False)), dict(fwd=True, bwd=3), True)
            variants["flex_fwd"] = (lambda: flex(q, k, v, block_mask=flex_mask), {}, False)
            variants["flex_fwdbwd"] = (fb(lambda: flex(q, k, v, block_mask=flex_mask)), {}, True)

            def with_knobs(fn, knobs):
                def step():
                    saved = hopper.EXACT_PREFETCH, hopper_bwd.EXACT_PREFETCH
                    hopper.EXACT_PREFETCH = knobs.get("fwd", saved[0])
                    hopper_bwd.EXACT_PREFETCH = knobs.get("bwd", saved[1])
                    try:
                        return fn()
                    finally:
                        hopper.EXACT_PREFETCH, hopper_bwd.EXACT_PREFETCH = saved
                return step

            outs, times = {}, {nm: [] for nm in variants}
            for nm, (fn, knobs, grad) in variants.items():
                step = with_knobs(fn, knobs)
                with torch.set_grad_enabled(grad):
                    out = step()
                outs[nm] = [t.detach().float() for t in (out if isinstance(out, tuple) else (out,))]
                torch.cuda.synchronize()
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for nm in order:
                    fn, knobs, grad = variants[nm]
                    with torch.set_grad_enabled(grad):
                        times[nm].append(graph_ms(with_knobs(fn, knobs)))
            row = dict(mask=kind, mask_label=label, tokens=args.tokens, heads=args.heads, head_dim=D,
                       partial_blocks=int(mask.exact_bits(dev).bits.shape[0]),
                       **{f"{nm}_ms": round(statistics.median(t), 4) for nm, t in times.items()})
            for group, first in ((FWD, "fwd_after"), (BWD, "bwd_after")):
                for nm in group:
                    if nm != first:
                        row[f"maxdiff_{nm}"] = max(float((a - b).abs().max()) for a, b in zip(outs[nm], outs[first]))
            row["maxdiff_flex_vs_exact_fwd"] = float((outs["flex_fwd"][0] - outs["fwd_ahead"][0]).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, do, outs
            torch.cuda.empty_cache()
    meta = dict(environment(dev), script="experiments/studies/exact-prefetch/prefetch.py")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "prefetch.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    cols = list(FWD) + list(BWD) + ["block_fwd", "block_fwdbwd", "flex_fwd", "flex_fwdbwd"]
    print(f"{'mask':16s} {'d':>4s} " + " ".join(f"{c:>12s}" for c in cols))
    for r in rows:
        print(f"{r['mask']:16s} {r['head_dim']:4d} " + " ".join(f"{r[c + '_ms']:12.4f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
