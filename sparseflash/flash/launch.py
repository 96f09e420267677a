"""Host launchers of the portable kernels (`kernels.py`): plans, grids, outputs, and the launch.

The op's layers: `sparseflash.attention` (api.py: validation, the short path `fast.try_call`, then
`flash_attention`) -> `FlashAttentionFunction` and its torch.library ops (autograd.py) -> `fwd` /
`bwd` here -> the kernels. `fwd` and `bwd` first ask `dispatch.hopper_plan` whether the Hopper
Gluon kernels take the call (launched by `hopper_fwd`, `hopper_bwd`); else they launch the portable
kernels with the tiles and TMA choice of `tiles` and the arguments of `operands`.

Per-call cost (a short call is bound by host time): what a launch derives from shapes, strides,
dtypes and scalars is a `_Plan` computed once per key; repeat launches of a plan go straight to the
compiled kernel's C launcher (`_launch`, FAST_LAUNCH; the comment above it says why that is safe).
`quick_fwd` / `quick_bwd` make the short path's `QuickLaunch`es: plans whose per-call tensors are
known by role, for `sparseflash.flash.fast` and its C++ half.
"""

from __future__ import annotations

import torch

from sparseflash import _env
from sparseflash._consts import LOG2E
from sparseflash.flash import dispatch, kernels, operands, tiles
from sparseflash.flash.operands import (ExactTiles, aligned_strides, bwd_consts, cdiv, check_exact, checked_rng,
                                       dkdv_tensors, dot_precision, dq_tensors, drop_consts, exact_flag, fwd_tensors,
                                       gather, list_args, seg_args, softcap_flag)

__all__ = ["fwd", "bwd", "bwd_dq", "bwd_dkdv", "hopper_fwd", "hopper_bwd", "plan_state", "POISON_OUTPUTS",
           "FAST_LAUNCH", "hooks_idle", "raw_stream", "QuickLaunch", "quick_ptrs", "quick_fwd", "quick_bwd"]


# Tests set this to fill every output with NaN before the kernels run, so that an element a
# kernel fails to write cannot pass as a plausible value.
POISON_OUTPUTS = False


def _new(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    t = torch.empty_like(like) if shape is None else torch.empty(shape, device=like.device, dtype=dtype)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


def _exact_slots(exact) -> tuple:
    """The plan's argument entries of the tile table and bit slots: tensors of the call (`_T`) with
    bits, else None (a constexpr to Triton: the default kernels keep their signature and code)."""
    return (None, None) if exact is None else (_T, _T)


# ----------------------------------------------------------------------------- launch plans
# Everything a launch derives from its inputs' shapes, strides and dtypes and from the call's
# scalars (tile config, grid, the strides and their alignment, the lists' strides, the dropout
# constants, the constexprs) is computed once per combination (the key) and kept as a _Plan; a
# call then allocates its outputs, puts its tensors into the plan's argument list and launches
# (`_launch`). The key also holds the module state the plans read (tile overrides, TMA_MODE,
# GATHER_MAX, interpreter, dot precision), so changing any of it makes new plans.

_T = object()  # marks where a tensor of the call goes in a plan's argument list
_PLANS: dict = {}
_PLANS_MAX = 1024


class _Plan:
    """One kernel's launch for one key: ``args`` its positional arguments with `_T` where the
    call's tensors go (positions ``slots``, in the order the launcher passes them), ``kwargs`` the
    constexprs and compile options, ``tma`` whether the tensors' last slots take TMA descriptors
    (built per call). ``bound``: `_launch`'s bound launches of this plan."""

    __slots__ = ("kernel", "grid", "args", "slots", "kwargs", "cfg", "tma", "cuda", "bound")

    def __init__(self, kernel: str, grid, args, kwargs, cfg, tma: bool, device: torch.device):
        # the kernel by name in kernels.py, looked up at each launch (tools may swap it)
        self.kernel, self.grid, self.kwargs, self.cfg, self.tma = kernel, grid, kwargs, cfg, tma
        self.args = tuple(args)
        self.slots = tuple(i for i, a in enumerate(self.args) if a is _T)
        self.cuda = device.type == "cuda"
        self.bound = {}


def plan_state() -> tuple:
    """The module state a plan depends on beyond its inputs (part of every plan key)."""
    return tiles.INTERPRETING, tiles.TMA_MODE, operands.GATHER_MAX, tiles.overrides()


def _plan(key, build, *args):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()  # a model calls with few layouts; this bounds a sweep over many
        plan = _PLANS[key] = build(*args)
    return plan


def _layout(t: torch.Tensor | None):
    """The part of a tensor's layout a plan reads: None, or (shape, strides)."""
    return None if t is None else (t.shape, t.stride())


def _seg_layout(seg):
    return None if seg is None else (_layout(seg[0]), _layout(seg[1]), type(seg).__name__, getattr(seg, "inner", None))


def _frozen(tma_plan):
    return None if tma_plan is None else tuple(map(tuple, tma_plan))


# Bound launches: after a plan's first launch through Triton (`kernel[grid](...)`, which
# specialises, compiles or finds the compiled kernel, and launches), `_launch` keeps the
# CompiledKernel Triton returned and launches later calls of the plan with its C launcher
# directly: ``compiled.run(grid, stream, function, packed_metadata, launch_metadata=None,
# enter_hook=None, exit_hook=None, *every parameter's value)``, the call JITFunction.run itself
# ends with (the same in triton 3.6 and 3.9). That skips Triton's per-launch binding of ~45
# arguments, its cache key, its option parsing, its launch metadata and the launcher's
# data_ptr() call and pointer-attribute query per tensor (tensors go as their addresses).
#
# Safe because everything Triton specialises a compiled kernel on is in the bound launch's key:
# the plan key fixes every scalar argument (so whether each int is 1, divisible by 16, int32 or
# int64), the constexprs and the options; per call the key adds the current device, each tensor's
# dtype and whether its address is 16-byte aligned. Anything else takes Triton's own path:
# the interpreter, plans with TMA descriptors, active launch hooks (profilers such as proton),
# pre-run hooks, TRITON_DEBUG, and a first launch whose result does not look like a
# CompiledKernel. FAST_LAUNCH = False (SPARSEFLASH_FAST_LAUNCH=0) turns it off, for A/B timing
# or to let tools that hook JITFunction.run see every launch.
FAST_LAUNCH = _env.flag("SPARSEFLASH_FAST_LAUNCH", True)


_KNOBS = None


def _runtime_knobs():
    """triton.knobs.runtime (triton 3.4+), or None: no bound launches without it."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs

            _KNOBS = knobs.runtime
        except (ImportError, AttributeError):
            _KNOBS = False
    return _KNOBS or None


def hooks_idle() -> bool:
    """Triton has its launch knobs and no launch hook is set (triton 3.6+ keeps them in
    HookChains, empty by default; a profiler such as proton adds to them)."""
    rt = _runtime_knobs()
    if rt is None:
        return False
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _current_device() -> int:
    return torch.cuda.current_device()  # the device Triton launches on (its driver asks the same)


try:  # what Triton's own CUDA driver asks for the current stream
    from torch._C import _cuda_getCurrentRawStream as raw_stream
except ImportError:  # pragma: no cover
    def raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _bind(plan: _Plan, kernel, compiled, args: list) -> tuple | None:
    """The bound launch of ``plan`` from its first launch: (run, function, packed_metadata, every
    parameter's value with None where a tensor's address goes, the compiled kernel), or None when
    it cannot be bound."""
    if getattr(kernel, "pre_run_hooks", None) or _runtime_knobs().debug:
        return None
    run, function, meta = getattr(compiled, "run", None), getattr(compiled, "function", None), \
        getattr(compiled, "packed_metadata", None)
    if run is None or function is None or meta is None:
        return None
    import inspect

    params = list(inspect.signature(kernel.fn).parameters.values())
    if len(args) > len(params):
        return None
    values = list(args)
    for p in params[len(args):]:
        if p.name in plan.kwargs:
            values.append(plan.kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            values.append(p.default)
        else:
            return None
    for i in plan.slots:
        values[i] = None
    return run, function, meta, tuple(values), compiled


def _launch(plan: _Plan, tensors) -> tuple | None:
    """Launch ``plan`` with ``tensors`` in its slots: bound (see FAST_LAUNCH) or through Triton.
    Returns (key, bound launch) of this combination when it has one (`QuickLaunch` keeps it)."""
    fast = FAST_LAUNCH and plan.cuda and not plan.tma and not tiles.INTERPRETING
    if fast:
        ptrs = [t.data_ptr() for t in tensors]
        key = (_current_device(), tuple(p & 15 == 0 for p in ptrs), tuple(t.dtype for t in tensors))
        bound = plan.bound.get(key)
        if bound is not None and hooks_idle():
            run, function, meta, values = bound[:4]
            values = list(values)
            for i, p in zip(plan.slots, ptrs):
                values[i] = p
            g = plan.grid
            run(g[0], g[1], 1, raw_stream(key[0]), function, meta, None, None, None, *values)
            return key, bound
    args = list(plan.args)
    for i, t in zip(plan.slots, tensors):
        args[i] = t
    kernel = getattr(kernels, plan.kernel)
    compiled = kernel[plan.grid](*args, **plan.kwargs)
    if fast and hooks_idle():
        try:
            bound = _bind(plan, kernel, compiled, args)
        except Exception:  # an unexpected Triton: keep its own launch path
            bound = None
        if bound is not None:
            plan.bound[key] = bound
            return key, bound
    return None


def fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None, mask_bk: int | None,
        dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0, seg=None, softcap: float = 0.0,
        exact: ExactTiles | None = None):
    """Forward launch. Returns (o like q, lse float32 [B, Hq, Nq] with +inf for empty rows).
    ``rng``: the `sparseflash.dropout.draw_rng` tensor, read when dropout_p > 0. ``work``: the
    call's estimated forward FLOPs, -1 unknown (`tiles.tma_plan`). ``seg``: int32 segment ids
    (seg_q, seg_k), a `KeyRanges`, an `Alibi` (`operands.with_alibi`), or None (`seg_args`).
    ``softcap``: > 0 soft-caps the scores (the kernels' SOFTCAP). ``exact``: an `ExactTiles` (the kernels'
    EXACT). Whether the Hopper kernel runs the call instead is `dispatch.hopper_plan`'s choice."""
    B, Hq, Nq, D = q.shape
    lay = dispatch.hopper_plan(q, k, v, mask_bq, mask_bk, work, scale=scale, dropout_p=dropout_p, seg=seg,
                               softcap=softcap, exact=exact)
    if lay is not None:
        return hopper_fwd(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, lay=lay, exact=exact)
    tma_plan = tiles.tma_plan(tiles.block_d(D), q, k, v, work=work)
    o = _new(q)
    lse = _new(q, (B, Hq, Nq), torch.float32)
    key = _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan, softcap,
                   exact is not None)
    plan = _plan(key, _fwd_plan, q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, softcap, exact)
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = tiles.tma_args(plan.cfg, tma_plan, tiles.block_d(D), (q, bm), (k, bn), (v, bn))[0]  # (q, k, v) without TMA
    ex = None if exact is None else check_exact(exact, kv_idx, "kv_idx")
    _launch(plan, fwd_tensors(q, k, v, o, lse, kv_idx, key_lengths, seg, rng, descs, ex))
    return o, lse


def hopper_fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, *, lay=None,
               num_sms=None, exact: ExactTiles | None = None):
    """The Hopper forward (`hopper.fwd`) with its outputs and list arguments made here. ``lay``:
    `hopper.layouts` of (q, k, v), if known; ``exact``: as `fwd`'s."""
    from sparseflash.flash.hopper import forward as hopper

    B, Hq, Nq, _ = q.shape
    lists = None
    if kv_idx is not None:
        lists = (*list_args(kv_idx, B, Hq, q), kv_idx.shape[-1])
    ex = None if exact is None else check_exact(exact, kv_idx, "kv_idx")
    return hopper.fwd(q, k, v, _new(q), _new(q, (B, Hq, Nq), torch.float32), lists, key_lengths, scale, causal,
                      mask_bq, mask_bk, lay or hopper.layouts(q, k, v), num_sms=num_sms, exact=ex)


def hopper_bwd(do, q, k, v, o, lse, dlse, q_idx, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, *,
               lays=None, num_sms=None, exact: ExactTiles | None = None):
    """The Hopper backward (`hopper_bwd.bwd`) with its list arguments made here. ``lays``: (the
    `hopper.layouts` of (q, k, v), `hopper_bwd.do_layout` of dO), if known; ``exact``: as `bwd`'s."""
    from sparseflash.flash.hopper import backward as hb, forward as hopper

    B, Hq = q.shape[:2]
    lists = None
    if q_idx is not None:
        lists = (*list_args(q_idx, B, Hq, q), q_idx.shape[-1])
    lay, do_lay = lays or (hopper.layouts(q, k, v), hb.do_layout(do))
    ex = None if exact is None else check_exact(exact, q_idx, "q_idx")
    return hb.bwd(do, q, k, v, o, lse, dlse, lists, key_lengths, scale, causal, mask_bq, mask_bk, lay, do_lay, new=_new,
                  num_sms=num_sms, exact=ex)


def _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
             softcap=0.0, exact: bool = False) -> tuple:
    return ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, _layout(kv_idx),
            None if key_lengths is None else key_lengths.dtype, _seg_layout(seg), scale, causal, mask_bq, mask_bk,
            dropout_p, _frozen(tma_plan), dot_precision(q.dtype), plan_state(), softcap, exact)


def _fwd_plan(q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg, softcap=0.0,
              exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = tiles.config("fwd", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                       dropout_p > 0.0, tma_plan is not None, seg is not None)
    _, i_strides, nb_p2 = list_args(kv_idx, B, Hq, q)
    thresh, drop_scale = drop_consts(dropout_p)
    (_, _, *seg_strides), seg_flags = seg_args(seg, q)
    strides, align = aligned_strides(q, k, v, o)
    tma = tiles.tma_taken(cfg, tma_plan)
    args = (_T,) * 6 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *i_strides, Hq, Hq // Hkv, Nq, Nk,
                                                          scale * LOG2E, _T, thresh, drop_scale, _T, _T, _T)
    kwargs = dict(HEAD_DIM=D, BLOCK_D=tiles.block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  MASK_BQ=mask_bq or cfg.block_m, MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=gather(nb_p2),
                  DENSE=kv_idx is None, CAUSAL=causal, HAS_KEYLEN=key_lengths is not None, DROPOUT=dropout_p > 0.0,
                  DOT_PREC=dot_precision(q.dtype), **cfg.launch_options(), ALIGN=align, TMA=tma, **seg_flags,
                  **softcap_flag(softcap), **exact_flag(exact))
    return _Plan("_fwd_kernel", (cdiv(Nq, cfg.block_m), B * Hq), args, kwargs, cfg, tma, q.device)


def bwd(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths, scale: float, causal: bool,
        mask_bq: int | None, mask_bk: int | None, dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0,
        seg=None, softcap: float = 0.0, exact: ExactTiles | None = None, deterministic: bool = False):
    """Backward launches: dQ (which also computes delta), then dK/dV. Returns (dq, dk, dv); or the
    one-pass Hopper backward (`hopper_bwd`) where `dispatch.hopper_plan` chooses it (never with
    ``deterministic``). ``seg``, ``softcap``, ``exact``: as `fwd`'s."""
    lays = dispatch.hopper_plan(q, k, v, mask_bq, mask_bk, work, scale=scale, dropout_p=dropout_p, seg=seg,
                                softcap=softcap, exact=exact, do=do, o=o, lists=q_idx is not None,
                                deterministic=deterministic)
    if lays is not None:
        return hopper_bwd(do, q, k, v, o, lse, dlse, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, lays=lays,
                          exact=exact)
    delta = _new(lse)
    args = (do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng)
    dq = bwd_dq(*args, kv_idx, o=o, dlse=dlse, work=work, seg=seg, softcap=softcap, exact=exact)
    dk, dv = bwd_dkdv(*args, q_idx, work=work, seg=seg, softcap=softcap, exact=exact)
    return dq, dk, dv


def _bwd_key(kind, do, q, k, v, idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan, *extra,
             softcap=0.0, exact: bool = False):
    return (kind, q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device, _layout(idx),
            None if key_lengths is None else key_lengths.dtype, _seg_layout(seg), scale, causal, mask_bq, mask_bk,
            dropout_p, _frozen(tma_plan), dot_precision(q.dtype), plan_state(), *extra, softcap, exact)


def bwd_dkdv(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, q_idx, *,
             work: float = -1.0, seg=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """dK, dV: one program per (k tile, batch * kv head), walking the column lists (delta from `bwd_dq`)."""
    tma_plan = tiles.tma_plan(tiles.block_d(q.shape[-1]), q, k, v, do, work=work)
    dk, dv = _new(k), _new(v)
    key = _bwd_key("dkdv", do, q, k, v, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
                   softcap=softcap, exact=exact is not None)
    plan = _plan(key, _dkdv_plan, do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, softcap, exact)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = tiles.tma_args(plan.cfg, tma_plan, tiles.block_d(q.shape[-1]), (q, bm), (k, bn), (v, bn), (do, bm))[0]
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    ex = None if exact is None else check_exact(exact, q_idx, "q_idx")
    _launch(plan, dkdv_tensors(q, k, v, do, lse, delta, dk, dv, q_idx, key_lengths, seg, rng, descs, ex))
    return dk, dv


def _dkdv_plan(do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg,
               softcap=0.0, exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    seg_strides, constexprs = bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap, exact)
    cfg = tiles.config("dkdv", D, q.device, mask_bq, mask_bk, q.dtype, None if q_idx is None else q_idx.shape[-2],
                       dropout_p > 0, tma_plan is not None)
    _, ci_s, nb_p2 = list_args(q_idx, B, Hq, q)
    strides, align = aligned_strides(q, k, v, do, dk, dv)
    args = (_T,) * 9 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *ci_s, Hq, Hkv, Hq // Hkv, Nq, Nk,
                                                          scale * LOG2E, scale, _T,
                                                          *drop_consts(dropout_p), _T, _T, _T, _T)
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BQ=mask_bq or cfg.block_m,
                  MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=gather(nb_p2), DENSE=q_idx is None,
                  **cfg.launch_options(), **constexprs, Q_ROWS=cfg.q_rows, ALIGN=align,
                  TMA=tiles.tma_taken(cfg, tma_plan))
    return _Plan("_bwd_dkdv_kernel", (cdiv(Nk, cfg.block_n), B * Hkv), args, kwargs, cfg, kwargs["TMA"], q.device)


def bwd_dq(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, kv_idx,
           *, o, dlse=None, work: float = -1.0, seg=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """dQ: one program per (q tile, batch * q head), walking the row lists. It first writes
    delta = rowsum(dO * O) - dLSE (float32 [B, Hq, Nq]) into ``delta``, for `bwd_dkdv`."""
    tma_plan = tiles.tma_plan(tiles.block_d(q.shape[-1]), q, k, v, do, o, work=work)
    dq = _new(q)
    key = _bwd_key("dq", do, q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
                   o.stride(), dlse is None, softcap=softcap, exact=exact is not None)
    plan = _plan(key, _dq_plan, do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, dlse is not None, softcap, exact)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = tiles.tma_args(plan.cfg, tma_plan, tiles.block_d(q.shape[-1]), (q, bm), (k, bn), (v, bn), (do, bm),
                           (o, bm))[0]
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    ex = None if exact is None else check_exact(exact, kv_idx, "kv_idx")
    _launch(plan, dq_tensors(q, k, v, o, do, lse, dlse, delta, dq, kv_idx, key_lengths, seg, rng, descs, ex))
    return dq


def _dq_plan(do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg,
             has_dlse, softcap=0.0, exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    seg_strides, constexprs = bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap, exact)
    cfg = tiles.config("dq", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                       dropout_p > 0, tma_plan is not None)
    _, ri_s, nb_p2 = list_args(kv_idx, B, Hq, q)
    strides, align = aligned_strides(q, k, v, do, o, dq)
    args = (_T,) * 10 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *ri_s, Hq, Hq // Hkv, Nq, Nk,
                                                           scale * LOG2E, scale, _T,
                                                           *drop_consts(dropout_p), _T, _T, _T, _T, _T)
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BQ=mask_bq or cfg.block_m,
                  MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=gather(nb_p2), DENSE=kv_idx is None,
                  HAS_DLSE=has_dlse, **cfg.launch_options(), **constexprs, ALIGN=align,
                  TMA=tiles.tma_taken(cfg, tma_plan))
    return _Plan("_bwd_dq_kernel", (cdiv(Nq, cfg.block_m), B * Hq), args, kwargs, cfg, kwargs["TMA"], q.device)


# ----------------------------------------------------------------------------- quick launches
# The launches of `sparseflash.flash.fast`'s calls: a plan whose per-call tensors are known by
# role (q, k, v, outputs; `_R` markers in the launch's tensor tuple) and whose other tensors (the
# mask's lists) are fixed. A call reads the role tensors' addresses, checks their alignment, and
# calls the C launcher; anything else (misaligned, hooks set, FAST_LAUNCH off, the interpreter)
# goes through `_launch` with the full tensor tuple.

class _R(int):
    """A role marker: the position of a per-call tensor in a quick launch's argument tuple."""


_Q, _K, _V, _O, _LSE, _KL, _DO, _DELTA, _DQ, _DK, _DV = (_R(i) for i in range(11))


class QuickLaunch:
    """A plan's launch for the short path: ``plan`` (its `_Plan`), ``roles`` ((argument slot, role
    index) of each per-call tensor), ``bound``: None until its first launch through `_launch` with
    every address 16-byte aligned, then that bound launch with the fixed tensors' addresses filled
    in (run, function, packed metadata, argument values, device, compiled kernel).
    `sparseflash.flash.native.launch_of` reads these to launch the same kernel from C++."""

    __slots__ = ("plan", "layout", "roles", "bound", "n")

    def __init__(self, plan: _Plan, layout: tuple):
        self.plan, self.layout = plan, layout  # layout: the launch's tensors, _R markers where a role goes
        self.roles = tuple((slot, r) for slot, r in zip(plan.slots, layout) if isinstance(r, _R))
        self.bound = None
        self.n = len(layout)

    def __call__(self, ts: tuple, ptrs: list) -> None:
        """Launch with ``ts`` the role tensors (indexed by the markers; None where a role is unused)
        and ``ptrs`` their addresses (`quick_ptrs`)."""
        b = self.bound
        if b is not None and FAST_LAUNCH and hooks_idle():
            run, function, meta, values, dev = b[:5]
            values = list(values)
            acc = 0
            for i, r in self.roles:
                p = values[i] = ptrs[r]
                acc |= p
            if not acc & 15 and _current_device() == dev:
                g = self.plan.grid
                run(g[0], g[1], 1, raw_stream(dev), function, meta, None, None, None, *values)
                return
        done = _launch(self.plan, tuple(ts[r] if isinstance(r, _R) else r for r in self.layout))
        if b is None and done is not None and all(done[0][1]):  # keep the all-aligned bound launch
            run, function, meta, values, compiled = done[1]
            values = list(values)
            for i, t in zip(self.plan.slots, self.layout):
                if not isinstance(t, _R):
                    values[i] = t.data_ptr()
            self.bound = run, function, meta, tuple(values), done[0][0], compiled


def quick_ptrs(ts: tuple) -> list:
    """The addresses of role tensors ``ts`` (0 for None), once for the launches that share them."""
    return [0 if t is None else t.data_ptr() for t in ts]


def quick_fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None,
              mask_bk: int | None, *, work: float) -> QuickLaunch | None:
    """The forward of a `sparseflash.flash.fast` call (no dropout, no segments) as a quick launch,
    role tensors (q, k, v, o, lse, key_lengths); None when its plan would load through TMA."""
    if tiles.tma_plan(tiles.block_d(q.shape[-1]), q, k, v, work=work) is not None:
        return None
    o = torch.empty_like(q)  # only the layout is read
    key = _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    plan = _plan(key, _fwd_plan, q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    kl = None if key_lengths is None else _KL
    return QuickLaunch(plan, fwd_tensors(_Q, _K, _V, _O, _LSE, kv_idx, kl, None, None, (_Q, _K, _V)))


def quick_bwd(do, q, k, v, o, kv_idx, q_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None,
              mask_bk: int | None, *, work: float) -> tuple[QuickLaunch, QuickLaunch] | None:
    """dQ and dK/dV of a `sparseflash.flash.fast` call for ``do``'s layout, role tensors (q, k, v,
    o, lse, key_lengths, do, delta, dq, dk, dv); None when a plan would load through TMA."""
    D = q.shape[-1]
    if tiles.tma_plan(tiles.block_d(D), q, k, v, do, o, work=work) is not None:
        return None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # only their layouts are read
    args = (do, q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    plan = _plan(_bwd_key("dq", *args, o.stride(), True), _dq_plan, do, q, k, v, o, dq, kv_idx, key_lengths, scale,
                 causal, mask_bq, mask_bk, 0.0, None, None, False)
    args = (do, q, k, v, q_idx) + args[5:]
    plan_kv = _plan(_bwd_key("dkdv", *args), _dkdv_plan, do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal,
                    mask_bq, mask_bk, 0.0, None, None)
    kl = None if key_lengths is None else _KL
    return (QuickLaunch(plan, dq_tensors(_Q, _K, _V, _O, _DO, _LSE, None, _DELTA, _DQ, kv_idx, kl, None, None,
                                     (_Q, _K, _V, _DO, _O))),
            QuickLaunch(plan_kv, dkdv_tensors(_Q, _K, _V, _DO, _LSE, _DELTA, _DK, _DV, q_idx, kl, None, None,
                                          (_Q, _K, _V, _DO))))