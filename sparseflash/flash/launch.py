"""Host launchers of the portable kernels (`kernels.py`): plans, grids, outputs, and the launch.

The op's layers: `sparseflash.attention` (api.py: validation, the short path `fast.lookup` / `fast.call`, then
`flash_attention`) -> `FlashAttentionFunction` and its torch.library ops (autograd.py) -> `fwd` /
`bwd` here -> the kernels. `fwd` and `bwd` first ask `dispatch.hopper_plan` whether the Hopper
Gluon kernels take the call (launched by `hopper_fwd`, `hopper_bwd`); else they launch the portable
kernels with the tiles and TMA choice of `tiles` and the arguments of `operands`.

Per-call cost (a short call is bound by host time): what a launch derives from shapes, strides,
dtypes and scalars is a `Plan` (`plan_fwd`, `plan_dq`, `plan_dkdv`) computed once per key, holding
every kernel argument by its parameter name; `run` launches a plan with the call's tensors by name,
through Triton's ``kernel[grid](**args)`` the first time and straight through the compiled kernel's
C launcher after (`sparseflash.flash.binding`: FAST_LAUNCH, and why that is safe). The short path
(`sparseflash.flash.fast`) runs the same plans with `run`, or from C++ (`sparseflash.flash.native`)
once a plan is bound: those are the two launch routes. Kernels launched without a plan (the Hopper
kernels, decoding, the index build and selection) take the first route through `binding.call`,
which binds per combination of what Triton specialises on.
"""

from __future__ import annotations

import torch

from sparseflash._consts import LOG2E
from sparseflash.flash import binding, dispatch, kernels, operands, tiles
from sparseflash.flash.operands import (TENSOR, ExactTiles, aligned_strides, bwd_consts, cdiv, check_exact, checked_rng,
                                       dot_precision, drop_args, drop_pack, list_args, list_plan_args, optional_tensors,
                                       softcap_arg, table_layout, table_pack_tensors, table_packs)

__all__ = ["fwd", "bwd", "bwd_dq", "bwd_dkdv", "hopper_fwd", "hopper_bwd", "plan_fwd", "plan_dq", "plan_dkdv", "run",
           "plan_state", "POISON_OUTPUTS", "Plan", "PLANS", "PLANS_MAX", "cached_plan", "bind_plan"]


# Tests set this to fill every output with NaN before the kernels run, so that an element a
# kernel fails to write cannot pass as a plausible value.
POISON_OUTPUTS = False


def _new(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    t = torch.empty_like(like) if shape is None else torch.empty(shape, device=like.device, dtype=dtype)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


# ----------------------------------------------------------------------------- launch plans
# Everything a launch derives from its inputs' shapes, strides and dtypes and from the call's
# scalars (tile config, grid, the strides and their alignment, the lists' strides, the dropout
# constants, the constexprs) is computed once per combination (the key) and kept as a Plan: every
# kernel argument by its parameter name. A call then allocates its outputs, names its tensors
# and launches (`run`). The key also holds the module state the plans read (tile overrides,
# TMA_MODE, GATHER_MAX, interpreter, dot precision), so changing any of it makes new plans.

PLANS: dict = {}  # key -> Plan (tests read and clear it)
PLANS_MAX = 1024


class Plan:
    """One kernel's launch for one key: ``args`` every argument by parameter name (constexprs and
    compile options included) with `operands.TENSOR` where a tensor of the call goes, None where
    the variant reads nothing; ``tensors`` the names a call fills with a tensor; ``packs`` (name,
    template) of each tuple argument holding TENSOR markers (an optional part's tensors with its
    scalars, e.g. ``segments``: (TENSOR, TENSOR, batch stride, batch stride)), which a call fills
    with a tuple of its tensors in the markers' order (`Plan.arguments`); ``tma`` whether the
    call's tensors include TMA descriptors (built per call). ``bound``: `run`'s bound launches of
    this plan; ``slots``: (position among the kernel's parameters, name) of each tensor and pack,
    once bound."""

    __slots__ = ("kernel", "grid", "args", "tensors", "packs", "cfg", "tma", "cuda", "bound", "slots")

    def __init__(self, kernel: str, grid, args: dict, cfg, tma: bool, device: torch.device):
        # the kernel by name in kernels.py, looked up at each launch (tools may swap it)
        self.kernel, self.grid, self.args, self.cfg, self.tma = kernel, grid, args, cfg, tma
        self.tensors = tuple(n for n, a in args.items() if a is TENSOR)
        self.packs = tuple((n, a) for n, a in args.items() if type(a) is tuple and any(x is TENSOR for x in a))
        self.cuda = device.type == "cuda"
        self.bound = {}
        self.slots = None

    def arguments(self, tensors: dict) -> dict:
        """Every argument by parameter name with the call's ``tensors`` in (a tensor per name of
        ``tensors``, a tuple of tensors per name of ``packs``)."""
        args = dict(self.args)
        for n in self.tensors:
            args[n] = tensors[n]
        for n, template in self.packs:
            args[n] = _filled(template, tensors[n])
        return args


def _filled(template: tuple, values) -> tuple:
    """``template`` with its TENSOR markers replaced by ``values`` in order."""
    it = iter(values)
    out = tuple(next(it) if x is TENSOR else x for x in template)
    if next(it, None) is not None:
        raise ValueError(f"more tensors than the {sum(x is TENSOR for x in template)} this argument takes")
    return out


def plan_state() -> tuple:
    """The module state a plan depends on beyond its inputs (part of every plan key)."""
    return tiles.INTERPRETING, tiles.TMA_MODE, operands.GATHER_MAX, tiles.overrides()


def cached_plan(key, build, *args, **kwargs):
    """The plan of ``key`` in PLANS, made by ``build(*args, **kwargs)`` when it is not there yet."""
    plan = PLANS.get(key)
    if plan is None:
        if len(PLANS) >= PLANS_MAX:
            PLANS.clear()  # a model calls with few layouts; this bounds a sweep over many
        plan = PLANS[key] = build(*args, **kwargs)
    return plan


def _layout(t: torch.Tensor | None):
    """The part of a tensor's layout a plan reads: None, or (shape, strides)."""
    return None if t is None else (t.shape, t.stride())


def _frozen(tma_plan):
    return None if tma_plan is None else tuple(map(tuple, tma_plan))


def bind_plan(plan: Plan, kernel, compiled, args: dict) -> tuple | None:
    """The bound launch of ``plan`` from its first launch with ``args`` (its arguments, the call's
    tensors in): (run, function, packed_metadata, every parameter's value in the kernel's order
    with None where a tensor's address goes, the compiled kernel), or None when it cannot be
    bound (`binding.bind`). Sets ``plan.slots`` on first use."""
    made = binding.bind(kernel, compiled, args)
    if made is None or len(made[4]) != len(plan.tensors) + len(plan.packs):
        return None
    plan.slots = made[4]
    return (*made[:4], compiled)


def run(plan: Plan, tensors: dict) -> tuple | None:
    """Launch ``plan`` with ``tensors`` (parameter name -> tensor, one per ``plan.tensors``):
    bound (see FAST_LAUNCH) or through Triton with every argument by keyword. Returns (key, bound
    launch) of this combination when it has one (the short path's native plan reads it)."""
    fast = binding.FAST_LAUNCH and plan.cuda and not plan.tma and not tiles.INTERPRETING
    if fast:
        ptrs = {n: tensors[n].data_ptr() for n in plan.tensors}
        key = (binding.current_device(), tuple(p & 15 == 0 for p in ptrs.values()),
               tuple(tensors[n].dtype for n in plan.tensors))
        if plan.packs:  # (their tensors' alignments and dtypes join the key's; each pack goes whole)
            key = _pack_key(plan, tensors, ptrs, key)
        bound = plan.bound.get(key)
        if bound is not None and binding.hooks_idle():
            run_c, function, meta, values = bound[:4]
            values = list(values)
            for i, n in plan.slots:  # (by name: the slots are in the kernel's parameter order)
                values[i] = ptrs[n]
            g = plan.grid
            run_c(g[0], g[1], 1, binding.raw_stream(key[0]), function, meta, None, None, None, *values)
            return key, bound
    args = plan.arguments(tensors)
    kernel = getattr(kernels, plan.kernel)
    if plan.tma and plan.cuda:  # descriptors made per call: bound per combination by `call`
        binding.call(kernel, plan.grid, **args)
        return None
    compiled = kernel[plan.grid](**args)
    if fast and binding.hooks_idle():
        try:
            bound = bind_plan(plan, kernel, compiled, args)
        except Exception:  # an unexpected Triton: keep its own launch path
            bound = None
        if bound is not None:
            plan.bound[key] = bound
            return key, bound
    return None


def _pack_key(plan: Plan, tensors: dict, ptrs: dict, key: tuple) -> tuple:
    """`run`'s bound-launch key with the packs' tensors in (their alignments, their dtypes), and
    ``ptrs`` given each pack's value as the bound launch passes it (the tensors as addresses)."""
    aligned, dtypes = list(key[1]), list(key[2])
    for n, template in plan.packs:
        ts = tensors[n]
        addrs = [t.data_ptr() for t in ts]
        aligned += [a & 15 == 0 for a in addrs]
        dtypes += [t.dtype for t in ts]
        ptrs[n] = _filled(template, addrs)
    return key[0], tuple(aligned), tuple(dtypes)


def _descs(cfg, tma_plan, D: int, kind: str, *tiles_) -> dict:
    """The DESC_* tensors of a ``kind`` launch: descriptors of ``tiles_`` ((tensor, rows) pairs) when
    the plan loads through TMA, else none (the plan's DESC_* arguments are None then)."""
    descs, taken = tiles.tma_args(cfg, tma_plan, tiles.block_d(D), *tiles_)
    return {f"DESC_{n}": d for n, d in zip(_DESC_NAMES[kind], descs)} if taken else {}


_DESC_NAMES = {"fwd": ("Q", "K", "V"), "dkdv": ("Q", "K", "V", "DO"), "dq": ("Q", "K", "V", "DO", "O")}


def _desc_args(names: str, tma: bool) -> dict:
    return {f"DESC_{n}": (TENSOR if tma else None) for n in _DESC_NAMES[names]}


def fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None, mask_bk: int | None,
        dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0, segments=None, key_ranges=None,
        slopes=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """Forward launch. Returns (o like q, lse float32 [B, Hq, Nq] with +inf for empty rows).
    ``rng``: the `sparseflash.dropout.draw_rng` tensor, read when dropout_p > 0. ``work``: the
    call's estimated forward FLOPs, -1 unknown (`tiles.tma_plan`). ``segments``: int32 segment ids
    (seg_q, seg_k); ``key_ranges``: the int32 key-range table; ``slopes``: ALiBi's float32 [1 or B,
    Hq] (`operands.table_packs`). ``softcap``: > 0 soft-caps the scores (the kernels' SOFTCAP).
    ``exact``: an `ExactTiles` (the kernels' EXACT). Whether the Hopper kernel runs the call
    instead is `dispatch.hopper_plan`'s choice."""
    B, Hq, Nq, D = q.shape
    tables = (segments, key_ranges, slopes)
    lay = dispatch.hopper_plan(q, k, v, mask_bq, mask_bk, work, scale=scale, dropout_p=dropout_p, tables=tables,
                               softcap=softcap, exact=exact)
    if lay is not None:
        return hopper_fwd(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, lay=lay, exact=exact)
    tma_plan = tiles.tma_plan(tiles.block_d(D), q, k, v, work=work)
    o = _new(q)
    lse = _new(q, (B, Hq, Nq), torch.float32)
    plan = plan_fwd(q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan=tma_plan,
                    tables=tables, softcap=softcap, exact=exact is not None)
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    tile_table, bits = (None, None) if exact is None else check_exact(exact, kv_idx, "kv_idx")
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    run(plan, optional_tensors(Q=q, K=k, V=v, O=o, LSE=lse, KV_IDX=kv_idx,
                               exact=None if exact is None else (tile_table, bits), KEY_LEN=key_lengths, RNG=rng,
                               **table_pack_tensors(*tables),
                               **_descs(plan.cfg, tma_plan, D, "fwd", (q, bm), (k, bn), (v, bn))))
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


def plan_fwd(q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, *, tma_plan=None,
             tables=(None, None, None), softcap=0.0, exact: bool = False) -> Plan:
    """The forward's plan for this combination (made once per key; ``o``: an output, for its layout)."""
    key = ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), o.stride(), q.dtype, q.device, _layout(kv_idx),
           None if key_lengths is None else key_lengths.dtype, table_layout(*tables), scale, causal, mask_bq, mask_bk,
           dropout_p, _frozen(tma_plan), dot_precision(q.dtype), plan_state(), softcap, exact)
    return cached_plan(key, _fwd_plan, q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                       tma_plan, tables, softcap, exact)


def _fwd_plan(q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, tables, softcap,
              exact):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = tiles.config("fwd", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                       dropout_p > 0.0, tma_plan is not None, any(t is not None for t in tables))
    list_a = list_plan_args(kv_idx, B, Hq, q, "KV_IDX", mask_bq or cfg.block_m, mask_bk or cfg.block_n)
    strides, align = aligned_strides(q, k, v, o)
    tma = tiles.tma_taken(cfg, tma_plan)
    args = dict(Q=TENSOR, K=TENSOR, V=TENSOR, O=TENSOR, LSE=TENSOR, **list_a, exact=(TENSOR, TENSOR) if exact else None,
                KEY_LEN=None if key_lengths is None else TENSOR, **table_packs(*tables),
                strides=_stride_tuples(4, strides), H_Q=Hq, GROUP=Hq // Hkv, seq_q=Nq, seq_k=Nk, qk_scale=scale * LOG2E,
                **drop_args(dropout_p), **_desc_args("fwd", tma),
                HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                CAUSAL=causal, DOT_PREC=dot_precision(q.dtype), **cfg.launch_options(), ALIGN=align,
                **softcap_arg(softcap))
    return Plan("fwd_kernel", (cdiv(Nq, cfg.block_m), B * Hq), args, cfg, tma, q.device)


def _stride_tuples(n: int, strides: tuple) -> tuple:
    """The kernels' ``strides`` argument from `aligned_strides`' flat tuple of ``n`` 4-D tensors: one
    (batch, head, row, column) tuple per tensor, in the order of the kernel's tensor parameters."""
    return tuple(tuple(strides[4 * i:4 * i + 4]) for i in range(n))


def bwd(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths, scale: float, causal: bool,
        mask_bq: int | None, mask_bk: int | None, dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0,
        segments=None, key_ranges=None, slopes=None, softcap: float = 0.0, exact: ExactTiles | None = None,
        deterministic: bool = False):
    """Backward launches: dQ (which also computes delta), then dK/dV. Returns (dq, dk, dv); or the
    one-pass Hopper backward (`hopper_bwd`) where `dispatch.hopper_plan` chooses it (never with
    ``deterministic``). ``segments``, ``key_ranges``, ``slopes``, ``softcap``, ``exact``: as `fwd`'s."""
    tables = (segments, key_ranges, slopes)
    lays = dispatch.hopper_plan(q, k, v, mask_bq, mask_bk, work, scale=scale, dropout_p=dropout_p, tables=tables,
                                softcap=softcap, exact=exact, do=do, o=o, lists=q_idx is not None,
                                deterministic=deterministic)
    if lays is not None:
        return hopper_bwd(do, q, k, v, o, lse, dlse, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, lays=lays,
                          exact=exact)
    delta = _new(lse)
    args = (do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng)
    named = dict(work=work, segments=segments, key_ranges=key_ranges, slopes=slopes, softcap=softcap, exact=exact)
    dq = bwd_dq(*args, kv_idx, o=o, dlse=dlse, **named)
    dk, dv = bwd_dkdv(*args, q_idx, **named)
    return dq, dk, dv


def _bwd_key(kind, do, q, k, v, idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tables, tma_plan,
             *extra, softcap=0.0, exact: bool = False):
    return (kind, q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device, _layout(idx),
            None if key_lengths is None else key_lengths.dtype, table_layout(*tables), scale, causal, mask_bq, mask_bk,
            dropout_p, _frozen(tma_plan), dot_precision(q.dtype), plan_state(), *extra, softcap, exact)


def bwd_dkdv(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, q_idx, *,
             work: float = -1.0, segments=None, key_ranges=None, slopes=None, softcap: float = 0.0,
             exact: ExactTiles | None = None):
    """dK, dV: one program per (k tile, batch * kv head), walking the column lists (delta from `bwd_dq`)."""
    D = q.shape[-1]
    tma_plan = tiles.tma_plan(tiles.block_d(D), q, k, v, do, work=work)
    dk, dv = _new(k), _new(v)
    tables = (segments, key_ranges, slopes)
    plan = plan_dkdv(do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan=tma_plan,
                     tables=tables, softcap=softcap, exact=exact is not None)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    tile_table, bits = (None, None) if exact is None else check_exact(exact, q_idx, "q_idx")
    run(plan, optional_tensors(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK=dk, DV=dv, Q_IDX=q_idx,
                               exact=None if exact is None else (tile_table, bits), KEY_LEN=key_lengths,
                               dropout=None if rng is None else (rng,), **table_pack_tensors(*tables),
                               **_descs(plan.cfg, tma_plan, D, "dkdv", (q, bm), (k, bn), (v, bn), (do, bm))))
    return dk, dv


def plan_dkdv(do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, *, tma_plan=None,
              tables=(None, None, None), softcap=0.0, exact: bool = False) -> Plan:
    """The dK/dV kernel's plan for this combination (made once per key; ``dk``, ``dv``: outputs,
    for their layouts)."""
    key = _bwd_key("dkdv", do, q, k, v, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tables,
                   tma_plan, dk.stride(), dv.stride(), softcap=softcap, exact=exact)
    return cached_plan(key, _dkdv_plan, do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk,
                       dropout_p, tma_plan, tables, softcap, exact)


def _dkdv_plan(do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, tables, softcap,
               exact):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    constexprs = bwd_consts(q, causal, softcap)
    cfg = tiles.config("dkdv", D, q.device, mask_bq, mask_bk, q.dtype, None if q_idx is None else q_idx.shape[-2],
                       dropout_p > 0, tma_plan is not None)
    list_a = list_plan_args(q_idx, B, Hq, q, "Q_IDX", mask_bq or cfg.block_m, mask_bk or cfg.block_n)
    strides, align = aligned_strides(q, k, v, do, dk, dv)
    tma = tiles.tma_taken(cfg, tma_plan)
    args = dict(Q=TENSOR, K=TENSOR, V=TENSOR, DO=TENSOR, LSE=TENSOR, DELTA=TENSOR, DK=TENSOR, DV=TENSOR, **list_a,
                exact=(TENSOR, TENSOR) if exact else None, KEY_LEN=None if key_lengths is None else TENSOR,
                **table_packs(*tables), strides=_stride_tuples(6, strides), H_Q=Hq, H_KV=Hkv, GROUP=Hq // Hkv,
                seq_q=Nq, seq_k=Nk, scales=(scale * LOG2E, scale), **drop_pack(dropout_p),
                **_desc_args("dkdv", tma),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                **cfg.launch_options(), **constexprs, Q_ROWS=cfg.q_rows, ALIGN=align)
    return Plan("bwd_dkdv_kernel", (cdiv(Nk, cfg.block_n), B * Hkv), args, cfg, tma, q.device)


def bwd_dq(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, kv_idx,
           *, o, dlse=None, work: float = -1.0, segments=None, key_ranges=None, slopes=None, softcap: float = 0.0,
           exact: ExactTiles | None = None):
    """dQ: one program per (q tile, batch * q head), walking the row lists. It first writes
    delta = rowsum(dO * O) - dLSE (float32 [B, Hq, Nq]) into ``delta``, for `bwd_dkdv`."""
    D = q.shape[-1]
    tma_plan = tiles.tma_plan(tiles.block_d(D), q, k, v, do, o, work=work)
    dq = _new(q)
    tables = (segments, key_ranges, slopes)
    plan = plan_dq(do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan=tma_plan,
                   tables=tables, has_dlse=dlse is not None, softcap=softcap, exact=exact is not None)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    rng = None if dropout_p <= 0.0 else checked_rng(rng, q.device)
    tile_table, bits = (None, None) if exact is None else check_exact(exact, kv_idx, "kv_idx")
    run(plan, optional_tensors(Q=q, K=k, V=v, O=o, DO=do, LSE=lse, DLSE=dlse, DELTA=delta, DQ=dq, KV_IDX=kv_idx,
                               exact=None if exact is None else (tile_table, bits), KEY_LEN=key_lengths,
                               dropout=None if rng is None else (rng,), **table_pack_tensors(*tables),
                               **_descs(plan.cfg, tma_plan, D, "dq", (q, bm), (k, bn), (v, bn), (do, bm), (o, bm))))
    return dq


def plan_dq(do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, *, tma_plan=None,
            tables=(None, None, None), has_dlse: bool = False, softcap=0.0, exact: bool = False) -> Plan:
    """The dQ kernel's plan for this combination (made once per key; ``dq``: an output, for its
    layout)."""
    key = _bwd_key("dq", do, q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tables,
                   tma_plan, o.stride(), dq.stride(), has_dlse, softcap=softcap, exact=exact)
    return cached_plan(key, _dq_plan, do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk,
                       dropout_p, tma_plan, tables, has_dlse, softcap, exact)


def _dq_plan(do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, tables,
             has_dlse, softcap, exact):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    constexprs = bwd_consts(q, causal, softcap)
    cfg = tiles.config("dq", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                       dropout_p > 0, tma_plan is not None)
    list_a = list_plan_args(kv_idx, B, Hq, q, "KV_IDX", mask_bq or cfg.block_m, mask_bk or cfg.block_n)
    strides, align = aligned_strides(q, k, v, do, o, dq)
    tma = tiles.tma_taken(cfg, tma_plan)
    args = dict(Q=TENSOR, K=TENSOR, V=TENSOR, O=TENSOR, DO=TENSOR, LSE=TENSOR, DLSE=TENSOR if has_dlse else None,
                DELTA=TENSOR, DQ=TENSOR, **list_a, exact=(TENSOR, TENSOR) if exact else None,
                KEY_LEN=None if key_lengths is None else TENSOR, **table_packs(*tables),
                strides=_stride_tuples(6, strides), H_Q=Hq, GROUP=Hq // Hkv, seq_q=Nq, seq_k=Nk,
                scales=(scale * LOG2E, scale), **drop_pack(dropout_p),
                **_desc_args("dq", tma),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                **cfg.launch_options(), **constexprs, ALIGN=align)
    return Plan("bwd_dq_kernel", (cdiv(Nq, cfg.block_m), B * Hq), args, cfg, tma, q.device)
