"""Where an eager per-call mask's host time goes: torch ops launched and host microseconds of each
piece of ``topk_indices`` -> ``BlockMask.from_indices`` -> ``sparseflash.attention`` (forward, and
forward + backward), on CPU (README.md: question, method, answer).

    PYTHONPATH=$PWD python -m sparseflash.experiments.studies.dynamic_host.host_breakdown --out DIR

Method. Ops: a ``TorchDispatchMode`` counts every aten op a piece dispatches (on a GPU each is one
launch or at least one allocator call, a few microseconds of host time each). Host time: the
pieces run on tiny CPU tensors (the arithmetic is negligible there) with the attention kernels'
launchers stubbed (``launch.fwd`` / ``launch.bwd`` return empty outputs and count their calls), so
what is timed is Python and dispatcher work above the kernels: the part a GPU run pays on the host
whatever the kernels cost. The index build is timed on the path a CPU tensor takes (torch ops);
on CUDA ``from_indices`` takes one Triton launch instead (`sparseflash.index_kernels`), whose ops
the table gives as ``*_kernel_path`` (`index_kernels.ON_CPU`, with the Triton launch stubbed and
counted: add a Triton launch's host time, about 20 us, to those rows).
Writes DIR/host_breakdown.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> tuple[int, dict]:
    with OpCounter() as c:
        fn()
    return sum(c.ops.values()), dict(c.ops.most_common())


def host_us(fn, reps: int = 200) -> float:
    """Host microseconds of ``fn``: the 10th percentile of ``reps`` calls after 10 warm-up calls (a low
    quantile, not the median: the CPU is shared, and other work only ever adds time)."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.quantiles(ts, n=10)[0]


def stub_launchers():
    """Replace the kernels' launchers by stubs returning empty outputs; returns the call counter."""
    from sparseflash.flash import launch

    calls = Counter()

    def fwd(q, k, v, *a, **kw):
        calls["launch.fwd"] += 1
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def bwd(do, q, k, v, *a, **kw):
        calls["launch.bwd"] += 1
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    launch.fwd, launch.bwd = fwd, bwd
    try:
        from sparseflash import index_kernels
    except ImportError:  # the "before" run
        return calls

    class _Stub:  # kernel[grid](...) counted, not run (the interpreter's time would mean nothing)
        def __getitem__(self, grid):
            def run(*a, **kw):
                calls["triton index kernel"] += 1
            return run

    index_kernels._lists_kernel = _Stub()
    return calls


def pieces(n: int, heads: int, d: int, K: int, block: int):
    import sparseflash
    from sparseflash import BlockMask
    from sparseflash.dynamic import topk_indices

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    ids = topk_indices(q, k, K, block, causal=True)
    dyn = BlockMask.from_indices(ids, n, block_size=block, check=False)
    dyn.index()

    def select():
        topk_indices(q, k, K, block, causal=True)

    def index():
        BlockMask.from_indices(ids, n, block_size=block, check=False).index()

    def attn_new_mask():  # the attention call alone, with a mask object new to it (its lists built already)
        m = BlockMask.from_indices(ids, n, block_size=block, check=False)
        m.index()
        with torch.no_grad():
            sparseflash.attention(q, k, v, m, causal=True)

    def step_fwd():
        with torch.no_grad():
            i = topk_indices(q, k, K, block, causal=True)
            sparseflash.attention(q, k, v, BlockMask.from_indices(i, n, block_size=block, check=False), causal=True)

    def step_fwdbwd():
        i = topk_indices(q, k, K, block, causal=True)
        o = sparseflash.attention(q, k, v, BlockMask.from_indices(i, n, block_size=block, check=False), causal=True)
        torch.autograd.grad(o, (q, k, v), do)

    out = dict(select=select, index=index, attention_new_mask=attn_new_mask, step_fwd=step_fwd,
               step_fwdbwd=step_fwdbwd)
    try:
        from sparseflash import index_kernels
    except ImportError:  # a checkout without the kernel (the "before" run)
        return out

    def index_kernel_path():  # from_indices as CUDA ids take it: the Triton launch stubbed
        index_kernels.ON_CPU = True
        try:
            BlockMask.from_indices(ids, n, block_size=block, check=False).index()
        finally:
            index_kernels.ON_CPU = False

    def step_fwd_kernel_path():
        index_kernels.ON_CPU = True
        try:
            step_fwd()
        finally:
            index_kernels.ON_CPU = False

    out.update(index_kernel_path=index_kernel_path, step_fwd_kernel_path=step_fwd_kernel_path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="", help="a name for this run (e.g. before / after)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    # the triton backend on CPU tensors (its launchers are stubbed below); read when first used
    os.environ.setdefault("TRITON_INTERPRET", "1")
    calls = stub_launchers()
    rows = []
    for name, fn in pieces(args.tokens, args.heads, args.head_dim, args.k, args.block).items():
        fn()
        calls.clear()
        n_ops, ops = count_ops(fn)
        launches = dict(calls)
        us = host_us(fn, args.reps)
        rows.append(dict(piece=name, aten_ops=n_ops, launcher_calls=launches, host_us=us, ops=ops))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sparseflash.experiments.bench.results import environment

    meta = dict(environment(torch.device("cpu")), label=args.label, tokens=args.tokens, heads=args.heads,
                head_dim=args.head_dim, k=args.k, block=args.block)
    path = out / f"host_breakdown{('_' + args.label) if args.label else ''}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {path}")
    print(f"{'piece':>20} {'aten ops':>9} {'host us':>9}  launcher calls")
    for r in rows:
        us = "-" if r["host_us"] is None else f"{r['host_us']:.0f}"
        print(f"{r['piece']:>20} {r['aten_ops']:>9} {us:>9}  {r['launcher_calls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
