"""BigBird (Zaheer et al. 2020): sliding window + global tokens + random blocks."""

from __future__ import annotations

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, global_positions, grid, random_blocks
from sparseflash.patterns.global_tokens import global_layout
from sparseflash.patterns.local import local_layout


def bigbird(seq_len: int, window: int, global_tokens, random_blocks_per_row: int, *, block_size=128,
            seq_k: int | None = None, heads: int = 1, seed: int = 0, causal: bool = False,
            device=None) -> BlockMask:
    """`local` (``|p - j| <= window``) | `global_tokens` | random blocks, per head.

    The random blocks are drawn, per row and head, among the blocks the window and global parts
    leave off (as BigBird does), so each row gets exactly ``random_blocks_per_row`` more blocks
    where that many are left. BigBird-ITC at block ``b`` is ``window=b`` (3 blocks per row),
    ``global_tokens=2*b``, ``random_blocks_per_row=3``. ``causal=True`` makes every part causal
    (``j <= p``, ``p = i + seq_k - seq_q``). Deterministic under ``seed`` on every device.
    """
    g = grid(seq_len, seq_k, block_size, device)
    window = check_int(window, "window", 0, "int number of tokens")
    k = check_int(random_blocks_per_row, "random_blocks_per_row", 0)
    causal = check_bool(causal, "causal")
    pos = global_positions(global_tokens, g.seq_k, g.p_lo.device)
    base = local_layout(g, window, causal) | global_layout(g, pos, causal)
    allowed = g.causal() if causal else g.d_lo.new_ones(g.shape, dtype=bool)
    return g.mask(base | random_blocks(allowed & ~base, k, heads, seed))
