"""Can a persistent, warp-specialised Gluon kernel take the fixed cost out of short block-sparse rows? (issue 3)

    python -m sparseflash.experiments.studies.gluon.gluon_probe [--head-dims 64 128] [--seq 4096] [--blocks 3]
        [--variant 128x64:w8:s4] [--out DIR]
    python -m sparseflash.experiments.studies.gluon.gluon_probe --compile-only [--json]   # no GPU needed

Issue 3's last gap is the 4K forward at density ~0.1: rows of ~3 key blocks run at 65-70% of the
dense rate because each q-tile program pays a fixed cost (Q load, address setup, the K/V
pipeline's fill and drain, the epilogue) worth ~1.5 blocks of work, which a long dense row
amortises and a short one cannot. Plain Triton did not hide it (a persistent kernel and
``tl.range(warp_specialize=True)``, see ws_probe.py). The hypothesis tested here is the
FlashAttention-3 structure written by hand in Gluon (``triton.experimental.gluon``) for Hopper:

- a persistent grid of G = min(q tiles, SMs x programs per SM) programs; program p takes the
  q tiles (batch x head, BLOCK_M rows) p, p + G, ...;
- ``gl.warp_specialize`` with a 1-warp loader partition that TMA-loads Q (two buffers) and K/V
  (a ring of STAGES buffers) guarded by mbarriers, with ring positions and phases counted over
  the program's whole tile stream, so the next tile's Q and first K/V blocks are in flight while
  the current tile's last blocks and epilogue are computed;
- the default partition (one or two consumer warpgroups) running S = Q K^T with wgmma from
  shared memory, the online softmax in fp32 registers, O += P V with P as a register operand,
  and the epilogue (O / l, LSE in natural-log units, +inf for empty rows) with plain stores.

This probe is a measurement, not a kernel of the package: the same stripped forward as
ws_probe.py (bf16, no causal, key_lengths, dropout or tails; sequence a multiple of 128;
contiguous [B, H, N, D] inputs; square 128x128 mask blocks read from ``mask.index().kv_idx``),
timed in GPU time (CUDA-graph replays) beside the package's forward on the same inputs and
mask, and checked against it (max |difference| of O, and of the LSE). Each variant that fails
to compile or run is reported with its error instead of stopping the probe.

Variants (``--variant``, repeatable): ``BMxBN:wW:sS[:np][:cC][:ov]``, e.g. ``128x64:w8:s4``: q tile
of BM rows, key sub-tile of BN, W consumer warps (4: one warpgroup, BM >= 64; 8: two, BM = 128),
S K/V ring stages; ``np``: one program per tile instead of the persistent grid (what persistence
alone buys); ``cC``: C programs per SM (registers capped to fit); ``ov``: FlashAttention-3's
in-warpgroup overlap, S_j = Q K_j^T issued before P_{j-1} V_{j-1} and the softmax of S_j computed
while that second wgmma runs (without it each wgmma is waited on at once).

``--compile-only`` needs no GPU: it compiles every variant for sm_90 with a stand-in driver
(as inspect_kernels.py does) and prints ok / error, shared memory and registers per variant.

Prints a table; with --out writes gluon_probe_<seq>.json.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import triton

__all__ = ["main", "probe_forward", "compile_sm90", "Variant", "VARIANTS", "parse_variant", "GLUON_ERROR"]

from sparseflash.cmdline import ArgumentParser, run_command
from sparseflash.flash.hopper.common import GLUON_ERROR  # the package's guarded gluon import, shared

if GLUON_ERROR is None:
    from sparseflash.flash.hopper.common import (fence_async_shared, gl, gluon, mbarrier,  # noqa: F401
                                                 warpgroup_mma, warpgroup_mma_wait)
    from sparseflash.flash.hopper.common import tma_load as _tma_load

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MASK_BLOCK = 128  # the probe takes square mask blocks of 128 (and dense = every 128-block)
LOADER_REGS = 40  # register budget of the 1-warp loader partition (setmaxnreg; 24 is the floor)

if GLUON_ERROR is None:
    _MB = gl.constexpr(MASK_BLOCK)  # module constants a kernel reads must be constexpr objects
    _LN2 = gl.constexpr(LN2)

    @gluon.constexpr_function
    def _list_layout(nb_p2, warps):
        # a q-block row's block list, spread over the 32 lanes (replicated over warps): counting
        # its entries is a warp reduction with no shared memory
        return gl.BlockedLayout([max(1, nb_p2 // 32)], [32], [warps], [0])

    @gluon.jit
    def _row_blocks(KV_IDX, bh, pm, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im,
                    BLOCK_M: gl.constexpr, NB_P2: gl.constexpr, DENSE: gl.constexpr, WARPS: gl.constexpr):
        """(pointer to tile (bh, pm)'s block list, number of key blocks of 128 it lists)."""
        if DENSE:
            p_list = KV_IDX
            n_blk = seq // _MB
        else:
            p_list = (KV_IDX + (bh // n_heads) * stride_ib + (bh % n_heads) * stride_ih
                      + (pm * BLOCK_M // _MB) * stride_im)
            offs = gl.arange(0, NB_P2, layout=_list_layout(NB_P2, WARPS))
            blocks = gl.load(p_list + offs, mask=offs < n_kblocks, other=n_kblocks)
            n_blk = gl.sum((blocks < n_kblocks).to(gl.int32), axis=0)
        return p_list, n_blk

    @gluon.jit
    def _loader(desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                KV_IDX, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im, n_tiles, m_tiles,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NB_P2: gl.constexpr, DENSE: gl.constexpr,
                STAGES: gl.constexpr):
        """1 warp: TMA loads of Q (2 buffers) and K/V (STAGES ring) for every tile of this program."""
        SUB: gl.constexpr = _MB // BLOCK_N
        it = 0  # K/V loads issued by this program so far, over all its tiles: ring slot and phase
        n_done = 0  # tiles started so far: Q buffer and phase
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            bh = t // m_tiles
            pm = t % m_tiles
            row0 = bh * seq  # first row of this (batch, head) in the [B*H*seq, D] views
            qi = n_done % 2
            # a fresh mbarrier counts as having completed the phase before phase 0, so the first
            # wait on an "empty" barrier (parity 1) passes at once
            mbarrier.wait(q_empty.index(qi), ((n_done // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qi), desc_q.block_type.nbytes)
            _tma_load(desc_q, [row0 + pm * BLOCK_M, 0], q_ready.index(qi), q_bufs.index(qi))
            p_list, n_blk = _row_blocks(KV_IDX, bh, pm, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im,
                                        BLOCK_M, NB_P2, DENSE, 1)
            for j in range(n_blk * SUB):
                if DENSE:
                    start_n = j * BLOCK_N
                else:
                    start_n = gl.load(p_list + j // SUB) * _MB + (j % SUB) * BLOCK_N
                s = it % STAGES
                mbarrier.wait(kv_empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
                _tma_load(desc_k, [row0 + start_n, 0], k_ready.index(s), k_bufs.index(s))
                mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes)
                _tma_load(desc_v, [row0 + start_n, 0], v_ready.index(s), v_bufs.index(s))
                it += 1
            n_done += 1

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE,
                  KV_IDX, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im, n_tiles, m_tiles, qk_scale,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NB_P2: gl.constexpr,
                  DENSE: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, OVERLAP: gl.constexpr):
        """The default partition (WARPS warps): wgmma, online softmax and epilogue of every tile."""
        SUB: gl.constexpr = _MB // BLOCK_N
        # wgmma accumulators: warps stacked along M (16 rows each per instruction); S is
        # [BLOCK_M, BLOCK_N], O is [BLOCK_M, HEAD_DIM]; P feeds the second wgmma from registers
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        rows_o = gl.arange(0, BLOCK_M, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
        rows_s = gl.arange(0, BLOCK_M, layout=row_s)
        it = 0
        n_done = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            bh = t // m_tiles
            pm = t % m_tiles
            n_blk = _row_blocks(KV_IDX, bh, pm, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im,
                                   BLOCK_M, NB_P2, DENSE, WARPS)[1]
            qi = n_done % 2
            mbarrier.wait(q_ready.index(qi), (n_done // 2) & 1)
            q_s = q_bufs.index(qi)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            n_steps = n_blk * SUB
            if OVERLAP:
                # FlashAttention-3's in-warpgroup overlap: step j issues S_j = Q K_j^T, then
                # O += P_{j-1} V_{j-1}, and computes the softmax of S_j while that second wgmma
                # runs; O is rescaled once it has finished. Step 0 only computes S_0 and P_0.
                if n_steps > 0:
                    s = it % STAGES
                    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
                    qk = warpgroup_mma(q_s, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_s))[0]
                    sc = qk * qk_scale
                    m_i = gl.max(sc, axis=1)
                    p = gl.exp2(sc - gl.expand_dims(m_i, 1))
                    l_i = gl.sum(p, axis=1)
                    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                    s_prev = s
                    ph_prev = (it // STAGES) & 1
                    it += 1
                    for j in range(1, n_steps):
                        s = it % STAGES
                        k_s = k_bufs.index(s)
                        v_prev = v_bufs.index(s_prev)
                        mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
                        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                        mbarrier.wait(v_ready.index(s_prev), ph_prev)
                        acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                        # wgmma groups retire in order: S_j is done, P_{j-1} V_{j-1} may still run
                        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_s, k_s))[0]
                        sc = qk * qk_scale
                        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
                        p = gl.exp2(sc - gl.expand_dims(m_new, 1))
                        alpha = gl.exp2(m_i - m_new)
                        l_i = l_i * alpha + gl.sum(p, axis=1)
                        m_i = m_new
                        p_next = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                        # p_op (registers read by the running wgmma) stays live until it retires
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_prev, p_op))[0]
                        p_op = p_next
                        mbarrier.arrive(kv_empty.index(s_prev))
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                        s_prev = s
                        ph_prev = (it // STAGES) & 1
                        it += 1
                    mbarrier.wait(v_ready.index(s_prev), ph_prev)
                    v_prev = v_bufs.index(s_prev)
                    acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_prev, p_op))[0]
                    mbarrier.arrive(kv_empty.index(s_prev))
            else:
                for j in range(n_steps):
                    s = it % STAGES
                    phase = (it // STAGES) & 1
                    k_s = k_bufs.index(s)
                    v_s = v_bufs.index(s)
                    mbarrier.wait(k_ready.index(s), phase)
                    qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_s, k_s))[0]
                    sc = qk * qk_scale  # log2 domain
                    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
                    p = gl.exp2(sc - gl.expand_dims(m_new, 1))
                    alpha = gl.exp2(m_i - m_new)
                    l_i = l_i * alpha + gl.sum(p, axis=1)
                    m_i = m_new
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                    mbarrier.wait(v_ready.index(s), phase)
                    acc = warpgroup_mma(p_op, v_s, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_s))[0]
                    mbarrier.arrive(kv_empty.index(s))  # K and V of slot s are read: the loader may refill it
                    it += 1
            mbarrier.arrive(q_empty.index(qi))
            empty = l_i == 0.0
            l_safe = gl.where(empty, 1.0, l_i)
            o = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
            row0 = bh.to(gl.int64) * seq + pm * BLOCK_M
            o_ptrs = O + (row0 + gl.expand_dims(rows_o, 1)) * HEAD_DIM + gl.expand_dims(cols_o, 0)
            gl.store(o_ptrs, o.to(gl.bfloat16))
            lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * _LN2)
            gl.store(LSE + row0 + rows_s, lse)
            n_done += 1

    @gluon.jit
    def _gluon_fwd(desc_q, desc_k, desc_v, O, LSE, KV_IDX, n_heads, seq, n_kblocks, qk_scale, n_tiles,
                   stride_ib, stride_ih, stride_im,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NB_P2: gl.constexpr,
                   DENSE: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, OVERLAP: gl.constexpr,
                   num_warps: gl.constexpr):
        m_tiles = seq // BLOCK_M
        q_bufs = gl.allocate_shared_memory(desc_q.dtype, [2, BLOCK_M, HEAD_DIM], desc_q.layout)
        k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
        v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        fence_async_shared()  # the barriers' initialisation is visible to TMA before the first load
        gl.warp_specialize([
            (_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, O, LSE,
                         KV_IDX, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im, n_tiles, m_tiles, qk_scale,
                         HEAD_DIM, BLOCK_M, BLOCK_N, NB_P2, DENSE, STAGES, num_warps, OVERLAP)),
            (_loader, (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                       KV_IDX, n_heads, seq, n_kblocks, stride_ib, stride_ih, stride_im, n_tiles, m_tiles,
                       BLOCK_M, BLOCK_N, NB_P2, DENSE, STAGES)),
        ], [1], [LOADER_REGS])


def _maxnreg(num_warps: int, ctas_per_sm: int) -> int | None:
    """Per-thread register cap so ctas_per_sm programs of num_warps consumer warps plus the loader
    (which rounds up to a warpgroup of 4 warps) fit the 64K-register file; None = no cap needed."""
    regs = min(256, 65536 // ((num_warps + 4) * 32 * ctas_per_sm)) // 8 * 8
    return None if regs >= 256 else regs


def probe_forward(q, k, v, mask, var: Variant, num_sms: int | None = None):
    """The probe's forward: (o, lse) for contiguous bf16 [B, H, N, D] inputs and an optional BlockMask."""
    block_m, block_n, num_warps, stages, persistent, ctas_per_sm, overlap = var
    if GLUON_ERROR is not None:
        raise RuntimeError(f"triton.experimental.gluon (hopper) is unavailable: {GLUON_ERROR}")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, N, D = q.shape
    if N % MASK_BLOCK or not q.is_contiguous() or k.shape != q.shape or q.dtype != torch.bfloat16:
        raise ValueError("the probe takes contiguous bf16 self-attention inputs with seq a multiple of 128")
    if D not in (64, 128) or MASK_BLOCK % block_m or MASK_BLOCK % block_n or block_m % (16 * num_warps):
        raise ValueError(f"unsupported tile {block_m}x{block_n} w{num_warps} for head_dim {D}")
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    qv, kv_, vv = (t.view(B * H * N, D) for t in (q, k, v))
    lay_m = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.bfloat16)
    lay_n = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    dq = TensorDescriptor.from_tensor(qv, [block_m, D], lay_m)
    dk = TensorDescriptor.from_tensor(kv_, [block_n, D], lay_n)
    dv = TensorDescriptor.from_tensor(vv, [block_n, D], lay_n)
    if mask is None:
        idx, strides, nb_p2, n_kb = q, (0, 0, 0), 2, N // MASK_BLOCK
    else:
        bq, bk = mask.block_size
        if (bq, bk) != (MASK_BLOCK, MASK_BLOCK):
            raise ValueError(f"the probe needs square mask blocks of {MASK_BLOCK}, got {mask.block_size}")
        idx = mask.index(q.device).kv_idx
        idx = idx.expand(B, H, *idx.shape[-2:])
        strides, nb_p2, n_kb = idx.stride()[:3], triton.next_power_of_2(idx.shape[-1]), idx.shape[-1]
    n_tiles = B * H * (N // block_m)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = min(n_tiles, num_sms * ctas_per_sm) if persistent else n_tiles
    _gluon_fwd[(grid,)](
        dq, dk, dv, o, lse, idx, H, N, n_kb, (D ** -0.5) * LOG2E, n_tiles, *strides,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, NB_P2=max(2, nb_p2), DENSE=mask is None, STAGES=stages,
        LOADER_REGS=LOADER_REGS, OVERLAP=overlap, num_warps=num_warps, maxnreg=_maxnreg(num_warps, ctas_per_sm),
    )
    return o, lse


class Variant(NamedTuple):
    """One probe configuration; ``--variant`` spells it "128x64:w8:s4[:np][:c2][:ov]"."""

    block_m: int  # q tile rows
    block_n: int  # key sub-tile
    warps: int  # consumer warps: 4 = one warpgroup on a 64-row tile, 8 = two sharing a 128-row tile
    stages: int  # K/V ring slots
    persistent: bool = True  # False ("np"): one program per tile (what persistence alone buys)
    ctas: int = 1  # programs per SM ("c2"), registers capped to fit
    overlap: bool = False  # "ov": S_j's softmax runs while P_{j-1} V_{j-1} is on the tensor cores

    @property
    def label(self) -> str:
        return (f"gluon {self.block_m}x{self.block_n} w{self.warps} s{self.stages}"
                f"{'' if self.persistent else ' np'}{f' c{self.ctas}' if self.ctas > 1 else ''}"
                f"{' ov' if self.overlap else ''}")


# Shared memory is 2 Q buffers + STAGES x (K + V): at d=128, 128x64 s4 and 128x128 s2 take 192 KB;
# two programs per SM must fit in 227 KB together. The first H100 run (experiments/studies/gluon/results/, _v1) had
# the first six, without the overlap; the best sparse times came from 64x64 w4 s2 c2.
VARIANTS = [Variant(128, 64, 8, 4), Variant(128, 128, 8, 2), Variant(64, 64, 4, 2, ctas=2),
            Variant(128, 64, 8, 4, overlap=True), Variant(128, 128, 8, 2, overlap=True),
            Variant(64, 64, 4, 2, ctas=2, overlap=True), Variant(64, 64, 4, 3, ctas=2, overlap=True),
            Variant(64, 128, 4, 2, overlap=True)]


def parse_variant(spec: str) -> Variant:
    """"128x64:w8:s4[:np][:c2][:ov]" -> Variant(128, 64, 8, 4, persistent, ctas, overlap)."""
    from sparseflash.experiments.studies.tma.ws_probe import split_spec

    try:
        bm, bn, opts, flags = split_spec(spec, "wsc")
        if not flags <= {"np", "ov"} or not {"w", "s"} <= set(opts) or bm not in (64, 128) or bn not in (64, 128):
            raise ValueError
        if bm < 16 * opts["w"] or opts["w"] not in (4, 8) or opts["s"] < 1 or opts.get("c", 1) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--variant must look like 128x64:w8:s4[:np][:c2][:ov] (tiles 64 or 128, w4 or w8, "
                         f"block_m >= 16 x warps), got {spec!r}") from None
    return Variant(bm, bn, opts["w"], opts["s"], "np" not in flags, opts.get("c", 1), "ov" in flags)


# ---------------------------------------------------------------------------------------------
# compiling for sm_90 without a GPU


def compile_sm90(head_dim: int, var: Variant, dense: bool = False, seq: int = 4096, blocks: int = 3, batch: int = 1, heads: int = 16):
    """Compile the probe kernel for sm_90 on any machine (a stand-in driver, no launch): returns
    the CompiledKernel. Launches the real host path on CPU tensors so the signature, descriptor
    types and integer specialisations are what a GPU run at this shape compiles (triton
    specialises integer arguments equal to 1 or divisible by 16)."""
    import os

    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.patterns import random as random_mask

    if GLUON_ERROR is not None:
        raise RuntimeError(f"triton.experimental.gluon (hopper) is unavailable: {GLUON_ERROR}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: gluon kernels only compile; unset it")
    B, H, N, D = batch, heads, seq, head_dim
    q, k, v = (torch.empty(B, H, N, D, dtype=torch.bfloat16) for _ in range(3))
    mask = None if dense else random_mask(N, blocks, block_size=MASK_BLOCK, seed=0, device="cpu")
    compiled = compile_launches(lambda: probe_forward(q, k, v, mask, var._replace(persistent=True), num_sms=132))
    if "_gluon_fwd" not in compiled:
        raise RuntimeError("the compile hook was not called (kernel already in the cache?)")
    return compiled["_gluon_fwd"]


def _error_text(e: BaseException) -> str:
    """The exception and, for compiler errors, the innermost cause (where the real message is)."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    inner = e
    while inner.__cause__ is not None or (inner.__context__ is not None and not inner.__suppress_context__):
        inner = inner.__cause__ or inner.__context__
    if inner is not e:
        text = text[-1500:] + "\ninnermost: " + "".join(traceback.format_exception_only(type(inner), inner)).strip()
    return text[-2500:]


def compile_only(head_dims, variants, seq: int, blocks: int, as_json: bool) -> int:
    from sparseflash.experiments.bench.inspect_kernels import gluon_report

    rows = []
    for d in head_dims:
        for var in variants:
            for dense in (False, True):
                row = dict(head_dim=d, mask="dense" if dense else f"{blocks}/row", variant=var.label,
                           status="ok", error=None)
                try:
                    row.update(gluon_report(compile_sm90(d, var, dense, seq, blocks)))
                except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
                    row["status"] = "error"
                    row["error"] = _error_text(e)
                rows.append(row)
                if not as_json:
                    if row["error"]:
                        print(f"d={d:3d} {row['mask']:7s} {row['variant']:29s} ERROR: "
                              f"{row['error'].splitlines()[-1][:300]}", flush=True)
                    else:
                        print(f"d={d:3d} {row['mask']:7s} {row['variant']:29s} ok  shared {row['shared'] // 1024:4d} KB"
                              f"  regs {row['regs']}  setmaxnreg {row['setmaxnreg'] or '-'}  stack {row['stack']}"
                              f"  wgmma {row['wgmma']}  tma {row['tma_loads']}", flush=True)
    if as_json:
        print(json.dumps(rows))
    import gc

    gc.collect()  # compiled kernels left to interpreter exit make triton 3.9's bindings report leaks
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def memory_floor(q, mask, density: float) -> dict:
    """The DRAM floor of the call against the time the 80% bar allows it, for the forward and the
    forward+backward of sparseflash.attention on [B, H, N, D] ``q`` (k, v alike) and ``mask``.

    Floor: every input read and every output written once (any implementation pays that much):
    forward Q, K, V in, O and LSE out; backward Q, K, V, O, dO and LSE in, dQ, dK, dV out, plus
    delta written and read. At 4K and density ~0.1 that traffic is a large part of the call, while
    at dense it is hidden under 10x more compute. Bandwidth: a device-to-device copy of q timed
    here (read + write). Bar: the sparse call at 80% of the dense rate, dense ms x density / 0.8.
    All times in GPU time (CUDA-graph replays)."""
    import sparseflash
    from sparseflash.experiments.bench.timing import graph_ms

    B, H, N, D = q.shape
    t_bytes = q.numel() * q.element_size()  # one [B, H, N, D] tensor
    row_bytes = B * H * N * 4  # one fp32 value per query row (LSE, delta)
    buf = torch.empty_like(q)
    copy_ms = graph_ms(lambda: buf.copy_(q))
    bw = 2 * t_bytes / (copy_ms * 1e-3)
    gen = torch.Generator(device=q.device).manual_seed(1)
    qg, kg, vg, do = (torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=gen) for _ in range(4))
    for x in (qg, kg, vg):
        x.requires_grad_()

    def fwd(m):
        with torch.no_grad():
            sparseflash.attention(qg, kg, vg, mask=m)

    def fwd_bwd(m):
        torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=m), (qg, kg, vg), do)

    out = dict(copy_ms=copy_ms, bandwidth_tb_s=bw / 1e12, density=density)
    # The same sparse forward with Q, K and V of every (batch, head) read from one head's memory
    # (stride-0 views, which stay in L2): only O and the LSE still go to DRAM. If the call is
    # bound by its DRAM traffic this one is much faster; if by per-row latency, it is not.
    q1, k1, v1 = (x[:1, :1].detach().expand(B, H, N, D) for x in (qg, kg, vg))
    with torch.no_grad():
        out["l2_inputs_fwd_ms"] = graph_ms(lambda: sparseflash.attention(q1, k1, v1, mask=mask))
        out["l2_inputs_dense_fwd_ms"] = graph_ms(lambda: sparseflash.attention(q1, k1, v1, mask=None))
    out["write_floor_ms"] = (t_bytes + row_bytes) / bw * 1e3
    # The backward alone (launch.bwd: the dQ and dK/dV kernels), normal inputs against the same
    # reads from L2 (stride-0 views of one head for Q, K, V, O, dO, LSE; dQ, dK, dV still written)
    from sparseflash.flash import launch
    from sparseflash.flash.autograd import estimate_work

    idx, mb, scale = mask.index(q.device), mask.block_size[0], D ** -0.5
    work = estimate_work(q, q, density)  # what the public call passes: the same load mode (TMA or pointer)
    with torch.no_grad():
        o, lse = launch.fwd(qg, kg, vg, idx.kv_idx, None, scale, False, mb, mb, 0.0, None, work=work)

    def bwd(qq, kk, vv, oo, ll, dd):
        launch.bwd(dd, qq, kk, vv, oo, ll, None, idx.kv_idx, idx.q_idx, None, scale, False, mb, mb, 0.0, None,
                   work=work)

    def one_head(x):
        return x.detach()[:1, :1].expand(x.shape)

    with torch.no_grad():
        out["bwd_ms"] = graph_ms(lambda: bwd(qg.detach(), kg.detach(), vg.detach(), o, lse, do))
        ins = [one_head(x) for x in (qg, kg, vg, o, lse, do)]
        out["l2_inputs_bwd_ms"] = graph_ms(lambda: bwd(*ins))
    out["bwd_floor_ms"] = (8 * t_bytes + 3 * row_bytes) / bw * 1e3
    out["bwd_write_floor_ms"] = (3 * t_bytes + row_bytes) / bw * 1e3
    for name, fn, n_bytes in (("fwd", fwd, 4 * t_bytes + row_bytes), ("fwd_bwd", fwd_bwd, 12 * t_bytes + 3 * row_bytes)):
        dense_ms, sparse_ms = graph_ms(lambda: fn(None)), graph_ms(lambda: fn(mask))
        floor_ms = n_bytes / bw * 1e3
        bar_ms = dense_ms * density / 0.8
        out[name] = dict(bytes=n_bytes, floor_ms=floor_ms, dense_ms=dense_ms, sparse_ms=sparse_ms, bar_ms=bar_ms,
                         ideal_ms=dense_ms * density)
    return out


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.gluon.gluon_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=3, help="key blocks of 128 per q-block row of the sparse mask")
    ap.add_argument("--variant", action="append", default=None, metavar="SPEC",
                    help="a probe variant, 128x64:w8:s4[:np][:c2][:ov] (repeatable; default: the built-in list); "
                         "np: one program per tile instead of persistent; c2: two programs per SM; "
                         "ov: softmax overlapped with the previous step's P V wgmma")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile every variant for sm_90 and report shared memory and registers")
    ap.add_argument("--json", action="store_true", help="with --compile-only: print the rows as JSON")
    ap.add_argument("--floor-only", action="store_true", help="only sparseflash and the DRAM floor, no Gluon variants")
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant] if args.variant else VARIANTS
        variants = [] if args.floor_only else variants
    except ValueError as e:
        ap.error(str(e))
    if args.seq % MASK_BLOCK:
        ap.error("--seq must be a multiple of 128")
    if GLUON_ERROR is not None:
        ap.error(f"needs triton.experimental.gluon with its hopper module: {GLUON_ERROR}")
    if args.compile_only:
        return compile_only(args.head_dims, variants, args.seq, args.blocks, args.json)

    import sparseflash
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.tma.ws_probe import print_dense_rates
    from sparseflash.patterns import random as random_mask

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --compile-only)")
    if torch.cuda.get_device_capability()[0] != 9:
        ap.error("the probe's kernel is Hopper-only (wgmma): needs an sm_90 GPU")
    N, H = args.seq, 16
    B = max(1, 16384 // N)
    rows = []
    torch.manual_seed(0)
    sparse = random_mask(N, args.blocks, block_size=MASK_BLOCK, seed=0, device="cuda")
    floors = {}
    for d in args.head_dims:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        floors[d] = memory_floor(q, sparse, args.blocks / (N // MASK_BLOCK))
        for name, mask in (("dense", None), (f"{args.blocks}/row", sparse)):
            with torch.no_grad():
                ref, ref_lse = sparseflash.attention(q, k, v, mask=mask, return_lse=True)
                base_ms = graph_ms(lambda: sparseflash.attention(q, k, v, mask=mask))
            rows.append(dict(head_dim=d, mask=name, variant="sparseflash", ms=base_ms, max_diff=0.0, error=None))
            print(f"d={d} {name:7s} {'sparseflash':29s} {base_ms:.4f} ms", flush=True)
            for var in variants:
                label = var.label
                row = dict(head_dim=d, mask=name, variant=label, **var._asdict(), ms=None, max_diff=None, lse_diff=None,
                           error=None)
                try:
                    o, lse = probe_forward(q, k, v, mask, var)
                    torch.cuda.synchronize()
                    row["max_diff"] = float((o.float() - ref.float()).abs().max())
                    fin = torch.isfinite(ref_lse)
                    same_inf = bool(torch.equal(fin, torch.isfinite(lse)))
                    row["lse_diff"] = float((lse[fin] - ref_lse[fin].float()).abs().max()) if same_inf else float("inf")
                    row["ms"] = graph_ms(lambda: probe_forward(q, k, v, mask, var))
                    print(f"d={d} {name:7s} {label:29s} {row['ms']:.4f} ms ({100 * base_ms / row['ms']:.0f}% of "
                          f"sparseflash's speed), max |diff| {row['max_diff']:.2e}"
                          f", lse {row['lse_diff']:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
                    row["error"] = _error_text(e)
                    print(f"d={d} {name:7s} {label:29s} FAILED: {row['error'].splitlines()[-1][:200]}", flush=True)
                rows.append(row)
    base = {(r["head_dim"], r["mask"]): r["ms"] for r in rows if r["variant"] == "sparseflash"}
    print(f"\n{'d':>3s} {'mask':7s} {'variant':29s} {'ms':>8s} {'vs sparseflash':>14s} {'max |diff|':>10s}")
    for r in rows:
        if r["variant"] == "sparseflash":
            continue
        if r["ms"] is None:
            print(f"{r['head_dim']:3d} {r['mask']:7s} {r['variant']:29s} {'failed':>8s}")
            continue
        print(f"{r['head_dim']:3d} {r['mask']:7s} {r['variant']:29s} {r['ms']:8.4f} "
              f"{100 * base[(r['head_dim'], r['mask'])] / r['ms']:13.0f}% {r['max_diff']:10.2e}")
    print_dense_rates(rows, args.head_dims, args.blocks, N, 29)
    print("\nDRAM floor (each input read and each output written once; bandwidth of a copy measured here)\n"
          "against the time the 80% bar allows the sparse call (dense x density / 0.8), sparseflash, GPU time:")
    for d, f in floors.items():
        for name in ("fwd", "fwd_bwd"):
            r = f[name]
            print(f"  d={d} {name:7s} {r['bytes'] / 2**20:5.0f} MiB at {f['bandwidth_tb_s']:.2f} TB/s: floor "
                  f"{r['floor_ms']:.4f} ms = {100 * r['floor_ms'] / r['bar_ms']:.0f}% of the bar's {r['bar_ms']:.4f} ms "
                  f"({100 * r['floor_ms'] / r['ideal_ms']:.0f}% of the ideal {r['ideal_ms']:.4f}); sparse {r['sparse_ms']:.4f} "
                  f"ms, dense {r['dense_ms']:.4f}")
        print(f"  d={d} fwd with Q, K, V read from L2 (one head's memory for all; O still written, floor "
              f"{f['write_floor_ms']:.4f} ms): sparse {f['l2_inputs_fwd_ms']:.4f} ms against {f['fwd']['sparse_ms']:.4f}, "
              f"dense {f['l2_inputs_dense_fwd_ms']:.4f} against {f['fwd']['dense_ms']:.4f}")
        print(f"  d={d} sparse bwd alone (floor {f['bwd_floor_ms']:.4f} ms): {f['bwd_ms']:.4f} ms; with Q, K, V, O, dO, "
              f"LSE read from L2 (floor {f['bwd_write_floor_ms']:.4f}): {f['l2_inputs_bwd_ms']:.4f} ms")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gluon_probe_{N}.json").write_text(json.dumps({"meta": environment(torch.device("cuda")),
                                                              "args": vars(args), "rows": rows, "memory_floor": floors},
                                                             indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
