"""`BlockMask`: the one mask type sparseflash speaks.

A block mask says, for every (query block, key block) tile of the attention matrix, whether that
tile is computed. Attention semantics are block-level: every token pair inside an "on" block is
attended (subject to `causal` and `key_lengths`, which the attention call applies on top).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

__all__ = ["BlockMask", "BlockIndex"]


def _pair(block_size, name: str = "block_size") -> tuple[int, int]:
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


def _check_len(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of tokens, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _tracing() -> bool:
    """True under torch.compile tracing or CUDA-graph capture, where reading values would sync or break."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _sorted_nonzero(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass(frozen=True)
class BlockIndex:
    """Compressed index form of a `BlockMask` on one device (see module docstring)."""

    kv_num: torch.Tensor  # [B', H', QB] int32
    kv_idx: torch.Tensor  # [B', H', QB, KB] int32
    q_num: torch.Tensor  # [B', H', KB] int32
    q_idx: torch.Tensor  # [B', H', KB, QB] int32
    # fraction of the layout's blocks that are on (host float), read once outside torch.compile
    # traces and CUDA-graph captures (None when built inside one, until a later call outside)
    density: float | None = None


class BlockMask:
    """A block-sparse attention mask: a bool block layout plus the lengths it was built for.

    Build one with `BlockMask.from_layout`, `BlockMask.from_dense` or a generator from
    `sparseflash.patterns`. Combine with ``|`` and ``&``; move with ``.to(device)``.
    """

    __slots__ = ("layout", "block_size", "seq_q", "seq_k", "_index_cache")

    def __init__(self, layout: torch.Tensor, block_size=128, seq_q: int | None = None, seq_k: int | None = None):
        layout = _as_layout(layout)
        bq, bk = _pair(block_size)
        qb, kb = layout.shape[-2:]
        if seq_q is None:
            raise TypeError("seq_q is required: the number of query tokens the mask was built for")
        seq_q = _check_len(seq_q, "seq_q")
        seq_k = seq_q if seq_k is None else _check_len(seq_k, "seq_k")
        if qb != math.ceil(seq_q / bq) or kb != math.ceil(seq_k / bk):
            raise ValueError(
                f"layout grid {qb}x{kb} does not match seq_q={seq_q}, seq_k={seq_k} with block size "
                f"{(bq, bk)}: expected ceil(seq_q/block_q) x ceil(seq_k/block_k) = "
                f"{math.ceil(seq_q / bq)}x{math.ceil(seq_k / bk)}"
            )
        self.layout = layout
        self.block_size = (bq, bk)
        self.seq_q = seq_q
        self.seq_k = seq_k
        self._index_cache: dict[torch.device, BlockIndex] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_layout(cls, layout, block_size=128, seq_q: int | None = None, seq_k: int | None = None) -> "BlockMask":
        """Wrap a bool block layout ``[QB, KB]``, ``[H, QB, KB]`` or ``[B, H, QB, KB]``.

        ``seq_k`` defaults to ``seq_q``. Without ``seq_q`` the grid is taken as whole blocks:
        ``seq_q = QB * block_q`` and ``seq_k = KB * block_k``.
        """
        layout = _as_layout(layout)
        bq, bk = _pair(block_size)
        if seq_q is None:
            seq_q = layout.shape[-2] * bq
            seq_k = layout.shape[-1] * bk if seq_k is None else seq_k
        return cls(layout, (bq, bk), seq_q, seq_k)

    @classmethod
    def from_dense(cls, token_mask, block_size=128) -> "BlockMask":
        """Pool a token-level bool mask ``[.., seq_q, seq_k]``: a block is on iff any pair in it is on."""
        if not isinstance(token_mask, torch.Tensor):
            raise TypeError(f"token_mask must be a torch.Tensor of dtype bool, got {type(token_mask).__name__}")
        if token_mask.dtype != torch.bool:
            raise TypeError(f"token_mask must have dtype torch.bool, got {token_mask.dtype}")
        if token_mask.dim() not in (2, 3, 4):
            raise ValueError(
                f"token_mask must be [seq_q, seq_k], [heads, seq_q, seq_k] or [batch, heads, seq_q, seq_k], "
                f"got shape {tuple(token_mask.shape)}"
            )
        bq, bk = _pair(block_size)
        seq_q, seq_k = token_mask.shape[-2:]
        if seq_q == 0 or seq_k == 0:
            raise ValueError(f"token_mask must have nonzero lengths, got shape {tuple(token_mask.shape)}")
        qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
        padded = torch.nn.functional.pad(token_mask, (0, kb * bk - seq_k, 0, qb * bq - seq_q))
        lead = padded.shape[:-2]
        pooled = padded.reshape(*lead, qb, bq, kb, bk).any(dim=-1).any(dim=-2)
        return cls(pooled, (bq, bk), seq_q, seq_k)

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
        out = BlockMask(self.layout.to(device), self.block_size, self.seq_q, self.seq_k)
        if device in self._index_cache:
            out._index_cache[device] = self._index_cache[device]
        return out

    def to_dense(self) -> torch.Tensor:
        """Token-level bool mask ``[B', H', seq_q, seq_k]`` (every pair of an on block)."""
        bq, bk = self.block_size
        dense = self.layout.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        return dense[..., : self.seq_q, : self.seq_k]

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
            kv_num, kv_idx = _sorted_nonzero(layout)
            q_num, q_idx = _sorted_nonzero(layout.transpose(-1, -2))
            cached = BlockIndex(kv_num, kv_idx, q_num, q_idx, None if _tracing() else self.density())
            if not torch.compiler.is_compiling():
                self._index_cache[device] = cached
        elif cached.density is None and not _tracing():
            cached = self._index_cache[device] = replace(cached, density=self.density())
        return cached

    def expand_as_heads(self, batch: int, heads: int) -> "BlockMask":
        """A mask whose layout is materialised to ``[batch, heads, QB, KB]``."""
        self._check_broadcast(batch, heads)
        return BlockMask(self.layout.expand(batch, heads, *self.num_blocks).contiguous(), self.block_size, self.seq_q, self.seq_k)

    def _check_broadcast(self, batch: int, heads: int, what: str = "mask") -> None:
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
        return BlockMask(op(self.layout, other.layout), self.block_size, self.seq_q, self.seq_k)

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
        grid = self.layout[slice_index].cpu()
        qb, kb = grid.shape
        fq, fk = math.ceil(qb / max_cells), math.ceil(kb / max_cells)
        if fq > 1 or fk > 1:
            pad = torch.nn.functional.pad(grid, (0, -kb % fk, 0, -qb % fq))
            grid = pad.reshape(pad.shape[0] // fq, fq, pad.shape[1] // fk, fk).any(-1).any(1)
        return "\n".join("".join("█" if x else "·" for x in row) for row in grid.tolist())

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
        from sparseflash.analysis import plot_mask

        return plot_mask(self, path=path, ax=ax, slice_index=slice_index, title=title)


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
