"""Compile the portable kernels' variants for sm_90 without a GPU (Triton's front end, its passes
and the bundled ptxas; nothing is launched), for the CPU test lane: the interpreter runs the
kernels as Python and takes the ``INTERPRET`` branches, so it never sees the compiled code path.
Run as a script, outside the interpreter (TRITON_INTERPRET unset, as kernels.py reads it on
import): ``python tests/_compile_sm90.py VARIANT...``; prints one line per kernel compiled, exit
status 3 when this triton cannot compile for CUDA here."""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the compiled code path is what this checks")

import torch  # noqa: E402

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # pragma: no cover
    print(f"cannot compile for CUDA here: {e}")
    sys.exit(3)

from sparseflash.flash import kernels, launch, operands, tiles  # noqa: E402
from sparseflash.flash.tiles import TileConfig  # noqa: E402

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def _type(a) -> str:
    if isinstance(a, torch.Tensor):
        return "*" + _TYPES[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if abs(a) < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {a!r}")


def compile_plan(plan, tensors, target):
    """PTX of ``plan`` (a launch._Plan) with ``tensors`` in its slots, compiled for ``target``."""
    fn = getattr(kernels, plan.kernel)
    args = list(plan.args)
    for i, t in zip(plan.slots, tensors):
        args[i] = t
    kw = {k: v for k, v in plan.kwargs.items() if k not in ("num_warps", "num_stages", "maxnreg")}
    sig, consts = {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        if p.is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = kw.pop(name) if name in kw else p.default
        elif args[i] is None:  # a slot a variant leaves empty (Triton takes None as a constexpr)
            sig[name] = "constexpr"
            consts[(i,)] = None
        else:
            sig[name] = _type(args[i])
    if kw:
        raise TypeError(f"{plan.kernel} has no parameters {sorted(kw)}")
    opts = dict(num_warps=plan.kwargs.get("num_warps", 4), num_stages=plan.kwargs.get("num_stages", 2))
    return triton.compile(ASTSource(fn, sig, consts), target=target, options=opts).asm["ptx"]


def main(names) -> None:
    B, H, Hk, N, D = 2, 4, 2, 256, 64
    q = torch.randn(B, H, N, D, dtype=torch.float16)
    k, v = torch.randn(B, Hk, N, D, dtype=torch.float16), torch.randn(B, Hk, N, D, dtype=torch.float16)
    o, do, dq, dk, dv = (torch.empty_like(t) for t in (q, q, q, k, v))
    lse, delta = torch.empty(B, H, N), torch.empty(B, H, N)
    seg = (torch.zeros(B, N, dtype=torch.int32), torch.zeros(B, N, dtype=torch.int32))
    ranges = operands.KeyRanges((torch.zeros(1, 2, N, dtype=torch.int32),) * 2)
    slopes = torch.rand(1, H)
    kl = torch.full((B,), N, dtype=torch.int64)
    rng = torch.zeros(3, dtype=torch.int64)
    variants = {  # name: (seg, softcap, dropout_p, causal, key_lengths)
        "default": (None, 0.0, 0.0, False, None),
        "softcap-causal": (None, 30.0, 0.0, True, None),
        "alibi-keylen": (operands.with_alibi(None, slopes), 0.0, 0.0, True, kl),
        "alibi-segments-softcap": (operands.with_alibi(seg, slopes), 5.0, 0.0, False, None),
        "alibi-ranges-dropout": (operands.with_alibi(ranges, slopes), 0.0, 0.1, False, None),
        "exact-causal": (None, 0.0, 0.0, True, None),  # a sliding-window mask's partial-block bits
    }
    target = GPUTarget("cuda", 90, 32)
    for name in names:
        s, cap, p, causal, klv = variants[name]
        r = rng if p > 0 else None
        kv_idx = q_idx = ex = mb = None
        if name.startswith("exact"):
            from sparseflash import BlockMask

            mask = BlockMask.from_fn(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 100), N, block_size=128)
            index, eb = mask.index(), mask.exact_bits()
            kv_idx, q_idx, mb = index.kv_idx, index.q_idx, 128
            ex = operands.ExactTiles((eb.bits, eb.kv_tile, eb.q_tile))
        for q_rows in (False, True):
            with tiles.tile_config(fwd=TileConfig(128, 64, 8, 3), dq=TileConfig(128, 64, 8, 3),
                                    dkdv=TileConfig(64, 128, 8, 3, q_rows=q_rows)):
                jobs = [("dkdv", launch._dkdv_plan(do, q, k, v, dk, dv, q_idx, klv, 0.125, causal, mb, mb, p, None, s,
                                                   cap, ex),
                         operands.dkdv_tensors(q, k, v, do, lse, delta, dk, dv, q_idx, klv, s, r, (q, k, v, do),
                                              ex and (ex[2], ex[0])))]
                if not q_rows:
                    jobs += [("fwd", launch._fwd_plan(q, k, v, o, kv_idx, klv, 0.125, causal, mb, mb, p, None, s, cap,
                                                      ex),
                              operands.fwd_tensors(q, k, v, o, lse, kv_idx, klv, s, r, (q, k, v), ex and (ex[1], ex[0]))),
                             ("dq", launch._dq_plan(do, q, k, v, o, dq, kv_idx, klv, 0.125, causal, mb, mb, p, None, s,
                                                    False, cap, ex),
                              operands.dq_tensors(q, k, v, o, do, lse, None, delta, dq, kv_idx, klv, s, r,
                                                 (q, k, v, do, o), ex and (ex[1], ex[0])))]
                for kind, plan, ts in jobs:
                    ptx = compile_plan(plan, ts, target)
                    print(f"{name} {kind} q_rows={q_rows}: {len(ptx.splitlines())} lines of PTX", flush=True)
                    if os.environ.get("SPARSEFLASH_PTX_DIR"):  # for comparing a variant's code across trees
                        with open(os.path.join(os.environ["SPARSEFLASH_PTX_DIR"], f"{name}-{kind}-{q_rows}.ptx"), "w") as f:
                            f.write(ptx)


if __name__ == "__main__":
    main(sys.argv[1:])
