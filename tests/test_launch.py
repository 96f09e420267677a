"""The launchers' per-call machinery (sparseflash.flash.launch): plans cached per key, and bound
launches, which after a plan's first launch through Triton call the CompiledKernel's launcher
directly. On CPU with a stand-in kernel that records what it is given; on a GPU, bound and
unbound launches of the real kernels give identical results. About 2 s on CPU."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton.language as tl

import sparseflash
from sparseflash.flash import TileConfig, binding, kernels, launch, tile_config, tiles


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
    monkeypatch.setattr(kernels, "stand_in_kernel", kernel, raising=False)
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    monkeypatch.setattr(binding, "current_device", lambda: 0)
    monkeypatch.setattr(binding, "raw_stream", lambda index: 77)
    monkeypatch.setattr(binding, "has_cuda", lambda: True)
    T = launch.TENSOR
    plan = launch.Plan("stand_in_kernel", (5, 6), dict(A=T, B=T, n=48, x=0.5, C=7, E=None, num_warps=4),
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


def test_bound_launch_fills_tuples_of_tensors(fake):
    """A tuple argument holding tensors (an optional part's tensors with its scalars, `Plan.packs`):
    the call gives its tensors as a tuple; Triton gets the filled tuple, a bound launch the tuple
    with the tensors' addresses, fresh each call (not the first call's), and the tensors'
    alignments and dtypes are part of the bound launch's key."""
    kernel, _ = fake
    T = launch.TENSOR
    plan = launch.Plan("stand_in_kernel", (5, 6), dict(A=T, B=T, n=48, x=0.5, C=7, E=(T, 3, T), num_warps=4),
                       TileConfig(16, 16), False, torch.device("cuda"))
    assert plan.tensors == ("A", "B") and plan.packs == (("E", (T, 3, T)),)

    def tensors(offset=0):
        e = torch.zeros(64, dtype=torch.int32)
        return dict(_tensors(), E=(e[offset:offset + 8], torch.zeros(4)))

    first = tensors()
    launch.run(plan, first)
    assert len(kernel.launches) == 1 and len(plan.bound) == 1
    assert kernel.launches[0][1]["E"] == (first["E"][0], 3, first["E"][1])
    second = tensors(offset=4)  # 16 bytes in: aligned as the first
    launch.run(plan, second)
    assert len(kernel.launches) == 1, "the second launch went through Triton again"
    (compiled,) = kernel.compiled.values()
    e0, e1 = second["E"]
    assert compiled.runs[-1][-1] == (e0.data_ptr(), 3, e1.data_ptr())
    launch.run(plan, tensors(offset=1))  # 4 bytes in: another specialisation, Triton's path
    assert len(kernel.launches) == 2 and len(plan.bound) == 2
    with pytest.raises(ValueError, match="more tensors"):
        plan.arguments(dict(_tensors(), E=(e0, e1, e1)))


def test_unbound_launches(fake, monkeypatch):
    """Triton's own path every time with FAST_LAUNCH off, for plans with TMA descriptors, under a
    launch hook (a profiler) and with the kernel's pre-run hooks."""
    from triton import knobs

    kernel, plan = fake
    monkeypatch.setattr(binding, "FAST_LAUNCH", False)
    for _ in range(2):
        launch.run(plan, _tensors())
    assert len(kernel.launches) == 2 and not plan.bound
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
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
    tma = launch.Plan("stand_in_kernel", (1, 1), plan.args, plan.cfg, True, torch.device("cuda"))
    binding.CALLS.clear()
    for _ in range(2):
        launch.run(tma, _tensors())
    # (a plan with TMA descriptors binds through `call`, keyed on the call's arguments, not in the plan)
    assert len(kernel.launches) == 7 and not tma.bound and len(binding.CALLS) == 1


def _const_fn(A, n, x, BLOCK: tl.constexpr, E=None):
    """A stand-in with a constexpr (its annotation names tl.constexpr, as Triton reads it)."""


@pytest.fixture
def fake_call(monkeypatch):
    """A stand-in kernel for `binding.call` on a (pretend) CUDA device."""
    kernel = _Kernel()
    kernel.fn = _const_fn
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    monkeypatch.setattr(binding, "current_device", lambda: 0)
    monkeypatch.setattr(binding, "raw_stream", lambda index: 77)
    monkeypatch.setattr(binding, "has_cuda", lambda: True)
    binding.CALLS.clear()
    return kernel


def test_call_binds_and_passes_the_calls_tensors(fake_call):
    """`call` launches through Triton once per combination, then through the compiled kernel's
    launcher with every parameter's value in order: this call's tensors (as addresses), the scalars,
    constexprs and defaults of the combination."""
    kernel = fake_call
    a = torch.zeros(8, dtype=torch.bfloat16)
    binding.call(kernel, (3,), A=a, n=32, x=0.5, BLOCK=64, num_warps=4)
    b = torch.ones(8, dtype=torch.bfloat16)
    binding.call(kernel, (3,), A=b, n=32, x=0.5, BLOCK=64, num_warps=4)
    assert len(kernel.launches) == 1
    (compiled,) = kernel.compiled.values()
    assert compiled.runs == [(3, 1, 1, 77, 1234, (4, 1, 0), None, None, None, b.data_ptr(), 32, 0.5, 64, None)]


def test_call_keys_on_what_triton_specialises(fake_call):
    """Another scalar (of any kind: a shape, a scale, a constexpr, a compile option, True for 1), dtype,
    alignment or a None for a tensor is another combination: Triton's path again, once. A tensor at
    another 16-byte aligned address is not."""
    kernel = fake_call
    a = torch.zeros(64, dtype=torch.bfloat16)
    base = dict(A=a[:8], n=32, x=0.5, BLOCK=64)
    others = [dict(BLOCK=128), dict(num_warps=8), dict(A=a[:8].half()), dict(A=a[1:9]), dict(n=1), dict(n=33),
              dict(n=True), dict(x=1.5), dict(E=a[:8])]
    binding.call(kernel, (1,), **base)
    for i, change in enumerate(others):
        binding.call(kernel, (1,), **{**base, **change})
        assert len(kernel.launches) == i + 2, change
    for change in others:
        binding.call(kernel, (1,), **{**base, **change})
    binding.call(kernel, (1,), **{**base, "A": a[8:16]})  # 16 bytes further: aligned as the first
    assert len(kernel.launches) == len(others) + 1


def test_call_keys_descriptors_on_their_type(fake_call):
    """A TMA descriptor goes to the launcher as itself (the launcher encodes it); its dtype and block
    shape are in the key, its base, shape and strides are not."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = fake_call
    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    d1 = TensorDescriptor.from_tensor(t, [16, 64])
    d2 = TensorDescriptor.from_tensor(t[:32], [16, 64])
    binding.call(kernel, (1,), A=d1, n=32, x=0.5, BLOCK=64)
    binding.call(kernel, (1,), A=d2, n=32, x=0.5, BLOCK=64)
    assert len(kernel.launches) == 1
    (compiled,) = kernel.compiled.values()
    assert compiled.runs[0][9] is d2
    binding.call(kernel, (1,), A=TensorDescriptor.from_tensor(t, [32, 64]), n=32, x=0.5, BLOCK=64)
    assert len(kernel.launches) == 2


def test_call_unbound(fake_call, monkeypatch):
    """Triton's own path each time with FAST_LAUNCH off or under the interpreter; positional
    arguments are named by the signature (Triton gets every argument by keyword)."""
    kernel = fake_call
    a = torch.zeros(8)
    monkeypatch.setattr(binding, "FAST_LAUNCH", False)
    binding.call(kernel, (1,), A=a, n=32, x=0.5, BLOCK=64)
    binding.call(kernel, (1,), A=a, n=32, x=0.5, BLOCK=64)
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    monkeypatch.setattr(tiles, "INTERPRETING", True)
    binding.call(kernel, (1,), A=a, n=32, x=0.5, BLOCK=64)
    assert len(kernel.launches) == 3 and not binding.CALLS
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    binding.call(kernel, (1,), a, 32, 0.5, BLOCK=64)
    assert kernel.launches[-1][1] == dict(A=a, n=32, x=0.5, BLOCK=64)


@pytest.mark.interpreter
def test_plans_are_cached_per_key():
    """Calls with the same shapes, dtypes and scalars share one plan; a tile override or another
    scalar makes another. (Runs the real kernels under the interpreter, at a tiny size.)"""
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    launch.PLANS.clear()
    sparseflash.attention(q, k, v, backend="triton")
    n = len(launch.PLANS)
    assert n == 1
    sparseflash.attention(q + 1, k, v, backend="triton")
    assert len(launch.PLANS) == n
    sparseflash.attention(q, k, v, backend="triton", scale=0.5)
    with tile_config(fwd=TileConfig(16, 16, 4, 1)):
        sparseflash.attention(q, k, v, backend="triton")
    assert len(launch.PLANS) == n + 2


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "PLANS_MAX", 3)
    launch.PLANS.clear()
    for i in range(5):
        launch.cached_plan(("k", i), lambda: object())
    assert len(launch.PLANS) <= 3


def _bound_against_triton(run, monkeypatch, reset, after_bind=lambda: None):
    """(``run()`` through Triton's own launches, ``run()`` through bound ones): the second after a
    ``reset()`` of the bindings and a first run that binds."""
    monkeypatch.setattr(binding, "FAST_LAUNCH", False)
    want = run()
    monkeypatch.setattr(binding, "FAST_LAUNCH", True)
    reset()
    run()  # binds
    after_bind()
    return want, run()


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

    want, got = _bound_against_triton(run, monkeypatch, launch.PLANS.clear)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert sum(len(p.bound) for p in launch.PLANS.values()) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bound launches run on CUDA")
@pytest.mark.parametrize("route", ["hopper-dense", "hopper-sparse-causal", "portable-tma", "decode", "index"])
def test_gpu_calls_match_triton(route, monkeypatch):
    """On the GPU, kernels launched by `binding.call` (the Hopper kernels, plans with TMA descriptors,
    decoding, the index build) give bitwise the results of Triton's own launches, and bind."""
    from sparseflash.flash.hopper import backward as hopper_bwd, forward as hopper
    from sparseflash.patterns import random as random_mask

    if route != "index" and route != "decode" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA descriptors and the Hopper kernels: sm_90")
    monkeypatch.setattr(tiles, "TMA_MODE", "on")
    if route == "portable-tma":
        monkeypatch.setattr(hopper, "MODE", "off")
        monkeypatch.setattr(hopper_bwd, "MODE", "off")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, N, D = 2, 4, 1024, 128

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, do = (randn(B, H, N, D) for _ in range(4))
    if route == "decode":
        kc, vc = randn(B, 4096, 2, D), randn(B, 4096, 2, D)
        qd = randn(B, 1, 8, D)
        lens = torch.tensor([4000, 1234], device="cuda", dtype=torch.int32)

        def run():
            return (sparseflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=0),)
    elif route == "index":
        ids = torch.randint(-1, N // 128, (B, H, N // 128, 5), device="cuda", generator=g)

        def run():
            m = sparseflash.BlockMask.from_indices(ids, N)
            ix = m.index()
            return m.layout, ix.kv_num, ix.kv_idx, ix.q_num, ix.q_idx
    else:
        kw = {}
        if route == "hopper-sparse-causal":
            kw = dict(mask=random_mask(N, 3, block_size=128, seed=0, device="cuda"), causal=True)

        def run():
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = sparseflash.attention(qq, kk, vv, **kw)
            return (out, *torch.autograd.grad(out, (qq, kk, vv), do))

    from sparseflash.flash import decode

    def bound():  # decoding binds in its plans (decode.DecodePlan, BoundsCheck), the others by `call`
        return len(binding.CALLS) + sum(len(launch.bound) for p in decode.PLANS.values() for launch in p.launches()) \
            + sum(len(c.launch.bound) for c in decode.CHECKS.values())

    def reset():
        binding.CALLS.clear()
        decode.PLANS.clear()
        decode.CHECKS.clear()
        sparseflash.kvcache.PLANS.clear()

    n_bound = []
    want, got = _bound_against_triton(run, monkeypatch, reset, after_bind=lambda: n_bound.append(bound()))
    assert n_bound[0] > 0 and bound() == n_bound[0], "no bound launch, or the second call bound anew"
    if route == "decode":
        assert n_bound[0] == 2  # the split kernel (which checks a read's bounds) and the combine
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def test_portable_kernel_signatures():
    """The portable kernels take at most 40 parameters (a signature a reader can hold in mind, each
    optional part one named argument): every tensor's
    (batch, head, row, column) strides one tuple, all of them one parameter ``strides``; every optional
    part a named parameter defaulting to None after the required ones (a table with its batch strides,
    the exact tables, the backward's dropout as one tuple each), the flag derived inside: no HAS_* or
    feature-flag parameters, no placeholder tensors, no numeric stand-ins (the block lists' MASK_BQ,
    MASK_BK, NB_P2, GATHER are None when dense); BLOCK_D derived from HEAD_DIM. The plans give every
    optional part as None or a value, and a dense default plan passes no stand-in."""
    flags = {"DENSE", "DROPOUT", "TMA", "SEGMENTS", "KEY_RANGES", "ALIBI", "EXACT", "BLOCK_D"}
    optional = {"SOFTCAP", "KV_IDX", "Q_IDX", "stride_idx", "MASK_BQ", "MASK_BK", "NB_P2", "GATHER", "exact", "KEY_LEN",
                "RNG", "drop_thresh", "dropout", "DLSE", "segments", "ranges", "alibi"}
    tensors = {"fwd_kernel": "Q K V O LSE", "bwd_dq_kernel": "Q K V O DO LSE DELTA DQ",
               "bwd_dkdv_kernel": "Q K V DO LSE DELTA DK DV"}
    for name, descs in (("fwd_kernel", 3), ("bwd_dq_kernel", 5), ("bwd_dkdv_kernel", 4)):
        ps = list(inspect.signature(getattr(kernels, name).fn).parameters.values())
        names = [p.name for p in ps]
        assert len(ps) <= 40, (name, len(ps))
        assert names[:len(tensors[name].split())] == tensors[name].split() and names[len(tensors[name].split())] == "strides"
        assert not [n for n in names if n.startswith("HAS_") or n in flags or n.startswith("stride_")
                    and n != "stride_idx"], name
        given = [p.default is inspect.Parameter.empty for p in ps]
        assert given == sorted(given, reverse=True), name  # the required ones first
        assert all(p.default is None for p in ps if p.default is not inspect.Parameter.empty), name
        descriptors = {n for n in names if n.startswith("DESC_")}
        assert len(descriptors) == descs, name
        assert {p.name for p in ps if p.default is None} == (optional & set(names)) | descriptors, name
    q = torch.zeros(1, 2, 64, 16)
    plans = (launch.plan_fwd(q, q, q, q, None, None, 0.25, False, None, None, 0.0),
             launch.plan_dq(q, q, q, q, q, q, None, None, 0.25, False, None, None, 0.0),
             launch.plan_dkdv(q, q, q, q, q, q, None, None, 0.25, False, None, None, 0.0))
    for plan in plans:
        off = {n for n in optional if n in plan.args and plan.args[n] is not None}
        assert off == set(), (plan.kernel, off)  # dense, no tables, no dropout: nothing given for them
        rows = {"LSE", "DELTA"}  # (the [B, H, N] float32 rows: no strides)
        assert len(plan.args["strides"]) == len(set(tensors[plan.kernel].split()) - rows)


def test_every_kernel_takes_at_most_40_parameters():
    """Every kernel of every family (portable, Hopper where Gluon imports, decode) takes at most 40
    parameters, its optional parts named and defaulting to None after the required ones."""
    from sparseflash.flash import decode
    from sparseflash.flash.hopper import backward as hopper_bwd, forward as hopper_fwd

    found = {}
    for mod in (kernels, decode, hopper_fwd, hopper_bwd):
        for name in dir(mod):
            fn = getattr(getattr(mod, name), "fn", None)
            if name.endswith("_kernel") and callable(fn):
                found[f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"] = list(inspect.signature(fn).parameters.values())
    assert {"kernels.fwd_kernel", "kernels.bwd_dq_kernel", "kernels.bwd_dkdv_kernel",
            "decode.decode_split_kernel"} <= set(found)
    if hopper_fwd.GLUON_ERROR is None:
        assert {"forward.hopper_fwd_kernel", "backward.hopper_bwd_kernel"} <= set(found)
    for name, ps in found.items():
        assert len(ps) <= 40, (name, len(ps))
        given = [p.default is inspect.Parameter.empty for p in ps]
        assert given == sorted(given, reverse=True), name  # the required ones first
        assert all(p.default is None for p in ps if p.default is not inspect.Parameter.empty), name
