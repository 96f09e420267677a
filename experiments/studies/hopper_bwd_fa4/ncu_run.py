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

``--provider fa4``: the same calls through FlashAttention-4 (`flash_attn.cute.flash_attn_func` on the
[B, N, H, D] views of the same tensors; dense and causal cases), to profile its SM90 backward beside
ours (ncu ``--kernel-name regex:BackwardSm90``: its main kernel, not the pre / post-processing).
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
    ap.add_argument("--provider", choices=("ours", "fa4"), default="ours",
                    help="ours (sparseflash.attention with the variant) or fa4 (dense and causal cases only)")
    ap.add_argument("--list-kernels", action="store_true",
                    help="print the names of the kernels one call launches (torch.profiler; not under ncu)")
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
    if a.provider == "fa4":
        if mask is not None:
            ap.error(f"--provider fa4 takes dense and causal cases, not {a.case}")
        from flash_attn.cute import flash_attn_func  # (on the device: ../shared/tools/fa4_parts.sh)

        def call():
            out, _lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            torch.autograd.grad(out, (q, k, v), do.transpose(1, 2))

        _run(call, a.calls, a.list_kernels)
        print(f"{a.case} fa4: {a.calls} fwd+bwd calls", flush=True)
        return 0

    def call():
        out = sparseflash.attention(q, k, v, mask=mask, causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    with variant(VARIANTS[a.variant]):
        _run(call, a.calls, a.list_kernels)
    print(f"{a.case} {a.variant}: {a.calls} fwd+bwd calls", flush=True)
    return 0


def _run(fn, calls: int, list_kernels: bool):
    """``calls`` calls of ``fn``; with ``list_kernels``, the last one under torch.profiler, its kernels printed."""
    for _ in range(calls - 1 if list_kernels else calls):
        fn()
    if list_kernels:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA":
                print(f"kernel: {e.key}", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(run_command(main))
