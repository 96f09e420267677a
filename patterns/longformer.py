"""Longformer (Beltagy et al. 2020): (dilated) sliding window + global tokens."""

from __future__ import annotations

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, global_positions, grid
from sparseflash.patterns.dilated import dilated_layout
from sparseflash.patterns.global_tokens import global_layout


def longformer(seq_len: int, window: int, global_tokens, *, dilation: int = 1, block_size=128,
               seq_k: int | None = None, causal: bool = False, device=None) -> BlockMask:
    """`dilated` window (``|p - j| <= window``, ``(p - j) % dilation == 0``) | `global_tokens`.

    ``window`` is one-sided (Longformer's attention window ``w`` is ``window = w // 2``);
    ``global_tokens`` is an int (the first g positions) or a sequence of positions.
    ``causal=True`` makes both parts causal (``j <= p``, ``p = i + seq_k - seq_q``).
    """
    g = grid(seq_len, seq_k, block_size, device)
    window = check_int(window, "window", 0, "int number of tokens")
    dilation = check_int(dilation, "dilation", 1)
    causal = check_bool(causal, "causal")
    pos = global_positions(global_tokens, g.seq_k, g.p_lo.device)
    return g.mask(dilated_layout(g, window, dilation, causal) | global_layout(g, pos, causal))
