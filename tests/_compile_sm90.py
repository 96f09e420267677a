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
    if isinstance(a, tuple):  # (the kernels' strides)
        return tuple(_type(x) for x in a)
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if abs(a) < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {a!r}")


def compile_plan(plan, tensors: dict, target):
    """PTX of ``plan`` (a launch.Plan) with ``tensors`` (parameter name -> tensor) in its tensor
    arguments, compiled for ``target``."""
    fn = getattr(kernels, plan.kernel)
    args = plan.arguments(tensors)
    opts = dict(num_warps=args.pop("num_warps", 4), num_stages=args.pop("num_stages", 2))
    args.pop("maxnreg", None)
    sig, consts = {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        given = name in args
        value = args.pop(name) if given else p.default
        if p.is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = value
        elif value is None:  # an argument a variant does not read (Triton takes None as a constexpr)
            sig[name] = "constexpr"
            consts[(i,)] = None
        else:
            sig[name] = _type(value)
    if args:
        raise TypeError(f"{plan.kernel} has no parameters {sorted(args)}")
    return triton.compile(ASTSource(fn, sig, consts), target=target, options=opts).asm["ptx"]


def main(names) -> None:
    B, H, Hk, N, D = 2, 4, 2, 256, 64
    q = torch.randn(B, H, N, D, dtype=torch.float16)
    k, v = torch.randn(B, Hk, N, D, dtype=torch.float16), torch.randn(B, Hk, N, D, dtype=torch.float16)
    o, do, dq, dk, dv = (torch.empty_like(t) for t in (q, q, q, k, v))
    lse, delta = torch.empty(B, H, N), torch.empty(B, H, N)
    seg = (torch.zeros(B, N, dtype=torch.int32), torch.zeros(B, N, dtype=torch.int32))
    ranges = torch.zeros(1, 2, N, dtype=torch.int32)
    slopes = torch.rand(1, H)
    kl = torch.full((B,), N, dtype=torch.int64)
    rng = torch.zeros(3, dtype=torch.int64)
    variants = {  # name: ((segments, key_ranges, slopes), softcap, dropout_p, causal, key_lengths)
        "default": ((None, None, None), 0.0, 0.0, False, None),
        "softcap-causal": ((None, None, None), 30.0, 0.0, True, None),
        "alibi-keylen": ((None, None, slopes), 0.0, 0.0, True, kl),
        "alibi-segments-softcap": ((seg, None, slopes), 5.0, 0.0, False, None),
        "alibi-ranges-dropout": ((None, ranges, slopes), 0.0, 0.1, False, None),
        "exact-causal": ((None, None, None), 0.0, 0.0, True, None),  # a sliding-window mask's partial-block bits
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
        common = dict(Q=q, K=k, V=v, LSE=lse, KEY_LEN=klv, RNG=r, **operands.table_pack_tensors(*s),
                      **({} if r is None else dict(dropout=(r,))))
        for q_rows in (False, True):
            with tiles.tile_config(fwd=TileConfig(128, 64, 8, 3), dq=TileConfig(128, 64, 8, 3),
                                    dkdv=TileConfig(64, 128, 8, 3, q_rows=q_rows)):
                named = dict(tables=s, softcap=cap, exact=ex is not None)
                jobs = [("dkdv", launch.plan_dkdv(do, q, k, v, dk, dv, q_idx, klv, 0.125, causal, mb, mb, p, **named),
                         dict(common, DO=do, DELTA=delta, DK=dk, DV=dv, Q_IDX=q_idx,
                              **({} if ex is None else dict(exact=(ex[2], ex[0])))))]
                if not q_rows:
                    rows = dict(KV_IDX=kv_idx, **({} if ex is None else dict(exact=(ex[1], ex[0]))))
                    jobs += [("fwd", launch.plan_fwd(q, k, v, o, kv_idx, klv, 0.125, causal, mb, mb, p, **named),
                              dict(common, O=o, **rows)),
                             ("dq", launch.plan_dq(do, q, k, v, o, dq, kv_idx, klv, 0.125, causal, mb, mb, p, **named),
                              dict(common, O=o, DO=do, DELTA=delta, DQ=dq, **rows))]
                for kind, plan, ts in jobs:
                    ptx = compile_plan(plan, ts, target)
                    print(f"{name} {kind} q_rows={q_rows}: {len(ptx.splitlines())} lines of PTX", flush=True)
                    if os.environ.get("SPARSEFLASH_PTX_DIR"):  # for comparing a variant's code across trees
                        with open(os.path.join(os.environ["SPARSEFLASH_PTX_DIR"], f"{name}-{kind}-{q_rows}.ptx"), "w") as f:
                            f.write(ptx)


if __name__ == "__main__":
    main(sys.argv[1:])
