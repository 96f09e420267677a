"""The native short path (sparseflash/flash/native.py, _native.cpp): on the CPU, the module builds,
packs Triton's parameter ABI from a bound launch, and its autograd node saves, checks and
releases what it should, goes back to Python where it has no launch, and counts launches with
stand-in (function 0) kernels; on a GPU, the real kernels through it give bitwise the Python
short path's outputs and gradients, and it steps aside for capture, launch hooks and misaligned
inputs."""

from __future__ import annotations

import os
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

import sparseflash
from sparseflash.flash import fast, launch, native

CUDA = torch.cuda.is_available()
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def mod():
    return native.load()


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bound(sig: dict, values: tuple, slots, md=None):
    """(plan, bound launch) stand-ins: ``slots`` (position, parameter name) of the plan's tensors."""
    compiled = SimpleNamespace(src=SimpleNamespace(signature=sig),
                               metadata=md or SimpleNamespace(num_ctas=1, launch_cooperative_grid=False,
                                                              launch_pdl=False, global_scratch_size=0,
                                                              profile_scratch_size=0))
    return SimpleNamespace(grid=(5, 6), slots=tuple(slots)), (None, 0, (4, 1, 1024), values, compiled)


@needs_cxx
def test_launch_of_packs_the_triton_abi(mod):
    """Non-constexpr parameters in order (pointers and i64 in 8 bytes, i32 and fp32 in 4, fp32 as
    its float bits, negative ints two's complement), the role slots filled per call, then
    Triton's two scratch pointers; kernels needing more than a plain launch are refused."""
    sig = {"Q": "*bf16", "n": "i32", "scale": "fp32", "O": "*bf16", "neg": "i32", "BLOCK": "constexpr",
           "KL": "constexpr", "big": "i64", "LIST": "*i32"}
    values = (None, 48, 0.5, None, -3, 64, None, 2**40, None)
    fixed = {"LIST": torch.empty(4, dtype=torch.int32)}
    slots = [(0, "Q"), (3, "O"), (8, "LIST")]
    roles = {"Q": fast.ROLES.index("Q"), "O": fast.ROLES.index("O")}
    plan, bound = _bound(sig, values, slots)
    lw = native.launch_of(plan, bound, fixed, roles, mod)
    ptrs = [16 * (i + 1) for i in range(6)]
    assert lw.pack(ptrs) == [16, 48, _bits(0.5), 64, 2**32 - 3, 2**40, fixed["LIST"].data_ptr(), 0, 0]
    assert lw.pack(ptrs[:2]) == []  # too few role addresses
    for bad in (dict(num_ctas=2), dict(launch_pdl=True), dict(global_scratch_size=128)):
        md = SimpleNamespace(**{**vars(bound[4].metadata), **bad})
        assert native.launch_of(*_bound(sig, values, slots, md), fixed, roles, mod) is None
    assert native.launch_of(*_bound({**sig, "n": "nvTmaDesc"}, values, slots), fixed, roles, mod) is None
    assert native.launch_of(*_bound(dict(list(sig.items())[:-1]), values, slots), fixed, roles, mod) is None  # count
    assert native.launch_of(plan, bound, {}, roles, mod) is None  # a tensor neither fixed nor a role
    assert "slots but" in mod.make_launch(0, [1, 1, 1], 128, 0, [0, 0], [8], [])
    assert "role out of range" in mod.make_launch(0, [1, 1, 1], 128, 0, [0], [8], [(0, 11)])
    assert "block must be" in mod.make_launch(0, [1, 1, 1], 2048, 0, [0], [8], [])


@needs_cxx
def test_launch_of_packs_tuple_parameters_in_place(mod):
    """A tuple parameter (the portable kernels' strides) packs as its elements, in order, where the
    parameter stands; its constexpr elements (a stride of 1) take no slot."""
    sig = {"Q": "*bf16", "stride_q": ("i32", "constexpr", "i64", "i32"), "n": "i32", "BLOCK": "constexpr"}
    values = (None, (48, 1, 2**40, -2), 5, 64)
    plan, bound = _bound(sig, values, [(0, "Q")])
    lw = native.launch_of(plan, bound, {}, {"Q": fast.ROLES.index("Q")}, mod)
    ptrs = [16 * (i + 1) for i in range(6)]
    assert lw.pack(ptrs) == [16, 48, 2**40, 2**32 - 2, 5, 0, 0]
    short = _bound(sig, (None, (48, 1), 5, 64), [(0, "Q")])  # a value that does not match its type
    assert native.launch_of(*short, {}, {"Q": fast.ROLES.index("Q")}, mod) is None


class _Fallback:
    def __init__(self):
        self.calls = []

    def __call__(self, do, q, k, v, o, lse, kl):
        self.calls.append(dict(do=do, q=q, o=o, lse=lse, kl=kl))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)


@pytest.fixture
def dry(mod):
    """A plan of stand-in launches (function 0: counted, not run) with a recording fallback."""
    fb = _Fallback()
    B, Hq, Hkv, N, D = 2, 4, 2, 32, 16
    rows = torch.empty((), dtype=torch.float32).expand(B, Hq, N)
    fwd = mod.make_launch(0, [1, 1, 1], 128, 0, [0] * 6, [8] * 6, [(i, i) for i in range(6)])
    plan = mod.Plan(0, fwd, rows, False, fb)
    q = torch.randn(B, Hq, N, D, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, D, requires_grad=True) for _ in range(2))
    return SimpleNamespace(mod=mod, plan=plan, fb=fb, q=q, k=k, v=v)


@needs_cxx
def test_native_node_falls_back_then_launches(dry):
    """Without a launch for dO's layout the node calls the plan's fallback with dO and what the
    forward saved; once the plan has that layout's launches it runs them (two) and returns gradients
    shaped like q, k, v (grouped heads); another layout falls back again."""
    m, plan, q, k, v = dry.mod, dry.plan, dry.q, dry.k, dry.v
    n0 = m.dry_launches()
    o = plan.forward(q, k, v, None, 0)
    assert o.shape == q.shape and o.grad_fn.name() == "SparseflashAttentionBackward"
    assert m.dry_launches() == n0 + 1
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    (c,) = dry.fb.calls
    assert torch.equal(c["do"], do) and c["q"] is q and c["kl"] is None
    assert c["o"].shape == q.shape and c["lse"].shape == q.shape[:3]
    assert torch.equal(dk, torch.full_like(k, 2.0))
    bwd = m.make_launch(0, [1, 1, 1], 128, 0, [0] * 11, [8] * 11, [(i, i) for i in range(11)])
    plan.add_bwd(list(do.stride()), bwd, bwd)
    assert plan.n_bwd == 1
    o = plan.forward(q, k, v, None, 0)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert len(dry.fb.calls) == 1 and m.dry_launches() == n0 + 4
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    o = plan.forward(q, k, v, None, 0)
    torch.autograd.grad(o, (q, k, v), do.transpose(1, 2).contiguous().transpose(1, 2))
    assert len(dry.fb.calls) == 2


@needs_cxx
def test_native_node_saves_like_builtin_ops(dry):
    """A second backward without retain_graph is refused, with it allowed; an input modified in
    place after the forward is caught; no grad mode or inputs without grad make no node; a call
    with key_lengths where the plan has none, or a misaligned input, is refused (None)."""
    plan, q, k, v = dry.plan, dry.q, dry.k, dry.v
    o = plan.forward(q, k, v, None, 0)
    loss = o.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    q2 = q.detach().clone().requires_grad_()
    o = plan.forward(q2, k, v, None, 0)
    with torch.no_grad():
        q2.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    with torch.no_grad():
        assert plan.forward(q, k, v, None, 0).grad_fn is None
    assert plan.forward(q.detach(), k.detach(), v.detach(), None, 0).grad_fn is None
    assert plan.forward(q, k, v, torch.ones(2, dtype=torch.int32), 0) is None
    buf = torch.empty(q.numel() + 1)
    assert plan.forward(buf[1:].view_as(q), k, v, None, 0) is None


@needs_cxx
def test_native_build_is_cached(mod, tmp_path, monkeypatch):
    """One module per source, torch and Python: loading again reuses the built file."""
    assert native.load() is mod and native.ready()
    files = list(native.cache_dir().glob(f"sparseflash_native_{native.build_tag()}*"))
    assert len(files) == 1


@pytest.mark.interpreter
def test_fallback_without_its_entry_runs_the_general_backward():
    """A native plan's fallback runs its entry's backward while the entry lives, and once the entry
    is gone (its cache cleared) the general backward with the lists and scalars it kept; it does
    not keep the entry alive (the entry holds the plan, which holds the fallback)."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(4))
    mask = sparseflash.BlockMask.from_layout(torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), block_size=16)
    from sparseflash.flash.autograd import mask_lists

    kv_idx, q_idx, bq, bk, density = mask_lists(mask, q.device)
    o, lse = launch.fwd(q, k, v, kv_idx, None, 0.25, False, bq or None, bk or None, 0.0, None)
    want = launch.bwd(do, q, k, v, o, lse, None, kv_idx, q_idx, None, 0.25, False, bq or None, bk or None, 0.0, None)
    entry = fast.make_entry(q, k, v, mask, False, 0.25, None)
    fb = fast.NativeFallback(entry)
    seen = []
    real = fast.Entry.backward
    fast.Entry.backward = lambda self, *a: (seen.append(1), real(self, *a))[1]
    try:
        got_alive = fb(do, q, k, v, o, lse, None)
    finally:
        fast.Entry.backward = real
    assert seen == [1]
    ref = weakref.ref(entry)
    del entry
    gc.collect()
    assert ref() is None
    got = fb(do, q, k, v, o, lse, None)
    for a, b, c in zip(got_alive, got, want):
        assert torch.equal(a, c) and torch.equal(b, c)


# ------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not CUDA, reason="native launches run on CUDA")


def _entries():
    from test_fast_path import _call

    found = list(fast.DENSE.values())
    for m in _call.masks.values():
        found += list(m.fast_entries.values())
    return [e for e in found if isinstance(e, fast.Entry)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("setting", ["dense", "mask", "mask-causal-keylen", "gqa-scale", "transposed"])
def test_gpu_native_matches_the_python_short_path(setting, mod, monkeypatch):
    """After two calls (bind, then plan) and a backward per dO layout, calls run natively: no
    Python forward or backward of the entry runs, and outputs and gradients are bitwise those of
    the Python short path and of the general path."""
    from test_fast_path import _call

    fast.clear()
    for m in _call.masks.values():
        m.fast_entries.clear()
    for seed in range(2):
        _call(setting, seed)
        _call(setting, seed, do_t=True)
    (entry,) = [e for e in _entries() if e.native]
    assert entry.native.n_bwd == 2
    py_calls = []
    for name in ("forward", "backward"):
        real = getattr(fast.Entry, name)
        monkeypatch.setattr(fast.Entry, name, lambda self, *a, _r=real, _n=name: (py_calls.append(_n), _r(self, *a))[1])
    got = [_call(setting, s)[0] for s in (2, 3)] + [_call(setting, 4, do_t=True)[0]]
    assert not py_calls
    monkeypatch.undo()
    for flag, mod_ in ((native, native), (fast, fast)):
        monkeypatch.setattr(mod_, "ENABLED", False)
        want = [_call(setting, s)[0] for s in (2, 3)] + [_call(setting, 4, do_t=True)[0]]
        for g, w in zip(got, want):
            for name, a, b in zip(("out", "dq", "dk", "dv"), g, w):
                assert torch.equal(a, b), (setting, flag.__name__, name)


@pytest.mark.gpu
@gpu
def test_gpu_native_steps_aside(mod, monkeypatch):
    """Launch hooks (a profiler) see every launch: the forward goes the Python way while one is
    set. A misaligned input goes the general way. A side stream is honoured. A CUDA graph
    captured after native calls replays the same values."""
    from triton import knobs

    fast.clear()
    q, k, v, do = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(3):
        want = torch.autograd.grad(sparseflash.attention(qg, kg, vg), (qg, kg, vg), do)
    (entry,) = [e for e in fast.DENSE.values() if isinstance(e, fast.Entry) and e.native]
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: seen.append(1))
    got = torch.autograd.grad(sparseflash.attention(qg, kg, vg), (qg, kg, vg), do)
    monkeypatch.undo()
    assert len(seen) >= 3
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    buf = torch.empty(q.numel() + 8, device="cuda", dtype=q.dtype)
    q_off = buf[1:q.numel() + 1].view_as(q).copy_(q)
    torch.testing.assert_close(sparseflash.attention(q_off, k, v), sparseflash.attention(q, k, v), atol=0, rtol=0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = torch.autograd.grad(sparseflash.attention(qg, kg, vg), (qg, kg, vg), do)
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sparseflash.attention(q, k, v)
    g.replay()
    torch.cuda.synchronize()
    ref = sparseflash.attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
