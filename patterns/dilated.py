"""Dilated sliding window: the keys within ``window`` positions at offsets divisible by ``dilation``."""

from __future__ import annotations

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import Grid, check_bool, check_int, grid, has_multiple


def dilated_layout(g: Grid, window: int, dilation: int, causal: bool) -> torch.Tensor:
    """Tiles whose token pairs include a dilated-window pair (shared with longformer)."""
    lo = g.d_lo.clamp(min=0 if causal else -window)
    hi = g.d_hi.clamp(max=window)
    return has_multiple(lo, hi, dilation)


def dilated(seq_len: int, window: int, dilation: int, *, block_size=128, seq_k: int | None = None,
            causal: bool = False, device=None) -> BlockMask:
    """Pair (i, j) attended iff ``|p - j| <= window`` and ``(p - j) % dilation == 0``.

    ``p = i + seq_k - seq_q`` (bottom-right aligned); causal also needs ``p - j >= 0``.
    ``dilation = 1`` is `local`. A dilation that is a multiple ``m * b`` of the block size keeps
    every m-th block diagonal of the band; a dilation below the block size fills the band.
    """
    g = grid(seq_len, seq_k, block_size, device)
    window = check_int(window, "window", 0, "int number of tokens")
    dilation = check_int(dilation, "dilation", 1)
    return g.mask(dilated_layout(g, window, dilation, check_bool(causal, "causal")))
