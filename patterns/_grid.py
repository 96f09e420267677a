"""What the generators share: argument checks and block-grid geometry.

Token-level patterns are evaluated on the block grid, never on tokens. The tile of query block
I and key block J holds the query positions ``[p_lo, p_hi]`` and key positions ``[k_lo, k_hi]``
(contiguous, tails cropped to the sequence). So the offsets ``d = p - j`` it contains are exactly
the integers of ``[p_lo - k_hi, p_hi - k_lo]``, and "is any pair in the tile attended?" becomes
interval arithmetic on ``[QB, KB]`` int64 tensors: O(blocks), no token-level ``N x N`` tensor.

Positions: query i sits at key position ``p = i + seq_k - seq_q``, so with ``seq_k != seq_q``
every pattern is bottom-right aligned like ``causal`` (``j <= p``) in `sparseflash.attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseflash.mask import BlockMask, block_pair, check_len


def check_int(value, name: str, minimum: int = 0, what: str = "int") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an {what}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an {what} >= {minimum}, got {value}")
    return value


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class Grid:
    """Block geometry for ``seq_q x seq_k`` tokens: position ranges of every block row / column."""

    seq_q: int
    seq_k: int
    bq: int
    bk: int
    device: torch.device | None
    p_lo: torch.Tensor  # [QB, 1] first query position of each block row
    p_hi: torch.Tensor  # [QB, 1] last query position
    k_lo: torch.Tensor  # [1, KB] first key position of each block column
    k_hi: torch.Tensor  # [1, KB] last key position

    @property
    def shape(self) -> tuple[int, int]:
        return self.p_lo.shape[0], self.k_lo.shape[1]

    @property
    def d_lo(self) -> torch.Tensor:
        """Smallest offset ``p - j`` in each tile, [QB, KB]."""
        return self.p_lo - self.k_hi

    @property
    def d_hi(self) -> torch.Tensor:
        """Largest offset ``p - j`` in each tile, [QB, KB]."""
        return self.p_hi - self.k_lo

    def causal(self) -> torch.Tensor:
        """Tiles holding at least one pair with ``j <= p``."""
        return self.d_hi >= 0

    def mask(self, layout: torch.Tensor) -> BlockMask:
        return BlockMask(layout, (self.bq, self.bk), self.seq_q, self.seq_k)


def grid(seq_len, seq_k, block_size, device) -> Grid:
    seq_q = check_len(seq_len, "seq_len")
    seq_k = seq_q if seq_k is None else check_len(seq_k, "seq_k")
    bq, bk = block_pair(block_size)
    qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
    off = seq_k - seq_q
    q0 = torch.arange(qb, device=device, dtype=torch.int64) * bq
    k0 = torch.arange(kb, device=device, dtype=torch.int64) * bk
    return Grid(
        seq_q, seq_k, bq, bk, device,
        p_lo=(q0 + off)[:, None], p_hi=((q0 + bq).clamp(max=seq_q) - 1 + off)[:, None],
        k_lo=k0[None, :], k_hi=((k0 + bk).clamp(max=seq_k) - 1)[None, :],
    )


def has_multiple(lo: torch.Tensor, hi: torch.Tensor, m: int) -> torch.Tensor:
    """Elementwise: does the integer interval ``[lo, hi]`` contain a multiple of ``m``?"""
    return (lo <= hi) & (torch.div(hi, m, rounding_mode="floor") * m >= lo)


def random_blocks(candidates: torch.Tensor, k: int, heads: int, seed: int) -> torch.Tensor:
    """Per head and row, ``k`` blocks drawn uniformly without replacement from ``candidates``.

    ``candidates`` is bool [QB, KB]; returns bool [heads, QB, KB]. Rows with fewer than ``k``
    candidates get all of them. Floyd's algorithm, run for all heads and rows at once: k steps,
    each drawing one uniform per (head, row), so only ``k * heads * QB`` random numbers are made.
    They come from a CPU generator (float64; ``floor(u * n)`` is exact IEEE arithmetic), so a seed
    gives the same blocks on every device.
    """
    heads = check_int(heads, "heads", 1)
    seed = check_int(seed, "seed", 0)
    qb, kb = candidates.shape
    dev = candidates.device
    k = min(k, kb)
    if k == 0:
        return torch.zeros(heads, qb, kb, dtype=torch.bool, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand(k, heads, qb, generator=gen, dtype=torch.float64).to(dev)
    m = candidates.sum(-1)  # [QB] candidates per row
    first = k - m.clamp(max=k)  # a row with m < k only runs the last m steps
    taken = torch.zeros(heads, qb, kb + 1, dtype=torch.bool, device=dev)  # by candidate rank; slot kb: idle rows
    picks = []
    for s in range(k):
        j = m - k + s  # this step draws a rank in [0, j]; if it is taken, it takes j itself
        active = first <= s
        t = torch.where(active, torch.floor(u[s] * (j + 1).double()).long(), kb)
        hit = taken.gather(-1, t[..., None])[..., 0]
        pick = torch.where(active, torch.where(hit, j.expand_as(t), t), kb)
        taken.scatter_(-1, pick[..., None], True)
        picks.append(pick)
    # The rank-r candidate of a row is the first column where the running candidate count reaches r + 1.
    ranks = torch.stack(picks, -1).permute(1, 0, 2).reshape(qb, heads * k).int().contiguous()  # [QB, heads * k]
    count = candidates.cumsum(-1, dtype=torch.int32)
    cols = torch.searchsorted(count, ranks + 1).clamp(max=kb)  # idle picks (rank kb) land on kb
    cols = cols.reshape(qb, heads, k).permute(1, 0, 2)
    out = torch.zeros(heads, qb, kb + 1, dtype=torch.bool, device=dev)
    return out.scatter_(-1, cols, True)[..., :kb]


def global_positions(tokens, seq_k: int, device) -> torch.Tensor:
    """``tokens`` as an int64 tensor of key positions: an int g means the first g positions."""
    if isinstance(tokens, bool):
        raise TypeError(f"global tokens must be an int count or a sequence of positions, got {tokens!r}")
    if isinstance(tokens, int):
        if not 0 <= tokens <= seq_k:
            raise ValueError(f"global tokens count must be in [0, seq_k={seq_k}], got {tokens}")
        return torch.arange(tokens, device=device, dtype=torch.int64)
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"global token positions must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        pos = tokens.to(device=device, dtype=torch.int64)
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise TypeError(f"global tokens must be an int count or a sequence of positions, got {tokens!r}") from None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise TypeError(f"global token positions must be ints, got {items!r}")
        pos = torch.tensor(items, dtype=torch.int64).to(device)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= seq_k):
        raise ValueError(f"global token positions must lie in [0, seq_k={seq_k}), got min {int(pos.min())}, max {int(pos.max())}")
    return pos
