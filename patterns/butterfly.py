"""Flat block butterfly (FlashAttention paper; Pixelfly's "flat block butterfly")."""

from __future__ import annotations

import math

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import check_bool, check_int, grid


def butterfly(seq_len: int, *, block_size=128, n_factors: int | None = None, butterfly_size: int | None = None,
              global_blocks: int = 0, causal: bool = False, device=None) -> BlockMask:
    """Block (i, j) is on iff ``i XOR j`` is 0 or ``2**k`` for some ``k < n_factors``.

    A block-level pattern on the square grid of ``nb = ceil(seq_len / block)`` blocks, padded up to
    a power of two ``P`` and cropped back. ``n_factors`` defaults to ``log2(P)``: with ``nb = P``
    every row holds ``1 + log2 nb`` blocks, density ``(1 + log2 nb) / nb``, O(N log N) work.
    ``butterfly_size`` (a power of two dividing ``P``) builds the butterfly on that many blocks and
    stretches each entry over ``P / butterfly_size`` blocks per side. ``global_blocks = g`` makes the
    first g block rows and columns dense (Pixelfly's low-rank part). ``causal=True`` keeps only the
    blocks holding a pair with ``j <= i`` (the lower triangle with its diagonal).
    """
    g = grid(seq_len, None, block_size, device)
    if g.bq != g.bk:
        raise ValueError(f"butterfly needs square blocks, got block_size={(g.bq, g.bk)}")
    nb = g.shape[0]
    P = 1 << max(0, (nb - 1).bit_length())
    size = P if butterfly_size is None else butterfly_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size & (size - 1) or P % size:
        raise ValueError(f"butterfly_size must be a power of two dividing the padded grid ({P} blocks), got {butterfly_size!r}")
    max_factors = size.bit_length() - 1
    if n_factors is None:
        n_factors = max_factors
    if isinstance(n_factors, bool) or not isinstance(n_factors, int) or not 0 <= n_factors <= max_factors:
        raise ValueError(f"n_factors must be an int in [0, log2(butterfly_size) = {max_factors}], got {n_factors!r}")
    global_blocks = check_int(global_blocks, "global_blocks", 0)
    if global_blocks > nb:
        raise ValueError(f"global_blocks must be at most the {nb} blocks of the grid, got {global_blocks}")
    idx = torch.arange(nb, device=device) // (P // size)
    x = idx[:, None] ^ idx[None, :]
    layout = (x & (x - 1) == 0) & (x < (1 << n_factors))  # x is 0 or a power of two below 2**n_factors
    layout[:global_blocks, :] = True
    layout[:, :global_blocks] = True
    if check_bool(causal, "causal"):
        layout &= g.causal()
    return g.mask(layout)
