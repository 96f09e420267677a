"""Sparse Transformer "fixed" attention (Child et al. 2019)."""

from __future__ import annotations

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, grid


def fixed(seq_len: int, stride: int, summary: int, *, block_size=128, seq_k: int | None = None,
          causal: bool = True, device=None) -> BlockMask:
    """Pair (i, j) attended iff ``p // stride == j // stride`` or ``j % stride >= stride - summary``.

    Positions are cut into stripes of ``stride`` tokens; a query sees its own stripe and the last
    ``summary`` tokens of every stripe. ``p = i + seq_k - seq_q``; causal (the default) also needs
    ``j <= p``, ``causal=False`` is the bidirectional variant. With ``stride = s * block`` and
    ``summary <= block`` the blocks are the stripe's s x s square plus the last block column of
    every stripe. With ``stride ~ sqrt(N)`` the work is O(N^1.5).
    """
    g = grid(seq_len, seq_k, block_size, device)
    stride = check_int(stride, "stride", 1, "int number of tokens")
    summary = check_int(summary, "summary", 0, "int number of tokens")
    if summary > stride:
        raise ValueError(f"summary must be at most stride={stride} tokens, got {summary}")
    causal = check_bool(causal, "causal")

    def stripe(x):
        return torch.div(x, stride, rounding_mode="floor")

    # Same stripe: the tile's query and key stripe ranges overlap; causal adds k_lo <= p_hi,
    # enough because any shared stripe above the key block's first one starts at or below p_hi.
    same = torch.maximum(stripe(g.p_lo), stripe(g.k_lo)) <= torch.minimum(stripe(g.p_hi), stripe(g.k_hi))
    if causal:
        same = same & g.causal()
    # Summary: the first summary column at or after k_lo is still inside the tile's key range.
    lo = g.k_lo
    hi = torch.minimum(g.k_hi, g.p_hi) if causal else g.k_hi
    r = lo - stripe(lo) * stride
    first = torch.where(r >= stride - summary, lo, lo - r + stride - summary)
    column = (lo <= hi) & (first <= hi) if summary else torch.zeros_like(same)
    return g.mask(same | column)
