"""Host time of an eager `flash_attn_with_kvcache` call on a CPU, its kernel launches stubbed (README.md:
question, method, answer).

    python -m sparseflash.experiments.studies.decode_host.host_cpu --out DIR [--label after] [--calls 2000]
        [--variants default,both] [--overrides KEY=VALUE ...]

The issue's decode shapes (GQA 32 query heads / 8 kv heads, d 128, bf16, one query token, a 16K cache) at
batch 1 and 16, on CPU tensors, in two calls: ``read`` (``cache_seqlens`` a tensor, no new keys: the
decode bench's call) and ``append`` (one new key and value appended, as a serving loop calls it). The
Triton kernels of `sparseflash.flash.decode` are replaced by stand-ins whose launch does nothing, and the
launchers are made to take their bound route (an H200's 132 SMs for the split count), so what is timed is
every line of Python and every torch op between the call and the C launcher: what a GPU host pays per
call on top of its launches. Per call: host µs (10th percentile and median of ``--calls`` calls after
warm-up, the 10th as other work on a shared machine only ever adds time; of the median of ``--repeats``
such runs, spread over the whole measurement; "best": the least 10th percentile of those runs), the aten
ops it dispatches (on a GPU each one that computes is a launch or an allocation), the Triton launches,
and the host reads (``.cpu()``, ``.item()``, ``.tolist()``, ``bool()`` / ``int()`` of a tensor: each a
device-to-host copy and a stream synchronisation on a GPU, free here). ``--variants``: the same calls
under each named set of `sparseflash.flash.decode.OVERRIDES` switches (`decode_host.VARIANTS`;
``--overrides`` adds one of its own, "custom"), their rows timed in turn in the same run. Writes
DIR/host_cpu[_LABEL].json and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sparseflash.cmdline import ArgumentParser, positive_int, run_command
from sparseflash.experiments.studies.decode_host import VARIANTS

H, HK, D, N = 32, 8, 128, 16384
BATCHES = (1, 16)


class _Compiled:
    """What Triton's launch returns, reduced to what a bound launch calls."""
    function, packed_metadata = 1, (4, 1, 0)

    def __init__(self, counter, name):
        self.counter, self.name = counter, name

    def run(self, *args):
        self.counter[self.name] += 1


class _Kernel:
    """A kernel's signature; launching it counts and gives a `_Compiled` (no compilation, no work but
    the bounds check's verdict "every bound holds" in its ``Ok`` buffer, which its bound launches reuse)."""

    def __init__(self, fn, counter, name):
        self.fn, self.pre_run_hooks, self.counter, self.name = fn, [], counter, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[self.name] += 1
            if isinstance(kwargs.get("Ok"), torch.Tensor):
                kwargs["Ok"].fill_(1)
            return _Compiled(self.counter, self.name)
        return launch


class _Ops(TorchDispatchMode):
    """aten ops by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


_READS = {torch.Tensor.cpu: "cpu", torch.Tensor.item: "item", torch.Tensor.tolist: "tolist",
          torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int", torch.Tensor.__index__: "index"}


class _Reads(TorchFunctionMode):
    """Host reads of tensor values (a synchronisation each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _READS.get(func)
        if name is not None:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def stub(launches: Counter):
    """Stand-in kernels and a bound launch route on this CPU; returns a function that undoes it all."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from sparseflash import kvcache
    from sparseflash.flash import binding, decode

    saved = []

    def put(obj, name, value):
        if hasattr(obj, name):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    for name, k in list(vars(decode).items()):  # every Triton kernel of the decode module
        if isinstance(k, (JITFunction, InterpretedFunction)):
            put(decode, name, _Kernel(k.fn, launches, name))
    put(decode, "sm_count", lambda device: 132)
    put(decode, "INTERPRETING", False)
    put(decode, "bound_launches", lambda device: True)  # the plans' route (this branch)
    put(binding, "_HAS_CUDA", True)  # `binding.call`'s route (the commit before)
    put(binding, "has_cuda", lambda: True)
    put(binding, "current_device", lambda: 0)
    put(binding, "raw_stream", lambda index: 0)
    put(binding.tiles, "INTERPRETING", False)
    for module, name in ((decode, "PLANS"), (decode, "CHECKS"), (decode, "APPENDS"), (kvcache, "PLANS")):
        put(module, name, {})  # plans of the stand-ins, dropped after

    def undo():
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
    return undo


def calls(batch: int):
    """The timed calls at one batch: {name: fn}."""
    import sparseflash

    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, 1, H, D, generator=g).to(torch.bfloat16)
    kc, vc = (torch.empty(batch, N, HK, D, dtype=torch.bfloat16) for _ in range(2))
    kn, vn = (torch.randn(batch, 1, HK, D, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), N - 100, dtype=torch.int32)

    def read():
        return sparseflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    def append():
        return sparseflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)

    return dict(read=read, append=append)


def switches(overrides: dict):
    """decode.OVERRIDES set to ``overrides`` inside (restored after): set around a row's timed calls, so
    a call pays no switching of its own."""
    from sparseflash.flash import decode

    return decode.overridden(overrides)


def _override(text: str) -> tuple:
    """KEY=VALUE, the value an int (1: on) or else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key, int(value) if value.lstrip("-").isdigit() else value


def host_us(fn, n: int) -> tuple[float, float]:
    """(10th percentile, median) µs of ``n`` calls of ``fn`` after 50 warm-up calls."""
    for _ in range(50):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.quantiles(ts, n=10)[0], 1e6 * statistics.median(ts)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.decode_host.host_cpu",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="", help="a name for this run (e.g. before, after)")
    ap.add_argument("--calls", type=positive_int, default=2000)
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="timed runs of --calls calls per row, spread over the rows (the median run is reported)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--profile", action="store_true", help="also print the top functions of each call by own time")
    ap.add_argument("--variants", default="default",
                    help=f"comma-separated sets of decode switches, of {', '.join(VARIANTS)}")
    ap.add_argument("--overrides", nargs="+", type=_override, default=[], metavar="KEY=VALUE",
                    help="one more variant, 'custom': these decode.OVERRIDES (e.g. fused_combine=1 check_in_split=0)")
    args = ap.parse_args(argv)
    variants = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"--variants: unknown {name!r}; known: {', '.join(VARIANTS)}")
        variants[name] = VARIANTS[name]
    if args.overrides:
        variants["custom"] = dict(args.overrides)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel path for CPU tensors (its launches stubbed)
    torch.set_num_threads(1)
    launches = Counter()
    undo = stub(launches)
    rows, fns = [], []
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            for name, call in calls(batch).items():
                for variant, overrides in variants.items():
                    with switches(overrides):
                        call()
                        launches.clear()
                        with _Ops() as ops, _Reads() as reads:
                            out = call()
                    assert out.shape == (batch, 1, H, D) and sum(launches.values()) > 0, "the kernel path was not taken"
                    one = dict(launches)
                    rows.append(dict(call=name, batch=batch, variant=variant, overrides=overrides, cache_len=N,
                                     heads=H, kv_heads=HK, head_dim=D, aten_ops=sum(ops.ops.values()),
                                     host_reads=sum(reads.reads.values()), triton_launches=sum(one.values()),
                                     launches=one, ops=dict(ops.ops.most_common()), reads=dict(reads.reads), runs=[]))
                    fns.append(call)
        for _ in range(args.repeats):  # each row's runs spread over the whole measurement (the CPU is shared)
            for r, fn in zip(rows, fns):
                with switches(r["overrides"]):
                    r["runs"].append(host_us(fn, args.calls))
        for r, fn in zip(rows, fns):
            r["host_us_p10"], r["host_us_median"] = sorted(r["runs"])[len(r["runs"]) // 2]
            r["host_us_p10_best"] = min(p10 for p10, _ in r["runs"])  # (the run the machine disturbed least)
            if args.profile:
                from sparseflash.experiments.bench.timing import profile_text

                print(f"--- {r['call']} B{r['batch']} {r['variant']}")
                with switches(r["overrides"]):
                    print(profile_text(fn, min(args.calls, 500), 20))
    finally:
        undo()
    from sparseflash.experiments.bench.results import environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_cpu{('_' + args.label) if args.label else ''}.json"
    meta = dict(environment(torch.device("cpu")), label=args.label, calls=args.calls)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")
    print(f"{'call':>7} {'B':>3} {'variant':>10} {'us p10':>7} {'median':>7} {'best':>6} {'aten ops':>8} "
          f"{'host reads':>10} {'launches':>8}")
    for r in rows:
        print(f"{r['call']:>7} {r['batch']:>3} {r['variant']:>10} {r['host_us_p10']:>7.1f} {r['host_us_median']:>7.1f} "
              f"{r['host_us_p10_best']:>6.1f} {r['aten_ops']:>8} {r['host_reads']:>10} {r['triton_launches']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
