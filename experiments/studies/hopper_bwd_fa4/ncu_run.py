"""The production Hopper backward of one `compare` case and variant, for Nsight Compute.

    ncu --kernel-name regex:hopper_bwd_kernel --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -f -o OUT/bwd \\
        python -m sparseflash.experiments.studies.hopper_bwd_fa4.ncu_run causal-d128-16k causal-one-loop
    ncu --import OUT/bwd.ncu-rep --page source --csv --print-source sass > OUT/bwd.csv
    python -m sparseflash.experiments.studies.hopper.ncu_bwd summary OUT/bwd.csv

Runs two forward + backward calls of the case (`compare.case`: 16 heads, bf16, 16K tokens a call)
with the variant's study overrides (`compare.VARIANTS`, set by `compare.variant`), so the second
call's backward is the kernel to profile (the first compiles). `ncu_bwd summary` turns ncu's
per-instruction samples into the stall reasons and the SASS lines that hold them. Needs an sm_90 GPU.
"""

from __future__ import annotations

import torch

from sparseflash.cmdline import ArgumentParser, run_command
from sparseflash.experiments.studies.hopper_bwd_fa4.compare import (HEADS, TOKENS, VARIANTS, _case_name, _mask, case,
                                                                  variant)

__all__ = ["main"]


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper_bwd_fa4.ncu_run",
                        description=__doc__.splitlines()[0])
    ap.add_argument("case", type=_case_name, help="a compare case: dense-d128-16k, randomK-dD-Nk, localW-dD-Nk, ...")
    ap.add_argument("variant", nargs="?", default="ours", choices=sorted(VARIANTS))
    ap.add_argument("--calls", type=int, default=2, help="forward + backward calls (default 2: profile the last)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Hopper backward runs on sm_90)")
    import sparseflash

    n, d, causal, pattern = case(a.case)
    mask = _mask(pattern, n, causal, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(TOKENS // n, HEADS, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    with variant(VARIANTS[a.variant]):
        for _ in range(a.calls):
            out = sparseflash.attention(q, k, v, mask=mask, causal=causal)
            torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize()
    print(f"{a.case} {a.variant}: {a.calls} fwd+bwd calls", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
