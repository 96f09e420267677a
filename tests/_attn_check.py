"""Shared checking helper: an attention implementation against the float64 reference, with the
error bound set by PyTorch's own error in the same dtype (STYLE.md)."""

from __future__ import annotations

import torch

from sparseflash import reference

# Absolute floors added to the 2x-PyTorch bound, per dtype (values are O(1)); on top, one unit in
# the last place of the largest reference value: rounding the exact answer to the dtype costs up
# to half of that, and a maximum over a whole tensor of rounding noise reaches it.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}


REPORT: list | None = None  # set to a list to collect (name, err, torch_err, floor) rows


def make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(B, Hq, Nq, D, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def _run(fn, q, k, v, do, with_grad=True):
    q, k, v = (t.detach().clone().requires_grad_(with_grad) for t in (q, k, v))
    out = fn(q, k, v)
    o, lse = out if isinstance(out, tuple) else (out, None)
    if not with_grad:
        return o.detach(), lse, None
    o.backward(do.to(o.dtype))
    return o.detach(), (None if lse is None else lse.detach()), (q.grad, k.grad, v.grad)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_torch_error(name, got, pt, ref, dtype, factor=2.0):
    """|got - ref| <= factor * |pt - ref| + floor (``pt``: the computation done in PyTorch in
    ``dtype``; ``ref``: float64), and no NaN in ``got``. Returns (error, torch's error)."""
    assert not torch.isnan(got).any(), f"{name} has NaN"
    e_k, e_pt = _err(got, ref), _err(pt, ref)
    floor = FLOOR[dtype] + torch.finfo(dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)
    if REPORT is not None:
        REPORT.append((name, e_k, e_pt, floor))
    assert e_k <= factor * e_pt + floor, f"{name}: error {e_k:.3e} > {factor} x torch's {e_pt:.3e} + {floor:.0e}"
    return e_k, e_pt


def check_attention(impl, q, k, v, do, *, mask=None, causal=False, scale=None, key_lengths=None, grads=True,
                    ref_kwargs=None, factor=2.0):
    """impl(q, k, v) -> out or (out, lse). Asserts |impl - ref64| <= factor * |torch_dtype - ref64| + floor
    for the output and (if grads) dq, dk, dv, and that nothing is NaN. Returns the errors."""
    kw = dict(mask=mask, causal=causal, scale=scale, key_lengths=key_lengths, **(ref_kwargs or {}))
    # The float64 reference runs on the inputs' device (float64 arithmetic is the same on a GPU,
    # and there it takes seconds at 16K tokens where the CPU takes minutes).
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    o_ref, _, g_ref = _run(lambda a, b, c: reference.attention(a, b, c, **kw), q64, k64, v64, do64, grads)
    # The same computation in PyTorch, in the input dtype (on the input device).
    o_pt, _, g_pt = _run(lambda a, b, c: reference.attention(a, b, c, compute_dtype=q.dtype, **kw), q, k, v, do, grads)
    o_k, _, g_k = _run(impl, q, k, v, do, grads)
    assert not torch.isnan(o_k).any(), "output has NaN"
    errs = {}
    pairs = [("out", o_k, o_pt, o_ref)]
    if grads:
        pairs += [(n, a, b, c) for n, a, b, c in zip(("dq", "dk", "dv"), g_k, g_pt, g_ref)]
    for name, got, pt, ref in pairs:
        errs[name] = assert_within_torch_error(name, got, pt, ref, q.dtype, factor)
    return errs


def flash_attn_allowed(lq: int, lk: int, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """flash-attn's documented mask of one sequence: query i (of lq) attends key j (of lk) iff
    i + lk - lq - left <= j <= i + lk - lq + right (bottom-right aligned; a negative bound is
    none; causal sets right to 0)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    m = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        m &= j <= i + right
    if left >= 0:
        m &= j >= i - left
    return m
