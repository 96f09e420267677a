"""Hopper (sm_90) backward: a warp-specialised Gluon kernel for dQ, dK and dV in one pass
(design and measurements: experiments/studies/hopper/README.md, experiments/studies/hopper_bwd_fa4/).

The portable backward (`kernels.py`) runs two kernels that each recompute P and dP: dQ walks the
row lists, dK/dV the column lists, seven matmuls per tile pair. This one does five, as
FlashAttention-3 does: one CTA owns a key tile of 128 keys and walks its column list in steps of
QT query rows (`q_step`: 64 at d=128, 128 at d=64), accumulating dK and dV in registers, and adds
each step's dQ contribution into a float32 buffer with TMA reductions (``cp.reduce.async.bulk``),
which a last small kernel scales and casts.

- a 1-warp **loader** TMA-loads the CTA's K and V once, then every visited q tile's Q (with its
  rows' LSE) and dO (with their delta) into rings of STAGES slots (a ready mbarrier each, one
  empty mbarrier per slot);
- two **consumer warpgroups** own 64 keys each. Per step a warpgroup computes
  S^T = K_w Q^T and dP^T = V_w dO^T (two wgmmas whose accumulators start at -LSE / scale and
  -delta, so that no row vector stays live beside them), P^T = exp2((S^T * scale - LSE) log2 e)
  and dS^T = P^T (dP^T - delta), then dV_w += P^T dO and dK_w += dS^T Q with P^T and dS^T as
  register operands. dS^T also goes to shared memory (two buffers). During the next step,
  once both warpgroups have written theirs (an mbarrier), each computes its half of the step's
  dQ = dS K (64-row steps: half of dQ's columns; 128-row steps: half of its rows) (issued before
  dK's wgmma, so it is stored while dK runs), and puts it in one of two staging buffers; a
  warpgroup never waits for the other's dS^T of the step it is on. A warpgroup arrives on a
  step's dS^T barrier only once its last dQ (of the step before, or of the previous tile) has
  read the other buffer, so that barrier also frees the buffer for the step after. At a key
  tile's end the warpgroups store dK and dV: by TMA through the (then free) staging buffers, or
  from registers on causal walks (`bwd`);
- a 1-warp **reducer** adds each step's two halves into the float32 dQ buffer with TMA reductions
  and frees the staging buffer once they have read it (while the warpgroups fill the other one);
- a small Triton kernel first computes delta = rowsum(dO * O) - dLSE and LSE / scale, stored negated
  (the accumulators' starts) and padded to whole steps (so every step's TMA load of them is in bounds); another one last casts
  dQ = scale * buffer.

The persistent CTAs take the key tiles of a few (batch, kv head)s at a time (`_heads_per_group`),
so the dQ rows they add into stay in L2; causal calls deal each CTA a long and a short key tile of
the same head in turn (`_key_tile`), so a static schedule stays balanced.

The walk is the portable dK/dV kernel's: the column list of the key tile's block (dense: every
q tile), rows that see none of the tile (causal) skipped, the causal mask applied only in the band
the diagonal crosses, keys at or past kv_end (key_lengths) masked in the one tile that holds
kv_end, and a tile wholly past kv_end writing zeros. Rows whose LSE is +inf (no key) give P = 0.

By default (MODE "auto") it runs the walks without block lists (dense, causal and key_lengths
calls, faster there than the portable backward) and block-sparse walks whose column lists are long
(`LIST_MIN_BLOCKS`); shorter lists keep the portable backward, faster there (the measurements behind
the rule: experiments/studies/hopper/README.md and experiments/studies/sparse_bwd/).
Scope: as the forward's (`hopper.unsupported`), plus a dO layout TMA takes. dQ's float32 sums
arrive in whatever order the CTAs finish, so dQ is not bitwise reproducible from run to run (its
error bound is the same); dK and dV are. Under torch.use_deterministic_algorithms(True) the
portable backward runs instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparseflash.flash.hopper import forward as hopper
from sparseflash.flash.hopper.common import GLUON_ERROR, LOG2E, TILE, descriptor, make_descriptor, sm_count
from sparseflash import _env
from sparseflash.flash import binding
from sparseflash.flash.operands import cdiv

__all__ = ["bwd", "plan", "unsupported", "do_unsupported", "do_layout", "list_min_blocks", "q_step", "padded_rows",
           "delta_rows", "delta_kernel", "dq_cast_kernel", "dq_order", "CAST_ROWS", "MODE", "OVERRIDES", "OVERRIDE_KEYS",
           "LIST_MIN_BLOCKS", "LIST_MIN_BLOCKS_BY_GPU"]

# "auto" (the default): this kernel wherever the Hopper forward runs and dO's layout allows, for walks
# without block lists (dense, causal, key_lengths) and block lists of at least LIST_MIN_BLOCKS blocks a
# column; shorter lists keep the portable backward, faster there (experiments/studies/hopper/README.md,
# stages 5 and 7). "on": every block-sparse call too. "off":
# the portable backward everywhere. SPARSEFLASH_HOPPER_BWD sets it; SPARSEFLASH_HOPPER=off turns both
# Hopper kernels off.
MODE = _env.text("SPARSEFLASH_HOPPER_BWD", "auto")

# MODE "auto" runs block-sparse walks here only when a key tile's column list holds at least this
# many 128-row q blocks on average: below, the kernel's fixed costs (the float32 dQ buffer zeroed and
# cast, each tile's K/V load and dK/dV stores) outweigh its faster steps (the crossover against the
# portable backward, measured on random masks at 16K: experiments/studies/hopper/README.md, the
# column-list threshold). GPUs whose crossover was measured have their own value (`list_min_blocks`):
# on an H200, since dK/dV are stored by TMA, this kernel wins from 4 blocks a column (random masks
# d 64 and 128, causal windows, 4K and 16K) and the portable pair at 2-3
# (experiments/studies/hopper_bwd_fa4/results/threshold/ and sparse_default/). The default stays
# at the older, slower kernel's crossover until an H100 measures the current one.
LIST_MIN_BLOCKS = 16.0
LIST_MIN_BLOCKS_BY_GPU = {"H200": 4.0}
# A CTA's key tile is TILE = 128 keys, 64 per consumer warpgroup; each step of its walk takes the
# next q tile of `q_step` rows.
# (Measurement variants of this kernel, without the dQ path, the walk's rotation or head groups,
# live in the study copy experiments/studies/sparse_bwd/bwd_variants.py.)
CONSUMER_REGS = 240
LOADER_REGS = 24


def q_step(head_dim: int) -> int:
    """Q rows per step of a key tile's walk. d=128: 64 (S^T and dP^T of [64 keys, 64 queries] a
    warpgroup beside dK and dV of [64, 128] fill its 240 registers), each warpgroup computing dQ's
    columns of its half of d. d=64: 128, so that S^T and dP^T are [64, 128] wgmmas and each
    warpgroup computes dQ for its half of the rows with all 64 columns ([64, 64], where 64-row
    steps gave [64, 32] products): half the steps, so half the barriers, LSE / delta loads and dQ
    reductions per key tile."""
    return OVERRIDES.get("q_step", {}).get(head_dim) or (128 if head_dim <= 64 else 64)


# Launch settings a study can override (experiments/studies/hopper_bwd_fa4): "q_step", a dict
# {head_dim: 64 or 128}; "dkdv_tma": True / False, dK and dV stored by TMA or from registers
# (default True where their layouts take descriptors); "causal_split": True / False, a causal walk in
# two loops, its diagonal's steps first (masked) then the rest (no mask code), or one loop testing
# each step (default True); "grid_all": True, one CTA a unit of work (a key tile, a causal pair of them)
# instead of a persistent grid of one CTA an SM, as FlashAttention-4 launches its backward (the head
# groups kept as the persistent grid would run them; default False); "dp_zero": True, dP^T starts at zero
# and -delta is added after its wgmma (default False: it starts at -delta; see `_bwd_consumer`). Empty in
# normal use.
OVERRIDES: dict = {}
OVERRIDE_KEYS = ("q_step", "dkdv_tma", "causal_split", "grid_all", "dp_zero")


def dq_order(n: int) -> tuple:
    """How the float32 dQ sums hold one warpgroup's [64, n] share of a step (n = 32, 64 or 128 columns),
    and how it is staged in shared memory: bit i of an element's offset in the share's 64 * n floats
    is coordinate (row, column) ``dq_order(n)[i]``. This is the order of the wgmma accumulator that
    computes it: a thread's registers (columns c and c + 1 of rows r and r + 8) are 4 consecutive floats,
    then the warpgroup's 128 threads (lane bits: columns 2 and 4, rows 1, 2 and 4; warps: rows 16 and
    32), then the accumulator's column groups of 8. Each thread stores 16 contiguous bytes and a warp
    512 (no bank conflicts; in row order, through TMA's swizzle, every store was a 2-way conflict), the
    reducer adds the share with one flat TMA reduction, and the cast kernel puts the rows back in
    order (`_dq_offset`, this map's inverse)."""
    if n not in (32, 64, 128):
        raise ValueError(f"n must be 32, 64 or 128 columns, got {n!r}")
    return _DQ_ORDER[:n.bit_length() + 5]


# `dq_order` of 128 columns (fewer columns: its first 9 + log2(n / 8) entries)
_DQ_ORDER = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0), (0, 8), (0, 16), (0, 32), (0, 64))


def _stages(head_dim: int) -> int:
    """Q/dO ring depth. Shared memory, d=128 (64-row steps): K, V 64 KB + 2 x (Q + dO) 64 KB + dS 32 KB
    + dQ staging 2 x 32 KB = 224 KB of the 227 KB an sm_90 CTA may have (so a third staging buffer
    does not fit). d=64 (128-row steps): K, V 32 KB + 2 x (Q + dO) 64 KB + dS 2 x 32 KB + dQ staging
    2 x 32 KB = 224 KB."""
    return 2


if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from sparseflash.flash.hopper.common import (bnhd, list_layout, list_start, tile_coord, tma_load, tma_store,
                                                  wgmma_layout)
    from triton.experimental.gluon.language._core import builtin as _gl_builtin, _unwrap_if_constexpr

    @_gl_builtin
    def _reinterpret(buf, dtype, shape, layout, _semantic=None):
        # shared memory seen as another dtype / shape / layout (triton 3.9 names the method
        # reinterpret, 3.6 _reinterpret; both call this)
        return _semantic.memdesc_reinterpret(buf, _unwrap_if_constexpr(dtype),
                                             [_unwrap_if_constexpr(x) for x in shape], _unwrap_if_constexpr(layout))

    if hasattr(tma, "async_atomic_add"):
        _tma_add = tma.async_atomic_add
    else:  # triton 3.6's gluon has the op in its builder but no wrapper
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    _TILE = gl.constexpr(TILE)
    _DQ_BUFS = gl.constexpr(2)  # dQ staging buffers: the reducer reads one while the warpgroups fill the other
    _HALF = gl.constexpr(TILE // 2)
    _ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # a step's LSE or delta

    @gluon.constexpr_function
    def _ds_layout(dtype, qt):
        # dS^T [128 keys, QT queries]: written from registers, read transposed as wgmma's A
        return gl.NVMMASharedLayout.get_default_for([TILE, getattr(qt, "value", qt)], getattr(dtype, "value", dtype))

    @gluon.constexpr_function
    def _dq_smem_layout(n):
        # one warpgroup's dQ share [64, n] float32 as it is staged for the reducer: in the order its
        # wgmma accumulator holds it (`dq_order`), so each thread's stores are 16 contiguous bytes and a
        # warp's are 512 (no bank conflicts; in row order, with TMA's swizzle, every store was 2-way)
        return gl.SharedLinearLayout([list(b) for b in _DQ_ORDER[:getattr(n, "value", n).bit_length() + 5]])

    _DQ_FLAT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # the reducer's view of it

    @gluon.jit
    def _key_tile(rr, n_tiles, n_bhk, gh, n_heads_kv, PAIR: gl.constexpr):
        """This CTA's key tile in round ``rr``: (tile index, batch, kv head, first key); the index is
        n_tiles when the CTA has none this round.

        The stream runs through the (batch, kv head)s in groups of ``gh`` (`_heads_per_group`), so
        the float32 dQ rows the CTAs add into stay in L2. Without PAIR, round r deals the next G
        tiles of the stream (G CTAs) in a snake (CTA 0..G-1 when r is even, G-1..0 when odd). With
        PAIR (causal: a tile's walk is longer the earlier its keys), a CTA takes key tile m of a head
        in round 2r and tile n_kt - 1 - m of the same head in round 2r + 1, so every CTA's pair of
        rounds costs about the same (a static schedule, balanced in any order of the pairs)."""
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        n_kt = n_tiles // n_bhk
        if PAIR:
            n_per = (n_kt + 1) // 2  # pairs per head
            u = (rr // 2) * G + pid
        else:
            n_per = n_kt
            u = rr * G + gl.where(rr % 2 == 0, pid, G - 1 - pid)
        g = u // (gh * n_per)
        heads = gl.maximum(gl.minimum(gh, n_bhk - g * gh), 1)  # (the last group may have fewer)
        r = u - g * gh * n_per
        bhk = g * gh + r % heads
        m = r // heads
        if PAIR:
            n = gl.where(rr % 2 == 1, n_kt - 1 - m, m)
            valid = (u < n_bhk * n_per) & ((rr % 2 == 0) | (n != m))  # (an odd n_kt's middle tile: once)
        else:
            n = m
            valid = u < n_tiles
        t = gl.where(valid, bhk * n_kt + n, n_tiles)
        return t, bhk // n_heads_kv, bhk % n_heads_kv, n * _TILE

    @gluon.jit
    def _col_list(Q_IDX, b, h, start_n, stride_ib, stride_ih, stride_in, MASK_BK: gl.constexpr, DENSE: gl.constexpr):
        """Pointer to the column list of one head's key tile (block lists); None when dense."""
        p_list = Q_IDX
        if not DENSE:
            p_list = (Q_IDX + b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih
                      + (start_n // MASK_BK).to(gl.int64) * stride_in)
        return p_list

    @gluon.jit
    def _cols(p_list, start_n, kv_end, seq_q, seq_k, n_qblocks, MASK_BQ: gl.constexpr, NB_P2: gl.constexpr,
              DENSE: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr, QT: gl.constexpr):
        """The q tiles (of QT rows) one head's walk over a key tile visits (``p_list``: its column
        list, `_col_list`; None when dense): (first step, end of the causal band, end), in that
        order. Steps j < j_skip see none of the tile's keys (causal), j < j_part cross the diagonal; a
        tile wholly past kv_end has an empty walk (j_skip = j_part = j_end)."""
        causal_off = seq_k - seq_q
        skip_below = 0
        full_from = 0
        if CAUSAL:
            skip_below = start_n - causal_off  # rows below see no key of the tile
            full_from = start_n + _TILE - 1 - causal_off  # rows from here on see them all
        if DENSE:
            n_rows = (seq_q + QT - 1) // QT
            j_skip = gl.minimum(gl.maximum(skip_below, 0) // QT, n_rows)
            j_part = gl.minimum((gl.maximum(full_from, 0) + QT - 1) // QT, n_rows)
            j_end = n_rows
        else:
            SUB: gl.constexpr = MASK_BQ // QT
            offs = gl.arange(0, NB_P2, layout=list_layout(NB_P2, WARPS))
            blocks = gl.load(p_list + offs, mask=offs < n_qblocks, other=1 << 30)
            n_skip = gl.sum((blocks < skip_below // MASK_BQ).to(gl.int32), axis=0)
            n_part = gl.sum((blocks < (full_from + MASK_BQ - 1) // MASK_BQ).to(gl.int32), axis=0)
            n = gl.sum((blocks < n_qblocks).to(gl.int32), axis=0)
            j_skip = n_skip * SUB
            j_part = gl.maximum(n_part, n_skip) * SUB
            j_end = n * SUB
        if start_n >= kv_end:
            j_end = j_skip
        # j_skip <= j_part <= j_end: a causal walk in two loops (CAUSAL_SPLIT) runs j_part - j_skip steps
        # and then j_end - j_part, which must add up to the loader's and the reducer's j_end - j_skip,
        # also for a tile wholly past kv_end (an empty walk, whose band end would otherwise stay put)
        j_end = gl.maximum(j_end, j_skip)
        return j_skip, gl.minimum(gl.maximum(j_part, j_skip), j_end), j_end

    @gluon.jit
    def _step(p_list, jj, j_skip, j_end, start_n, DENSE: gl.constexpr, MASK_BQ: gl.constexpr, QT: gl.constexpr,
              BAND_FIRST: gl.constexpr):
        """(j, first query row) of the jj-th step of a walk over j_skip .. j_end - 1. Each key
        tile's walk starts at a different q tile (tile n at step 2n, wrapping), so CTAs on the
        same head do not reduce into the same dQ rows at the same time. BAND_FIRST (causal): in
        order from j_skip, so the diagonal's steps come first (the walks of a head's key tiles
        start at their own diagonals, apart without the rotation)."""
        if BAND_FIRST:
            j = j_skip + jj
        else:
            n_steps = j_end - j_skip
            j = jj + ((start_n // QT) % gl.maximum(n_steps, 1))
            j = j_skip + gl.where(j >= n_steps, j - n_steps, j)
        return j, list_start(p_list, j, DENSE, MASK_BQ, QT)

    @gluon.jit
    def _kv_end(KEY_LEN, b, seq_k, HAS_KEYLEN: gl.constexpr):
        kv_end = seq_k
        if HAS_KEYLEN:
            kv_end = gl.minimum(gl.maximum(gl.load(KEY_LEN + b).to(gl.int32), 0), seq_k)
        return kv_end

    @gluon.jit
    def _fill2(desc, coord, buf, desc_row, coord_row, buf_row, ready):
        """TMA-load a tile and its rows' [1, QT] float32 vector (LSE or delta), on one barrier."""
        mbarrier.expect(ready, desc.block_type.nbytes + desc_row.block_type.nbytes)
        tma_load(desc, coord, ready, buf)
        tma_load(desc_row, coord_row, ready, buf_row)

    @gluon.jit
    def _bwd_loader(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_dlt, q_bufs, do_bufs, lse_bufs, dlt_bufs, k_buf,
                    v_buf, kv_ready, kv_empty, q_ready, do_ready, step_empty, Q_IDX, KEY_LEN, n_tiles, n_rounds, n_bhk, gh,
                    n_heads_kv, group, seq_q, seq_k, n_qblocks,
                    stride_ib, stride_ih, stride_in,
                    MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr, NB_P2: gl.constexpr, DENSE: gl.constexpr,
                    CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr, STAGES: gl.constexpr,
                    Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, DO_BNHD: gl.constexpr, QT: gl.constexpr,
                    CAUSAL_SPLIT: gl.constexpr):
        """1 warp: K and V of each tile (once the consumers release the last tile's), then Q with its
        rows' LSE and dO with their delta for every step, in walk order; barrier phases run over the
        CTA's whole tile stream."""
        it = 0  # steps issued so far: ring slot and phase
        n_done = 0  # tiles started: the K/V phase
        for rr in range(0, n_rounds):
            t, b, hk, start_n = _key_tile(rr, n_tiles, n_bhk, gh, n_heads_kv, CAUSAL)
            if t < n_tiles:
                kv_end = _kv_end(KEY_LEN, b, seq_k, HAS_KEYLEN)
                # (a fresh barrier passes a parity-1 wait at once; K and V share one barrier pair)
                mbarrier.wait(kv_empty, (n_done & 1) ^ 1)
                mbarrier.expect(kv_ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
                tma_load(desc_k, tile_coord(b, hk, start_n, KV_BNHD), kv_ready, k_buf)
                tma_load(desc_v, tile_coord(b, hk, start_n, KV_BNHD), kv_ready, v_buf)
                for g in range(group):
                    h = hk * group + g
                    p_list = _col_list(Q_IDX, b, h, start_n, stride_ib, stride_ih, stride_in, MASK_BK, DENSE)
                    j_skip, j_part, j_end = _cols(p_list, start_n, kv_end, seq_q, seq_k, n_qblocks, MASK_BQ, NB_P2, DENSE,
                                                  CAUSAL, 1, QT)
                    for jj in range(0, j_end - j_skip):
                        j, start_m = _step(p_list, jj, j_skip, j_end, start_n, DENSE, MASK_BQ, QT, CAUSAL_SPLIT)
                        s = it % STAGES
                        ph = (it // STAGES) & 1
                        bh = b * (n_heads_kv * group) + h
                        mbarrier.wait(step_empty.index(s), ph ^ 1)  # both warpgroups are done with the slot
                        _fill2(desc_q, tile_coord(b, h, start_m, Q_BNHD), q_bufs.index(s), desc_lse, [bh, start_m],
                               lse_bufs.index(s), q_ready.index(s))
                        _fill2(desc_do, tile_coord(b, h, start_m, DO_BNHD), do_bufs.index(s), desc_dlt, [bh, start_m],
                               dlt_bufs.index(s), do_ready.index(s))
                        it += 1
                n_done += 1

    @gluon.jit
    def _bwd_reducer(desc_dq, dq_bufs, dq_full, dq_empty, Q_IDX, KEY_LEN, n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group, seq_q,
                     seq_k, n_qblocks, n_pad, stride_ib, stride_ih, stride_in,
                     MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr, NB_P2: gl.constexpr, DENSE: gl.constexpr,
                     CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr, QT: gl.constexpr, DQ_M: gl.constexpr,
                     DQ_N: gl.constexpr, DKDV_TMA: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL_SPLIT: gl.constexpr):
        """1 warp: once both warpgroups have put a step's dQ halves in shared memory (dq_full), add
        them into the float32 dQ buffer with TMA reductions, and hand a buffer back (dq_empty) once
        its reductions have read it: with two buffers, one step later (after the next step's
        reductions are issued). The walk is the loader's. A warpgroup's half is [DQ_M, DQ_N]: the
        step's rows and half its columns (DQ_M = QT), or half its rows and every column. The sums hold
        such shares whole, in `dq_order`, n_pad rows a head: each half is one box of the flat
        [*, DQ_N] view `desc_dq` reduces into. DKDV_TMA: a
        tile's last step's buffer is handed back at the tile's end (once its reductions have read
        it), not at the next step, so the consumers can stage the tile's dK and dV in both buffers."""
        N_CB: gl.constexpr = HEAD_DIM // DQ_N  # shares across dQ's columns
        # where half 1 lies past half 0 (in rows of the view): the next rows' share (128-row steps) or
        # the next columns'
        HALF1: gl.constexpr = (N_CB if DQ_M < QT else 1) * DQ_M
        n_mt = n_pad // DQ_M
        it = 0
        rel = 0  # steps before this one have had their buffer handed back
        for rr in range(0, n_rounds):
            t, b, hk, start_n = _key_tile(rr, n_tiles, n_bhk, gh, n_heads_kv, CAUSAL)
            if t < n_tiles:
                kv_end = _kv_end(KEY_LEN, b, seq_k, HAS_KEYLEN)
                for g in range(group):
                    h = hk * group + g
                    p_list = _col_list(Q_IDX, b, h, start_n, stride_ib, stride_ih, stride_in, MASK_BK, DENSE)
                    j_skip, j_part, j_end = _cols(p_list, start_n, kv_end, seq_q, seq_k, n_qblocks, MASK_BQ, NB_P2, DENSE,
                                                  CAUSAL, 1, QT)
                    for jj in range(0, j_end - j_skip):
                        j, start_m = _step(p_list, jj, j_skip, j_end, start_n, DENSE, MASK_BQ, QT, CAUSAL_SPLIT)
                        bi = it % _DQ_BUFS
                        mbarrier.wait(dq_full.index(bi), (it // _DQ_BUFS) & 1)
                        r0 = ((b * (n_heads_kv * group) + h) * n_mt + start_m // DQ_M) * (N_CB * DQ_M)
                        _tma_add(desc_dq, [r0, 0], dq_bufs.index(2 * bi))
                        _tma_add(desc_dq, [r0 + HALF1, 0], dq_bufs.index(2 * bi + 1))
                        if it > rel:
                            tma.store_wait(2)  # the last step's two reductions have read their halves
                            mbarrier.arrive(dq_empty.index((it - 1) % _DQ_BUFS))
                        if DKDV_TMA:
                            rel = it
                        it += 1
                if DKDV_TMA:
                    if it > rel:  # the tile's last step: its reductions have read, its buffer is free
                        tma.store_wait(0)
                        mbarrier.arrive(dq_empty.index((it - 1) % _DQ_BUFS))
                        rel = it
        tma.store_wait(0)  # (the CTA's shared memory must outlive the last reductions' reads)

    @gluon.jit
    def _exact_keep_t(BITS, tb, kw0, queries, s_layout: gl.constexpr, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr):
        """Which pairs of a [64 keys, QT queries] P^T tile bit tile ``tb`` attends: keys from
        ``kw0`` * 32 on (counted from the mask block's corner; the warpgroup's 64 keys are 2 words
        of each query's row, `mask.ExactBits`), queries ``queries`` (absolute). The two words of
        each query are loaded as two column vectors and spread over the keys in registers (a
        pointer per element would cost 64 registers a thread). Loading them ahead of the step's
        scores, or from tiles stored transposed (4 loads a thread instead of 32), measured no
        faster overall on an H200 (experiments/studies/exact-bits-cost/)."""
        W: gl.constexpr = (MASK_BK + 31) // 32
        p = BITS + tb.to(gl.int64) * (MASK_BQ * W) + (queries % MASK_BQ) * W + kw0  # [QT] column pointers
        w0 = gl.expand_dims(gl.load(p), 0)
        w1 = gl.expand_dims(gl.load(p + 1), 0)
        i = gl.expand_dims(gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout)), 1)
        w = gl.where(i < 32, w0, w1)
        return ((w >> (i % 32)) & 1) != 0

    @gluon.jit
    def _seen(keys, cols, causal_off):
        """[64 keys, QT queries]: which keys each query sees under the causal mask (bottom-right)."""
        return gl.expand_dims(keys, 1) <= gl.expand_dims(cols + causal_off, 0)

    @gluon.jit
    def _dq_stage(dq, dq_bufs, dq_empty, p, WG: gl.constexpr, DQ_M: gl.constexpr, DQ_N: gl.constexpr,
                  DKDV_TMA: gl.constexpr):
        """Put this warpgroup's half of step p's dQ ([DQ_M, DQ_N] float32) in its staging buffer,
        once the reducer has read that buffer's last halves (DKDV_TMA: and this warpgroup's dK / dV
        stores from the buffers have read them). `_dq_publish` then tells the reducer."""
        bi = p % _DQ_BUFS
        mbarrier.wait(dq_empty.index(bi), ((p // _DQ_BUFS) & 1) ^ 1)
        if DKDV_TMA:
            tma.store_wait(0)
        _reinterpret(dq_bufs.index(2 * bi + WG), gl.float32, [DQ_M, DQ_N], _dq_smem_layout(DQ_N)).store(dq)

    @gluon.jit
    def _dq_publish(dq_full, p):
        """Step p's staged dQ half is the reducer's: the stores made visible to TMA, then its barrier."""
        fence_async_shared()
        mbarrier.arrive(dq_full.index(p % _DQ_BUFS))

    @gluon.jit
    def _ds_rows(ds_buf, WG: gl.constexpr, QT: gl.constexpr, DQ_N: gl.constexpr, HEAD_DIM: gl.constexpr):
        """A of this warpgroup's dQ product, dS [64 queries, 128 keys], from a dS^T buffer [128 keys,
        QT queries]: every query of a 64-row step (each warpgroup then takes half of the columns),
        or the warpgroup's half of a 128-row step's queries (and every column)."""
        if DQ_N < HEAD_DIM:
            return ds_buf.permute((1, 0))
        else:
            return ds_buf.slice(WG * _HALF, _HALF, dim=1).permute((1, 0))

    @gluon.jit
    def _bwd_consumer(q_bufs, do_bufs, lse_bufs, dlt_bufs, k_buf, v_buf, ds_bufs, dq_bufs, kv_ready, kv_empty, q_ready, do_ready,
                      step_empty, ds_ready, dq_full, dq_empty, DK, DV, desc_dk, desc_dv, Q_IDX, Q_TILE, BITS, KEY_LEN,
                      n_tiles, n_rounds,
                      n_bhk, gh, n_heads_kv,
                      group, seq_q, seq_k, n_qblocks, stride_ib, stride_ih, stride_in, stride_dkb, stride_dkh,
                      stride_dkn, stride_dvb, stride_dvh, stride_dvn, qk_scale, sm_scale,
                      WG: gl.constexpr, HEAD_DIM: gl.constexpr, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr,
                      NB_P2: gl.constexpr, DENSE: gl.constexpr, CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr,
                      STAGES: gl.constexpr, EXACT: gl.constexpr, QT: gl.constexpr, DQ_N: gl.constexpr,
                      DKDV_TMA: gl.constexpr, DK_BNHD: gl.constexpr, DV_BNHD: gl.constexpr,
                      CAUSAL_SPLIT: gl.constexpr, DP_ZERO: gl.constexpr):
        """One consumer warpgroup: keys WG*64 .. WG*64+63 of each tile; of each step's dQ, the
        columns of half WG (64-row steps) or the rows of half WG (128-row steps; DQ_N columns
        either way). Step j's dQ is computed during step j + 1 (and the tile's last after its
        walk), so a warpgroup never waits for the other's dS^T of the step it is on. EXACT: a step
        in a partial block zeroes P^T (and so dS^T) where its bit tile (Q_TILE, laid out as the
        column lists) is 0. DKDV_TMA: a tile's dK and dV go out through the dQ staging buffers
        with TMA stores (else from registers). DP_ZERO (a study's): dP^T starts at zero and -delta is
        added after its wgmma (not the accumulator's start: see the step)."""
        s_layout: gl.constexpr = wgmma_layout(QT)  # S^T, dP^T: [64 keys, QT queries] fp32
        a_layout: gl.constexpr = wgmma_layout(HEAD_DIM)  # dK, dV: [64 keys, HEAD_DIM] fp32
        q_layout: gl.constexpr = wgmma_layout(DQ_N)  # this warpgroup's dQ: [64, DQ_N] fp32
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = k_buf.dtype
        causal_off = seq_k - seq_q
        zero_s = gl.zeros([_HALF, QT], gl.float32, layout=s_layout)
        zero_q = gl.zeros([_HALF, DQ_N], gl.float32, layout=q_layout)
        k_all = k_buf.reshape([_TILE, HEAD_DIM])
        k_w = k_all.slice(WG * _HALF, _HALF, dim=0)
        v_w = v_buf.reshape([_TILE, HEAD_DIM]).slice(WG * _HALF, _HALF, dim=0)
        k_half = k_all.slice(WG * DQ_N if DQ_N < HEAD_DIM else 0, DQ_N, dim=1)  # [128 keys, DQ_N]: B of this dQ
        r_s = WG * _HALF + gl.arange(0, _HALF, layout=row_s)
        r_a = WG * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(1, a_layout))
        c_a = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, a_layout))
        it = 0  # steps so far: ring slot and phase, dS buffer and phase
        n_done = 0
        for rr in range(0, n_rounds):
            t, b, hk, start_n = _key_tile(rr, n_tiles, n_bhk, gh, n_heads_kv, CAUSAL)
            if t < n_tiles:
                kv_end = _kv_end(KEY_LEN, b, seq_k, HAS_KEYLEN)
                keys = start_n + r_s
                key_mask = start_n + _TILE > kv_end  # the tile holding kv_end masks the keys past it
                dk = gl.zeros([_HALF, HEAD_DIM], gl.float32, layout=a_layout)
                dv = gl.zeros([_HALF, HEAD_DIM], gl.float32, layout=a_layout)
                it0 = it  # (the tile's first step has no previous dQ to compute)
                mbarrier.wait(kv_ready, n_done & 1)
                for g in range(group):
                    h = hk * group + g
                    p_list = _col_list(Q_IDX, b, h, start_n, stride_ib, stride_ih, stride_in, MASK_BK, DENSE)
                    j_skip, j_part, j_end = _cols(p_list, start_n, kv_end, seq_q, seq_k, n_qblocks, MASK_BQ, NB_P2, DENSE,
                                                  CAUSAL, 4, QT)
                    p_tile = Q_TILE
                    if EXACT:
                        p_tile = (Q_TILE + b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih
                                  + (start_n // MASK_BK).to(gl.int64) * stride_in)
                    # CAUSAL_SPLIT: the walk in two loops, the diagonal's steps (masked) then the rest (no
                    # mask code at all); else one loop that tests each step (j < j_part)
                    N_LOOPS: gl.constexpr = 2 if CAUSAL_SPLIT else 1
                    for band in gl.static_range(N_LOOPS):
                        lo = 0
                        hi = j_end - j_skip
                        if CAUSAL_SPLIT:
                            if band == 0:
                                hi = j_part - j_skip
                            else:
                                lo = j_part - j_skip
                        for jj in range(lo, hi):
                            j, start_m = _step(p_list, jj, j_skip, j_end, start_n, DENSE, MASK_BQ, QT, CAUSAL_SPLIT)
                            s = it % STAGES
                            ph = (it // STAGES) & 1
                            q_s = q_bufs.index(s).reshape([QT, HEAD_DIM])
                            do_s = do_bufs.index(s).reshape([QT, HEAD_DIM])
                            mbarrier.wait(q_ready.index(s), ph)
                            # The accumulators start at -LSE / scale and -delta ([1, QT] rows of the step's
                            # queries, padded, stored negated: `delta_kernel`), so S^T - LSE / scale and dP^T -
                            # delta come out of the wgmmas: neither row vector stays live beside them, and the
                            # start is a broadcast (negating it here cost 32 FADDs a step before each issue).
                            # (Starting them at zero and adding -LSE log2(e) in the exponent's FMA and -delta
                            # in dS^T saves these starts' register copies, 2 a score, but was 1.6-3.7% slower
                            # at d=128 and on causal d=64 walks: more registers live, more spills;
                            # experiments/studies/hopper_bwd_fa4/, session 6. Loading the next step's starts at the
                            # end of the step before was 0.6-6.7% slower: session 7.)
                            st = warpgroup_mma(k_w, q_s.permute((1, 0)),
                                               gl.broadcast(zero_s, lse_bufs.index(s).load(s_layout))[1], is_async=True)
                            mbarrier.wait(do_ready.index(s), ph)
                            # (DP_ZERO: triton 3.6's ptxas injects a warpgroup wait between the S^T and the
                            # dP^T wgmmas of one of the two consumer warpgroups when dP^T starts at -delta
                            # (C7517 in every backward build), so that warpgroup runs them one after the
                            # other; started at zero, it does not)
                            if DP_ZERO:
                                dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                            else:
                                dpt = warpgroup_mma(v_w, do_s.permute((1, 0)),
                                                    gl.broadcast(zero_s, dlt_bufs.index(s).load(s_layout))[1],
                                                    is_async=True)
                            cols = start_m + gl.arange(0, QT, layout=col_s)
                            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, k_w, q_s))[0]
                            pt = gl.exp2(st * qk_scale)  # exp2((S^T * scale - LSE) * log2(e))
                            if key_mask:
                                pt = gl.where(gl.expand_dims(keys < kv_end, 1), pt, 0.0)
                            if CAUSAL:
                                if CAUSAL_SPLIT:
                                    if band == 0:
                                        pt = gl.where(_seen(keys, cols, causal_off), pt, 0.0)
                                elif j < j_part:
                                    pt = gl.where(_seen(keys, cols, causal_off), pt, 0.0)
                            if EXACT:
                                SUB: gl.constexpr = MASK_BQ // QT
                                tb = gl.load(p_tile + j // SUB)
                                if tb >= 0:
                                    kw0 = (start_n % MASK_BK + WG * _HALF) // 32
                                    keep_t = _exact_keep_t(BITS, tb, kw0, cols, s_layout, MASK_BQ, MASK_BK)
                                    pt = gl.where(keep_t, pt, 0.0)
                            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, v_w, do_s))[0]
                            if DP_ZERO:
                                dpt = dpt + dlt_bufs.index(s).load(s_layout)  # (-delta, stored negated)
                            ds16 = (pt * dpt).to(dtype)
                            p_op = gl.convert_layout(pt.to(dtype), op_layout)
                            dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
                            # dS^T goes into buffer it % 2 once both warpgroups' dQ of two steps ago has read
                            # it: each warpgroup arrives on a step's ds_ready only after its last dQ (of the
                            # step before, or at a tile's first step the previous tile's last) has retired, so
                            # the other's arrival on the last step's says so.
                            if it > 0:
                                mbarrier.wait(ds_ready.index((it - 1) % 2), ((it - 1) // 2) & 1)
                            ds_bufs.index(it % 2).slice(WG * _HALF, _HALF, dim=0).store(ds16)
                            ds_op = gl.convert_layout(ds16, op_layout)
                            # dS^T, written by this warpgroup, is read by both warpgroups' wgmma once it
                            # arrives on ds_ready: fenced just before that arrive, after this step's wgmmas
                            # are issued, so the stores drain under them (a fence right after the stores
                            # waited for them: 1.4-3.2% slower backward, experiments/studies/hopper_bwd_fa4/)
                            # With a previous step in the tile, its dQ (both dS^T halves are in the other
                            # buffer) is issued before dK, so it is stored while dK runs. (Each branch ends
                            # with dK and dV waited: an scf.if yields tensors, not wgmma tokens.)
                            if it > it0:
                                ds_prev = _ds_rows(ds_bufs.index((it - 1) % 2), WG, QT, DQ_N, HEAD_DIM)
                                dq = warpgroup_mma(ds_prev, k_half, zero_q, use_acc=False, is_async=True)
                                dk_t = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                                r_vq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p_op, ds_bufs, k_half, do_s))
                                fence_async_shared()
                                mbarrier.arrive(ds_ready.index(it % 2))  # (after the dQ above has read its buffer)
                                # dQ's staging stores drain while dK finishes; then its fence finds them done
                                _dq_stage(r_vq[1], dq_bufs, dq_empty, it - 1, WG, _HALF, DQ_N, DKDV_TMA)
                                r_kv = warpgroup_mma_wait(num_outstanding=0, deps=(dk_t, r_vq[0], ds_op, q_s))
                                _dq_publish(dq_full, it - 1)
                                dk_w = r_kv[0]
                                dv_w = r_kv[1]
                            else:
                                fence_async_shared()
                                mbarrier.arrive(ds_ready.index(it % 2))
                                dk_t = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                                r_kv0 = warpgroup_mma_wait(num_outstanding=0, deps=(dk_t, dv, ds_op, p_op, q_s, do_s))
                                dk_w = r_kv0[0]
                                dv_w = r_kv0[1]
                            dk = dk_w
                            dv = dv_w
                            mbarrier.arrive(step_empty.index(s))
                            it += 1
                if it > it0:  # the tile's last dQ, before K goes
                    pb = (it - 1) % 2
                    mbarrier.wait(ds_ready.index(pb), ((it - 1) // 2) & 1)
                    dq = warpgroup_mma(_ds_rows(ds_bufs.index(pb), WG, QT, DQ_N, HEAD_DIM), k_half, zero_q,
                                       use_acc=False, is_async=True)
                    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_bufs, k_half))[0]
                    _dq_stage(dq, dq_bufs, dq_empty, it - 1, WG, _HALF, DQ_N, DKDV_TMA)
                    _dq_publish(dq_full, it - 1)
                mbarrier.arrive(kv_empty)  # the loader may bring the next tile's K and V
                # keys at or past kv_end take no part: their gradients are exactly zero
                keys_a = start_n + r_a
                keep = gl.expand_dims(keys_a < kv_end, 1)
                if DKDV_TMA:
                    # Both staging buffers are free once the reducer has handed back steps it - 2 and
                    # it - 1 (the tile's last, handed back at the tile's end): the waits `_dq_stage`
                    # would make for steps it and it + 1. Each warpgroup writes only its own halves,
                    # in both roles, so its own store_wait orders the reuse.
                    mbarrier.wait(dq_empty.index(it % _DQ_BUFS), ((it // _DQ_BUFS) & 1) ^ 1)
                    mbarrier.wait(dq_empty.index((it + 1) % _DQ_BUFS), (((it + 1) // _DQ_BUFS) & 1) ^ 1)
                    tma.store_wait(0)  # (a tile without steps: the last tile's stores have read them)
                    out = _reinterpret(dq_bufs, dtype, [2 * _DQ_BUFS] + desc_dk.block_type.shape, desc_dk.layout)
                    dk_s = out.index(WG)
                    dv_s = out.index(_DQ_BUFS + WG)
                    dk_s.reshape([_HALF, HEAD_DIM]).store(gl.where(keep, dk * sm_scale, 0.0).to(dtype))
                    dv_s.reshape([_HALF, HEAD_DIM]).store(gl.where(keep, dv, 0.0).to(dtype))
                    fence_async_shared()
                    # (TMA clips the rows past seq_k)
                    tma_store(desc_dk, tile_coord(b, hk, start_n + WG * _HALF, DK_BNHD), dk_s)
                    tma_store(desc_dv, tile_coord(b, hk, start_n + WG * _HALF, DV_BNHD), dv_s)
                else:
                    in_seq = gl.expand_dims(keys_a < seq_k, 1)
                    off_k = gl.expand_dims(keys_a.to(gl.int64), 1)
                    p_dk = (DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + off_k * stride_dkn
                            + gl.expand_dims(c_a, 0))
                    gl.store(p_dk, gl.where(keep, dk * sm_scale, 0.0).to(dtype), mask=in_seq)
                    p_dv = (DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + off_k * stride_dvn
                            + gl.expand_dims(c_a, 0))
                    gl.store(p_dv, gl.where(keep, dv, 0.0).to(dtype), mask=in_seq)
                n_done += 1
        if DKDV_TMA:
            tma.store_wait(0)  # (shared memory must outlive the last stores' reads)

    @gluon.jit
    def hopper_bwd_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, desc_lse, desc_dlt, DK, DV,
                           n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group, seq_q, seq_k, n_qblocks, n_pad, scales,
                           strides, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr, NB_P2: gl.constexpr,
                           CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           LOADER_REGS: gl.constexpr, SPLIT_BAND: gl.constexpr, DP_ZERO: gl.constexpr, Q_IDX=None,
                           Q_TILE=None, BITS=None, KEY_LEN=None, desc_dk=None, desc_dv=None):
        """Optional features are named pointers, None when off: Q_IDX, the column lists (None: dense);
        Q_TILE and BITS, the exact-mask bit tiles and their bits; KEY_LEN, key_lengths; desc_dk and
        desc_dv, dK and dV stored by TMA (None: from registers, through DK and DV with their strides).
        ``scales``: (qk_scale, sm_scale); ``strides``: the [B, H, column] strides of the column lists
        (and Q_TILE, laid out as they are), then DK's and DV's [B, H, N] strides, three tuples.
        The head dimension, the step and each tensor's memory order come from the descriptors."""
        qk_scale, sm_scale = scales
        idx_strides, dk_strides, dv_strides = strides  # (triton 3.6 takes no nested targets)
        stride_ib, stride_ih, stride_in = idx_strides
        stride_dkb, stride_dkh, stride_dkn = dk_strides
        stride_dvb, stride_dvh, stride_dvn = dv_strides
        DENSE: gl.constexpr = Q_IDX is None
        EXACT: gl.constexpr = BITS is not None
        HAS_KEYLEN: gl.constexpr = KEY_LEN is not None
        DKDV_TMA: gl.constexpr = desc_dk is not None
        HEAD_DIM: gl.constexpr = desc_q.block_type.shape[3]
        QT: gl.constexpr = desc_lse.block_type.shape[1]
        Q_BNHD: gl.constexpr = bnhd(desc_q)
        KV_BNHD: gl.constexpr = bnhd(desc_k)
        DO_BNHD: gl.constexpr = bnhd(desc_do)
        DK_BNHD: gl.constexpr = bnhd(desc_dk)
        DV_BNHD: gl.constexpr = bnhd(desc_dv)
        CAUSAL_SPLIT: gl.constexpr = CAUSAL and SPLIT_BAND
        dtype: gl.constexpr = desc_q.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_lse.block_type.shape, desc_lse.layout)
        dlt_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_dlt.block_type.shape, desc_dlt.layout)
        k_buf = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
        v_buf = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, _TILE, QT], _ds_layout(dtype, QT))
        DQ_N: gl.constexpr = desc_dq.block_type.shape[1]  # a warpgroup's dQ columns (`_dq_box`)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * _DQ_BUFS] + desc_dq.block_type.shape, desc_dq.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        step_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [_DQ_BUFS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [_DQ_BUFS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_DQ_BUFS):
            mbarrier.init(dq_full.index(i), count=2)  # both warpgroups stored their half of a step's dQ
            mbarrier.init(dq_empty.index(i), count=1)
        mbarrier.init(kv_ready, count=1)
        mbarrier.init(kv_empty, count=2)  # both warpgroups are done with the tile's K and V
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups wrote their half of dS^T
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(step_empty.index(i), count=2)  # both warpgroups are done with a slot's Q and dO
            mbarrier.init(do_ready.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_bwd_consumer, (q_bufs, do_bufs, lse_bufs, dlt_bufs, k_buf, v_buf, ds_bufs, dq_bufs, kv_ready, kv_empty,
                             q_ready, do_ready, step_empty, ds_ready, dq_full, dq_empty, DK, DV, desc_dk, desc_dv,
                             Q_IDX, Q_TILE, BITS, KEY_LEN, n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group,
                             seq_q, seq_k, n_qblocks, stride_ib, stride_ih, stride_in, stride_dkb, stride_dkh,
                             stride_dkn, stride_dvb, stride_dvh, stride_dvn, qk_scale, sm_scale,
                             0, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES,
                             EXACT, QT, DQ_N, DKDV_TMA, DK_BNHD, DV_BNHD, CAUSAL_SPLIT, DP_ZERO)),
            (_bwd_consumer, (q_bufs, do_bufs, lse_bufs, dlt_bufs, k_buf, v_buf, ds_bufs, dq_bufs, kv_ready, kv_empty,
                             q_ready, do_ready, step_empty, ds_ready, dq_full, dq_empty, DK, DV, desc_dk, desc_dv,
                             Q_IDX, Q_TILE, BITS, KEY_LEN, n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group,
                             seq_q, seq_k, n_qblocks, stride_ib, stride_ih, stride_in, stride_dkb, stride_dkh,
                             stride_dkn, stride_dvb, stride_dvh, stride_dvn, qk_scale, sm_scale,
                             1, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES,
                             EXACT, QT, DQ_N, DKDV_TMA, DK_BNHD, DV_BNHD, CAUSAL_SPLIT, DP_ZERO)),
            (_bwd_loader, (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_dlt, q_bufs, do_bufs, lse_bufs, dlt_bufs,
                           k_buf, v_buf, kv_ready, kv_empty, q_ready, do_ready, step_empty, Q_IDX, KEY_LEN, n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group, seq_q, seq_k,
                           n_qblocks,
                           stride_ib, stride_ih, stride_in, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES,
                           Q_BNHD, KV_BNHD, DO_BNHD, QT, CAUSAL_SPLIT)),
            (_bwd_reducer, (desc_dq, dq_bufs, dq_full, dq_empty, Q_IDX, KEY_LEN, n_tiles, n_rounds, n_bhk, gh, n_heads_kv, group,
                            seq_q, seq_k, n_qblocks, n_pad, stride_ib, stride_ih, stride_in, MASK_BQ, MASK_BK, NB_P2,
                            DENSE, CAUSAL, HAS_KEYLEN, QT, _HALF, DQ_N, DKDV_TMA, HEAD_DIM, CAUSAL_SPLIT)),
        ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------- the two small kernels


@triton.jit
def _rows(n_heads, seq_q, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's (batch * head, batch, head, BLOCK row indices, head_dim indices, row mask)."""
    i_bh = tl.program_id(1)
    o_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return (i_bh, (i_bh // n_heads).to(tl.int64), (i_bh % n_heads).to(tl.int64), o_m, tl.arange(0, HEAD_DIM),
            (o_m < seq_q)[:, None])


@triton.jit
def delta_kernel(O, DO, LSE, LSE2, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                  n_heads, seq_q, n_pad, lse_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, DLSE=None, ACC=None):
    """For BLOCK rows of one (batch, head): the backward's accumulator starts DELTA = -(rowsum(dO * O)
    - dLSE) and LSE2 = -LSE * lse_scale, float32 [B * H, n_pad], rows seq_q .. n_pad - 1 padded with
    -0 and -inf (P = 0), so the backward's steps load them without masks and without negating them. ACC (optional): the float32 dQ sums (n_pad * HEAD_DIM
    contiguous floats a (batch, head), in any order), zeroed in the same launch, so the backward needs
    no fill launch of its own."""
    i_bh, i_b, i_h, o_m, o_d, m = _rows(n_heads, seq_q, BLOCK, HEAD_DIM)
    if ACC is not None:
        tl.store(ACC + (i_bh.to(tl.int64) * n_pad + o_m.to(tl.int64))[:, None] * HEAD_DIM + o_d[None, :],
                 tl.zeros([BLOCK, HEAD_DIM], tl.float32), mask=(o_m < n_pad)[:, None])
    b_o = tl.load(O + i_b * stride_ob + i_h * stride_oh + o_m.to(tl.int64)[:, None] * stride_om + o_d[None, :],
                  mask=m, other=0.0)
    b_do = tl.load(DO + i_b * stride_dob + i_h * stride_doh + o_m.to(tl.int64)[:, None] * stride_dom + o_d[None, :],
                   mask=m, other=0.0)
    delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    p_row = i_bh.to(tl.int64) * seq_q + o_m
    if DLSE is not None:  # (the LSE's own gradient, when the caller used it)
        delta -= tl.load(DLSE + p_row, mask=o_m < seq_q, other=0.0)
    lse2 = tl.load(LSE + p_row, mask=o_m < seq_q, other=float("inf")) * lse_scale
    p_pad = i_bh.to(tl.int64) * n_pad + o_m
    tl.store(DELTA + p_pad, -delta, mask=o_m < n_pad)
    tl.store(LSE2 + p_pad, -lse2, mask=o_m < n_pad)


@triton.jit
def _dq_offset(r, c):
    """Offset of element (r, c) in a [64, n] share of the dQ sums: the inverse of `dq_order`."""
    return (c & 1) | (((r >> 3) & 1) << 1) | (((c >> 1) & 3) << 2) | ((r & 7) << 4) | ((r >> 4) << 7) | ((c >> 3) << 9)


@triton.jit
def dq_cast_kernel(ACC, DQ, stride_qb, stride_qh, stride_qm, n_heads, seq_q, n_pad, scale,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, DQ_N: tl.constexpr):
    """dQ = scale * the float32 sums (n_pad rows a (batch, head), as [64, DQ_N] shares in `dq_order`,
    the shares of a row of 64 next to each other), cast to dQ's dtype, in dQ's layout."""
    i_bh, i_b, i_h, o_m, o_d, m = _rows(n_heads, seq_q, BLOCK, HEAD_DIM)
    r = o_m % 64
    share = (i_bh.to(tl.int64) * n_pad + (o_m - r).to(tl.int64))[:, None] * HEAD_DIM + (o_d // DQ_N * (64 * DQ_N))[None, :]
    acc = tl.load(ACC + share + _dq_offset(r[:, None], (o_d % DQ_N)[None, :]), mask=m)
    tl.store(DQ + i_b * stride_qb + i_h * stride_qh + o_m.to(tl.int64)[:, None] * stride_qm + o_d[None, :],
             (acc * scale).to(DQ.dtype.element_ty), mask=m)


def do_unsupported(do, q, o=None) -> str | None:
    """Why the backward cannot take this dO (and O), or None; raises on a bad `MODE`."""
    if MODE not in ("auto", "on", "off"):
        raise ValueError(f"hopper_bwd.MODE (SPARSEFLASH_HOPPER_BWD) must be 'auto', 'on' or 'off', got {MODE!r}")
    if MODE == "off":
        return "SPARSEFLASH_HOPPER_BWD=off"
    if torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms(True): dQ's TMA reductions add in arrival order"
    if do.dtype != q.dtype or do.shape != q.shape:
        return f"dO of dtype {do.dtype} and shape {tuple(do.shape)}"
    if o is not None and o.stride(-1) != 1:
        return "O rows not contiguous (the delta kernel reads rows)"
    if do_layout(do) is None:  # (also needs contiguous rows)
        return "a dO layout TMA descriptors cannot take"
    return None


def unsupported(do, q, k, v, o=None, *, mask_bq=None, mask_bk=None, dropout_p=0.0, seg=None) -> str | None:
    """Why this kernel cannot run a backward call, or None when it can: the forward's reasons
    (`hopper.unsupported`), then dO's and O's (`do_unsupported`)."""
    return (hopper.unsupported(q, k, v, mask_bq=mask_bq, mask_bk=mask_bk, dropout_p=dropout_p, seg=seg)
            or do_unsupported(do, q, o))


def plan(do, q, o, lay, cols: float | None = None, *, exact: bool = False):
    """(lay, dO's layout) when the backward runs a call whose forward runs the Hopper kernel with
    layouts ``lay``, else None. ``cols``: None for walks without block lists, else the mean number
    of 128-row q blocks in a key tile's column list (-1: unknown); MODE "auto" leaves lists shorter
    than `LIST_MIN_BLOCKS` to the portable backward, unless the call has exact-mask bits
    (``exact``): the portable backward's bits cost more than this kernel's fixed costs, also on
    short lists (measured on a causal window at 16K: experiments/studies/hopper/README.md)."""
    if do_unsupported(do, q, o) is not None:
        return None
    if cols is not None and MODE == "auto" and cols < list_min_blocks(q.device) and not exact:
        return None
    return lay, do_layout(do)


def list_min_blocks(device) -> float:
    """The column length from which MODE "auto" runs block lists here on ``device``: the GPU's own
    measured value in `LIST_MIN_BLOCKS_BY_GPU` (matched by name), else `LIST_MIN_BLOCKS`."""
    if device.type == "cuda":
        name = gpu_name(device.index if device.index is not None else torch.cuda.current_device())
        for key, value in LIST_MIN_BLOCKS_BY_GPU.items():
            if key in name:
                return value
    return LIST_MIN_BLOCKS


@functools.lru_cache(maxsize=None)
def gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def padded_rows(n_q: int, mask_bq: int | None, step: int) -> int:
    """The q rows per head a walk can visit: whole steps of ``step`` rows (dense, ``mask_bq``
    None), or every step of each listed block of ``mask_bq`` rows, the last block's too."""
    unit = mask_bq or step
    return cdiv(n_q, unit) * unit


CAST_ROWS = 64  # rows per program of the delta and cast kernels (a divisor of every step)


def delta_rows(o, do, lse, dlse, n_pad: int, lse_scale: float, acc=None):
    """The backward's accumulator starts (-LSE * lse_scale, -delta), delta = rowsum(dO * O) - dLSE,
    float32 [B * H, n_pad] each, rows past Nq padded with -inf and -0 (`delta_kernel`; ``lse_scale`` > 0). ``acc``: None, or a contiguous
    float32 tensor of B * H * n_pad * D elements that the same launch zeroes (the backward's dQ sums)."""
    B, H, Nq, D = o.shape
    if acc is not None and (acc.numel() != B * H * n_pad * D or acc.dtype != torch.float32 or not acc.is_contiguous()):
        raise ValueError(f"acc must be a contiguous float32 tensor of B * H * n_pad * D = {B * H * n_pad * D} elements, "
                         f"got {acc.dtype} {tuple(acc.shape)}{'' if acc.is_contiguous() else ' (not contiguous)'}")
    lse2 = torch.empty((B * H, n_pad), device=o.device, dtype=torch.float32)
    delta = torch.empty((B * H, n_pad), device=o.device, dtype=torch.float32)
    so, sdo = o.stride(), do.stride()
    binding.call(
        delta_kernel, (cdiv(n_pad, CAST_ROWS), B * H), O=o, DO=do, LSE=lse, DLSE=dlse, LSE2=lse2, DELTA=delta, stride_ob=so[0],
        stride_oh=so[1], stride_om=so[2], stride_dob=sdo[0], stride_doh=sdo[1], stride_dom=sdo[2], n_heads=H, seq_q=Nq,
        n_pad=n_pad, lse_scale=lse_scale, HEAD_DIM=D, BLOCK=CAST_ROWS, ACC=acc)
    return lse2, delta


def _heads_per_group(n_per: int, n_bhk: int, num_sms: int) -> int:
    """How many (batch, kv head)s the tile stream runs at a time (`_key_tile`): enough for one round
    of the CTAs (``n_per`` units each: key tiles, or causal pairs of them), no more, so the float32
    dQ rows the CTAs add into stay in L2 (16K tokens, d=128: 2 heads, 16 MB, where a stream of key
    tile 0 of every head first spans 16 heads, 128 MB)."""
    return max(1, min(n_bhk, cdiv(num_sms, n_per)))


def _row_descriptor(t, step: int):
    """A TMA descriptor of float32 [B * H, n_pad] ``t`` (`delta_rows`'s outputs), blocks of one step's rows."""
    return make_descriptor(t, t.shape, t.stride(), (1, step), _ROW_LAYOUT)


def _dq_box(head_dim: int, step: int) -> tuple:
    """(rows, columns) of one warpgroup's share of a step's dQ, as the reducer adds it: of 64-row
    steps half the columns, of 128-row steps half the rows."""
    return (64, head_dim // 2) if step == 64 else (step // 2, head_dim)


def do_layout(do):
    """`hopper.tensor_layout` of dO, or None."""
    return hopper.tensor_layout(do)


def bwd(do, q, k, v, o, lse, dlse, lists, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, lay, do_lay,
        *, new=torch.empty_like, num_sms=None, exact=None):
    """(dq, dk, dv) like (q, k, v). ``lists``: (column lists or a placeholder, their [B, H, k block]
    strides, NB_P2, number of q blocks; None for dense), as `launch.hopper_bwd` makes them.
    ``lay``: `hopper.layouts` of (q, k, v); ``do_lay``: `do_layout` of dO; ``new``: allocates an
    output like a tensor. ``exact``: None, or (bit-tile table laid out as the column lists, bits)
    (`operands.check_exact`; block lists required). Call only when `unsupported` is None."""
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    dense = lists is None
    idx, i_strides, nb_p2, n_qb = (None, (0, 0, 0), 2, 0) if dense else lists
    if exact is not None and dense:
        raise ValueError("exact bits come with block lists (a dense call has none)")
    q_tile, bits = (None, None) if exact is None else exact
    mask_q = mask_bq or TILE  # (the kernel's MASK_BQ; dense walks ignore it)
    qt = q_step(D)
    n_pad = padded_rows(Nq, None if dense else mask_q, qt)
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if OVERRIDES and not set(OVERRIDES) <= set(OVERRIDE_KEYS):  # (a study's: normal calls skip the check)
        raise ValueError(f"hopper_bwd.OVERRIDES takes the keys {OVERRIDE_KEYS}, got {sorted(OVERRIDES)}")
    # the float32 dQ sums as warpgroup shares in `dq_order`, zeroed by the delta launch (one launch
    # fewer than a fill of their own); the reducer adds each share as one box of a flat [*, dq_n] view
    acc = torch.empty(B * H * n_pad * D, device=q.device, dtype=torch.float32)
    lse2, delta = delta_rows(o, do, lse, dlse, n_pad, 1.0 / scale, acc)  # (the accumulators' start, see _bwd_consumer)
    dk, dv = new(k), new(v)
    sk, sv = dk.stride(), dv.stride()
    dq_m, dq_n = _dq_box(D, qt)
    desc_dq = make_descriptor(acc, [acc.numel() // dq_n, dq_n], [dq_n, 1], (dq_m, dq_n), _DQ_FLAT)
    n_bhk = B * Hk
    n_tiles = cdiv(Nk, TILE) * n_bhk
    if num_sms is None:
        num_sms = sm_count(q.device.index)
    n_kt = n_tiles // n_bhk
    n_units = n_bhk * ((n_kt + 1) // 2) if causal else n_tiles  # (causal: pairs of tiles, `_key_tile`)
    grid = max(1, min(n_units, num_sms))
    gh = _heads_per_group(n_units // n_bhk, n_bhk, grid)
    if OVERRIDES.get("grid_all"):  # (a study's) every unit its own CTA, the hardware scheduling them
        grid = n_units
    n_rounds = cdiv(n_units, grid) * (2 if causal else 1)
    lay_dk, lay_dv = hopper.tensor_layout(dk), hopper.tensor_layout(dv)
    # dK / dV by TMA store through the dQ staging buffers where their layouts take descriptors. A causal
    # walk runs in two loops (SPLIT_BAND: the diagonal's masked steps, then steps without mask code):
    # with one loop testing every step, the TMA epilogue's extra live registers spilled inside it and
    # made causal 8-13% slower; split, TMA is the faster store on every walk (H200, fwd+bwd: causal
    # 1-5%, causal local 3-5% faster than one loop with register stores; experiments/studies/hopper_bwd_fa4/)
    dkdv_tma = lay_dk is not None and lay_dv is not None and OVERRIDES.get("dkdv_tma", True)
    desc_dk = descriptor(dk, lay_dk, TILE // 2) if dkdv_tma else None  # one warpgroup's 64 keys a store
    desc_dv = descriptor(dv, lay_dv, TILE // 2) if dkdv_tma else None
    binding.call(
        hopper_bwd_kernel, (grid,), desc_q=descriptor(q, lay[0], qt), desc_k=descriptor(k, lay[1], TILE),
        desc_v=descriptor(v, lay[2], TILE), desc_do=descriptor(do, do_lay, qt), desc_dq=desc_dq,
        desc_lse=_row_descriptor(lse2, qt), desc_dlt=_row_descriptor(delta, qt), DK=dk, DV=dv, Q_IDX=idx,
        Q_TILE=q_tile, BITS=bits, KEY_LEN=key_lengths, n_tiles=n_tiles, n_rounds=n_rounds, n_bhk=n_bhk, gh=gh,
        n_heads_kv=Hk, group=H // Hk, seq_q=Nq, seq_k=Nk, n_qblocks=n_qb, n_pad=n_pad, scales=(scale * LOG2E, scale),
        strides=(tuple(i_strides[:3]), tuple(sk[:3]), tuple(sv[:3])),
        MASK_BQ=mask_q, MASK_BK=mask_bk or TILE, NB_P2=max(2, nb_p2), CAUSAL=bool(causal), STAGES=_stages(D),
        CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, SPLIT_BAND=bool(OVERRIDES.get("causal_split", True)),
        DP_ZERO=bool(OVERRIDES.get("dp_zero", False)), desc_dk=desc_dk, desc_dv=desc_dv, num_warps=4)
    dq = new(q)
    sq = dq.stride()
    binding.call(dq_cast_kernel, (cdiv(Nq, CAST_ROWS), B * H), ACC=acc, DQ=dq, stride_qb=sq[0], stride_qh=sq[1],
                 stride_qm=sq[2], n_heads=H, seq_q=Nq, n_pad=n_pad, scale=scale, HEAD_DIM=D, BLOCK=CAST_ROWS, DQ_N=dq_n)
    return dq, dk, dv
