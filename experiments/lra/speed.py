"""Runtime versus sparsity on the LRA / Path-X shapes: full training steps and attention alone.

    sparseflash lra speed --task all --out DIR            # every task, every provider (GPU)
    sparseflash lra speed --task listops,pathx --out DIR --patterns butterfly butterfly:n_factors=2
    sparseflash lra speed --tiny --device cpu --out DIR   # labelled smoke run at toy sizes
    sparseflash lra speed --plot-only DIR                 # redraw the figures from DIR/speed.json

For every task, at its true length and batch size (the ``faithful`` config: ListOps 2048, Text 1K
and 4K, Retrieval 2 x 4K, Image 1K, Pathfinder 1K, Path-X 16K, Path-256 64K), random tokens of the
right shape go through full training steps (forward, backward, AdamW step) of the task's model
under bf16 autocast, for each provider:

- ``torch``: standard attention in PyTorch ops (the baseline of the paper's speedups),
- ``sdpa``: ``scaled_dot_product_attention`` (flash / cuDNN kernels), ``flex``: compiled FlexAttention,
- ``sparseflash``: our kernels dense, and ``sparseflash/<pattern>`` block-sparse at several
  densities (by default a sweep of the butterfly: the paper's full butterfly, fewer factors,
  a stretched one), plus ``flex/butterfly`` for the same sparsity in FlexAttention.

Each row: median step time (CUDA events, after warm-up), the median forward + backward time of
one attention call at the same shape (and times the layer count), tokens/s, peak memory, status
(``ok``, ``oom``, ``unsupported``, ``error``). With ``--rounds R`` the whole plan runs R times,
every other round in reverse order, so that slow drift of the machine (clocks, other tenants)
falls on every provider alike; a row then pools the timed steps of all rounds (median, min) and
reports ``step_ms_spread``, the range of the per-round medians over their median: a difference
between two providers smaller than that is noise. Attention dropout is off for every provider (the
compared kernels do not all support it); residual dropout stays. Speedups are over ``torch`` per
task, with the geometric mean over the five LRA tasks of the paper (ListOps, Text, Retrieval,
Image, Pathfinder) and over all tasks measured. Outputs: ``speed.csv``, ``speedup.csv``,
``speed.json`` (rows, summary, environment), ``step_time_vs_density.png``,
``attn_time_vs_density.png``, ``speedup.png`` (over standard attention and over SDPA).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseflash.experiments.lra.configs import LRA5, SPEED_TASKS, get_config
from sparseflash.experiments.lra.model import AttentionKernel, LRAClassifier, ModelConfig, build_pattern, parse_pattern_spec

__all__ = ["Provider", "default_providers", "butterfly_sweep", "task_setup", "measure", "run_speed", "summarize",
           "plot_speed", "register_lra", "main"]

_ROW_COLS = ("mode", "task", "provider", "attention", "pattern", "density", "token_density", "batch", "seqs", "seq_len",
             "d_model", "n_heads", "head_dim", "n_layers", "block_size", "status", "error", "step_ms", "step_ms_min",
             "attn_ms", "attn_ms_per_step", "attn_share", "tokens_per_s", "peak_mem_gb", "repeats", "rounds",
             "failed_rounds", "step_ms_spread")
_SUMMARY_COLS = ("task", "provider", "pattern", "density", "step_ms", "speedup_vs_torch", "speedup_vs_sdpa",
                 "attn_speedup_vs_torch", "tasks")


@dataclass
class Provider:
    attention: str
    pattern: str | None = None  # a pattern spec ("butterfly:n_factors=2"), None for dense
    kwargs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.pattern is None:
            return self.attention
        args = ",".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.attention}/{self.pattern}" + (f":{args}" if args else "")


def butterfly_sweep(seq_len: int, block_size: int) -> list[dict]:
    """Butterfly settings from sparse to dense for a grid: 1 factor, half of them, all of them
    (the paper's pattern), and the full butterfly of half the size stretched 2x2. Duplicates
    (small grids) are dropped."""
    nb = math.ceil(seq_len / block_size)
    log_p = max(0, (nb - 1).bit_length())
    out = []
    for kw in ({"n_factors": min(1, log_p)}, {"n_factors": (log_p + 1) // 2}, {}, {"butterfly_size": 1 << max(0, log_p - 1)}):
        if log_p == 0 and kw:
            continue
        full = dict(kw)
        if full.get("n_factors") == log_p:
            full = {}  # the default: every factor
        if full not in out:
            out.append(full)
    return out


def default_providers(seq_len: int, block_size: int, patterns: list[str] | None = None, flex_sparse: bool = True) -> list[Provider]:
    """Dense baselines, sparseflash dense, sparseflash at each pattern (default: `butterfly_sweep`,
    plus ``local`` with a 2-block window if the zoo has it), flex with the full butterfly."""
    out = [Provider("torch"), Provider("sdpa"), Provider("flex"), Provider("sparseflash")]
    if patterns is None:
        specs = [("butterfly", kw) for kw in butterfly_sweep(seq_len, block_size)]
        import sparseflash.patterns as zoo

        if "local" in getattr(zoo, "__all__", ()):
            specs.append(("local", {"window": 2 * block_size}))
    else:
        specs = [parse_pattern_spec(s) for s in patterns]
    out += [Provider("sparseflash", name, kw) for name, kw in specs if name is not None]
    if flex_sparse:
        out.append(Provider("flex", "butterfly"))
    return out


def task_setup(task: str, tiny: bool = False, block_size: int = 128) -> tuple[ModelConfig, int]:
    """(model config, batch size) of ``task`` at its true shape, or at toy size with ``tiny``
    (length 256 as a 16x16 grid, batch 2, block 32)."""
    cfg = get_config(task, "faithful")
    model = replace(cfg.model, attn_dropout=0.0, block_size=block_size)
    batch = cfg.train.batch_size
    if tiny:
        model = replace(model, seq_len=256, grid=(16, 16) if model.grid else None, block_size=32)
        batch = 2
    return model, batch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup: int, repeats: int, max_seconds: float) -> list[float]:
    """Milliseconds of each timed call of ``fn`` (CUDA events on GPU), after ``warmup`` calls;
    stops early once ``max_seconds`` of timed work is spent (at least 3 calls)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times, spent = [], 0.0
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - t0)
        times.append(ms)
        spent += ms / 1e3
        if spent > max_seconds and len(times) >= 3:
            break
    return times


def _classify_error(e: BaseException) -> tuple[str, str]:
    msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower() or "can't allocate memory" in str(e):
        return "oom", msg
    if isinstance(e, NotImplementedError):
        return "unsupported", msg
    return "error", msg


def _provider_config(task: str, provider: Provider, tiny: bool, block_size: int) -> tuple[ModelConfig, int]:
    """(model config with the provider's attention and pattern, batch) of ``task``."""
    cfg, batch = task_setup(task, tiny, block_size)
    return replace(cfg, attention=provider.attention, pattern=provider.pattern,
                   pattern_kwargs=dict(provider.kwargs)), batch


def _train_step(cfg: ModelConfig, batch: int, device: torch.device, compile: bool = False):
    """A full training step (forward under bf16 autocast on GPU, backward, fused AdamW) of a fresh
    model of ``cfg`` on fixed random tokens of the task's shape, as a closure."""
    torch.manual_seed(0)
    model = LRAClassifier(cfg).to(device)
    net = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    shape = (batch, 2, cfg.seq_len) if cfg.dual else (batch, cfg.seq_len)
    tokens = torch.randint(1, cfg.vocab_size, shape, device=device)
    labels = torch.randint(0, cfg.num_classes, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = net(tokens)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
    return step


def measure(task: str, provider: Provider, *, device="cuda", tiny: bool = False, block_size: int = 128,
            warmup: int = 3, repeats: int = 10, max_seconds: float = 20.0, compile: bool = False) -> dict:
    """One row: time full training steps and one attention call of ``provider`` on ``task``."""
    device = torch.device(device)
    cfg, batch = _provider_config(task, provider, tiny, block_size)
    seqs = batch * (2 if cfg.dual else 1)
    head_dim = cfg.d_model // cfg.n_heads
    row = {"mode": "tiny" if tiny else "full", "task": task, "provider": provider.label, "attention": provider.attention,
           "pattern": provider.label.split("/", 1)[1] if provider.pattern else "dense", "batch": batch, "seqs": seqs,
           "seq_len": cfg.seq_len, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "head_dim": head_dim,
           "n_layers": cfg.n_layers, "block_size": cfg.block_size, "status": "ok", "error": ""}
    precision = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    try:
        mask = build_pattern(cfg.pattern, cfg.attn_len, cfg.block_size, device=device, **cfg.pattern_kwargs)
    except (ValueError, TypeError) as e:
        return {**row, "status": "error", "error": f"pattern: {e}"[:300]}
    row["density"] = mask.density() if mask is not None else 1.0
    row["token_density"] = mask.token_density() if mask is not None else 1.0

    def full_steps():
        step = _train_step(cfg, batch, device, compile)
        if device.type == "cuda":
            step()  # compile / autotune outside the peak-memory window
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = _time(step, device, warmup, repeats, max_seconds)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return times, peak

    def attention_only():
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(seqs, cfg.n_heads, cfg.attn_len, head_dim, device=device, dtype=precision,
                               generator=gen).requires_grad_() for _ in range(3))
        attend = AttentionKernel(cfg.attention, cfg.attn_len, seqs, device, mask=mask, backend=cfg.backend)
        dout = torch.randn_like(q)

        def call():
            with autocast:
                out = attend(q, k, v, 0.0)
            torch.autograd.grad(out, (q, k, v), dout)

        return _time(call, device, warmup, repeats, max_seconds)

    for name, fn in (("step", full_steps), ("attn", attention_only)):
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            status, msg = _classify_error(e)
            if name == "step" or row["status"] == "ok":
                row["status"], row["error"] = status, f"{name}: {msg}"
            result = None
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if result is None:
            continue
        if name == "step":
            times, peak = result
            row.update(step_times=times, peak_mem_gb=peak)
        else:
            row["attn_times"] = result
    return _finish(row)


def _finish(row: dict) -> dict:
    """Fill the statistics of a row from its timed calls (``step_times``, ``attn_times``)."""
    times = row.get("step_times")
    if times:
        med = statistics.median(times)
        row.update(step_ms=med, step_ms_min=min(times), repeats=len(times),
                   tokens_per_s=row["seqs"] * row["seq_len"] / (med / 1e3))  # seqs: both documents of dual tasks
    if row.get("attn_times"):
        row.update(attn_ms=statistics.median(row["attn_times"]),
                   attn_ms_per_step=statistics.median(row["attn_times"]) * row["n_layers"])
    if row.get("step_ms") and row.get("attn_ms_per_step"):
        row["attn_share"] = row["attn_ms_per_step"] / row["step_ms"]
    return row


def merge_rounds(rows: list[dict]) -> dict:
    """One row from the rows of one (task, provider) measured in several rounds: the timed calls
    of the rounds that ran pooled, the peak memory the largest, ``step_ms_spread`` = (max - min) /
    median of the per-round step medians, ``rounds`` the rounds that ran and ``failed_rounds`` the
    others. With no round run the row is the first failure (status and error)."""
    good = [r for r in rows if r["status"] == "ok"]
    failed = len(rows) - len(good)
    if not good:
        return {**rows[0], "rounds": 0, "failed_rounds": failed}
    rows = good
    merged = {k: v for k, v in rows[0].items() if k not in ("step_times", "attn_times")}
    merged["failed_rounds"] = failed
    merged["step_times"] = [t for r in rows for t in r.get("step_times", [])]
    merged["attn_times"] = [t for r in rows for t in r.get("attn_times", [])]
    peaks = [r["peak_mem_gb"] for r in rows if r.get("peak_mem_gb") is not None]
    merged["peak_mem_gb"] = max(peaks) if peaks else None
    merged["rounds"] = len(rows)
    _finish(merged)
    medians = [statistics.median(r["step_times"]) for r in rows if r.get("step_times")]
    if len(medians) > 1:
        merged["step_ms_spread"] = (max(medians) - min(medians)) / statistics.median(medians)
    return merged


def summarize(rows: list[dict]) -> list[dict]:
    """Per task and provider: speedups over standard attention (``torch``) and over SDPA; then the
    geometric mean per provider over the LRA tasks of the paper and over every task (only tasks
    where both the provider and the baseline ran)."""
    ok = {(r["task"], r["provider"]): r for r in rows if r["status"] == "ok" and r.get("step_ms")}
    out = []
    for (task, prov), r in ok.items():
        base, sdpa = ok.get((task, "torch")), ok.get((task, "sdpa"))
        out.append({"task": task, "provider": prov, "pattern": r["pattern"], "density": r["density"],
                    "step_ms": r["step_ms"],
                    "speedup_vs_torch": base["step_ms"] / r["step_ms"] if base else None,
                    "speedup_vs_sdpa": sdpa["step_ms"] / r["step_ms"] if sdpa else None,
                    "attn_speedup_vs_torch": (base["attn_ms"] / r["attn_ms"]) if base and base.get("attn_ms") and r.get("attn_ms") else None,
                    "tasks": 1})
    per_task = list(out)
    for group, tasks in (("geomean(LRA)", LRA5), ("geomean(all)", None)):
        for prov in dict.fromkeys(s["provider"] for s in per_task):
            sel = [s for s in per_task if s["provider"] == prov and (tasks is None or s["task"] in tasks)]
            row = {"task": group, "provider": prov, "pattern": sel[0]["pattern"] if sel else "", "density": None,
                   "step_ms": None, "tasks": 0}
            for key in ("speedup_vs_torch", "speedup_vs_sdpa", "attn_speedup_vs_torch"):
                vals = [s[key] for s in sel if s[key]]
                row[key] = math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None
                if key == "speedup_vs_torch":
                    row["tasks"] = len(vals)
            if row["tasks"]:
                out.append(row)
    return out


def _environment(device) -> dict:
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": sys.version.split()[0], "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    from sparseflash.experiments.lra.provenance import code_commit

    env["commit"] = code_commit()  # SPARSEFLASH_COMMIT overrides a copied tree's stale .git
    return env


def _write_csv(path: Path, rows: list[dict], cols) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _prepare(tasks, device, out_dir) -> tuple[torch.device, Path]:
    """Check the task names and the device; make the output directory."""
    unknown = [t for t in tasks if t not in SPEED_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}: choose from {SPEED_TASKS} or 'all'")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device (use --device cpu --tiny)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        from sparseflash.flash import native

        if native.ENABLED:
            try:  # built before timing, not in the background of the first steps
                native.load()
            except Exception as e:  # noqa: BLE001 - the Python short path serves the calls
                print(f"sparseflash native short path off: {e}")
    return device, out


def _task_providers(task: str, tiny: bool, block_size: int, patterns, providers, flex_sparse: bool) -> list[Provider]:
    """`default_providers` of ``task``, keeping only those whose label or attention ``providers`` lists."""
    cfg, _ = task_setup(task, tiny, block_size)
    return [p for p in default_providers(cfg.attn_len, cfg.block_size, patterns, flex_sparse)
            if providers is None or p.label in providers or p.attention in providers]


def run_speed(tasks, out_dir, *, device="cuda", tiny: bool = False, patterns: list[str] | None = None,
              providers: list[str] | None = None, flex_sparse: bool = True, block_size: int = 128, warmup: int = 3,
              repeats: int = 10, max_seconds: float = 20.0, compile: bool = False, show_progress: bool = True,
              plots: bool = True, rounds: int = 1) -> dict:
    """Measure every (task, provider) ``rounds`` times (alternating the order), write the tables
    and plots into ``out_dir``; returns the speed.json content. ``providers`` keeps only rows whose
    label or attention is listed. Results are rewritten after every row (merging the rounds done so
    far), so an interrupted sweep keeps what it measured."""
    from sparseflash._progress import Progress

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    device, out = _prepare(tasks, device, out_dir)
    plan = [(task, p) for task in tasks
            for p in _task_providers(task, tiny, block_size, patterns, providers, flex_sparse)]
    result = {"environment": {**_environment(device), "mode": "tiny" if tiny else "full", "warmup": warmup,
                              "repeats": repeats, "rounds": rounds}, "rows": [], "summary": []}
    measured: dict = {}  # (task, provider label) -> its rows, one per round done
    merged: dict = {}  # (task, provider label) -> those rows merged (the row written)
    with Progress(rounds * len(plan), "lra speed", disable=not show_progress) as bar:
        for rnd in range(rounds):
            for task, p in (plan if rnd % 2 == 0 else plan[::-1]):
                done = measured.get((task, p.label), [])
                if done and done[0]["status"] != "ok":  # out of memory, unsupported, ...: once is enough
                    bar.update(1)
                    continue
                row = measure(task, p, device=device, tiny=tiny, block_size=block_size, warmup=warmup,
                              repeats=repeats, max_seconds=max_seconds, compile=compile)
                measured.setdefault((task, p.label), []).append(row)
                merged[task, p.label] = merge_rounds(measured[task, p.label])
                result["rows"] = list(merged.values())
                result["summary"] = summarize(result["rows"])
                _write_csv(out / "speed.csv", result["rows"], _ROW_COLS)
                _write_csv(out / "speedup.csv", result["summary"], _SUMMARY_COLS)
                (out / "speed.json").write_text(json.dumps(result, indent=2))
                shown = f"{row['step_ms']:.1f} ms" if row.get("step_ms") else row["status"]
                bar.update(1, postfix=f"round {rnd + 1}: {task} {p.label}: {shown}")
    if plots:
        plot_speed(result, out)
    return result


# ----------------------------------------------------------------------------------- paired steps
def _median_ci(x: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of ``x``."""
    import numpy as np

    a = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    return float(np.quantile(meds, (1 - level) / 2)), float(np.quantile(meds, (1 + level) / 2))


PAIRED_DENSE = "sparseflash"  # run_paired's second reference: our dense kernel


def run_paired(tasks, out_dir, *, device="cuda", tiny: bool = False, patterns: list[str] | None = None,
               providers: list[str] | None = None, flex_sparse: bool = False, block_size: int = 128,
               warmup: int = 5, steps: int = 40, show_progress: bool = True) -> dict:
    """Training steps of a task's providers alternated one by one (A B C, C B A, ...) ``steps``
    times each, so that a host-bound step's drift (clocks, other tenants, Python's allocator)
    falls on every provider alike, and each step is compared with the reference's step beside it.
    The reference is ``sdpa`` when measured, else the first provider. Per row: median and min
    step ms, and the median over pairs of step / the reference's step with a 95% bootstrap
    interval (``ratio_lo``, ``ratio_hi``; below 1: faster than the reference). Where our dense
    kernel (``sparseflash``) is measured too, every row also gets the same statistics against its
    step of the same pass (``vs_dense``, ``vs_dense_lo``, ``vs_dense_hi``): "block-sparse faster
    than both dense kernels" is then two intervals under 1. Writes ``paired.json`` (with every
    step's time), ``paired.csv`` and the figure ``paired.png`` into ``out_dir``."""
    from sparseflash._progress import Progress

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be an int >= 3, got {steps!r}")
    device, out = _prepare(tasks, device, out_dir)
    result = {"environment": {**_environment(device), "mode": "tiny" if tiny else "full", "warmup": warmup,
                              "steps": steps, "paired": True}, "rows": []}
    cols = ("task", "provider", "reference", "density", "batch", "seq_len", "n_layers", "status", "error", "step_ms",
            "step_ms_min", "ratio", "ratio_lo", "ratio_hi", "vs_dense", "vs_dense_lo", "vs_dense_hi", "steps")
    for task in tasks:
        plan = _task_providers(task, tiny, block_size, patterns, providers, flex_sparse)
        labels = [p.label for p in plan]
        ref = "sdpa" if "sdpa" in labels else labels[0]
        runs, rows = {}, {}
        for p in plan:
            cfg, batch = _provider_config(task, p, tiny, block_size)
            rows[p.label] = {"task": task, "provider": p.label, "reference": ref, "density": None, "batch": batch,
                             "seq_len": cfg.seq_len, "n_layers": cfg.n_layers, "status": "ok", "error": "", "times": []}
            try:
                mask = build_pattern(cfg.pattern, cfg.attn_len, cfg.block_size, device=device, **cfg.pattern_kwargs)
                rows[p.label]["density"] = mask.density() if mask is not None else 1.0
                step = _train_step(cfg, batch, device)
                for _ in range(warmup):
                    step()
                _sync(device)
                runs[p.label] = step
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                rows[p.label]["status"], rows[p.label]["error"] = _classify_error(e)
        order = [lb for lb in labels if lb in runs]
        with Progress(steps, f"lra paired {task}", disable=not show_progress) as bar:
            for i in range(steps):
                for lb in (order if i % 2 == 0 else order[::-1]):
                    rows[lb]["times"].append(_time(runs[lb], device, 0, 1, float("inf"))[0])
                bar.update(1)
        for lb, row in rows.items():
            t = row["times"]
            if not t:
                continue
            row.update(step_ms=statistics.median(t), step_ms_min=min(t), steps=len(t))
            for key, other in (("ratio", ref), ("vs_dense", PAIRED_DENSE)):
                if lb in runs and other in runs:
                    ratios = [a / b for a, b in zip(t, rows[other]["times"])]
                    lo, hi = _median_ci(ratios)
                    row.update({key: statistics.median(ratios), f"{key}_lo": lo, f"{key}_hi": hi})
        del runs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["rows"] += list(rows.values())
        (out / "paired.json").write_text(json.dumps(result, indent=2))
        _write_csv(out / "paired.csv", result["rows"], cols)
    plot_paired(result, out)
    return result


def _task_grid(plt, n: int):
    """A figure of one panel per task, four to a row: (figure, the first ``n`` axes); the
    panels past ``n`` are hidden."""
    cols = min(4, max(1, n))
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def plot_paired(result: dict, out_dir) -> Path:
    """``paired.png``: per task, each provider's median step over the reference's (SDPA) step of
    the same pass against block density, with its 95% interval; our dense kernel's interval is
    drawn across as a band, so a block-sparse point under both the band and 1 is faster than both
    dense kernels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in result["rows"] if r.get("ratio") is not None]
    tasks = list(dict.fromkeys(r["task"] for r in result["rows"]))
    fig, axes = _task_grid(plt, len(tasks))
    for ax, task in zip(axes, tasks):
        tr = [r for r in rows if r["task"] == task]
        ref = tr[0]["reference"] if tr else "sdpa"
        ax.axhline(1.0, color="C2", ls=":", label=f"{ref} (reference)")
        dense = next((r for r in tr if r["provider"] == PAIRED_DENSE), None)
        if dense is not None:
            ax.axhspan(dense["ratio_lo"], dense["ratio_hi"], color="C0", alpha=0.2,
                       label=f"sparseflash dense {dense['ratio']:.3f}")
        families = dict.fromkeys(r["provider"].split(":")[0] for r in tr if "/" in r["provider"])
        for i, fam in enumerate(families):
            pts = sorted((r["density"], r["ratio"], r["ratio_lo"], r["ratio_hi"]) for r in tr
                         if r["provider"].split(":")[0] == fam and r["density"] is not None)
            if pts:
                d, m, lo, hi = zip(*pts)
                ax.errorbar(d, m, yerr=[[a - b for a, b in zip(m, lo)], [b - a for a, b in zip(m, hi)]],
                            fmt="o-", capsize=3, color=f"C{(1, 3, 4, 5, 6)[i % 5]}", label=fam.split("/", 1)[-1])
        failed = [r["provider"] for r in result["rows"] if r["task"] == task and r["status"] != "ok"]
        first = next((r for r in result["rows"] if r["task"] == task), {})
        shape = f" ({first.get('seq_len')} x {first.get('batch')})" if first else ""
        ax.set_title(task + shape + (f"\nfailed: {', '.join(failed)}" if failed else ""), fontsize=9)
        ax.set_xscale("log")
        ticks = []  # at the measured densities, none within 30% of the previous one
        for d in sorted({r["density"] for r in tr if r["density"] is not None and r["density"] < 1}):
            if not ticks or d > 1.3 * ticks[-1]:
                ticks.append(d)
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel("block density")
        ax.set_ylabel(f"step / {ref} step (median, 95%)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    env = result.get("environment", {})
    fig.suptitle(f"LRA training steps, paired with {rows[0]['reference'] if rows else 'sdpa'}'s "
                 f"({env.get('steps')} pairs, {env.get('mode', 'full')}), {env.get('gpu') or env.get('device', '')}")
    fig.tight_layout()
    path = Path(out_dir) / "paired.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ plots
def plot_speed(result: dict, out_dir) -> list[Path]:
    """Draw step time and attention time against density per task, and speedup bars per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out = Path(out_dir)
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    tasks = list(dict.fromkeys(r["task"] for r in result["rows"]))
    mode = result.get("environment", {}).get("mode", "full")
    device = result.get("environment", {}).get("gpu") or result.get("environment", {}).get("device", "")
    paths = []
    for key, fname, ylabel in (("step_ms", "step_time_vs_density.png", "training step (ms)"),
                               ("attn_ms", "attn_time_vs_density.png", "attention fwd+bwd, one layer (ms)")):
        fig, axes = _task_grid(plt, len(tasks))
        for ax, task in zip(axes, tasks):
            tr = [r for r in rows if r["task"] == task and r.get(key)]
            for attention, style in (("sparseflash", "o-"), ("flex", "s--")):
                mine = [r for r in tr if r["attention"] == attention]
                dense = [(r["density"], r[key]) for r in mine if r["pattern"] == "dense"]
                families = dict.fromkeys(r["pattern"].split(":")[0] for r in mine if r["pattern"] != "dense")
                for fam in families:  # one line per pattern family, through the dense point
                    pts = sorted(dense + [(r["density"], r[key]) for r in mine if r["pattern"].split(":")[0] == fam])
                    ax.plot(*zip(*pts), style, label=f"{attention} {fam}")
                if dense and not families:
                    ax.plot(*zip(*dense), style[0], label=f"{attention} (dense)")
            for r in tr:
                if r["attention"] in ("torch", "sdpa"):
                    ax.axhline(r[key], ls=":", color="C3" if r["attention"] == "torch" else "C2",
                               label=f"{r['attention']} (dense)")
            failed = [r["provider"] for r in result["rows"] if r["task"] == task and r["status"] != "ok"]
            title = task + (f"\nfailed: {', '.join(failed)}" if failed else "")
            ax.set_title(title, fontsize=8 if failed else 10)
            ax.set_xlabel("block density")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers, no crowded minor labels
                axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticks([t for t in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
                           if min(r["density"] for r in tr or [{"density": 1.0}]) / 1.5 <= t])
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(f"LRA shapes ({mode}), {device}: {ylabel} vs density")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)

    summary = result["summary"]
    groups = tasks + [g for g in ("geomean(LRA)", "geomean(all)") if any(s["task"] == g for s in summary)]
    show = ["torch", "sdpa", "flex", "sparseflash", "sparseflash/butterfly", "flex/butterfly"]
    show = [p for p in show if any(s["provider"] == p for s in summary)]
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(6.0, 1.2 * len(groups)), 4))
    width = 0.8 / max(1, len(show))
    for ax, key, base in ((axes[0], "speedup_vs_torch", "standard attention"), (axes[1], "speedup_vs_sdpa", "SDPA")):
        for i, prov in enumerate(show):
            vals = [next((s[key] for s in summary if s["task"] == g and s["provider"] == prov), None) or 0 for g in groups]
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=prov, color=f"C{i}")
        for j, g in enumerate(groups):
            if g in tasks and not any(s["task"] == g and s[key] for s in summary):
                ax.text(j + 0.4 - width / 2, 0.05, f"{base}\nfailed / OOM", ha="center", fontsize=7, rotation=90, va="bottom")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=20, fontsize=8)
        ax.set_ylabel(f"speedup over {base} (step time)")
        ax.set_title(f"Training-step speedup over {base} ({mode}), {device}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)
    paths.append(out / "speedup.png")
    return paths


# -------------------------------------------------------------------------------------------- CLI
# what a measuring command writes in --out (and refuses to replace without --overwrite)
SPEED_FILES = ("speed.csv", "speedup.csv", "speed.json", "step_time_vs_density.png", "attn_time_vs_density.png",
               "speedup.png")
PAIRED_FILES = ("paired.json", "paired.csv", "paired.png")


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    from sparseflash.cmdline import non_negative_int, positive_int

    p.add_argument("--task", default="all", help=f"'all' or a comma-separated list of {', '.join(SPEED_TASKS)}")
    p.add_argument("--out", required=True, help="output directory (with --plot-only: the directory to redraw)")
    p.add_argument("--patterns", nargs="+", help="block patterns for sparseflash, e.g. butterfly 'butterfly:n_factors=2' "
                                                "(default: a butterfly sweep per task, plus local if available)")
    p.add_argument("--providers", nargs="+", help="keep only these providers (labels or attention kinds)")
    p.add_argument("--no-flex-sparse", action="store_true", help="skip FlexAttention with the butterfly pattern")
    p.add_argument("--block-size", type=positive_int, default=128)
    p.add_argument("--device", help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (length 256, batch 2): a labelled smoke run")
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=10, help="timed calls per measurement (per round)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run the whole plan this many times, alternating its order, and pool the timings")
    p.add_argument("--max-seconds", type=float, default=20.0, help="timed seconds per measurement at most")
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model (flex is always compiled)")
    p.add_argument("--paired", type=non_negative_int, metavar="STEPS", default=0,
                   help="alternate single training steps of the providers, STEPS timed steps each, and compare "
                        "each step with the reference's (sdpa) and our dense kernel's beside it: OUT/paired.json, "
                        "paired.csv, paired.png")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw the figures from OUT/speed.json and OUT/paired.json, whichever are there")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier measurement in --out; without it they are refused")
    p.add_argument("--no-progress", action="store_true")


def _cmd_speed(args) -> int:
    from sparseflash.cmdline import CommandError, check_output_dir, claim_output_files, read_json_object

    if args.plot_only:
        out = Path(args.out)
        remedy = "measure again with lra speed, or restore it from a copy"
        speed, paired = (read_json_object(out / name, remedy) for name in ("speed.json", "paired.json"))
        if speed is None and paired is None:
            raise CommandError(f"--out {out} holds neither speed.json nor paired.json", "run lra speed there first")
        if speed is not None:
            for path in plot_speed(speed, out):
                print(path)
        if paired is not None:
            print(plot_paired(paired, out))
        return 0
    tasks = list(SPEED_TASKS) if args.task == "all" else [t.strip() for t in args.task.split(",") if t.strip()]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_output_dir(args.out)
    claim_output_files(args.out, PAIRED_FILES if args.paired else SPEED_FILES, overwrite=args.overwrite)
    if args.paired:
        result = run_paired(tasks, args.out, device=device, tiny=args.tiny, patterns=args.patterns,
                            providers=args.providers, flex_sparse=not args.no_flex_sparse, block_size=args.block_size,
                            warmup=args.warmup, steps=args.paired, show_progress=not args.no_progress)
        print(f"{'task':14s} {'provider':36s} {'density':>8s} {'step ms':>9s} {'min':>7s} {'x ref (95%)':>20s}"
              f" {'x our dense (95%)':>20s}")
        for r in result["rows"]:
            ratio, vs_dense = ((f"{r[k]:.3f} ({r[k + '_lo']:.3f}-{r[k + '_hi']:.3f})" if r.get(k) is not None
                                else r["status"] if r["status"] != "ok" else "-") for k in ("ratio", "vs_dense"))
            ms = (f"{r['step_ms']:9.2f} {r['step_ms_min']:7.2f}" if r.get("step_ms") is not None else f"{'-':>9s} {'-':>7s}")
            dens = "-" if r["density"] is None else f"{r['density']:.3f}"
            print(f"{r['task']:14s} {r['provider']:36s} {dens:>8s} {ms} {ratio:>20s} {vs_dense:>20s}")
        print(f"results in {args.out}")
        return 0
    result = run_speed(tasks, args.out, device=device, tiny=args.tiny, patterns=args.patterns, providers=args.providers,
                       flex_sparse=not args.no_flex_sparse, block_size=args.block_size, warmup=args.warmup,
                       repeats=args.repeats, max_seconds=args.max_seconds, compile=args.compile,
                       show_progress=not args.no_progress, rounds=args.rounds)
    print(f"{'task':14s} {'provider':36s} {'density':>8s} {'step ms':>9s} {'attn ms':>9s} {'mem GB':>7s} {'x torch':>8s}")
    speed = {(s["task"], s["provider"]): s for s in result["summary"]}
    for r in result["rows"]:
        s = speed.get((r["task"], r["provider"]), {})
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"{r['task']:14s} {r['provider']:36s} {fmt(r.get('density'), '8.3f')} "
              f"{fmt(r.get('step_ms'), '9.2f') if r['status'] == 'ok' else r['status']:>9s} {fmt(r.get('attn_ms'), '9.3f')} "
              f"{fmt(r.get('peak_mem_gb'), '7.2f')} {fmt(s.get('speedup_vs_torch'), '8.2f')}")
    for s in result["summary"]:
        if s["task"].startswith("geomean") and s["speedup_vs_torch"]:
            print(f"{s['task']} {s['provider']}: {s['speedup_vs_torch']:.2f}x over standard attention ({s['tasks']} tasks)")
    print(f"results in {args.out}")
    return 0


def register_lra(subparsers) -> None:
    """Declare ``sparseflash lra speed`` (called by experiments/lra/cli.py)."""
    p = subparsers.add_parser("speed", help="runtime vs sparsity of training steps on the LRA shapes",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_speed_arguments(p)
    p.set_defaults(func=_cmd_speed)


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    parser = ArgumentParser(prog="python -m sparseflash.experiments.lra.speed", description=__doc__.split("\n\n")[0])
    add_speed_arguments(parser)
    return _cmd_speed(parser.parse_args(argv))


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    sys.exit(run_command(main))
