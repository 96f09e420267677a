"""Context-parallel benchmark of `sparseflash.distributed` on the GPUs of one host (torchrun).

    torchrun --nproc-per-node 4 -m sparseflash.experiments.bench.context_parallel \
        --out experiments/results/context-parallel

1. Correctness (small, ``--check-len``): bf16 outputs and q/k/v gradients of the context-parallel op and
   of one GPU against a float64 reference (`sparseflash.attention`, backend "reference") on causal,
   packed documents and butterfly masks; a row passes when the distributed error is at most twice the
   one-GPU error plus 1e-3.
2. Timings, fwd+bwd, bf16 (``--heads``, ``--dim``): dense causal at ``--dense-lens``; local window
   ``--window`` causal, documents (lengths drawn from 2K-64K) and butterfly at ``--sparse-lens``.
   Providers: ``sparseflash-cp`` (this module, W GPUs, stages of ``--stage-tokens``; ``sparseflash-cp-lists``
   with ``--own-stage-lists``: a causal plan's own stage through block lists and bits), ``sparseflash-1gpu``
   (rank 0 alone, the full sequence; skipped above ``--one-gpu-max``), ``torch-cp-allgather`` and
   ``torch-cp-alltoall`` (torch's ``context_parallel`` over SDPA's cuDNN backend, dense causal only, with
   each of its rotate methods (``--torch-methods``): all-gather the keys/values once, or pass them round
   the ring one permute a step; CUDA only). Timing: CUDA events around each of ``--reps`` calls after
   ``--warmup`` calls, all ranks in step (a barrier before each call), median.
   Each row also has: bytes sent, summed over ranks, in one fwd+bwd (``sent_bytes``: counted as sent;
   for sparseflash ``plan_bytes`` is what the plan says it must be; for torch the bytes its collectives
   move out of each rank: a permute its input, an all-gather W - 1 times its input), the busiest rank's
   work over the mean, and per rank (CUDA) the peak allocated during one fwd+bwd (``peak_gib``, the
   busiest rank; ``peak_gib_ranks``, every rank) and that peak beyond what the step found allocated and
   the gradients it leaves (``extra_gib``, ``extra_gib_ranks``: what the method itself needs beyond the
   local q, k, v, dO and their gradients).

``fwd_ms``: the forward alone (no autograd), beside each fwd+bwd ``ms``. ``--profile``: one fwd+bwd of each case
under torch.profiler per rank (and the one-GPU call), top operators and kernels by device time in OUT/profile/.

Writes ``OUT/context_parallel.csv`` (one row per measurement, GPU / versions / commit / date columns; a
re-run replaces the rows of the same kind, case, length, GPU count and provider and keeps the others, so
runs per length or per GPU count make one table) and ``OUT/context_parallel.png`` (time and memory per
rank, from every row of the file), and prints a table last. The issue's set at 4 GPUs, in commands that
each fit a few minutes::

    B="torchrun --nproc-per-node 4 -m sparseflash.experiments.bench.context_parallel --out DIR"
    $B --dense-lens 131072,262144,524288 --sparse-lens ""
    $B --skip-check --dense-lens 1048576 --sparse-lens "" --one-gpu-max 0
    $B --skip-check --dense-lens "" --sparse-lens 1048576
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import sparseflash
import sparseflash.distributed as sfd
from sparseflash import BlockMask

FIELDS = ["kind", "case", "seq_len", "world", "provider", "ms", "fwd_ms", "speedup_vs_1gpu", "err_out", "err_dq", "err_dk",
          "err_dv", "err_1gpu_max", "passed", "plan_bytes", "sent_bytes", "work_max_over_mean", "placement",
          "plan_s", "peak_gib", "peak_gib_ranks", "extra_gib", "extra_gib_ranks", "stage_tokens", "heads",
          "head_dim", "gpu", "torch", "triton", "commit", "date", "error"]
KEY = ("kind", "case", "seq_len", "world", "provider")  # a re-run replaces the rows it measures again


def _commit() -> str:
    if os.environ.get("SPARSEFLASH_COMMIT"):  # a tree without .git (a snapshot sent to a GPU host) names its commit
        return os.environ["SPARSEFLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def doc_ids(n: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    """Packed-document ids ``[n]`` with document lengths drawn uniformly from ``[lo, hi]`` (the last cut)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < n:
        m = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), n - total)
        lengths.append(m)
        total += m
    return torch.cat([torch.full((m,), i, dtype=torch.int32) for i, m in enumerate(lengths)])


def window_mask(n: int, window: int, block: int, device) -> BlockMask:
    """Causal local window: query i attends keys i-window+1 .. i (built from key ranges: O(n) memory)."""
    i = torch.arange(n, device=device)
    ranges = torch.stack([(i - window + 1).clamp(min=0), i + 1], dim=-1)[None]
    return BlockMask.from_key_ranges(ranges, n, block_size=block)


def cases(kind: str, n: int, args, device):
    """Plan keyword arguments of a named case (documents' ids stay on the CPU for the plan)."""
    if kind == "dense-causal":
        return {"causal": True}
    if kind == "window":
        return {"mask": window_mask(n, args.window, args.block, device)}
    if kind == "documents":
        return {"causal": True, "segment_ids": doc_ids(n, 2048, 65536)}
    if kind == "butterfly":
        from sparseflash.patterns import butterfly

        return {"mask": butterfly(n, block_size=args.block, device=device)}
    raise ValueError(f"unknown case {kind!r}")


def one_gpu_call(q, k, v, kw, dtype_backend="auto"):
    seg = kw.get("segment_ids")
    return sparseflash.attention(q, k, v, kw.get("mask"), causal=kw.get("causal", False),
                                 segment_ids=None if seg is None else seg.to(q.device)[None], backend=dtype_backend)


def _time(fn, warmup: int, reps: int, sync_group=True) -> float:
    """Median ms of ``fn`` (CUDA events on a GPU; wall time in the CPU smoke mode)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if sync_group:
            dist.barrier()
        sync()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            sync()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def profile(step, path: str, device) -> None:
    """One call of ``step`` under torch.profiler: the operators and kernels by total device time (CPU time
    off CUDA), the top 40 as a table in ``path``; where a rank's time goes (the stages' kernels, the
    merges, the copies, NCCL's waits)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    table = prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=40)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)


def step_memory(step, inputs, device) -> tuple:
    """(peak GiB, extra GiB) of one call of ``step`` on this rank: the peak allocated while it ran, and
    that peak beyond what was allocated when it started (``inputs``' gradients dropped first) and the
    gradients it leaves on ``inputs``; ("", "") off CUDA."""
    if device.type != "cuda":
        step()
        return "", ""
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in inputs if t.grad is not None)
    return peak / 2**30, (peak - start - grads) / 2**30


def every_rank(values: tuple, device) -> list:
    """Each rank's ``values`` (floats; "" off CUDA, the same on every rank): a list per value."""
    if values[0] == "":
        return [[""] for _ in values]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    return [[float(t[i]) for t in got] for i in range(len(values))]


def memory_fields(per_rank: list) -> dict:
    """Row fields from `every_rank` of (peak, extra): the busiest rank's and every rank's (``;``-joined)."""
    out = {}
    for name, vals in zip(("peak_gib", "extra_gib"), per_rank):
        if vals[0] != "":
            out[name], out[name + "_ranks"] = max(vals), ";".join(f"{x:.3f}" for x in vals)
    return out


def _tensors(n, args, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, args.heads, n, args.dim)
    return [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4)]


def check(args, base, device, rank, world):
    rows = []
    n = args.check_len
    for kind in ("dense-causal", "documents", "butterfly"):
        kw = cases(kind, n, args, device)
        if kind == "documents":
            kw["segment_ids"] = doc_ids(n, 100, 2000)
        q, k, v, do = _tensors(n, args, device, torch.float32, seed=1)
        grads = {}
        for name, dtype in (("ref64", torch.float64), ("1gpu", torch.bfloat16)):
            qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
            o = one_gpu_call(qq, kk, vv, kw, "reference" if dtype == torch.float64 else args.backend)
            o.backward(do.to(dtype))
            grads[name] = [o.detach().double(), qq.grad.double(), kk.grad.double(), vv.grad.double()]
        plan = sfd.plan(n, None, block_size=args.block, stage_tokens=args.stage_tokens, **kw)
        qq, kk, vv = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
        o = plan.unshard(sfd.attention(plan.shard(qq), plan.shard(kk), plan.shard(vv), plan, backend=args.backend))
        o.backward(do.to(torch.bfloat16))
        gs = [qq.grad.float(), kk.grad.float(), vv.grad.float()]
        for t in gs:
            dist.all_reduce(t)
        dist_vals = [o.detach().double()] + [t.double() for t in gs]
        errs = [float((a - r).abs().max()) for a, r in zip(dist_vals, grads["ref64"])]
        one = [float((a - r).abs().max()) for a, r in zip(grads["1gpu"], grads["ref64"])]
        passed = all(e <= 2 * o1 + 1e-3 for e, o1 in zip(errs, one))
        rows.append(dict(base, kind="check", case=kind, seq_len=n, provider=_cp_name(args), err_out=errs[0],
                         err_dq=errs[1], err_dk=errs[2], err_dv=errs[3], err_1gpu_max=max(one), passed=passed,
                         placement=plan.placement))
    return rows


def timing(args, base, device, rank, world, kind, n):
    rows = []
    kw = cases(kind, n, args, device)
    t0 = time.perf_counter()
    plan = sfd.plan(n, None, block_size=args.block, stage_tokens=args.stage_tokens, **kw)
    plan_s = time.perf_counter() - t0
    q, k, v, do = _tensors(n, args, device, torch.bfloat16)
    ql, kl, vl, dol = (plan.shard(t).detach().requires_grad_() for t in (q, k, v, do))

    def step():
        o = sfd.attention(ql, kl, vl, plan, backend=args.backend)
        o.backward(dol)

    plan.bytes_sent = 0
    step()  # first call: compile, build the sub-masks' bits
    sent = torch.tensor([plan.bytes_sent], device=device, dtype=torch.float64)
    planned = torch.tensor([plan.expected_bytes(kl, vl, backward=True)], device=device, dtype=torch.float64)
    dist.all_reduce(sent)
    dist.all_reduce(planned)
    ms = _time(step, args.warmup, args.reps)

    def forward():
        with torch.no_grad():
            sfd.attention(ql, kl, vl, plan, backend=args.backend)

    fwd_ms = _time(forward, args.warmup, args.reps)
    mem = memory_fields(every_rank(step_memory(step, (ql, kl, vl), device), device))
    if args.profile:
        profile(step, os.path.join(args.out, "profile", f"{kind}-{n}-cp-rank{rank}.txt"), device)
    work = plan.work
    rows.append(dict(base, kind="time", case=kind, seq_len=n, provider=_cp_name(args), ms=ms, fwd_ms=fwd_ms,
                     plan_bytes=int(planned.item()), sent_bytes=int(sent.item()),
                     work_max_over_mean=max(work) / max(1e-9, statistics.mean(work)), placement=plan.placement,
                     plan_s=plan_s, stage_tokens=plan.stage_blocks * args.block, **mem))
    del ql, kl, vl, dol, plan
    one_ms = None
    if n <= args.one_gpu_max:
        if rank == 0:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

            def one():
                one_gpu_call(qq, kk, vv, kw, args.backend).backward(do)

            def one_forward():
                with torch.no_grad():
                    one_gpu_call(qq, kk, vv, kw, args.backend)

            one_ms = _time(one, args.warmup, args.reps, sync_group=False)
            one_fwd = _time(one_forward, args.warmup, args.reps, sync_group=False)
            mem = memory_fields([[x] for x in step_memory(one, (qq, kk, vv), device)])
            if args.profile:
                profile(one, os.path.join(args.out, "profile", f"{kind}-{n}-1gpu.txt"), device)
            rows.append(dict(base, kind="time", case=kind, seq_len=n, provider="sparseflash-1gpu", world=1, ms=one_ms,
                             fwd_ms=one_fwd, **mem))
            del qq, kk, vv
        dist.barrier()
        t = torch.tensor([one_ms or 0.0], device=device)
        dist.broadcast(t, 0)
        one_ms = float(t.item())
        rows[0]["speedup_vs_1gpu"] = one_ms / ms
    if kind == "dense-causal" and not args.skip_torch_cp and device.type == "cuda":
        for method in args.torch_methods:
            row = dict(base, kind="time", case=kind, seq_len=n, provider=f"torch-cp-{method}")
            try:
                row.update(torch_cp(args, q, k, v, do, world, device, method))
                if one_ms:
                    row["speedup_vs_1gpu"] = one_ms / row["ms"]
            except Exception as e:  # noqa: BLE001 - an unavailable or failing baseline is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.empty_cache()
            rows.append(row)
    return rows


class TorchBytes:
    """Counts the bytes torch's context parallelism sends from this rank while it is entered: its
    attention module moves keys / values (and their gradients) through the functional collectives it
    holds as ``ft_c``: ``permute_tensor`` sends its input to one rank (the ring's step),
    ``all_gather_single`` sends W - 1 times its input (a ring all-gather). ``bytes`` None: the module
    has no ``ft_c`` (another torch) and nothing was counted."""

    def __init__(self, module, world: int):
        self.module, self.world, self.bytes = module, world, None

    def __enter__(self):
        self.orig = getattr(self.module, "ft_c", None)
        if self.orig is None:
            return self
        self.bytes = 0
        counter, orig = self, self.orig

        class Counted:
            def __getattr__(self, name):
                return getattr(orig, name)

            def permute_tensor(self, t, *a, **kw):
                counter.bytes += t.numel() * t.element_size()
                return orig.permute_tensor(t, *a, **kw)

            def all_gather_single(self, t, *a, **kw):
                counter.bytes += (counter.world - 1) * t.numel() * t.element_size()
                return orig.all_gather_single(t, *a, **kw)

        self.module.ft_c = Counted()
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            self.module.ft_c = self.orig
        return False


def torch_cp(args, q, k, v, do, world, device, method: str) -> dict:
    """Row fields of torch's ``context_parallel`` (SDPA, cuDNN backend; its default load balancing) with
    rotate method ``method`` ("allgather" or "alltoall"): ms, bytes sent (summed over ranks), memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = sys.modules[set_rotate_method.__module__]  # where the method and its collectives live
    before = module._cp_options.rotate_method
    set_rotate_method(method)
    try:
        mesh = init_device_mesh("cuda", (world,))
        bufs = [q.clone(), k.clone(), v.clone(), do.clone()]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            qs, ks, vs, dos = bufs
            qs, ks, vs = (t.detach().requires_grad_() for t in (qs, ks, vs))

            def step():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                o.backward(dos)

            with TorchBytes(module, world) as counted:
                step()
            ms = _time(step, args.warmup, args.reps)
            mem = memory_fields(every_rank(step_memory(step, (qs, ks, vs), device), device))
    finally:
        module._cp_options.rotate_method = before
    out = dict(ms=ms, **mem)
    if counted.bytes is not None:
        sent = torch.tensor([float(counted.bytes)], device=device, dtype=torch.float64)
        dist.all_reduce(sent)
        out["sent_bytes"] = int(sent.item())
    return out


def plot(rows, path):
    """Two panels from the rows: fwd+bwd ms and the busiest rank's extra memory, per case and length, a bar
    per provider and GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure

    timed = [r for r in rows if r["kind"] == "time" and r.get("ms") not in ("", None)]
    labels = sorted({(r["case"], int(r["seq_len"])) for r in timed})
    provs = sorted({(r["provider"], int(r["world"])) for r in timed})
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(labels)), 4.2))
    width = 0.8 / max(1, len(provs))
    for ax, field, ylabel in ((axes[0], "ms", "fwd+bwd ms (median)"),
                              (axes[1], "extra_gib", "GiB per rank beyond q, k, v, dO and grads (busiest)")):
        for j, (p, w) in enumerate(provs):
            xs, ys = [], []
            for i, lab in enumerate(labels):
                for r in timed:
                    if (r["case"], int(r["seq_len"])) == lab and (r["provider"], int(r["world"])) == (p, w) \
                            and r.get(field) not in ("", None):
                        xs.append(i + j * width)
                        ys.append(float(r[field]))
            if xs:
                ax.bar(xs, ys, width, label=f"{p} ({w} GPU{'s' if w > 1 else ''})")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels([f"{c}\n{n // 1024}K" if n >= 1024 else f"{c}\n{n}" for c, n in labels], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        if field == "ms":
            ax.set_yscale("log")
    gpu = timed[0]["gpu"] if timed else ""
    fig.suptitle(f"context parallel, fwd+bwd ({gpu}, commit {timed[0]['commit'] if timed else ''})", fontsize=9)
    axes[0].legend(fontsize=7)
    save_figure(fig, path, dpi=120)


def merge(path: str, rows: list) -> list:
    """The rows of ``path`` (if any) with this run's rows in place of those of the same `KEY`."""
    old = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    mine = {tuple(str(r[k]) for k in KEY) for r in rows}
    kept = [{f: r.get(f, "") for f in FIELDS} for r in old if tuple(r.get(k, "") for k in KEY) not in mine]
    return kept + rows


def write(out: str, rows: list) -> str:
    """Merge ``rows`` into OUT/context_parallel.csv (`merge`: earlier rows of other keys stay); its path.
    Written again after each measurement, so the rows of this run replace their own earlier write."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "context_parallel.csv")
    table = merge(path, rows)
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, FIELDS)
        wr.writeheader()
        wr.writerows(table)
    return path


def _cp_name(args) -> str:
    """The context-parallel rows' provider: ``sparseflash-cp``, or ``sparseflash-cp-lists`` with
    ``--own-stage-lists`` (a causal plan's own stage through block lists and bits, as before its causal walk)."""
    return "sparseflash-cp-lists" if args.own_stage_lists else "sparseflash-cp"


def _lens(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for context_parallel.csv and .png")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--check-len", type=int, default=4099)
    p.add_argument("--dense-lens", type=_lens, default=[131072, 262144, 524288, 1048576])
    p.add_argument("--sparse-lens", type=_lens, default=[1048576])
    p.add_argument("--sparse-cases", default="window,documents,butterfly")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--one-gpu-max", type=int, default=1048576, help="longest sequence timed on one GPU too")
    p.add_argument("--stage-tokens", type=int, default=65536,
                   help="sparseflash.distributed.plan's stage_tokens: keys/values one stage of the exchange moves")
    p.add_argument("--torch-methods", type=lambda t: [m for m in t.split(",") if m], default=["allgather", "alltoall"],
                   help="torch context_parallel rotate methods timed (set_rotate_method)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-torch-cp", action="store_true")
    p.add_argument("--own-stage-lists", action="store_true",
                   help="a plain causal plan's own stage through block lists and bits (sparseflash.distributed."
                        "CAUSAL_OWN_STAGE = False; rows as provider sparseflash-cp-lists), for an A/B of its causal walk")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also one fwd+bwd of each case under torch.profiler: OUT/profile/<case>-<N>-cp-rank<r>.txt and -1gpu.txt")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run on gloo (tiny sizes, float32 through --backend reference)")
    p.add_argument("--backend", default="auto", help="sparseflash.attention's backend (cpu smoke: reference)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.own_stage_lists:
        sfd.CAUSAL_OWN_STAGE = False
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import triton

    base = {f: "" for f in FIELDS}
    base.update(world=world, heads=args.heads, head_dim=args.dim,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows = [] if args.skip_check else check(args, base, device, rank, world)
    plan_ = [("dense-causal", n) for n in args.dense_lens]
    plan_ += [(c, n) for n in args.sparse_lens for c in args.sparse_cases.split(",") if c]
    for kind, n in plan_:
        try:
            rows += timing(args, base, device, rank, world, kind, n)
        except torch.cuda.OutOfMemoryError as e:
            rows.append(dict(base, kind="time", case=kind, seq_len=n, provider=_cp_name(args),
                             error=f"OutOfMemoryError: {str(e)[:120]}"))
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"done {kind} {n}", file=sys.stderr, flush=True)
            write(args.out, rows)  # after every measurement: a command cut off by its time limit keeps them
    if rank == 0:
        path = write(args.out, rows)
        try:
            plot(merge(path, []), os.path.join(args.out, "context_parallel.png"))
        except Exception as e:  # noqa: BLE001 - the CSV is the result; a figure problem is reported
            print(f"figure not made: {e}", file=sys.stderr)
        print(f"wrote {path}")
        print(f"{'kind':6} {'case':13} {'N':>8} {'provider':18} {'ms':>9} {'x1gpu':>6} {'work':>5} "
              f"{'plan MB':>8} {'sent MB':>8} {'peak GiB':>8} {'extra':>6} {'pass':>5} error")
        num = lambda r, f, fmt, scale=1: format(r[f] / scale, fmt) if r[f] != "" else ""  # noqa: E731
        for r in rows:
            print(f"{r['kind']:6} {r['case']:13} {r['seq_len']:>8} {r['provider']:18} {num(r, 'ms', '.2f'):>9} "
                  f"{num(r, 'speedup_vs_1gpu', '.2f'):>6} {num(r, 'work_max_over_mean', '.2f'):>5} "
                  f"{num(r, 'plan_bytes', '.1f', 1e6):>8} {num(r, 'sent_bytes', '.1f', 1e6):>8} "
                  f"{num(r, 'peak_gib', '.2f'):>8} {num(r, 'extra_gib', '.2f'):>6} {str(r['passed']):>5} {r['error']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
