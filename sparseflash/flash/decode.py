"""Split-KV decoding: a few query tokens (1-16) against a long, possibly paged, KV cache.

Algorithm (flash-decoding): a decode step has too few query rows to fill the GPU with one program
per query block, so the work is spread over the cache instead. A program per ``(split, batch, kv
head)`` reads one contiguous range of the cache once, with the ``seq_q x (nheads // nheads_k)``
query rows of its GQA group stacked as the rows of one tile (the cache is read once per kv head,
not once per query head), runs the online softmax over its range and writes a partial ``(o, lse)``
in float32. A second kernel merges the splits of each row by log-sum-exp:
``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s``. With one split (a short cache or
selection, or ``num_splits=1``) the split kernel stores the answer itself: one launch, no float32
partials written and read back.

Differences from the textbook version:

- Keys are addressed per key, so a paged cache (``block_table``: key ``p`` of batch row ``b`` is
  row ``p % page`` of page ``block_table[b, p // page]``) costs one extra index load per key and
  any page size works; ``batch_idx`` picks the cache row of each batch row.
- Each batch row has its own key range ``[start, end)`` (``cache_leftpad`` or 0; the cache length
  after the append, or the whole cache); causal and window bounds are bottom-right relative to
  ``end`` (query ``t`` of ``seq_q`` sits at position ``end - seq_q + t``). A split's range is cut
  from the keys this batch row can reach, so a short row does not run empty tiles.
- Block-sparse decoding: with ``blocks`` (sorted lists of cache blocks per ``(batch, kv head)`` and
  their counts) a split walks a share of the list instead of a key range; unlisted blocks are
  never read. Every query head of a GQA group shares its kv head's list.
- Rows that attend nothing (a split with no keys, a row beyond every bound) keep a finite pivot:
  their output is 0 and their lse ``-inf``; the combine never computes ``-inf - (-inf)``.

Host side: a `DecodePlan` per call shape (`plan`) holds the split count, every launch argument and
the float32 partials (one set per stream); each launch goes through Triton once and through the
compiled kernel's bound C launcher after. Each row's key end is ``seqlens[b] + seq_add`` (the new
keys), computed in the kernel, so a call launches no index arithmetic of its own. `BoundsCheck`
launches `decode_bounds_kernel`, one program that checks every row's lengths, leftpad, cache row and
page ids and writes a verdict for ``torch._assert_async``: bad values fail on the device, with no host
read. `Append` writes a call's new keys and values into the cache in one launch
(`decode_append_kernel`). For a read without new keys or pages the split kernel writes the bounds
verdict itself (``check_in_split``, on by default since an H200 measured it: no bounds launch), and the
split count spreads the programs evenly over the SMs (``balanced_splits``, on by default: `pick_splits`);
a study turns either off in `OVERRIDES`. A study switch, off by default: ``fused_combine`` (the split
kernel's last program per (batch, kv head) merges the splits: no combine launch; slower on an H200).

Forward only (flash-attn's decode has no backward). `sparseflash.kvcache` validates the inputs,
applies rotary, and holds the plain-PyTorch reference of the same semantics.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import reduce
from operator import or_

import torch
import triton
import triton.language as tl

from sparseflash import _env
from sparseflash.flash import binding
from sparseflash.flash.kernels import block_d
from sparseflash.flash.operands import next_pow2

INTERPRETING = _env.interpreting()


@triton.jit
def decode_split_kernel(
    Q, K, V, strides, n_splits, q_back, seq_add, scale,
    SQ: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    Out=None, stride_o=None, LSE=None, stride_lse=None, O_part=None, LSE_part=None,
    seqlens=None, leftpad=None, batch_idx=None, block_table=None, stride_tb=None, PAGE: tl.constexpr = None,
    alibi=None, stride_ab=None, blk_idx=None, stride_idx=None, blk_cnt=None, stride_cnt=None,
    TILES_PER_BLOCK: tl.constexpr = None, softcap=None, left=None, right=None, Tickets=None,
    BLOCK_S: tl.constexpr = None, Ok=None, bounds=None,
):
    """One split of one (batch row, kv head): program ``(split, batch, kv head)``.

    Q ``[B, seq_q, H, D]``, K and V the cache ``[B_cache, N, Hk, D]`` or pages ``[pages, PAGE, Hk, D]``;
    strides: their strides, one tuple per tensor in its own dimension order (Q: batch, token, head,
    column; K, V: batch or page, row, head, column). A program reads its GQA group's ``SQ x G``
    query rows; q_back: the query tokens of later chunks (other launches) after this launch's.
    Every optional part is None when off (a constexpr: no code, no parameter), its flag derived here:
    - outputs: with one split ``Out`` ``[B, seq_q, H, D]`` (strides stride_o, as Q's) and, if the lse
      is wanted, ``LSE`` float32 ``[B, H, seq_q]`` (stride_lse: batch, head, token) hold the answer;
      with several, ``O_part``, ``LSE_part``: the float32 partials ``[B, Hk, splits, rows, D]`` and
      ``[B, Hk, splits, rows]`` that `decode_combine_kernel` merges (then Out and LSE are None);
    - seqlens: the rows' key ends ``seqlens[b] + seq_add`` (None: ``seq_add``); leftpad: their
      starts (None: 0); batch_idx: the cache row of each batch row (None: ``b``);
    - block_table (paged cache, batch stride stride_tb): key ``p`` is row ``p % PAGE`` of page
      ``block_table[b, p // PAGE]``;
    - alibi: float32 slopes ``[B or 1, H]`` (batch stride stride_ab, 0 for one row shared);
    - blk_idx, blk_cnt (block lists; strides stride_idx, stride_cnt: batch, kv head): the sorted
      cache blocks of each (batch, kv head) and their counts; a block is TILES_PER_BLOCK key tiles;
    - softcap: the cap; left, right: the window's bounds (keys at most ``left`` before / ``right``
      after the query);
    - Tickets (with partials, and Out, LSE as with one split; a study switch, `OVERRIDES`): int32
      ``[B, Hk]`` counters, 0 at the launch; each program takes a ticket after writing its partial
      and the one that draws the last merges the splits of its (batch, kv head) as
      `decode_combine_kernel` does (BLOCK_S its split tile), stores the answer and puts the counter
      back to 0: no combine launch;
    - Ok (with bounds: ``(seq_max, n_rows)``; `sparseflash.kvcache`'s reads, by default; not with
      block_table): int32 ``[1]``, the bounds verdict `decode_bounds_kernel` would write for seqlens,
      leftpad and batch_idx, written by program (0, 0, 0) for ``torch._assert_async`` after the launch;
      meanwhile every program clamps its row's key end to ``seq_max + seq_add`` and its cache row to
      ``[0, n_rows)``, so a bad value reads nothing outside the cache (a good one is unchanged)."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    DIRECT: tl.constexpr = O_part is None  # one split: the answer stored here, no partials
    FUSED: tl.constexpr = Tickets is not None  # several: the last split of a (batch, kv head) merges them
    CHECK: tl.constexpr = Ok is not None  # the bounds checked here (no bounds launch), every read clamped
    PAGED: tl.constexpr = block_table is not None
    SPARSE: tl.constexpr = blk_idx is not None
    stride_q, stride_k, stride_v = strides
    stride_qb, stride_qt, stride_qh, stride_qd = stride_q
    stride_kb, stride_kn, stride_kh, stride_kd = stride_k
    stride_vb, stride_vn, stride_vh, stride_vd = stride_v
    i_s = tl.program_id(0)
    i_b = tl.program_id(1)
    i_hk = tl.program_id(2)
    n_kv_heads = tl.num_programs(2)
    R: tl.constexpr = SQ * G
    # this row's keys [start, end): end = seqlens[b] + seq_add (the new keys), or seq_add (the whole cache)
    start = i_b * 0
    if leftpad is not None:
        start = tl.load(leftpad + i_b)
    end = i_b * 0 + seq_add
    if CHECK:
        seq_max, n_rows = bounds
        if (i_s == 0) & (i_b == 0) & (i_hk == 0):
            tl.store(Ok, _bounds_verdict(tl.num_programs(1), seq_add, seq_max, 64, seqlens, leftpad, batch_idx, n_rows,
                                         None, None, None, None, None, None))
    if seqlens is not None:
        if CHECK:  # (the verdict fails the call after the launch; until then read within the cache)
            end = tl.minimum(tl.load(seqlens + i_b), seq_max) + seq_add
        else:
            end = tl.load(seqlens + i_b) + seq_add
    diag = end - SQ - q_back  # query t sits at key position t + diag (q_back: later queries of other launches)

    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < R
    o_t = o_m // G  # rows are token-major: row = t * G + g
    o_h = i_hk * G + o_m % G
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_q = Q + i_b.to(tl.int64) * stride_qb + o_t[:, None].to(tl.int64) * stride_qt \
        + o_h[:, None].to(tl.int64) * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_PREC == "upcast":
        b_q = b_q.to(tl.float32)
    if alibi is not None:
        b_slope = tl.load(alibi + i_b * stride_ab + o_h, mask=m_m, other=0.0).to(tl.float32)

    # the keys any row of this batch row can reach: [lo, hi)
    lo = start
    hi = end
    if right is not None:
        hi = tl.minimum(hi, SQ - 1 + diag + right + 1)
    if left is not None:
        lo = tl.maximum(lo, diag - left)
    if SPARSE:
        stride_ib, stride_ih = stride_idx
        stride_cb, stride_ch = stride_cnt
        n_units = tl.load(blk_cnt + i_b * stride_cb + i_hk * stride_ch) * TILES_PER_BLOCK
    else:
        first = tl.maximum(lo, 0) // BLOCK_N
        n_units = tl.maximum(tl.cdiv(hi, BLOCK_N) - first, 0)
    per_split = tl.cdiv(n_units, n_splits)
    u0 = i_s * per_split
    u1 = tl.minimum(u0 + per_split, n_units)

    if batch_idx is not None:
        cache_row = tl.load(batch_idx + i_b)
        if CHECK:
            cache_row = tl.minimum(tl.maximum(cache_row, 0), n_rows - 1)
        cache_row = cache_row.to(tl.int64)
    else:
        cache_row = i_b.to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for u in range(u0, u1):
        if SPARSE:
            blk = tl.load(blk_idx + i_b * stride_ib + i_hk * stride_ih + u // TILES_PER_BLOCK)
            tile = blk * TILES_PER_BLOCK + u % TILES_PER_BLOCK
        else:
            tile = first + u
        o_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = (o_n >= lo) & (o_n < hi)
        if PAGED:
            page = tl.load(block_table + i_b * stride_tb + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
            row_k = page * stride_kb + (o_n % PAGE).to(tl.int64) * stride_kn
            row_v = page * stride_vb + (o_n % PAGE).to(tl.int64) * stride_vn
        else:
            row_k = cache_row * stride_kb + o_n.to(tl.int64) * stride_kn
            row_v = cache_row * stride_vb + o_n.to(tl.int64) * stride_vn
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(K + row_k[:, None] + i_hk * stride_kh + o_d[None, :] * stride_kd, mask=m_kv, other=0.0)
        b_v = tl.load(V + row_v[:, None] + i_hk * stride_vh + o_d[None, :] * stride_vd, mask=m_kv, other=0.0)
        if DOT_PREC == "upcast":
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = b_s * scale
        if softcap is not None:  # softcap * tanh(s / softcap), tanh through exp (finite for any s)
            b_e = tl.exp(-2.0 * tl.abs(b_s) / softcap)
            b_th = (1.0 - b_e) / (1.0 + b_e)
            b_s = softcap * tl.where(b_s < 0, -b_th, b_th)
        b_rel = (o_t[:, None] + diag) - o_n[None, :]  # query position - key position
        if alibi is not None:
            b_s = b_s - b_slope[:, None] * tl.abs(b_rel).to(tl.float32)
        m_s = m_n[None, :] & m_m[:, None]
        if right is not None:
            m_s = m_s & (b_rel >= -right)
        if left is not None:
            m_s = m_s & (b_rel <= left)
        b_s = tl.where(m_s, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a finite pivot for rows with no key yet
        b_p = tl.exp(b_s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if DOT_PREC == "upcast":
            acc = acc * alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        m_i = m_new

    has = l_i > 0.0
    b_o = acc / tl.where(has, l_i, 1.0)[:, None]
    b_lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    if DIRECT:  # one split: this is the answer; no partials, no combine launch
        stride_ob, stride_ot, stride_oh, stride_od = stride_o
        p_o = Out + i_b.to(tl.int64) * stride_ob + o_t[:, None].to(tl.int64) * stride_ot \
            + o_h[:, None].to(tl.int64) * stride_oh + o_d[None, :] * stride_od
        tl.store(p_o, b_o.to(Out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
        if LSE is not None:
            stride_lb, stride_lh, stride_lt = stride_lse
            tl.store(LSE + i_b.to(tl.int64) * stride_lb + o_h * stride_lh + o_t * stride_lt, b_lse, mask=m_m)
    else:
        # partials [B, Hk, S, R, D] and [B, Hk, S, R]
        base = ((i_b * n_kv_heads + i_hk) * n_splits + i_s).to(tl.int64) * R
        tl.store(O_part + (base + o_m[:, None]) * HEAD_DIM + o_d[None, :], b_o, mask=m_m[:, None] & m_d[None, :])
        tl.store(LSE_part + base + o_m, b_lse, mask=m_m)
        if FUSED:
            # Every program, an empty split's too, writes its partial and then takes a ticket, so the one
            # that draws n_splits - 1 comes after every partial of its (batch, kv head) is written. On the
            # GPU: the barrier orders all this program's threads' partial stores before the ticket, whose
            # acq_rel atomic (one thread, gpu scope) releases them and acquires the others' (the pattern of
            # a serial split-K reduction's semaphore); Triton shares the ticket with the other threads
            # through shared memory behind a barrier, and the partials are read at L2 (.cg), never from
            # an L1 line an earlier call left. The interpreter runs programs one after another, so only
            # the GPU tests check this ordering.
            tl.debug_barrier()
            p_t = Tickets + i_b * n_kv_heads + i_hk
            ticket = tl.atomic_add(p_t, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                i_bh = i_b * n_kv_heads + i_hk
                BLOCK_W: tl.constexpr = merge_rows(BLOCK_S, BLOCK_M, BLOCK_N)
                for i_r in range(R):  # the combine kernel's arithmetic, row by row: bitwise its answer
                    out, lse = _merge_row(O_part, LSE_part, i_bh, i_r, n_splits, R, HEAD_DIM, BLOCK_S, ".cg", BLOCK_W)
                    _store_row(Out, stride_o, LSE, stride_lse, i_b, i_hk, i_r, out, lse, G, HEAD_DIM)
                tl.store(p_t, 0)  # the next call, or a CUDA graph's next replay, counts from 0 again


@triton.constexpr_function
def merge_rows(block_s, block_m, block_n):
    """Rows of the fused merge's tile of partial outputs (`decode_split_kernel`'s Tickets): BLOCK_S
    doubled until it differs from the split kernel's other tiles of BLOCK_D columns (BLOCK_M query
    rows, BLOCK_N keys). Triton gives every memory access of one shape in a kernel the widest
    per-thread vector among them: a [BLOCK_N, BLOCK_D] tile of partials would take the 16-bit key
    tile's 8 columns a thread, so its rows would be spread over other threads and summed in another
    order than `decode_combine_kernel`'s. Padded with empty splits (weight 0) to a shape of its own,
    it gets the combine's layout, the same partial sums in each thread, then added zeros."""
    rows = block_s
    while rows in (block_m, block_n):
        rows *= 2
    return rows


@triton.jit
def _merge_row(O_part, LSE_part, i_bh, i_r, n_splits, R: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_S: tl.constexpr, CACHE: tl.constexpr, BLOCK_W: tl.constexpr):
    """``(o [BLOCK_D] float32, lse)`` of row i_r of (batch * kv heads) i_bh from its splits' partials
    (`decode_split_kernel`'s layout): ``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse)
    o_s``; 0 and -inf for a row no split attends. BLOCK_S: the splits' tile; BLOCK_W (>= BLOCK_S) the
    rows of the partial outputs' tile (`merge_rows`); CACHE: the partials' loads' cache modifier."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < n_splits
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    rows = (i_bh * n_splits + o_s).to(tl.int64) * R + i_r  # [BLOCK_S]
    b_lse = tl.load(LSE_part + rows, mask=m_s, other=float("-inf"), cache_modifier=CACHE)
    m = tl.max(b_lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    b_w = tl.exp(b_lse - m_use)  # 0 for empty splits
    total = tl.sum(b_w, 0)
    if BLOCK_W != BLOCK_S:  # the same weights, and 0 for the rows past BLOCK_S
        o_s = tl.arange(0, BLOCK_W)
        m_s = o_s < n_splits
        rows = (i_bh * n_splits + o_s).to(tl.int64) * R + i_r  # [BLOCK_W]
        b_w = tl.exp(tl.load(LSE_part + rows, mask=m_s, other=float("-inf"), cache_modifier=CACHE) - m_use)
    b_o = tl.load(O_part + rows[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0,
                  cache_modifier=CACHE)
    out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    lse = tl.where(total > 0.0, m_use + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _store_row(Out, stride_o, LSE, stride_lse, i_b, i_hk, i_r, out, lse, G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Row i_r (token-major: ``t * G + g``) of batch i_b, kv head i_hk: its output in Out (strides
    stride_o: batch, token, head, column) and, when LSE is not None, its lse (stride_lse: batch, head,
    token)."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    stride_ob, stride_ot, stride_oh, stride_od = stride_o
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    t = i_r // G
    h = i_hk * G + i_r % G
    tl.store(Out + i_b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + o_d * stride_od,
             out.to(Out.dtype.element_ty), mask=m_d)
    if LSE is not None:
        stride_lb, stride_lh, stride_lt = stride_lse
        tl.store(LSE + i_b.to(tl.int64) * stride_lb + h * stride_lh + t * stride_lt, lse)


@triton.jit
def decode_combine_kernel(
    O_part, LSE_part, Out, stride_o, n_splits, n_kv_heads,
    SQ: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    LSE=None, stride_lse=None,
):
    """The answer of one row from its splits' partials (`decode_split_kernel`): program ``(row,
    batch * kv heads)``; Out and stride_o as the split kernel's; LSE (strides stride_lse), None when
    the lse is not wanted."""
    i_r = tl.program_id(0)  # a row of the partials: (batch, kv head, row)
    i_bh = tl.program_id(1)  # batch * kv heads
    R: tl.constexpr = SQ * G
    i_b = i_bh // n_kv_heads
    i_hk = i_bh % n_kv_heads
    out, lse = _merge_row(O_part, LSE_part, i_bh, i_r, n_splits, R, HEAD_DIM, BLOCK_S, "", BLOCK_S)
    _store_row(Out, stride_o, LSE, stride_lse, i_b, i_hk, i_r, out, lse, G, HEAD_DIM)


@triton.jit
def _bounds_verdict(n_batch, seq_add, seq_max, BLOCK_B: tl.constexpr, seqlens, leftpad, batch_idx, n_rows, block_table,
                    stride_tb, n_pages, n_table, PAGE: tl.constexpr, BLOCK_T: tl.constexpr):
    """1 when every batch row's bounds hold, else 0 (int32): `decode_bounds_kernel`'s check, its
    arguments as there (the tensors not checked None), BLOCK_B batch rows read at once."""
    b_bad = tl.zeros([BLOCK_B], tl.int32)
    for b0 in range(0, n_batch, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < n_batch
        if seqlens is not None:
            b_s = tl.load(seqlens + o_b, mask=m_b, other=0)
        else:
            b_s = tl.zeros([BLOCK_B], tl.int32)
        b_ok = (b_s >= 0) & (b_s <= seq_max)
        b_end = tl.where(b_ok, b_s, 0) + seq_add  # (no overflow from a bad length)
        if leftpad is not None:
            b_lp = tl.load(leftpad + o_b, mask=m_b, other=0)
            b_ok = b_ok & (b_lp >= 0) & (b_lp <= b_end)
        if batch_idx is not None:
            b_r = tl.load(batch_idx + o_b, mask=m_b, other=0)
            b_ok = b_ok & (b_r >= 0) & (b_r < n_rows)
        if block_table is not None:
            b_need = (b_end + PAGE - 1) // PAGE  # pages in use
            for t0 in range(0, n_table, BLOCK_T):
                o_t = t0 + tl.arange(0, BLOCK_T)
                m_t = m_b[:, None] & (o_t[None, :] < b_need[:, None]) & (o_t[None, :] < n_table)
                p_t = block_table + o_b[:, None].to(tl.int64) * stride_tb + o_t[None, :]
                b_pg = tl.load(p_t, mask=m_t, other=0)  # [BLOCK_B, BLOCK_T]
                b_out = ((b_pg < 0) | (b_pg >= n_pages)).to(tl.int32)
                b_ok = b_ok & (tl.sum(b_out, 1) == 0)
        b_bad += (m_b & ~b_ok).to(tl.int32)
    return (tl.sum(b_bad, 0) == 0).to(tl.int32)


@triton.jit
def decode_bounds_kernel(
    Ok, n_batch, seq_add, seq_max, BLOCK_B: tl.constexpr,
    seqlens=None, leftpad=None, batch_idx=None, n_rows=None, block_table=None, stride_tb=None, n_pages=None,
    n_table=None, PAGE: tl.constexpr = None, BLOCK_T: tl.constexpr = None,
):
    """``Ok[0] = 1`` when every batch row's bounds hold, else 0 (one program): ``0 <= seqlens[b] <=
    seq_max``; ``0 <= leftpad[b] <= seqlens[b] + seq_add``; ``0 <= batch_idx[b] < n_rows``; the page
    ids ``block_table[b, :ceil((seqlens[b] + seq_add) / PAGE)]`` in ``[0, n_pages)``. Each vector
    checked is None when the call has none (seqlens None: every length 0); n_rows comes with
    batch_idx, and the table's batch stride stride_tb, n_pages, its n_table columns, PAGE and
    BLOCK_T (the columns read at once) with block_table."""
    tl.store(Ok, _bounds_verdict(n_batch, seq_add, seq_max, BLOCK_B, seqlens, leftpad, batch_idx, n_rows, block_table,
                                 stride_tb, n_pages, n_table, PAGE, BLOCK_T))


@triton.jit
def decode_append_kernel(
    K_new, V_new, K, V, seqlens, stride_k_new, stride_v_new, stride_k, stride_v,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    batch_idx=None, block_table=None, stride_tb=None, PAGE: tl.constexpr = None,
):
    """New key and value ``t`` of batch row ``b`` (program ``(t, b)``) written into the cache at position
    ``seqlens[b] + t``: of cache row ``batch_idx[b]`` (None: ``b``), or row ``pos % PAGE`` of page
    ``block_table[b, pos // PAGE]`` (given with its batch stride stride_tb and PAGE). Strides one tuple
    per tensor in its dimension order (batch, token or row, head, column). (The bounds are checked
    before: `decode_bounds_kernel`.)"""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    stride_nb, stride_nt, stride_nh, stride_nd = stride_k_new
    stride_wb, stride_wt, stride_wh, stride_wd = stride_v_new
    stride_kb, stride_kn, stride_kh, stride_kd = stride_k
    stride_vb, stride_vn, stride_vh, stride_vd = stride_v
    i_t = tl.program_id(0)
    i_b = tl.program_id(1)
    pos = (tl.load(seqlens + i_b) + i_t).to(tl.int64)
    if block_table is not None:
        page = tl.load(block_table + i_b.to(tl.int64) * stride_tb + pos // PAGE).to(tl.int64)
        row_k = page * stride_kb + (pos % PAGE) * stride_kn
        row_v = page * stride_vb + (pos % PAGE) * stride_vn
    else:
        if batch_idx is not None:
            cache_row = tl.load(batch_idx + i_b).to(tl.int64)
        else:
            cache_row = i_b.to(tl.int64)
        row_k = cache_row * stride_kb + pos * stride_kn
        row_v = cache_row * stride_vb + pos * stride_vn
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_hd = (o_h[:, None] < N_HEADS) & (o_d[None, :] < HEAD_DIM)
    i_bt = i_b.to(tl.int64)
    b_k = tl.load(K_new + i_bt * stride_nb + i_t * stride_nt + o_h[:, None] * stride_nh + o_d[None, :] * stride_nd,
                  mask=m_hd)  # [BLOCK_H, BLOCK_D]
    tl.store(K + row_k + o_h[:, None] * stride_kh + o_d[None, :] * stride_kd, b_k, mask=m_hd)
    b_v = tl.load(V_new + i_bt * stride_wb + i_t * stride_wt + o_h[:, None] * stride_wh + o_d[None, :] * stride_wd,
                  mask=m_hd)
    tl.store(V + row_v + o_h[:, None] * stride_vh + o_d[None, :] * stride_vd, b_v, mask=m_hd)


# Launch settings of the split kernel, overridable by a study (experiments/studies/decode_splits): keys
# "num_warps", "num_stages", "block_n" (the key tile, dense caches only). Switches of the launches per call
# and the split count (experiments/studies/decode_host), read with their defaults (`SWITCH_DEFAULTS`):
# "check_in_split" (`sparseflash.kvcache`: a read without new keys or pages has its bounds checked by the
# split kernel: no bounds launch) and "balanced_splits" (`pick_splits`), on by default since an H200
# measured them (fdc55a7: check as fast on the GPU, less host time; balanced 9-12% less GPU time at batch
# 4, the same elsewhere); a study sets either False for the previous behaviour. "fused_combine" (with
# several splits the split kernel merges them itself: no combine launch), off: slower on the H200. Empty in
# normal use (then every switch is its default; a plan's key holds OVERRIDES' items).
OVERRIDES: dict = {}
SWITCH_DEFAULTS = {"check_in_split": True, "balanced_splits": True, "fused_combine": False}


@contextmanager
def overridden(overrides: dict):
    """`OVERRIDES` set to exactly ``overrides`` inside the block, restored after (a study's or a test's
    variant; normal calls leave OVERRIDES empty)."""
    saved = dict(OVERRIDES)
    OVERRIDES.clear()
    OVERRIDES.update(overrides)
    try:
        yield
    finally:
        OVERRIDES.clear()
        OVERRIDES.update(saved)


def switch(name: str) -> bool:
    """Whether the decode switch ``name`` (a key of `SWITCH_DEFAULTS`) is on: OVERRIDES' value, else its
    default."""
    return bool(OVERRIDES.get(name, SWITCH_DEFAULTS[name]))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 under the interpreter: splits are exercised)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_splits(batch: int, kv_heads: int, n_units: int, device: torch.device, min_units: int = 4) -> int:
    """num_splits=0: enough programs for about two waves over the SMs, each split keeping at least
    ``min_units`` tiles (so short caches are not cut into tiles of overhead); at most 128.

    Then, balanced (the switch ``balanced_splits``, on unless ``OVERRIDES["balanced_splits"]`` is False):
    the fewest splits from that count up (to 4x it) whose programs spread over the SMs within 5% of evenly
    (programs / SMs at least 0.95 of its ceiling), where some do. The programs of a read are all resident
    at once, so an SM given one more than the others sets the time: batch 4 x 8 kv heads with 9 splits is
    288 programs, 2.18 an SM (some 3, some 2: 27% longer than even); 12 splits, 2.91 an SM. On an H200
    (132 SMs) this changes batch 4 only among the decode bench's points, and cut its GPU time 9-12%
    (experiments/studies/decode_host, results/h200_switches)."""
    programs = batch * kv_heads
    sms = sm_count(device)
    top = min(n_units // min_units if n_units >= min_units else 1, 128)
    want = max(1, min(math.ceil(2 * sms / programs), top))
    if switch("balanced_splits"):
        for s in range(want, min(4 * want, top) + 1):
            if programs * s / sms >= 0.95 * math.ceil(programs * s / sms):
                return s
    return want


def decode_block_n(block_size: int | None, block_d: int = 128) -> int:
    """The key tile: 64 (32 for head dims over 128, whose K and V tiles and accumulator would crowd
    the registers), or the largest power of two (>= 16) up to that dividing the mask's cache block."""
    top = 64 if block_d <= 128 else 32
    if block_size is None:
        return top
    for n in (64, 32, 16):
        if n > top:
            continue
        if block_size % n == 0:
            return n
    raise ValueError(f"mask: the cache block size must be a multiple of 16 for the decode kernel, got {block_size}")


# ----------------------------------------------------------------------------- plans
# A decode call is short (tens of µs on the GPU at batch 1), so its host cost sets an eager decode
# loop's pace. Everything a launch derives from shapes, strides, dtypes and flags (tiles, the split
# count, every scalar and constexpr, the grid) is a `DecodePlan` built once per key (`plan`); a call
# then allocates its outputs, takes its workspace and launches. Each launch goes through Triton once,
# then straight through the compiled kernel's C launcher (`binding.bind`; as `launch.run` does for the
# attention kernels' plans), keyed by the only things Triton specialises on that the plan key does
# not fix: the device and each tensor's 16-byte alignment.

PLANS: dict = {}
_PLANS_MAX = 256

# the split kernel's tensor parameters, in the order `DecodePlan.__call__` passes them
_SPLIT_TENSORS = ("Q", "K", "V", "O_part", "LSE_part", "Out", "LSE", "seqlens", "leftpad", "batch_idx",
                  "block_table", "alibi", "blk_idx", "blk_cnt", "Tickets", "Ok")


def bound_launches(device: torch.device) -> bool:
    """Whether plans on ``device`` may launch through bound C launchers (CUDA, not the interpreter;
    `binding.FAST_LAUNCH` and idle launch hooks are asked per call). Tools that time the host path
    on a CPU, with the kernels stubbed, replace this function."""
    return device.type == "cuda" and not INTERPRETING


class _Launch:
    """One kernel launch of a plan: ``args`` every other argument by parameter name, ``names`` the
    parameters a call fills with its tensors (in the order it passes them); launched by the kernel's
    name in this module (a tool may swap the kernel). The first launch per (device, tensor alignment)
    goes through Triton; with a stream given, the later ones through the bound launcher."""

    __slots__ = ("kernel", "grid", "names", "args", "bound")

    def __init__(self, kernel: str, grid: tuple, names: tuple, args: dict):
        self.kernel, self.grid, self.names, self.args = kernel, tuple(grid) + (1,) * (3 - len(grid)), names, args
        self.bound = {}

    def __call__(self, stream, device_index, tensors) -> None:
        if stream is not None:
            ptrs = [t.data_ptr() for t in tensors]
            # (every address 16-byte aligned, the usual case, is one key; else one per alignment pattern)
            key = (device_index, True) if not reduce(or_, ptrs) & 15 else (device_index, *[p & 15 == 0 for p in ptrs])
            bound = self.bound.get(key)
            if bound is not None:
                run_c, function, meta, values, at = bound
                values = list(values)
                for i, j in at:
                    values[i] = ptrs[j]
                g = self.grid
                run_c(g[0], g[1], g[2], stream, function, meta, None, None, None, *values)
                return
        args = dict(self.args)
        args.update(zip(self.names, tensors))
        kernel = globals()[self.kernel]
        compiled = kernel[self.grid](**args)
        if stream is not None:
            try:
                made = binding.bind(kernel, compiled, args)
            except Exception:  # an unexpected Triton: keep its own launch path
                made = None
            if made is not None:
                run_c, function, meta, values, slots = made
                self.bound[key] = (run_c, function, meta, values, tuple((i, self.names.index(n)) for i, n in slots))


def _route(cuda: bool, bindable: bool):
    """(stream, device index) of a call: the current stream, which keys the workspace (None off CUDA),
    and the device index, None unless the call launches bound (then on that stream)."""
    if not (cuda or bindable):
        return None, None
    index = binding.current_device()
    stream = binding.raw_stream(index)
    if not (bindable and binding.FAST_LAUNCH and binding.hooks_idle()):
        return (stream if cuda else None), None
    return stream, index


def _workspace(store: dict, cuda: bool, stream, make):
    """A call's scratch buffers from ``store``, one set per stream (calls on one stream run in order);
    inside a CUDA-graph capture a new set that the graph owns."""
    if cuda and torch.cuda.is_current_stream_capturing():
        return make()
    w = store.get(stream)
    if w is None:
        w = store[stream] = make()
    return w


class DecodePlan:
    """The launches of one decode call shape (`plan`): the split count ``splits``, the query chunks of
    at most ``rows`` rows (tokens x GQA group) each with its split launch and, with more than one
    split, its combine launch (one split stores the answer itself: no combine; ``fused``: the split
    kernel merges, `OVERRIDES`), and the scratch made once per stream: the float32 partials and, when
    fused, the tickets, one int32 set per query chunk, 0 when made and after every launch."""

    def __init__(self, q, k_cache, v_cache, *, scale, window, softcap, alibi, batch_idx, block_table, blocks, seqlens,
                 leftpad, seq_add, num_splits, max_len, rows, store_lse, check=False):
        B, SQ, H, D = q.shape
        Hk = k_cache.shape[2]
        G = H // Hk
        self.shape, self.dtype, self.device, self.store_lse = (B, SQ, H, D), q.dtype, q.device, store_lse
        self.cuda, self.bindable = q.device.type == "cuda", bound_launches(q.device)
        step = max(1, rows // G)
        BLOCK_D = max(16, next_pow2(D))
        mask_block = blocks[2] if blocks is not None else None
        BLOCK_N = decode_block_n(mask_block, BLOCK_D)
        if OVERRIDES and mask_block is None:
            BLOCK_N = OVERRIDES.get("block_n", BLOCK_N)
        paged = block_table is not None
        if blocks is not None:
            n_units = blocks[0].shape[-1] * (mask_block // BLOCK_N)
        else:
            n_units = math.ceil(max_len / BLOCK_N)
        S = self.splits = num_splits if num_splits > 0 else pick_splits(B, Hk, n_units, q.device)
        direct = S == 1
        fused = self.fused = not direct and switch("fused_combine")
        if check and paged:
            raise ValueError("check: a paged cache's page ids are checked by decode_bounds_kernel")
        self.check = check
        left, right = window
        prec = "upcast" if q.dtype == torch.float32 or INTERPRETING else "native"  # (interpreter: bf16 dot is wrong)
        # Pipeline depth: a dense cache read in one split per (batch, kv head) (many programs, e.g. batch 64
        # x 8 kv heads) ran faster two stages deep than three: 0.241 against 0.282 ms at B64 x 4K and 0.943
        # against 1.142 at B64 x 16K (H200, bf16, d 128, one query token, GQA 32/8;
        # experiments/studies/decode_splits). Split launches keep three (best there at B1 x 256K, where two is
        # 17% slower); block-sparse reads keep the three they were measured with. Not measured: the other
        # one-split cases this rule also covers (paged caches, several query tokens, d 256, short caches).
        stages = OVERRIDES.get("num_stages", 2 if direct and blocks is None else 3)
        # (the split kernel's optional parameters are given only when on: `decode_split_kernel`)
        present = dict(O_part=not direct, LSE_part=not direct, Out=direct or fused, LSE=(direct or fused) and store_lse,
                       seqlens=seqlens, leftpad=leftpad, batch_idx=batch_idx, block_table=paged,
                       alibi=alibi is not None, blk_idx=blocks is not None, blk_cnt=blocks is not None, Tickets=fused,
                       Ok=check)
        self.take = tuple(i for i, n in enumerate(_SPLIT_TENSORS) if present.get(n, True))
        names = tuple(_SPLIT_TENSORS[i] for i in self.take)
        out_strides = (SQ * H * D, H * D, D, 1)  # out [B, SQ, H, D] and lse [B, H, SQ], made contiguous
        lse_strides = (H * SQ, SQ, 1)
        optional = {}
        if direct or fused:
            optional.update(stride_o=out_strides, **(dict(stride_lse=lse_strides) if store_lse else {}))
        if fused:
            optional.update(BLOCK_S=max(2, next_pow2(S)))  # (the combine kernel's split tile: its sums' order)
        if check:
            optional.update(bounds=(int(max_len - seq_add), k_cache.shape[0]))
        if paged:
            optional.update(stride_tb=block_table.stride(0), PAGE=k_cache.shape[1])
        if alibi is not None:
            optional.update(stride_ab=alibi.stride(0) if alibi.dim() == 2 else 0)
        if blocks is not None:
            idx, cnt = blocks[0], blocks[1]
            optional.update(stride_idx=(idx.stride(0), idx.stride(1)), stride_cnt=(cnt.stride(0), cnt.stride(1)),
                            TILES_PER_BLOCK=mask_block // BLOCK_N)
        if softcap is not None:
            optional.update(softcap=float(softcap))
        if left >= 0:
            optional.update(left=int(left))
        if right >= 0:
            optional.update(right=int(right))
        self.chunks = []
        for t0 in range(0, SQ, step):
            t1 = min(SQ, t0 + step)
            sq, R = t1 - t0, (t1 - t0) * G
            BLOCK_M = max(16, next_pow2(R))
            consts = dict(strides=(tuple(q.stride()), tuple(k_cache.stride()), tuple(v_cache.stride())), n_splits=S,
                          q_back=SQ - t1, seq_add=int(seq_add), scale=float(scale), SQ=sq, G=G, HEAD_DIM=D,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PREC=prec,
                          **optional, num_warps=OVERRIDES.get("num_warps", 4), num_stages=stages)
            split = _Launch("decode_split_kernel", (S, B, Hk), names, consts)
            combine = None
            if not direct and not fused:
                combine = _Launch("decode_combine_kernel", (R, B * Hk),
                                  ("O_part", "LSE_part", "Out") + (("LSE",) if store_lse else ()),
                                  dict(stride_o=out_strides, n_splits=S, n_kv_heads=Hk, SQ=sq, G=G, HEAD_DIM=D,
                                       BLOCK_S=max(2, next_pow2(S)),
                                       **(dict(stride_lse=lse_strides) if store_lse else {}), num_warps=4))
            self.chunks.append((t0, t1, split, combine))
        self.n_part = 0 if direct else B * Hk * S * step * G * D  # partials [B, Hk, S, R, D], then [B, Hk, S, R]
        self.n_lse_part = 0 if direct else B * Hk * S * step * G
        self.n_tickets = B * Hk if fused else 0  # per query chunk
        self.no_tickets = (None,) * len(self.chunks)
        self.scratch = bool(self.n_part or check)
        self.work = {}

    def _scratch(self):
        """(float32 partials, their lse, per query chunk its tickets or None, the bounds verdict or
        None), each part None or empty when the plan has none; the tickets zero-filled."""
        o_part = lse_part = flags = None
        if self.n_part:
            buf = torch.empty(self.n_part + self.n_lse_part, device=self.device, dtype=torch.float32)
            o_part, lse_part = buf[:self.n_part], buf[self.n_part:]
        n, chunks = self.n_tickets, len(self.chunks)
        if n or self.check:
            flags = torch.zeros(n * chunks + self.check, device=self.device, dtype=torch.int32)
        tickets = tuple(flags[i * n:(i + 1) * n] for i in range(chunks)) if n else self.no_tickets
        return o_part, lse_part, tickets, flags[n * chunks:] if self.check else None

    def launches(self) -> list:
        """The plan's launches (their ``bound`` launchers, per alignment, once bound)."""
        return [launch for _, _, split, combine in self.chunks for launch in (split, combine) if launch is not None]

    def route(self) -> tuple:
        """This call's (stream, device index) (`_route`), for the launches of the call that share it."""
        return _route(self.cuda, self.bindable)

    def __call__(self, q, k_cache, v_cache, seqlens=None, leftpad=None, batch_idx=None, block_table=None, alibi=None,
                 blocks=None, route=None):
        """``(out [batch, seq_q, nheads, headdim] in q's dtype, lse float32 [batch, nheads, seq_q] or None
        without ``store_lse``, the bounds verdict int32 [1] for ``torch._assert_async`` or None without
        ``check``)`` of one call; the tensors as the plan was made for (`plan`)."""
        B, SQ, H, D = self.shape
        out = torch.empty(B, SQ, H, D, device=self.device, dtype=self.dtype)
        lse = torch.empty(B, H, SQ, device=self.device, dtype=torch.float32) if self.store_lse else None
        stream, index = route or _route(self.cuda, self.bindable)
        o_part = lse_part = ok = None
        tickets = self.no_tickets
        if self.scratch:
            o_part, lse_part, tickets, ok = _workspace(self.work, self.cuda, stream, self._scratch)
        idx, cnt = (blocks[0], blocks[1]) if blocks is not None else (None, None)
        launch_on = stream if index is not None else None
        one = len(self.chunks) == 1
        for (t0, t1, split, combine), tk in zip(self.chunks, tickets):
            qc, oc, lc = (q, out, lse) if one else (q[:, t0:t1], out[:, t0:t1], None if lse is None else lse[:, :, t0:t1])
            every = (qc, k_cache, v_cache, o_part, lse_part, oc, lc, seqlens, leftpad, batch_idx, block_table, alibi,
                     idx, cnt, tk, ok)
            split(launch_on, index, [every[i] for i in self.take])
            if combine is not None:
                combine(launch_on, index, (o_part, lse_part, oc) if lc is None else (o_part, lse_part, oc, lc))
        return out, lse, ok


def plan(q, k_cache, v_cache, *, scale: float, window: tuple[int, int], softcap: float | None = None,
         alibi: torch.Tensor | None = None, batch_idx: bool = False, block_table: torch.Tensor | None = None,
         blocks: tuple[torch.Tensor, torch.Tensor, int] | None = None, seqlens: bool = True, leftpad: bool = False,
         seq_add: int = 0, num_splits: int = 0, max_len: int | None = None, rows: int = 64,
         store_lse: bool = True, check: bool = False) -> DecodePlan:
    """The `DecodePlan` of a call (made once per key, then shared).

    Args:
        q: ``[batch, seq_q, nheads, headdim]`` (any strides).
        k_cache, v_cache: ``[batch_cache, seqlen_cache, nheads_k, headdim]`` or pages
            ``[num_pages, page, nheads_k, headdim]`` with ``block_table``.
        window: ``(left, right)``, -1 unbounded (flash-attn's causal is ``right = 0``).
        alibi: float32 ``[nheads]`` or ``[batch, nheads]``.
        batch_idx, seqlens, leftpad: whether the call passes those int32 ``[batch]`` tensors: batch row
            ``b`` reads cache row ``batch_idx[b]`` and attends keys ``[leftpad[b], seqlens[b] + seq_add)``
            (without seqlens: ``[leftpad[b], seq_add)``; without leftpad from 0).
        blocks: ``(indices [batch, nheads_k, n_sel] int32 sorted, counts [batch, nheads_k], block_size)``.
        max_len: an upper bound of the rows' key ends (the cache's capacity), for the split count.
        rows: query rows (tokens x GQA group) per launch; longer query blocks run in chunks.
        store_lse: whether the call wants the lse.
        check: the split kernel checks the bounds of seqlens (``<= max_len - seq_add``), leftpad and
            batch_idx (``< k_cache.shape[0]``) and returns the verdict (`decode_split_kernel`'s Ok; no
            paged cache): what `sparseflash.kvcache` asks for a read (its switch ``check_in_split``).
    """
    paged = block_table is not None
    cap = max_len if max_len is not None else (block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1])
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.stride(), float(scale),
           tuple(window), softcap, None if alibi is None else (alibi.shape, alibi.stride()), batch_idx,
           None if block_table is None else (block_table.shape, block_table.stride()),
           None if blocks is None else (blocks[0].shape, blocks[0].stride(), blocks[1].stride(), blocks[2]),
           seqlens, leftpad, seq_add, num_splits, cap, rows, store_lse, check, tuple(sorted(OVERRIDES.items())))
    p = PLANS.get(key)
    if p is None:
        if len(PLANS) >= _PLANS_MAX:
            PLANS.clear()  # a decoder calls with a few shapes; this bounds a sweep over many
        p = PLANS[key] = DecodePlan(q, k_cache, v_cache, scale=scale, window=window, softcap=softcap, alibi=alibi,
                                    batch_idx=batch_idx, block_table=block_table, blocks=blocks, seqlens=seqlens,
                                    leftpad=leftpad, seq_add=seq_add, num_splits=num_splits, max_len=cap, rows=rows,
                                    store_lse=store_lse, check=check)
    return p


class BoundsCheck:
    """The bounds of one call shape, checked on the device (`bounds_check`): a call launches
    `decode_bounds_kernel` and returns its verdict, int32 ``[1]`` (1: every bound holds), for
    ``torch._assert_async``: no host read."""

    def __init__(self, device, batch: int, *, seqlens: bool, leftpad: bool, batch_idx: bool,
                 block_table: torch.Tensor | None, seq_add: int, max_len: int, n_rows: int, n_pages: int, page: int):
        self.device, self.cuda, self.bindable = device, device.type == "cuda", bound_launches(device)
        paged = block_table is not None
        BLOCK_B = max(16, min(next_pow2(batch), 256))
        names = ("Ok",) + tuple(n for n, on in (("seqlens", seqlens), ("leftpad", leftpad), ("batch_idx", batch_idx),
                                                ("block_table", paged)) if on)
        args = dict(n_batch=batch, seq_add=int(seq_add), seq_max=int(max_len - seq_add), BLOCK_B=BLOCK_B, num_warps=4)
        if batch_idx:
            args.update(n_rows=n_rows)
        if paged:  # (the kernel's optional parameters are given only when on: `decode_bounds_kernel`)
            n_table = block_table.shape[1]
            args.update(stride_tb=block_table.stride(0), n_pages=n_pages, n_table=n_table, PAGE=page,
                        BLOCK_T=max(16, min(next_pow2(n_table), 4096 // BLOCK_B)))
        self.launch = _Launch("decode_bounds_kernel", (1,), names, args)
        self.take = tuple(i for i, on in enumerate((seqlens, leftpad, batch_idx, paged)) if on)
        self.work = {}

    def _flag(self):
        return torch.empty(1, device=self.device, dtype=torch.int32)

    def __call__(self, seqlens=None, leftpad=None, batch_idx=None, block_table=None, route=None) -> torch.Tensor:
        stream, index = route or _route(self.cuda, self.bindable)
        ok = _workspace(self.work, self.cuda, stream, self._flag)
        given = (seqlens, leftpad, batch_idx, block_table)
        self.launch(stream if index is not None else None, index, [ok] + [given[i] for i in self.take])
        return ok


CHECKS: dict = {}


def bounds_check(device, batch: int, *, seqlens: bool, leftpad: bool = False, batch_idx: bool = False,
                 block_table: torch.Tensor | None = None, seq_add: int = 0, max_len: int, n_rows: int = 0,
                 n_pages: int = 0, page: int = 1) -> BoundsCheck:
    """The `BoundsCheck` of a call (made once per key): every batch row ``b`` must have ``0 <=
    seqlens[b] <= max_len - seq_add`` (with seqlens), ``0 <= leftpad[b] <= seqlens[b] + seq_add``,
    ``0 <= batch_idx[b] < n_rows``, and page ids in ``[0, n_pages)`` in ``block_table[b]`` for its
    ``ceil((seqlens[b] + seq_add) / page)`` pages."""
    key = (device, batch, seqlens, leftpad, batch_idx,
           None if block_table is None else (block_table.shape, block_table.stride()), seq_add, max_len, n_rows,
           n_pages, page)
    c = CHECKS.get(key)
    if c is None:
        if len(CHECKS) >= _PLANS_MAX:
            CHECKS.clear()
        c = CHECKS[key] = BoundsCheck(device, batch, seqlens=seqlens, leftpad=leftpad, batch_idx=batch_idx,
                                      block_table=block_table, seq_add=seq_add, max_len=max_len, n_rows=n_rows,
                                      n_pages=n_pages, page=page)
    return c


APPENDS: dict = {}


class Append:
    """The in-place append of one call shape (`append`): a call writes its new keys and values into
    the cache in one launch of `decode_append_kernel` (no index arithmetic launched on the host)."""

    def __init__(self, k_new, v_new, k_cache, v_cache, *, batch_idx: bool, block_table: torch.Tensor | None):
        B, SN, Hk, D = k_new.shape
        self.cuda, self.bindable = k_new.device.type == "cuda", bound_launches(k_new.device)
        paged = block_table is not None
        names = ("K_new", "V_new", "K", "V", "seqlens") + (("batch_idx",) if batch_idx else ()) \
            + (("block_table",) if paged else ())
        args = dict(stride_k_new=tuple(k_new.stride()), stride_v_new=tuple(v_new.stride()),
                    stride_k=tuple(k_cache.stride()), stride_v=tuple(v_cache.stride()), N_HEADS=Hk, HEAD_DIM=D,
                    BLOCK_H=next_pow2(Hk), num_warps=4)
        if paged:
            args.update(stride_tb=block_table.stride(0), PAGE=k_cache.shape[1])
        self.launch = _Launch("decode_append_kernel", (SN, B), names, args)

    def __call__(self, k_new, v_new, k_cache, v_cache, seqlens, batch_idx=None, block_table=None, route=None) -> None:
        stream, index = route or _route(self.cuda, self.bindable)
        ts = [k_new, v_new, k_cache, v_cache, seqlens]
        if batch_idx is not None:
            ts.append(batch_idx)
        if block_table is not None:
            ts.append(block_table)
        self.launch(stream if index is not None else None, index, ts)


def append(k_new, v_new, k_cache, v_cache, *, batch_idx: bool = False,
           block_table: torch.Tensor | None = None) -> Append:
    """The `Append` of a call (made once per key): new keys and values ``[batch, seqlen_new, nheads_k,
    headdim]`` into ``k_cache``, ``v_cache`` at ``seqlens[b] + t`` (`decode_append_kernel`)."""
    key = ("append", k_new.shape, k_new.stride(), v_new.stride(), k_new.dtype, k_new.device, k_cache.shape,
           k_cache.stride(), v_cache.stride(), batch_idx,
           None if block_table is None else (block_table.shape, block_table.stride()))
    a = APPENDS.get(key)
    if a is None:
        if len(APPENDS) >= _PLANS_MAX:
            APPENDS.clear()
        a = APPENDS[key] = Append(k_new, v_new, k_cache, v_cache, batch_idx=batch_idx, block_table=block_table)
    return a
