"""The Hopper forward's host path on a CPU: a proxy for its host cost where no GPU is at hand.

    TRITON_INTERPRET=1 python -m sparseflash.experiments.studies.hopper_threshold.host_cpu [--calls 500] [--profile]

Runs `sparseflash.attention` (no grad, B1 H2 N1K d128 bf16 CPU tensors, a random mask of one block a
row, the short path off) through the general path into the Hopper launcher, with three stand-ins: the
dispatch takes the Hopper kernels for CPU tensors, the SM count is an H200's, and the kernel object
returns a compiled kernel whose launcher does nothing, so `binding.call` binds on the first call and
takes its bound route after. What it times is every line of Python and every torch call between
`sparseflash.attention` and the C launcher: API checks, the autograd Function, the dispatch, the
descriptors and the bound launch's key. This machine's µs are not an H200 host's (those run about
2-3x longer, `results/host_profile/`), but a change that removes work here removes it there.
Prints µs per call (best of three runs of ``--calls``) and, with ``--profile``, the top functions.
"""

from __future__ import annotations

import sys
import time

import torch

from sparseflash.cmdline import ArgumentParser, positive_int, run_command


class _Compiled:
    function, packed_metadata = 1, (4, 1, 0)

    def run(self, *args):
        pass


class _Kernel:
    """The Hopper kernel's signature; launching gives a `_Compiled` (no compilation, no GPU)."""

    def __init__(self, fn):
        self.fn, self.pre_run_hooks = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Compiled()


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper_threshold.host_cpu",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=positive_int, default=500)
    ap.add_argument("--profile", action="store_true", help="also print the top functions by own time")
    ap.add_argument("--per-call", action="store_true",
                    help="the per-call top-k step instead: `topk_blocks` (8 of 8 blocks... of 8, causal) + the forward, "
                         "the selection and index kernels stubbed like the attention's (--torch-select: the "
                         "selection's torch ops instead of its kernel)")
    ap.add_argument("--torch-select", action="store_true")
    ap.add_argument("--backward", action="store_true",
                    help="dense forward+backward (the one-pass Hopper backward: its delta, main and dQ-cast launches)")
    args = ap.parse_args(argv)
    import sparseflash
    from sparseflash import index_kernels
    from sparseflash.flash import binding, dispatch, fast
    from sparseflash.flash.hopper import backward as hb, forward as hf
    from sparseflash.patterns import random as random_mask

    if hf.GLUON_ERROR is not None:
        ap.error(f"needs gluon's Hopper module: {hf.GLUON_ERROR}")
    saved = (fast.ENABLED, dispatch.fwd_layouts, hf.sm_count, hf.hopper_fwd_kernel, binding.has_cuda,
             binding.current_device, binding.raw_stream, binding.tiles.INTERPRETING)
    saved_ix = (index_kernels.ON_CPU, index_kernels._topk_kernel, index_kernels._lists_kernel,
                index_kernels._pool_kernel)
    saved_hb = (hb.sm_count, hb.hopper_bwd_kernel, hb.delta_kernel, hb.dq_cast_kernel)
    if args.backward:
        hb.sm_count = lambda index: 132
        hb.hopper_bwd_kernel, hb.delta_kernel, hb.dq_cast_kernel = (_Kernel(k.fn) for k in saved_hb[1:])
    if args.per_call:  # the index kernels take CPU inputs, and launch nothing either
        index_kernels.ON_CPU = True
        index_kernels._topk_kernel = _Kernel(saved_ix[1].fn)
        index_kernels._lists_kernel = _Kernel(saved_ix[2].fn)
        index_kernels._pool_kernel = _Kernel(saved_ix[3].fn)
    fast.ENABLED = False
    dispatch.fwd_layouts = lambda q, k, v, bq, bk, work: hf.layouts(q, k, v)
    hf.sm_count = lambda index: 132
    hf.hopper_fwd_kernel = _Kernel(saved[3].fn)
    binding.has_cuda, binding.current_device, binding.raw_stream = (lambda: True), (lambda: 0), (lambda index: 0)
    binding.tiles.INTERPRETING = False
    try:
        q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
        mask = random_mask(1024, 1, block_size=128, seed=0)

        def fixed():
            with torch.no_grad():
                sparseflash.attention(q, k, v, mask=mask)

        def per_call():
            with torch.no_grad():
                m = sparseflash.topk_blocks(q, k, 4, 128, causal=True)
                sparseflash.attention(q, k, v, mask=m, causal=True)

        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)

        def dense_fwd_bwd():
            torch.autograd.grad(sparseflash.attention(qg, kg, vg), (qg, kg, vg), do)

        fwd = dense_fwd_bwd if args.backward else per_call if args.per_call else fixed
        if args.per_call and args.torch_select:
            saved_takes = index_kernels.select_takes
            index_kernels.select_takes = lambda q, kb, width: False

        for _ in range(5):
            fwd()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fwd()
            best = min(best, (time.perf_counter() - t0) / args.calls * 1e6)
        what = ("dense Hopper forward+backward" if args.backward else
                "per-call top-4 step, selection by " + ("torch ops" if args.torch_select else "its kernel")
                if args.per_call else "Hopper forward")
        print(f"{best:.1f} us per {what} on this CPU (host path to the launchers; best of 3 x {args.calls})")
        if args.profile:
            from sparseflash.experiments.bench.timing import profile_text

            print(profile_text(fwd, args.calls, 25))
    finally:
        (fast.ENABLED, dispatch.fwd_layouts, hf.sm_count, hf.hopper_fwd_kernel, binding.has_cuda,
         binding.current_device, binding.raw_stream, binding.tiles.INTERPRETING) = saved
        (index_kernels.ON_CPU, index_kernels._topk_kernel, index_kernels._lists_kernel,
         index_kernels._pool_kernel) = saved_ix
        hb.sm_count, hb.hopper_bwd_kernel, hb.delta_kernel, hb.dq_cast_kernel = saved_hb
        if args.per_call and args.torch_select:
            index_kernels.select_takes = saved_takes
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
