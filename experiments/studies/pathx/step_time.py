"""Training-step time of the Path-64 / Path-X / Path-256 recipe models on release-fidelity images.

    python -m sparseflash.experiments.studies.pathx.step_time --out DIR [--tasks pathfinder64 pathx]

For each task: a batch pool of real generated images (release fidelity, hard), then full steps
(bf16 autocast forward, backward, grad clip, fused AdamW) of the faithful config's model, each
step on the next batch of the pool (so the trimmed width varies as in training), for:
- ``black_is_padding`` off (every pixel a token), on but untrimmed (the packed sequence at full
  length, as before trimming), on and trimmed (the default);
- dense and butterfly; eager, torch.compile and CUDA graphs (trimmed only). CUDA graphs: the
  training loop's ``--cuda-graphs`` step (`train.GraphedTrainStep`: one graph per width bucket,
  capturable fused AdamW; the optimizer's first step eager), every batch of the pool captured
  during the warm-up; the batches' plans (`model.host_plan`) are computed beforehand, as the
  loader's workers do in training.
Median GPU time per step over the timed steps, CUDA events; peak memory. Also the data loader's
throughput on the same images written to disk (batches/s for a few worker counts), since a fast
step can make the loader the limit. Writes step_time.csv/json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sparseflash.experiments.lra.configs import get_config
from sparseflash.experiments.lra.model import Encoder, LRAClassifier, host_plan, parse_pattern_spec

_RES = {"pathfinder64": 64, "pathx": 128, "path256": 256}


def _images(task: str, n: int, workers: int, root: Path) -> tuple[torch.Tensor, Path]:
    """``n`` release-fidelity hard images of the task's resolution, as token ids [n, R*R], and the folder."""
    from sparseflash.experiments.lra.data import get_dataset
    from sparseflash.experiments.lra.data.pathfinder import write_pathfinder

    r = _RES[task]
    write_pathfinder(root, r, "hard", n, seed=123, workers=workers, per_batch=max(1, n // workers), overwrite=True,
                     show_progress=False)
    ds = get_dataset(task, root, "train", workers=workers)
    toks = torch.stack([ds[i]["tokens"] for i in range(len(ds))])
    return toks, root


def _model(task: str, pattern: str, bip: bool, device) -> LRAClassifier:
    cfg = get_config(task, "faithful", [f"model.black_is_padding={bip}"])
    cfg.model.vocab_size = 257
    cfg.model.pattern, cfg.model.pattern_kwargs = parse_pattern_spec(pattern)
    torch.manual_seed(0)
    return LRAClassifier(cfg.model).to(device)


def _time_steps(model, pool: torch.Tensor, batch: int, compile: bool, steps: int, warmup: int,
                plans: list | None = None) -> dict:
    """``plans``: the pool batches' `host_plan`s, for CUDA graphs (None: eager or compiled steps)."""
    from sparseflash.experiments.lra.train import GraphedTrainStep

    device = pool.device
    net = torch.compile(model) if compile else model
    graphs = plans is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphs)
    labels = torch.randint(0, 2, (batch,), device=device)
    n_batches = pool.shape[0] // batch
    runner = None
    if graphs:  # room for every width of the pool; the warm-up sees each batch once after the eager first step
        runner = GraphedTrainStep(model, opt, torch.zeros(4, dtype=torch.float64, device=device), grad_clip=1.0,
                                  max_graphs=max(64, n_batches))
        warmup = max(warmup, n_batches + 1)
        warnings.filterwarnings("ignore", message=".*capturable=True.*")  # the eager first step

    def step(i):
        j = i % n_batches
        tokens = pool[j * batch:(j + 1) * batch]
        if runner is not None and runner.run({"tokens": tokens, "lengths": None, "labels": labels, "plan": plans[j]}):
            return
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(tokens, None)
        F.cross_entropy(logits.float(), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(warmup + i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    t1 = time.perf_counter()
    for i in range(steps):  # wall time back to back (host work included)
        step(i)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t1) / steps * 1e3
    out = {"step_ms": statistics.median(times), "wall_ms": wall, "warmup_s": warm_s,
           "mem_gb": torch.cuda.max_memory_allocated() / 2**30,
           # a graph's scratch sits in its private pool: reserved, not allocated between replays
           "reserved_gb": torch.cuda.memory_reserved() / 2**30, "graphs": 0, "eager_steps": 0}
    if runner is not None:
        out.update(graphs=len(runner.graphs), eager_steps=runner.eager)
    return out


def _loader_rate(task: str, root: Path, batch: int, workers_list, seconds: float = 8.0) -> list[dict]:
    from sparseflash.experiments.lra.data import get_dataset
    from sparseflash.experiments.lra.train import collate

    ds = get_dataset(task, root, "train")
    rows = []
    for w in workers_list:
        sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=10**7)
        dl = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=collate, num_workers=w,
                                         pin_memory=True, persistent_workers=False, prefetch_factor=4 if w else None)
        it = iter(dl)
        for _ in range(3):
            next(it)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            b = next(it)
            b["tokens"].to("cuda", non_blocking=True)
            n += 1
        torch.cuda.synchronize()
        rows.append({"task": task, "loader_workers": w, "batch": batch, "batches_per_s": n / (time.perf_counter() - t0)})
        del it, dl
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", nargs="+", default=["pathfinder64", "pathx"], choices=sorted(_RES))
    p.add_argument("--images", type=int, default=512, help="images per task (the batch pool)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--loader-workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA-graph rows")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("SPARSEFLASH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d")}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows, loader_rows = [], []
    full_pack = Encoder._pack
    for task in args.tasks:
        t0 = time.perf_counter()
        toks, root = _images(task, args.images, args.workers, out / "data" / task)
        print(f"{task}: {len(toks)} images in {time.perf_counter() - t0:.1f} s; drawn share "
              f"{(toks > 1).float().mean():.3f}", flush=True)
        pool = toks.to(dev)
        batch = get_config(task, "faithful").train.batch_size
        variants = [("off", False, False, False), ("untrimmed", True, False, False), ("trimmed", True, False, False)]
        if not args.no_compile:
            variants.append(("trimmed", True, True, False))
        if not args.no_graphs:
            variants.append(("trimmed", True, False, True))
        for pattern in ("dense", "butterfly"):
            for bip_mode, bip, comp, graphs in variants:
                if bip_mode == "untrimmed":
                    Encoder._pack = lambda self, t, l: (*full_pack(self, t, l)[:2], t.shape[1])
                try:
                    model = _model(task, pattern, bip, dev)
                    plans = None
                    if graphs:  # what the loader's workers compute from the CPU batches in training
                        plans = [host_plan(model.cfg, toks[j * batch:(j + 1) * batch], None)
                                 for j in range(len(toks) // batch)]
                    r = _time_steps(model, pool, batch, comp, args.steps, args.warmup, plans)
                    err = ""
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    r, err = {"step_ms": float("nan"), "wall_ms": float("nan"), "warmup_s": 0.0, "mem_gb": 0.0,
                              "reserved_gb": 0.0, "graphs": 0, "eager_steps": 0}, repr(e)[:200]
                finally:
                    Encoder._pack = full_pack
                    torch._dynamo.reset()
                row = {"task": task, "batch": batch, "pattern": pattern, "black_is_padding": bip_mode,
                       "compile": comp, "cuda_graphs": graphs, **r, "error": err, **meta}
                rows.append(row)
                print(f"  {pattern:9s} bip={bip_mode:9s} compile={comp!s:5s} graphs={graphs!s:5s} {r['step_ms']:8.2f} ms "
                      f"(wall {r['wall_ms']:.2f}) {r['mem_gb']:.1f} GB {err}", flush=True)
                del model
                torch.cuda.empty_cache()
        loader_rows += [{**lr, **meta} for lr in _loader_rate(task, root, batch, args.loader_workers)]
        print("  loader:", ", ".join(f"{lr['loader_workers']}w {lr['batches_per_s']:.0f}/s" for lr in loader_rows
                                      if lr["task"] == task), flush=True)
    import csv
    with open(out / "step_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "step_time.json").write_text(json.dumps({"meta": meta, "steps": rows, "loader": loader_rows}, indent=1))
    print("\ntask         pattern   black_is_padding compile cuda_graphs  step_ms  wall_ms")
    for r in rows:
        print(f"{r['task']:12s} {r['pattern']:9s} {r['black_is_padding']:16s} {r['compile']!s:7s} "
              f"{r['cuda_graphs']!s:11s} {r['step_ms']:8.2f} {r['wall_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
