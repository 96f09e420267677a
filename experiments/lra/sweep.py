"""Accuracy against sparsity: one task trained at several densities of one pattern, and a table
and a figure of test accuracy and training-step time against density.

    sparseflash lra sweep --task listops --config quick --data DIR --pattern butterfly \\
        --densities 1 0.5 0.25 0.125 [--seeds 0 1 2] [--max-steps N] [--time-limit MIN] [--set ...] --out OUT
    sparseflash lra sweep ... --dry-run            the pattern settings each density gets, nothing trained
    sparseflash lra sweep --plot-only OUT          redraw OUT/sweep.png and OUT/sweep.md from OUT/sweep.json

Choosing the settings. For each target density the pattern's parameters are searched over a
fixed grid (`candidates`) at the task's attended length and block size (taken from the data, as
training does), and the setting whose block density is nearest to the target on a log scale is
taken (ties: the first in the grid, the simplest). Density 1 is dense attention (no mask). Target
and achieved density (blocks computed / all blocks) and the token density (pairs attended / all
pairs) are recorded; two targets that land on the same setting are trained once. The pattern is
the same for every seed; the seeds change the training (initialisation, dropout, data order).

Running. Each (seed, density) is an ordinary `sparseflash lra train` run in ``OUT/runs/<name>/``,
made in seed-major order. The sweep is resumable like the runs: a finished run is skipped, an
interrupted one resumed from its ``last.pt`` (``--resume``: an --out that holds a sweep is refused
without it, or ``--overwrite``), so a sweep can be split over commands or sessions;
``--time-limit`` bounds the whole command (a run is not started with less than
``START_RESERVE_S`` left), SIGTERM / SIGINT stop it cleanly, exit status 75 as for ``train``.

Step time. The step times in a run's log (``train.csv``, ``step_ms``) mix in warm-up and whatever
else the machine did; after a run ends the sweep also times full training steps (forward,
backward, AdamW; bf16 autocast on CUDA as in training) of the run's model on its first training
batch, with CUDA events after warm-up, median of ``--timing-repeats``. Both are in the table
(``step_ms``: that measurement; ``log_step_ms``: the median of the log windows that do not start
a command).

Outputs in OUT: ``sweep.csv`` and ``sweep.json`` (one row per run: task, pattern, parameters,
target / achieved / token density, seed, steps, best validation accuracy, test accuracy with the
best-on-val weights and its binomial standard error, step times, wall time over all commands,
commit, GPU, torch / triton versions, date), ``sweep.md`` (the rows and a per-density summary)
and ``sweep.png`` (test accuracy against density: mean over seeds with error bars, each seed a
point; step time against density beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["SWEEP_PATTERNS", "candidates", "choose_settings", "plan_sweep", "run_sweep", "time_train_step", "plot_sweep",
           "write_tables", "register_lra", "main"]

SWEEP_PATTERNS = ("butterfly", "local", "random", "bigbird", "longformer")
START_RESERVE_S = 60.0  # with --time-limit: no run is started or resumed with less time than this left
_ROW_COLS = ("run", "status", "task", "variant", "attention", "pattern", "params", "target_density", "density",
             "token_density", "seed", "steps", "schedule_steps", "best_val_acc", "best_val_step", "test_acc", "test_se",
             "test_n", "test_final_acc", "step_ms", "step_ms_min", "log_step_ms", "wall_s", "commands", "seq_len",
             "block_size", "batch_size", "commit", "gpu", "device", "torch", "triton", "date")


# ------------------------------------------------------------------------------------ settings
def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(max(0, limit).bit_length()) if 1 << k <= limit]


def candidates(pattern: str, attn_len: int, block_size: int) -> list[dict]:
    """The grid of keyword settings searched for ``pattern`` at ``attn_len`` tokens (sparsest-
    first within each family; the simplest setting of a density comes first).

    - butterfly: every ``n_factors`` (0 .. log2 of the size) of the full butterfly and of each
      smaller power-of-two ``butterfly_size`` stretched over the grid,
    - local: ``window`` of 0 .. nb - 1 blocks (in tokens),
    - random: ``blocks_per_row`` 1 .. nb,
    - bigbird: ``global_tokens`` 2 blocks (BigBird-ITC) or 1, ``window`` a power of two of blocks,
      ``random_blocks_per_row`` 0, 1, 2, 3 and powers of two up to nb: all three parts are kept
      (a target below what the window and global tokens cover gets the sparsest such setting),
    - longformer: ``global_tokens`` 2 blocks or 1, ``window`` 1 .. nb - 1 blocks.
    """
    nb = math.ceil(attn_len / block_size)
    log_p = max(0, (nb - 1).bit_length())
    b = block_size
    if pattern == "butterfly":
        out = []
        for size in [None] + [1 << k for k in range(log_p - 1, -1, -1)]:
            log_s = log_p if size is None else size.bit_length() - 1
            for nf in range(0, log_s + 1):
                kw = {} if size is None else {"butterfly_size": size}
                if nf != log_s:
                    kw["n_factors"] = nf
                out.append(kw)
        return out
    if pattern == "local":
        return [{"window": k * b} for k in range(nb)]
    if pattern == "random":
        return [{"blocks_per_row": k} for k in range(1, nb + 1)]
    if pattern == "bigbird":
        rand = sorted({0, 1, 2, 3, *_powers_of_two(nb)})
        return [{"window": w * b, "global_tokens": min(g * b, attn_len), "random_blocks_per_row": r}
                for g in (2, 1) for w in _powers_of_two(max(1, nb // 2)) for r in rand]
    if pattern == "longformer":
        return [{"window": k * b, "global_tokens": min(g * b, attn_len)} for g in (2, 1) for k in range(1, max(2, nb))]
    raise ValueError(f"--pattern must be one of {SWEEP_PATTERNS} for a density sweep, got {pattern!r}")


@functools.lru_cache(maxsize=16)
def _grid_densities(pattern: str, attn_len: int, block_size: int) -> tuple:
    """(kwargs, block density, token density) of every buildable setting in `candidates`."""
    from sparseflash.experiments.lra.model import build_pattern

    out = []
    for kw in candidates(pattern, attn_len, block_size):
        try:
            mask = build_pattern(pattern, attn_len, block_size, **kw)
        except (ValueError, TypeError):
            continue  # a setting this grid cannot take (e.g. more global tokens than positions)
        out.append((kw, mask.density(), mask.token_density()))
    return tuple(out)


def choose_settings(pattern: str, target: float, attn_len: int, block_size: int) -> dict:
    """The setting of ``pattern`` whose block density at ``attn_len`` is nearest to ``target`` (on
    a log scale); ``target == 1`` is dense. Returns ``{"pattern", "kwargs", "density", "token_density"}``."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise ValueError(f"densities must lie in (0, 1], got {target!r}")
    if target == 1:
        return {"pattern": None, "kwargs": {}, "density": 1.0, "token_density": 1.0}
    best = None
    for kw, d, td in _grid_densities(pattern, attn_len, block_size):
        gap = abs(math.log(d / target)) if d > 0 else math.inf
        if best is None or gap < best[0] - 1e-12:
            best = (gap, kw, d, td)
    if best is None:
        raise ValueError(f"no setting of pattern {pattern!r} builds at length {attn_len}, block {block_size}")
    return {"pattern": pattern, "kwargs": dict(best[1]), "density": best[2], "token_density": best[3]}


def _run_name(setting: dict, target: float, seed: int) -> str:
    return f"{setting['pattern'] or 'dense'}-d{target:g}-s{seed}"


def plan_sweep(cfg, pattern: str, densities, seeds, attn_len: int) -> list[dict]:
    """One entry per (seed, distinct setting), seed-major: name, seed, target density, setting."""
    settings, seen = [], {}
    for target in densities:
        s = choose_settings(pattern, target, attn_len, cfg.model.block_size)
        key = (s["pattern"], json.dumps(s["kwargs"], sort_keys=True))
        if key in seen:
            print(f"density {target:g} gets the setting of density {seen[key]:g} "
                  f"({s['pattern'] or 'dense'} {s['kwargs']}, {s['density']:.4f}): trained once", file=sys.stderr)
            continue
        seen[key] = target
        settings.append((target, s))
    return [{"name": _run_name(s, target, seed), "seed": seed, "target_density": target, **s}
            for seed in seeds for target, s in settings]


# --------------------------------------------------------------------------------- step timing
def time_train_step(cfg, batch: dict, *, device, precision: str, warmup: int = 5, repeats: int = 20,
                    max_seconds: float = 10.0) -> dict:
    """Median / min milliseconds of one full training step (forward, loss, backward, clipping,
    AdamW) of ``cfg``'s model on ``batch`` (a collated training batch): CUDA events after
    ``warmup`` steps on a GPU, wall clock on CPU."""
    import torch.nn.functional as F

    from sparseflash.experiments.lra.model import LRAClassifier
    from sparseflash.experiments.lra.speed import _time
    from sparseflash.experiments.lra.train import _optimizer

    device = torch.device(device)
    torch.manual_seed(0)
    model = LRAClassifier(cfg.model).to(device).train()
    opt = _optimizer(model, cfg.train, device)
    tokens, lengths, labels = (batch[k].to(device) for k in ("tokens", "lengths", "labels"))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        with autocast:
            logits = model(tokens, lengths)
        loss = F.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()

    times = _time(step, device, warmup, repeats, max_seconds)
    return {"step_ms": statistics.median(times), "step_ms_min": min(times), "repeats": len(times), "warmup": warmup}


def _log_step_ms(run_dir: Path, summary: dict, log_every: int):
    """Median ``step_ms`` of the run's log windows, leaving out each window that holds the first
    step of a command (compilation, warm-up)."""
    path = run_dir / "train.csv"
    if not path.exists():
        return None
    starts = [seg["start_step"] for seg in summary.get("segments", [])] or [0]
    with path.open() as f:
        vals = [float(r["step_ms"]) for r in csv.DictReader(f)
                if not any(int(r["step"]) - log_every <= s < int(r["step"]) for s in starts)]
    return statistics.median(vals) if vals else None


# ------------------------------------------------------------------------------------- the sweep
def _run_record(path: Path) -> dict:
    """A sweep run's summary.json or step_time.json ({} when there is none); a damaged one raises
    ValueError naming it."""
    from sparseflash.cmdline import read_json_object

    return read_json_object(path, "restore it, or delete it and --resume redoes what it recorded") or {}


def _row(entry: dict, run_dir: Path, cfg, env: dict) -> dict:
    """The table row of one planned run from what its directory holds."""
    summary, timing = _run_record(run_dir / "summary.json"), _run_record(run_dir / "step_time.json")
    renv = timing.get("environment", env)
    test = summary.get("test_best") or {}
    acc, n = test.get("acc"), test.get("n")
    status = ("done" if summary.get("finished") and timing else "trained" if summary.get("finished")
              else "stopped" if summary or (run_dir / "checkpoints" / "last.pt").exists() else "pending")
    best = summary.get("best_val") or {}
    segs = summary.get("segments", [])
    return {"run": entry["name"], "status": status, "task": cfg.task, "variant": cfg.variant,
            "attention": cfg.model.attention, "pattern": entry["pattern"] or "dense", "params": json.dumps(entry["kwargs"]),
            "target_density": entry["target_density"], "density": entry["density"],
            "token_density": entry["token_density"], "seed": entry["seed"], "steps": summary.get("steps"),
            "schedule_steps": summary.get("schedule_steps"),
            "best_val_acc": best.get("acc") if best.get("step") is not None else None, "best_val_step": best.get("step"),
            "test_acc": acc, "test_se": math.sqrt(acc * (1 - acc) / n) if acc is not None and n else None, "test_n": n,
            "test_final_acc": (summary.get("test_final") or {}).get("acc"),
            "step_ms": timing.get("step_ms"), "step_ms_min": timing.get("step_ms_min"),
            "log_step_ms": timing.get("log_step_ms"), "wall_s": summary.get("wall_s_total"), "commands": len(segs) or None,
            "seq_len": cfg.model.attn_len, "block_size": cfg.model.block_size, "batch_size": cfg.train.batch_size,
            "commit": renv.get("commit"), "gpu": renv.get("gpu"), "device": renv.get("device"), "torch": renv.get("torch"),
            "triton": renv.get("triton"), "date": renv.get("date")}


def run_sweep(cfg, out_dir, *, pattern: str, densities, seeds=(0,), data_root=None, datasets: dict | None = None,
              cache_dir=None, device: str | None = None, max_steps: int | None = None, deadline: float | None = None,
              num_workers: int = 0, precision: str | None = None, timing_warmup: int = 5, timing_repeats: int = 20,
              init_from: str | None = None, init_from_sweep: str | None = None, dry_run: bool = False,
              show_progress: bool = True, plots: bool = True) -> dict:
    """Train ``cfg`` at each density of ``pattern`` and seed (skipping finished runs, resuming
    stopped ones), time each run's training step, write the tables and the figure; returns the
    sweep.json content, whose ``stopped_by`` is set when a signal or ``deadline`` ended it early.

    ``init_from``: a checkpoint every new run starts from (`train`'s ``init_from``: Path-X from a
    Path-64 model); ``init_from_sweep``: another sweep's directory whose run of the same name
    (same pattern, target density and seed) gives its ``best.pt`` to each new run."""
    from sparseflash.experiments.lra.configs import apply_overrides, config_from_dict
    from sparseflash.experiments.lra.speed import _environment
    from sparseflash.experiments.lra.train import _Stopper, collate, fit_to_data, load_datasets, train

    if init_from and init_from_sweep:
        raise ValueError("give init_from or init_from_sweep, not both")
    if cfg.train.objective != "classify":  # its tables are accuracies and its step timing a classifier's
        raise ValueError(f"a sweep trains classifiers: train.objective must be 'classify', got {cfg.train.objective!r} "
                         "(self-pretrain with `sparseflash lra train --objective denoise`, then sweep with --init-from)")
    if pattern not in SWEEP_PATTERNS:
        raise ValueError(f"pattern must be one of {SWEEP_PATTERNS} for a density sweep, got {pattern!r}")
    densities, seeds = list(densities), list(seeds)
    if not densities:
        raise ValueError("give at least one density")
    for d in densities:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(f"densities must lie in (0, 1], got {d!r}")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be non-negative ints, got {seeds!r}")
    if len(set(seeds)) != len(seeds) or len(set(densities)) != len(densities):
        raise ValueError(f"densities and seeds must not repeat, got {densities} and {seeds}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = precision or ("bf16" if torch.device(device).type == "cuda" else "fp32")
    out = Path(out_dir)
    if datasets is None:
        if data_root is None:
            raise ValueError("give the data directory (--data DIR) or datasets=")
        datasets = load_datasets(cfg, data_root, cache_dir)
    base = config_from_dict(cfg.to_dict())
    fit_to_data(base, datasets["train"])
    plan = plan_sweep(base, pattern, densities, seeds, base.model.attn_len)
    env = _environment(device)
    args = {"task": cfg.task, "variant": cfg.variant, "pattern": pattern, "densities": densities, "seeds": seeds,
            "max_steps": max_steps, "device": str(device), "precision": precision, "init_from": init_from,
            "init_from_sweep": init_from_sweep}
    starts = {}
    for e in plan:
        start = init_from or (Path(init_from_sweep) / "runs" / e["name"] / "checkpoints" / "best.pt"
                              if init_from_sweep else None)
        fresh = not (out / "runs" / e["name"] / "checkpoints" / "last.pt").exists()
        if start is not None and fresh and not dry_run and not Path(start).exists():
            raise ValueError(f"run {e['name']} would start from {start}, which does not exist")
        starts[e["name"]] = str(start) if start else None
    result = {"environment": env, "args": args, "plan": plan, "rows": [], "stopped_by": None}

    def run_cfg(entry, fitted: bool = False):
        c = config_from_dict((base if fitted else cfg).to_dict())
        c.model.pattern, c.model.pattern_kwargs = entry["pattern"], dict(entry["kwargs"])
        apply_overrides(c, {"train.seed": entry["seed"]})
        return c.validate()

    def write():
        result["rows"] = [_row(e, out / "runs" / e["name"], run_cfg(e, fitted=True), env) for e in plan]
        (out / "sweep.json").write_text(json.dumps(result, indent=2))
        write_tables(result, out)

    if dry_run:
        for e in plan:
            print(f"{e['name']:32s} {e['pattern'] or 'dense':10s} {json.dumps(e['kwargs']):56s} "
                  f"target {e['target_density']:<6g} density {e['density']:.4f} (tokens {e['token_density']:.4f})"
                  + (f" from {starts[e['name']]}" if starts[e["name"]] else ""))
        return result
    made = [p for p in (out / "runs", out, *out.parents) if not p.exists()]  # the deepest first
    (out / "runs").mkdir(parents=True, exist_ok=True)
    try:
        stopper = _Stopper(deadline)
        with stopper:
            for entry in plan:
                run_dir = out / "runs" / entry["name"]
                c = run_cfg(entry)
                summary = _run_record(run_dir / "summary.json")
                end = summary.get("schedule_steps") or math.inf
                end = end if max_steps is None else min(max_steps, end)
                if not (summary.get("finished") and summary.get("steps", -1) >= end):
                    reason = stopper.signal or ("time_limit" if stopper.left_s() < START_RESERVE_S else None)
                    if reason:
                        result["stopped_by"] = reason
                        break
                    resume = "auto" if (run_dir / "checkpoints" / "last.pt").exists() else None
                    print(f"sweep: {'resuming' if resume else 'training'} {entry['name']} "
                          f"({entry['pattern'] or 'dense'} {entry['kwargs']}, density {entry['density']:.4f})", file=sys.stderr)
                    summary = train(c, run_dir, datasets=datasets, device=device, max_steps=max_steps, resume=resume,
                                    init_from=None if resume else starts[entry["name"]], precision=precision,
                                    num_workers=num_workers, show_progress=show_progress, deadline=deadline)
                    if summary["stopped_by"] is not None:
                        result["stopped_by"] = summary["stopped_by"]
                        break
                if not (run_dir / "step_time.json").exists():
                    reason = stopper.signal or ("time_limit" if stopper.left_s() < START_RESERVE_S / 2 else None)
                    if reason:
                        result["stopped_by"] = reason
                        break
                    fitted = run_cfg(entry, fitted=True)
                    batch = collate([datasets["train"][i] for i in range(fitted.train.batch_size)])
                    timing = time_train_step(fitted, batch, device=device, precision=precision, warmup=timing_warmup,
                                             repeats=timing_repeats)
                    timing["log_step_ms"] = _log_step_ms(run_dir, summary, fitted.train.log_every)
                    timing["environment"] = _environment(device)
                    (run_dir / "step_time.json").write_text(json.dumps(timing, indent=2))
                write()
            if result["stopped_by"] is None and stopper.signal:
                result["stopped_by"] = stopper.signal
        write()
    except BaseException:
        for folder in made:  # a failed start (no run recorded anything): no folder left to refuse its retry
            with contextlib.suppress(OSError):  # not empty: a run recorded something
                folder.rmdir()
        raise
    if plots:
        plot_sweep(result, out / "sweep.png")
    return result


# -------------------------------------------------------------------------------- tables, figure
def _aggregate(rows: list[dict]) -> list[dict]:
    """Per setting (target density): test accuracy mean over the finished seeds, its error (the
    standard error over seeds with two or more, else the run's binomial standard error), step times."""
    out = []
    for target in dict.fromkeys(r["target_density"] for r in rows):
        rs = [r for r in rows if r["target_density"] == target and r["test_acc"] is not None]
        if not rs:
            continue
        accs = [r["test_acc"] for r in rs]
        err = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else rs[0]["test_se"]
        times = [r["step_ms"] for r in rs if r["step_ms"] is not None]
        logs = [r["log_step_ms"] for r in rs if r["log_step_ms"] is not None]
        out.append({"target_density": target, "density": rs[0]["density"], "token_density": rs[0]["token_density"],
                    "pattern": rs[0]["pattern"], "params": rs[0]["params"], "seeds": len(rs),
                    "test_acc": statistics.fmean(accs), "test_err": err,
                    "step_ms": statistics.median(times) if times else None,
                    "log_step_ms": statistics.median(logs) if logs else None})
    return out


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def write_tables(result: dict, out_dir) -> None:
    """sweep.csv (every row) and sweep.md (a per-density summary, then every row)."""
    out = Path(out_dir)
    rows = result["rows"]
    with (out / "sweep.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, _ROW_COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    env, args = result.get("environment", {}), result.get("args", {})
    lines = [f"# {args.get('task')} ({args.get('variant')}): accuracy and step time against density of "
             f"{args.get('pattern')}", "",
             f"{env.get('gpu') or env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"commit {env.get('commit')}, {env.get('date')}. Test accuracy with the best-on-validation weights; "
             "± is the standard error over seeds (with one seed: the binomial standard error of the test set). "
             "Step time: median of timed full training steps after the run (`step_ms`), and of its log windows "
             "(`log_step_ms`).", "",
             "| target | density | token density | pattern | settings | seeds | test acc (%) | ± | step ms | log step ms |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for a in _aggregate(rows):
        lines.append(f"| {a['target_density']:g} | {a['density']:.4f} | {a['token_density']:.4f} | {a['pattern']} | "
                     f"`{a['params']}` | {a['seeds']} | {100 * a['test_acc']:.2f} | "
                     f"{_fmt(a['test_err'] and 100 * a['test_err'], '.2f')} | "
                     f"{_fmt(a['step_ms'], '.2f')} | {_fmt(a['log_step_ms'], '.2f')} |")
    lines += ["",
              "| run | status | seed | steps | best val (%) | test (%) | ± | step ms | log step ms | wall s | commands |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = lambda v: _fmt(v if v is None else 100 * v, ".2f")  # noqa: E731
        lines.append(f"| {r['run']} | {r['status']} | {r['seed']} | {_fmt(r['steps'], 'd')} | {pct(r['best_val_acc'])} | "
                     f"{pct(r['test_acc'])} | {pct(r['test_se'])} | {_fmt(r['step_ms'], '.2f')} | "
                     f"{_fmt(r['log_step_ms'], '.2f')} | {_fmt(r['wall_s'], '.1f')} | {_fmt(r['commands'], 'd')} |")
    if result.get("stopped_by"):
        lines += ["", f"The sweep stopped early ({result['stopped_by']}); run the same command again with --resume to go on."]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")


def plot_sweep(result: dict, path) -> Path:
    """Test accuracy (mean over seeds, error bars, each seed a point) and training-step time
    against block density (log scale), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["rows"]
    agg = _aggregate(rows)
    args, env = result.get("args", {}), result.get("environment", {})
    fig, (ax_acc, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    done = [r for r in rows if r["test_acc"] is not None]
    if done:
        ax_acc.scatter([r["density"] for r in done], [100 * r["test_acc"] for r in done], s=22, marker="x", color="0.35",
                       zorder=3, label="one seed")
    if agg:
        ax_acc.errorbar([a["density"] for a in agg], [100 * a["test_acc"] for a in agg],
                        yerr=[100 * (a["test_err"] or 0) for a in agg], fmt="o-", color="C0", capsize=3,
                        label="mean over seeds")
    timed = [a for a in agg if a["step_ms"] is not None]
    if timed:
        ax_t.plot([a["density"] for a in timed], [a["step_ms"] for a in timed], "o-", color="C1",
                  label="timed steps (median)")
    logged = [a for a in agg if a["log_step_ms"] is not None]
    if logged:
        ax_t.plot([a["density"] for a in logged], [a["log_step_ms"] for a in logged], "s--", color="C2", alpha=0.7,
                  label="training log (median)")
    ticks = sorted({r["density"] for r in rows})
    for ax, ylabel in ((ax_acc, "test accuracy (%)"), (ax_t, "training step (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if ticks:
            ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
        ax.set_xlabel(f"block density of {args.get('pattern')} (1 = dense)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if ax.has_data():
            ax.legend(fontsize=8)
    if timed or logged:
        ax_t.set_ylim(bottom=0)
    seeds = len(args.get("seeds") or [])
    ax_acc.set_title(f"{args.get('task')} ({args.get('variant')}): test accuracy, {seeds} seed{'s' * (seeds != 1)}",
                     fontsize=10)
    ax_t.set_title(f"training step, {env.get('gpu') or env.get('device')}", fontsize=10)
    pending = sum(r["test_acc"] is None for r in rows)
    if pending or result.get("stopped_by"):
        fig.suptitle(f"{pending} of {len(rows)} runs not finished", fontsize=9, color="C3")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# -------------------------------------------------------------------------------------------- CLI
def _density(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"a density must be a number in (0, 1], got {text!r}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"a seed must be a non-negative integer, got {text!r}")
    return v


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    from sparseflash.cmdline import non_negative_int, positive_int
    from sparseflash.experiments.lra.model import ATTENTIONS
    from sparseflash.experiments.lra.train import _minutes, add_data_arguments, add_device_arguments

    add_data_arguments(p, task_required=False)  # --plot-only needs no task
    p.add_argument("--out", help="output directory (runs/, sweep.{csv,json,md,png})")
    p.add_argument("--pattern", default="butterfly", choices=SWEEP_PATTERNS, help="default: butterfly")
    p.add_argument("--densities", nargs="+", type=_density, default=[1.0, 0.5, 0.25, 0.125],
                   help="target block densities, 1 = dense (default: 1 0.5 0.25 0.125)")
    p.add_argument("--seeds", nargs="+", type=_seed, default=[0], help="training seeds (default: 0)")
    p.add_argument("--attention", choices=ATTENTIONS, help="attention implementation (default: the config's)")
    p.add_argument("--block-size", type=positive_int, help="block size of the pattern (default 128)")
    p.add_argument("--max-steps", type=positive_int, help="end each run after this step (its schedule is unchanged)")
    p.add_argument("--init-from", metavar="CHECKPOINT", help="start every run from these weights (Path-X: a Path-64 model)")
    p.add_argument("--init-from-sweep", metavar="SWEEP_OUT",
                   help="start each run from the best.pt of the run of the same name in another sweep (e.g. a "
                        "pathfinder64 sweep at the same densities and seeds, for Path-X)")
    p.add_argument("--time-limit", type=_minutes, metavar="MINUTES",
                   help="end the whole sweep, every run resumable, within MINUTES of its start (exit status 75)")
    add_device_arguments(p)
    p.add_argument("--num-workers", type=non_negative_int, default=2, help="data-loader workers (default 2)")
    p.add_argument("--timing-warmup", type=non_negative_int, default=5, help="untimed steps before the step timing (default 5)")
    p.add_argument("--timing-repeats", type=positive_int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field for every run (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the sweep in --out: finished runs are kept, stopped ones resumed, the rest run")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds a sweep (its runs and tables are removed); without it, "
                        "or --resume, such a folder is refused and left as it is")
    p.add_argument("--dry-run", action="store_true", help="print the settings each density gets; train nothing")
    p.add_argument("--plot-only", metavar="OUT", help="redraw OUT/sweep.png and OUT/sweep.md from OUT/sweep.json")
    p.add_argument("--no-progress", action="store_true")


SWEEP_FILES = ("runs", "sweep.csv", "sweep.json", "sweep.md", "sweep.png")  # what --overwrite removes


def _cmd_sweep(args) -> int:
    from sparseflash.cmdline import CommandError, check_output_dir, claim_output_dir, read_json_object
    from sparseflash.experiments.lra.configs import get_config
    from sparseflash.experiments.lra.train import EXIT_STOPPED

    deadline = time.monotonic() + 60 * args.time_limit if args.time_limit else None
    if args.plot_only:
        out = Path(args.plot_only)
        if not (out / "sweep.json").exists():
            raise CommandError(f"--plot-only: {out / 'sweep.json'} does not exist",
                               "give the --out folder of a sweep that has started")
        result = read_json_object(out / "sweep.json", "run the sweep again with --resume, or restore it from a copy")
        write_tables(result, out)
        print(plot_sweep(result, out / "sweep.png"))
        print(out / "sweep.md")
        return 0
    missing = [f"--{k}" for k in ("task", "out") if getattr(args, k) is None]
    if missing:
        raise CommandError(f"{' and '.join(missing)} required (or --plot-only OUT)", "see sparseflash lra sweep --help")
    overrides = list(args.set)
    if args.attention:
        overrides.append(f"model.attention={args.attention!r}")
    if args.block_size is not None:
        overrides.append(f"model.block_size={args.block_size}")
    cfg = get_config(args.task, args.config, overrides)
    if args.overwrite and args.resume:
        raise CommandError("--overwrite and --resume contradict each other", "give one of them")
    if not args.dry_run:
        check_output_dir(args.out)
        claim_output_dir(args.out, owned=SWEEP_FILES, overwrite=args.overwrite, resume=args.resume, kind="a sweep")
    result = run_sweep(cfg, args.out, pattern=args.pattern, densities=args.densities, seeds=args.seeds,
                       data_root=args.data, cache_dir=args.cache_dir, device=args.device, max_steps=args.max_steps,
                       deadline=deadline, num_workers=args.num_workers, precision=args.precision,
                       timing_warmup=args.timing_warmup, timing_repeats=args.timing_repeats, init_from=args.init_from,
                       init_from_sweep=args.init_from_sweep, dry_run=args.dry_run, show_progress=not args.no_progress)
    if args.dry_run:
        return 0
    print((Path(args.out) / "sweep.md").read_text())
    if result["stopped_by"]:
        print(f"sweep stopped by {result['stopped_by']}; run the same command again with --resume to go on")
        return EXIT_STOPPED
    print(f"results in {args.out}: sweep.csv, sweep.json, sweep.md, sweep.png")
    return 0


def register_lra(subparsers) -> None:
    """Declare ``sparseflash lra sweep`` (called by experiments/lra/cli.py)."""
    p = subparsers.add_parser("sweep", help="accuracy and step time against density of a pattern",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p)
    p.set_defaults(func=_cmd_sweep)


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    parser = ArgumentParser(prog="python -m sparseflash.experiments.lra.sweep", description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser)
    return _cmd_sweep(parser.parse_args(argv))


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    sys.exit(run_command(main))
