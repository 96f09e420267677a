"""Flat block butterfly (FlashAttention paper; Pixelfly's "flat block butterfly")."""

from __future__ import annotations

import math

import torch

from sparseflash.mask import BlockMask, _check_len, _pair


def butterfly(seq_len: int, *, block_size=128, n_factors: int | None = None, butterfly_size: int | None = None,
              global_blocks: int = 0, device=None) -> BlockMask:
    """Block (i, j) is on iff ``i XOR j`` is 0 or ``2**k`` for some ``k < n_factors``.

    The grid of ``nb = ceil(seq_len / block)`` blocks is padded up to a power of two ``P`` and
    cropped back. ``n_factors`` defaults to ``log2(P)`` (``1 + log2 P`` blocks per row, density
    ``~ (1 + log2 nb) / nb``). ``butterfly_size`` (a power of two dividing ``P``) builds the
    butterfly on that many blocks and stretches each entry over ``P / butterfly_size`` blocks per
    side. ``global_blocks = g`` makes the first g block rows and columns dense.
    """
    seq_len = _check_len(seq_len, "seq_len")
    bq, bk = _pair(block_size)
    if bq != bk:
        raise ValueError(f"butterfly needs square blocks, got block_size={(bq, bk)}")
    nb = math.ceil(seq_len / bq)
    P = 1 << max(0, (nb - 1).bit_length())
    size = P if butterfly_size is None else butterfly_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size & (size - 1) or P % size:
        raise ValueError(f"butterfly_size must be a power of two dividing the padded grid ({P} blocks), got {butterfly_size!r}")
    max_factors = size.bit_length() - 1
    if n_factors is None:
        n_factors = max_factors
    if isinstance(n_factors, bool) or not isinstance(n_factors, int) or not 0 <= n_factors <= max_factors:
        raise ValueError(f"n_factors must be an int in [0, log2(butterfly_size) = {max_factors}], got {n_factors!r}")
    if isinstance(global_blocks, bool) or not isinstance(global_blocks, int) or global_blocks < 0:
        raise ValueError(f"global_blocks must be a non-negative int, got {global_blocks!r}")
    stretch = P // size
    idx = torch.arange(nb, device=device) // stretch
    x = idx[:, None] ^ idx[None, :]
    # x is 0 or a power of two below 2**n_factors
    layout = (x & (x - 1) == 0) & (x < (1 << n_factors))
    if global_blocks:
        layout[:global_blocks, :] = True
        layout[:, :global_blocks] = True
    return BlockMask(layout, (bq, bk), seq_len, seq_len)
