"""Python-side host cost of a call, with the Triton launches taken out (any machine, no GPU needed)

    python -m sparseflash.experiments.studies.host_cost.host_python [--seq-len 4096] [--head-dim 64] [--blocks 3]

Replaces the three kernels with no-ops for the duration of the run and times
`sparseflash.attention` forward (no_grad) and forward + backward (`torch.autograd.grad`) on CPU
tensors: what remains is our wrapper, launchers, the autograd Function and PyTorch's autograd
engine, without Triton's launch path (see host_cost.py for the whole host path on a GPU). Inputs
are stride-0 views, so nothing sizeable is touched; the outputs the launchers allocate are
real, and on a CPU their allocation is part of the number (a CUDA caching allocator makes it
nearly free). Medians of --repeats batches of --calls calls. For comparing launcher changes on
one machine, not a GPU-host figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

__all__ = ["measure", "main"]

_KERNELS = ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")


@contextlib.contextmanager
def _triton_on_cpu():
    """Let CPU tensors take the Triton path for the run (the API asks for TRITON_INTERPRET; no
    kernel is interpreted, none is launched), and restore the environment afterwards."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def measure(seq_len: int = 4096, head_dim: int = 64, blocks: int = 3, batch: int = 4, heads: int = 16,
            calls: int = 200, repeats: int = 7) -> dict:
    """{"fwd_us": ..., "fwd_bwd_us": ...}: median host microseconds per call, kernels not launched."""
    import sparseflash
    from sparseflash.flash import kernels
    from sparseflash.patterns import random as random_mask

    def view(requires_grad):
        base = torch.randn(batch, heads, 1, head_dim, dtype=torch.bfloat16)
        return base.expand(batch, heads, seq_len, head_dim).requires_grad_(requires_grad)

    q, k, v = (view(True) for _ in range(3))
    do = torch.zeros(1, dtype=torch.bfloat16).expand(batch, heads, seq_len, head_dim)
    mask = None if blocks <= 0 else random_mask(seq_len, blocks, block_size=128, seed=0)

    def fwd():
        with torch.no_grad():
            sparseflash.attention(q, k, v, mask=mask)

    def fwd_bwd():
        torch.autograd.grad(sparseflash.attention(q, k, v, mask=mask), (q, k, v), do)

    saved = {name: getattr(kernels, name) for name in _KERNELS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_triton_on_cpu())
        stack.callback(lambda: [setattr(kernels, name, k_) for name, k_ in saved.items()])
        for name in _KERNELS:
            setattr(kernels, name, _NoLaunch())
        out = {}
        for label, fn in (("fwd_us", fwd), ("fwd_bwd_us", fwd_bwd)):
            for _ in range(max(3, calls // 10)):
                fn()
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                runs.append((time.perf_counter() - t0) / calls * 1e6)
            out[label] = statistics.median(runs)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=3, help="key blocks of 128 per row of a random mask (0: dense)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    r = measure(args.seq_len, args.head_dim, args.blocks, calls=args.calls, repeats=args.repeats)
    print(f"Python-side host cost, kernels not launched: fwd {r['fwd_us']:.1f} us, fwd+bwd {r['fwd_bwd_us']:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
