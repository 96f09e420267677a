"""Where the block-sparse backward's fixed cost goes: the one-pass Hopper backward with parts of it
switched off, at 1 to 128 listed blocks a key column.

    python -m sparseflash.experiments.studies.sparse_bwd.decompose --out DIR [--head-dims 64 128]
    python -m sparseflash.experiments.studies.sparse_bwd.decompose --compile-only   (no GPU: builds every variant for sm_90)

Each case is one backward call of a fwd+bwd of `sparseflash.attention` (bf16, 16 heads, 16K tokens,
batch 1) on a mask with exactly K q blocks of 128 rows in every key column (each head its own
draw), timed as CUDA-graph replays of `launch.bwd` with the arguments the real call passed it.
Variants (the study copy `bwd_variants.py` of the production kernel, patched in for the call):
- ``onepass``: the kernel as it runs (delta, zero-filled float32 dQ buffer, kernel, dQ cast);
- ``no_dq``: no dQ path at all (DQ_PARTS 0: dK, dV only; the buffer is still allocated and zeroed);
- ``no_store``: everything but the dK/dV stores (masked off: no bytes move);
- ``ordered``: the kernel with key tiles dealt longest column first (`bwd_variants.LONGEST_FIRST`),
  its largest difference from ``onepass`` in ``ordered_maxdiff``;
- ``walk``: the consumers do no arithmetic, only take and return each step's Q/dO slot: the loads,
  the barriers, the K/V loads per tile and the dK/dV stores;
- ``portable``: the two portable kernels (dQ over row lists, dK/dV over column lists), for reference;
- ``zeros``, ``delta``, ``cast``: the one-pass kernel's three helper launches alone (the float32
  buffer's zero fill, the delta/LSE kernel, the scale-and-cast of dQ).
Linear fits ms = fixed + per_block * K per variant are printed last and written beside the rows.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

KS = (1, 4, 13, 32, 128)
VARIANTS = {  # name: knobs of the study copy (bwd_variants.KNOBS)
    "onepass": {},
    "no_dq": dict(DQ_PARTS=0),
    "no_store": dict(STORE_DKDV=False),
    "walk": dict(WALK_ONLY=True),
    "ordered": dict(LONGEST_FIRST=True),
}


def column_mask(n: int, k: int, heads: int, seed: int = 0, block: int = 128, device="cuda", rows: bool = False):
    """A BlockMask with exactly ``k`` q blocks in every key column, drawn per head; ``rows``: ``k``
    key blocks in every query row instead (`patterns.random`: columns of Binomial(n / block, k / (n /
    block)) blocks, what a random mask of that density gives the backward's column walks)."""
    from sparseflash.mask import BlockMask
    from sparseflash.patterns import random as random_mask

    if rows:
        return random_mask(n, k, block_size=block, heads=heads, seed=seed, device=device)

    nb = n // block
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, nb, nb, generator=g)  # [H, k block, q block]
    top = scores.topk(min(k, nb), dim=-1).indices
    lay_t = torch.zeros(heads, nb, nb, dtype=torch.bool).scatter_(-1, top, True)
    return BlockMask.from_layout(lay_t.transpose(-1, -2).unsqueeze(0).contiguous().to(device), block_size=block)


def variant(name: str):
    """Routes `launch.hopper_bwd` through the study copy with ``name``'s switches, MODE "on"."""
    from sparseflash.experiments.studies.sparse_bwd.bwd_variants import routed

    return routed("on", **VARIANTS[name])


def captured(n: int, d: int, k: int, heads: int = 16, rows: bool = False):
    """(args, kwargs) that `launch.bwd` got from one fwd+bwd on `column_mask`."""
    import sparseflash
    from sparseflash.flash import launch

    g = torch.Generator(device="cuda").manual_seed(1)
    q, kk, v, do = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    mask = column_mask(n, k, heads, rows=rows)
    real, saved = launch.bwd, {}

    def spy(*a, **kw):
        saved["a"], saved["kw"] = a, kw
        return real(*a, **kw)
    launch.bwd = spy
    try:
        ts = [t.detach().requires_grad_() for t in (q, kk, v)]
        torch.autograd.grad(sparseflash.attention(*ts, mask=mask), ts, do)
    finally:
        launch.bwd = real
    return saved["a"], saved["kw"]


def measure(n: int, d: int, k: int, variants=tuple(VARIANTS), rows: bool = False) -> dict:
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.flash import launch
    from sparseflash.flash.hopper import backward as hopper_bwd

    a, kw = captured(n, d, k, rows=rows)
    do_, q_, k_, v_, o_, lse_, dlse_ = a[:7]
    row = dict(seq=n, head_dim=d, blocks_per_col=k, mask="random rows" if rows else "balanced columns")
    ref = None
    for name in variants:
        with variant(name):
            got = launch.bwd(*a, **kw)
            torch.cuda.synchronize()
            if name == "onepass":
                ref = [t.clone() for t in got]
            elif name == "ordered" and ref is not None:  # the same sums, other tiles first: equal up to dQ's order
                row["ordered_maxdiff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref))
            row[name] = graph_ms(lambda: launch.bwd(*a, **kw))
    saved = hopper_bwd.MODE
    hopper_bwd.MODE = "off"
    try:
        row["portable"] = graph_ms(lambda: launch.bwd(*a, **kw))
    finally:
        hopper_bwd.MODE = saved
    B, H, N, D = q_.shape
    row["zeros"] = graph_ms(lambda: torch.zeros((B, H, N, D), device=q_.device, dtype=torch.float32))
    n_pad = hopper_bwd.padded_rows(N, 128, hopper_bwd.q_step(D))
    row["delta"] = graph_ms(lambda: hopper_bwd.delta_rows(o_, do_, lse_, dlse_, n_pad, 1.0 / 0.1))
    acc = torch.zeros(B * H * n_pad * D, device=q_.device, dtype=torch.float32)
    dq = torch.empty_like(q_)
    dq_n = D // 2 if hopper_bwd.q_step(D) == 64 else D  # (a warpgroup's share: `hopper_bwd._dq_box`)

    def cast():
        import triton
        sq = dq.stride()
        hopper_bwd.dq_cast_kernel[(triton.cdiv(N, hopper_bwd.CAST_ROWS), B * H)](
            acc, dq, sq[0], sq[1], sq[2], H, N, n_pad, 0.1, HEAD_DIM=D, BLOCK=hopper_bwd.CAST_ROWS, DQ_N=dq_n)
    row["cast"] = graph_ms(cast)
    return row


def fits(rows: list[dict]) -> list[dict]:
    """Least-squares ms = fixed + per_block * K for each (head_dim, variant)."""
    out = []
    for d in sorted({r["head_dim"] for r in rows}):
        sub = [r for r in rows if r["head_dim"] == d]
        x = torch.tensor([float(r["blocks_per_col"]) for r in sub], dtype=torch.float64)
        for name in [v for v in (*VARIANTS, "portable") if v in sub[0]]:  # (the variants run)
            y = torch.tensor([r[name] for r in sub], dtype=torch.float64)
            A = torch.stack([torch.ones_like(x), x], 1)
            sol = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1)
            out.append(dict(head_dim=d, variant=name, fixed_ms=float(sol[0]), per_block_ms=float(sol[1])))
    return out


def compile_only(head_dims) -> int:
    """Builds every variant's kernel for sm_90 on this machine (no GPU), to catch compile errors."""
    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.experiments.studies.sparse_bwd import bwd_variants as bv

    for d in head_dims:
        B, H, N, D = 1, 2, 512, d
        q, k, v, o, do = (torch.empty(B, H, N, D, dtype=torch.bfloat16) for _ in range(5))
        lse = torch.empty(B, H, N)
        index = column_mask(N, 2, H, device="cpu").index("cpu")
        for name in VARIANTS:
            with variant(name):
                from sparseflash.flash.launch import hopper_bwd as launch_hopper_bwd
                got = compile_launches(lambda: launch_hopper_bwd(do, q, k, v, o, lse, None, index.q_idx, None,
                                                                 D ** -0.5, False, 128, 128, num_sms=132))
            ck = got.get("hopper_bwd_kernel")
            print(f"d={d} {name:9s} {'ok' if ck is not None else 'NOT COMPILED'}", flush=True)
            if ck is None:
                return 1
    return 0


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.sparse_bwd.decompose",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=list(KS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rows", action="store_true", help="masks of K blocks a row (random), not K a column")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only(args.head_dims)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --compile-only)")
    from sparseflash.flash import fast, tiles

    fast.ENABLED = False
    tiles.TMA_MODE = "on"
    rows = []
    out = Path(args.out) if args.out else None
    for d in args.head_dims:
        for k in args.ks:
            rows.append(measure(args.seq, d, k, args.variants, args.rows))
            print(" ".join(f"{a}={b:.3f}" if isinstance(b, float) else f"{a}={b}" for a, b in rows[-1].items()),
                  flush=True)
            if out:
                out.mkdir(parents=True, exist_ok=True)
                with open(out / ("decompose_rows.csv" if args.rows else "decompose.csv"), "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
    fit = fits(rows)
    if out:
        from sparseflash.experiments.bench.results import environment
        env = environment(torch.device("cuda"))
        (out / ("decompose_rows_fits.json" if args.rows else "decompose_fits.json")).write_text(json.dumps(dict(env=env, fits=fit, rows=rows), indent=1))
    print("\nhead_dim variant   fixed_ms per_block_ms")
    for f in fit:
        print(f"{f['head_dim']:8d} {f['variant']:9s} {f['fixed_ms']:8.3f} {f['per_block_ms']:12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
