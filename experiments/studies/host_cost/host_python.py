"""Python-side host cost of a call, with the Triton launches taken out (any machine, no GPU needed)

    python -m sparseflash.experiments.studies.host_cost.host_python [--seq-len 4096] [--head-dim 64] [--blocks 3]
        [--key-lengths] [--table] [--profile]

Replaces the three kernels with no-ops for the duration of the run and times
`sparseflash.attention` forward (no_grad) and forward + backward (`torch.autograd.grad`) on CPU
tensors: what remains is our wrapper, launchers, the autograd Function and PyTorch's autograd
engine, without Triton's launch path (see host_cost.py for the whole host path on a GPU). Inputs
are stride-0 views, so nothing sizeable is touched; the outputs the launchers allocate are
real, and on a CPU their allocation is part of the number (a CUDA caching allocator makes it
nearly free). Medians of --repeats batches of --calls calls. For comparing launcher changes on
one machine, not a GPU-host figure. ``--table``: every setting of the issue (d=64 and 128, dense
and a random mask of --blocks blocks per row, with and without key_lengths); ``--profile``: the
cProfile of the forward + backward (top functions by own time).
"""

from __future__ import annotations

import contextlib
import os

import torch

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["measure", "table", "stubbed_kernels", "main"]

_KERNELS = ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel")


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


@contextlib.contextmanager
def stubbed_kernels():
    """For the duration: the three kernels replaced by no-ops and CPU tensors allowed on the Triton
    path; the kernels and the environment are restored afterwards."""
    from sparseflash.flash import kernels

    saved = {name: getattr(kernels, name) for name in _KERNELS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_triton_on_cpu())
        stack.callback(lambda: [setattr(kernels, name, k_) for name, k_ in saved.items()])
        for name in _KERNELS:
            setattr(kernels, name, _NoLaunch())
        yield


def measure(seq_len: int = 4096, head_dim: int = 64, blocks: int = 3, batch: int = 4, heads: int = 16,
            calls: int = 200, repeats: int = 7, key_lengths: bool = False, profile: bool = False) -> dict:
    """{"fwd_us": ..., "fwd_bwd_us": ...}: median host microseconds per call, kernels not launched.
    ``key_lengths``: pass a key_lengths tensor (all seq_len); ``profile``: also "profile", the text
    of a cProfile of --calls forward + backward calls."""
    import sparseflash
    from sparseflash.patterns import random as random_mask
    from sparseflash.experiments.bench.timing import profile_text, wall_us

    def view(requires_grad):
        base = torch.randn(batch, heads, 1, head_dim, dtype=torch.bfloat16)
        return base.expand(batch, heads, seq_len, head_dim).requires_grad_(requires_grad)

    q, k, v = (view(True) for _ in range(3))
    do = torch.zeros(1, dtype=torch.bfloat16).expand(batch, heads, seq_len, head_dim)
    mask = None if blocks <= 0 else random_mask(seq_len, blocks, block_size=128, seed=0)
    klen = torch.full((batch,), seq_len, dtype=torch.int32) if key_lengths else None

    def fwd():
        with torch.no_grad():
            sparseflash.attention(q, k, v, mask=mask, key_lengths=klen)

    def fwd_bwd():
        torch.autograd.grad(sparseflash.attention(q, k, v, mask=mask, key_lengths=klen), (q, k, v), do)

    with stubbed_kernels():
        out = {}
        for label, fn in (("fwd_us", fwd), ("fwd_bwd_us", fwd_bwd)):
            for _ in range(max(3, calls // 10)):
                fn()
            out[label] = wall_us(fn, calls, repeats)
        if profile:
            out["profile"] = profile_text(fwd_bwd, calls, 30)
        return out


def table(seq_len: int = 4096, blocks: int = 3, head_dims=(64, 128), calls: int = 200, repeats: int = 7) -> list[dict]:
    """`measure` at every setting of issue 21: rows of head_dim, mask ("dense" / "random{blocks}"),
    key_lengths, fwd_us, fwd_bwd_us."""
    rows = []
    for d in head_dims:
        for b in (0, blocks):
            for kl in (False, True):
                r = measure(seq_len, d, b, calls=calls, repeats=repeats, key_lengths=kl)
                rows.append(dict(head_dim=d, mask="dense" if b <= 0 else f"random{b}", key_lengths=kl, **r))
    return rows


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.host_cost.host_python", description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=3, help="key blocks of 128 per row of a random mask (0: dense)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--key-lengths", action="store_true", help="pass key_lengths (all seq_len)")
    ap.add_argument("--table", action="store_true", help="every setting: d=64/128, dense/mask, key_lengths or not")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the forward + backward")
    args = ap.parse_args(argv)
    if args.table:
        print(f"Python-side host cost, kernels not launched (us per call, median), seq_len {args.seq_len}")
        print(f"{'d':>4} {'mask':>8} {'key_len':>7} {'fwd':>7} {'fwd+bwd':>8}")
        for r in table(args.seq_len, args.blocks, calls=args.calls, repeats=args.repeats):
            print(f"{r['head_dim']:>4} {r['mask']:>8} {'yes' if r['key_lengths'] else 'no':>7} "
                  f"{r['fwd_us']:7.1f} {r['fwd_bwd_us']:8.1f}")
        return 0
    r = measure(args.seq_len, args.head_dim, args.blocks, calls=args.calls, repeats=args.repeats,
                key_lengths=args.key_lengths, profile=args.profile)
    print(f"Python-side host cost, kernels not launched: fwd {r['fwd_us']:.1f} us, fwd+bwd {r['fwd_bwd_us']:.1f} us")
    if args.profile:
        print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
