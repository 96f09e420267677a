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
- Each batch row has its own key range ``[start, end)`` (``cache_leftpad``, the cache length after
  the append); causal and window bounds are bottom-right relative to ``end`` (query ``t`` of
  ``seq_q`` sits at position ``end - seq_q + t``). A split's range is cut from the keys this batch
  row can reach, so a short row does not run empty tiles.
- Block-sparse decoding: with ``blocks`` (sorted lists of cache blocks per ``(batch, kv head)`` and
  their counts) a split walks a share of the list instead of a key range; unlisted blocks are
  never read. Every query head of a GQA group shares its kv head's list.
- Rows that attend nothing (a split with no keys, a row beyond every bound) keep a finite pivot:
  their output is 0 and their lse ``-inf``; the combine never computes ``-inf - (-inf)``.

Forward only (flash-attn's decode has no backward). `sparseflash.kvcache` validates the inputs,
applies rotary and appends new keys, and holds the plain-PyTorch reference of the same semantics.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparseflash import _env
from sparseflash.flash import binding
from sparseflash.flash.operands import next_pow2

INTERPRETING = _env.interpreting()


@triton.jit
def _decode_split_kernel(
    Q, K, V, O_part, LSE_part, Out, LSE, seq_start, seq_end, batch_idx, block_table, alibi, blk_idx, blk_cnt,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_ob, stride_ot, stride_oh, stride_od, stride_lb, stride_lh, stride_lt,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_tb, stride_ab, stride_ib, stride_ih, stride_cb, stride_ch,
    n_splits, q_back, scale, softcap, left, right,
    SQ: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TILES_PER_BLOCK: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr, SPARSE: tl.constexpr, DOT_PREC: tl.constexpr,
    DIRECT: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_b = tl.program_id(1)
    i_hk = tl.program_id(2)
    n_kv_heads = tl.num_programs(2)
    R: tl.constexpr = SQ * G
    start = tl.load(seq_start + i_b)
    end = tl.load(seq_end + i_b)
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
    if HAS_ALIBI:
        b_slope = tl.load(alibi + i_b * stride_ab + o_h, mask=m_m, other=0.0).to(tl.float32)

    # the keys any row of this batch row can reach: [lo, hi)
    lo = start
    hi = end
    if HAS_RIGHT:
        hi = tl.minimum(hi, SQ - 1 + diag + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, diag - left)
    if SPARSE:
        n_units = tl.load(blk_cnt + i_b * stride_cb + i_hk * stride_ch) * TILES_PER_BLOCK
    else:
        first = tl.maximum(lo, 0) // BLOCK_N
        n_units = tl.maximum(tl.cdiv(hi, BLOCK_N) - first, 0)
    per_split = tl.cdiv(n_units, n_splits)
    u0 = i_s * per_split
    u1 = tl.minimum(u0 + per_split, n_units)

    if HAS_BATCH_IDX:
        cache_row = tl.load(batch_idx + i_b).to(tl.int64)
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
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (finite for any s)
            b_e = tl.exp(-2.0 * tl.abs(b_s) / softcap)
            b_th = (1.0 - b_e) / (1.0 + b_e)
            b_s = softcap * tl.where(b_s < 0, -b_th, b_th)
        b_rel = (o_t[:, None] + diag) - o_n[None, :]  # query position - key position
        if HAS_ALIBI:
            b_s = b_s - b_slope[:, None] * tl.abs(b_rel).to(tl.float32)
        m_s = m_n[None, :] & m_m[:, None]
        if HAS_RIGHT:
            m_s = m_s & (b_rel >= -right)
        if HAS_LEFT:
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
        p_o = Out + i_b.to(tl.int64) * stride_ob + o_t[:, None].to(tl.int64) * stride_ot \
            + o_h[:, None].to(tl.int64) * stride_oh + o_d[None, :] * stride_od
        tl.store(p_o, b_o.to(Out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
        tl.store(LSE + i_b.to(tl.int64) * stride_lb + o_h * stride_lh + o_t * stride_lt, b_lse, mask=m_m)
    else:
        # partials [B, Hk, S, R, D] and [B, Hk, S, R]
        base = ((i_b * n_kv_heads + i_hk) * n_splits + i_s).to(tl.int64) * R
        tl.store(O_part + (base + o_m[:, None]) * HEAD_DIM + o_d[None, :], b_o, mask=m_m[:, None] & m_d[None, :])
        tl.store(LSE_part + base + o_m, b_lse, mask=m_m)


@triton.jit
def _decode_combine_kernel(
    O_part, LSE_part, Out, LSE, n_splits, n_kv_heads,
    stride_ob, stride_ot, stride_oh, stride_od, stride_lb, stride_lh, stride_lt,
    SQ: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_r = tl.program_id(0)  # a row of the partials: (batch, kv head, row)
    i_bh = tl.program_id(1)  # batch * kv heads
    R: tl.constexpr = SQ * G
    i_b = i_bh // n_kv_heads
    i_hk = i_bh % n_kv_heads
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < n_splits
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    rows = (i_bh * n_splits + o_s).to(tl.int64) * R + i_r  # [BLOCK_S]
    b_lse = tl.load(LSE_part + rows, mask=m_s, other=float("-inf"))
    m = tl.max(b_lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    b_w = tl.exp(b_lse - m_use)  # 0 for empty splits
    total = tl.sum(b_w, 0)
    b_o = tl.load(O_part + rows[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    lse = tl.where(total > 0.0, m_use + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    t = i_r // G
    h = i_hk * G + i_r % G
    tl.store(Out + i_b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + o_d * stride_od,
             out.to(Out.dtype.element_ty), mask=m_d)
    tl.store(LSE + i_b.to(tl.int64) * stride_lb + h * stride_lh + t * stride_lt, lse)


# Launch settings of the split kernel, overridable by a study (experiments/studies/decode_splits): keys
# "num_warps", "num_stages", "block_n" (the key tile, dense caches only). Empty in normal use.
OVERRIDES: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 under the interpreter: splits are exercised)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_splits(batch: int, kv_heads: int, n_units: int, device: torch.device, min_units: int = 4) -> int:
    """num_splits=0: enough programs for about two waves over the SMs, each split keeping at least
    ``min_units`` tiles (so short caches are not cut into tiles of overhead); at most 128."""
    programs = batch * kv_heads
    want = math.ceil(2 * sm_count(device) / programs)
    return max(1, min(want, n_units // min_units if n_units >= min_units else 1, 128))


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


def decode_attention(q, k_cache, v_cache, seq_start, seq_end, *, scale: float, window: tuple[int, int],
                     softcap: float | None = None, alibi: torch.Tensor | None = None,
                     batch_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     blocks: tuple[torch.Tensor, torch.Tensor, int] | None = None, num_splits: int = 0,
                     max_len: int | None = None, q_back: int = 0):
    """Launch the split-KV kernel and the combine (module docstring).

    Args:
        q: ``[batch, seq_q, nheads, headdim]`` (any strides), ``seq_q * nheads / nheads_k <= 128``.
        k_cache, v_cache: ``[batch_cache, seqlen_cache, nheads_k, headdim]`` or pages
            ``[num_pages, page, nheads_k, headdim]`` with ``block_table``.
        seq_start, seq_end: int32 ``[batch]``: batch row ``b`` attends keys ``[start, end)``.
        window: ``(left, right)``, -1 unbounded (flash-attn's causal is ``right = 0``).
        alibi: float32 ``[batch, nheads]`` (a per-head ``[nheads]`` expanded by the caller).
        blocks: ``(indices [batch, nheads_k, n_sel] int32 sorted, counts [batch, nheads_k], block_size)``.
        max_len: an upper bound of ``seq_end`` (the cache's capacity), for the split count.
        q_back: these queries are followed by ``q_back`` more (a chunk of a longer query block):
            query ``t`` sits at key position ``end - seq_q - q_back + t``.

    Returns:
        ``(out [batch, seq_q, nheads, headdim] in q's dtype, lse float32 [batch, nheads, seq_q])``,
        ``-inf`` lse and 0 output for rows that attend nothing.
    """
    B, SQ, H, D = q.shape
    Hk = k_cache.shape[2]
    G = H // Hk
    R = SQ * G
    BLOCK_M = max(16, next_pow2(R))
    BLOCK_D = max(16, next_pow2(D))
    mask_block = blocks[2] if blocks is not None else None
    BLOCK_N = decode_block_n(mask_block, BLOCK_D)
    if OVERRIDES and mask_block is None:
        BLOCK_N = OVERRIDES.get("block_n", BLOCK_N)
    paged = block_table is not None
    cap = max_len if max_len is not None else (block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1])
    if blocks is not None:
        n_units = blocks[0].shape[-1] * (mask_block // BLOCK_N)
    else:
        n_units = math.ceil(cap / BLOCK_N)
    S = num_splits if num_splits > 0 else pick_splits(B, Hk, n_units, q.device)
    direct = S == 1
    # Pipeline depth: a dense cache read in one split per (batch, kv head) (many programs, e.g. batch 64
    # x 8 kv heads) ran faster two stages deep than three: 0.241 against 0.282 ms at B64 x 4K and 0.943
    # against 1.142 at B64 x 16K (H200, bf16, d 128, one query token, GQA 32/8;
    # experiments/studies/decode_splits). Split launches keep three (best there at B1 x 256K, where two is
    # 17% slower); block-sparse reads keep the three they were measured with. Not measured: the other
    # one-split cases this rule also covers (paged caches, several query tokens, d 256, short caches).
    o_part = torch.empty(0 if direct else B * Hk * S * R * D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(0 if direct else B * Hk * S * R, device=q.device, dtype=torch.float32)
    out = torch.empty(B, SQ, H, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, SQ, device=q.device, dtype=torch.float32)
    left, right = window
    dummy = seq_end
    if alibi is not None:
        alibi = alibi.to(torch.float32)
    if q.dtype == torch.float32 or INTERPRETING:
        prec = "upcast"  # fp32 products (the interpreter's bf16 dot is wrong; fp32 inputs stay exact)
    else:
        prec = "native"
    idx, cnt = (blocks[0], blocks[1]) if blocks is not None else (dummy, dummy)
    binding.call(
        _decode_split_kernel, (S, B, Hk), q, k_cache, v_cache, o_part, lse_part, out, lse, seq_start, seq_end,
        batch_idx if batch_idx is not None else dummy, block_table if paged else dummy,
        alibi if alibi is not None else dummy, idx, cnt,
        *q.stride(), *out.stride(), *lse.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0) if paged else 0, alibi.stride(0) if alibi is not None else 0,
        idx.stride(0) if blocks is not None else 0, idx.stride(1) if blocks is not None else 0,
        cnt.stride(0) if blocks is not None else 0, cnt.stride(1) if blocks is not None else 0,
        S, q_back, float(scale), float(softcap or 1.0), int(left), int(right),
        SQ=SQ, G=G, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PAGE=k_cache.shape[1] if paged else 1, TILES_PER_BLOCK=(mask_block // BLOCK_N) if blocks is not None else 1,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=alibi is not None, HAS_BATCH_IDX=batch_idx is not None, PAGED=paged, SPARSE=blocks is not None,
        DOT_PREC=prec, DIRECT=direct, num_warps=OVERRIDES.get("num_warps", 4),
        num_stages=OVERRIDES.get("num_stages", 2 if direct and blocks is None else 3),
    )
    if direct:
        return out, lse
    binding.call(
        _decode_combine_kernel, (R, B * Hk), o_part, lse_part, out, lse, S, Hk, *out.stride(), *lse.stride(),
        SQ=SQ, G=G, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_S=max(2, next_pow2(S)), num_warps=4,
    )
    return out, lse
