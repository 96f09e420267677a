"""Where the backward's time goes: the portable kernels against the Hopper one-pass kernel (issue 22).

    python -m sparseflash.experiments.studies.hopper.bwd_parts [--out DIR]

GPU time (CUDA-graph replays) of `launch.bwd` alone, replayed with the arguments a real
forward + backward handed it, bf16, 16 heads, 16K tokens per batch. Columns (ms):
- ``portable``: the portable backward (dQ kernel, then dK/dV kernel; 7 matmuls per tile pair);
- ``portable_dq``, ``portable_dkdv``: each of its kernels alone;
- ``hopper``: the one-pass Gluon kernel (`hopper_bwd`, 5 matmuls, dQ by TMA reduce-add), with
  its delta, zero-fill and cast launches;
- ``hopper_dkdv``: the same kernel without the dQ part (DQ_PARTS 0 of the study copy experiments/studies/sparse_bwd/bwd_variants.py: dK, dV
  only, plus the delta launch), which shows what the dQ accumulation costs;
- with ``--dq-parts``, ``hopper_parts1`` .. ``hopper_parts3``: the kernel with DQ_PARTS 1 (+ the
  dS^T exchange between the warpgroups), 2 (+ the dQ wgmma; ptxas drops part of it, since its
  result is unused) and 3 (+ dQ's store to the staging buffers and the hand-off to the reducer
  warp, which then adds nothing).
Every call goes through `launch.bwd` (the short path off, TMA descriptors on, as large calls take).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

CASES = [(16384, 128, "dense"), (16384, 128, "random"), (4096, 128, "random"), (4096, 128, "causal"),
         (16384, 64, "dense"), (4096, 64, "random")]


def captured_bwd_args(n: int, d: int, kind: str):
    """The (args, kwargs) one fwd+bwd of this case (bf16, 16 heads, 16K tokens per batch; mask as in
    `fwd_bench`) passes `launch.bwd`, to time backward variants on."""
    import sparseflash
    from sparseflash.experiments.studies.hopper.fwd_bench import _mask
    from sparseflash.flash import launch

    B, H = max(1, 16384 // n), 16
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    real, saved = launch.bwd, {}

    def spy(*a, **kw):
        saved["a"], saved["kw"] = a, kw
        return real(*a, **kw)
    launch.bwd = spy
    try:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        o = sparseflash.attention(qg, kg, vg, mask=_mask(kind, n), causal=kind == "causal")
        torch.autograd.grad(o, (qg, kg, vg), do)
    finally:
        launch.bwd = real
    return saved["a"], saved["kw"]


def measure(n: int, d: int, kind: str, dq_parts: bool = False) -> dict:
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.sparse_bwd.bwd_variants import routed
    from sparseflash.flash import launch

    real = launch.bwd
    a, kw = captured_bwd_args(n, d, kind)
    do_, q_, k_, v_, o_, lse_, dlse_, kv_idx, q_idx, kl, scale, cz, mbq, mbk, dp, rng = a
    row = dict(seq=n, head_dim=d, mask=kind)
    variants = [("portable", "off", 4), ("hopper", "on", 4), ("hopper_dkdv", "on", 0)]
    if dq_parts:
        variants += [(f"hopper_parts{i}", "on", i) for i in (1, 2, 3)]
    for name, mode, dq_parts in variants:
        def step():
            with routed(mode, DQ_PARTS=dq_parts):
                real(*a, **kw)
        step()
        torch.cuda.synchronize()
        row[name] = graph_ms(step)
    delta = torch.empty_like(lse_)
    row["portable_dq"] = graph_ms(lambda: launch.bwd_dq(do_, q_, k_, v_, lse_, delta, kl, scale, cz, mbq, mbk, dp, rng,
                                                       kv_idx, o=o_, dlse=dlse_, **kw))
    row["portable_dkdv"] = graph_ms(lambda: launch.bwd_dkdv(do_, q_, k_, v_, lse_, delta, kl, scale, cz, mbq, mbk, dp,
                                                           rng, q_idx, **kw))
    return row


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.bwd_parts", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dq-parts", action="store_true", help="also time the kernel with DQ_PARTS 1, 2, 3")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from sparseflash.flash import fast, tiles

    fast.ENABLED = False  # 4K calls would take the short path (quick launches), not launch.bwd
    tiles.TMA_MODE = "on"  # the portable kernels' descriptor loads, as large calls take them
    rows = []
    for n, d, kind in CASES:
        rows.append(measure(n, d, kind, args.dq_parts))
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out, "bwd_parts.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
