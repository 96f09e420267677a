"""Random blocks: ``k`` key blocks per query-block row, drawn uniformly and independently per head."""

from __future__ import annotations

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, grid, random_blocks
from sparseflash.patterns.local import local_layout


def random(seq_len: int, blocks_per_row: int, *, block_size=128, seq_k: int | None = None, heads: int = 1,
           seed: int = 0, diagonal: bool = False, causal: bool = False, device=None) -> BlockMask:
    """Each query-block row gets ``blocks_per_row`` distinct key blocks chosen uniformly at random.

    A block-level pattern (no token definition). ``diagonal=True`` also turns on the diagonal
    blocks (those holding a pair with ``j = p``, ``p = i + seq_k - seq_q``) and draws the random
    blocks from the other ones, so a row has ``1 + blocks_per_row`` blocks; it is off by default
    so that ``blocks_per_row`` is exactly what it says. ``causal=True`` draws only among blocks
    holding a pair with ``j <= p``. Rows with fewer candidates than requested get all of them.
    ``heads > 1`` draws each head independently (layout ``[1, heads, QB, KB]``). The same
    ``seed`` gives the same mask on every device (the draws come from a CPU generator).
    """
    g = grid(seq_len, seq_k, block_size, device)
    k = check_int(blocks_per_row, "blocks_per_row", 0)
    diagonal = check_bool(diagonal, "diagonal")
    allowed = g.causal() if check_bool(causal, "causal") else g.d_lo.new_ones(g.shape, dtype=bool)
    base = local_layout(g, 0, False) if diagonal else g.d_lo.new_zeros(g.shape, dtype=bool)
    return g.mask(base | random_blocks(allowed & ~base, k, heads, seed))
