"""Dense attention as a block mask (every block on)."""

from __future__ import annotations

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import grid


def dense(seq_len: int, *, block_size=128, seq_k: int | None = None, device=None) -> BlockMask:
    """Every block on: the O(N^2) baseline, equivalent to ``mask=None``."""
    g = grid(seq_len, seq_k, block_size, device)
    return g.mask(torch.ones(g.shape, dtype=torch.bool, device=device))
