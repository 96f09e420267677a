"""Attention dropout: the seed/offset bookkeeping and the keep-mask, shared by kernels and reference.

The keep decision for query row i, key column j of (batch b, query head h) is

    row(i) = (i // 16) * 8 + i % 8,   col(j) = (j // 32) * 4 + (j % 8) // 2
    words = Philox4x32-7(key=(seed_lo, seed_hi), counter=(col(j), row(i), b * heads_q + h, offset))
    u = byte 2 * ((i // 8) % 2) + j % 2 of words[(j // 8) % 4]      (byte 0 the lowest)
    keep = u >= round(p * 256)

One Philox call decides the sixteen elements {i, i + 8} x {j, j + 1, j + 8, j + 9, j + 16, j + 17,
j + 24, j + 25}, which one thread holds in the tensor-core accumulator layout of a [queries, keys]
tile: the forward and dQ kernels build their masks without moving data between threads (dK/dV
on [keys, queries] tiles moves each call's words to the threads that hold its elements; with
``TileConfig(q_rows=True)``, its default at head_dim <= 64 with dropout, it draws them as the
forward does).
The RNG is the main cost of dropout in the kernels; 7 rounds pass BigCrush (Salmon et al. 2011).

Resolution: each decision uses 8 random bits, as FlashAttention-2 does (PyTorch's SDPA flash
dropout), which halves the RNG work against 16 bits. The probability actually applied is
``effective_p(p) = round(p * 256) / 256`` (0.1 -> 0.1016, 0.2 -> 0.1992), and kept values are scaled
by ``1 / (1 - effective_p(p))``, so the expectation is exact. A p that would round to 0 or to 1
without being 0 or 1 (0 < p < 1/512 or 1 - 1/512 <= p < 1) is refused rather than silently turned
off or into "drop everything". The Triton kernels compute these bits in registers (forward and,
regenerated, backward) and `keep_mask` below computes them bit for bit, so tests compare kernels
and reference exactly: in NumPy for an eager call with an int seed, and in torch ops on int64
tensors (32-bit products from 16-bit halves, so nothing overflows; slower than NumPy on a CPU) for a
tensor seed or under ``torch.compile``, whose graph the reference path with dropout then joins
(``fullgraph=True`` included: there the seed stays a tensor, never a host int).

Seeds follow torch's generators, so ``torch.manual_seed`` controls dropout: each call draws its
(seed_lo, seed_hi, offset) with one small torch random op on the inputs' device (`draw_rng`) and
so advances the generator as torch's own random ops do. The kernels read the draw from device
memory, and backward reuses it: a call captured in a CUDA graph (``torch.compile`` with
``mode="reduce-overhead"``, ``torch.cuda.graphs``) gets fresh bits on every replay.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["keep_mask", "draw_rng", "rng_values", "next_seed_offset", "threshold", "effective_p", "check_p", "LEVELS"]

# Philox4x32 constants as Python ints (the NumPy path converts them; torch.compile never sees NumPy scalars)
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


ROUNDS = 7
LEVELS = 256  # each keep decision compares 8 random bits with round(p * LEVELS)


def check_p(p: float) -> None:
    """Refuse a dropout probability the 8-bit decisions cannot represent without turning dropout
    off (0 < p < 1/512) or into dropping everything (1 - 1/512 <= p < 1)."""
    if 0.0 < p < 1.0 and threshold(p) in (0, LEVELS):
        raise ValueError(f"dropout_p={p} is outside what the kernels' 8-bit dropout can apply (steps of 1/{LEVELS}): "
                         f"pass 0, a value in [1/{2 * LEVELS}, 1 - 1/{2 * LEVELS}), or 1")


def threshold(p: float) -> int:
    """Integer threshold on 8 random bits: drop iff bits < threshold."""
    return min(int(round(p * LEVELS)), LEVELS)


def effective_p(p: float) -> float:
    """The dropout probability the 8-bit threshold applies: round(p * 256) / 256."""
    return threshold(p) / LEVELS


def split_seed(seed: int) -> tuple[int, int]:
    return seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF


def draw_rng(device, generator: torch.Generator | None = None) -> torch.Tensor:
    """One dropout call's key and counter offset, drawn from torch's RNG on ``device``: an int64
    tensor [3] (seed_lo, seed_hi, offset), each in [0, 2**31). The kernels read it from device
    memory, so the draw is an ordinary torch random op: ``torch.manual_seed`` (or ``generator``)
    controls it, each call advances the generator, and inside a CUDA graph every replay draws
    anew (torch's graph-safe Philox), where reading the generator on the host would freeze one
    mask into the graph."""
    return torch.randint(0, 2**31, (3,), device=device, dtype=torch.int64, generator=generator)


def rng_values(rng: torch.Tensor) -> tuple[int, int]:
    """(62-bit seed, offset) of a `draw_rng` tensor, as `keep_mask` takes them (syncs with the device)."""
    lo, hi, offset = (int(x) for x in rng.tolist())
    return lo | (hi << 31), offset


def next_seed_offset(device, generator: torch.Generator | None = None):
    """(seed, offset) of the next dropout call: `rng_values` of `draw_rng` (advances the generator).
    Under ``torch.compile`` they stay 0-dim int64 tensors on ``device`` (reading them on the host
    would break the graph); `keep_mask` takes either."""
    rng = draw_rng(device, generator)
    if torch.compiler.is_compiling():
        return rng[0] | (rng[1] << 31), rng[2]
    return rng_values(rng)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``a * m`` for 32-bit values ``a`` (int64 tensor) and ``m``,
    from 16-bit partial products: no intermediate reaches 2**63."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    mid = a_hi * m_lo + a_lo * m_hi
    t = a_lo * m_lo + ((mid & 0xFFFF) << 16)
    return (a_hi * m_hi + (mid >> 16) + (t >> 32)) & _MASK32, t & _MASK32


def _philox_np(c0, c1, c2, c3, k0, k1):
    """Philox4x32 (ROUNDS rounds) on uint32 arrays (NumPy, arithmetic in uint64)."""
    u = np.uint64
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1, m0, m1, mask = u(k0), u(k1), u(_M0), u(_M1), u(_MASK32)
    for _ in range(ROUNDS):
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> u(32)) ^ c1 ^ k0, p1 & mask, (p0 >> u(32)) ^ c3 ^ k1, p0 & mask)
        k0 = (k0 + u(_W0)) & mask
        k1 = (k1 + u(_W1)) & mask
    return c0, c1, c2, c3


def _keep_mask_np(seed: int, offset: int, batch: int, heads_q: int, seq_q: int, seq_k: int, p: float,
                  device=None) -> torch.Tensor:
    seed_lo, seed_hi = split_seed(seed)
    thresh = threshold(p)
    u = np.uint64
    rows = np.arange(seq_q, dtype=np.uint64)[:, None]
    cols = np.arange(seq_k, dtype=np.uint64)[None, :]
    c0 = np.broadcast_to((cols // u(32)) * u(4) + (cols % u(8)) // u(2), (seq_q, seq_k))
    c1 = np.broadcast_to((rows // u(16)) * u(8) + rows % u(8), (seq_q, seq_k))
    word = np.broadcast_to(((cols // u(8)) % u(4)).astype(np.int64), (seq_q, seq_k))
    shift = u(16) * ((rows // u(8)) % u(2)) + u(8) * (cols % u(2))
    out = np.empty((batch * heads_q, seq_q, seq_k), dtype=bool)
    for bh in range(batch * heads_q):
        r = _philox_np(c0, c1, u(bh), u(offset), seed_lo, seed_hi)
        out[bh] = ((np.choose(word, r) >> shift) & u(0xFF)).astype(np.int64) >= thresh
    return torch.from_numpy(out.reshape(batch, heads_q, seq_q, seq_k)).to(device or "cpu")


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32 (ROUNDS rounds) on int64 tensors holding 32-bit values (keys: ints or tensors)."""
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def keep_mask(seed, offset, batch: int, heads_q: int, seq_q: int, seq_k: int, p: float,
              device=None) -> torch.Tensor:
    """The kernels' keep-mask as a bool tensor ``[batch, heads_q, seq_q, seq_k]`` (for testing and
    the reference path; materialises every pair, so keep it to modest sizes). ``seed`` and
    ``offset`` are ints (NumPy computes the bits) or 0-dim int64 tensors (`next_seed_offset` under
    ``torch.compile``; torch ops compute them, equal bit for bit)."""
    if not (torch.compiler.is_compiling() or isinstance(seed, torch.Tensor) or isinstance(offset, torch.Tensor)):
        return _keep_mask_np(int(seed), int(offset), batch, heads_q, seq_q, seq_k, p, device)
    device = torch.device(device or "cpu")
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device)
    offset = torch.as_tensor(offset, dtype=torch.int64, device=device)
    seed_lo, seed_hi = seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF  # split_seed, on tensors
    thresh = threshold(p)
    rows = torch.arange(seq_q, dtype=torch.int64, device=device)[:, None]
    cols = torch.arange(seq_k, dtype=torch.int64, device=device)[None, :]
    c0 = ((cols // 32) * 4 + (cols % 8) // 2).expand(seq_q, seq_k)
    c1 = ((rows // 16) * 8 + rows % 8).expand(seq_q, seq_k)
    word = ((cols // 8) % 4).expand(seq_q, seq_k)
    shift = 16 * ((rows // 8) % 2) + 8 * (cols % 2)
    out = []
    for bh in range(batch * heads_q):  # one [seq_q, seq_k] slice at a time: bounded memory
        r = _philox(c0, c1, torch.full_like(c0, bh), offset.expand(seq_q, seq_k), seed_lo, seed_hi)
        w = torch.where(word == 0, r[0], torch.where(word == 1, r[1], torch.where(word == 2, r[2], r[3])))
        out.append(((w >> shift) & 0xFF) >= thresh)
    if not out:
        return torch.zeros(batch, heads_q, seq_q, seq_k, dtype=torch.bool, device=device)
    return torch.stack(out).reshape(batch, heads_q, seq_q, seq_k)
