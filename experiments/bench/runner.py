"""The measurement loop shared by the sweeps: (shape, mask point, provider) jobs -> tidy rows.

Each job is checked for availability first (a provider that cannot run here gives a row with
status ``unavailable: why``), then measured; an exception in one provider becomes that row's
status (``OOM``, ``unavailable: ...`` when SDPA finds no kernel for the inputs, or
``error: Type: message``) and the sweep goes on.

On a CPU (the README's small labelled demo) each point is the median CPU time per call over five
interleaved rounds on one thread, its 25th-75th percentile drawn as error bars; two runs agreed
within 5% on all 36 rows on a quiet 2-core machine, within 20% on 33 of 36 under a load of 3-4.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch

from sparseflash._progress import Progress
from sparseflash.experiments.bench.flops import attended_pairs, attention_flops, dense_pairs
from sparseflash.experiments.bench.providers import Provider, Setting, device_label, dtype_of
from sparseflash.experiments.bench.results import CPU_NOTE
from sparseflash.experiments.bench.timing import TimingConfig, free_memory, is_oom, measure, pooled
from sparseflash.mask import BlockMask

__all__ = ["Shape", "Point", "Job", "dense_point", "jobs_for", "estimate_seconds", "run_job", "run_jobs", "execute", "default_kernels",
           "CHECK_TOL"]

# Rough FlexAttention compile cost for the time estimate: seconds per compiled graph (a guess; the
# first_ms column of the results records what it really was).
_FLEX_COMPILE_S = {"fwd": 6.0, "bwd": 15.0, "fwdbwd": 15.0}


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    block_size: int


@dataclass
class Point:
    """A mask (None: dense) with its provenance and densities."""

    pattern: str
    param: str
    mask: BlockMask | None
    density: float
    token_density: float
    rel_density: float
    mask_ms: float = float("nan")
    ends: bool = True  # densest or sparsest mask of its sweep (where masked providers run by default)


@dataclass
class Job:
    shape: Shape
    point: Point
    provider: Provider


def dense_point(seq_len: int, causal: bool) -> Point:
    td = dense_pairs(seq_len, seq_len, causal) / (seq_len * seq_len)
    return Point("dense", "", None, 1.0, td, 1.0)


def jobs_for(shape: Shape, points: list[Point], providers: list[Provider], masked_points: str = "all") -> list[Job]:
    """Dense providers at the dense point; sparse providers at every mask point; masked providers
    (which compute every pair whatever the mask) at every point, or with ``masked_points="ends"``
    only at the points flagged ``ends``."""
    jobs = []
    for pt in points:
        for p in providers:
            if (p.kind == "dense") != (pt.mask is None):
                continue
            if p.kind == "masked" and masked_points == "ends" and not pt.ends:
                continue
            jobs.append(Job(shape, pt, p))
    return jobs


def _setting(job: Job, device: torch.device, sf_backend: str) -> Setting:
    s = job.shape
    return Setting(device, dtype_of(s.dtype), s.batch, s.heads, s.seq_len, s.head_dim, s.causal, s.mode,
                   job.point.mask, sf_backend)


def estimate_seconds(jobs: list[Job], device: torch.device, sf_backend: str,
                     cfg: TimingConfig) -> tuple[float, int, int]:
    """(rough seconds, measurements, FlexAttention compiles) for the runnable jobs."""
    runnable = [j for j in jobs if j.provider.check(_setting(j, device, sf_backend)) is None]
    flex_graphs = {(j.shape, j.provider.name) for j in runnable if j.provider.name.startswith("flex")}
    per = (cfg.warmup_ms + cfg.rep_ms) / 1000 * 1.6 + 0.05
    compile_s = sum(_FLEX_COMPILE_S[shape.mode] for shape, _ in flex_graphs)
    return len(runnable) * per + compile_s, len(runnable), len(flex_graphs)


def _make_inputs(s: Setting):
    def make():
        shape = (s.batch, s.heads, s.seq_len, s.head_dim)
        grad = s.mode != "fwd"
        qkv = tuple(torch.randn(shape, device=s.device, dtype=s.dtype).requires_grad_(grad) for _ in range(3))
        return qkv + (torch.randn(shape, device=s.device, dtype=s.dtype),) if grad else qkv

    return make


def _make_step(p: Provider, s: Setting):
    def make(ctx, inputs):
        if s.mode == "fwd":
            q, k, v = inputs

            def step():
                with torch.no_grad():
                    p.forward(ctx, s, q, k, v)

            return step
        q, k, v, do = inputs
        if s.mode == "fwdbwd":
            def step():
                out = p.forward(ctx, s, q, k, v)
                torch.autograd.grad(out, (q, k, v), do)

            return step
        out = p.forward(ctx, s, q, k, v)  # mode "bwd": forward once, outside the numbers

        def step():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        return step

    return make


def _short(text: str, n: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _row(env, bench, job: Job, s: Setting, timing_label: str) -> dict:
    sh, pt, p = job.shape, job.point, job.provider
    pairs = attended_pairs(pt.mask, sh.batch, sh.heads, sh.seq_len, sh.seq_len, sh.causal)
    return {
        **env, "bench": bench, "provider": p.name, "label": device_label(p, s), "kind": p.kind, "backend": p.backend(s),
        "pattern": pt.pattern, "param": pt.param, "density": pt.density, "token_density": pt.token_density,
        "rel_density": pt.rel_density, "batch": sh.batch, "heads": sh.heads, "seq_len": sh.seq_len,
        "head_dim": sh.head_dim, "dtype": sh.dtype, "causal": sh.causal, "mode": sh.mode,
        "block_size": sh.block_size if pt.mask is not None else None,
        "flops": attention_flops(pairs, sh.head_dim, sh.mode), "ms": float("nan"), "ms_lo": float("nan"), "ms_hi": float("nan"),
        "n_runs": None, "tflops": float("nan"),
        "peak_mem_mb": float("nan"), "mask_ms": pt.mask_ms, "prep_ms": float("nan"), "first_ms": float("nan"),
        "n_sets": None, "max_err": None,
        "status": "", "note": "; ".join(n for n in (CPU_NOTE if env["device"] == "cpu" else "", _env_note()) if n),
        "timing": timing_label,
    }


def default_kernels(device, dtype: str, head_dims) -> str:
    """The kernel family sparseflash's default path takes for this run's calls that the Hopper
    kernels implement (no dropout, segments or score modifications): "hopper" when the Hopper
    forward takes a call of every head_dim of the run on ``device``, else "portable (<why not>)",
    the Hopper forward's own reason (`sparseflash.flash.hopper.forward.unsupported`). Written into
    the run's meta, so BENCHMARKS.md names the kernels each table measured."""
    from sparseflash.flash.hopper import forward as hopper_forward

    why = []
    for d in head_dims:
        q = torch.zeros(1, 1, 128, d, device=device, dtype=dtype_of(dtype))
        reason = hopper_forward.unsupported(q, q, q)
        if reason is not None and reason not in why:
            why.append(reason)
    return "hopper" if not why else f"portable ({'; '.join(why)})"


def _env_note() -> str:
    """Kernel settings taken from the environment (measurement switches), so rows say what ran."""
    return "; ".join(f"{k}={os.environ[k]}" for k in ("SPARSEFLASH_GATHER_MAX",) if os.environ.get(k))


def _note(row: dict, text: str) -> None:
    row["note"] = f"{row['note']}; {text}" if row["note"] else text


class _Checker:
    """Max abs error of a provider's forward output against the float32 reference on fixed inputs
    (the reference output is cached for the current shape and mask, shared by the providers)."""

    def __init__(self):
        self.key, self.data = None, None

    def __call__(self, job: Job, s: Setting):
        def after(ctx):
            from sparseflash import reference

            key = (s.batch, s.heads, s.seq_len, s.head_dim, s.dtype, s.causal, id(job.point))
            if self.key != key:
                self.key, self.data = None, None
                g = torch.Generator(device=s.device).manual_seed(1234)
                shape = (s.batch, s.heads, s.seq_len, s.head_dim)
                q, k, v = (torch.randn(shape, generator=g, device=s.device, dtype=s.dtype) for _ in range(3))
                ref = reference.attention(q.float(), k.float(), v.float(), s.mask, causal=s.causal, scale=s.scale)
                self.key, self.data = key, (q, k, v, ref)
            q, k, v, ref = self.data
            with torch.no_grad():
                out = job.provider.forward(ctx, s, q, k, v)
            return float((out.float() - ref).abs().max())

        def guarded(ctx):  # a failed check must not throw away the timing
            try:
                return after(ctx), None
            except Exception as e:
                self.clear()
                return float("nan"), f"check failed: {_short(f'{type(e).__name__}: {e}', 160)}"

        return guarded

    def clear(self):
        self.key, self.data = None, None


# Max abs error above which a checked row is reported as a possible mismatch (outputs are O(1)).
CHECK_TOL = {"bf16": 0.06, "fp16": 0.01, "fp32": 1e-3}


def run_job(job: Job, env: dict, bench: str, device: torch.device, sf_backend: str, cfg: TimingConfig,
            checker: _Checker | None = None) -> dict:
    s = _setting(job, device, sf_backend)
    if device.type != "cuda":
        timing_label = (f"process CPU time per call, median of the calls of {cfg.rounds} interleaved round(s) of "
                        f"{cfg.rep_ms:g} ms after {cfg.warmup_ms:g} ms of warm-up; ms_lo / ms_hi: 25th / 75th "
                        f"percentiles")
    elif cfg.cuda_graph:
        timing_label = f"do_bench_cudagraph median (kernels only, no host overhead), rep {cfg.rep_ms:g} ms"
    else:
        timing_label = (f"back-to-back calls, CUDA events per sample, median (host cost included where "
                        f"host-bound), warmup {cfg.warmup_ms:g} ms, rep {cfg.rep_ms:g} ms")
    row = _row(env, bench, job, s, timing_label)
    reason = job.provider.check(s)
    if reason is not None:
        row["status"] = f"unavailable: {reason}"
        return row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            m = measure(lambda: job.provider.prepare(s), _make_inputs(s), _make_step(job.provider, s), device, cfg,
                        after=None if checker is None else checker(job, s))
        except Exception as e:  # one provider failing must not end the sweep
            if is_oom(e):
                row["status"] = "OOM"
            elif "no available kernel" in str(e).lower():
                why = [str(w.message) for w in caught if "not used because" in str(w.message)]
                row["status"] = "unavailable: " + _short("; ".join(why) or str(e))
            else:
                row["status"] = "error: " + _short(f"{type(e).__name__}: {e}")
            m = None
    if m is None:
        free_memory()  # after the exception is gone: its traceback held the failed call's tensors
        return row
    if m.after is not None:
        row["max_err"], problem = m.after
        if problem:
            _note(row, problem)
            free_memory()
    row.update(ms=m.ms, prep_ms=m.prep_ms, first_ms=m.first_ms, n_sets=m.n_sets, status="ok",
               peak_mem_mb=m.peak_bytes / 2**20 if m.peak_bytes is not None else float("nan"))
    if m.samples:
        row.update(pooled(m.samples), samples=m.samples)
    _set_tflops(row)
    text = [str(w.message) for w in caught]
    fallback = [t for t in text if "flex_attention" in t.lower() and "compile" in t.lower()]
    if fallback:
        _note(row, _short(fallback[0], 160))
    return row


def _set_tflops(row: dict) -> None:
    row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12 if row["ms"] > 0 else float("nan")


def run_jobs(jobs: list[Job], env: dict, bench: str, device: torch.device, sf_backend: str, cfg: TimingConfig,
             show_progress: bool = True, check: bool = False) -> list[dict]:
    """Measure every job (and with ``check`` compare each provider's output with the reference).
    A provider that cannot run on this machine at all gets one ``unavailable`` row (its first
    job) instead of one per setting. On a CPU with ``cfg.rounds > 1`` the plan runs that many
    times, every other pass in reverse order, and each row pools its samples (`timing.pooled`)."""
    rounds = cfg.rounds if device.type != "cuda" else 1
    rows, unavailable = {}, set()
    checker = _Checker() if check else None
    with Progress(len(jobs) * rounds, f"bench {bench}", disable=not show_progress) as bar:
        for r in range(rounds):
            order = list(enumerate(jobs))
            for i, job in (order if r % 2 == 0 else order[::-1]):
                sh = job.shape
                bar.set_postfix(f"{job.provider.name} {job.point.pattern} {job.point.param} N={sh.seq_len} "
                                f"d={sh.head_dim} {sh.mode}"[:90])
                if job.provider.name not in unavailable and (r == 0 or rows.get(i, {}).get("status") == "ok"):
                    row = run_job(job, env, bench, device, sf_backend, cfg, checker if r == 0 else None)
                    if r == 0:
                        if job.provider.check(_setting(job, device, sf_backend)) is not None:
                            unavailable.add(job.provider.name)
                        rows[i] = row
                    elif row["status"] == "ok":
                        rows[i]["samples"] += row["samples"]
                bar.update()
    if checker is not None:
        checker.clear()
    out = [rows[i] for i in sorted(rows)]
    for row in out:
        samples = row.pop("samples", None)
        if samples:
            row.update(pooled(samples))
            _set_tflops(row)
    return out


# torch threads of a CPU sweep: with several, a call waits at every parallel region for its
# slowest thread, which another process's load deschedules at random (runs 1.4-2.4x apart on a
# shared 2-core machine); one thread's CPU time per call repeats far better.
CPU_THREADS = 1


@contextlib.contextmanager
def _steady_malloc():
    """glibc: keep freed memory in the process during a CPU sweep. By default every large tensor
    is a fresh mmap whose pages fault in on first touch (1500-2600 faults and 3-6 ms of system time
    per reference call at the CPU size, varying with the machine's memory pressure); with the mmap
    and trim thresholds raised, calls reuse the heap. Restored to glibc's default 128 KiB after."""
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        yield
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 1 << 30)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def execute(cfg, points_by_seq: dict[int, list[Point]], notes: list[str], command: str = "",
            show_progress: bool = True, log=None) -> tuple[list[dict], dict]:
    """Run every (shape, point, provider) job of a configuration; returns (rows, meta)."""
    if cfg.device != "cpu":
        return _execute(cfg, points_by_seq, notes, command, show_progress, log)
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        with _steady_malloc():
            return _execute(cfg, points_by_seq, notes, command, show_progress, log)
    finally:
        torch.set_num_threads(threads)


def _execute(cfg, points_by_seq, notes, command, show_progress, log) -> tuple[list[dict], dict]:
    import sys
    import time

    from sparseflash.experiments.bench.providers import get_providers
    from sparseflash.experiments.bench.results import environment

    log = log or (lambda msg: print(msg, file=sys.stderr))
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device (use --device cpu)")
    providers = get_providers(cfg.providers)
    env = environment(device)
    jobs = []
    masked = cfg.masked_points if cfg.bench == "sparsity" else "all"
    for n in cfg.seq_lens:
        for d in cfg.head_dims:
            # Modes innermost: the checker's reference output is computed once per shape and mask.
            for pt in [dense_point(n, cfg.causal)] + points_by_seq.get(n, []):
                for mode in cfg.modes:
                    shape = Shape(cfg.batch_for(n), cfg.heads, n, d, cfg.dtype, cfg.causal, mode, cfg.block_size)
                    jobs += jobs_for(shape, [pt], providers, masked)
    est, n_meas, n_flex = estimate_seconds(jobs, device, cfg.sf_backend, cfg.timing)
    if device.type == "cuda":
        log(f"[bench {cfg.bench}] {env['device_name']}: {len(jobs)} rows, {n_meas} to measure ({n_flex} "
            f"FlexAttention graphs to compile); rough estimate {est / 60:.1f} min")
    else:
        log(f"[bench {cfg.bench}] {env['device_name']} -- {CPU_NOTE}: {len(jobs)} rows, {n_meas} to measure, "
            f"each in {cfg.timing.rounds} interleaved round(s) of {cfg.timing.warmup_ms:g} ms of warm-up then "
            f"{cfg.timing.rep_ms:g} ms of timed calls (at least {cfg.timing.min_runs})")
    for note in notes:
        log(f"[bench {cfg.bench}] note: {note}")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    rows = run_jobs(jobs, env, cfg.bench, device, cfg.sf_backend, cfg.timing, show_progress, cfg.check)
    unavailable = sorted({(r["provider"], r["status"]) for r in rows if r["status"].startswith("unavailable")})
    notes = notes + [f"provider {p} skipped: {s[len('unavailable: '):]}" for p, s in unavailable]
    meta = {"bench": cfg.bench, "command": command, "config": cfg.as_dict(), "notes": notes, **env,
            "kernels": default_kernels(device, cfg.dtype, cfg.head_dims),
            "estimate_s": round(est, 1), "wall_s": round(time.perf_counter() - t0, 1)}
    note = "; ".join(n for n in (CPU_NOTE if device.type == "cpu" else "", _env_note()) if n)
    if note:
        meta["note"] = note
    return rows, meta
