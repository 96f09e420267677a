"""Can Triton's warp specialisation take the fixed cost out of short block-sparse rows? (issue 3)

    python -m sparseflash.experiments.studies.tma.ws_probe [--out DIR]

Issue 3's last gap is the 4K forward at density ~0.1: rows of ~3 key blocks run at 65-69% of the
dense rate because each row pays a fixed cost (Q load, address setup, the K/V pipeline's fill
and drain, the epilogue) that a long dense row amortises (experiments/studies/short_rows/results/persistent/).
Warp specialisation, producer warps loading K/V while consumer warps compute, is how cuDNN and
FlashAttention-3 hide it. Triton exposes it as ``tl.range(..., warp_specialize=True)``, which
upstream reports working on Hopper only with tensor-descriptor (TMA) loads.

This probe is a measurement, not a kernel of the package: a stripped forward (bf16, no causal,
key_lengths, dropout or tails; sequence a multiple of the tiles; contiguous inputs) that reads
K/V through tensor descriptors at row offsets taken from the block list, compiled with and
without ``warp_specialize``, timed in GPU time (CUDA-graph replays) beside the package's
forward on the same inputs and mask, and checked against it (max |difference|). Each variant
that fails to compile or run is reported with its error instead of stopping the probe.

Prints a table; with --out writes ws_probe_<seq>.json.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["main"]


@triton.jit
def _probe_fwd(desc_q, desc_k, desc_v, desc_o, KV_IDX, LSE, n_heads, seq, n_kblocks, qk_scale,
               stride_ib, stride_ih, stride_im,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_B: tl.constexpr,
               NB_P2: tl.constexpr, DENSE: tl.constexpr, GATHER: tl.constexpr, WS: tl.constexpr,
               STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // n_heads
    i_h = bh % n_heads
    row0 = bh * seq  # first row of this (batch, head) in the [B*H*seq, HEAD_DIM] views
    start_m = pid_m * BLOCK_M
    q = desc_q.load([row0 + start_m, 0])  # [BLOCK_M, HEAD_DIM]
    SUB: tl.constexpr = MASK_B // BLOCK_N
    if DENSE:
        p_idx = KV_IDX
        b_list = tl.zeros([NB_P2], tl.int32)
        n_tiles = seq // BLOCK_N
    else:
        p_idx = KV_IDX + i_b * stride_ib + i_h * stride_ih + (start_m // MASK_B) * stride_im
        o_t = tl.arange(0, NB_P2)
        b_list = tl.load(p_idx + o_t, mask=o_t < n_kblocks, other=1 << 30)
        n_tiles = tl.sum((b_list < n_kblocks).to(tl.int32), axis=0) * SUB
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j in tl.range(0, n_tiles, num_stages=STAGES, warp_specialize=WS):
        if DENSE:
            start_n = j * BLOCK_N
        elif GATHER:  # the entry picked out of the list in registers: no load on the address path
            b = tl.sum(tl.where(tl.arange(0, NB_P2) == j // SUB, b_list, 0), axis=0)
            start_n = b * MASK_B + (j % SUB) * BLOCK_N
        else:
            start_n = tl.load(p_idx + j // SUB) * MASK_B + (j % SUB) * BLOCK_N
        k = desc_k.load([row0 + start_n, 0])  # [BLOCK_N, HEAD_DIM]
        v = desc_v.load([row0 + start_n, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    desc_o.store([row0 + start_m, 0], (acc / l_safe[:, None]).to(q.dtype))
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + bh.to(tl.int64) * seq + start_m + tl.arange(0, BLOCK_M), lse)


def probe_forward(q, k, v, mask, block_m: int, block_n: int, num_warps: int, stages: int, ws: bool,
                  gather: bool = False):
    """The probe's forward: (o, lse) for contiguous [B, H, N, D] inputs and an optional BlockMask."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, N, D = q.shape
    if N % 128 or not q.is_contiguous() or k.shape != q.shape:
        raise ValueError("the probe takes contiguous self-attention inputs with seq a multiple of 128")
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    views = [t.view(B * H * N, D) for t in (q, k, v, o)]
    dq, dk, dv, do = (TensorDescriptor.from_tensor(t, [bs, D]) for t, bs in zip(views, (block_m, block_n, block_n, block_m)))
    if mask is None:
        idx, strides, nb_p2, mask_b, n_kb = q, (0, 0, 0), 2, block_n, N // block_n
    else:
        bq, bk = mask.block_size
        if bq != bk or bq % block_m or bq % block_n:
            raise ValueError(f"the probe needs square mask blocks that the tiles divide, got {mask.block_size}")
        idx = mask.index(q.device).kv_idx
        idx = idx.expand(B, H, *idx.shape[-2:])
        strides, nb_p2, mask_b, n_kb = idx.stride()[:3], triton.next_power_of_2(idx.shape[-1]), bq, idx.shape[-1]
    _probe_fwd[(N // block_m, B * H)](
        dq, dk, dv, do, idx, lse, H, N, n_kb, (D ** -0.5) * 1.4426950408889634, *strides,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, MASK_B=mask_b, NB_P2=max(2, nb_p2), DENSE=mask is None,
        GATHER=gather, WS=ws, STAGES=stages, num_warps=num_warps, num_stages=stages,
    )
    return o, lse


# (block_m, block_n, num_warps, stages, warp_specialize, gather); --variant takes "128x64:w8:s3:ws:gather"
VARIANTS = [(128, 64, 8, 3, False, False), (128, 64, 8, 3, True, False), (128, 64, 8, 3, True, True),
            (128, 64, 4, 3, True, False), (128, 128, 8, 2, True, False), (64, 64, 4, 3, True, False),
            (128, 64, 8, 2, True, False)]


def split_spec(spec: str, numbered: str) -> tuple[int, int, dict, set]:
    """"BMxBN:w8:s3:flag..." -> (BM, BN, {letter: number} for the letters in ``numbered``, {flags});
    ValueError when the tile part is not two integers. (Shared with gluon_probe's variants.)"""
    parts = spec.split(":")
    bm, bn = (int(x) for x in parts[0].split("x"))
    numeric = [p for p in parts[1:] if p[:1] in numbered and p[1:].isdigit()]
    return bm, bn, {p[0]: int(p[1:]) for p in numeric}, set(parts[1:]) - set(numeric)


def print_dense_rates(rows: list, head_dims, blocks: int, seq: int, width: int) -> None:
    """Each variant's sparse rate against its own dense time and against sparseflash's (the 80%
    bar), from rows with head_dim, mask ("dense" or "<blocks>/row"), variant and ms."""
    dense_ms = {r["head_dim"]: r["ms"] for r in rows if r["mask"] == "dense" and r["variant"] == "sparseflash"}
    sparse, frac = f"{blocks}/row", blocks / (seq // 128)
    print("\nrate of the sparse mask relative to each implementation's own dense time (the 80% bar):")
    for d in head_dims:
        for variant in dict.fromkeys(r["variant"] for r in rows if r["head_dim"] == d):
            t = {r["mask"]: r["ms"] for r in rows if r["head_dim"] == d and r["variant"] == variant}
            if None in t.values() or len(t) < 2:
                continue
            pct = 100 * t["dense"] * frac / t[sparse]
            vs = 100 * dense_ms[d] * frac / t[sparse]
            print(f"  d={d} {variant:{width}s} sparse {t[sparse]:.4f} ms: {pct:.0f}% of its dense rate, "
                  f"{vs:.0f}% of sparseflash's dense rate")


def parse_variant(spec: str) -> tuple:
    """"128x64:w8:s3[:ws][:gather]" -> (128, 64, 8, 3, ws, gather)."""
    try:
        bm, bn, opts, flags = split_spec(spec, "ws")
        if not flags <= {"ws", "gather"} or set(opts) != {"w", "s"}:
            raise ValueError
    except ValueError:
        raise ValueError(f"--variant must look like 128x64:w8:s3[:ws][:gather], got {spec!r}") from None
    return bm, bn, opts["w"], opts["s"], "ws" in flags, "gather" in flags


def main(argv=None) -> int:
    import sparseflash
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.patterns import random as random_mask

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.tma.ws_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=3, help="key blocks of 128 per q-block row of the sparse mask")
    ap.add_argument("--variant", action="append", default=None, metavar="SPEC",
                    help="a probe variant, 128x64:w8:s3[:ws][:gather] (repeatable; default: the built-in list)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant] if args.variant else VARIANTS
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] < 9:
        ap.error("warp specialisation with tensor descriptors needs Hopper (sm_90) or newer")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    N, H = args.seq, 16
    B = max(1, 16384 // N)
    rows = []
    torch.manual_seed(0)
    sparse = random_mask(N, args.blocks, block_size=128, seed=0, device="cuda")
    for d in args.head_dims:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, mask in (("dense", None), (f"{args.blocks}/row", sparse)):
            with torch.no_grad():
                ref = sparseflash.attention(q, k, v, mask=mask)
                base_ms = graph_ms(lambda: sparseflash.attention(q, k, v, mask=mask))
            rows.append(dict(head_dim=d, mask=name, variant="sparseflash", ms=base_ms, max_diff=0.0, error=None))
            print(f"d={d} {name:7s} sparseflash                      {base_ms:.4f} ms", flush=True)
            for bm, bn, w, st, ws, ga in variants:
                label = f"probe {bm}x{bn} w{w} s{st}{' WS' if ws else ''}{' gather' if ga else ''}"
                row = dict(head_dim=d, mask=name, variant=label, block_m=bm, block_n=bn, num_warps=w, stages=st,
                           warp_specialize=ws, gather=ga, ms=None, max_diff=None, error=None)
                try:
                    o, _ = probe_forward(q, k, v, mask, bm, bn, w, st, ws, ga)
                    torch.cuda.synchronize()
                    row["max_diff"] = float((o.float() - ref.float()).abs().max())
                    row["ms"] = graph_ms(lambda: probe_forward(q, k, v, mask, bm, bn, w, st, ws, ga))
                    print(f"d={d} {name:7s} {label:32s} {row['ms']:.4f} ms ({100 * base_ms / row['ms']:.0f}% of "
                          f"sparseflash's speed), max |diff| {row['max_diff']:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
                    row["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-600:]
                    print(f"d={d} {name:7s} {label:32s} FAILED: {row['error'].splitlines()[-1][:200]}", flush=True)
                rows.append(row)
    print_dense_rates(rows, args.head_dims, args.blocks, N, 32)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ws_probe_{N}.json").write_text(json.dumps({"meta": environment(torch.device("cuda")), "args": vars(args),
                                                       "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
