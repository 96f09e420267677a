"""The launchers' per-call machinery (sparseflash.flash.launch): plans cached per key, and bound
launches, which after a plan's first launch through Triton call the CompiledKernel's launcher
directly. On CPU with a stand-in kernel that records what it is given; on a GPU, bound and
unbound launches of the real kernels give identical results. About 2 s on CPU."""

from __future__ import annotations

import inspect

import pytest
import torch

import sparseflash
from sparseflash.flash import TileConfig, kernels, launch, tile_config, tiles


def _kernel_fn(A, B, n, x, C, D=3, E=None):
    """A stand-in kernel's signature: two pointers, an int, a float, constexprs with defaults."""


class _Compiled:
    """What Triton's launch returns: the C launcher (``run``), the function handle, packed metadata."""

    def __init__(self):
        self.function, self.packed_metadata, self.runs = 1234, (4, 1, 0), []

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A JITFunction stand-in: ``kernel[grid](*args, **kwargs)`` records the launch and returns a
    `_Compiled` (one per specialisation, as Triton's cache would)."""

    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.launches, self.compiled, self.pre_run_hooks = [], {}, []

    def __getitem__(self, grid):
        def launch_(**kwargs):
            self.launches.append((grid, kwargs))
            spec = tuple((t.dtype, t.data_ptr() % 16 == 0) for t in kwargs.values() if isinstance(t, torch.Tensor))
            return self.compiled.setdefault(spec, _Compiled())

        return launch_


@pytest.fixture
def fake(monkeypatch):
    """A plan of the stand-in kernel on a (pretend) CUDA device, with bound launches possible."""
    kernel = _Kernel()
    monkeypatch.setattr(kernels, "_test_kernel", kernel, raising=False)
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "raw_stream", lambda index: 77)
    T = launch.TENSOR
    plan = launch._Plan("_test_kernel", (5, 6), dict(A=T, B=T, n=48, x=0.5, C=7, E=None, num_warps=4),
                        TileConfig(16, 16), False, torch.device("cuda"))
    return kernel, plan


def _tensors(dtype=torch.bfloat16, offset=0):
    a = torch.zeros(64, dtype=dtype)
    return dict(A=a[offset:offset + 8], B=torch.zeros(8, dtype=torch.int32))


def test_bound_launch_passes_what_triton_would(fake):
    """The second launch of a plan skips Triton's path and calls the compiled kernel's launcher
    with the grid, the current stream, no launch metadata or hooks, and every parameter's value in
    signature order (constexprs and defaults included), tensors as their addresses: the values
    JITFunction.run passes it (its bound arguments). Triton got every argument by keyword."""
    kernel, plan = fake
    launch.run(plan, _tensors())
    assert len(kernel.launches) == 1 and plan.bound
    assert kernel.launches[0][1].keys() == {"A", "B", "n", "x", "C", "E", "num_warps"}
    a, b = _tensors().values()
    launch.run(plan, dict(A=a, B=b))
    assert len(kernel.launches) == 1, "the second launch went through Triton again"
    (compiled,) = kernel.compiled.values()
    (run,) = compiled.runs
    bound = inspect.signature(_kernel_fn).bind(a, b, 48, 0.5, C=7, E=None)
    bound.apply_defaults()
    want = [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in bound.arguments.values()]
    assert run == (5, 6, 1, 77, 1234, (4, 1, 0), None, None, None, *want)


def test_bound_launch_keys_on_alignment_and_dtype(fake):
    """A tensor at an address not 16-byte aligned, or of another dtype, is another specialisation
    to Triton: it takes Triton's path (then binds under its own key)."""
    kernel, plan = fake
    launch.run(plan, _tensors())
    launch.run(plan, _tensors(offset=1))  # 2 bytes in: not aligned
    launch.run(plan, _tensors(torch.float16))
    assert len(kernel.launches) == 3 and len(plan.bound) == 3
    launch.run(plan, _tensors(offset=1))
    launch.run(plan, _tensors(offset=8))  # 16 bytes in: aligned, as the first
    assert len(kernel.launches) == 3


def test_unbound_launches(fake, monkeypatch):
    """Triton's own path every time with FAST_LAUNCH off, for plans with TMA descriptors, under a
    launch hook (a profiler) and with the kernel's pre-run hooks."""
    from triton import knobs

    kernel, plan = fake
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    for _ in range(2):
        launch.run(plan, _tensors())
    assert len(kernel.launches) == 2 and not plan.bound
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            launch.run(plan, _tensors())
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.launches) == 4 and not plan.bound
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(2):
        launch.run(plan, _tensors())
    assert len(kernel.launches) == 6 and not plan.bound
    kernel.pre_run_hooks.clear()
    tma = launch._Plan("_test_kernel", (1, 1), plan.args, plan.cfg, True, torch.device("cuda"))
    for _ in range(2):
        launch.run(tma, _tensors())
    assert len(kernel.launches) == 8 and not tma.bound


@pytest.mark.interpreter
def test_plans_are_cached_per_key():
    """Calls with the same shapes, dtypes and scalars share one plan; a tile override or another
    scalar makes another. (Runs the real kernels under the interpreter, at a tiny size.)"""
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    launch._PLANS.clear()
    sparseflash.attention(q, k, v, backend="triton")
    n = len(launch._PLANS)
    assert n == 1
    sparseflash.attention(q + 1, k, v, backend="triton")
    assert len(launch._PLANS) == n
    sparseflash.attention(q, k, v, backend="triton", scale=0.5)
    with tile_config(fwd=TileConfig(16, 16, 4, 1)):
        sparseflash.attention(q, k, v, backend="triton")
    assert len(launch._PLANS) == n + 2


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "_PLANS_MAX", 3)
    launch._PLANS.clear()
    for i in range(5):
        launch._plan(("k", i), lambda: object())
    assert len(launch._PLANS) <= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bound launches run on CUDA")
@pytest.mark.parametrize("setting", ["dense", "sparse-keylen", "dropout", "gqa-causal", "segments"])
def test_gpu_bound_launches_match_triton(setting, monkeypatch):
    """On the GPU, calls through bound launches give bitwise the outputs and gradients of calls
    through Triton's own path, and bound launches are really taken."""
    from sparseflash.patterns import random as random_mask

    from sparseflash.flash import fast

    monkeypatch.setattr(tiles, "TMA_MODE", "off")
    monkeypatch.setattr(fast, "ENABLED", False)  # the general path's launches (the short path's: test_fast_path)
    B, Hq, N, D = 2, 4, 512, 64
    Hkv = 2 if setting == "gqa-causal" else Hq
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    kw = {}
    if setting == "sparse-keylen":
        kw = dict(mask=random_mask(N, 2, block_size=128, seed=0, device="cuda"),
                  key_lengths=torch.tensor([N, N - 77], device="cuda"))
    elif setting == "dropout":
        kw = dict(dropout_p=0.25)
    elif setting == "gqa-causal":
        kw = dict(causal=True)
    elif setting == "segments":
        kw = dict(segment_ids=torch.arange(N, device="cuda").div(100, rounding_mode="floor").expand(B, N))

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        gen = torch.Generator(device="cuda").manual_seed(1) if setting == "dropout" else None
        out = sparseflash.attention(qq, kk, vv, generator=gen, **kw)
        return (out, *torch.autograd.grad(out, (qq, kk, vv), do))

    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    want = run()
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch._PLANS.clear()
    run()  # binds
    got = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert sum(len(p.bound) for p in launch._PLANS.values()) == 3
