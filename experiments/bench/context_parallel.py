"""Context-parallel benchmark of `sparseflash.distributed` on the GPUs of one host (torchrun).

    torchrun --nproc-per-node 2 -m sparseflash.experiments.bench.context_parallel \
        --out experiments/results/context-parallel

1. Correctness (small, ``--check-len``): bf16 outputs and q/k/v gradients of the context-parallel op and
   of one GPU against a float64 reference (`sparseflash.attention`, backend "reference") on causal,
   packed documents and butterfly masks; a row passes when the distributed error is at most twice the
   one-GPU error plus 1e-3.
2. Timings, fwd+bwd, bf16 (``--heads``, ``--dim``): dense causal at ``--dense-lens``; local window
   ``--window`` causal, documents (lengths drawn from 2K-64K) and butterfly at ``--sparse-lens``.
   Providers: ``sparseflash-cp`` (this module, W GPUs), ``sparseflash-1gpu`` (rank 0 alone, the full
   sequence; skipped above ``--one-gpu-max``), ``torch-cp-cudnn`` (torch's ``context_parallel`` ring over
   SDPA's cuDNN backend, dense causal only, where importable). Timing: CUDA events around each of
   ``--reps`` calls after ``--warmup`` calls, all ranks in step (a barrier before each call), median.
   Each row also has the plan's bytes (summed over ranks, forward + backward), the bytes the exchange
   really sent, and the busiest rank's work over the mean.

Writes ``OUT/context_parallel.csv`` (one row per measurement, GPU / versions / commit / date columns)
and ``OUT/context_parallel.png``, and prints a table last.
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

FIELDS = ["kind", "case", "seq_len", "world", "provider", "ms", "speedup_vs_1gpu", "err_out", "err_dq", "err_dk",
          "err_dv", "err_1gpu_max", "passed", "plan_bytes", "sent_bytes", "work_max_over_mean", "placement",
          "plan_s", "peak_gib", "heads", "head_dim", "gpu", "torch", "triton", "commit", "date", "error"]


def _commit() -> str:
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


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else ""


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
        plan = sfd.plan(n, None, block_size=args.block, **kw)
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
        rows.append(dict(base, kind="check", case=kind, seq_len=n, provider="sparseflash-cp", err_out=errs[0],
                         err_dq=errs[1], err_dk=errs[2], err_dv=errs[3], err_1gpu_max=max(one), passed=passed,
                         placement=plan.placement))
    return rows


def timing(args, base, device, rank, world, kind, n):
    rows = []
    kw = cases(kind, n, args, device)
    t0 = time.perf_counter()
    plan = sfd.plan(n, None, block_size=args.block, **kw)
    plan_s = time.perf_counter() - t0
    q, k, v, do = _tensors(n, args, device, torch.bfloat16)
    ql, kl, vl, dol = (plan.shard(t).detach().requires_grad_() for t in (q, k, v, do))

    def step():
        o = sfd.attention(ql, kl, vl, plan, backend=args.backend)
        o.backward(dol)

    _peak_reset(device)
    plan.bytes_sent = 0
    step()  # first call: compile, build the sub-masks' bits
    sent = torch.tensor([plan.bytes_sent], device=device, dtype=torch.float64)
    planned = torch.tensor([plan.expected_bytes(kl, vl, backward=True)], device=device, dtype=torch.float64)
    dist.all_reduce(sent)
    dist.all_reduce(planned)
    ms = _time(step, args.warmup, args.reps)
    peak = _peak(device)
    work = plan.work
    rows.append(dict(base, kind="time", case=kind, seq_len=n, provider="sparseflash-cp", ms=ms,
                     plan_bytes=int(planned.item()), sent_bytes=int(sent.item()),
                     work_max_over_mean=max(work) / max(1e-9, statistics.mean(work)), placement=plan.placement,
                     plan_s=plan_s, peak_gib=peak))
    del ql, kl, vl, dol
    one_ms = None
    if n <= args.one_gpu_max:
        if rank == 0:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

            def one():
                one_gpu_call(qq, kk, vv, kw, args.backend).backward(do)

            _peak_reset(device)
            one_ms = _time(one, args.warmup, args.reps, sync_group=False)
            rows.append(dict(base, kind="time", case=kind, seq_len=n, provider="sparseflash-1gpu", world=1, ms=one_ms,
                             peak_gib=_peak(device)))
            del qq, kk, vv
        dist.barrier()
        t = torch.tensor([one_ms or 0.0], device=device)
        dist.broadcast(t, 0)
        one_ms = float(t.item())
        rows[0]["speedup_vs_1gpu"] = one_ms / ms
    if kind == "dense-causal" and not args.skip_torch_cp and device.type == "cuda":
        row = dict(base, kind="time", case=kind, seq_len=n, provider="torch-cp-cudnn")
        try:
            row["ms"] = torch_cp_ms(args, q, k, v, do, world, device)
            if one_ms:
                row["speedup_vs_1gpu"] = one_ms / row["ms"]
        except Exception as e:  # noqa: BLE001 - an unavailable or failing baseline is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def torch_cp_ms(args, q, k, v, do, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    bufs = [q.clone(), k.clone(), v.clone(), do.clone()]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        qs, ks, vs, dos = bufs
        qs, ks, vs = (t.detach().requires_grad_() for t in (qs, ks, vs))

        def step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            o.backward(dos)

        return _time(step, args.warmup, args.reps)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure

    timed = [r for r in rows if r["kind"] == "time" and r.get("ms")]
    labels = sorted({(r["case"], r["seq_len"]) for r in timed}, key=lambda c: (c[0], c[1]))
    provs = sorted({r["provider"] for r in timed})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    width = 0.8 / max(1, len(provs))
    for j, p in enumerate(provs):
        xs, ys = [], []
        for i, lab in enumerate(labels):
            for r in timed:
                if (r["case"], r["seq_len"]) == lab and r["provider"] == p:
                    xs.append(i + j * width)
                    ys.append(r["ms"])
        ax.bar(xs, ys, width, label=p)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"{c}\n{n // 1024}K" for c, n in labels], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("fwd+bwd ms (median)")
    world = max((r["world"] for r in timed), default=1)
    ax.set_title(f"context parallel, {world} GPUs ({timed[0]['gpu'] if timed else ''})")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def _lens(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for context_parallel.csv and .png")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--check-len", type=int, default=4099)
    p.add_argument("--dense-lens", type=_lens, default=[131072, 262144])
    p.add_argument("--sparse-lens", type=_lens, default=[262144])
    p.add_argument("--sparse-cases", default="window,documents,butterfly")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--one-gpu-max", type=int, default=262144, help="longest sequence timed on one GPU too")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-torch-cp", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run on gloo (tiny sizes, float32 through --backend reference)")
    p.add_argument("--backend", default="auto", help="sparseflash.attention's backend (cpu smoke: reference)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
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
    base.update(world=world, heads=args.heads, head_dim=args.dim, gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows = [] if args.skip_check else check(args, base, device, rank, world)
    plan_ = [("dense-causal", n) for n in args.dense_lens]
    plan_ += [(c, n) for n in args.sparse_lens for c in args.sparse_cases.split(",") if c]
    for kind, n in plan_:
        try:
            rows += timing(args, base, device, rank, world, kind, n)
        except torch.cuda.OutOfMemoryError as e:
            rows.append(dict(base, kind="time", case=kind, seq_len=n, provider="sparseflash-cp",
                             error=f"OutOfMemoryError: {str(e)[:120]}"))
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"done {kind} {n}", file=sys.stderr, flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "context_parallel.csv")
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(f, FIELDS)
            wr.writeheader()
            wr.writerows(rows)
        try:
            plot(rows, os.path.join(args.out, "context_parallel.png"))
        except Exception as e:  # noqa: BLE001 - the CSV is the result; a figure problem is reported
            print(f"figure not made: {e}", file=sys.stderr)
        print(f"wrote {path}")
        print(f"{'kind':6} {'case':13} {'N':>8} {'provider':16} {'ms':>9} {'x1gpu':>6} {'work':>5} "
              f"{'plan MB':>8} {'sent MB':>8} {'pass':>5} error")
        for r in rows:
            ms = f"{r['ms']:.2f}" if r["ms"] != "" else ""
            sp = f"{r['speedup_vs_1gpu']:.2f}" if r["speedup_vs_1gpu"] != "" else ""
            wk = f"{r['work_max_over_mean']:.2f}" if r["work_max_over_mean"] != "" else ""
            pb = f"{r['plan_bytes'] / 1e6:.1f}" if r["plan_bytes"] != "" else ""
            sb = f"{r['sent_bytes'] / 1e6:.1f}" if r["sent_bytes"] != "" else ""
            print(f"{r['kind']:6} {r['case']:13} {r['seq_len']:>8} {r['provider']:16} {ms:>9} {sp:>6} {wk:>5} "
                  f"{pb:>8} {sb:>8} {str(r['passed']):>5} {r['error']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
