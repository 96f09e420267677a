"""Per-head stacking: a different pattern in each attention head."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparseflash.mask import BlockMask, HeadStackMod


def stack(masks: Sequence[BlockMask]) -> BlockMask:
    """Concatenate masks along the head dimension: ``stack([m1, m2])`` has layout ``[B, H1 + H2, QB, KB]``.

    Every mask must share lengths, block size and device; batch dims must be 1 or equal (size-1
    batches are broadcast). E.g. Sparse Transformer's split heads:
    ``stack([local(n, l - 1, causal=True), dilated(n, n, l, causal=True)])``. Masks with a
    ``mask_mod`` (`BlockMask.from_fn`, ...) keep it per head, and their full / partial blocks.
    """
    if isinstance(masks, BlockMask) or not isinstance(masks, Sequence):
        raise TypeError(f"masks must be a list or tuple of BlockMask, got {type(masks).__name__}")
    if len(masks) == 0:
        raise ValueError("masks must hold at least one BlockMask")
    for n, m in enumerate(masks):
        if not isinstance(m, BlockMask):
            raise TypeError(f"masks[{n}] must be a BlockMask, got {type(m).__name__}")
    first = masks[0]
    key = (first.seq_q, first.seq_k, first.block_size)
    for n, m in enumerate(masks[1:], 1):
        if (m.seq_q, m.seq_k, m.block_size) != key:
            raise ValueError(
                f"masks[{n}] is for seq_q={m.seq_q}, seq_k={m.seq_k}, block {m.block_size}, but masks[0] is "
                f"for seq_q={first.seq_q}, seq_k={first.seq_k}, block {first.block_size}"
            )
        if m.device != first.device:
            raise ValueError(f"masks[{n}] is on {m.device}, masks[0] on {first.device}: move them with .to()")
    batch = max(m.shape[0] for m in masks)
    if any(m.shape[0] not in (1, batch) for m in masks):
        raise ValueError(f"mask batch dims {[m.shape[0] for m in masks]} must each be 1 or {batch}")
    layout = torch.cat([m.layout.expand(batch, -1, -1, -1) for m in masks], dim=1)
    if all(m.mask_mod is None for m in masks):
        return BlockMask(layout, first.block_size, first.seq_q, first.seq_k)
    # Token-level definitions (from_fn / from_dense / from_flex masks) stay: head h reads its own mask's.
    full = torch.cat([m.full.expand(batch, -1, -1, -1) for m in masks], dim=1)
    mod = HeadStackMod([m.token_mod() for m in masks], [m.shape[1] for m in masks])
    return BlockMask(layout, first.block_size, first.seq_q, first.seq_k, full=full, mask_mod=mod)
