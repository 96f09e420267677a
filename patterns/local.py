"""Sliding-window (local) attention: each query sees the keys within ``window`` positions."""

from __future__ import annotations

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import Grid, check_bool, check_int, grid


def local_layout(g: Grid, window: int, causal: bool) -> torch.Tensor:
    """Tiles that meet the band of the local window (shared with bigbird and random)."""
    # The tile's offsets [d_lo, d_hi] meet the allowed band [lo, window].
    lo = 0 if causal else -window
    return (g.d_lo <= window) & (g.d_hi >= lo)


def local(seq_len: int, window: int, *, block_size=128, seq_k: int | None = None, causal: bool = False,
          device=None) -> BlockMask:
    """Pair (i, j) attended iff ``|p - j| <= window`` (causal: ``0 <= p - j <= window``).

    ``p = i + seq_k - seq_q`` is the query's position (``p = i`` for self-attention). With a
    window of ``w`` tokens and blocks of ``b``, an interior block row holds ``2 * ceil(w / b) + 1``
    blocks (causal: ``ceil(w / b) + 1``) when lengths are block-aligned: O(N) work.
    """
    g = grid(seq_len, seq_k, block_size, device)
    window = check_int(window, "window", 0, "int number of tokens")
    return g.mask(local_layout(g, window, check_bool(causal, "causal")))
