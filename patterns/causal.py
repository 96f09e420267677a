"""Causal attention as a block mask (the blocks holding any pair with ``j <= p``)."""

from __future__ import annotations

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import grid


def causal(seq_len: int, *, block_size=128, seq_k: int | None = None, device=None) -> BlockMask:
    """Block (I, J) on iff it holds a pair with ``j <= i + seq_k - seq_q`` (bottom-right aligned).

    The lower block triangle with its diagonal: density ``(nb + 1) / (2 nb)`` on an ``nb``-block
    square grid. The diagonal blocks are only partly causal; ``sparseflash.attention(...,
    causal=True)`` masks inside them. ``mask & causal(n)`` restricts any mask to these blocks.
    """
    g = grid(seq_len, seq_k, block_size, device)
    return g.mask(g.causal())
