"""One Hopper backward call for Nsight Compute, and a summary of ncu's per-instruction stall samples.

    ncu --kernel-name regex:hopper_bwd_kernel --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -f -o OUT/bwd \\
        python -m sparseflash.experiments.studies.hopper.ncu_bwd run 16384 128 dense
    ncu --import OUT/bwd.ncu-rep --page source --csv --print-source sass > OUT/bwd.csv
    python -m sparseflash.experiments.studies.hopper.ncu_bwd summary OUT/bwd.csv

``run N D MASK [DQ_PARTS]``: two fwd+bwd calls (bf16, 16 heads, 16K tokens per batch; mask as in
`fwd_bench`) with the Hopper backward on. ``summary CSV``: the stall reasons over all warps, and
the SASS lines holding at least 0.5% of the samples with their two main reasons.
"""

from __future__ import annotations

import csv
import sys


def run(n: int, d: int, kind: str, dq_parts: int = 4) -> None:
    import torch

    import sparseflash
    from sparseflash.experiments.studies.hopper.fwd_bench import _mask
    from sparseflash.experiments.studies.sparse_bwd.bwd_variants import routed
    from sparseflash.flash import fast, tiles

    fast.ENABLED, tiles.TMA_MODE = False, "on"
    routed("on", DQ_PARTS=dq_parts).__enter__()  # (for the rest of this profiled process)
    B, H = max(1, 16384 // n), 16
    q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    for _ in range(2):
        o = sparseflash.attention(qg, kg, vg, mask=_mask(kind, n), causal=kind == "causal")
        torch.autograd.backward(o, do)
    torch.cuda.synchronize()


def summary(path: str, share: float = 0.005) -> None:
    lines = open(path).read().splitlines()
    rows = list(csv.DictReader(lines[1:] if lines[0].startswith('"Kernel Name"') else lines))

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0

    key = "Warp Stall Sampling (All Samples)"
    total = sum(num(r[key]) for r in rows) or 1.0
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    by_reason = sorted(((sum(num(r[c]) for r in rows), c) for c in reasons), reverse=True)
    print("stall reasons (% of samples):", ", ".join(f"{c[6:]} {v / total * 100:.1f}" for v, c in by_reason
                                                       if v / total > 0.005))
    for i, r in enumerate(rows):
        if num(r[key]) / total >= share:
            top = sorted(((num(r[c]), c) for c in reasons), reverse=True)[:2]
            print(f"{i:5d} {num(r[key]) / total * 100:5.1f}%  {r['Source'].strip()[:70]:70s} "
                  + ", ".join(f"{c[6:]} {v / total * 100:.1f}" for v, c in top if v))


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *(int(x) for x in sys.argv[5:6]))
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)
