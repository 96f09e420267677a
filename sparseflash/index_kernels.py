"""One Triton launch from key-block ids to a per-call mask's index form (`BlockMask.from_indices`).

Input: ``ids [B', H', QB, K]`` (any integer dtype, any strides; -1 = none, duplicates and any
order allowed; an id outside ``[0, KB)`` is ignored). Output, all on the ids' device, exactly what
`sparseflash.mask.ranked_lists` / `sorted_nonzero` give for the layout the ids mean:

- ``layout [B', H', QB, KB]`` bool;
- rows: ``kv_num [B', H', QB]`` int32, ``kv_idx [B', H', QB, KB]`` int32: the row's key blocks in
  increasing order, then the padding KB;
- columns: ``q_num [B', H', KB]``, ``q_idx [B', H', KB, QB]``: the transpose, padding QB.

Algorithm (membership by comparison, no sort and no layout round trip): one program per list,
grid ``(QB + KB, B' * H')``. A row program loads its K ids once and asks of every key block j, a
chunk of BLOCK_J at a time, whether any id equals j (a [BLOCK_J, BLOCK_K] compare and a max);
a column program asks of every query block i whether any id of row i equals its j (a
[BLOCK_I, BLOCK_K] tile of ids per chunk). Pass 1 counts the hits n; pass 2 writes each entry
once: the t-th hit at place t (so the list is sorted and duplicates collapse), the t-th miss at
place n + t with the padding value, so the list's every slot is written by exactly one lane (no
fill before, no ordering between stores). Row programs also write the layout row. The work is
``2 (QB KB K)`` compares per list kind, a few microseconds at 128 x 128 blocks, K = 16.

Caveats: K is padded to a power of two in registers (`MAX_K` bounds it; wider ids take the
torch path in `sparseflash.mask`); this is an index builder, not an attention kernel: it never
reads q, k or v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lists_from_ids", "takes", "MAX_K", "ON_CPU", "topk_ids", "select_takes", "MAX_SELECT_KB", "pool_pair"]

# `BlockMask.from_indices` takes this kernel for CUDA ids; ON_CPU = True also for CPU ids (the kernel
# then runs under TRITON_INTERPRET=1: tests and the host-cost study; the torch ops are faster on a CPU)
ON_CPU = False

# widest id list the kernel holds in registers (ids wider than this take the torch path)
MAX_K = 1024
# elements of one compare tile ([BLOCK_J or BLOCK_I, BLOCK_K])
_TILE_ELEMS = 4096


@triton.jit
def _row_hits(b_ids, m_k, j0, KB, BLOCK_J: tl.constexpr):
    """Key blocks j0 .. j0 + BLOCK_J: (their ids, whether any of the row's ids ``b_ids [BLOCK_K]``
    (valid lanes ``m_k``) names each one, 0 past KB)."""
    o_j = j0 + tl.arange(0, BLOCK_J)
    b_hit = tl.max(((b_ids[None, :] == o_j[:, None]) & m_k[None, :]).to(tl.int32), axis=1)  # [BLOCK_J]
    return o_j, tl.where(o_j < KB, b_hit, 0)


@triton.jit
def _col_hits(p_ids, i_j, q0, QB, stride_iq, stride_ik, o_k, m_k, BLOCK_I: tl.constexpr):
    """Query blocks q0 .. q0 + BLOCK_I: (their ids, whether the row of ids of each names key block
    i_j, 0 past QB)."""
    o_i = q0 + tl.arange(0, BLOCK_I)
    m_ik = (o_i < QB)[:, None] & m_k[None, :]  # (unsigned ids read "other" as a large id: mask the compare too)
    b_ids = tl.load(p_ids + o_i[:, None].to(tl.int64) * stride_iq + o_k[None, :] * stride_ik, mask=m_ik,
                    other=0)  # [BLOCK_I, BLOCK_K]
    return o_i, tl.max(((b_ids == i_j) & m_ik).to(tl.int32), axis=1)  # [BLOCK_I]


@triton.jit
def _lists_kernel(IDS, LAYOUT, KV_NUM, KV_IDX, Q_NUM, Q_IDX,
                  stride_ib, stride_ih, stride_iq, stride_ik, H, QB, KB, K,
                  BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    p_ids = IDS + i_b.to(tl.int64) * stride_ib + i_h.to(tl.int64) * stride_ih
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    if i_p < QB:  # a row list: the key blocks of query block i
        i_q = i_p
        # [BLOCK_K]; padding lanes are masked out of every compare (unsigned ids would read -1 as a large id)
        b_ids = tl.load(p_ids + i_q.to(tl.int64) * stride_iq + o_k * stride_ik, mask=m_k, other=0)
        n = 0
        for j0 in range(0, KB, BLOCK_J):
            _, b_hit = _row_hits(b_ids, m_k, j0, KB, BLOCK_J)
            n += tl.sum(b_hit, axis=0)
        row = (i_bh.to(tl.int64) * QB + i_q) * KB
        hits = 0
        for j0 in range(0, KB, BLOCK_J):
            o_j, b_hit = _row_hits(b_ids, m_k, j0, KB, BLOCK_J)
            m_j = o_j < KB
            c_hit = tl.cumsum(b_hit, axis=0)
            c_miss = (o_j - j0 + 1) - c_hit  # misses up to and including this lane
            o_pos = tl.where(b_hit > 0, hits + c_hit - 1, n + (j0 - hits) + c_miss - 1)
            tl.store(KV_IDX + row + o_pos, tl.where(b_hit > 0, o_j, KB), mask=m_j)
            tl.store(LAYOUT + row + o_j, b_hit.to(tl.uint8), mask=m_j)
            hits += tl.sum(b_hit, axis=0)
        tl.store(KV_NUM + i_bh.to(tl.int64) * QB + i_q, n)
    else:  # a column list: the query blocks whose ids hold key block j
        i_j = i_p - QB
        n = 0
        for q0 in range(0, QB, BLOCK_I):
            _, b_hit = _col_hits(p_ids, i_j, q0, QB, stride_iq, stride_ik, o_k, m_k, BLOCK_I)
            n += tl.sum(b_hit, axis=0)
        col = (i_bh.to(tl.int64) * KB + i_j) * QB
        hits = 0
        for q0 in range(0, QB, BLOCK_I):
            o_i, b_hit = _col_hits(p_ids, i_j, q0, QB, stride_iq, stride_ik, o_k, m_k, BLOCK_I)
            c_hit = tl.cumsum(b_hit, axis=0)
            c_miss = (o_i - q0 + 1) - c_hit
            o_pos = tl.where(b_hit > 0, hits + c_hit - 1, n + (q0 - hits) + c_miss - 1)
            tl.store(Q_IDX + col + o_pos, tl.where(b_hit > 0, o_i, QB), mask=o_i < QB)
            hits += tl.sum(b_hit, axis=0)
        tl.store(Q_NUM + i_bh.to(tl.int64) * KB + i_j, n)


def _launch(device: torch.device, kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` on ``device`` (Triton launches on the current one), as a bound
    launch (`sparseflash.flash.binding.call`)."""
    # (not at import: the mask module imports this one, and sparseflash.flash imports the mask module)
    from sparseflash.flash.binding import call

    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            call(kernel, grid, *args, **meta)
    else:
        call(kernel, grid, *args, **meta)


def takes(ids: torch.Tensor) -> bool:
    """Whether `BlockMask.from_indices` builds the lists of ``ids [B', H', QB, K]`` here: CUDA ids (CPU
    ones with ON_CPU), K <= MAX_K, outside torch.compile traces (which trace the torch ops and fuse them)."""
    return (ids.is_cuda or (ON_CPU and ids.device.type == "cpu")) and ids.shape[-1] <= MAX_K \
        and not torch.compiler.is_compiling()


def lists_from_ids(ids: torch.Tensor, kb: int):
    """(layout, kv_num, kv_idx, q_num, q_idx) of the 4-D key-block ids ``ids [B', H', QB, K]`` over
    ``kb`` key blocks, in one launch (module docstring). The caller checks types and shapes;
    ``K <= MAX_K``."""
    from sparseflash.flash.operands import next_pow2

    B, H, qb, K = ids.shape
    if K > MAX_K:
        raise ValueError(f"lists_from_ids takes at most {MAX_K} ids per query block, got {K}")
    dev = ids.device
    layout = torch.empty(B, H, qb, kb, dtype=torch.uint8, device=dev)
    kv_num = torch.empty(B, H, qb, dtype=torch.int32, device=dev)
    kv_idx = torch.empty(B, H, qb, kb, dtype=torch.int32, device=dev)
    q_num = torch.empty(B, H, kb, dtype=torch.int32, device=dev)
    q_idx = torch.empty(B, H, kb, qb, dtype=torch.int32, device=dev)
    block_k = next_pow2(max(K, 1))
    rows = max(16, _TILE_ELEMS // block_k)
    block_j = min(rows, next_pow2(kb))
    block_i = min(rows, next_pow2(qb))
    grid = (qb + kb, B * H)
    args = (ids, layout, kv_num, kv_idx, q_num, q_idx, *ids.stride(), H, qb, kb, K)
    _launch(dev, _lists_kernel, grid, *args, BLOCK_J=block_j, BLOCK_I=block_i, BLOCK_K=block_k)
    return layout.view(torch.bool), kv_num, kv_idx, q_num, q_idx


# ----------------------------------------------------------------------------- top-k selection
# `sparseflash.dynamic.topk_indices` from pooled blocks in one launch: per (batch, selection) and
# tile of BLOCK_R query blocks, the scores against every key block (mean over the selection's query
# heads of pooled q . pooled k, float32 products), the blocks the call may not pick set to -inf,
# then the best `width` of each row by repeated max (best first, the lowest block id among equal
# scores), written after the always-on ids. Replaces about ten torch ops (GQA repeat, matmul,
# group mean, masking, topk, count mask, concatenation) with one launch.

# widest key-block count the selection kernel holds a row of scores for (wider: the torch ops)
MAX_SELECT_KB = 256


@triton.jit
def _topk_kernel(QP, KP, FIXED, PER_SEL, OUT,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 n_sel, group, heads_per_kv, QB, KB, n_fixed, width, bq, bk, off, sinks, inv_group,
                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_F: tl.constexpr, CAUSAL: tl.constexpr, HAS_PER_SEL: tl.constexpr):
    i_r = tl.program_id(0)
    i_bs = tl.program_id(1)
    i_b = i_bs // n_sel
    i_s = i_bs % n_sel
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # query blocks [BLOCK_R]
    o_j = tl.arange(0, BLOCK_KB)  # key blocks [BLOCK_KB]
    m_r = o_r < QB
    m_j = o_j < KB
    acc = tl.zeros([BLOCK_R, BLOCK_KB], dtype=tl.float32)
    for g in range(0, group):
        h_q = i_s * group + g
        h_k = h_q // heads_per_kv
        p_q = QP + i_b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh
        p_k = KP + i_b.to(tl.int64) * stride_kb + h_k.to(tl.int64) * stride_kh
        for d0 in range(0, D, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_q = tl.load(p_q + o_r[:, None] * stride_qm + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
            b_k = tl.load(p_k + o_j[:, None] * stride_kn + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
            acc += tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    scores = acc * inv_group
    allowed = m_j[None, :] & (o_j[None, :] >= sinks)  # [1, BLOCK_KB]
    if CAUSAL:
        x = o_r * bq + off  # the first key each query block sees, floor-divided into blocks
        first = tl.where(x >= 0, x // bk, -((bk - 1 - x) // bk))
        first = tl.minimum(tl.maximum(first, 0), KB)
        allowed = allowed & (o_j[None, :] < first[:, None])
    scores = tl.where(allowed, scores, float("-inf"))
    row = (i_bs.to(tl.int64) * QB + o_r) * (n_fixed + width)  # [BLOCK_R]
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < n_fixed
    b_fix = tl.load(FIXED + o_r[:, None] * n_fixed + o_f[None, :], mask=m_r[:, None] & m_f[None, :], other=-1)
    tl.store(OUT + row[:, None] + o_f[None, :], b_fix, mask=m_r[:, None] & m_f[None, :])
    count = width
    if HAS_PER_SEL:
        count = tl.load(PER_SEL + i_s).to(tl.int32)
    for t in range(0, width):
        best = tl.max(scores, axis=1)  # [BLOCK_R]
        pick = tl.argmax(scores, axis=1)
        keep = (best > float("-inf")) & (t < count)
        tl.store(OUT + row + n_fixed + t, tl.where(keep, pick, -1).to(tl.int64), mask=m_r)
        scores = tl.where(o_j[None, :] == pick[:, None], float("-inf"), scores)


# The selection's input, pooled in one launch: per (batch, head, block) of q and of k, the float32
# mean of the block's real tokens (the tail block's over its own), a program each, grid
# ``(Hq * QB + Hk * KB, B)``: the q programs first, then the k ones. `sparseflash.dynamic.pool_blocks`'
# values to float32 rounding (a float32 sum over BLOCK_T-token chunks, then one division),
# in place of two reductions, their reshapes and, for a tail block, a padded copy.
@triton.jit
def _pool_one(X, XP, i_b, i_h, i_j, H, NB, N, block, stride_b, stride_h, stride_n, stride_d,
              D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    t0 = i_j * block
    t1 = tl.minimum(t0 + block, N)
    base = X + i_b.to(tl.int64) * stride_b + i_h.to(tl.int64) * stride_h
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(t0, t1, BLOCK_T):
        o_t = c + tl.arange(0, BLOCK_T)
        m_t = o_t < t1
        p = base + o_t[:, None].to(tl.int64) * stride_n + o_d[None, :] * stride_d
        acc += tl.sum(tl.load(p, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32), axis=0)
    out = XP + ((i_b * H + i_h).to(tl.int64) * NB + i_j) * D
    tl.store(out + o_d, acc / (t1 - t0).to(tl.float32), mask=m_d)


@triton.jit
def _pool_kernel(Q, K, QP, KP, Hq, Hk, NQ, NK, QB, KB, bq, bk,
                 stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    i_b = tl.program_id(1)
    if i < Hq * QB:
        _pool_one(Q, QP, i_b, i // QB, i % QB, Hq, QB, NQ, bq, stride_qb, stride_qh, stride_qn, stride_qd,
                  D, BLOCK_T, BLOCK_D)
    else:
        i -= Hq * QB
        _pool_one(K, KP, i_b, i // KB, i % KB, Hk, KB, NK, bk, stride_kb, stride_kh, stride_kn, stride_kd,
                  D, BLOCK_T, BLOCK_D)


def pool_pair(q: torch.Tensor, k: torch.Tensor, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``[B, Hq, ceil(Nq / bq), D]``, float32 ``[B, Hk, ceil(Nk / bk), D]``): the block means
    of ``q [B, Hq, Nq, D]`` and ``k [B, Hk, Nk, D]`` (any strides, one dtype or two), one launch."""
    from sparseflash.flash.operands import cdiv, next_pow2

    B, Hq, NQ, D = q.shape
    Hk, NK = k.shape[1], k.shape[2]
    QB, KB = cdiv(NQ, bq), cdiv(NK, bk)
    qp = torch.empty(B, Hq, QB, D, dtype=torch.float32, device=q.device)
    kp = torch.empty(B, Hk, KB, D, dtype=torch.float32, device=q.device)
    block_d = max(16, next_pow2(D))
    args = (q, k, qp, kp, Hq, Hk, NQ, NK, QB, KB, bq, bk, *q.stride(), *k.stride())
    grid = (Hq * QB + Hk * KB, B)
    _launch(q.device, _pool_kernel, grid, *args, D=D, BLOCK_T=max(16, 4096 // block_d), BLOCK_D=block_d)
    return qp, kp


def select_takes(q: torch.Tensor, kb: int, width: int) -> bool:
    """Whether `topk_ids` selects for ``q``'s call: CUDA (CPU with ON_CPU), a row of at most
    MAX_SELECT_KB key blocks, a top-k to take, outside torch.compile traces (which fuse the torch ops)."""
    return (q.is_cuda or (ON_CPU and q.device.type == "cpu")) and 0 < width <= kb <= MAX_SELECT_KB \
        and not torch.compiler.is_compiling()


def topk_ids(qp: torch.Tensor, kp: torch.Tensor, fixed: torch.Tensor | None, width: int, per_sel: torch.Tensor | None,
             group: int, bq: int, bk: int, seq_q: int, seq_k: int, causal: bool, sinks: int) -> torch.Tensor:
    """int64 ``[B, Hq // group, QB, n_fixed + width]``: the always-on ids ``fixed [QB, n_fixed]`` (or none),
    then the ``width`` best key blocks of each query block by the selection's mean pooled score (-1 past
    the blocks allowed or the selection's count ``per_sel [Hq // group]``). ``qp [B, Hq, QB, D]`` and
    ``kp [B, Hk, KB, D]``: float32 pooled blocks, last dim contiguous."""
    from sparseflash.flash.operands import cdiv, next_pow2

    B, Hq, QB, D = qp.shape
    Hk, KB = kp.shape[1], kp.shape[2]
    n_sel = Hq // group
    n_fixed = 0 if fixed is None else fixed.shape[1]
    out = torch.empty(B, n_sel, QB, n_fixed + width, dtype=torch.int64, device=qp.device)
    block_r = 16
    block_kb = max(16, next_pow2(KB))
    grid = (cdiv(QB, block_r), B * n_sel)

    args = dict(QP=qp, KP=kp, FIXED=out if fixed is None else fixed, PER_SEL=out if per_sel is None else per_sel,
                OUT=out, stride_qb=qp.stride(0), stride_qh=qp.stride(1), stride_qm=qp.stride(2), stride_kb=kp.stride(0),
                stride_kh=kp.stride(1), stride_kn=kp.stride(2), n_sel=n_sel, group=group, heads_per_kv=Hq // Hk, QB=QB,
                KB=KB, n_fixed=n_fixed, width=width, bq=bq, bk=bk, off=seq_k - seq_q, sinks=sinks, inv_group=1.0 / group,
                D=D, BLOCK_R=block_r, BLOCK_KB=block_kb, BLOCK_D=min(64, max(16, next_pow2(D))),
                BLOCK_F=max(2, next_pow2(max(n_fixed, 1))), CAUSAL=causal, HAS_PER_SEL=per_sel is not None)
    _launch(qp.device, _topk_kernel, grid, **args)
    return out
