"""`BlockMask`: the one mask type sparseflash speaks.

A block mask says, for every (query block, key block) tile of the attention matrix, whether that
tile is computed. Without a token-level definition every token pair inside an "on" block is
attended (subject to `causal` and `key_lengths`, which the attention call applies on top); with
one, `sparseflash.attention` applies it inside the blocks it covers only in part (below).

Layout: a boolean tensor broadcastable to ``[batch, heads, q_blocks, k_blocks]``; it is stored
4-D with size-1 batch / head dims where the mask is shared. ``q_blocks = ceil(seq_q / block_q)``,
so the last block row / column may be partial when a length is not a multiple of the block.

Kernels read the compressed index form (computed once per device, vectorised, cached):

- rows:    ``kv_num [B', H', QB]`` int32 and ``kv_idx [B', H', QB, KB]`` int32: for q-block i,
  the first ``kv_num[..., i]`` entries of ``kv_idx[..., i, :]`` are its nonzero k-blocks in
  increasing order (the rest is padding, set to ``KB``).
- columns: ``q_num [B', H', KB]`` and ``q_idx [B', H', KB, QB]``: the transpose, for backward.

The Triton kernels read only ``kv_idx`` and ``q_idx``: they count a list's parts from its entries,
which relies on the padding comparing above every block index (it is ``KB``, resp. ``QB``).

Token-level source and partial blocks. A mask built from a token-level definition
(`BlockMask.from_fn`, `BlockMask.from_dense`, `BlockMask.from_flex` with a ``mask_mod``) keeps that
definition as ``mask.mask_mod`` (FlexAttention's convention: ``fn(b, h, q_idx, kv_idx) -> bool``)
and records which on blocks it covers completely (``mask.full``) and which only in part
(``mask.partial``). ``mask.to_dense(exact=True)`` is the token-level truth, and what
`sparseflash.attention` computes by default (``exact=True``), as FlexAttention does with
``mask.to_flex()``: full blocks as every on block was before, partial blocks pair by pair.
``exact=False`` (or ``mask.block_level()``) computes every pair of an on block instead, which
equals the truth only where ``mask.partial`` is empty (``mask.is_exact``). Without a
``mask_mod`` (block layouts, the pattern zoo) every on block is full and the two are the same.

Exact masks inside partial blocks (`BlockMask.exact_bits`, computed once per device, cached):
``bits [P, block_q, ceil(block_k / 32)]`` int32, one bit tile per partial block (P of them, in the
row-major order of ``mask.partial``'s nonzeros; bit ``c % 32`` of word ``c // 32`` of row ``r``
is pair ``(r, c)`` of the block, 0 past the sequences' ends), evaluated from ``mask_mod`` over the
partial blocks only, so memory is proportional to P (a 128K-token causal window of 1024 at block
128: 2040 tiles, 4 MB), never ``seq_q x seq_k``; and int32 tables aligned with the lists,
``kv_tile`` with ``kv_idx`` and ``q_tile`` with ``q_idx``, giving each listed block's tile, -1 for
a full block (and the padding). The kernels read a tile's bits only in partial blocks.

Per-call masks (a layout selected on the GPU every step: `BlockMask.from_indices` from key-block
ids such as a top-k's, ``from_layout(..., dynamic=True)``, `sparseflash.topk_blocks`): the mask is
``dynamic``; its lists are ranked from the layout by cumulative sums instead of a sort
(`ranked_lists`, the same lists), or for CUDA ids built with the layout in one Triton launch
(`sparseflash.index_kernels`), and its density is never read back (``BlockIndex.density`` None; the
launchers get ``density_bound``, K / KB for `from_indices`, or -1), so building it and attending
with it make no host synchronisation.

Where things are: this module is the mask core (layout, index form, exact bits, algebra); the
token-level mask_mods and their evaluation over blocks are `sparseflash.mask_mods`, the FlexAttention
conversions `sparseflash.mask_flex`, the pictures `sparseflash._picture`. Their public names are
re-exported here where they were before (``HeadStackMod``).
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, replace

import torch

from sparseflash import mask_flex
from sparseflash._picture import plot_layout, text_picture
from sparseflash.mask_mods import (FN_CHUNK_ELEMS, CombinedMod, DenseMod, HeadStackMod, LayoutMod, RangeMod,
                                   check_fn_result, eval_blocks, eval_partial, mod_to)

__all__ = ["BlockMask", "BlockIndex", "ExactBits", "as_block_mask", "HeadStackMod"]

# Token pairs (batch x heads x rows x keys) `from_fn` and `exact_bits` evaluate at once (the same dict as
# `sparseflash.mask_mods.FN_CHUNK_ELEMS`, where it is documented).
_FN_CHUNK_ELEMS = FN_CHUNK_ELEMS



def block_pair(block_size, name: str = "block_size") -> tuple[int, int]:
    """``block_size`` (an int or a pair of ints) as a checked (block_q, block_k) pair; the error names ``name``."""
    if isinstance(block_size, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got a bool")
    if isinstance(block_size, int):
        bq = bk = block_size
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_size
    ):
        bq, bk = block_size
    else:
        raise TypeError(f"{name} must be an int or a pair (block_q, block_k) of ints, got {block_size!r}")
    if bq <= 0 or bk <= 0:
        raise ValueError(f"{name} must be positive, got {(bq, bk)}")
    return bq, bk


def check_len(value, name: str) -> int:
    """``value`` when it is a positive int number of tokens; else a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of tokens, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def tracing() -> bool:
    """True under torch.compile tracing or CUDA-graph capture, where reading values would sync or break."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def sorted_nonzero(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a bool [..., R, C] tensor: (count [..., R] int32, indices [..., R, C] int32).

    Nonzero column indices come first in increasing order; padding entries hold C.
    """
    n_cols = layout.shape[-1]
    count = layout.sum(-1, dtype=torch.int32)
    cols = torch.arange(n_cols, device=layout.device, dtype=torch.int32)
    # Off entries get key C + j, so a plain sort puts on-columns first in increasing order.
    keys = torch.where(layout, cols, cols + n_cols)
    idx = keys.sort(dim=-1).values
    idx = torch.where(idx >= n_cols, torch.full_like(idx, n_cols), idx)
    return count, idx.contiguous()


def ranked_lists(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sorted_nonzero` without a sort: an on column's place in its row's list is the number of on
    columns up to it (a cumulative sum), and it is scattered there; off columns go to a spare slot
    before the row, which is cut off. Fixed shapes, six small kernels, no host read: what per-call
    masks use (`BlockMask.from_indices`, ``from_layout(dynamic=True)``)."""
    n_cols = layout.shape[-1]
    rank = layout.cumsum(-1, dtype=torch.int64)  # [..., R, C]: on columns up to and including this one
    place = torch.where(layout, rank, 0)  # 1..count for on columns, the spare slot 0 for off ones
    cols = torch.arange(n_cols, device=layout.device, dtype=torch.int32).expand(layout.shape)
    out = torch.full((*layout.shape[:-1], n_cols + 1), n_cols, dtype=torch.int32, device=layout.device)
    out.scatter_(-1, place, cols)  # (only the spare slot receives more than one column)
    return rank[..., -1].to(torch.int32), out[..., 1:].contiguous()


@dataclass(frozen=True)
class BlockIndex:
    """Compressed index form of a `BlockMask` on one device (see module docstring)."""

    kv_num: torch.Tensor  # [B', H', QB] int32
    kv_idx: torch.Tensor  # [B', H', QB, KB] int32
    q_num: torch.Tensor  # [B', H', KB] int32
    q_idx: torch.Tensor  # [B', H', KB, QB] int32
    # fraction of the layout's blocks that are on (host float), read once outside torch.compile
    # traces and CUDA-graph captures (None when built inside one, until a later call outside; always
    # None for a dynamic mask, whose density is never read back)
    density: float | None = None


@dataclass(frozen=True)
class ExactBits:
    """The token-level definition of a mask's partial blocks on one device, as the kernels read it
    (see the module docstring, "Exact masks inside partial blocks").

    ``bits [P, block_q, ceil(block_k / 32)]`` int32: bit ``c % 32`` of word ``c // 32`` in row
    ``r`` of tile ``p`` says whether pair ``(r, c)`` of the p-th partial block (in the row-major
    order of ``mask.partial``'s nonzeros) is attended; pairs past the sequences' ends are 0.
    ``tile_of [B', H', QB, KB]`` int32: each block's tile index, -1 for a full or off block.
    ``kv_tile`` / ``q_tile``: ``tile_of`` read along the mask's row lists (aligned with
    `BlockIndex.kv_idx`) and column lists (aligned with ``q_idx``); -1 at full blocks and padding.
    """

    bits: torch.Tensor
    tile_of: torch.Tensor
    kv_tile: torch.Tensor
    q_tile: torch.Tensor

    def tables(self, kv_idx: torch.Tensor, q_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_tile, q_tile) aligned with other row / column lists of the same grid (e.g. the mask's
        lists pruned per call by segment ids), whose batch / head dims broadcast with ``tile_of``."""
        return _tile_table(self.tile_of, kv_idx), _tile_table(self.tile_of.transpose(-1, -2), q_idx)


def _tile_table(tile_of: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``tile_of [.., R, C]`` gathered along the sorted lists ``idx [.., R, C]`` (padding C: -1)."""
    n = tile_of.shape[-1]
    lead = torch.broadcast_shapes(tile_of.shape[:-2], idx.shape[:-2])
    t = tile_of.expand(*lead, *tile_of.shape[-2:])
    i = idx.expand(*lead, *idx.shape[-2:]).long()
    out = torch.where(i < n, t.gather(-1, i.clamp(max=n - 1)), -1)
    return out.to(torch.int32).contiguous()



class BlockMask:
    """A block-sparse attention mask: a bool block layout plus the lengths it was built for.

    Build one with `BlockMask.from_layout`, `BlockMask.from_dense`, `BlockMask.from_fn`,
    `BlockMask.from_flex` or a generator from `sparseflash.patterns`. Combine with ``|`` and ``&``;
    move with ``.to(device)``; hand to FlexAttention with ``.to_flex()``.

    ``mask_mod`` (optional): the token-level definition the mask was pooled from, ``fn(b, h, q_idx,
    kv_idx) -> bool`` as in FlexAttention; ``full`` (optional, with ``mask_mod``): bool layout of the
    on blocks whose every real pair it attends. `sparseflash.attention` applies ``mask_mod`` pair
    by pair inside the other, partial, blocks (by default; ``exact=False`` computes them entirely;
    module docstring).
    """

    __slots__ = ("layout", "block_size", "seq_q", "seq_k", "mask_mod", "_full", "_index_cache", "_exact_cache",
                 "fast_entries", "decode_lists", "dynamic", "density_bound")

    def __init__(self, layout: torch.Tensor, block_size=128, seq_q: int | None = None, seq_k: int | None = None,
                 *, full: torch.Tensor | None = None, mask_mod=None):
        layout = _as_layout(layout)
        bq, bk = block_pair(block_size)
        qb, kb = layout.shape[-2:]
        if seq_q is None:
            raise TypeError("seq_q is required: the number of query tokens the mask was built for")
        seq_q = check_len(seq_q, "seq_q")
        seq_k = seq_q if seq_k is None else check_len(seq_k, "seq_k")
        if qb != math.ceil(seq_q / bq) or kb != math.ceil(seq_k / bk):
            raise ValueError(
                f"layout grid {qb}x{kb} does not match seq_q={seq_q}, seq_k={seq_k} with block size "
                f"{(bq, bk)}: expected ceil(seq_q/block_q) x ceil(seq_k/block_k) = "
                f"{math.ceil(seq_q / bq)}x{math.ceil(seq_k / bk)}"
            )
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx) or None, got {mask_mod!r}")
        if full is not None:
            if mask_mod is None:
                raise ValueError("full is only meaningful with a mask_mod: without one every on block is full")
            full = _as_layout(full).to(layout.device)
            try:
                shape = torch.broadcast_shapes(full.shape, layout.shape)
            except RuntimeError:
                shape = None
            if shape != layout.shape:
                raise ValueError(f"full must have the layout's shape {tuple(layout.shape)}, got {tuple(full.shape)}")
            full = (full & layout).expand(layout.shape)
        self._state(layout, (bq, bk), seq_q, seq_k, mask_mod, full)

    def _state(self, layout, block, seq_q, seq_k, mask_mod=None, full=None, dynamic=False, density_bound=None):
        """Every slot, from arguments already checked (`__init__`, `_made`)."""
        self.layout = layout
        self.block_size = block
        self.seq_q = seq_q
        self.seq_k = seq_k
        self.mask_mod = mask_mod
        self._full = full
        self._index_cache: dict[torch.device, BlockIndex] = {}
        self._exact_cache: dict[torch.device, ExactBits | None] = {}
        self.fast_entries: dict = {}  # sparseflash.flash.fast's entries for calls with this mask
        self.decode_lists: dict = {}  # sparseflash.kvcache's cache-block lists of this mask, per call shape
        # a per-call mask (`from_indices`, `from_layout(dynamic=True)`): its index never reads the density
        # back (a host synchronisation); see `index`
        self.dynamic = dynamic
        # an upper bound of `density` known without a device read (`from_indices`: K ids of KB blocks per row),
        # for the launchers' work estimate of a dynamic mask (whose density is never read back); None: unknown
        self.density_bound: float | None = density_bound

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_layout(cls, layout, block_size=128, seq_q: int | None = None, seq_k: int | None = None, *,
                    dynamic: bool = False) -> "BlockMask":
        """Wrap a bool block layout ``[QB, KB]``, ``[H, QB, KB]`` or ``[B, H, QB, KB]``.

        ``seq_k`` defaults to ``seq_q``. Without ``seq_q`` the grid is taken as whole blocks:
        ``seq_q = QB * block_q`` and ``seq_k = KB * block_k``.

        ``dynamic=True``: a mask made for one call (a layout selected on the GPU every step). Its
        index is built on the layout's device without a sort or any host read (`ranked_lists`),
        so building it and attending with it never synchronises with the host (CUDA graphs,
        ``torch.compile``); its density stays unknown (``index().density`` None), so the eager
        short path (`sparseflash.flash.fast`) skips it; a `from_indices` mask, whose density bound
        is known from its shapes, takes that path (one entry for all masks of its shapes).
        """
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be a bool, got {dynamic!r}")
        layout = _as_layout(layout)
        bq, bk = block_pair(block_size)
        if seq_q is None:
            seq_q = layout.shape[-2] * bq
            seq_k = layout.shape[-1] * bk if seq_k is None else seq_k
        mask = cls(layout, (bq, bk), seq_q, seq_k)
        mask.dynamic = dynamic
        return mask

    @classmethod
    def _made(cls, layout: torch.Tensor, block: tuple[int, int], seq_q: int, seq_k: int, index: BlockIndex,
              density_bound: float) -> "BlockMask":
        """A dynamic mask from a layout and index the caller has just built to fit (bool ``[B', H', QB, KB]``
        on the index's device, QB and KB matching the lengths and ``block``): `__init__`'s `_state`
        without re-validating them, the per-call path's saving (see `from_indices`)."""
        mask = object.__new__(cls)
        mask._state(layout, block, seq_q, seq_k, dynamic=True, density_bound=density_bound)
        mask._index_cache[layout.device] = index
        return mask

    @classmethod
    def from_indices(cls, indices, seq_q: int, seq_k: int | None = None, block_size=128, *,
                     check: bool = True) -> "BlockMask":
        """A per-call mask from key-block ids: ``indices`` an integer tensor ``[B or 1, H or 1, QB, K]``
        (or ``[H, QB, K]``, ``[QB, K]``) listing, for query block ``i``, the key blocks it attends
        (a top-k output as it comes: any order, duplicates allowed, ``-1`` = none; ``K`` any width).
        ``QB = ceil(seq_q / block_q)``; ids lie in ``[0, ceil(seq_k / block_k))`` or are -1.

        Built on the indices' device with fixed shapes and no host read: for CUDA ids one Triton
        launch writes the bool layout and the kernels' row and column lists
        (`sparseflash.index_kernels`); otherwise (CPU ids, ``torch.compile`` traces, K > 1024) the ids
        are scattered into the layout (duplicates and -1 fall away there) and the lists ranked from
        it by cumulative sums (`ranked_lists`), the same lists. Capturable in a CUDA graph and
        traceable by ``torch.compile(fullgraph=True)``. The mask is ``dynamic`` (see `from_layout`):
        its density is not read back; ``mask.density_bound`` = min(K, KB) / KB bounds it for the
        launchers' work estimate.

        ``block_size``: an int or ``(block_q, block_k)``, multiples of 16 (the kernels' smallest tile).
        ``check``: validate the ids' values. On a CPU tensor outside a trace, a ValueError names the
        first bad id; on a GPU (or under ``torch.compile``) the check is ``torch._assert_async``, which
        does not synchronise: a bad id fails at the next synchronisation as a device-side assert
        (which ends the CUDA context). ``check=False`` skips it; bad ids are then ignored (never read
        out of bounds). Types and shapes are always checked (they need no device read).
        """
        if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype.is_complex \
                or indices.dtype == torch.bool:
            got = f"a {indices.dtype} tensor" if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise TypeError(f"indices must be an integer torch.Tensor of key-block ids [B, H, q_blocks, K] "
                            f"(-1 = none), got {got}")
        if indices.dim() not in (2, 3, 4):
            raise ValueError(f"indices must be [q_blocks, K], [heads, q_blocks, K] or [batch, heads, q_blocks, K], "
                             f"got shape {tuple(indices.shape)}")
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool, got {check!r}")
        seq_q = check_len(seq_q, "seq_q")
        seq_k = seq_q if seq_k is None else check_len(seq_k, "seq_k")
        bq, bk = block_pair(block_size)
        if bq % 16 or bk % 16:
            raise ValueError(f"block_size must be multiples of 16 for the kernels (their smallest tile), got "
                             f"{(bq, bk)}")
        while indices.dim() < 4:
            indices = indices.unsqueeze(0)
        qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
        if indices.shape[2] != qb:
            raise ValueError(f"indices has {indices.shape[2]} query blocks (dim -2 of shape {tuple(indices.shape)}), "
                             f"expected ceil(seq_q / block_q) = ceil({seq_q} / {bq}) = {qb}")
        if indices.shape[0] == 0 or indices.shape[1] == 0:
            raise ValueError(f"indices must have batch and heads of at least 1, got shape {tuple(indices.shape)}")
        ids = indices
        if check:
            ok = (ids >= -1) & (ids < kb)
            if ids.device.type == "cpu" and not tracing():
                bad = (~ok).nonzero()
                if bad.shape[0]:
                    where = tuple(bad[0].tolist())
                    raise ValueError(f"indices must hold key-block ids in [0, {kb}) or -1 (seq_k={seq_k}, block_k={bk}), "
                                     f"got {int(ids[where])} at {where}")
            else:
                torch._assert_async(ok.all(), f"BlockMask.from_indices: indices must hold key-block ids in [0, {kb}) "
                                              f"or -1")
        if _index_kernels().takes(ids):
            # one launch builds the layout and both lists (`sparseflash.index_kernels`); torch.compile traces
            # the torch ops below instead, which it fuses
            layout, kv_num, kv_idx, q_num, q_idx = _index_kernels().lists_from_ids(ids, kb)
            return cls._made(layout, (bq, bk), seq_q, seq_k, BlockIndex(kv_num, kv_idx, q_num, q_idx, None),
                             min(ids.shape[-1], kb) / kb)
        ids = ids if ids.dtype == torch.int64 else ids.long()
        # -1 and bad ids go to a spare column kb, cut off below
        slot = torch.where(ids < 0, kb, ids.clamp(max=kb))
        layout = torch.zeros(*ids.shape[:3], kb + 1, dtype=torch.bool, device=ids.device)
        layout.scatter_(-1, slot, True)
        mask = cls.from_layout(layout[..., :kb], (bq, bk), seq_q, seq_k, dynamic=True)
        mask.density_bound = min(ids.shape[-1], kb) / kb
        return mask

    @classmethod
    def from_dense(cls, token_mask, block_size=128) -> "BlockMask":
        """Pool a token-level bool mask ``[.., seq_q, seq_k]``: a block is on iff any pair in it is on.

        The token mask is kept (by reference) as the mask's ``mask_mod`` and ``.full`` marks the
        blocks it covers completely; `BlockMask.from_fn` does the same without an N x N tensor.
        """
        if not isinstance(token_mask, torch.Tensor):
            raise TypeError(f"token_mask must be a torch.Tensor of dtype bool, got {type(token_mask).__name__}")
        if token_mask.dtype != torch.bool:
            raise TypeError(f"token_mask must have dtype torch.bool, got {token_mask.dtype}")
        if token_mask.dim() not in (2, 3, 4):
            raise ValueError(
                f"token_mask must be [seq_q, seq_k], [heads, seq_q, seq_k] or [batch, heads, seq_q, seq_k], "
                f"got shape {tuple(token_mask.shape)}"
            )
        bq, bk = block_pair(block_size)
        seq_q, seq_k = token_mask.shape[-2:]
        if seq_q == 0 or seq_k == 0:
            raise ValueError(f"token_mask must have nonzero lengths, got shape {tuple(token_mask.shape)}")
        qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
        padded = torch.nn.functional.pad(token_mask, (0, kb * bk - seq_k, 0, qb * bq - seq_q))
        lead = padded.shape[:-2]
        tiles = padded.reshape(*lead, qb, bq, kb, bk)
        pooled = tiles.any(dim=-1).any(dim=-2)
        # full: every real pair on (the zero padding of tail blocks is not a pair)
        full = torch.nn.functional.pad(token_mask, (0, kb * bk - seq_k, 0, qb * bq - seq_q), value=True)
        full = full.reshape(*lead, qb, bq, kb, bk).all(dim=-1).all(dim=-2)
        tm = token_mask
        while tm.dim() < 4:
            tm = tm.unsqueeze(0)
        return cls(pooled, (bq, bk), seq_q, seq_k, full=full, mask_mod=DenseMod(tm))

    @classmethod
    def from_key_ranges(cls, key_ranges, seq_k: int, block_size=128) -> "BlockMask":
        """Query ``i`` attends keys ``start[i] <= j < end[i]``: ``key_ranges`` an integer tensor
        ``[batch or 1, seq_q, 2]`` of ``(start, end)`` pairs, as `sparseflash.attention`'s
        ``key_ranges`` (a sliding window, flash-attn's varlen sequences:
        `sparseflash.segments.key_ranges_from_cu_seqlens`), values clamped to ``[0, seq_k]``.

        Built from the ranges on their device in O(seq_q x k_blocks) work, never a ``seq_q x
        seq_k`` mask: a block is on iff some query's range meets its keys, full iff every real
        query's range covers all of its real keys. The ranges are the mask's ``mask_mod``, so
        `sparseflash.attention` applies them exactly inside the partial blocks (a sliding window of
        1024 at 16K tokens: the diagonal and the window's far edge, 2 of ~9 blocks a row) with the
        kernels' bit tiles, which run faster than the key-range predicate
        (experiments/studies/exact-predicates/).
        """
        if not isinstance(key_ranges, torch.Tensor) or key_ranges.dtype.is_floating_point \
                or key_ranges.dtype.is_complex or key_ranges.dtype == torch.bool:
            got = key_ranges.dtype if isinstance(key_ranges, torch.Tensor) else type(key_ranges).__name__
            raise TypeError(f"key_ranges must be an integer torch.Tensor [batch, seq_q, 2], got {got}")
        if key_ranges.dim() != 3 or key_ranges.shape[-1] != 2:
            raise ValueError(f"key_ranges must have shape [batch, seq_q, 2]: (start, end) of each query's keys, "
                             f"got {tuple(key_ranges.shape)}")
        seq_k = check_len(seq_k, "seq_k")
        batch, seq_q = key_ranges.shape[0], check_len(key_ranges.shape[1], "seq_q (key_ranges.shape[1])")
        bq, bk = block_pair(block_size)
        start, end = key_ranges.long().clamp(0, seq_k).unbind(-1)  # [B', seq_q] each
        qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
        # on: the key blocks some query's range meets, as +1 / -1 at each range's first block and past
        # its last one, summed per q block and along the keys
        some = end > start
        device = key_ranges.device
        rows = torch.arange(seq_q, device=device) // bq
        first = start // bk
        past = torch.where(some, (end - 1) // bk + 1, first)  # (an empty range adds nothing)
        marks = torch.zeros(batch, qb, kb + 1, dtype=torch.int64, device=device)
        flat = marks.view(batch, -1)
        flat.scatter_add_(1, rows * (kb + 1) + first, some.long())
        flat.scatter_add_(1, rows * (kb + 1) + past, -some.long())
        layout = (marks.cumsum(-1)[..., :kb] > 0).unsqueeze(1)  # [B', 1, QB, KB]
        pad = qb * bq - seq_q  # rows past seq_q: no say in which blocks are full
        lo = torch.nn.functional.pad(start, (0, pad), value=-1).view(batch, qb, bq).amax(-1)
        hi = torch.nn.functional.pad(end, (0, pad), value=seq_k).view(batch, qb, bq).amin(-1)
        c0 = torch.arange(0, seq_k, bk, device=device)
        c1 = (c0 + bk).clamp(max=seq_k)
        full = layout & ((lo[:, :, None] <= c0) & (hi[:, :, None] >= c1)).unsqueeze(1)
        return cls(layout, (bq, bk), seq_q, seq_k, full=full, mask_mod=RangeMod(start, end))

    @classmethod
    def from_fn(cls, fn, seq_q: int, seq_k: int | None = None, block_size=128, batch: int | None = None,
                heads: int | None = None, device=None) -> "BlockMask":
        """Pool a token-level mask function without building the ``seq_q x seq_k`` mask.

        ``fn(b, h, q_idx, kv_idx) -> bool tensor`` in FlexAttention's ``mask_mod`` convention
        (True: the pair is attended). It is called with int64 index tensors that broadcast:
        ``b [batch, 1, 1, 1]``, ``h [1, heads, 1, 1]``, ``q_idx [1, 1, rows, 1]``,
        ``kv_idx [1, 1, 1, keys]`` — so elementwise code (``q_idx >= kv_idx``,
        ``doc[q_idx] == doc[kv_idx]``, ``kv_idx < lengths[b]``, `and_masks` / `or_masks` of torch's
        flex_attention) works unchanged. ``batch`` / ``heads`` None: the mask is shared (``b = h = 0``,
        as FlexAttention's ``B=None``); a result that does not depend on ``b`` or ``h`` is stored shared.

        The function runs on ``device`` (default CPU; pass the device its captured tensors live on)
        over chunks of block rows of at most ~64M pairs on a GPU (~4M on a CPU), so memory stays
        bounded at any length; every real pair is evaluated once (64K x 64K causal sliding window:
        well under a second on an H100). Block (i, j) is on iff ``fn`` is True for some pair in it:
        the layout equals ``from_dense`` of the full token mask. ``.full`` marks the on blocks where
        ``fn`` holds for every real pair, ``.partial`` the others. ``fn`` is kept as
        ``mask.mask_mod``: `sparseflash.attention` applies it inside partial blocks (its default
        ``exact=True``), as ``to_flex`` does; with ``exact=False`` it computes partial blocks
        entirely, which matches ``fn`` only when ``mask.is_exact``.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(b, h, q_idx, kv_idx) -> bool tensor, got {fn!r}")
        seq_q = check_len(seq_q, "seq_q")
        seq_k = seq_q if seq_k is None else check_len(seq_k, "seq_k")
        for name, v in (("batch", batch), ("heads", heads)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None (shared), got {v!r}")
        bq, bk = block_pair(block_size)
        device = torch.device("cpu" if device is None else device)
        any_, all_ = eval_blocks(fn, seq_q, seq_k, (bq, bk), batch or 1, heads or 1, device)
        return cls(any_, (bq, bk), seq_q, seq_k, full=all_, mask_mod=fn)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Layout shape ``(B', H', q_blocks, k_blocks)``; B' and H' are 1 where shared."""
        return tuple(self.layout.shape)

    @property
    def num_blocks(self) -> tuple[int, int]:
        return tuple(self.layout.shape[-2:])

    @property
    def full(self) -> torch.Tensor:
        """Bool layout of the on blocks that ``mask_mod`` attends completely (every on block when
        there is no ``mask_mod``)."""
        return self.layout if self._full is None else self._full

    @property
    def partial(self) -> torch.Tensor:
        """Bool layout of the on blocks that ``mask_mod`` attends only in part. `sparseflash.attention`
        applies ``mask_mod`` pair by pair in these blocks (`exact_bits`); with ``exact=False`` it
        computes them entirely (every pair, subject to ``causal`` / ``key_lengths``). Empty without
        a ``mask_mod``."""
        return self.layout & ~self.full

    @property
    def is_exact(self) -> bool:
        """True when no on block is partial: block-level attention (``exact=False``) equals the
        token-level definition, and exact attention needs no bits."""
        return self._full is None or not bool(self.partial.any())

    def block_level(self) -> "BlockMask":
        """The same layout without the token-level definition: every pair of an on block attended,
        which is what `sparseflash.attention` computes with ``exact=False`` (``block_level().to_flex()``
        makes FlexAttention compute the same)."""
        out = BlockMask(self.layout, self.block_size, self.seq_q, self.seq_k)
        out.dynamic, out.density_bound = self.dynamic, self.density_bound
        return out

    def density(self) -> float:
        """Fraction of nonzero blocks (over every batch/head slice the layout stores)."""
        return float(self.layout.float().mean())

    def _block_extents(self):
        bq, bk = self.block_size
        qb, kb = self.num_blocks
        dev = self.layout.device
        q0 = torch.arange(qb, device=dev, dtype=torch.int64) * bq
        k0 = torch.arange(kb, device=dev, dtype=torch.int64) * bk
        return q0, (q0 + bq).clamp(max=self.seq_q), k0, (k0 + bk).clamp(max=self.seq_k)

    def pair_counts(self, causal: bool = False) -> torch.Tensor:
        """Number of attended token pairs in each block, int64 ``[QB, KB]`` (ignoring the layout).

        Tail blocks count only real tokens; with ``causal`` only pairs with
        ``j <= i + seq_k - seq_q`` (bottom-right aligned).
        """
        q0, q1, k0, k1 = self._block_extents()
        rows = (q1 - q0)[:, None]
        width = (k1 - k0)[None, :]
        if not causal:
            return rows * width
        # Sum over rows r in [q0, q1) of clamp(r + a, 0, w), a = off + 1 - k0: T(q1 + a) - T(q0 + a).
        a = (self.seq_k - self.seq_q + 1) - k0[None, :]

        def prefix(y):  # sum_{u < y} clamp(u, 0, w)
            m = torch.minimum(y - 1, width).clamp(min=0)
            return torch.where(y >= 1, m * (m + 1) // 2 + (y - 1 - width).clamp(min=0) * width, 0)

        return prefix(q1[:, None] + a) - prefix(q0[:, None] + a)

    def attended_pairs(self, causal: bool = False) -> torch.Tensor:
        """Attended token pairs per layout slice, int64 ``[B', H']``."""
        return (self.layout * self.pair_counts(causal)).sum(dim=(-1, -2))

    def token_density(self, causal: bool = False) -> float:
        """Exact fraction of the ``seq_q x seq_k`` token pairs that are attended (mean over slices)."""
        return float(self.attended_pairs(causal).double().mean()) / (self.seq_q * self.seq_k)

    def blocks_per_row(self) -> torch.Tensor:
        """Nonzero blocks in each q-block row, ``[B', H', QB]``."""
        return self.layout.sum(-1)

    # ------------------------------------------------------------------ conversion
    def to(self, device) -> "BlockMask":
        device = torch.device(device)
        if device == self.layout.device:
            return self
        out = BlockMask(self.layout.to(device), self.block_size, self.seq_q, self.seq_k,
                        full=None if self._full is None else self._full.to(device),
                        mask_mod=mod_to(self.mask_mod, device))
        out.dynamic, out.density_bound = self.dynamic, self.density_bound
        if device in self._index_cache:
            out._index_cache[device] = self._index_cache[device]
        if device in self._exact_cache:
            out._exact_cache[device] = self._exact_cache[device]
        return out

    def to_dense(self, exact: bool = False) -> torch.Tensor:
        """Token-level bool mask ``[B', H', seq_q, seq_k]``: every pair of an on block (what
        `sparseflash.attention` attends with ``exact=False``), or with ``exact=True`` only those
        ``mask_mod`` also attends (what it attends by default, and FlexAttention's semantics; the
        same without a ``mask_mod``)."""
        bq, bk = self.block_size
        dense = self.layout.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        dense = dense[..., : self.seq_q, : self.seq_k]
        if exact and self.mask_mod is not None:
            dev = self.layout.device
            b = torch.arange(dense.shape[0], device=dev).view(-1, 1, 1, 1)
            h = torch.arange(dense.shape[1], device=dev).view(1, -1, 1, 1)
            q = torch.arange(self.seq_q, device=dev).view(1, 1, -1, 1)
            kv = torch.arange(self.seq_k, device=dev).view(1, 1, 1, -1)
            out = check_fn_result(self.mask_mod(b, h, q, kv), self.mask_mod, tuple(dense.shape), dev)
            dense = dense & out
        return dense

    def index(self, device=None) -> BlockIndex:
        """The compressed index form on ``device`` (default: the mask's), computed once and cached.

        Inside a ``torch.compile`` trace the index is computed in the graph and not cached: a cached
        tensor made by the graph would be one of its outputs, which Inductor's CUDA graphs
        (``mode="reduce-overhead"``) overwrite on the next replay. Call ``mask.index(device)`` once
        outside the compiled code to keep the sort out of the graph.
        """
        device = self.layout.device if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._index_cache.get(device)
        if cached is None:
            layout = self.layout.to(device)
            lists = ranked_lists if self.dynamic else sorted_nonzero
            kv_num, kv_idx = lists(layout)
            q_num, q_idx = lists(layout.transpose(-1, -2))
            cached = BlockIndex(kv_num, kv_idx, q_num, q_idx, None if tracing() or self.dynamic else self.density())
            if not torch.compiler.is_compiling():
                self._index_cache[device] = cached
        elif cached.density is None and not (tracing() or self.dynamic):
            cached = self._index_cache[device] = replace(cached, density=self.density())
        return cached

    def exact_bits(self, device=None) -> ExactBits | None:
        """The bit tiles of the partial blocks on ``device`` (default: the mask's), built once and
        cached; None when there is nothing to apply at token level (no ``mask_mod``, or no
        partial block). ``mask_mod`` runs on the mask's device, over the partial blocks only (a
        chunk of blocks at a time, as `from_fn`), so memory is ``P x block_q x block_k / 8``
        bytes for P partial blocks, never ``seq_q x seq_k``.

        Building reads the number of partial blocks back (a host synchronisation on a GPU), so
        under ``torch.compile`` or CUDA-graph capture call it once outside first; there it raises.
        """
        if self._full is None:
            return None
        device = self.layout.device if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            return self._exact_cache[device]
        except KeyError:
            pass
        if tracing():
            raise RuntimeError(
                "a mask with a token-level definition (mask_mod) builds its partial blocks' bits on first use, "
                "which cannot happen inside torch.compile or CUDA-graph capture: call mask.exact_bits(device) once "
                "outside, or pass exact=False for block-level attention")
        partial = self.partial
        nz = partial.nonzero()  # [P, 4], row-major: the tile order
        if nz.shape[0] == 0:
            self._exact_cache[device] = None
            return None
        chunk = _FN_CHUNK_ELEMS["cuda" if self.device.type == "cuda" else "cpu"]
        bits = eval_partial(self.mask_mod, nz, self.seq_q, self.seq_k, self.block_size, chunk).to(device)
        tile_of = torch.full(partial.shape, -1, dtype=torch.int32, device=self.device)
        tile_of[partial] = torch.arange(nz.shape[0], dtype=torch.int32, device=self.device)
        tile_of = tile_of.to(device)
        index = self.index(device)
        kv_tile = _tile_table(tile_of, index.kv_idx)
        q_tile = _tile_table(tile_of.transpose(-1, -2), index.q_idx)
        out = self._exact_cache[device] = ExactBits(bits.contiguous(), tile_of, kv_tile, q_tile)
        return out

    def expand_as_heads(self, batch: int, heads: int) -> "BlockMask":
        """A mask whose layout is materialised to ``[batch, heads, QB, KB]``."""
        self.check_broadcast(batch, heads)
        shape = (batch, heads, *self.num_blocks)
        return BlockMask(self.layout.expand(shape).contiguous(), self.block_size, self.seq_q, self.seq_k,
                         full=None if self._full is None else self._full.expand(shape).contiguous(),
                         mask_mod=self.mask_mod)

    # ------------------------------------------------------------------ FlexAttention
    def to_flex(self, causal: bool = False, *, block_size=None, device=None, layout_in_mask_mod: bool = True):
        """This mask as a ``torch.nn.attention.flex_attention.BlockMask`` (torch >= 2.5).

        Full blocks go in Flex's full lists (its kernels skip ``mask_mod`` there), partial blocks in
        its partial lists; ``mask_mod`` is the token-level truth: the block lookup, and this mask's
        ``mask_mod`` if it has one, and with ``causal`` ``kv_idx <= q_idx + seq_k - seq_q``
        (blocks with no causal pair are dropped, cut ones become partial). So
        ``flex_attention(q, k, v, block_mask=mask.to_flex(causal))`` attends exactly the pairs of
        ``mask.to_dense(exact=True)`` (& causal), as ``sparseflash.attention(q, k, v, mask,
        causal=causal)`` does (for the block-level ``exact=False``, ``mask.block_level().to_flex()``).

        ``block_size``: Flex's tile (default this mask's). Compiled FlexAttention needs multiples of
        128 (smaller tiles fail to lower in torch 2.11); a multiple of this mask's block pools the
        layout, any other size re-evaluates the token-level truth on the new grid (O(seq_q x seq_k)
        work, in chunks). ``layout_in_mask_mod=False`` leaves the block lookup out of ``mask_mod``:
        compiled flex calls ``mask_mod`` only inside partial blocks, where the lookup is true, so the
        result is the same for less work there; eager flex (CPU) applies ``mask_mod`` to every pair
        and ignores the block lists, so it needs the lookup (forced on when ``block_size`` differs).
        """
        try:
            import torch.nn.attention.flex_attention  # noqa: F401  (torch >= 2.5)
        except ImportError as e:
            raise ImportError(f"to_flex needs torch.nn.attention.flex_attention (torch >= 2.5): {e}") from None
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        device = self.device if device is None else torch.device(device)
        fb = self.block_size if block_size is None else block_pair(block_size)
        return mask_flex.to_flex(self.to(device), causal, fb, layout_in_mask_mod)

    @classmethod
    def from_flex(cls, flex_mask) -> "BlockMask":
        """A `BlockMask` from a ``torch.nn.attention.flex_attention.BlockMask``.

        The layout is Flex's partial and full blocks together, on its tile (``BLOCK_SIZE``) and
        ``seq_lengths``; a Flex mask made for longer sequences and ``_adjust``-ed down is cut to its
        grid. Flex's ``mask_mod`` is kept as ``mask_mod`` and its full lists as ``full``, so its
        partial blocks show in ``.partial`` (with Flex's ``noop_mask`` every block is full). A tail
        block Flex lists as partial stays partial, even where ``mask_mod`` holds for all its real
        pairs (Flex pads tails with False). ``from_flex(m.to_flex())`` gives back ``m`` (layout,
        full blocks and mask_mod).
        """
        try:
            from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
        except ImportError as e:
            raise ImportError(f"from_flex needs torch.nn.attention.flex_attention (torch >= 2.5): {e}") from None
        if not isinstance(flex_mask, FlexBlockMask):
            raise TypeError(f"flex_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(flex_mask).__name__}")
        layout, block, seq_q, seq_k, full, mod = mask_flex.from_flex_parts(flex_mask)
        return cls(layout, block, seq_q, seq_k, full=full, mask_mod=mod)

    def check_broadcast(self, batch: int, heads: int, what: str = "mask") -> None:
        """Raises unless the layout broadcasts to ``batch`` x ``heads`` (each 1 or equal)."""
        b, h = self.layout.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(
                f"{what} layout has batch x heads = {b}x{h}, which does not broadcast to {batch}x{heads} "
                f"(each must be 1 or match)"
            )

    # ------------------------------------------------------------------ algebra
    def _combine(self, other, op, sym: str) -> "BlockMask":
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.seq_q, self.seq_k, self.block_size) != (other.seq_q, other.seq_k, other.block_size):
            raise ValueError(
                f"cannot combine masks with {sym}: one is for seq_q={self.seq_q}, seq_k={self.seq_k}, "
                f"block {self.block_size}, the other for seq_q={other.seq_q}, seq_k={other.seq_k}, "
                f"block {other.block_size}"
            )
        if self.device != other.device:
            raise ValueError(f"cannot combine masks on {self.device} and {other.device}: move one with .to()")
        try:
            torch.broadcast_shapes(self.layout.shape, other.layout.shape)
        except RuntimeError:
            raise ValueError(
                f"cannot combine masks with {sym}: layouts {tuple(self.layout.shape)} and "
                f"{tuple(other.layout.shape)} do not broadcast"
            ) from None
        layout = op(self.layout, other.layout)
        if self.mask_mod is None and other.mask_mod is None:
            return BlockMask(layout, self.block_size, self.seq_q, self.seq_k)
        # Token level: each side's truth is (its block is on) & its mask_mod. A block is known full
        # if it is full on one side (|) or on both (&); the rest of the on blocks count as partial
        # (for & an on block may even hold no attended pair: pooling an intersection is not exact).
        mod = CombinedMod(op, [self.token_mod(), other.token_mod()])
        return BlockMask(layout, self.block_size, self.seq_q, self.seq_k, full=op(self.full, other.full), mask_mod=mod)

    def token_mod(self):
        """The mask's token-level truth as one mask_mod function (FlexAttention's convention, see
        `from_fn`): the block lookup, and ``mask_mod`` where there is one. Used to combine masks
        (``|``, ``&``, the pattern zoo's head stacks) without losing their token-level definitions."""
        lookup = LayoutMod(self.layout, self.block_size)
        return lookup if self.mask_mod is None else CombinedMod(operator.and_, [lookup, self.mask_mod])

    def __or__(self, other):
        return self._combine(other, torch.logical_or, "|")

    def __and__(self, other):
        return self._combine(other, torch.logical_and, "&")

    def equal(self, other: "BlockMask") -> bool:
        """Same lengths, block size and (broadcast) layout."""
        if (self.seq_q, self.seq_k, self.block_size) != (other.seq_q, other.seq_k, other.block_size):
            return False
        try:
            shape = torch.broadcast_shapes(self.layout.shape, other.layout.shape)
        except RuntimeError:
            return False
        return bool(torch.equal(self.layout.expand(shape).cpu(), other.layout.to(self.device).expand(shape).cpu()))

    # ------------------------------------------------------------------ display
    def picture(self, max_cells: int = 32, slice_index: tuple[int, int] = (0, 0)) -> str:
        """Text picture of one (batch, head) slice; grids larger than ``max_cells`` are OR-pooled."""
        return text_picture(self.layout[slice_index].cpu(), max_cells)

    def __repr__(self) -> str:
        b, h, qb, kb = self.layout.shape
        head = (
            f"BlockMask(seq_q={self.seq_q}, seq_k={self.seq_k}, block_size={self.block_size}, "
            f"grid={qb}x{kb}, batch x heads={b}x{h}, density={self.density():.4f}, "
            f"token density={self.token_density():.4f}, device={self.device})"
        )
        note = "" if b * h == 1 else "\n(slice batch 0, head 0)"
        fq, fk = math.ceil(qb / 32), math.ceil(kb / 32)
        if fq > 1 or fk > 1:
            note += f"\n(each cell: {fq}x{fk} blocks, on if any is on)"
        return f"{head}{note}\n{self.picture()}"

    def plot(self, path=None, ax=None, slice_index: tuple[int, int] = (0, 0), title: str | None = None):
        """Draw one (batch, head) slice of the layout with matplotlib; save to ``path`` if given.

        Returns the matplotlib Axes. The title states lengths, block size, density and
        blocks per row (min / mean / max).
        """
        return plot_layout(self, path=path, ax=ax, slice_index=slice_index, title=title)


# FlexAttention masks converted by `as_block_mask`, kept while the Flex mask lives: a model passing
# one Flex mask to every layer converts it once and reuses the BlockMask's index.
_FROM_FLEX: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_BUILD_HINT = ("build one with BlockMask.from_fn(mask_mod, seq_q, seq_k) for a FlexAttention-style function "
               "mask_mod(b, h, q_idx, kv_idx), BlockMask.from_dense(token_mask) for a bool [.., seq_q, seq_k] "
               "tensor, BlockMask.from_layout(layout, block_size) for a bool block layout, or "
               "BlockMask.from_flex(flex_block_mask) for torch's FlexAttention BlockMask")


def as_block_mask(mask, name: str = "mask") -> "BlockMask | None":
    """``mask`` as a sparseflash `BlockMask`: a `BlockMask` (or None) as it is; torch's FlexAttention
    ``BlockMask`` converted with `BlockMask.from_flex` (exact: layout, full blocks and mask_mod;
    cached per Flex mask object). Anything else raises a TypeError naming ``name`` and how to build
    a `BlockMask` from it."""
    if mask is None or isinstance(mask, BlockMask):
        return mask
    cls = type(mask)
    if cls.__name__ == "BlockMask" and cls.__module__.startswith("torch.nn.attention"):
        try:
            return _FROM_FLEX[mask]
        except (KeyError, TypeError):
            pass
        converted = BlockMask.from_flex(mask)
        try:
            _FROM_FLEX[mask] = converted
        except TypeError:  # not weak-referenceable: convert per call
            pass
        return converted
    if isinstance(mask, torch.Tensor):
        what = f"a {mask.dtype} tensor of shape {tuple(mask.shape)}"
    elif callable(mask):
        what = f"the function {getattr(mask, '__name__', cls.__name__)}"
    else:
        what = f"{cls.__name__}"
    raise TypeError(f"{name} must be a sparseflash.BlockMask, a torch FlexAttention BlockMask or None, got {what}: "
                    f"{_BUILD_HINT}")


def _index_kernels():
    """sparseflash.index_kernels, imported on first use (it imports triton; this module does not)."""
    from sparseflash import index_kernels

    return index_kernels


def _as_layout(layout) -> torch.Tensor:
    if not isinstance(layout, torch.Tensor):
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            np = None
        if np is not None and isinstance(layout, np.ndarray):
            layout = torch.from_numpy(layout)
        else:
            raise TypeError(f"layout must be a bool torch.Tensor (or numpy array), got {type(layout).__name__}")
    if layout.dtype != torch.bool:
        raise TypeError(f"layout must have dtype torch.bool, got {layout.dtype} (use layout.bool() if it holds 0/1)")
    if layout.dim() not in (2, 3, 4):
        raise ValueError(
            f"layout must be [q_blocks, k_blocks], [heads, q_blocks, k_blocks] or "
            f"[batch, heads, q_blocks, k_blocks], got shape {tuple(layout.shape)}"
        )
    if layout.shape[-1] == 0 or layout.shape[-2] == 0 or layout.numel() == 0:
        raise ValueError(f"layout must have at least one block in every dim, got shape {tuple(layout.shape)}")
    while layout.dim() < 4:
        layout = layout.unsqueeze(0)
    return layout
