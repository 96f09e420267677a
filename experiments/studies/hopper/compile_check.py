"""Compile the Hopper forward (`sparseflash.flash.hopper`) or backward (`hopper_bwd`) for sm_90
on any machine, no GPU.

    python -m sparseflash.experiments.studies.hopper.compile_check [--kernel fwd|bwd] [--head-dims 64 128]
        [--dump DIR]

A stand-in driver (experiments/bench/inspect_kernels.py) makes Triton compile the kernel a GPU
launch of each case would compile, without launching it; prints per case: shared memory,
registers, spills (stack), the setmaxnreg values, and counts of wgmma, TMA loads and mbarrier
arrives in the PTX. Exit status 1 when a case fails to compile.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["compile_case", "CASES", "main"]

# (label, dense, causal, key_lengths, mask block); "exact" cases apply a sliding window's bits inside
# its partial blocks (EXACT)
CASES = [("dense", True, False, False, 128), ("causal+keylen", True, True, True, 128),
         ("sparse128", False, False, False, 128), ("sparse256 causal", False, True, False, 256)]
EXACT_CASES = [("exact128", False, False, False, 128), ("exact256 causal+keylen", False, True, True, 256)]


def compile_case(head_dim: int, dense: bool, causal: bool, keylen: bool, block: int, seq: int = 1000,
                 dtype=torch.bfloat16, kernel: str = "fwd", exact: bool = False):
    """The CompiledKernel of one forward (``kernel`` "fwd") or backward ("bwd") call's shape,
    compiled for sm_90 without a GPU; ``exact`` (block lists): with a sliding window's bit tiles
    (the kernels' EXACT)."""
    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.flash.hopper import forward as hopper
    from sparseflash.flash.launch import hopper_bwd, hopper_fwd
    from sparseflash.patterns import random as random_mask

    if hopper.GLUON_ERROR is not None:
        raise RuntimeError(f"no gluon: {hopper.GLUON_ERROR}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: gluon kernels only compile; unset it")
    B, H, N, D = 2, 4, seq, head_dim
    q, k, v = (torch.empty(B, H, N, D, dtype=dtype) for _ in range(3))
    kv_idx, q_idx, bq, ex = None, None, None, None
    if exact:
        from sparseflash.flash.operands import ExactTiles
        from sparseflash.mask import BlockMask

        m = BlockMask.from_fn(lambda b, h, i, j: (i - j).abs() < max(2, N // 3), N, block_size=block)
        bits, index = m.exact_bits("cpu"), m.index("cpu")
        kv_idx, q_idx, bq = index.kv_idx, index.q_idx, block
        ex = ExactTiles((bits.bits, bits.kv_tile, bits.q_tile))
    elif not dense:
        index = random_mask(N, 3, block_size=block, seed=0, device="cpu").index("cpu")
        kv_idx, q_idx, bq = index.kv_idx, index.q_idx, block
    kl = torch.full((B,), N, dtype=torch.int32) if keylen else None
    if kernel == "fwd":
        name = "hopper_fwd_kernel"
        compiled = compile_launches(lambda: hopper_fwd(q, k, v, kv_idx, kl, D ** -0.5, causal, bq, bq, num_sms=132,
                                                       exact=ex))
    else:
        name = "hopper_bwd_kernel"
        o, do = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(B, H, N)
        compiled = compile_launches(lambda: hopper_bwd(do, q, k, v, o, lse, None, q_idx, kl, D ** -0.5, causal, bq, bq,
                                                       num_sms=132, exact=ex))
    if name not in compiled:
        raise RuntimeError("the compile hook was not called (kernel already in the cache?)")
    return compiled[name]


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dump", default=None, help="write each case's PTX here")
    ap.add_argument("--cases", nargs="+", default=None, help="case labels to compile (default: all)")
    ap.add_argument("--seq", type=int, default=1000)
    ap.add_argument("--exact", action="store_true", help="also the forward with exact-mask bits (EXACT_CASES)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list at the end")
    args = ap.parse_args(argv)
    import triton

    from sparseflash.experiments.bench.inspect_kernels import gluon_report

    ok = True
    rows = []
    for d in args.head_dims:
        for label, dense, causal, keylen, block in CASES + (EXACT_CASES if args.exact else []):
            if args.cases and label not in args.cases:
                continue
            try:
                ck = compile_case(d, dense, causal, keylen, block, seq=args.seq, kernel=args.kernel,
                                  exact=label.startswith("exact"))
                r = gluon_report(ck)
                rows.append(dict(head_dim=d, case=label, status="ok", **r))
                print(f"triton {triton.__version__} {args.kernel} d={d:3d} {label:18s} ok   " + json.dumps(r), flush=True)
                if args.dump:
                    Path(args.dump).mkdir(parents=True, exist_ok=True)
                    Path(args.dump, f"{args.kernel}_d{d}_{label.replace(' ', '_')}.ptx").write_text(ck.asm["ptx"])
            except Exception as e:  # noqa: BLE001 - report every case
                ok = False
                rows.append(dict(head_dim=d, case=label, status="error"))
                from sparseflash.experiments.studies.gluon.gluon_probe import _error_text

                print(f"triton {triton.__version__} d={d:3d} {label:18s} FAIL {_error_text(e)[-1200:]}", flush=True)
    if args.json:
        print(json.dumps(rows))
    import gc

    gc.collect()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_command(main))
