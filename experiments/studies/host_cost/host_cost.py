"""Host cost of a call: the CPU time to issue one attention call, layer by layer (GPU only).

    python -m sparseflash.experiments.studies.host_cost.host_cost [--seq-len 4096] [--head-dim 64] [--out DIR]

A short call is host-bound when issuing it takes longer than the GPU takes to run it. To time
the issuing alone, the GPU is first put to sleep (``torch.cuda._sleep``) so that every launch
queues behind it and none waits for the GPU; the host time per call is then the wall time of the
loop over calls. Layers, from the outside in:

- ``attention fwd+bwd`` / ``attention fwd``: ``sparseflash.attention`` as a user calls it (the
  backward through autograd);
- ``launch fwd`` / ``launch bwd``: the launchers in `sparseflash.flash.launch`, no autograd;
- ``kernel <name>``: each Triton kernel launched again with the arguments the launcher passed
  (Triton's own launch path: argument binding, specialisation key, cache lookup, driver call);
- ``Function.backward, direct``: the autograd.Function's backward called without the engine;
  ``trivial Function fwd+bwd``: a do-nothing autograd.Function through the engine (its own cost);
- ``sdpa fwd+bwd``: torch's SDPA (flash backend) for comparison.

Also profiles the fwd+bwd call with cProfile (top functions by own time) and reports the GPU
time of the same call (CUDA-graph replay), so the table says which side bounds it. Writes
``host_cost.json`` and ``host_cost_profile.txt`` under ``--out``.
"""

from __future__ import annotations

import cProfile
import io
import json
import math
import os
import pstats
import time

import torch

from sparseflash.cmdline import ArgumentParser, run_command
from sparseflash.experiments.bench.timing import SLEEP_CYCLES, graph_ms, host_us

def _recorded_launches(fn):
    """(kernel, grid, args, kwargs) of every Triton launch ``fn`` makes (bound launches off, so
    that each goes through JITFunction.run)."""
    import triton

    from sparseflash.flash import binding

    seen = []
    orig = triton.runtime.jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append((self, grid, args, dict(kwargs)))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    triton.runtime.jit.JITFunction.run = run
    fast, binding.FAST_LAUNCH = binding.FAST_LAUNCH, False
    try:
        fn()
    finally:
        triton.runtime.jit.JITFunction.run = orig
        binding.FAST_LAUNCH = fast
    torch.cuda.synchronize()
    return seen


def main(argv=None) -> int:
    from sparseflash.experiments.bench.config import add_shape_args

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.host_cost.host_cost", description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--blocks-per-row", type=int, default=3, help="random mask of 128-blocks; 0: mask=None")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("host_cost times CUDA launches: it needs a GPU")
    import triton

    import sparseflash
    from sparseflash.flash import launch
    from sparseflash.patterns import random as random_mask

    N, D, H = args.seq_len, args.head_dim, args.heads
    B = max(1, args.tokens // N)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    mask = random_mask(N, args.blocks_per_row, seed=0, device=dev) if args.blocks_per_row else None
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    scale = 1 / math.sqrt(D)

    def fwd():
        return sparseflash.attention(q, k, v, mask=mask)

    def fwd_bwd():
        sparseflash.attention(qg, kg, vg, mask=mask).backward(do)

    def fwd_grad():
        return sparseflash.attention(qg, kg, vg, mask=mask)

    def fwd_autograd_grad():
        torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=mask), (qg, kg, vg), do)

    # the launch rows pass the call's work estimate as the public call does, so that they take
    # the same load mode (TMA or pointer) under SPARSEFLASH_TMA=auto
    from sparseflash.flash.autograd import estimate_work

    density = mask.density() if mask is not None else 1.0
    work = estimate_work(q, k, density)
    idx = mask.index(dev) if mask is not None else None
    kv_idx, q_idx = (idx.kv_idx, idx.q_idx) if idx is not None else (None, None)
    mb = 128 if mask is not None else None
    o, lse = launch.fwd(q, k, v, kv_idx, None, scale, False, mb, mb, 0.0, None, work=work)

    def l_fwd():
        launch.fwd(q, k, v, kv_idx, None, scale, False, mb, mb, 0.0, None, work=work)

    def l_bwd():
        launch.bwd(do, q, k, v, o, lse, None, kv_idx, q_idx, None, scale, False, mb, mb, 0.0, None, work=work)

    class _Trivial(torch.autograd.Function):  # the engine's own cost: one Python node, 3 accumulations
        @staticmethod
        def forward(ctx, a, b, c):
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            return g, g, g

    def trivial():
        _Trivial.apply(qg, kg, vg).backward(do)

    from types import SimpleNamespace

    from sparseflash.flash.autograd import FlashAttentionFunction

    ctx = SimpleNamespace(entry=None,  # (the general path's backward: no short-path entry)
                          saved_tensors=(q, k, v, o, lse, torch.empty(3, dtype=torch.int64, device=dev), kv_idx, q_idx,
                                         None, None, None, None, None, None, None, None),
                          params=(scale, False, mb or 0, mb or 0, 0.0, density, 0.0, False))

    def fn_bwd():
        FlashAttentionFunction.backward(ctx, do, None)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(qg, kg, vg).backward(do)

    rows = []

    def row(name, fn, gpu=True):  # (the "fwd" rows take q, k, v without grad: no graph is recorded)
        h = host_us(fn, args.calls)
        gu = graph_ms(fn, rep_ms=50) * 1e3 if gpu else None
        rows.append(dict(layer=name, host_us=h, gpu_us=gu))
        print(f"{name:28s} host {h:8.1f} us" + (f"   GPU {gu:8.1f} us" if gu is not None else ""), flush=True)

    row("attention fwd+bwd", fwd_bwd)
    row("attention fwd+autograd.grad", fwd_autograd_grad)
    row("attention fwd, grad on", fwd_grad, gpu=False)
    row("attention fwd", fwd)
    row("Function.backward, direct", fn_bwd, gpu=False)
    row("trivial Function fwd+bwd", trivial, gpu=False)
    row("launch fwd", l_fwd)
    row("launch bwd", l_bwd)
    for kern, grid, a, kw in _recorded_launches(lambda: (l_fwd(), l_bwd())):
        row(f"kernel {kern.fn.__name__}", lambda: kern[grid](*a, **kw), gpu=False)
    row("torch.empty_like x4", lambda: [torch.empty_like(q) for _ in range(4)], gpu=False)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row("sdpa flash fwd+bwd (dense)", sdpa)
    except RuntimeError as e:
        print(f"sdpa flash: unavailable ({e})")

    prof = cProfile.Profile()
    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof.enable()
    for _ in range(args.calls):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(30)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("SPARSEFLASH_COMMIT", "unknown"), date=time.strftime("%Y-%m-%d"),
                B=B, H=H, N=N, D=D, blocks_per_row=args.blocks_per_row, calls=args.calls,
                method="host: wall time of issuing the calls while the GPU sleeps; GPU: do_bench_cudagraph median")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_cost.json"), "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "host_cost_profile.txt"), "w") as f:
            f.write(buf.getvalue())
    print("\n".join(buf.getvalue().splitlines()[:45]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
