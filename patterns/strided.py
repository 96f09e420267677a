"""Sparse Transformer "strided" attention (Child et al. 2019)."""

from __future__ import annotations

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, grid, has_multiple


def strided(seq_len: int, stride: int, *, block_size=128, seq_k: int | None = None, causal: bool = True,
            device=None) -> BlockMask:
    """Pair (i, j) attended iff ``p - stride < j <= p`` or ``(p - j) % stride == 0`` (and ``j <= p``).

    ``p = i + seq_k - seq_q``. ``causal=False`` is the bidirectional variant:
    ``|p - j| < stride`` or ``(p - j) % stride == 0``. Pooled onto blocks the pattern is sparse only
    when ``stride`` is large against the block: with ``stride = s * block`` block (I, J) is on iff
    ``0 <= I - J <= s`` or ``(I - J) % s == 0`` (causal), while any ``stride < 2 * block - 1``
    puts a multiple of the stride in every tile and the mask is dense (causal: lower-triangular).
    With ``stride ~ sqrt(N)`` the work is O(N^1.5).
    """
    g = grid(seq_len, seq_k, block_size, device)
    stride = check_int(stride, "stride", 1, "int number of tokens")
    causal = check_bool(causal, "causal")
    d_lo, d_hi = g.d_lo, g.d_hi
    lo = 0 if causal else -(stride - 1)
    window = (d_lo <= stride - 1) & (d_hi >= lo)
    column = has_multiple(d_lo.clamp(min=0) if causal else d_lo, d_hi, stride)
    return g.mask(window | column)
