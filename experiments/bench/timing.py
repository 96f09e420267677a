"""Timing and peak memory of one benchmark callable.

GPU, eager (the default): the time per call of calls issued back to back, as a training loop
issues them: CUDA events around each sample of several calls, median over the samples, after
warm-up calls made outside the numbers (first call: compilation and autotuning). A call whose
host side (Python, autograd, launches) takes longer than its kernels is timed at its host cost,
which is what it costs a model; one whose kernels take longer, at their GPU time. The callable
rotates over several input sets whose total size is several times the L2 cache, so a timed call
never finds its inputs cached. (Until 2026-11-24 eager rows used ``triton.testing.do_bench``,
which zeroes a 256 MB buffer before each call: a host-bound call then read its kernels plus
whatever part of its host time that zeroing did not cover, so rows under ~1 ms varied 1.3-2.9x
between runs. Each row's ``timing`` column says which method made it.)
Peak memory is ``torch.cuda.max_memory_allocated`` over one untimed call with one input set
(reset just before it), minus what was allocated before the provider prepared anything: the
footprint of the operation including its inputs, outputs, saved activations and any mask or
converted mask it holds.

With ``cuda_graph`` (``--cuda-graph``): ``triton.testing.do_bench_cudagraph`` instead, which
captures the rotating calls in one CUDA graph and replays it: the GPU time of the kernels alone,
without the host's per-call cost (Python, autograd, launches). No L2 flush there; the rotation
over input sets still keeps inputs out of L2.

CPU (the labelled CPU mode only): the process's CPU time (``time.process_time``) around each
call, with the garbage collector paused, after untimed warm-up calls (the first call, then more
until ``warmup_ms`` has passed); the calls of ``rep_ms`` (at least ``min_runs``) are the row's
samples: median, and the 25th / 75th percentiles as its spread. CPU time, not wall time: on a
shared machine another process's load stretches wall time by whatever share of the cores it
takes, while the CPU time of the call stays what the call costs (the sweep runs torch on one
thread there, see runner.execute, so no thread waits for another that is descheduled). The
sweep measures every row in ``rounds`` passes over the whole plan, in alternating order, and
pools the samples (`pooled`), so that what load remains falls on every row alike.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["TimingConfig", "Measurement", "is_oom", "free_memory", "l2_bytes", "rotation_count", "measure", "pooled", "graph_ms",
           "stream_ms", "kernel_ms", "host_us"]


@dataclass(frozen=True)
class TimingConfig:
    """``warmup_ms`` / ``rep_ms``: time budgets per measurement on GPU; on CPU the timed loop
    runs for ``rep_ms`` (at least ``min_runs`` calls) after the first call and ``warmup_ms`` of
    untimed calls, in each of ``rounds`` passes over the plan (CPU only)."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_runs: int = 1
    l2_multiple: float = 4.0  # rotate input sets until their total is this many times L2
    max_sets: int = 8
    cuda_graph: bool = False  # GPU: time graph replays (kernels only, no host overhead)
    rounds: int = 1  # CPU: passes over the whole plan, samples pooled per row

    def __post_init__(self):
        if not (self.warmup_ms >= 0 and self.rep_ms > 0):
            raise ValueError(f"warmup_ms must be >= 0 and rep_ms > 0, got {self.warmup_ms}, {self.rep_ms}")
        if self.min_runs < 1 or self.max_sets < 1 or self.rounds < 1:
            raise ValueError("min_runs, max_sets and rounds must be at least 1")


@dataclass
class Measurement:
    ms: float
    peak_bytes: int | None
    n_sets: int
    prep_ms: float
    first_ms: float  # the first call: compilation, autotuning, allocator warm-up
    after: object = None
    samples: list | None = None  # CPU: ms of every timed call


def pooled(samples) -> dict:
    """``ms`` (median), ``ms_lo`` / ``ms_hi`` (25th / 75th percentiles) and ``n_runs`` of CPU samples."""
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
    return {"ms": statistics.median(samples), "ms_lo": q[0], "ms_hi": q[2], "n_runs": len(samples)}


def is_oom(exc: BaseException) -> bool:
    """Out of device (or host) memory, whichever library raised it."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "outofmemory" in text


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def rotation_count(set_bytes: int, device: torch.device, cfg: TimingConfig) -> int:
    """Input sets to rotate so that their total is at least ``cfg.l2_multiple`` x L2."""
    l2 = l2_bytes(device)
    if l2 == 0 or set_bytes <= 0:
        return 1
    return max(1, min(cfg.max_sets, math.ceil(cfg.l2_multiple * l2 / set_bytes)))


def graph_ms(fn, rep_ms: float = 100.0) -> float:
    """GPU ms per call of ``fn`` alone: ``do_bench_cudagraph`` median (CUDA-graph replays, no host
    cost), captured on a side stream that first waits for the current one (a graph cannot be
    captured on the legacy default stream). For one-off scripts; `measure` is the bench's timer."""
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def cpu_ms(fn, reps: int = 3) -> float:
    """Median wall ms of ``fn`` on a CPU after one untimed call (the benches' tiny labelled mode)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def fwd_fwdbwd_times(fwd, inputs, do, flops_of, *, cuda: bool, graphs: bool = True) -> dict:
    """``{fwd,fwdbwd}_{ms,gpu_ms,tflops}`` of a forward call ``fwd()`` and of forward+backward (the
    gradients of ``inputs`` against ``do``). On CUDA: calls back to back (`stream_ms`, host cost
    included) and CUDA-graph replays (`graph_ms`; NaN with ``graphs`` False), the forward without
    autograd; on a CPU `cpu_ms`, GPU times NaN. ``flops_of(mode)``: the FLOPs a mode counts; the
    rate uses the faster of the two times."""
    def fwdbwd():
        return torch.autograd.grad(fwd(), inputs, do)

    out = {}
    for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        if cuda:
            with torch.set_grad_enabled(mode == "fwdbwd"):
                ms = stream_ms(fn, calls=5)
                gpu = graph_ms(fn) if graphs else float("nan")
        else:
            ms, gpu = cpu_ms(fn), float("nan")
        out[f"{mode}_ms"], out[f"{mode}_gpu_ms"] = ms, gpu
        out[f"{mode}_tflops"] = flops_of(mode) / (min(ms, gpu) if gpu == gpu else ms) / 1e9
    return out


def stream_ms(step, calls: int, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_samples: int = 5) -> float:
    """ms per call of ``step`` issued back to back on the current CUDA stream: median over samples
    of at least ``calls`` calls each (events around each sample, none between its calls, so the
    GPU waits for the host wherever the host is slower), after ``warmup_ms`` of untimed calls."""
    def sample(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        return start, end

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while True:  # warm-up, which also estimates the time per call
        s, e = sample(calls)
        torch.cuda.synchronize()
        if (time.perf_counter() - t0) * 1000 >= warmup_ms:
            break
    per_call = max(s.elapsed_time(e) / calls, 1e-3)
    n = calls * max(1, math.ceil(1.0 / (per_call * calls)))  # samples of >= ~1 ms: event resolution
    samples = max(min_samples, math.ceil(rep_ms / (per_call * n)))
    events = [sample(n) for _ in range(samples)]
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / n for s, e in events)


def kernel_ms(fn, calls: int = 20, warmup: int = 3) -> tuple[float, dict[str, float]]:
    """GPU ms per call of what ``fn`` runs on the GPU when called eagerly: the durations of its
    kernels, memsets and copies as the profiler (CUPTI) records them, summed over ``calls`` calls
    and divided by ``calls``. That is the same call's own GPU time: the kernels it really launches
    (not those a graph capture of it would choose), without the gaps between them and without
    host cost. Also returns the ms per call of each kernel name."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / calls
    if not per_name:
        raise RuntimeError("the profiler recorded no GPU activity (is CUPTI available?)")
    return sum(per_name.values()), per_name


SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU sleep: longer than issuing any batch host_us times (checked)


def wall_us(fn, calls: int, repeats: int = 5) -> float:
    """Wall microseconds per call of ``fn`` (no GPU involved: e.g. the Python side with the kernels
    stubbed out): the median over ``repeats`` batches of ``calls`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Host microseconds per call of ``fn``: the median of `host_us_samples`."""
    return statistics.median(host_us_samples(fn, calls, repeats))


def host_us_samples(fn, calls: int, repeats: int = 5) -> list[float]:
    """Host microseconds per call of ``fn`` in each of ``repeats`` batches: the wall time of
    issuing ``calls`` calls while the GPU sleeps (``torch.cuda._sleep``), so that no launch waits
    for the GPU; few calls per batch so that CUDA's launch queue never fills. A call that
    synchronises with the GPU cannot be timed so (it would wait out the sleep): RuntimeError."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        pending = not torch.cuda.current_stream().query()  # still sleeping: no call waited for the GPU
        torch.cuda.synchronize()
        if not pending:
            raise RuntimeError("the GPU finished its sleep before the calls were issued: a call synchronised "
                               "with the GPU, or SLEEP_CYCLES is too small")
        times.append((t1 - t0) / calls * 1e6)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(prepare, make_inputs, make_step, device: torch.device, cfg: TimingConfig, after=None) -> Measurement:
    """Time ``make_step(ctx, inputs)()``; ``ctx = prepare()`` is built once and timed separately.

    ``prepare()`` builds what the provider needs besides the inputs (a converted mask, a token
    mask), after the memory baseline is taken so that it counts in the footprint.
    ``make_inputs()`` returns one fresh input set (a tuple of tensors); ``make_step(ctx, inputs)``
    returns a zero-argument callable running the operation on that set (it may precompute, e.g.
    a forward pass to time backward alone). ``after(ctx)``, if given, runs once the timing is done
    and the input sets are freed (its result lands in ``Measurement.after``). Exceptions (OOM
    included) propagate to the caller.
    """
    device = torch.device(device)
    if device.type == "cuda" and cfg.cuda_graph:
        # Everything on a side stream, not the legacy default one: autograd runs a backward on the
        # stream its forward ran on, and mode "bwd" makes its forward here, outside the graph; a
        # backward on the default stream cannot join do_bench_cudagraph's capture (it invalidated it).
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return _measure(prepare, make_inputs, make_step, device, cfg, after)
    return _measure(prepare, make_inputs, make_step, device, cfg, after)


def _measure(prepare, make_inputs, make_step, device: torch.device, cfg: TimingConfig, after) -> Measurement:
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    _sync(device)
    t0 = time.perf_counter()
    ctx = prepare()
    _sync(device)
    prep_ms = (time.perf_counter() - t0) * 1000
    first = make_inputs()
    set_bytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    steps = [make_step(ctx, first)]
    t0 = time.perf_counter()
    steps[0]()  # warm-up outside the numbers: compilation, autotuning, caches
    _sync(device)
    first_ms = (time.perf_counter() - t0) * 1000
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        steps[0]()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        short = False
        try:
            for _ in range(rotation_count(set_bytes, device, cfg) - 1):
                steps.append(make_step(ctx, make_inputs()))
        except Exception as e:  # a nearly full device still gets measured, on fewer sets
            if not is_oom(e):
                raise
            short = True
        if short:
            free_memory()
    counter = [0]

    def step():
        s = steps[counter[0] % len(steps)]
        counter[0] += 1
        s()

    if cuda:
        import triton.testing

        for s in steps[1:]:  # every set warm once
            s()
        if cfg.cuda_graph:  # captured on do_bench_cudagraph's own stream
            ms = float(triton.testing.do_bench_cudagraph(step, rep=cfg.rep_ms, return_mode="median"))
        else:
            ms = stream_ms(step, len(steps), cfg.warmup_ms, cfg.rep_ms)
    else:
        clock = time.process_time
        t_end = clock() + cfg.warmup_ms / 1000
        while clock() < t_end:  # warm-up beyond the first call: caches, allocator, frequency
            step()
        times = []
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            deadline = clock() + cfg.rep_ms / 1000
            while len(times) < cfg.min_runs or (clock() < deadline and len(times) < 1000):
                t0 = clock()
                step()
                times.append((clock() - t0) * 1000)
        finally:
            if gc_was_on:
                gc.enable()
        ms = statistics.median(times)
    n_sets = len(steps)
    del steps, step, first
    return Measurement(ms=ms, peak_bytes=peak, n_sets=n_sets, prep_ms=prep_ms, first_ms=first_ms,
                       after=None if after is None else after(ctx), samples=None if cuda else times)


def profile_text(fn, calls: int, top: int = 25, sorts=("tottime",)) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions under each order in ``sorts``, as text
    (the host-cost studies' view of where a call's Python goes)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    for order in sorts:
        st.sort_stats(order).print_stats(top)
    return buf.getvalue()
