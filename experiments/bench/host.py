"""Host cost per call against GPU time: how much of a short call the host bounds.

    python -m sparseflash.experiments.bench.host --out DIR [--seq-len 4096] [--head-dims 64 128] [--blocks 3]
    python -m sparseflash.experiments.bench.host --device cpu --out DIR   (smoke run: kernels are no-ops, labelled)

bf16, batch x heads = tokens // seq_len x 16 (default 4 x 16 at 4K tokens), one side-by-side run:

- ``part=host``: host microseconds to issue one call (`timing.host_us_samples`: the wall time of
  issuing calls while the GPU sleeps, so no launch waits for it; ``host_us`` the median and
  ``host_us_min`` the least over ``--repeats`` batches: lent machines are noisy), forward (no grad) and
  forward + backward (``torch.autograd.grad``), for each head dim, dense and a random mask of
  ``--blocks`` 128-blocks per row (density 3/32 = 0.094 at 4K), without and with ``key_lengths``.
  Providers (``--providers``): ``sparseflash`` (the default: repeat calls take the short path,
  `sparseflash.flash.fast`, run by its native plan, `sparseflash.flash.native`),
  ``sparseflash-python`` (the short path in Python with bound launches), ``sparseflash-general`` (short path off: every
  call validated and planned, bound launches), ``sparseflash-unbound`` (also
  ``binding.FAST_LAUNCH = False``: every launch through Triton's own path), ``sdpa``
  (``F.scaled_dot_product_attention``, dense; with key_lengths a boolean key-padding mask) as
  the anchor, and ``autograd-floor`` (dense, no key_lengths: a Python autograd Function that
  allocates our outputs and launches nothing, what PyTorch charges any such op; ours minus it is
  our own Python and launch cost). Rows with key_lengths run with
  ``sparseflash.api.CHECK_KEY_LENGTHS = False``: the check reads the lengths back, a host
  synchronisation, which would wait out the GPU's sleep (its cost shows in ``part=eager``).
- ``part=eager``: forward + backward as a training step issues them, back to back
  (`timing.stream_ms`, ``eager_ms``), against two GPU times: the call replayed from a CUDA graph
  (`timing.graph_ms`, ``gpu_ms``; a capture takes the general path, whose kernels can differ
  from the short path's: TMA descriptors, so the Hopper kernels, at any size) and the eager
  call's own kernels as the profiler records them (`timing.kernel_ms`, ``kernel_ms``, each
  kernel's share in ``kernels``). ``eager_over_kernels`` is the goal's ratio (<= 1.15 at 4K,
  density 0.1): what the host and the gaps between launches add to the same call's GPU time.
  Every case is measured ``--rounds`` times, the rounds interleaved in alternating order; the
  row keeps the medians and the range of the ratio. Mask rows also with key_lengths, checked and
  not; ours with the short path and without it.

Writes DIR/host.csv and DIR/host.json and prints a table. On CPU (``--device cpu``) the kernels
are replaced by no-ops (`studies.host_cost.host_python.stubbed_kernels`), host times are
plain wall time per call and there is no eager part: a check that the script runs, not a figure.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import statistics
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command

COLUMNS = ["part", "provider", "pass", "head_dim", "mask", "density", "key_lengths", "kl_checked", "host_us",
           "host_us_min", "eager_ms", "gpu_ms", "eager_over_gpu", "kernel_ms", "eager_over_kernels",
           "eager_over_kernels_min", "eager_over_kernels_max", "rounds", "kernels", "B", "H", "N", "device_name", "torch", "triton", "commit", "date"]


PROVIDERS = ("sparseflash", "sparseflash-python", "sparseflash-general", "sparseflash-unbound", "sdpa",
             "autograd-floor")


@contextlib.contextmanager
def _settings(provider: str = "sparseflash", check_key_lengths: bool = True):
    """Our switches for ``provider``: the native plan (`sparseflash.flash.native`) off for
    "sparseflash-python", the whole short path (`sparseflash.flash.fast`) off for
    "sparseflash-general", bound launches also off for "sparseflash-unbound"."""
    from sparseflash import api
    from sparseflash.flash import binding, fast, native

    saved = binding.FAST_LAUNCH, fast.ENABLED, native.ENABLED, api.CHECK_KEY_LENGTHS
    binding.FAST_LAUNCH = provider != "sparseflash-unbound"
    fast.ENABLED = provider in ("sparseflash", "sparseflash-python")
    native.ENABLED = provider == "sparseflash" and saved[2]
    api.CHECK_KEY_LENGTHS = check_key_lengths
    try:
        yield
    finally:
        binding.FAST_LAUNCH, fast.ENABLED, native.ENABLED, api.CHECK_KEY_LENGTHS = saved


class _Floor(torch.autograd.Function):
    """A Python autograd Function that allocates what ours does (o, lse; dq, dk, dv, delta) and
    launches nothing: what PyTorch itself costs a custom op of ours, the floor of our own cost."""

    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _calls(provider, q, k, v, do, mask, klen):
    """(forward, forward + backward) of ``provider`` on these inputs."""
    import torch.nn.functional as F

    import sparseflash

    if provider == "sdpa":
        am = None if klen is None else (torch.arange(k.shape[2], device=k.device) < klen[:, None])[:, None, None, :]

        def attn(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=am)
    elif provider == "autograd-floor":
        def attn(q_, k_, v_):
            return _Floor.apply(q_, k_, v_)
    else:
        def attn(q_, k_, v_):
            return sparseflash.attention(q_, k_, v_, mask=mask, key_lengths=klen)

    qd, kd, vd = (t.detach() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            attn(qd, kd, vd)

    def fwd_bwd():
        torch.autograd.grad(attn(q, k, v), (q, k, v), do)

    return fwd, fwd_bwd


def run(device: torch.device, seq_len: int = 4096, head_dims=(64, 128), blocks: int = 3, tokens: int = 16384,
        heads: int = 16, calls: int = 30, eager: bool = True, providers=PROVIDERS, repeats: int = 5,
        host: bool = True, rounds: int = 3) -> list[dict]:
    from sparseflash.experiments.bench.timing import graph_ms, host_us_samples, kernel_ms, stream_ms, wall_us
    from sparseflash.patterns import random as random_mask

    cuda = device.type == "cuda"
    B, H, N = max(1, tokens // seq_len), heads, seq_len
    nb = math.ceil(N / 128)
    def timer(fn):  # (median, min) over the batches
        samples = host_us_samples(fn, calls, repeats) if cuda else [wall_us(fn, calls, 1) for _ in range(repeats)]
        return statistics.median(samples), min(samples)
    rows = []

    def add(**r):
        rows.append(dict(B=B, H=H, N=N, **r))
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()
                        if k != "kernels"), flush=True)

    for D in head_dims:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4))
        if not cuda:  # stride-0 views: the no-op kernels touch nothing, keep the allocations small
            q, k, v, do = (t[:, :, :1].expand(B, H, N, D).contiguous() for t in (q, k, v, do))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        klen_t = torch.full((B,), N, dtype=torch.int32, device=device)
        klen_t[-1] = N - 77  # a padded row
        masks = {"dense": None, f"random{blocks}": random_mask(N, blocks, block_size=128, seed=0, device=device)}
        for m in masks.values():
            if m is not None:
                m.index(device)  # the sort outside the timed calls, as a model's first step does
        # host part
        for mname, mask in masks.items() if host else ():
            density = 1.0 if mask is None else blocks / nb
            for kl in (False, True):
                klen = klen_t if kl else None
                for prov in providers:
                    if prov == "sdpa" and mask is not None or prov == "autograd-floor" and (mask is not None or kl):
                        continue
                    fwd, fwd_bwd = _calls(prov, q, k, v, do, mask, klen)
                    with _settings(prov, check_key_lengths=False):
                        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                            med, low = timer(fn)
                            add(part="host", provider=prov, **{"pass": name}, head_dim=D, mask=mname,
                                density=density, key_lengths=kl, kl_checked=False, host_us=med, host_us_min=low)
        if not (eager and cuda):
            continue
        # eager against GPU time, the cases interleaved over rounds (alternating order)
        cases = []
        for mname, mask in masks.items():
            ours = [p for p in ("sparseflash", "sparseflash-python", "sparseflash-general") if p in providers]
            cases += [(mname, mask, p, None, True) for p in ours] + (
                [(mname, mask, "sdpa", None, True)] if mask is None and "sdpa" in providers else
                [(mname, mask, p, klen_t, c) for p in ours for c in (True, False)] if mask is not None else [])
        samples: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(cases))}
        names: dict[int, dict[str, float]] = {}
        for rnd in range(rounds):
            for i in (range(len(cases)) if rnd % 2 == 0 else reversed(range(len(cases)))):
                _, mask, prov, klen, checked = cases[i]
                _, fwd_bwd = _calls(prov, q, k, v, do, mask, klen)
                with _settings(prov, check_key_lengths=checked):
                    e = stream_ms(fwd_bwd, calls=10)
                    gpu = graph_ms(fwd_bwd, rep_ms=50)
                    kern, names[i] = kernel_ms(fwd_bwd)
                samples[i].append((e, gpu, kern))
        for i, (mname, mask, prov, klen, checked) in enumerate(cases):
            e, gpu, kern = (statistics.median(x[j] for x in samples[i]) for j in range(3))
            by_kernels = [x[0] / x[2] for x in samples[i]]
            add(part="eager", provider=prov, **{"pass": "fwd+bwd"}, head_dim=D, mask=mname,
                density=1.0 if mask is None else blocks / nb, key_lengths=klen is not None,
                kl_checked=checked and klen is not None, eager_ms=e, gpu_ms=gpu, eager_over_gpu=e / gpu,
                kernel_ms=kern, eager_over_kernels=statistics.median(by_kernels),
                eager_over_kernels_min=min(by_kernels), eager_over_kernels_max=max(by_kernels), rounds=rounds,
                kernels=";".join(f"{n}={t:.4f}" for n, t in sorted(names[i].items(), key=lambda t: -t[1])))
    return rows


def table(rows: list[dict]) -> str:
    """The host part as one line per setting (providers side by side) and the eager part."""
    out = []
    host = [r for r in rows if r["part"] == "host"]
    keys = sorted({(r["head_dim"], r["mask"], r["key_lengths"], r["pass"]) for r in host},
                  key=lambda t: (t[0], t[1] != "dense", t[2], t[3]))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in host)]
    out.append(f"{'host us per call':<24}" + "".join(f"{p:>21}" for p in provs))
    for key in keys:
        cells = {r["provider"]: r["host_us"] for r in host if (r["head_dim"], r["mask"], r["key_lengths"], r["pass"]) == key}
        label = f"d={key[0]} {key[1]}{' kl' if key[2] else ''} {key[3]}"
        out.append(f"{label:<24}" + "".join(f"{cells[p]:21.1f}" if p in cells else f"{'':>21}" for p in provs))
    eager = [r for r in rows if r["part"] == "eager"]
    if eager:
        out.append(f"\n{'fwd+bwd':<24}{'provider':<20}{'eager ms':>10}{'graph ms':>10}{'eager/graph':>12}"
                   f"{'kernels ms':>11}{'eager/kernels (range)':>24}")
        for r in eager:
            label = f"d={r['head_dim']} {r['mask']}" + (f" kl{'(checked)' if r['kl_checked'] else ''}"
                                                          if r["key_lengths"] else "")
            out.append(f"{label:<24}{r['provider']:<20}{r['eager_ms']:10.4f}{r['gpu_ms']:10.4f}{r['eager_over_gpu']:12.2f}"
                       f"{r['kernel_ms']:11.4f}{r['eager_over_kernels']:8.2f} ({r['eager_over_kernels_min']:.2f}-"
                       f"{r['eager_over_kernels_max']:.2f})")
    return "\n".join(out)


def write(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shared = {k: meta.get(k) for k in ("device_name", "torch", "triton", "commit", "date")}
    with open(out / "host.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**shared, **r})
    with open(out / "host.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    from sparseflash.experiments.bench.results import environment

    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.host", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--seq-len", type=positive_int, default=4096)
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--blocks", type=positive_int, default=3, help="128-blocks per row of the random mask")
    ap.add_argument("--tokens", type=positive_int, default=16384, help="batch = tokens // seq_len")
    ap.add_argument("--heads", type=positive_int, default=16)
    ap.add_argument("--calls", type=positive_int, default=30, help="calls per timed batch of the host part")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed batches per host row (median and min kept)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager-against-GPU part")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="eager part: measure every case this many times, interleaved in alternating order; "
                         "medians over the rounds (and the range of eager_over_kernels) are kept")
    ap.add_argument("--no-host", action="store_true", help="skip the host part")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS,
                    help="sparseflash (short path with its native plan), sparseflash-python (short path, "
                         "native plan off), sparseflash-general (short path off), sparseflash-unbound "
                         "(also bound launches off), sdpa, autograd-floor (a Python autograd Function that "
                         "allocates our outputs and launches nothing)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU")
    check_output_dir(args.out)
    if device.type == "cuda" and "sparseflash" in args.providers:
        from sparseflash.flash import native

        native.load()  # built before timing, not in the background of the first rows
    kw = dict(seq_len=args.seq_len, head_dims=args.head_dims, blocks=args.blocks, tokens=args.tokens,
              heads=args.heads, calls=args.calls, eager=not args.no_eager, providers=args.providers,
              repeats=args.repeats, host=not args.no_host, rounds=args.rounds)
    if device.type == "cpu":
        from sparseflash.experiments.studies.host_cost.host_python import stubbed_kernels

        with stubbed_kernels():
            rows = run(device, **kw)
    else:
        rows = run(device, **kw)
    meta = dict(environment(device), bench="host", args=vars(args),
                method="host_us / host_us_min: median / min over --repeats batches of issuing --calls calls while "
                       "the GPU sleeps (timing.host_us_samples); eager_ms: timing.stream_ms; "
                       "gpu_ms: timing.graph_ms (CUDA-graph replay); kernel_ms: timing.kernel_ms (the eager "
                       "call's own kernels, profiled); eager part: medians over --rounds interleaved rounds" if device.type == "cuda" else
                       "CPU smoke run: kernels are no-ops; host_us is wall time per call")
    write(rows, meta, Path(args.out))
    print()
    print(table(rows))
    print(f"\nwrote {Path(args.out) / 'host.csv'} and host.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
