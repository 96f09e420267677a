"""What exact-mask bits cost the Hopper kernels: the partial steps, and the EXACT variant itself.

    python experiments/studies/exact-bits-cost/bits_cost.py --out DIR [--tokens 16384] [--heads 16]
        [--head-dims 64 128] [--masks sliding-window documents] [--rounds 2]

(a path, not ``-m``: the directory name has a dash.)

GPU time (CUDA-graph replays, `timing.graph_ms`), bf16, the token-exact masks of
`experiments/bench/exact.py` (a causal sliding window of 1024, causal documents of mean length
2048; 128-blocks), side by side in one process, rounds interleaved, medians reported:
- ``fwd``, ``fwdbwd``: the call with bits (the default, exact);
- ``nopartial_*``: the exact call with its tile tables set to -1 (every block treated as full), so
  the kernels run their EXACT variant without a single partial step: what that variant costs on
  every step, apart from the bits (its output is the block-level one);
- ``block_*``: the same mask block-level (``exact=False``), with the default backward and with the
  Hopper backward forced (``block_hopper_fwdbwd``, `hopper_bwd.MODE` "on": what the bits cost that
  kernel);
- ``flex_*``: compiled FlexAttention on the same mask_mod, for the ratios the goals are stated in.
``maxdiff_nopartial_vs_block_fwd``: must be 0. Writes DIR/bits_cost.json and prints a table.
(Versions of this script at ec92ef6 and 82b5295 also timed kernel variants that were then removed:
bits loaded ahead of a step's scores, and the backward reading transposed bit tiles; their results
are in results/ and the README.)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command



def main(argv=None) -> int:
    ap = ArgumentParser(prog="bits_cost.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--masks", nargs="+", default=["sliding-window", "documents"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import sparseflash
    from sparseflash.experiments.bench.exact import build_mask
    from sparseflash.experiments.bench.providers import _flex_compiled
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.flash import autograd, fast
    from sparseflash.flash.hopper import backward as hopper_bwd

    exact_tables = autograd.exact_tables

    def _no_partial(*a, **kw):  # the call's bits with every tile index -1
        bits, kv_tile, q_tile = exact_tables(*a, **kw)
        if bits is None:
            return bits, kv_tile, q_tile
        return bits, torch.full_like(kv_tile, -1), torch.full_like(q_tile, -1)

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

            # name -> (fn, hopper_bwd knobs, fwd+bwd?)
            variants = {"fwd": (fwd_call(), {}, False),
                        "fwdbwd": (fb(fwd_call()), {}, True),
                        "nopartial_fwd": (fwd_call(), dict(NO_PARTIAL=True), False),
                        "nopartial_fwdbwd": (fb(fwd_call()), dict(NO_PARTIAL=True), True),
                        "block_fwd": (fwd_call(False), {}, False),
                        "block_fwdbwd": (fb(fwd_call(False)), {}, True),
                        "block_hopper_fwdbwd": (fb(fwd_call(False)), dict(MODE="on"), True),
                        "flex_fwd": (lambda: flex(q, k, v, block_mask=flex_mask), {}, False),
                        "flex_fwdbwd": (fb(lambda: flex(q, k, v, block_mask=flex_mask)), {}, True)}

            def with_knobs(fn, knobs):
                knobs = dict(knobs)
                patch = knobs.pop("NO_PARTIAL", False)

                def step():
                    saved = {key: getattr(hopper_bwd, key) for key in knobs}
                    for key, val in knobs.items():
                        setattr(hopper_bwd, key, val)
                    if patch:
                        autograd.exact_tables = _no_partial
                    try:
                        return fn()
                    finally:
                        for key, val in saved.items():
                            setattr(hopper_bwd, key, val)
                        autograd.exact_tables = exact_tables
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
            row["maxdiff_nopartial_vs_block_fwd"] = float((outs["nopartial_fwd"][0] - outs["block_fwd"][0]).abs().max())
            row["maxdiff_flex_vs_exact_fwd"] = float((outs["flex_fwd"][0] - outs["fwd"][0]).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, do, outs
            torch.cuda.empty_cache()
    meta = dict(environment(dev), script="experiments/studies/exact-bits-cost/bits_cost.py")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "bits_cost.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    cols = list(variants)
    print(f"{'mask':16s} {'d':>4s} " + " ".join(f"{c:>12s}" for c in cols))
    for r in rows:
        print(f"{r['mask']:16s} {r['head_dim']:4d} " + " ".join(f"{r[c + '_ms']:12.4f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
