"""Where the host time of a short-path call goes, piece by piece, on a GPU.

    python -m sparseflash.experiments.studies.host_cost.pieces [--out DIR] [--calls 50] [--repeats 15]

bf16, B=4, H=16, 4K tokens, d=64, a random mask of 3 128-blocks per row (density 0.094), no
key_lengths. Each row: host microseconds per call (median and min over --repeats batches of --calls
calls issued while the GPU sleeps, `timing.host_us_samples`) of one piece of the call, after the
call's key has been seen (the short path's entry exists):

- the pieces of our forward: the key lookup, the output allocations, the entry's launch alone;
- our backward without PyTorch's autograd engine (`Entry.backward` called directly);
- the native plan's forward alone (`sparseflash.flash.native`, no Python around it);
- whole calls: ours (short path with its native plan, the Python short path, general), SDPA's (dense: the anchor), and a Python autograd
  Function that allocates our outputs and launches nothing (PyTorch's own charge for any such
  op), forward without grad and forward + backward (``torch.autograd.grad``).

"Our own" cost of a fwd+bwd is ours minus that floor; it is also the sum of lookup + forward +
direct backward. Writes DIR/pieces.json and DIR/pieces.csv and prints the table.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command


def main(argv=None) -> int:
    import torch.nn.functional as F

    import sparseflash
    from sparseflash.experiments.bench.host import _Floor
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import host_us_samples
    from sparseflash.flash import fast, native
    from sparseflash.patterns import random as random_mask

    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.host_cost.pieces", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    B, H, N, D = 4, 16, 4096, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    mask = random_mask(N, 3, block_size=128, seed=0, device=dev)
    native.load()  # built before timing (a first call would otherwise build it in the background)
    for _ in range(3):  # bind the launches, make the native plan, give it the backward's launches
        torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=mask), (qg, kg, vg), do)
    entry = fast.lookup(q, k, v, mask, False, None, None)
    assert isinstance(entry, fast.Entry), "the short path did not take the call"
    o, lse = entry.forward(q, k, v, None)
    ts = (q, k, v, o, lse, None)
    entry.backward(do, q, k, v, o, lse, None)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def general(fn, switch=fast):
        def run():
            switch.ENABLED = False
            try:
                fn()
            finally:
                switch.ENABLED = True
        return run

    def python(fn):  # the short path without the native plan
        return general(fn, native)

    attn = lambda a, b, c: sparseflash.attention(a, b, c, mask=mask)  # noqa: E731
    pieces = [
        ("fwd: key lookup", lambda: fast.lookup(q, k, v, mask, False, None, None)),
        ("fwd: allocate o", lambda: torch.empty_like(q)),
        ("fwd: allocate lse", lambda: torch.empty_like(entry.rows)),
        ("fwd: entry launch (launch.run)", lambda: entry.fwd(ts)),
        ("fwd: entry.forward (alloc + launch)", lambda: entry.forward(q, k, v, None)),
        ("bwd: entry.backward (no engine)", lambda: entry.backward(do, q, k, v, o, lse, None)),
        ("fwd no-grad: native plan alone", no_grad(lambda: entry.native.forward(q, k, v, None, 0))),
        ("fwd no-grad: ours", no_grad(lambda: attn(q, k, v))),
        ("fwd no-grad: ours python short path", python(no_grad(lambda: attn(q, k, v)))),
        ("fwd no-grad: ours general", general(no_grad(lambda: attn(q, k, v)))),
        ("fwd no-grad: sdpa (dense)", no_grad(lambda: F.scaled_dot_product_attention(q, k, v))),
        ("fwd no-grad: autograd floor", no_grad(lambda: _Floor.apply(q, k, v))),
        ("fwd with grad: ours", lambda: attn(qg, kg, vg)),
        ("fwd with grad: autograd floor", lambda: _Floor.apply(qg, kg, vg)),
        ("fwd+bwd: ours", lambda: torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do)),
        ("fwd+bwd: ours python short path",
         python(lambda: torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do))),
        ("fwd+bwd: ours general", general(lambda: torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do))),
        ("fwd+bwd: sdpa (dense)",
         lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg), (qg, kg, vg), do)),
        ("fwd+bwd: autograd floor", lambda: torch.autograd.grad(_Floor.apply(qg, kg, vg), (qg, kg, vg), do)),
    ]
    rows = []
    for name, fn in pieces:
        s = host_us_samples(fn, args.calls, args.repeats)
        rows.append(dict(piece=name, host_us=statistics.median(s), host_us_min=min(s)))
        print(f"{name:<40} {rows[-1]['host_us']:8.1f} {rows[-1]['host_us_min']:8.1f}", flush=True)
    # the Python short path's backward as the engine runs it (its worker thread): the time inside
    # Entry.backward per call
    inside, real = [], fast.Entry.backward

    def timed(self, *a):
        t0 = time.perf_counter()
        try:
            return real(self, *a)
        finally:
            inside.append((time.perf_counter() - t0) * 1e6)

    fast.Entry.backward = timed
    try:
        host_us_samples(python(lambda: torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do)), args.calls,
                        args.repeats)
    finally:
        fast.Entry.backward = real
    rows.append(dict(piece="bwd: entry.backward inside the engine", host_us=statistics.median(inside),
                     host_us_min=min(inside)))
    print(f"{rows[-1]['piece']:<40} {rows[-1]['host_us']:8.1f} {rows[-1]['host_us_min']:8.1f}", flush=True)
    meta = dict(environment(dev), B=B, H=H, N=N, D=D, mask="random3 (density 0.094)", calls=args.calls,
                repeats=args.repeats, native_plan=bool(entry.native), native_bwd_layouts=entry.native.n_bwd
                if entry.native else 0)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = {k: meta.get(k) for k in ("device_name", "torch", "triton", "sparseflash", "commit", "date")}
        rows = [dict(r, **stamp) for r in rows]  # every row says where and when it ran
        (out / "pieces.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        with open(out / "pieces.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
