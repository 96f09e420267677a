"""Hopper (sm_90) forward: a warp-specialised, ping-pong Gluon kernel (design and measurements:
experiments/studies/hopper/README.md).

The portable kernels (`kernels.py`) run everywhere Triton does; on an H100 they leave the tensor
cores idle while the softmax runs, because one program's matmuls and its softmax are one
dependent chain. This kernel takes FlashAttention-3's structure, written in Gluon:

- one CTA = one q tile of 128 rows (192 at head_dim 64 without block lists: three consumer
  warpgroups, each step in order, see `OVERRIDES`' note), three roles (``gl.warp_specialize``):
  a 1-warp **loader** that TMA-loads Q (two buffers) and K, V (rings of STAGES slots, separate
  barriers for K and V so a K slot is refilled as soon as S = Q K^T has read it), and two
  **consumer warpgroups** of 4 warps, each owning 64 rows of the tile;
- **ping-pong**: the consumers take turns issuing their two wgmmas of a step (a pair of
  mbarriers passes the turn), so one warpgroup's softmax runs while the other's matmuls keep
  the tensor cores busy;
- **in-warpgroup overlap**: step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together and
  computes the softmax of S_j while the second one runs (O is rescaled before that issue);
- **persistent** grid of one CTA per SM walking q tiles p, p + G, ... (the static schedule), or taking
  each next tile from a counter (the dynamic schedule, `DYNAMIC`, a switch: causal calls with short walks,
  whose heads run in sections that keep their K / V in L2); barrier phases are counted over the CTA's whole
  stream, so the next tile's Q and first K/V tiles load during the current tile's last steps and epilogue;
- **epilogue**: each warpgroup writes its half of O into shared memory and one TMA
  store takes it out, so the next tile starts without waiting on global stores (an O whose layout
  TMA cannot take is stored from registers).

The block-sparse list walk is the portable kernels': a q tile visits the k blocks of its row list
(dense: every block), split into a mask-free prefix and a masked band (key_lengths, causal
bottom-right), and skips the rest. Rows with no keys give O = 0 and an LSE of +inf.

Scope (everything else takes the portable path, see `unsupported`; `dispatch.hopper_plan` also keeps
a scale <= 0 there, as the running max is taken on raw scores): an sm_90 GPU, float16 or
bfloat16, head_dim 64 or 128 (K and V alike), mask blocks that are multiples of 128 (or dense),
no dropout, no segment ids, layouts TMA descriptors take: [B, H, N, D] or [B, N, H, D] memory
(a transposed view) with unit last stride and 16-byte aligned strides. Exact-mask bits (EXACT: a
step in a partial block ANDs its bit tile into the scores; the backward's zeroes P^T) unless
`dispatch.HOPPER_EXACT` is "off".
Outputs: O like q, and the LSE (natural log, float32 [B, H, N]) that the backward reads.
"""

from __future__ import annotations

import functools

import torch

from sparseflash.flash.hopper.common import GLUON_ERROR, LN2, LOG2E, TILE, descriptor, sm_count
from sparseflash import _env
from sparseflash.flash import binding
from sparseflash.flash.operands import cdiv

__all__ = ["fwd", "plan", "unsupported", "layouts", "tensor_layout", "section", "GLUON_ERROR", "MODE", "DYNAMIC", "TILE"]

if GLUON_ERROR is None:  # (the guarded import, and the helpers the backward shares: `common`)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from sparseflash.flash.hopper.common import (bnhd, list_layout, list_start, tile_coord, tma_load, tma_store,
                                                  wgmma_layout)

# "auto": the kernel on sm_90 wherever `unsupported` allows it; "off": never (the portable
# kernels always). SPARSEFLASH_HOPPER sets the starting value.
MODE = _env.text("SPARSEFLASH_HOPPER", "auto")


def _stages(head_dim: int) -> int:
    """K/V ring depth: 2 Q buffers + STAGES x (K + V) tiles of 128 x head_dim + the O staging (two
    64-row halves) must fit 227 KB (d=128: 224 KB and the barriers, 229,784-229,816 bytes)."""
    return 2 if head_dim > 64 else 4


if GLUON_ERROR is None:
    _TILE = gl.constexpr(TILE)
    _HALF = gl.constexpr(TILE // 2)
    _LN2 = gl.constexpr(LN2)

    @gluon.constexpr_function
    def _p_layout(head_dim):
        return gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(head_dim), k_width=2)

    @gluon.jit
    def _stream_pos(base, CAUSAL: gl.constexpr):
        """This CTA's position in the tile stream in the round starting at ``base`` (a static
        schedule). Without causal, CTA p takes positions p, p + G, ...; causal, the rounds are dealt
        in a snake (round r goes p = 0..G-1 when r is even, G-1..0 when odd): the causal stream runs
        longest tiles first (`_tile_at`), so long and short tiles even out per CTA (G = 132 is 4 more
        than a 16K head's 128 tiles: in stream order a CTA would get tiles of about the same length in
        every round, 57% balance at 16K)."""
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        if CAUSAL:
            r = base // G
            t = base + gl.where(r % 2 == 0, pid, G - 1 - pid)
        else:
            t = base + pid
        return t

    @gluon.jit
    def _tile_at(t, n_tiles, m_tiles, n_heads, sec_heads, CAUSAL: gl.constexpr):
        """(batch, head, q tile) at stream position ``t`` < n_tiles. Without causal the stream runs
        (batch, head, q tile) in order. Causal, longest tiles first over the (batch, head)s, all at
        once (``sec_heads`` None) or in sections of ``sec_heads`` (batch, head)s, longest first within
        each, so the K / V that a section's CTAs re-read from block 0 on stay in L2 (sections need
        the dynamic schedule: dealt statically they unbalance the CTAs, `fwd`)."""
        if CAUSAL:
            n_bh = n_tiles // m_tiles
            if sec_heads is None:
                bh = t % n_bh
                pm = m_tiles - 1 - t // n_bh
            else:
                sec = t // (sec_heads * m_tiles)
                heads = gl.maximum(gl.minimum(sec_heads, n_bh - sec * sec_heads), 1)  # (the last may have fewer)
                u = t - sec * sec_heads * m_tiles
                bh = sec * sec_heads + u % heads
                pm = m_tiles - 1 - u // heads
        else:
            bh = t // m_tiles
            pm = t % m_tiles
        return bh // n_heads, bh % n_heads, pm

    @gluon.jit
    def _more(t, base, n_tiles, DYN: gl.constexpr):
        """Whether a CTA's stream goes on: dynamic, while the last tile taken exists; static, while
        rounds are left (a CTA may have no tile in the last one)."""
        if DYN:
            go = t < n_tiles
        else:
            go = base < n_tiles
        return go

    @gluon.jit
    def _put_tile(tile_ids, slot, t):
        """The loader's note of the tile whose Q goes into buffer ``slot`` (dynamic schedule), written
        before the barrier that tells the consumers Q is there."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        tile_ids.index(slot).store(gl.zeros([1], gl.int32, layout=lay) + t)

    @gluon.jit
    def _get_tile(tile_ids, slot):
        """A consumer warpgroup's read of `_put_tile`'s note (after waiting for that Q buffer)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.max(tile_ids.index(slot).load(lay), axis=0)

    @gluon.jit
    def _row_list(KV_IDX, b, h, pm, stride_ib, stride_ih, stride_im, MASK_BQ: gl.constexpr, M_TILE: gl.constexpr,
                  DENSE: gl.constexpr):
        """Pointer to the row list of one head's q tile pm (block lists); None when dense."""
        p_list = KV_IDX
        if not DENSE:
            p_list = (KV_IDX + b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih
                      + (pm * M_TILE // MASK_BQ).to(gl.int64) * stride_im)
        return p_list

    @gluon.jit
    def _steps(p_list, KEY_LEN, b, pm, seq_q, seq_k, n_kblocks, MASK_BK: gl.constexpr, NB_P2: gl.constexpr,
               DENSE: gl.constexpr, CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr, WARPS: gl.constexpr,
               M_TILE: gl.constexpr):
        """(steps without an element mask, steps in all, kv_end, causal offset) of q tile pm's walk
        (``p_list``: its row list, `_row_list`; None when dense). Step j < j_full needs no mask;
        j_full <= j < j_valid masks keys at or past kv_end and, causal, above the bottom-right
        diagonal; later blocks are skipped."""
        start_m = pm * M_TILE
        kv_end = seq_k
        if HAS_KEYLEN:
            kv_end = gl.minimum(gl.maximum(gl.load(KEY_LEN + b).to(gl.int32), 0), seq_k)
        full_end = kv_end
        valid_end = kv_end
        causal_off = seq_k - seq_q
        if CAUSAL:
            full_end = gl.minimum(full_end, start_m + causal_off + 1)
            valid_end = gl.minimum(valid_end, gl.minimum(start_m + M_TILE, seq_q) + causal_off)
        if DENSE:
            j_full = gl.maximum(full_end, 0) // _TILE
            j_valid = (gl.maximum(valid_end, 0) + _TILE - 1) // _TILE
        else:
            SUB: gl.constexpr = MASK_BK // _TILE
            offs = gl.arange(0, NB_P2, layout=list_layout(NB_P2, WARPS))
            blocks = gl.load(p_list + offs, mask=offs < n_kblocks, other=1 << 30)
            # (C division truncates towards zero: a negative bound counts nothing)
            j_full = gl.sum((blocks < full_end // MASK_BK).to(gl.int32), axis=0) * SUB
            j_valid = gl.sum((blocks < (valid_end + MASK_BK - 1) // MASK_BK).to(gl.int32), axis=0) * SUB
        return j_full, j_valid, kv_end, causal_off

    @gluon.jit
    def _fill(desc, coord, ready, empty, buf, phase):
        """Load one tile into a ring slot: wait until the slot is free (``empty`` completed the
        phase before ``phase``; a fresh barrier passes a parity-1 wait at once), then TMA-load
        ``desc`` at ``coord`` into ``buf``, completing on ``ready``."""
        mbarrier.wait(empty, phase ^ 1)
        mbarrier.expect(ready, desc.block_type.nbytes)
        tma_load(desc, coord, ready, buf)

    @gluon.jit
    def _loader(desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                KV_IDX, KEY_LEN, n_heads, group, seq_q, seq_k, n_kblocks, stride_ib, stride_ih, stride_im,
                n_tiles, m_tiles, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr, NB_P2: gl.constexpr,
                DENSE: gl.constexpr, CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr, STAGES: gl.constexpr,
                Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, M_TILE: gl.constexpr, QB: gl.constexpr, sec_heads,
                SCHED, tile_ids, DYN: gl.constexpr):
        """1 warp: TMA loads of every tile's Q (M_TILE rows) and the K/V tiles of its walk, in stream
        order. DYN (the dynamic schedule): after its first tile (its program id) the CTA takes the
        next stream position from the counter SCHED[0], and notes each tile in ``tile_ids`` for the
        consumers."""
        it = 0  # K/V tiles issued by this CTA so far: ring slot and phase
        n_done = 0  # tiles started: Q buffer and phase
        G = gl.num_programs(0)
        base = 0
        t = _stream_pos(base, CAUSAL)
        if DYN:
            t = gl.program_id(0)
        while _more(t, base, n_tiles, DYN):
            if t < n_tiles:
                b, h, pm = _tile_at(t, n_tiles, m_tiles, n_heads, sec_heads, CAUSAL)
                hk = h // group
                p_list = _row_list(KV_IDX, b, h, pm, stride_ib, stride_ih, stride_im, MASK_BQ, M_TILE, DENSE)
                j_full, j_valid, kv_end, causal_off = _steps(p_list, KEY_LEN, b, pm, seq_q, seq_k, n_kblocks, MASK_BK,
                                                             NB_P2, DENSE, CAUSAL, HAS_KEYLEN, 1, M_TILE)
                qi = n_done % 2
                mbarrier.wait(q_empty.index(qi), ((n_done // 2) & 1) ^ 1)
                if DYN:
                    _put_tile(tile_ids, qi, t)
                # a tile's Q in QB boxes of M_TILE / QB rows, on one barrier
                mbarrier.expect(q_ready.index(qi), QB * desc_q.block_type.nbytes)
                for i in gl.static_range(QB):
                    tma_load(desc_q, tile_coord(b, h, pm * M_TILE + i * (M_TILE // QB), Q_BNHD), q_ready.index(qi),
                             q_bufs.index(qi * QB + i))
                for j in range(j_valid):
                    start_n = list_start(p_list, j, DENSE, MASK_BK, _TILE)
                    s = it % STAGES
                    ph = (it // STAGES) & 1
                    _fill(desc_k, tile_coord(b, hk, start_n, KV_BNHD), k_ready.index(s), k_empty.index(s), k_bufs.index(s), ph)
                    _fill(desc_v, tile_coord(b, hk, start_n, KV_BNHD), v_ready.index(s), v_empty.index(s), v_bufs.index(s), ph)
                    it += 1
                n_done += 1
            base += G
            if DYN:  # the next tile: the first the counter has not handed out (G + the tiles taken after the first G)
                t = G + gl.atomic_add(SCHED, 1)
            else:
                t = _stream_pos(base, CAUSAL)
        if DYN:
            # past the stream: the consumers wake to a tile index >= n_tiles and stop; the last CTA to get
            # here resets the counters for the next launch (every CTA has taken its last tile by then)
            qi = n_done % 2
            mbarrier.wait(q_empty.index(qi), ((n_done // 2) & 1) ^ 1)
            _put_tile(tile_ids, qi, t)
            mbarrier.arrive(q_ready.index(qi))
            if gl.atomic_add(SCHED + 1, 1) == G - 1:
                gl.atomic_xchg(SCHED, 0)
                gl.atomic_xchg(SCHED + 1, 0)

    @gluon.jit
    def _band_mask(qk, start_n, kv_end, causal_off, rows, s_layout: gl.constexpr, CAUSAL: gl.constexpr):
        """A score tile of the masked band with keys at or past kv_end and, causal, those above the
        bottom-right diagonal set to -inf."""
        cols = start_n + gl.arange(0, _TILE, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < kv_end, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + causal_off, 1))
        return gl.where(keep, qk, float("-inf"))

    @gluon.jit
    def _exact_keep(BITS, tb, rows, c0, s_layout: gl.constexpr, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr):
        """Which pairs of a [64, 128] score tile bit tile ``tb`` attends: rows ``rows`` (absolute),
        keys ``c0`` .. ``c0`` + 127 counted from the mask block's corner (c0 a multiple of 128).
        Row r of a bit tile holds ceil(MASK_BK / 32) int32 words, key c in bit c % 32 of word
        c // 32 (`mask.ExactBits`). The tile's 4 words of each row are loaded as 4 row vectors (8
        words a thread) and spread over the columns in registers: a pointer per element would cost
        128 registers a thread and spill. (Loading them before the step waits for its K tile and its
        turn, to hide their latency, measured no faster: experiments/studies/exact-bits-cost/.)"""
        W: gl.constexpr = (MASK_BK + 31) // 32
        p = BITS + tb.to(gl.int64) * (MASK_BQ * W) + (rows % MASK_BQ) * W + c0 // 32  # [64] row pointers
        w0 = gl.expand_dims(gl.load(p), 1)
        w1 = gl.expand_dims(gl.load(p + 1), 1)
        w2 = gl.expand_dims(gl.load(p + 2), 1)
        w3 = gl.expand_dims(gl.load(p + 3), 1)
        c = gl.expand_dims(gl.arange(0, _TILE, layout=gl.SliceLayout(0, s_layout)), 0)
        k = c // 32
        w = gl.where(k == 0, w0, gl.where(k == 1, w1, gl.where(k == 2, w2, w3)))
        return ((w >> (c % 32)) & 1) != 0

    @gluon.jit
    def _softmax_step(qk, m_i, l_i, qk_scale, j, j_full, p_list, kv_end, causal_off, rows, p_tile, BITS,
                      s_layout: gl.constexpr, DENSE: gl.constexpr, CAUSAL: gl.constexpr, MASK_BK: gl.constexpr,
                      EXACT: gl.constexpr, MASK_BQ: gl.constexpr):
        """Online softmax of one raw score tile (log2 domain, the scale folded into the exponent's
        FMA): (P, new running max, new running sum, the factor that rescales O). EXACT: a step in a
        partial block (its bit-tile index >= 0) also drops the pairs its bits leave out, and a row
        may then have seen no key yet at any step, so the pivot is always kept finite."""
        if EXACT:
            start_n = list_start(p_list, j, DENSE, MASK_BK, _TILE)
            if j >= j_full:
                qk = _band_mask(qk, start_n, kv_end, causal_off, rows, s_layout, CAUSAL)
            SUB: gl.constexpr = MASK_BK // _TILE
            tb = gl.load(p_tile + j // SUB)
            if tb >= 0:
                qk = gl.where(_exact_keep(BITS, tb, rows, start_n % MASK_BK, s_layout, MASK_BQ, MASK_BK), qk,
                              float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
            m_piv = gl.where(m_new == float("-inf"), 0.0, m_new)
        elif j >= j_full:  # the masked band: keys past kv_end and, causal, above the diagonal
            qk = _band_mask(qk, list_start(p_list, j, DENSE, MASK_BK, _TILE), kv_end, causal_off, rows, s_layout, CAUSAL)
            m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
            m_piv = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key so far stays finite
        else:
            m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
            m_piv = m_new
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_piv, 1))
        alpha = gl.exp2(m_i - m_piv)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _named_barrier(BAR: gl.constexpr, ARRIVE: gl.constexpr):
        """A hardware named barrier of the two consumer warpgroups (256 threads), met by this warpgroup:
        ``bar.arrive`` (go on) or ``bar.sync`` (wait for the other's arrive). Ids 14 and 15: Triton's
        own barriers of these partitions take the low ids (0-2 in the forward's PTX)."""
        x = gl.full([128], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))  # one element a thread
        if ARRIVE:
            if BAR == 14:
                asm: gl.constexpr = "bar.arrive 14, 256;\n\tmov.b32 $0, $1;"
            else:
                asm: gl.constexpr = "bar.arrive 15, 256;\n\tmov.b32 $0, $1;"
        else:
            if BAR == 14:
                asm: gl.constexpr = "bar.sync 14, 256;\n\tmov.b32 $0, $1;"
            else:
                asm: gl.constexpr = "bar.sync 15, 256;\n\tmov.b32 $0, $1;"
        gl.inline_asm_elementwise(asm, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _turn_wait(me, n_turns, WG: gl.constexpr, NAMED: gl.constexpr):
        """Wait for this warpgroup's turn to issue: its mbarrier's next phase, or (NAMED) its named
        barrier (14 + WG), which the other warpgroup's pass completes. Gluon's mbarrier arrive has the
        warpgroup meet at a bar.sync before one thread arrives; a named barrier's arrive does not wait."""
        if NAMED:
            _named_barrier(14 + WG, False)
        else:
            mbarrier.wait(me, n_turns & 1)

    @gluon.jit
    def _turn_pass(other, WG: gl.constexpr, NAMED: gl.constexpr):
        """Pass the turn to the other warpgroup (`_turn_wait`)."""
        if NAMED:
            _named_barrier(15 - WG, True)
        else:
            mbarrier.arrive(other)

    @gluon.jit
    def _consumer(shared, sec_heads, WG: gl.constexpr, HEAD_DIM: gl.constexpr, MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr,
                  NB_P2: gl.constexpr, DENSE: gl.constexpr, CAUSAL: gl.constexpr, HAS_KEYLEN: gl.constexpr,
                  STAGES: gl.constexpr, TMA_O: gl.constexpr, O_BNHD: gl.constexpr, EXACT: gl.constexpr,
                  NWG: gl.constexpr, QB: gl.constexpr, FLAT: gl.constexpr, NAMED_TURNS: gl.constexpr,
                  DYN: gl.constexpr):
        """One of NWG consumer warpgroups (rows WG*64 .. WG*64+63 of each tile of NWG * 64 rows):
        wgmma, softmax, epilogue. The turn to issue passes from warpgroup WG to WG + 1 (mod NWG), by
        mbarriers, or (NAMED_TURNS, two warpgroups: a study's) by hardware named barriers (`_turn_wait`).
        FLAT (three warpgroups' order): each step in order, S = Q K^T, its softmax, O += P V, without
        turns and without overlapping a step's softmax with the step before's P V (one P live, not
        two); with three warpgroups the other two cover one's softmax. DYN (the dynamic schedule): each
        tile is the one the loader noted with its Q (`_put_tile`)."""
        (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, desc_o, O, LSE,
         KV_IDX, KV_TILE, BITS, KEY_LEN, n_heads, seq_q, seq_k, n_kblocks, stride_ib, stride_ih, stride_im, stride_ob,
         stride_oh, stride_om, n_tiles, m_tiles, qk_scale, tile_ids) = shared
        M_TILE: gl.constexpr = NWG * _HALF
        s_layout: gl.constexpr = wgmma_layout(_TILE)  # S: [64, 128] fp32
        o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)  # O: [64, HEAD_DIM] fp32
        p_layout: gl.constexpr = _p_layout(HEAD_DIM)  # P as the register operand of P V
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = k_bufs.dtype
        zero_s = gl.zeros([_HALF, _TILE], gl.float32, layout=s_layout)
        r_s = gl.arange(0, _HALF, layout=row_s) + WG * _HALF
        r_o = gl.arange(0, _HALF, layout=row_o) + WG * _HALF
        c_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        me = turn.index(WG)
        other = turn.index((WG + 1) % NWG)
        it = 0
        n_turns = 0
        n_done = 0
        if NAMED_TURNS and WG == 1:
            _turn_pass(other, WG, NAMED_TURNS)  # warpgroup 0 issues first
        G = gl.num_programs(0)
        base = 0
        t = _stream_pos(base, CAUSAL)
        if DYN:  # the loader's note of the first tile (`_put_tile`)
            mbarrier.wait(q_ready.index(0), 0)
            t = _get_tile(tile_ids, 0)
        while _more(t, base, n_tiles, DYN):
            if t < n_tiles:
                b, h, pm = _tile_at(t, n_tiles, m_tiles, n_heads, sec_heads, CAUSAL)
                p_list = _row_list(KV_IDX, b, h, pm, stride_ib, stride_ih, stride_im, MASK_BQ, M_TILE, DENSE)
                j_full, j_valid, kv_end, causal_off = _steps(p_list, KEY_LEN, b, pm, seq_q, seq_k, n_kblocks, MASK_BK,
                                                             NB_P2, DENSE, CAUSAL, HAS_KEYLEN, 4, M_TILE)
                start_m = pm * M_TILE
                rows = start_m + r_s
                p_tile = KV_TILE  # EXACT: the bit-tile indices, laid out as the row lists
                if EXACT:
                    p_tile = (KV_TILE + b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih
                              + (start_m // MASK_BQ).to(gl.int64) * stride_im)
                qi = n_done % 2
                mbarrier.wait(q_ready.index(qi), (n_done // 2) & 1)
                if QB == 1:
                    q_s = q_bufs.index(qi).reshape([M_TILE, HEAD_DIM]).slice(WG * _HALF, _HALF, dim=0)
                else:  # (one 64-row box a warpgroup)
                    q_s = q_bufs.index(qi * QB + WG).reshape([_HALF, HEAD_DIM])
                m_i = gl.full([_HALF], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.zeros([_HALF], gl.float32, layout=row_s)
                acc = gl.zeros([_HALF, HEAD_DIM], gl.float32, layout=o_layout)
                if FLAT:
                    for j in range(0, j_valid):
                        s = it % STAGES
                        ph = (it // STAGES) & 1
                        k_s = k_bufs.index(s).reshape([_TILE, HEAD_DIM])
                        v_s = v_bufs.index(s).reshape([_TILE, HEAD_DIM])
                        mbarrier.wait(k_ready.index(s), ph)
                        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_s, k_s))[0]
                        mbarrier.arrive(k_empty.index(s))
                        p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, qk_scale, j, j_full, p_list, kv_end, causal_off,
                                                           rows, p_tile, BITS, s_layout, DENSE, CAUSAL, MASK_BK, EXACT,
                                                           MASK_BQ)
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                        p_op = gl.convert_layout(p.to(dtype), p_layout)
                        mbarrier.wait(v_ready.index(s), ph)
                        acc = warpgroup_mma(p_op, v_s, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_s, p_op))[0]
                        mbarrier.arrive(v_empty.index(s))
                        it += 1
                elif j_valid > 0:
                    # step 0: S_0 and its softmax only
                    s = it % STAGES
                    k_s = k_bufs.index(s).reshape([_TILE, HEAD_DIM])
                    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
                    _turn_wait(me, n_turns, WG, NAMED_TURNS)
                    qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    _turn_pass(other, WG, NAMED_TURNS)
                    n_turns += 1
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_s, k_s))[0]
                    mbarrier.arrive(k_empty.index(s))
                    p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, qk_scale, 0, j_full, p_list, kv_end, causal_off,
                                                       rows, p_tile, BITS, s_layout, DENSE, CAUSAL, MASK_BK, EXACT,
                                                       MASK_BQ)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    s_prev = s
                    ph_prev = (it // STAGES) & 1
                    it += 1
                    for j in range(1, j_valid):
                        s = it % STAGES
                        k_s = k_bufs.index(s).reshape([_TILE, HEAD_DIM])
                        v_prev = v_bufs.index(s_prev).reshape([_TILE, HEAD_DIM])
                        mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
                        _turn_wait(me, n_turns, WG, NAMED_TURNS)
                        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                        mbarrier.wait(v_ready.index(s_prev), ph_prev)
                        acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                        _turn_pass(other, WG, NAMED_TURNS)
                        n_turns += 1
                        # wgmma groups retire in order: S_j is done, P_{j-1} V_{j-1} may still run
                        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_s, k_s))[0]
                        mbarrier.arrive(k_empty.index(s))
                        p, m_i, l_i, alpha = _softmax_step(qk, m_i, l_i, qk_scale, j, j_full, p_list, kv_end, causal_off,
                                                           rows, p_tile, BITS, s_layout, DENSE, CAUSAL, MASK_BK, EXACT,
                                                           MASK_BQ)
                        p_next = gl.convert_layout(p.to(dtype), p_layout)
                        # p_op (registers the running wgmma reads) stays live until it retires
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_prev, p_op))[0]
                        mbarrier.arrive(v_empty.index(s_prev))
                        p_op = p_next
                        s_prev = s
                        ph_prev = (it // STAGES) & 1
                        it += 1
                    v_prev = v_bufs.index(s_prev).reshape([_TILE, HEAD_DIM])
                    _turn_wait(me, n_turns, WG, NAMED_TURNS)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    mbarrier.wait(v_ready.index(s_prev), ph_prev)
                    acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                    _turn_pass(other, WG, NAMED_TURNS)
                    n_turns += 1
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_prev, p_op))[0]
                    mbarrier.arrive(v_empty.index(s_prev))
                mbarrier.arrive(q_empty.index(qi))
                # epilogue: O / l and the natural-log LSE; rows with no key: O = 0, LSE = +inf
                empty = l_i == 0.0
                l_safe = gl.where(empty, 1.0, l_i)
                o = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
                if TMA_O:  # through shared memory and a TMA store (it clips rows past seq_q)
                    o_s = o_bufs.index(WG)
                    tma.store_wait(0)  # this warpgroup's store of the last tile has read o_s
                    o_s.reshape([_HALF, HEAD_DIM]).store(o.to(o_s.dtype))
                    fence_async_shared()
                    tma_store(desc_o, tile_coord(b, h, start_m + WG * _HALF, O_BNHD), o_s)
                else:
                    rows_o = start_m + r_o
                    o_ptrs = (O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                              + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1) + gl.expand_dims(c_o, 0))
                    gl.store(o_ptrs, o.to(dtype), mask=gl.expand_dims(rows_o < seq_q, 1))
                lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * _LN2)
                gl.store(LSE + (b * n_heads + h).to(gl.int64) * seq_q + rows, lse, mask=rows < seq_q)
                n_done += 1
            base += G
            if DYN:  # the next tile, as the loader noted it with its Q (an index >= n_tiles: the end)
                qn = n_done % 2
                mbarrier.wait(q_ready.index(qn), (n_done // 2) & 1)
                t = _get_tile(tile_ids, qn)
            else:
                t = _stream_pos(base, CAUSAL)
        if NAMED_TURNS and WG == 0:
            _turn_wait(me, n_turns, WG, NAMED_TURNS)  # the last pass of warpgroup 1: both barriers end even
        if TMA_O:
            tma.store_wait(0)  # (shared memory must outlive the last store's read)

    @gluon.jit
    def hopper_fwd_kernel(desc_q, desc_k, desc_v, O, LSE, n_heads, group, seq_q, seq_k, n_kblocks, qk_scale, n_tiles,
                           stride_ib, stride_ih, stride_im, stride_ob, stride_oh, stride_om,
                           MASK_BQ: gl.constexpr, MASK_BK: gl.constexpr, NB_P2: gl.constexpr, CAUSAL: gl.constexpr,
                           STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                           NWG: gl.constexpr, FLAT: gl.constexpr, NAMED_TURNS: gl.constexpr, KV_IDX=None, KV_TILE=None,
                           BITS=None, KEY_LEN=None, desc_o=None, sec_heads=None, SCHED=None):
        """Optional features are named pointers, None when off: KV_IDX, the row lists (None: dense);
        KV_TILE and BITS, the exact-mask bit tiles and their bits; KEY_LEN, key_lengths; desc_o, O
        stored by TMA (None: from registers, through O with its strides); sec_heads (a study's), the
        causal stream's (batch, head)s a section (`_tile_at`); SCHED, int32 [2] counters of the dynamic
        schedule (zero before the launch, left zero after it; None: the static one, `_stream_pos`).
        The head dimension and each tensor's memory order come from the descriptors."""
        DENSE: gl.constexpr = KV_IDX is None
        EXACT: gl.constexpr = BITS is not None
        HAS_KEYLEN: gl.constexpr = KEY_LEN is not None
        DYN: gl.constexpr = SCHED is not None
        TMA_O: gl.constexpr = desc_o is not None
        HEAD_DIM: gl.constexpr = desc_q.block_type.shape[3]
        Q_BNHD: gl.constexpr = bnhd(desc_q)
        KV_BNHD: gl.constexpr = bnhd(desc_k)
        O_BNHD: gl.constexpr = bnhd(desc_o)
        M_TILE: gl.constexpr = NWG * _HALF  # q rows a CTA: 64 a consumer warpgroup
        QB: gl.constexpr = M_TILE // desc_q.block_type.shape[1 if Q_BNHD else 2]  # Q boxes a tile (TMA: powers of 2)
        m_tiles = (seq_q + M_TILE - 1) // M_TILE
        q_bufs = gl.allocate_shared_memory(desc_q.dtype, [2 * QB] + desc_q.block_type.shape, desc_q.layout)
        k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
        if TMA_O:  # one [64, HEAD_DIM] part of O per consumer warpgroup
            o_bufs = gl.allocate_shared_memory(desc_o.dtype, [NWG] + desc_o.block_type.shape, desc_o.layout)
        else:
            o_bufs = q_bufs  # (unused)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NWG, 1], mbarrier.MBarrierLayout())
        # the dynamic schedule's tile of each Q buffer (`_put_tile`)
        tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=NWG)  # every consumer warpgroup releases a buffer
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(2, NWG):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NWG)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NWG)
        if not NAMED_TURNS:
            mbarrier.arrive(turn.index(0))  # warpgroup 0 issues first
        fence_async_shared()  # the barriers' initialisation is visible to TMA before the first load
        # what every consumer warpgroup takes besides its constexprs, one tuple written once for both
        # partition lists (constexprs stay out of it, and the lists are literals: a constexpr inside a
        # tuple variable, or in tuples built by concatenation, becomes a tensor)
        shared = (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, desc_o, O,
                  LSE, KV_IDX, KV_TILE, BITS, KEY_LEN, n_heads, seq_q, seq_k, n_kblocks, stride_ib, stride_ih, stride_im,
                  stride_ob, stride_oh, stride_om, n_tiles, m_tiles, qk_scale, tile_ids)
        if NWG == 3:  # three consumer warpgroups (`fwd`'s 192-row tiles)
            gl.warp_specialize([
                (_consumer, (shared, sec_heads, 0, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES, TMA_O, O_BNHD,
                             EXACT, NWG, QB, FLAT, NAMED_TURNS, DYN)),
                (_consumer, (shared, sec_heads, 1, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES, TMA_O, O_BNHD,
                             EXACT, NWG, QB, FLAT, NAMED_TURNS, DYN)),
                (_consumer, (shared, sec_heads, 2, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES, TMA_O, O_BNHD,
                             EXACT, NWG, QB, FLAT, NAMED_TURNS, DYN)),
                (_loader, (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, KV_IDX, KEY_LEN, n_heads, group, seq_q, seq_k, n_kblocks, stride_ib, stride_ih,
                           stride_im, n_tiles, m_tiles, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES,
                           Q_BNHD, KV_BNHD, M_TILE, QB, sec_heads, SCHED, tile_ids, DYN)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (shared, sec_heads, 0, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES, TMA_O, O_BNHD,
                             EXACT, NWG, QB, FLAT, NAMED_TURNS, DYN)),
                (_consumer, (shared, sec_heads, 1, HEAD_DIM, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES, TMA_O, O_BNHD,
                             EXACT, NWG, QB, FLAT, NAMED_TURNS, DYN)),
                (_loader, (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, KV_IDX, KEY_LEN, n_heads, group, seq_q, seq_k, n_kblocks, stride_ib, stride_ih,
                           stride_im, n_tiles, m_tiles, MASK_BQ, MASK_BK, NB_P2, DENSE, CAUSAL, HAS_KEYLEN, STAGES,
                           Q_BNHD, KV_BNHD, M_TILE, QB, sec_heads, SCHED, tile_ids, DYN)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])



CONSUMER_REGS = 232  # second consumer warpgroup (setmaxnreg); the first takes what is left
CONSUMER_REGS_3 = 160  # with three consumer warpgroups, the second and third (3 x 128 x 160 + the loader's fit)
LOADER_REGS = 40
# With three consumer warpgroups the loader's warpgroup gives up more, so that all three keep 160 (at 40 the
# first, Gluon's default partition, got what was left: 152, and the in-warpgroup overlap spilled 120 bytes a
# thread on triton 3.6's ptxas; at 32 none, as FlashAttention-4's 3 x 160 + 32)
LOADER_REGS_3 = 32

# Consumer warpgroups: at head_dim 64 without block lists three (192-row q tiles, FlashAttention-4's tile
# there), each step S, softmax, P V in order (FLAT): 4-7% faster forwards than two ping-pong warpgroups at
# 4K and 16K, dense and causal (1% slower at causal 4K), outputs bitwise equal
# (experiments/studies/hopper_bwd_fa4/, session 7); elsewhere two, with turns and in-warpgroup overlap.
# (Three with turns and overlap were 27-34% slower, spilling with two P tiles live; two flat 12-24%:
# experiments/studies/hopper/README.md and hopper_bwd_fa4 session 7.)
# A study can override: "consumers": 2 or 3 (3 taken only where the default would allow it), "flat":
# True / False (default: flat with three); "sec_heads": an int, a causal call's (batch, head)s taken in
# sections of that many (`_tile_coords`; default: all at once); "one_tile": True, a grid of one CTA a tile
# (not persistent: the hardware hands tiles to SMs as they free up, in stream order, so a causal stream's
# longest-first order balances itself, with or without sections; Nsight Compute at causal d=128 16K: our
# persistent grid hits L2 on 74% of loads against FA4's 95% with one CTA a tile); "named_turns": True, two
# ping-pong warpgroups pass the turn by hardware named barriers instead of mbarriers (Gluon's mbarrier arrive
# has the warpgroup meet at a bar.sync first: 7% of the consumers' stall samples at causal d=128 16K sit
# there, FA4's 0.1%). Empty in normal use.
# "dynamic": True / False, the dynamic schedule (`DYNAMIC`) on every call / on none; causal calls then
# take `section`'s sections (or none) unless "sec_heads" says otherwise.
OVERRIDES: dict = {}
# "loader_regs": the loader warpgroup's setmaxnreg (default `LOADER_REGS`, `LOADER_REGS_3` with three consumers).
OVERRIDE_KEYS = ("consumers", "flat", "sec_heads", "one_tile", "named_turns", "dynamic", "loader_regs")

# Which calls take the dynamic schedule (SPARSEFLASH_HOPPER_DYNAMIC): "auto", causal calls whose walks
# take sections (`section`); "all", every call; "off", none. Each CTA of the persistent grid takes its
# next tile from a counter as it finishes one, so causal sections of heads (K / V kept in L2) stay
# balanced; the static schedule deals the tiles out in rounds, which sections would unbalance. "off" by
# default until a GPU has measured "auto" with counters zeroed per call (the per-stream counters it was
# measured with left a CUDA graph captured on another stream with sections and no counters: slower).
DYNAMIC = _env.text("SPARSEFLASH_HOPPER_DYNAMIC", "off")


def unsupported(q, k, v, *, mask_bq=None, mask_bk=None, dropout_p=0.0, seg=None) -> str | None:
    """Why this kernel cannot run a forward call, or None when it can."""
    if MODE not in ("auto", "off"):
        raise ValueError(f"hopper.MODE (SPARSEFLASH_HOPPER) must be 'auto' or 'off', got {MODE!r}")
    if DYNAMIC not in ("auto", "all", "off"):
        raise ValueError(f"hopper.DYNAMIC (SPARSEFLASH_HOPPER_DYNAMIC) must be 'auto', 'all' or 'off', got {DYNAMIC!r}")
    if MODE == "off":
        return "SPARSEFLASH_HOPPER=off"
    if GLUON_ERROR is not None:
        return f"no gluon: {GLUON_ERROR}"
    if q.device.type != "cuda" or _sm_major(q.device.index) != 9:
        return "not an sm_90 GPU"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}"
    D = q.shape[-1]
    if D not in (64, 128) or k.shape[-1] != D or v.shape[-1] != D:
        return f"head_dim {D}"
    if (mask_bq or TILE) % TILE or (mask_bk or TILE) % TILE:
        return f"mask block {mask_bq}x{mask_bk} (needs multiples of {TILE})"
    if dropout_p > 0.0:
        return "dropout"
    if seg is not None:
        return "segment ids"
    if layouts(q, k, v) is None:
        return "a layout TMA descriptors cannot take"
    return None


def plan(q, k, v, *, mask_bq=None, mask_bk=None):
    """The `layouts` of (q, k, v) when this kernel runs the call (no dropout, no segment ids:
    `dispatch.hopper_plan`'s part), else None; each check once."""
    if unsupported(q, k, v, mask_bq=mask_bq, mask_bk=mask_bk) is not None:
        return None
    return layouts(q, k, v)  # cached by layout: the second look is a dictionary hit


@functools.lru_cache(maxsize=None)
def _sm_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _row_major(shape, stride, esz: int):
    """Descriptor strides of a 4-D layout read in its own dimension order, or None: unit last
    stride, 16-byte aligned strides, each dimension at least as far apart as the whole of the
    next (size-1 dimensions get such a stride: their coordinate is always 0)."""
    a, b, c, d = shape
    sa, sb, sc, sd = stride
    if sd != 1:
        return None
    sc = sc if c > 1 else d + (-d) % (16 // esz)
    sb = sb if b > 1 else c * sc
    sa = sa if a > 1 else b * sb
    ok = all((x * esz) % 16 == 0 for x in (sa, sb, sc)) and sc >= d and sb >= c * sc and sa >= b * sb
    return (sa, sb, sc, 1) if ok else None


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple, stride: tuple, esz: int, aligned: bool):
    """(descriptor strides, bnhd) of a [B, H, N, D] tensor: its memory read as [B, H, N, D], or
    as [B, N, H, D] (bnhd; the layout of q.view(B, N, H, D).transpose(1, 2)); None if neither."""
    if not aligned:
        return None
    B, H, N, D = shape
    sb, sh, sn, sd = stride
    st = _row_major((B, H, N, D), (sb, sh, sn, sd), esz)
    if st is not None:
        return st, False
    st = _row_major((B, N, H, D), (sb, sn, sh, sd), esz)
    return None if st is None else (st, True)


def o_layout(o):
    """The layout O's TMA-store epilogue takes (`tensor_layout`), None: O is stored from registers."""
    return tensor_layout(o)


def tensor_layout(t: torch.Tensor):
    """`_layout` of a [B, H, N, D] tensor (its address's 16-byte alignment included), or None."""
    return _layout(tuple(t.shape), t.stride(), t.element_size(), t.data_ptr() % 16 == 0)


def layouts(q, k, v):
    """The descriptor layouts of q, k, v (`tensor_layout`), or None when one has none. K and V share
    one dimension order (one constexpr)."""
    out = [tensor_layout(t) for t in (q, k, v)]
    if None in out or out[1][1] != out[2][1]:
        return None
    return out


def fwd(q, k, v, o, lse, lists, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, lay, *,
        num_sms=None, exact=None):
    """Fill ``o`` (like q) and ``lse`` (float32 [B, Hq, Nq], +inf for rows with no key); returns
    them. ``lists``: (row lists or a placeholder, their [B, H, row] strides, NB_P2, entries per
    row; None for dense), as `launch.hopper_fwd` makes them. ``lay``: `layouts` of (q, k, v).
    ``exact``: None, or (bit-tile table laid out as the row lists, bits) of a mask applied exactly
    inside its partial blocks (`operands.check_exact`; block lists required). Call only when
    `unsupported` is None."""
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    dense = lists is None
    idx, i_strides, nb_p2, n_kb = (None, (0, 0, 0), 2, 0) if dense else lists
    if exact is not None and dense:
        raise ValueError("exact bits come with block lists (a dense call has none)")
    kv_tile, bits = (None, None) if exact is None else exact
    wide = dense and D == 64  # three consumer warpgroups, 192-row tiles, flat steps
    nwg, flat = (3, True) if wide else (2, False)
    named = one_tile = False
    m_tiles = cdiv(Nq, 64 * nwg)
    sec = section(B * H, m_tiles, Nk, D, k.element_size(), H // Hk) if causal and DYNAMIC != "off" else None
    dyn = sec is not None or DYNAMIC == "all"
    if OVERRIDES:  # (a study's: normal calls skip the check and the lookups)
        if not set(OVERRIDES) <= set(OVERRIDE_KEYS) or OVERRIDES.get("consumers", nwg) not in (2, 3):
            raise ValueError(f"hopper.OVERRIDES takes {OVERRIDE_KEYS} ('consumers': 2 or 3), got {OVERRIDES}")
        nwg = 3 if OVERRIDES.get("consumers", nwg) == 3 and wide else 2
        m_tiles = cdiv(Nq, 64 * nwg)
        flat = bool(OVERRIDES.get("flat", nwg == 3))
        named = bool(OVERRIDES.get("named_turns")) and nwg == 2 and not flat  # (turns exist only there)
        one_tile = bool(OVERRIDES.get("one_tile"))
        dyn = bool(OVERRIDES.get("dynamic", dyn)) and not one_tile
        if not causal:
            sec = None
        elif "sec_heads" in OVERRIDES:
            sec = OVERRIDES["sec_heads"]
        else:
            sec = section(B * H, m_tiles, Nk, D, k.element_size(), H // Hk) if dyn else None
    loader_regs = LOADER_REGS_3 if nwg == 3 else LOADER_REGS
    if OVERRIDES and "loader_regs" in OVERRIDES:
        loader_regs = OVERRIDES["loader_regs"]
    sched = _counters(q.device) if dyn else None
    so = o.stride()
    # O through shared memory and a TMA store where its layout takes a descriptor (faster, most on short
    # walks: experiments/studies/hopper/README.md, the TMA epilogue), else stored from registers
    o_lay = o_layout(o)
    n_tiles = B * H * m_tiles
    if num_sms is None:
        num_sms = n_tiles if one_tile else sm_count(q.device.index)
    grid = (max(1, min(n_tiles, num_sms)),)
    desc_q = descriptor(q, lay[0], TILE if nwg == 2 else 64)  # (192 rows: three boxes, TMA boxes are powers of 2)
    binding.call(
        hopper_fwd_kernel, grid, desc_q=desc_q, desc_k=descriptor(k, lay[1], TILE), desc_v=descriptor(v, lay[2], TILE),
        desc_o=None if o_lay is None else descriptor(o, o_lay, TILE // 2), O=o, LSE=lse, KV_IDX=idx,
        KV_TILE=kv_tile, BITS=bits, KEY_LEN=key_lengths,
        n_heads=H, group=H // Hk, seq_q=Nq, seq_k=Nk, n_kblocks=n_kb, qk_scale=scale * LOG2E, n_tiles=n_tiles,
        stride_ib=i_strides[0], stride_ih=i_strides[1], stride_im=i_strides[2],
        stride_ob=so[0], stride_oh=so[1], stride_om=so[2],
        MASK_BQ=mask_bq or TILE, MASK_BK=mask_bk or TILE, NB_P2=max(2, nb_p2), CAUSAL=bool(causal),
        STAGES=_stages(D), CONSUMER_REGS=CONSUMER_REGS_3 if nwg == 3 else CONSUMER_REGS, LOADER_REGS=loader_regs,
        NWG=nwg, FLAT=flat, NAMED_TURNS=named, sec_heads=sec, SCHED=sched, num_warps=4)
    return o, lse


# Causal sections of the dynamic schedule (experiments/studies/hopper_bwd_fa4, session 9; H200, bf16, 16
# heads): the (batch, head)s whose K and V make SECTION_BYTES, on walks of at most SECTION_MAX_TILES q tiles.
# At 4K x 4 (32 tiles a walk) sections of 4-8 heads cut the causal forward by 11% at d=128 (0.549 -> 0.488
# ms) and 2.5% at d=64. The 16K rows that set SECTION_MAX_TILES (sections 15-36% slower) match the static
# schedule with sections to 0.1-0.6%, which is what a launch without counters ran then; Nsight Compute of
# one launch with sections of 2 at 16K: 1.55 ms, L2 hits 96% (static, all heads: 1.66 ms, 74%). To be
# remeasured with counters per call; the limit is likely to go.
SECTION_BYTES = 16 << 20
SECTION_MAX_TILES = 32


def section(n_bh: int, m_tiles: int, seq_k: int, head_dim: int, esz: int, group: int):
    """The (batch, head)s a causal section of the dynamic schedule (`_tile_at`): as many as share
    `SECTION_BYTES` of K and V (heads of one GQA group share theirs); None (all heads at once) when
    that is all of them or a walk has more than `SECTION_MAX_TILES` q tiles (``m_tiles``)."""
    if m_tiles > SECTION_MAX_TILES:
        return None
    per_head = 2 * seq_k * head_dim * esz / group
    sec = max(1, int(SECTION_BYTES // per_head))
    return None if sec >= n_bh else sec


def _counters(device):
    """The dynamic schedule's int32 [2] counters (next stream position, CTAs done), zeroed for this
    call (one memset; captured with the launch in a CUDA graph). A buffer per call, not per stream:
    launches on different streams may run at once, and a graph is captured on a stream of its own.
    (The kernel's last CTA also puts them back to zero.)"""
    return torch.zeros(2, dtype=torch.int32, device=device)
