"""Token-level mask functions (FlexAttention's ``mask_mod`` convention, ``fn(b, h, q_idx, kv_idx) ->
bool``) that `sparseflash.mask.BlockMask` keeps as its token-level definition, and their evaluation
over blocks: `eval_blocks` (any / all of a function per block, for `BlockMask.from_fn`) and
`eval_partial` (the packed bit tiles of the partial blocks, for `BlockMask.exact_bits`).

The mask_mods made here hold tensors and move with ``.to(device)`` (`mod_to`); a user's function
is left as it is. Imports nothing of the library, so `sparseflash.mask` and its Flex conversions
(`sparseflash.mask_flex`) both build on it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FN_CHUNK_ELEMS", "LayoutMod", "DenseMod", "RangeMod", "CombinedMod", "HeadStackMod", "OWN_MODS", "mod_to",
           "causal_mod", "offset_causal_mod", "check_fn_result", "eval_blocks", "pack_bits", "eval_partial"]

# Token pairs (batch x heads x rows x keys) `from_fn` evaluates at once: the mask function's
# int64 intermediates then take 512 MiB on a GPU (64K x 64K in 64 chunks), 32 MiB on a CPU.
FN_CHUNK_ELEMS = {"cuda": 1 << 26, "cpu": 1 << 22}


def _pick(t: torch.Tensor, dim: int, idx):
    """Index for dim ``dim`` of ``t``: ``idx`` where the dim is real, 0 where it is broadcast (size 1)."""
    return idx if t.shape[dim] > 1 else 0


class LayoutMod:
    """mask_mod of a block layout: pair (q, kv) is on iff its block is on. Broadcasts like FlexAttention's
    mask_mods (tensors of indices in, a bool tensor out) and moves with ``.to(device)``."""

    def __init__(self, layout: torch.Tensor, block_size: tuple[int, int]):
        self.layout, self.block_size = layout, block_size

    def __call__(self, b, h, q_idx, kv_idx):
        bq, bk = self.block_size
        lay = self.layout
        return lay[_pick(lay, 0, b), _pick(lay, 1, h), q_idx // bq, kv_idx // bk]

    def to(self, device):
        return LayoutMod(self.layout.to(device), self.block_size)


class DenseMod:
    """mask_mod of a token-level bool mask ``[B', H', seq_q, seq_k]`` (a lookup)."""

    def __init__(self, token_mask: torch.Tensor):
        self.token_mask = token_mask

    def __call__(self, b, h, q_idx, kv_idx):
        tm = self.token_mask
        return tm[_pick(tm, 0, b), _pick(tm, 1, h), q_idx, kv_idx]

    def to(self, device):
        return DenseMod(self.token_mask.to(device))


class RangeMod:
    """mask_mod of key ranges: query i of batch row b attends keys ``start[b, i] <= j < end[b, i]``
    (int64 ``[B', seq_q]`` each)."""

    def __init__(self, start: torch.Tensor, end: torch.Tensor):
        self.start, self.end = start, end

    def __call__(self, b, h, q_idx, kv_idx):
        bb = _pick(self.start, 0, b)
        return (kv_idx >= self.start[bb, q_idx]) & (kv_idx < self.end[bb, q_idx])

    def to(self, device):
        return RangeMod(self.start.to(device), self.end.to(device))


class CombinedMod:
    """``op`` (and / or) of mask_mods, applied left to right."""

    def __init__(self, op, parts):
        self.op, self.parts = op, tuple(parts)

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for part in self.parts[1:]:
            out = self.op(out, part(b, h, q_idx, kv_idx))
        return out

    def to(self, device):
        return CombinedMod(self.op, [mod_to(p, device) for p in self.parts])


class HeadStackMod:
    """mask_mod of masks stacked along heads: head ``h`` in ``[starts[i], starts[i] + heads[i])`` reads
    ``parts[i]`` at head ``h - starts[i]``."""

    def __init__(self, parts, heads):
        self.parts, self.heads = tuple(parts), tuple(heads)

    def __call__(self, b, h, q_idx, kv_idx):
        out, start = None, 0
        for part, n in zip(self.parts, self.heads):
            here = (h >= start) & (h < start + n)
            # clamp keeps the index in range for the heads where `here` is False
            v = here & part(b, (h - start).clamp(0, n - 1), q_idx, kv_idx)
            out = v if out is None else out | v
            start += n
        return out

    def to(self, device):
        return HeadStackMod([mod_to(p, device) for p in self.parts], self.heads)


OWN_MODS = (LayoutMod, DenseMod, CombinedMod, HeadStackMod)


def mod_to(mod, device):
    """Move a mask_mod made here (which holds tensors) to ``device``; a user's function is left as is."""
    return mod.to(device) if isinstance(mod, OWN_MODS) else mod


def _causal_mod(b, h, q_idx, kv_idx):
    # Module level so that torch.compile sees one function across masks (no recompiles).
    return q_idx >= kv_idx


causal_mod = _causal_mod  # (its __name__ stays _causal_mod, as masks made before the split show)


def offset_causal_mod(offset: int):
    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return causal_mod


def check_fn_result(out, fn, shape: tuple[int, int, int, int], device) -> torch.Tensor:
    """fn's result as a bool tensor broadcast to 4-D, with batch / head dims 1 or full."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        what = f"a tensor of dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(
            f"fn must return a bool torch.Tensor (FlexAttention's mask_mod convention), got {what} from {fn!r}"
        )
    if out.device != torch.device(device) and not (out.device.type == torch.device(device).type == "cuda"):
        raise ValueError(f"fn returned a tensor on {out.device}, expected {device} (pass device= to match its tensors)")
    try:
        target = torch.broadcast_shapes(out.shape, (1, 1, shape[2], shape[3]))
    except RuntimeError:
        target = None
    if target is None or len(target) != 4 or target[0] not in (1, shape[0]) or target[1] not in (1, shape[1]) \
            or target[2:] != shape[2:]:
        raise ValueError(
            f"fn returned shape {tuple(out.shape)}, which does not broadcast to [batch, heads, q, kv] = "
            f"{list(shape)} (it is called with b [{shape[0]},1,1,1], h [1,{shape[1]},1,1], q_idx [1,1,{shape[2]},1] "
            f"and kv_idx [1,1,1,{shape[3]}] int64 tensors)"
        )
    return out.expand(target)


def eval_blocks(fn, seq_q: int, seq_k: int, block_size: tuple[int, int], batch: int, heads: int, device,
                 chunk_elems: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) of ``fn`` over the real token pairs of every block: bool ``[B', H', QB, KB]`` each.

    Query rows are evaluated a chunk of block rows at a time; indices past the end of a sequence are
    clamped to its last token, which repeats a real row / column of the block and so changes neither
    ``any`` nor ``all``. Memory: one chunk of ``chunk_elems`` pairs (plus fn's intermediates).
    """
    bq, bk = block_size
    qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
    device = torch.device(device)
    if chunk_elems is None:
        chunk_elems = FN_CHUNK_ELEMS["cuda" if device.type == "cuda" else "cpu"]
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv = torch.arange(kb * bk, device=device).clamp_(max=seq_k - 1).view(1, 1, 1, kb * bk)
    anys, alls = [], []
    i0, step = 0, 1  # the first chunk is one block row; its result's shape sizes the rest
    while i0 < qb:
        i1 = min(qb, i0 + step)
        q = torch.arange(i0 * bq, i1 * bq, device=device).clamp_(max=seq_q - 1).view(1, 1, -1, 1)
        out = check_fn_result(fn(b, h, q, kv), fn, (batch, heads, (i1 - i0) * bq, kb * bk), device)
        lb, lh = out.shape[:2]
        tiles = out.reshape(lb, lh, i1 - i0, bq, kb, bk)
        anys.append(tiles.any(dim=-1).any(dim=-2))
        alls.append(tiles.all(dim=-1).all(dim=-2))
        if i0 == 0:
            step = max(1, chunk_elems // (lb * lh * bq * kb * bk))
        i0 = i1
    lead = torch.broadcast_shapes(*(a.shape[:2] for a in anys))
    any_ = torch.cat([a.expand(*lead, -1, -1) for a in anys], dim=2)
    all_ = torch.cat([a.expand(*lead, -1, -1) for a in alls], dim=2)
    return any_, all_



def pack_bits(on: torch.Tensor) -> torch.Tensor:
    """bool ``[n, R, C]`` -> int32 ``[n, R, ceil(C / 32)]``, bit ``c % 32`` of word ``c // 32``."""
    n, r, c = on.shape
    w = math.ceil(c / 32)
    on = torch.nn.functional.pad(on, (0, 32 * w - c)).view(n, r, w, 32)
    words = (on.to(torch.int64) << torch.arange(32, device=on.device)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def eval_partial(fn, nz: torch.Tensor, seq_q: int, seq_k: int, block_size: tuple[int, int],
                  chunk_elems: int) -> torch.Tensor:
    """``fn`` over the blocks ``nz [P, 4]`` (batch, head, q block, k block), a chunk of blocks at a
    time, packed (`pack_bits`): int32 ``[P, block_q, ceil(block_k / 32)]``. Called with ``b, h
    [n, 1, 1, 1]``, ``q_idx [n, 1, block_q, 1]``, ``kv_idx [n, 1, 1, block_k]`` (indices past a
    sequence's end clamped to its last token; those pairs are then set off)."""
    bq, bk = block_size
    dev = nz.device
    oq, ok = torch.arange(bq, device=dev), torch.arange(bk, device=dev)
    step = max(1, chunk_elems // (bq * bk))
    out = []
    for i in range(0, nz.shape[0], step):
        blk = nz[i:i + step]
        n = blk.shape[0]
        q = blk[:, 2, None] * bq + oq  # [n, bq]
        kv = blk[:, 3, None] * bk + ok  # [n, bk]
        on = fn(blk[:, 0].view(n, 1, 1, 1), blk[:, 1].view(n, 1, 1, 1), q.clamp(max=seq_q - 1).view(n, 1, bq, 1),
                kv.clamp(max=seq_k - 1).view(n, 1, 1, bk))
        if not isinstance(on, torch.Tensor) or on.dtype != torch.bool:
            what = f"a tensor of dtype {on.dtype}" if isinstance(on, torch.Tensor) else type(on).__name__
            raise TypeError(f"mask_mod must return a bool torch.Tensor (FlexAttention's convention), got {what} "
                            f"from {fn!r}")
        try:
            on = on.to(dev).expand(n, 1, bq, bk).reshape(n, bq, bk)
        except RuntimeError:
            raise ValueError(f"mask_mod returned shape {tuple(on.shape)} for index tensors b, h [{n},1,1,1], "
                             f"q_idx [{n},1,{bq},1], kv_idx [{n},1,1,{bk}]: it must broadcast elementwise") from None
        on = on & (q < seq_q)[:, :, None] & (kv < seq_k)[:, None, :]
        out.append(pack_bits(on))
    return torch.cat(out) if len(out) > 1 else out[0]

