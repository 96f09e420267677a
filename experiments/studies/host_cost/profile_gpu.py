"""Host time of back-to-back eager calls, and where it goes (cProfile), on a CUDA GPU:

    python -m sparseflash.experiments.studies.host_cost.profile_gpu

B=4, H=16, 4K tokens, d=64, bf16, a random mask of 3 of 32 blocks per row. 200 forward calls (no
grad), then 200 forward+backward calls (``torch.autograd.grad``), each issued while the GPU sleeps
(`timing.host_us`) so no launch waits for it; prints µs per call and the top of a cProfile of
the same loop (cProfile's own overhead inflates those times ~2x: read them as shares).
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch


def main(n: int = 200) -> None:
    import sparseflash
    from sparseflash.experiments.bench.timing import SLEEP_CYCLES, host_us
    from sparseflash.patterns import random as random_mask

    torch.manual_seed(0)
    B, H, N, D = 4, 16, 4096, 64
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = random_mask(N, 3, block_size=128, seed=0, device="cuda")

    def fwd():
        with torch.no_grad():
            sparseflash.attention(q, k, v, mask=mask)

    def fwd_bwd():
        o = sparseflash.attention(q, k, v, mask=mask)
        torch.autograd.grad(o, (q, k, v), o)

    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for _ in range(20):
            fn()
        print(f"{name}: {host_us(fn, n, repeats=1):.1f} us host per call")
        prof = cProfile.Profile()
        torch.cuda._sleep(SLEEP_CYCLES)
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
        print(out.getvalue())


if __name__ == "__main__":
    main()
