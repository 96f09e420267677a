"""One exact-mask backward call for Nsight Compute: block-level, the EXACT variant with no partial
step, or exact (the three backward rows of `bits_cost.py`).

    ncu --kernel-name regex:hopper_bwd_kernel --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --section LaunchStats -f -o OUT/VARIANT \\
        python experiments/studies/exact-bits-cost/ncu_exact.py MASK D VARIANT
    ncu --import OUT/VARIANT.ncu-rep --page source --csv --print-source sass > OUT/VARIANT.csv
    python -m sparseflash.experiments.studies.hopper.ncu_bwd summary OUT/VARIANT.csv

MASK: sliding-window or documents (16K tokens, 16 heads, bf16, 128-blocks, as `bench.exact`); D: 64 or
128; VARIANT: block (``exact=False``), nopartial (tile tables all -1), exact. Two fwd+bwd calls with
the Hopper backward forced on (`hopper_bwd.MODE` "on"), so the block-level call runs the same kernel.
"""

from __future__ import annotations

import sys

import torch


def main(argv=None) -> int:
    kind, d, variant = (argv or sys.argv[1:])[:3]
    import sparseflash
    from sparseflash.experiments.bench.exact import build_mask
    from sparseflash.flash import autograd, fast
    from sparseflash.flash.hopper import backward as hopper_bwd

    fast.ENABLED, hopper_bwd.MODE = False, "on"
    dev = torch.device("cuda")
    mask, _, _ = build_mask(kind, 16384, 1024, 2048, 128, dev)
    mask.exact_bits(dev)
    if variant == "nopartial":
        tables = autograd.exact_tables

        def no_partial(*a, **kw):
            bits, kv_tile, q_tile = tables(*a, **kw)
            return bits, torch.full_like(kv_tile, -1), torch.full_like(q_tile, -1)

        autograd.exact_tables = no_partial
    elif variant not in ("block", "exact"):
        raise SystemExit(f"VARIANT must be block, nopartial or exact, got {variant!r}")
    q, k, v, do = (torch.randn(1, 16, 16384, int(d), device=dev, dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.requires_grad_() for t in (q, k, v))
    for _ in range(2):
        o = sparseflash.attention(qg, kg, vg, mask, exact=variant != "block")
        torch.autograd.backward(o, do)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
