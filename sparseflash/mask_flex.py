"""`BlockMask`'s conversions to and from torch's FlexAttention ``BlockMask``
(`sparseflash.mask.BlockMask.to_flex` / `BlockMask.from_flex` call `to_flex` / `from_flex_parts`).

Works on any object with BlockMask's attributes (``layout``, ``full``, ``block_size``, ``seq_q``,
``seq_k``, ``mask_mod``, ``pair_counts``) and imports only `sparseflash.mask_mods`, so
`sparseflash.mask` imports it at module level without a cycle. torch's flex_attention module is
imported inside the functions (torch >= 2.5).
"""

from __future__ import annotations

import operator

import torch

from sparseflash.mask_mods import OWN_MODS, CombinedMod, LayoutMod, causal_mod, eval_blocks, offset_causal_mod

__all__ = ["pool", "by_row", "from_rows", "to_flex", "from_flex_parts"]


def pool(grid: torch.Tensor, fq: int, fk: int, fill: bool, reduce) -> torch.Tensor:
    """Pool a bool ``[B, H, QB, KB]`` grid by ``fq x fk`` blocks, padding the edges with ``fill``."""
    qb, kb = grid.shape[-2:]
    padded = torch.nn.functional.pad(grid, (0, -kb % fk, 0, -qb % fq), value=fill)
    B, H, Q, K = padded.shape
    return reduce(reduce(padded.reshape(B, H, Q // fq, fq, K // fk, fk), -1), -2)


def by_row(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's (num, indices) form of a bool [B, H, QB, KB]: on columns first, ascending; the
    rest of each row holds the off columns (valid indices, never read)."""
    num = layout.sum(-1, dtype=torch.int32)
    idx = layout.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def from_rows(num: torch.Tensor, idx: torch.Tensor, qb: int, kb: int) -> torch.Tensor:
    """Bool [B, H, qb, kb] from a FlexAttention (num, indices) pair; entries past num and indices past
    the grid (a mask made for longer sequences) are ignored."""
    while num.dim() < 3:
        num, idx = num.unsqueeze(0), idx.unsqueeze(0)
    num, idx = num[..., :qb], idx[..., :qb, :]
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
    valid &= (idx >= 0) & (idx < kb)
    counts = torch.zeros(*idx.shape[:-1], kb + 1, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(-1, torch.where(valid, idx.long(), kb), valid.to(torch.int32))
    return counts[..., :kb] > 0


def to_flex(src, causal: bool, fb: tuple[int, int], layout_in_mask_mod: bool):
    """The Flex mask of ``src`` (a `BlockMask` already on the target device) on Flex tile ``fb``;
    see `BlockMask.to_flex`, which checks the arguments."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    bq, bk = src.block_size
    coarse = fb != src.block_size
    parts = []
    if layout_in_mask_mod or coarse:
        parts.append(LayoutMod(src.layout, src.block_size))
    if src.mask_mod is not None:
        parts.append(src.mask_mod)
    if causal:
        parts.append(causal_mod if src.seq_q == src.seq_k else offset_causal_mod(src.seq_k - src.seq_q))
    layout, full = src.layout, src.full
    if causal:
        attended = src.pair_counts(causal=True)
        layout = layout & (attended > 0)
        full = full & (attended == src.pair_counts(causal=False))
    if coarse and fb[0] % bq == 0 and fb[1] % bk == 0:
        fq, fk = fb[0] // bq, fb[1] // bk
        layout = pool(layout, fq, fk, False, torch.any)
        full = pool(full, fq, fk, True, torch.all) & layout
    elif coarse:
        truth = CombinedMod(operator.and_, parts)
        layout, full = eval_blocks(truth, src.seq_q, src.seq_k, fb, src.layout.shape[0], src.layout.shape[1],
                                   src.layout.device)
        full = full & layout
    kv_num, kv_idx = by_row(layout & ~full)
    full_num, full_idx = by_row(full)
    mask_mod = None
    if len(parts) == 1 and not isinstance(parts[0], OWN_MODS):
        mask_mod = parts[0]  # the user's function, or the causal one, as it is
    elif parts:
        mod = parts[0] if len(parts) == 1 else CombinedMod(operator.and_, parts)

        def mask_mod(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx, kv_idx)

        if layout_in_mask_mod and not (causal or coarse):
            # lets from_flex recover this mask's own mask_mod instead of nesting lookups
            mask_mod._sparseflash = (src.layout, src.block_size, src.mask_mod)
    return FlexBlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tuple(fb),
                                        mask_mod=mask_mod, seq_lengths=(src.seq_q, src.seq_k))


def from_flex_parts(flex_mask):
    """``(layout, (bq, bk), seq_q, seq_k, full or None, mask_mod or None)`` of a Flex mask, what
    `BlockMask.from_flex` builds its mask from (see there)."""
    from torch.nn.attention.flex_attention import noop_mask

    seq_q, seq_k = (int(x) for x in flex_mask.seq_lengths)
    bq, bk = (int(x) for x in flex_mask.BLOCK_SIZE)
    qb, kb = -(-seq_q // bq), -(-seq_k // bk)
    layout = from_rows(flex_mask.kv_num_blocks, flex_mask.kv_indices, qb, kb)
    full = torch.zeros_like(layout)
    if flex_mask.full_kv_num_blocks is not None:
        full = from_rows(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, qb, kb)
    layout = layout | full
    mod = flex_mask.mask_mod
    if mod is noop_mask:
        mod = None
    tag = getattr(mod, "_sparseflash", None)
    if tag is not None:
        own_layout, own_block, own_mod = tag
        inside = own_block == (bq, bk) and not bool((layout & ~own_layout.to(layout.device)).any())
        if inside:  # the lookup in mod is implied by the layout: keep the mask's own mask_mod
            mod = own_mod
    return layout, (bq, bk), seq_q, seq_k, None if mod is None else full, mod
