"""Triton kernels: block-sparse FlashAttention forward and backward (dense = every block on).

Algorithm (FlashAttention-2, restricted to the nonzero blocks of a `BlockMask`):

- Forward: one program per (q tile of BLOCK_M rows, batch*head). The Q tile stays in registers;
  the loop runs over the k-blocks listed for the tile's q-block row (``kv_idx``), so the trip
  count is the number of nonzero blocks, never a scan over zero blocks. Online softmax in the
  log2 domain (``exp2`` with ``scale * log2(e)`` folded into the scores), fp32 running max / sum,
  one normalisation at the end; the natural-log LSE is stored for backward.
- Backward: dQ programs own a q tile and walk the row list; they first compute
  ``delta = rowsum(dO * O) - dLSE`` of their rows and store it. Then dK/dV programs own a k tile
  and walk its column list (``q_idx``, the transposed index) for every query head of its GQA
  group, reading delta. No atomics, so results are bitwise reproducible.
- Lists: a row (column) list holds the sorted nonzero block indices, then padding that compares
  above every index, so each part of a walk is a count of entries below a bound and no kernel
  loads the lists' lengths (one dependent load fewer before the first K/V tile).

Element masks only where a tile needs them. The lists are sorted, and every element-level
condition here is a threshold on the column (``j < kv_end``; causal ``j <= i + seq_k - seq_q``),
so along a row list the tiles split into a mask-free prefix, a masked band, and a tail that is
skipped; along a column list (dK/dV) into a skipped prefix, a masked band and a mask-free
rest. Each kernel loads its list once as a vector, counts the three parts, and runs two loops:
the mask-free one and the masked one. Tail rows (``i >= seq_q``) need no mask: they load zeros
and, in backward, an LSE of +inf, which makes their probabilities exactly 0. Columns at or past
``kv_end`` only matter in dK/dV through what is stored, so they are zeroed at the store.

Rows that attend to nothing keep a finite pivot (never ``-inf - -inf``): their output is 0, the
LSE buffer holds +inf (the public API reports -inf), and backward gives them zero gradient.

Packed documents (SEGMENTS, compiled out when off; the kernels' ``segments`` tuple): each program loads the segment ids of its
own tile once; for every streamed tile it loads that tile's ids and, unless every id of both
tiles is one and the same (one reduction per tile, `_seg_other`), ANDs ``seg_q == seg_k`` into
the score mask. Block pairs sharing no document are not in the lists at all (the launcher's
caller prunes them per call, `autograd.segment_lists`). With segments even a "mask-free" tile
may leave a row without keys so far, so the forward keeps its pivot finite on every tile.

Key ranges (KEY_RANGES, compiled out when off; never with SEGMENTS): query i attends keys
``start[i] <= j < end[i]`` only, read from the int32 table RANGES [B', 2, seq_q] (the kernels'
``ranges`` tuple); every tile ANDs the range test into its mask (on top of causal and kv_end), and
the forward keeps its pivot finite as with segments. Exact at token level for any ranges, e.g.
flash-attn's varlen sequences with causal bottom-right aligned in each one
(`sparseflash.segments.key_ranges_from_cu_seqlens`). Block pairs no range reaches are pruned from
the lists per call (`autograd.segment_lists`).

Exact masks (EXACT, compiled out when off: the kernels' ``exact`` tuple, (KV_TILE or Q_TILE, BITS),
is None then, so default kernels keep their signature and code): a mask built from a token-level
definition carries one bit tile per partial block, ``[block_q, ceil(block_k / 32)]`` int32 words
(`sparseflash.mask.ExactBits`), and an int32 table laid out as the row lists (KV_TILE, forward and
dQ) and one as the column lists (Q_TILE, dK/dV) that gives each listed block's tile, -1 for a
full block. Every tile of a walk, in the mask-free and the masked loop alike, loads its entry
(one scalar load); only tiles of partial blocks read their bits (`_exact_bits`, the kernel tile's
sub-rectangle of the mask block's bits) and AND them into the scores (forward) or probabilities
(backward), so full blocks do no element-wise work. As with segments, the forward keeps its
pivot finite on every tile: a row may have seen no attended key so far, or none at all.

Score modifications (compiled out when off; flash-attn's definitions, in this order, on the
scaled score s of every computed pair before any mask): SOFTCAP (a constexpr, None when off: one
variant per cap) makes ``s = SOFTCAP * tanh(s / SOFTCAP)``; ALIBI adds ``-slope[b, h] * |i + seq_k - seq_q - j|``
with the float32 slopes SLOPES [B or 1, H_Q] (the kernels' ``alibi`` tuple: SLOPES and its batch
stride), one load per program
(per query head in dK/dV). Backward
recomputes both (nothing stored) and multiplies dS by tanh's derivative ``1 - tanh^2``; the
slopes get no gradient. `_score_mod` does both, in the log2 domain of the scores.

Dropout (optional, compiled out when off): keep(i, j) is decided by Philox4x32-7 keyed by the
seed; one call decides the 16 elements {i, i + 8} x {j, j + 1, j + 8, j + 9, ..., j + 24, j + 25},
which one thread holds in the accumulator layout of a [queries, keys] tile, so the forward and dQ
kernels move no data between threads (`_philox_keep`; dK/dV on [keys, queries] tiles moves each
call's words to the threads holding its elements, and with Q_ROWS works on [queries, keys] tiles
as the forward does); the seed and offset are read from a device tensor; an element is kept when its 8 bits are
>= ``round(p * 256)``; backward regenerates the same bits.
`sparseflash.dropout` defines the mask and computes it in NumPy for tests.

Addressing: batch, head and row strides arrive divided by ALIGN and are multiplied back
(`_aligned`), so the compiler sees row alignments that Triton's divisible-by-16 specialisation
misses (head_dim 40).
"""


import triton
import triton.language as tl
from triton.language.extra import libdevice
from sparseflash import _env
from sparseflash._consts import LN2 as _LN2, LOG2E as _LOG2E

LOG2E = tl.constexpr(_LOG2E)
LN2 = tl.constexpr(_LN2)
# Under the Triton interpreter inline PTX cannot run: helpers take a plain path there.
INTERPRET = tl.constexpr(_env.interpreting())


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr):
    """tl.dot; "upcast" multiplies in fp32 (exact bf16 products, as tensor cores give): the
    Triton interpreter's bf16 dot is wrong, so CPU runs of bf16 inputs use this."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT_PREC == "tf32" and a.dtype == tl.float32:
        # tensor cores read the top 19 bits of an fp32 operand (truncation); round to nearest
        # first, as cuBLAS does: truncating P (all positive) biases every output downwards
        return tl.dot(tf32_round(a), tf32_round(b), acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def tf32_round(x):
    """fp32 -> nearest tf32 (10 mantissa bits, ties to even), still stored as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


# The dropout threshold varies with p: never specialise on its value (1 would turn into a
# constant, and every value divisible by 16 would compile a new variant).
_RNG_ARGS = ["drop_thresh"]


@triton.constexpr_function
def block_d(head_dim):
    """The tiles' column count: head_dim rounded up to a power of two, at least 16 (`tiles.block_d`)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _aligned(strides, ALIGN: tl.constexpr):
    """A tensor's (batch, head, row, column) strides, one tuple argument of a kernel: the first three,
    which the launcher passes divided by ALIGN (the largest power of two < 16 dividing them all,
    `operands.aligned_strides`), multiplied back here, so the compiler knows every row starts
    ALIGN-aligned. Triton's own specialisation only recognises strides divisible by 16, so a
    head_dim of 40 would get element-wise loads without it."""
    return strides[0] * ALIGN, strides[1] * ALIGN, strides[2] * ALIGN, strides[3]


@triton.jit
def _list_row(LIST, stride_idx, i_b, i_h, row):
    """Row ``row`` of block list (or tile table) LIST read as [B, H, rows, ...]: strides stride_idx,
    (batch, head, row), 0 where the list is shared."""
    return LIST + i_b * stride_idx[0] + i_h * stride_idx[1] + row.to(tl.int64) * stride_idx[2]


# ----------------------------------------------------------------------------- dropout bits
@triton.jit
def _rng_state(RNG):
    """(seed_lo, seed_hi, offset) of this call's dropout bits: the int64 [3] tensor the forward op
    drew on the device (read here, not passed by value, so a CUDA graph replays fresh draws)."""
    return tl.load(RNG), tl.load(RNG + 1), tl.load(RNG + 2)


@triton.jit
def _mul_wide(a, b):
    """(high, low) 32-bit halves of the 64-bit product of uint32 a and b: one IMAD.WIDE.U32 on the
    GPU, where umulhi and a separate low multiply cost two; the interpreter computes the same in uint64."""
    if INTERPRET:
        p = a.to(tl.uint64) * b.to(tl.uint64)
        return (p >> 32).to(tl.uint32), p.to(tl.uint32)
    else:
        return tl.inline_asm_elementwise("{ .reg .u64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }",
                                         "=r,=r,r,r", [a, b], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _philox_words(seed_lo, seed_hi, offset, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The Philox4x32-7 words of queries start_m + [0, BLOCK_M) and keys start_n + [0, BLOCK_N)
    (start_m a multiple of 16, start_n and BLOCK_N of 32), as [a, u, x, z, y % 2, y // 2] for query
    16a + 8b + u and key 32x + 8y + 2z + e (the call is (a, u, x, z); y picks the word)."""
    call_r = start_m // 2 + 8 * tl.arange(0, BLOCK_M // 16)[:, None] + tl.arange(0, 8)[None, :]  # [M/16, 8]: row(i)
    call_c = start_n // 8 + 4 * tl.arange(0, BLOCK_N // 32)[:, None] + tl.arange(0, 4)[None, :]  # [N/32, 4]: col(j)
    zero = tl.zeros([BLOCK_M // 16, 8, BLOCK_N // 32, 4], dtype=tl.uint32)
    c0 = zero + call_c.to(tl.uint32)[None, None, :, :]
    c1 = zero + call_r.to(tl.uint32)[:, :, None, None]
    c2 = zero + bh.to(tl.uint32)
    c3 = zero + offset.to(tl.uint32)
    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    m0 = zero + 0xD2511F53
    m1 = zero + 0xCD9E8D57
    for _ in tl.static_range(7):
        hi0, lo0 = _mul_wide(c0, m0)
        hi1, lo1 = _mul_wide(c2, m1)
        c0 = hi1 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo1
        c3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return tl.join(tl.join(c0, c1), tl.join(c2, c3))


@triton.jit
def _philox_keep32(seed_lo, seed_hi, offset, bh, start_m, start_n, drop_thresh, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """`_philox_keep` for BLOCK_N a multiple of 32 (start_n too): each element takes its call's
    word and picks its byte, so every thread works only on the elements it holds."""
    w = _philox_words(seed_lo, seed_hi, offset, bh, start_m, start_n, BLOCK_M, BLOCK_N)  # [a, u, x, z, y%2, y//2]
    o_m = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    if TRANS:  # [keys, queries]: key 32x + 8y + 2z + e, query 16a + 8b + u
        w = tl.permute(w, 2, 5, 4, 3, 0, 1)  # [x, y//2, y%2, z, a, u]
        w = tl.broadcast_to(w[:, :, :, :, None, :, None, :], [BLOCK_N // 32, 2, 2, 4, 2, BLOCK_M // 16, 2, 8])
        w = tl.reshape(w, [BLOCK_N, BLOCK_M])
        shift = 16 * ((o_m[None, :] // 8) % 2) + 8 * (o_n[:, None] % 2)
    else:  # [queries, keys]
        w = tl.permute(w, 0, 1, 2, 5, 4, 3)  # [a, u, x, y//2, y%2, z]
        w = tl.broadcast_to(w[:, None, :, :, :, :, :, None], [BLOCK_M // 16, 2, 8, BLOCK_N // 32, 2, 2, 4, 2])
        w = tl.reshape(w, [BLOCK_M, BLOCK_N])
        shift = 16 * ((o_m[:, None] // 8) % 2) + 8 * (o_n[None, :] % 2)
    # byte >= t  <=>  (word << (24 - 8 * byte)) >= t << 24 (unsigned; the byte's lower neighbours
    # cannot lift a smaller byte over t << 24): a shift and a compare, no mask
    # (p = 1 has threshold 256, which does not fit: 255 keeps 1/256 of the elements, and the scale,
    # 1 / (1 - p) taken as 0, zeroes them.)
    return (w << (24 - shift).to(tl.uint32)) >= (tl.minimum(drop_thresh, 255).to(tl.uint32) << 24)


@triton.jit
def _philox_keep(seed_lo, seed_hi, offset, bh, start_m, start_n, drop_thresh, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Keep-mask (bool) of queries start_m + [0, BLOCK_M) and keys start_n + [0, BLOCK_N) (starts
    multiples of 16), [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with TRANS (the dK/dV tiles).

    Query i and key j are decided by the Philox4x32-7 call with counter (col(j), row(i), bh,
    offset), row(i) = (i // 16) * 8 + i % 8 and col(j) = (j // 32) * 4 + (j % 8) // 2: byte
    2 * ((i // 8) % 2) + j % 2 of word (j // 8) % 4, kept when >= drop_thresh. A call's sixteen
    elements {i, i + 8} x {j, j + 1, j + 8, j + 9, j + 16, j + 17, j + 24, j + 25} are held by one
    thread in the tensor-core accumulator layout of a [queries, keys] tile, so the forward and dQ
    kernels build the mask without moving data between threads.
    """
    if BLOCK_N >= 32:
        return _philox_keep32(seed_lo, seed_hi, offset, bh, start_m, start_n, drop_thresh, BLOCK_M, BLOCK_N, TRANS)
    else:  # a 16-key tile: the half of its 32-key span that it covers
        base = start_n - start_n % 32
        t = _philox_keep32(seed_lo, seed_hi, offset, bh, start_m, base, drop_thresh, BLOCK_M, 32, TRANS)
        if TRANS:
            lo, hi = tl.split(tl.permute(tl.reshape(t, [2, 16, BLOCK_M]), 1, 2, 0))
        else:
            lo, hi = tl.split(tl.permute(tl.reshape(t, [BLOCK_M, 2, 16]), 0, 2, 1))
        return tl.where(start_n == base, lo, hi)


# ----------------------------------------------------------------------------- list parts
@triton.jit
def _list(p_idx, n_blocks, NB_P2: tl.constexpr):
    """A sorted block list as a vector [NB_P2]: its entries, then padding that compares above every
    block index (the stored padding is n_blocks, positions past the row read 2**30). No count is
    needed: every part of a walk is counted from the entries themselves, so the list load does
    not wait for another load."""
    o_t = tl.arange(0, NB_P2)
    return tl.load(p_idx + o_t, mask=o_t < n_blocks, other=1 << 30)


@triton.jit
def _row_parts(b_idx, full_end, valid_end, MASK_BK: tl.constexpr):
    """For a sorted k-block list: (#entries fully inside [0, full_end), #entries starting below valid_end).
    (Integer division truncates towards zero, so a negative bound counts nothing.)"""
    n_full = tl.sum((b_idx < full_end // MASK_BK).to(tl.int32), axis=0)
    n_valid = tl.sum((b_idx < (valid_end + MASK_BK - 1) // MASK_BK).to(tl.int32), axis=0)
    return n_full, n_valid


@triton.jit
def _col_parts(b_idx, n_blocks, skip_below, full_from, MASK_BQ: tl.constexpr):
    """For a sorted q-block list: (#entries whose rows all lie below skip_below, #entries with a row
    below full_from, #entries)."""
    n_skip = tl.sum((b_idx < skip_below // MASK_BQ).to(tl.int32), axis=0)
    n_part = tl.sum((b_idx < (full_from + MASK_BQ - 1) // MASK_BQ).to(tl.int32), axis=0)
    n = tl.sum((b_idx < n_blocks).to(tl.int32), axis=0)
    return n_skip, n_part, n


@triton.jit
def _tile_start(walk, j, GATHER: tl.constexpr, MASK_B: tl.constexpr, BLOCK: tl.constexpr):
    """Token start of the j-th kernel tile of a walk: ``walk`` (p_idx, b_list) a block list's pointer
    and the list held in registers (`_list`), or None: dense, the j-th tile of the axis.

    GATHER picks the list entry out of the list already held in registers (b_list) instead of
    loading it: the tile address then depends only on the loop counter, so the software pipeliner
    can load K/V tiles several iterations ahead (a loaded index makes it drain every step).
    """
    if walk is None:
        return j * BLOCK
    else:
        p_idx, b_list = walk
        SUB: tl.constexpr = MASK_B // BLOCK
        if GATHER:
            b = tl.sum(tl.where(tl.arange(0, b_list.shape[0]) == j // SUB, b_list, 0), axis=0)
        else:
            b = tl.load(p_idx + j // SUB)
        return b * MASK_B + (j % SUB) * BLOCK


@triton.jit
def _row_bounds(KEY_LEN, i_b, start_m, seq_q, seq_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """The key bounds of a q tile (forward and dQ): (kv_end, causal_off, full_end, valid_end). Keys
    from kv_end on do not exist (KEY_LEN, None: seq_k); tiles ending at or below full_end need no
    element mask; tiles starting at or past valid_end are skipped."""
    kv_end = seq_k
    if KEY_LEN is not None:
        kv_end = tl.minimum(tl.maximum(tl.load(KEY_LEN + i_b).to(tl.int32), 0), seq_k)
    full_end = kv_end
    valid_end = kv_end
    causal_off = seq_k - seq_q
    if CAUSAL:
        full_end = tl.minimum(full_end, start_m + causal_off + 1)
        valid_end = tl.minimum(valid_end, tl.minimum(start_m + BLOCK_M, seq_q) + causal_off)
    return kv_end, causal_off, full_end, valid_end


@triton.jit
def _row_walk(KV_IDX, stride_idx, i_b, i_h, start_m, seq_k, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
              NB_P2: tl.constexpr):
    """A q tile's row list (forward and dQ) as `_tile_start` walks it: (its pointer, the list in registers)."""
    q_blk = start_m // MASK_BQ
    p_idx = _list_row(KV_IDX, stride_idx, i_b, i_h, q_blk)
    return p_idx, _list(p_idx, tl.cdiv(seq_k, MASK_BK), NB_P2)


@triton.jit
def _row_tiles(walk, full_end, valid_end, BLOCK_N: tl.constexpr, MASK_BK: tl.constexpr):
    """The tile counts of a q tile's walk (``walk`` None: dense) below `_row_bounds`' bounds: of the
    mask-free prefix (j < j_full) and of the whole walk (j < j_valid)."""
    if walk is None:
        j_full = tl.maximum(full_end, 0) // BLOCK_N
        j_valid = tl.cdiv(tl.maximum(valid_end, 0), BLOCK_N)
    else:
        SUB: tl.constexpr = MASK_BK // BLOCK_N
        n_full, n_valid = _row_parts(walk[1], full_end, valid_end, MASK_BK)
        j_full = n_full * SUB
        j_valid = n_valid * SUB
    return j_full, j_valid


# ----------------------------------------------------------------------------- segments
@triton.jit
def _seg_range(ids, valid):
    """(min, max) of a vector of segment ids over its valid entries (int32 scalars)."""
    return (tl.min(tl.where(valid, ids, 2147483647), 0),
            tl.max(tl.where(valid, ids, -2147483648), 0))


@triton.jit
def _seg_other(p_seg, start, o_t, seq, own_lo, own_hi):
    """The segment ids of the streamed tile start + o_t ([BLOCK], positions past seq read as own_lo:
    they are masked or not stored anyway) and whether the tile is mixed: unless every id of the
    held tile (range [own_lo, own_hi]) and of this one is the same, the tile needs the
    element-wise comparison."""
    ids = tl.load(p_seg + start + o_t, mask=(start + o_t) < seq, other=own_lo)
    mixed = (own_lo != own_hi) | (tl.max((ids != own_lo).to(tl.int32), 0) != 0)  # one reduction
    return ids, mixed


@triton.jit
def _seg_rows(segments, i_b, o_m, seq_q):
    """For a program holding q tile o_m (forward, dQ): its segment ids [BLOCK_M], their range over
    the real rows, and the key ids' row pointer (the inner loops' ``seg``). ``segments``: the
    kernels' (SEG_Q, SEG_K, stride_sqb, stride_skb)."""
    SEG_Q, SEG_K, stride_sqb, stride_skb = segments
    m_row = o_m < seq_q
    b_sq = tl.load(SEG_Q + i_b * stride_sqb + o_m, mask=m_row, other=0)
    sq_lo, sq_hi = _seg_range(b_sq, m_row)
    return b_sq, sq_lo, sq_hi, SEG_K + i_b * stride_skb


@triton.jit
def _range_rows(ranges, i_b, o_m, seq_q):
    """Key ranges of rows o_m: (start, end) int32 [BLOCK_M] each, read from the [B', 2, seq_q] table
    RANGES of ``ranges`` (RANGES, stride_rb); rows past seq_q get the empty range (0, 0)."""
    RANGES, stride_rb = ranges
    m_row = o_m < seq_q
    p = RANGES + i_b * stride_rb
    return tl.load(p + o_m, mask=m_row, other=0), tl.load(p + seq_q + o_m, mask=m_row, other=0)


# ----------------------------------------------------------------------------- exact masks
@triton.jit
def _exact_tile(p_tile, j, SUB: tl.constexpr):
    """The bit-tile index of the mask block holding kernel tile j of a walk (its list entry j // SUB),
    -1 for a full block."""
    return tl.load(p_tile + j // SUB)


@triton.jit
def _exact_bits(BITS, t, r, c0, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Whether each pair of a tile is attended, from bit tile t (>= 0): rows r [BLOCK_M] and keys
    c0 .. c0 + BLOCK_N - 1 counted from the mask block's corner (c0 a multiple of BLOCK_N).
    [BLOCK_M, BLOCK_N] bool, [BLOCK_N, BLOCK_M] with TRANS. Row r of a tile holds
    ceil(MASK_BK / 32) int32 words, key c in bit c % 32 of word c // 32
    (`sparseflash.mask.ExactBits`); every index stays inside the tile. From 32 keys on, a row's
    BLOCK_N / 32 words are loaded once and expanded in registers: one load per key would move 32x
    the bytes, and its software pipelining would hold BLOCK_M x BLOCK_N words of shared memory a
    stage (over the sm_90 limit at d=128)."""
    W: tl.constexpr = (MASK_BK + 31) // 32
    p = BITS + t.to(tl.int64) * (MASK_BQ * W)
    if BLOCK_N >= 32:
        NW: tl.constexpr = BLOCK_N // 32
        wi = c0 // 32 + tl.arange(0, NW)
        sh = tl.arange(0, 32)
        if TRANS:
            w = tl.load(p + r[None, :] * W + wi[:, None])  # [NW, BLOCK_M]
            b = (w[:, None, :] >> sh[None, :, None]) & 1  # [NW, 32, BLOCK_M]
            return tl.reshape(b, (BLOCK_N, BLOCK_M)) != 0
        else:
            w = tl.load(p + r[:, None] * W + wi[None, :])  # [BLOCK_M, NW]
            b = (w[:, :, None] >> sh[None, None, :]) & 1  # [BLOCK_M, NW, 32]
            return tl.reshape(b, (BLOCK_M, BLOCK_N)) != 0
    else:
        c = c0 + tl.arange(0, BLOCK_N)
        if TRANS:
            w = tl.load(p + r[None, :] * W + (c // 32)[:, None])  # [BLOCK_N, BLOCK_M]
            return ((w >> (c % 32)[:, None]) & 1) != 0
        else:
            w = tl.load(p + r[:, None] * W + (c // 32)[None, :])  # [BLOCK_M, BLOCK_N]
            return ((w >> (c % 32)[None, :]) & 1) != 0


# ----------------------------------------------------------------------------- score modifications
@triton.jit
def _tanh(x):
    """tanh of fp32 x: libdevice's on the GPU; the interpreter has no libdevice, so there from exp
    in float64 (as accurate, rounded to fp32)."""
    if INTERPRET:
        e = tl.math.exp(-2.0 * tl.abs(x.to(tl.float64)))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0.0, -t, t).to(tl.float32)
    else:
        return libdevice.tanh(x)


@triton.jit
def _alibi_slope(alibi, i_b, i_h):
    """ALiBi's slope of batch i_b, query head i_h times log2(e) (``alibi``: (SLOPES, stride_slb), the
    float32 slopes [B or 1, H_Q] and their batch stride)."""
    SLOPES, stride_slb = alibi
    return tl.load(SLOPES + i_b * stride_slb + i_h) * LOG2E


@triton.jit
def _score_mod(b_s, o_m, o_kn, slope2, causal_off, SOFTCAP: tl.constexpr, TRANS: tl.constexpr):
    """Scores in the log2 domain (b_s = s * log2(e), [BLOCK_M, BLOCK_N]; TRANS: [BLOCK_N, BLOCK_M]) of
    queries o_m and keys o_kn (absolute positions), soft-capped (SOFTCAP not None) then with ALiBi's bias
    (slope2 = slope * log2(e), None without ALiBi). Returns (scores, tanh of the capped argument: backward's
    derivative is 1 - tanh^2; b_s itself without SOFTCAP, unused then). Both off: b_s unchanged."""
    b_t = b_s
    if SOFTCAP is not None:
        b_t = _tanh(b_s * (1.0 / (SOFTCAP * LOG2E)))
        b_s = b_t * (SOFTCAP * LOG2E)
    if slope2 is not None:
        if TRANS:
            dist = o_m[None, :] + causal_off - o_kn[:, None]  # [BLOCK_N, BLOCK_M]
        else:
            dist = o_m[:, None] + causal_off - o_kn[None, :]  # [BLOCK_M, BLOCK_N]
        b_s = b_s - slope2 * tl.abs(dist).to(tl.float32)
    return b_s, b_t


# ----------------------------------------------------------------------------- forward
@triton.jit
def _key_mask(start_n, o_n, o_m, kv_end, causal_off, CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] (or [1, BLOCK_N]) bool: key start_n + o_n is attended by query o_m
    (below kv_end and, causal, on or below the diagonal)."""
    m_s = ((start_n + o_n) < kv_end)[None, :]
    if CAUSAL:
        m_s = m_s & ((start_n + o_n)[None, :] <= o_m[:, None] + causal_off)
    return m_s


@triton.jit
def _masked_max(b_s, m_i, start_n, o_n, o_m, kv_end, causal_off, CAUSAL: tl.constexpr):
    """A score tile with unattended keys (`_key_mask`) set to -inf; the new running max, and the
    pivot to subtract (0 for rows that have seen no key yet)."""
    b_s = tl.where(_key_mask(start_n, o_n, o_m, kv_end, causal_off, CAUSAL), b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    return b_s, m_new, tl.where(m_new == float("-inf"), 0.0, m_new)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, kv, walk, j_lo, j_hi, j_mask, rows, bounds, qk_scale, drop, tma, seg, ranges, slope2,
               exact, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
               GATHER: tl.constexpr, SOFTCAP: tl.constexpr):
    # kv (p_k, p_v, stride_kn, stride_vn): the K and V tiles' pointers at key 0 and their row strides;
    # rows (start_m, o_m, o_d): the held q tile's first row, its rows and columns; bounds (seq_k,
    # kv_end, causal_off): `_row_bounds`'; tiles j_lo <= j < j_hi of the walk.
    # Optional parts, None when off (the flag derived from it): walk (p_idx, b_list) the block
    # list (`_tile_start`; None: dense), drop (seed_lo, seed_hi, offset, bh, drop_thresh, drop_scale),
    # tma (the two descriptors, batch, head), seg (the held tile's ids, their range, the streamed
    # ids' row), ranges, slope2 (ALiBi), exact (the tile table's row, the bit tiles).
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    p_k, p_v, stride_kn, stride_vn = kv
    start_m, o_m, o_d = rows
    seq_k, kv_end, causal_off = bounds
    DROPOUT: tl.constexpr = drop is not None
    TMA: tl.constexpr = tma is not None
    SEGMENTS: tl.constexpr = seg is not None
    KEY_RANGES: tl.constexpr = ranges is not None
    EXACT: tl.constexpr = exact is not None
    if DROPOUT:
        seed_lo, seed_hi, rng_off, bh, drop_thresh = drop[0], drop[1], drop[2], drop[3], drop[4]
    if TMA:
        DESC_K, DESC_V, i_b, i_hk = tma
    if SEGMENTS:
        b_sq, sq_lo, sq_hi, p_sk = seg
    if KEY_RANGES:
        b_rlo, b_rhi = ranges
    if EXACT:
        p_tile, BITS = exact
    # TMA: K/V tiles come through 4-D tensor descriptors (Hopper's bulk copies) at (i_b, i_hk,
    # start_n); rows past seq_k and columns past HEAD_DIM read as zeros, as the pointer loads'
    # masks give. With TMA the kernel runs one loop (MASKED), applying the element mask from tile
    # j_mask on: two loops of descriptor loads cost 1 KB more shared memory (sm_90 compile),
    # enough to drop a d=128 64x64 3-stage kernel from two programs per SM to one.
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < HEAD_DIM
    for j in range(j_lo, j_hi):
        start_n = _tile_start(walk, j, GATHER, MASK_BK, BLOCK_N)
        off_kv = start_n.to(tl.int64)
        if MASKED:
            m_kv = ((start_n + o_n) < seq_k)[:, None] & m_d[None, :]
        else:
            m_kv = m_d[None, :]
        if TMA:  # K and V issued together: one barrier per stage for both
            b_k = DESC_K.load([i_b, i_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # rows past seq_k, columns past HEAD_DIM: 0
            b_v = DESC_V.load([i_b, i_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            b_k = tl.load(p_k + off_kv * stride_kn, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_s = _dot(q, tl.trans(b_k), None, DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        b_s, _ = _score_mod(b_s, o_m, start_n + o_n, slope2, causal_off, SOFTCAP, False)  # before any -inf
        if SEGMENTS:  # packed documents: keys of another segment are not attended (mixed tiles only)
            b_sk, mixed = _seg_other(p_sk, start_n, o_n, seq_k, sq_lo, sq_hi)
            if mixed:
                b_s = tl.where(b_sq[:, None] == b_sk[None, :], b_s, float("-inf"))
        if KEY_RANGES:  # every tile: row i attends keys b_rlo[i] <= j < b_rhi[i] only
            o_kn = (start_n + o_n)[None, :]
            b_s = tl.where((o_kn >= b_rlo[:, None]) & (o_kn < b_rhi[:, None]), b_s, float("-inf"))
        if EXACT:  # a partial block: its bits; a full one (t < 0) costs one scalar load
            t = _exact_tile(p_tile, j, MASK_BK // BLOCK_N)
            if t >= 0:
                b_s = tl.where(_exact_bits(BITS, t, o_m % MASK_BQ, start_n % MASK_BK, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, False),
                               b_s, float("-inf"))
        if MASKED and TMA:  # one loop: the element mask only from tile j_mask on (a branch per tile)
            if j >= j_mask:
                b_s, m_new, m_pivot = _masked_max(b_s, m_i, start_n, o_n, o_m, kv_end, causal_off, CAUSAL)
            else:
                m_new = tl.maximum(m_i, tl.max(b_s, 1))
                m_pivot = m_new
        elif MASKED:
            b_s, m_new, m_pivot = _masked_max(b_s, m_i, start_n, o_n, o_m, kv_end, causal_off, CAUSAL)
        else:
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            m_pivot = m_new
        if SEGMENTS or KEY_RANGES or EXACT:  # a row may have seen no key of its segment (range, bits) yet: keep the pivot finite
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.math.exp2(b_s - m_pivot[:, None])
        alpha = tl.math.exp2(m_i - m_pivot)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = _philox_keep(seed_lo, seed_hi, rng_off, bh, start_m, start_n, drop_thresh, BLOCK_M, BLOCK_N, False)
            b_p = tl.where(keep, b_p, 0.0)
        if not TMA:
            b_v = tl.load(p_v + off_kv * stride_vn, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = _dot(b_p.to(b_v.dtype), b_v, acc, DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_RNG_ARGS)
def fwd_kernel(Q, K, V, O, LSE, strides, H_Q, GROUP, seq_q, seq_k, qk_scale, drop_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PREC: tl.constexpr, ALIGN: tl.constexpr, SOFTCAP: tl.constexpr = None,
               KV_IDX=None, stride_idx=None, MASK_BQ: tl.constexpr = None, MASK_BK: tl.constexpr = None,
               NB_P2: tl.constexpr = None, GATHER: tl.constexpr = None, exact=None, KEY_LEN=None, RNG=None,
               drop_thresh=None, segments=None, ranges=None, alibi=None, DESC_Q=None, DESC_K=None, DESC_V=None):
    """strides: (stride_q, stride_k, stride_v, stride_o), each tensor's (batch, head, row, column)
    strides as one tuple, the first three divided by ALIGN (`_aligned`; 1: not divided). drop_scale: the output's
    scale, 1 / (1 - p) with dropout, 1.0 without.
    Every optional part is None when off (a constexpr: no parameter, no code in that variant), its
    flag derived from it at the top of the body:
    - KV_IDX (block lists; None: dense): the row lists [B or 1, H or 1, q blocks, NB] (strides
      stride_idx: batch, head, row), of mask blocks MASK_BQ x MASK_BK, NB_P2 entries read as one
      vector, from registers with GATHER (`_tile_start`);
    - exact (EXACT, with block lists): (KV_TILE, BITS), the bit-tile index of each row-list entry
      (int32, laid out as KV_IDX) and the bit tiles (module docstring);
    - KEY_LEN: each batch row's key count (None: seq_k);
    - RNG (dropout): the int64 [3] seed and offset tensor, with drop_thresh (`_philox_keep`; a
      parameter of its own: Triton's do_not_specialize does not reach into a tuple);
    - segments (SEGMENTS): (SEG_Q, SEG_K, stride_sqb, stride_skb), int32 segment ids [B or 1, seq]
      and their batch strides (0 when shared); keys whose id differs from the query's are not attended;
    - ranges (KEY_RANGES, never with segments): (RANGES, stride_rb), int32 [B or 1, 2, seq_q] of each
      query's key range: query i attends keys start[i] <= j < end[i] only;
    - alibi (ALIBI): (SLOPES, stride_slb), ALiBi's float32 slopes [B or 1, H_Q] and their batch stride;
      SOFTCAP: the cap (the score modifications: module docstring);
    - DESC_Q, DESC_K, DESC_V (TMA): 4-D descriptors of Q, K and V ([B, H, N, HEAD_DIM], blocks
      [1, 1, BLOCK_M or BLOCK_N, BLOCK_D]); each a parameter of its own (triton 3.6's launcher
      takes descriptors only as top-level arguments)."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    # every optional part is on when given (None: a constexpr, compiled out)
    DENSE: tl.constexpr = KV_IDX is None
    DROPOUT: tl.constexpr = RNG is not None
    TMA: tl.constexpr = DESC_Q is not None
    SEGMENTS: tl.constexpr = segments is not None
    KEY_RANGES: tl.constexpr = ranges is not None
    ALIBI: tl.constexpr = alibi is not None
    EXACT: tl.constexpr = exact is not None
    stride_q, stride_k, stride_v, stride_o = strides
    stride_qb, stride_qh, stride_qm, stride_qd = _aligned(stride_q, ALIGN)
    stride_kb, stride_kh, stride_kn, stride_kd = _aligned(stride_k, ALIGN)
    stride_vb, stride_vh, stride_vn, stride_vd = _aligned(stride_v, ALIGN)
    stride_ob, stride_oh, stride_om, stride_od = _aligned(stride_o, ALIGN)
    i_m = tl.program_id(0)
    if DROPOUT:
        seed_lo, seed_hi, rng_off = _rng_state(RNG)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H_Q).to(tl.int64)
    i_h = (i_bh % H_Q).to(tl.int64)
    i_hk = i_h // GROUP
    start_m = i_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM

    if TMA:
        q = DESC_Q.load([i_b.to(tl.int32), i_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        p_q = Q + i_b * stride_qb + i_h * stride_qh + start_m.to(tl.int64) * stride_qm \
            + tl.arange(0, BLOCK_M)[:, None] * stride_qm + o_d[None, :] * stride_qd
        q = tl.load(p_q, mask=(o_m < seq_q)[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    p_k = K + i_b * stride_kb + i_hk * stride_kh + o_n[:, None] * stride_kn + o_d[None, :] * stride_kd
    p_v = V + i_b * stride_vb + i_hk * stride_vh + o_n[:, None] * stride_vn + o_d[None, :] * stride_vd
    seg, row_ranges, slope2, drop, tma, exact_row, walk = None, None, None, None, None, None, None
    if SEGMENTS:
        seg = _seg_rows(segments, i_b, o_m, seq_q)
    if KEY_RANGES:
        row_ranges = _range_rows(ranges, i_b, o_m, seq_q)
    if ALIBI:
        slope2 = _alibi_slope(alibi, i_b, i_h)

    kv_end, causal_off, full_end, valid_end = _row_bounds(KEY_LEN, i_b, start_m, seq_q, seq_k, BLOCK_M, CAUSAL)
    if not DENSE:
        walk = _row_walk(KV_IDX, stride_idx, i_b, i_h, start_m, seq_k, MASK_BQ, MASK_BK, NB_P2)
    j_full, j_valid = _row_tiles(walk, full_end, valid_end, BLOCK_N, MASK_BK)
    if EXACT:  # the tile table's row, laid out as the row list's
        KV_TILE, BITS = exact
        exact_row = (_list_row(KV_TILE, stride_idx, i_b, i_h, start_m // MASK_BQ), BITS)
    if DROPOUT:
        drop = (seed_lo, seed_hi, rng_off, i_bh, drop_thresh, drop_scale)
    if TMA:
        tma = (DESC_K, DESC_V, i_b.to(tl.int32), i_hk.to(tl.int32))

    kv = (p_k, p_v, stride_kn, stride_vn)
    rows = (start_m, o_m, o_d)
    bounds = (seq_k, kv_end, causal_off)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j_lo = 0  # TMA: one loop over every tile, masking from j_full on (see _fwd_inner)
    if not TMA:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, walk, 0, j_full, j_full, rows, bounds, qk_scale, drop, tma,
                                   seg, row_ranges, slope2, exact_row, False, CAUSAL, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N,
                                   HEAD_DIM, DOT_PREC, GATHER, SOFTCAP)
        j_lo = j_full
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, walk, j_lo, j_valid, j_full, rows, bounds, qk_scale, drop, tma,
                               seg, row_ranges, slope2, exact_row, True, CAUSAL, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N,
                               HEAD_DIM, DOT_PREC, GATHER, SOFTCAP)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc * (drop_scale / l_safe)[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))
    p_o = O + i_b * stride_ob + i_h * stride_oh + start_m.to(tl.int64) * stride_om \
        + tl.arange(0, BLOCK_M)[:, None] * stride_om + o_d[None, :] * stride_od
    tl.store(p_o, acc.to(O.dtype.element_ty), mask=(o_m < seq_q)[:, None] & m_d[None, :])
    tl.store(LSE + i_bh.to(tl.int64) * seq_q + o_m, lse, mask=o_m < seq_q)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _dkdv_inner(dk, dv, held, qs, walk, j_lo, j_hi, j_mask, cols, bounds, qk_scale, drop, tma, seg, p_rq, slope2, exact,
                MASKED: tl.constexpr, Q_ROWS: tl.constexpr, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
                GATHER: tl.constexpr, SOFTCAP: tl.constexpr):
    # held (b_k, b_v): the held k tile's K and V; qs (p_q, p_do, p_lse, p_delta, stride_qm, stride_dom):
    # the streamed Q, dO, LSE and delta rows' pointers at row 0 of this query head, Q's and dO's row
    # strides; cols (start_n, o_n, o_d): the held tile's first key, its keys and columns; bounds
    # (seq_q, causal_off).
    # Optional parts, None when off (the flag derived from it): walk (p_idx, b_list) the block
    # list (`_tile_start`; None: dense), drop (seed_lo, seed_hi, offset, bh, drop_thresh, drop_scale),
    # tma (the two descriptors, batch, head), seg (the held tile's ids, their range, the streamed
    # ids' row), p_rq (the key-range table's row), slope2 (ALiBi), exact (the tile table's row, the bit tiles).
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    b_k, b_v = held
    p_q, p_do, p_lse, p_delta, stride_qm, stride_dom = qs
    start_n, o_n, o_d = cols
    seq_q, causal_off = bounds
    DROPOUT: tl.constexpr = drop is not None
    TMA: tl.constexpr = tma is not None
    SEGMENTS: tl.constexpr = seg is not None
    KEY_RANGES: tl.constexpr = p_rq is not None
    EXACT: tl.constexpr = exact is not None
    if DROPOUT:
        seed_lo, seed_hi, rng_off, bh, drop_thresh, drop_scale = drop
    if TMA:
        DESC_Q, DESC_DO, i_b, i_h = tma
    if SEGMENTS:
        b_sk, sk_lo, sk_hi, p_sq = seg
    if EXACT:
        p_tile, BITS = exact
    # TMA: Q and dO tiles through descriptors (rows past seq_q read as zeros) in one loop that
    # applies the causal mask (MASKED) only below tile j_mask.
    m_d = o_d < HEAD_DIM
    for j in range(j_lo, j_hi):
        start_m = _tile_start(walk, j, GATHER, MASK_BQ, BLOCK_M)
        o_m = start_m + tl.arange(0, BLOCK_M)
        m_row = o_m < seq_q
        off_q = start_m.to(tl.int64)
        if TMA:
            b_q = DESC_Q.load([i_b, i_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            b_q = tl.load(p_q + off_q * stride_qm, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        b_lse = tl.load(p_lse + o_m, mask=m_row, other=float("inf")) * LOG2E
        # (the loads of dO and delta stay after the first dot in each branch: hoisted above it, the
        # d=128 kernel spills more in an sm_90 compile, 112 bytes instead of 72)
        if Q_ROWS:  # [queries, keys] tiles, as the forward's: P^T and dS^T go to the MMAs via shared memory
            b_s = _dot(b_q, tl.trans(b_k), None, DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
            b_s, b_t = _score_mod(b_s, o_m, o_n, slope2, causal_off, SOFTCAP, False)
            b_p = tl.math.exp2(b_s - b_lse[:, None])
            if MASKED:
                if (not TMA) or j < j_mask:
                    b_p = tl.where(o_n[None, :] <= o_m[:, None] + causal_off, b_p, 0.0)
            if SEGMENTS:
                b_sq, mixed = _seg_other(p_sq, start_m, tl.arange(0, BLOCK_M), seq_q, sk_lo, sk_hi)
                if mixed:
                    b_p = tl.where(b_sq[:, None] == b_sk[None, :], b_p, 0.0)
            if KEY_RANGES:
                b_rlo = tl.load(p_rq + o_m, mask=m_row, other=0)
                b_rhi = tl.load(p_rq + seq_q + o_m, mask=m_row, other=0)
                b_p = tl.where((o_n[None, :] >= b_rlo[:, None]) & (o_n[None, :] < b_rhi[:, None]), b_p, 0.0)
            if EXACT:
                t = _exact_tile(p_tile, j, MASK_BQ // BLOCK_M)
                if t >= 0:
                    b_p = tl.where(_exact_bits(BITS, t, o_m % MASK_BQ, start_n % MASK_BK, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, False), b_p, 0.0)
            if TMA:
                b_do = DESC_DO.load([i_b, i_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
            else:
                b_do = tl.load(p_do + off_q * stride_dom, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            b_dp = _dot(b_do, tl.trans(b_v), None, DOT_PREC)  # [BLOCK_M, BLOCK_N]
            b_pd = b_p
            if DROPOUT:
                keep = _philox_keep(seed_lo, seed_hi, rng_off, bh, start_m, start_n, drop_thresh, BLOCK_M, BLOCK_N, False)
                b_pd = tl.where(keep, b_p * drop_scale, 0.0)
                b_dp = tl.where(keep, b_dp * drop_scale, 0.0)
            dv = _dot(tl.trans(b_pd.to(b_do.dtype)), b_do, dv, DOT_PREC)
            b_delta = tl.load(p_delta + o_m, mask=m_row, other=0.0)
            b_ds = b_p * (b_dp - b_delta[:, None])
            if SOFTCAP is not None:  # through the cap: d(cap * tanh(s / cap)) / ds = 1 - tanh^2
                b_ds = b_ds * (1.0 - b_t * b_t)
            dk = _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, dk, DOT_PREC)
        else:  # [keys, queries] tiles: P^T and dS^T are MMA operands straight from registers
            b_sT = _dot(b_k, tl.trans(b_q), None, DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
            b_sT, b_tT = _score_mod(b_sT, o_m, o_n, slope2, causal_off, SOFTCAP, True)
            b_pT = tl.math.exp2(b_sT - b_lse[None, :])
            if MASKED:
                if (not TMA) or j < j_mask:
                    b_pT = tl.where(o_n[:, None] <= o_m[None, :] + causal_off, b_pT, 0.0)
            if SEGMENTS:
                b_sq, mixed = _seg_other(p_sq, start_m, tl.arange(0, BLOCK_M), seq_q, sk_lo, sk_hi)
                if mixed:
                    b_pT = tl.where(b_sk[:, None] == b_sq[None, :], b_pT, 0.0)
            if KEY_RANGES:
                b_rlo = tl.load(p_rq + o_m, mask=m_row, other=0)
                b_rhi = tl.load(p_rq + seq_q + o_m, mask=m_row, other=0)
                b_pT = tl.where((o_n[:, None] >= b_rlo[None, :]) & (o_n[:, None] < b_rhi[None, :]), b_pT, 0.0)
            if EXACT:
                t = _exact_tile(p_tile, j, MASK_BQ // BLOCK_M)
                if t >= 0:
                    b_pT = tl.where(_exact_bits(BITS, t, o_m % MASK_BQ, start_n % MASK_BK, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, True), b_pT, 0.0)
            if TMA:
                b_do = DESC_DO.load([i_b, i_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
            else:
                b_do = tl.load(p_do + off_q * stride_dom, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            b_dpT = _dot(b_v, tl.trans(b_do), None, DOT_PREC)  # [BLOCK_N, BLOCK_M]
            b_pdT = b_pT
            if DROPOUT:
                keepT = _philox_keep(seed_lo, seed_hi, rng_off, bh, start_m, start_n, drop_thresh, BLOCK_M, BLOCK_N, True)
                b_pdT = tl.where(keepT, b_pT * drop_scale, 0.0)
                b_dpT = tl.where(keepT, b_dpT * drop_scale, 0.0)
            dv = _dot(b_pdT.to(b_do.dtype), b_do, dv, DOT_PREC)
            b_delta = tl.load(p_delta + o_m, mask=m_row, other=0.0)
            b_dsT = b_pT * (b_dpT - b_delta[None, :])
            if SOFTCAP is not None:
                b_dsT = b_dsT * (1.0 - b_tT * b_tT)
            dk = _dot(b_dsT.to(b_q.dtype), b_q, dk, DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=_RNG_ARGS)
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, strides, H_Q, H_KV, GROUP, seq_q, seq_k, scales,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    DOT_PREC: tl.constexpr, Q_ROWS: tl.constexpr, ALIGN: tl.constexpr, SOFTCAP: tl.constexpr = None,
                    Q_IDX=None, stride_idx=None, MASK_BQ: tl.constexpr = None, MASK_BK: tl.constexpr = None,
                    NB_P2: tl.constexpr = None, GATHER: tl.constexpr = None, exact=None, KEY_LEN=None, dropout=None,
                    drop_thresh=None, segments=None, ranges=None, alibi=None,
                    DESC_Q=None, DESC_K=None, DESC_V=None, DESC_DO=None):
    """strides: (stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv), as the forward's;
    scales and dropout as the dQ kernel's. Q_IDX (block lists): the column lists [B or 1, H or 1,
    k blocks, NB] (strides stride_idx); exact: (Q_TILE, BITS), the bit-tile index of each
    column-list entry (laid out as Q_IDX) and the bit tiles. The other optional parts as the
    forward's (None when off, the flag derived from each); DESC_* (TMA): 4-D descriptors as the
    forward's (Q, dO in BLOCK_M rows, K, V in BLOCK_N)."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    DENSE: tl.constexpr = Q_IDX is None
    DROPOUT: tl.constexpr = dropout is not None
    TMA: tl.constexpr = DESC_Q is not None
    SEGMENTS: tl.constexpr = segments is not None
    KEY_RANGES: tl.constexpr = ranges is not None
    ALIBI: tl.constexpr = alibi is not None
    EXACT: tl.constexpr = exact is not None
    qk_scale, sm_scale = scales
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv = strides
    stride_qb, stride_qh, stride_qm, stride_qd = _aligned(stride_q, ALIGN)
    stride_kb, stride_kh, stride_kn, stride_kd = _aligned(stride_k, ALIGN)
    stride_vb, stride_vh, stride_vn, stride_vd = _aligned(stride_v, ALIGN)
    stride_dob, stride_doh, stride_dom, stride_dod = _aligned(stride_do, ALIGN)
    stride_dkb, stride_dkh, stride_dkn, stride_dkd = _aligned(stride_dk, ALIGN)
    stride_dvb, stride_dvh, stride_dvn, stride_dvd = _aligned(stride_dv, ALIGN)
    i_n = tl.program_id(0)
    if DROPOUT:
        RNG, drop_scale = dropout
        seed_lo, seed_hi, rng_off = _rng_state(RNG)
    i_bhk = tl.program_id(1)
    i_b = (i_bhk // H_KV).to(tl.int64)
    i_hk = (i_bhk % H_KV).to(tl.int64)
    start_n = i_n * BLOCK_N
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_kv = (o_n < seq_k)[:, None] & m_d[None, :]
    if TMA:
        b_k = DESC_K.load([i_b.to(tl.int32), i_hk.to(tl.int32), start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        b_v = DESC_V.load([i_b.to(tl.int32), i_hk.to(tl.int32), start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        b_k = tl.load(K + i_b * stride_kb + i_hk * stride_kh + o_n.to(tl.int64)[:, None] * stride_kn + o_d[None, :] * stride_kd,
                      mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_v = tl.load(V + i_b * stride_vb + i_hk * stride_vh + o_n.to(tl.int64)[:, None] * stride_vn + o_d[None, :] * stride_vd,
                      mask=m_kv, other=0.0)
    kv_end = seq_k
    if KEY_LEN is not None:
        kv_end = tl.minimum(tl.maximum(tl.load(KEY_LEN + i_b).to(tl.int32), 0), seq_k)
    causal_off = seq_k - seq_q
    seg, p_rq = None, None
    if SEGMENTS:  # this k tile's ids, their range over the real keys, and the query ids' row
        SEG_Q, SEG_K, stride_sqb, stride_skb = segments
        b_sk = tl.load(SEG_K + i_b * stride_skb + o_n, mask=o_n < seq_k, other=0)
        sk_lo, sk_hi = _seg_range(b_sk, o_n < seq_k)
        seg = (b_sk, sk_lo, sk_hi, SEG_Q + i_b * stride_sqb)
    if KEY_RANGES:  # the key-range table's row
        RANGES, stride_rb = ranges
        p_rq = RANGES + i_b * stride_rb
    # Rows below skip_below see none of this tile's columns; rows from full_from on see all of them.
    skip_below = 0
    full_from = 0
    if CAUSAL:
        skip_below = start_n - causal_off
        full_from = start_n + BLOCK_N - 1 - causal_off

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    held = (b_k, b_v)
    cols = (start_n, o_n, o_d)
    bounds = (seq_q, causal_off)
    if start_n < kv_end:
        o_mt = tl.arange(0, BLOCK_M)
        for g in range(0, GROUP):
            i_h = i_hk * GROUP + g
            i_bh = i_b * H_Q + i_h
            p_q = Q + i_b * stride_qb + i_h * stride_qh + o_mt[:, None] * stride_qm + o_d[None, :] * stride_qd
            p_do = DO + i_b * stride_dob + i_h * stride_doh + o_mt[:, None] * stride_dom + o_d[None, :] * stride_dod
            p_lse = LSE + i_bh * seq_q
            p_delta = DELTA + i_bh * seq_q
            slope2, walk, exact_col, drop, tma = None, None, None, None, None
            if ALIBI:
                slope2 = _alibi_slope(alibi, i_b, i_h)
            if DENSE:
                j_skip = tl.maximum(skip_below, 0) // BLOCK_M
                j_part = tl.minimum(tl.cdiv(tl.maximum(full_from, 0), BLOCK_M), tl.cdiv(seq_q, BLOCK_M))
                j_end = tl.cdiv(seq_q, BLOCK_M)
            else:
                SUB: tl.constexpr = MASK_BQ // BLOCK_M
                k_blk = start_n // MASK_BK
                p_idx = _list_row(Q_IDX, stride_idx, i_b, i_h, k_blk)
                n_qb = tl.cdiv(seq_q, MASK_BQ)
                b_list = _list(p_idx, n_qb, NB_P2)
                n_skip, n_part, n = _col_parts(b_list, n_qb, skip_below, full_from, MASK_BQ)
                j_skip = n_skip * SUB
                j_part = tl.maximum(n_part, n_skip) * SUB
                j_end = n * SUB
                walk = (p_idx, b_list)
            if EXACT:  # the tile table's column, laid out as the column list's
                Q_TILE, BITS = exact
                exact_col = (_list_row(Q_TILE, stride_idx, i_b, i_h, start_n // MASK_BK), BITS)
            if DROPOUT:
                drop = (seed_lo, seed_hi, rng_off, i_bh, drop_thresh, drop_scale)
            if TMA:
                tma = (DESC_Q, DESC_DO, i_b.to(tl.int32), i_h.to(tl.int32))
            j_hi = j_end if TMA else j_part  # TMA: one loop, the causal mask below j_part
            qs = (p_q, p_do, p_lse, p_delta, stride_qm, stride_dom)
            dk, dv = _dkdv_inner(dk, dv, held, qs, walk, j_skip, j_hi, j_part, cols, bounds, qk_scale, drop, tma, seg,
                                 p_rq, slope2, exact_col, CAUSAL, Q_ROWS, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, HEAD_DIM,
                                 DOT_PREC, GATHER, SOFTCAP)
            if not TMA:
                dk, dv = _dkdv_inner(dk, dv, held, qs, walk, j_part, j_end, j_part, cols, bounds, qk_scale, drop, tma,
                                     seg, p_rq, slope2, exact_col, False, Q_ROWS, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N,
                                     HEAD_DIM, DOT_PREC, GATHER, SOFTCAP)
    # Keys at or past kv_end take no part in the attention: their gradients are exactly zero.
    m_keep = (o_n < kv_end)[:, None]
    dk = tl.where(m_keep, dk * sm_scale, 0.0)
    dv = tl.where(m_keep, dv, 0.0)
    tl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + o_n.to(tl.int64)[:, None] * stride_dkn + o_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=m_kv)
    tl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + o_n.to(tl.int64)[:, None] * stride_dvn + o_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=m_kv)


@triton.jit
def _dq_inner(dq, held, kv, walk, j_lo, j_hi, j_mask, rows, bounds, qk_scale, drop, tma, seg, ranges, slope2, exact,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
              GATHER: tl.constexpr, SOFTCAP: tl.constexpr):
    # held (q, do, b_lse, b_delta): the held q tile's Q, dO, LSE (log2 domain) and delta; kv, rows,
    # bounds as `_fwd_inner`'s.
    # Optional parts, None when off (the flag derived from it): walk (p_idx, b_list) the block
    # list (`_tile_start`; None: dense), drop (seed_lo, seed_hi, offset, bh, drop_thresh, drop_scale),
    # tma (the two descriptors, batch, head), seg (the held tile's ids, their range, the streamed
    # ids' row), ranges, slope2 (ALiBi), exact (the tile table's row, the bit tiles).
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    q, do, b_lse, b_delta = held
    p_k, p_v, stride_kn, stride_vn = kv
    start_m, o_m, o_d = rows
    seq_k, kv_end, causal_off = bounds
    DROPOUT: tl.constexpr = drop is not None
    TMA: tl.constexpr = tma is not None
    SEGMENTS: tl.constexpr = seg is not None
    KEY_RANGES: tl.constexpr = ranges is not None
    EXACT: tl.constexpr = exact is not None
    if DROPOUT:
        seed_lo, seed_hi, rng_off, bh, drop_thresh, drop_scale = drop
    if TMA:
        DESC_K, DESC_V, i_b, i_hk = tma
    if SEGMENTS:
        b_sq, sq_lo, sq_hi, p_sk = seg
    if KEY_RANGES:
        b_rlo, b_rhi = ranges
    if EXACT:
        p_tile, BITS = exact
    # TMA: as in _fwd_inner, K/V through descriptors in one loop masking from tile j_mask on.
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < HEAD_DIM
    for j in range(j_lo, j_hi):
        start_n = _tile_start(walk, j, GATHER, MASK_BK, BLOCK_N)
        if TMA:
            b_k = DESC_K.load([i_b, i_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # rows past seq_k, columns past HEAD_DIM: 0
            b_v = DESC_V.load([i_b, i_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            off_kv = start_n.to(tl.int64)
            if MASKED:
                m_kv = ((start_n + o_n) < seq_k)[:, None] & m_d[None, :]
            else:
                m_kv = m_d[None, :]
            b_k = tl.load(p_k + off_kv * stride_kn, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
            b_v = tl.load(p_v + off_kv * stride_vn, mask=m_kv, other=0.0)
        b_s = _dot(q, tl.trans(b_k), None, DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        b_s, b_t = _score_mod(b_s, o_m, start_n + o_n, slope2, causal_off, SOFTCAP, False)
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        if MASKED:
            if (not TMA) or j >= j_mask:
                b_p = tl.where(_key_mask(start_n, o_n, o_m, kv_end, causal_off, CAUSAL), b_p, 0.0)
        if SEGMENTS:
            b_sk, mixed = _seg_other(p_sk, start_n, o_n, seq_k, sq_lo, sq_hi)
            if mixed:
                b_p = tl.where(b_sq[:, None] == b_sk[None, :], b_p, 0.0)
        if KEY_RANGES:
            o_kn = (start_n + o_n)[None, :]
            b_p = tl.where((o_kn >= b_rlo[:, None]) & (o_kn < b_rhi[:, None]), b_p, 0.0)
        if EXACT:
            t = _exact_tile(p_tile, j, MASK_BK // BLOCK_N)
            if t >= 0:
                b_p = tl.where(_exact_bits(BITS, t, o_m % MASK_BQ, start_n % MASK_BK, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, False),
                               b_p, 0.0)
        b_dp = _dot(do, tl.trans(b_v), None, DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if DROPOUT:
            keep = _philox_keep(seed_lo, seed_hi, rng_off, bh, start_m, start_n, drop_thresh, BLOCK_M, BLOCK_N, False)
            b_dp = tl.where(keep, b_dp * drop_scale, 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])
        if SOFTCAP is not None:  # through the cap: 1 - tanh^2
            b_ds = b_ds * (1.0 - b_t * b_t)
        dq = _dot(b_ds.to(b_k.dtype), b_k, dq, DOT_PREC)
    return dq


@triton.jit(do_not_specialize=_RNG_ARGS)
def bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, strides, H_Q, GROUP, seq_q, seq_k, scales,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  DOT_PREC: tl.constexpr, ALIGN: tl.constexpr, SOFTCAP: tl.constexpr = None,
                  KV_IDX=None, stride_idx=None, MASK_BQ: tl.constexpr = None, MASK_BK: tl.constexpr = None,
                  NB_P2: tl.constexpr = None, GATHER: tl.constexpr = None, exact=None, KEY_LEN=None, dropout=None,
                  drop_thresh=None, DLSE=None, segments=None, ranges=None, alibi=None,
                  DESC_Q=None, DESC_K=None, DESC_V=None, DESC_DO=None, DESC_O=None):
    """dQ of a q tile, and first delta = rowsum(dO * O) - dLSE of its rows, which it stores for the
    dK/dV kernel (launched after it): no separate preprocessing pass over O and dO.
    strides: (stride_q, stride_k, stride_v, stride_do, stride_o, stride_dq), as the forward's.
    scales: (qk_scale, sm_scale), the scores' scale in the log2 domain (sm_scale * log2(e)) and the
    softmax scale. Optional parts as the forward's (None when off, the flag derived from each), and:
    dropout: (RNG, drop_scale), the seed and offset tensor and the kept values' scale, with
    drop_thresh; DLSE: the LSE's incoming gradient; DESC_* (TMA): 4-D descriptors as the forward's
    (Q, dO, O in BLOCK_M rows, K, V in BLOCK_N)."""
    BLOCK_D: tl.constexpr = block_d(HEAD_DIM)
    DENSE: tl.constexpr = KV_IDX is None
    DROPOUT: tl.constexpr = dropout is not None
    TMA: tl.constexpr = DESC_Q is not None
    SEGMENTS: tl.constexpr = segments is not None
    KEY_RANGES: tl.constexpr = ranges is not None
    ALIBI: tl.constexpr = alibi is not None
    EXACT: tl.constexpr = exact is not None
    qk_scale, sm_scale = scales
    stride_q, stride_k, stride_v, stride_do, stride_o, stride_dq = strides
    stride_qb, stride_qh, stride_qm, stride_qd = _aligned(stride_q, ALIGN)
    stride_kb, stride_kh, stride_kn, stride_kd = _aligned(stride_k, ALIGN)
    stride_vb, stride_vh, stride_vn, stride_vd = _aligned(stride_v, ALIGN)
    stride_dob, stride_doh, stride_dom, stride_dod = _aligned(stride_do, ALIGN)
    stride_ob, stride_oh, stride_om, stride_od = _aligned(stride_o, ALIGN)
    stride_dqb, stride_dqh, stride_dqm, stride_dqd = _aligned(stride_dq, ALIGN)
    i_m = tl.program_id(0)
    if DROPOUT:
        RNG, drop_scale = dropout
        seed_lo, seed_hi, rng_off = _rng_state(RNG)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H_Q).to(tl.int64)
    i_h = (i_bh % H_Q).to(tl.int64)
    i_hk = i_h // GROUP
    start_m = i_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_mt = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_q = (o_m < seq_q)[:, None] & m_d[None, :]
    off_m = start_m.to(tl.int64)
    if TMA:  # rows past seq_q and columns past HEAD_DIM read as zeros, as the masked loads give
        q = DESC_Q.load([i_b.to(tl.int32), i_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        do = DESC_DO.load([i_b.to(tl.int32), i_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        b_o = DESC_O.load([i_b.to(tl.int32), i_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(Q + i_b * stride_qb + i_h * stride_qh + off_m * stride_qm + o_mt[:, None] * stride_qm + o_d[None, :] * stride_qd,
                    mask=m_q, other=0.0)
        do = tl.load(DO + i_b * stride_dob + i_h * stride_doh + off_m * stride_dom + o_mt[:, None] * stride_dom + o_d[None, :] * stride_dod,
                     mask=m_q, other=0.0)
        b_o = tl.load(O + i_b * stride_ob + i_h * stride_oh + off_m * stride_om + o_mt[:, None] * stride_om + o_d[None, :] * stride_od,
                      mask=m_q, other=0.0)
    p_row = i_bh.to(tl.int64) * seq_q + o_m
    b_lse = tl.load(LSE + p_row, mask=o_m < seq_q, other=float("inf")) * LOG2E
    b_delta = tl.sum(b_o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    if DLSE is not None:
        b_delta -= tl.load(DLSE + p_row, mask=o_m < seq_q, other=0.0)
    tl.store(DELTA + p_row, b_delta, mask=o_m < seq_q)
    p_k = K + i_b * stride_kb + i_hk * stride_kh + o_n[:, None] * stride_kn + o_d[None, :] * stride_kd
    p_v = V + i_b * stride_vb + i_hk * stride_vh + o_n[:, None] * stride_vn + o_d[None, :] * stride_vd
    seg, row_ranges, slope2, drop, tma, exact_row, walk = None, None, None, None, None, None, None
    if SEGMENTS:
        seg = _seg_rows(segments, i_b, o_m, seq_q)
    if KEY_RANGES:
        row_ranges = _range_rows(ranges, i_b, o_m, seq_q)
    if ALIBI:
        slope2 = _alibi_slope(alibi, i_b, i_h)

    kv_end, causal_off, full_end, valid_end = _row_bounds(KEY_LEN, i_b, start_m, seq_q, seq_k, BLOCK_M, CAUSAL)
    if not DENSE:
        walk = _row_walk(KV_IDX, stride_idx, i_b, i_h, start_m, seq_k, MASK_BQ, MASK_BK, NB_P2)
    j_full, j_valid = _row_tiles(walk, full_end, valid_end, BLOCK_N, MASK_BK)
    if EXACT:  # the tile table's row, laid out as the row list's
        KV_TILE, BITS = exact
        exact_row = (_list_row(KV_TILE, stride_idx, i_b, i_h, start_m // MASK_BQ), BITS)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if DROPOUT:
        drop = (seed_lo, seed_hi, rng_off, i_bh, drop_thresh, drop_scale)
    if TMA:
        tma = (DESC_K, DESC_V, i_b.to(tl.int32), i_hk.to(tl.int32))
    held = (q, do, b_lse, b_delta)
    kv = (p_k, p_v, stride_kn, stride_vn)
    rows = (start_m, o_m, o_d)
    bounds = (seq_k, kv_end, causal_off)
    j_lo = 0  # TMA: one loop over every tile, masking from j_full on
    if not TMA:
        dq = _dq_inner(dq, held, kv, walk, 0, j_full, j_full, rows, bounds, qk_scale, drop, tma, seg, row_ranges, slope2, exact_row,
                       False, CAUSAL, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PREC, GATHER, SOFTCAP)
        j_lo = j_full
    dq = _dq_inner(dq, held, kv, walk, j_lo, j_valid, j_full, rows, bounds, qk_scale, drop, tma, seg, row_ranges, slope2, exact_row,
                   True, CAUSAL, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PREC, GATHER, SOFTCAP)
    tl.store(DQ + i_b * stride_dqb + i_h * stride_dqh + off_m * stride_dqm + o_mt[:, None] * stride_dqm + o_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_q)
