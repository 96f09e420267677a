"""FLOP and density accounting for attention benchmarks.

Effective FLOPs count only the token pairs the attention actually attends (block on, and with
``causal`` on or below the bottom-right aligned diagonal, and inside the sequence: tail blocks
count only real tokens). Per attended pair and head dimension ``d`` the forward pass does
``2d`` FLOPs for ``q.k`` and ``2d`` for ``p.v``: forward = ``4 * pairs * d``. Backward recomputes
``q.k`` and does four more matmuls (dV, dP, dQ, dK): 2.5x forward; forward+backward = 3.5x.
The same numerator is used for every provider at a setting, so effective TFLOP/s compare like
inverse runtimes, whatever a provider computes and throws away.
"""

from __future__ import annotations

from sparseflash.mask import BlockMask

__all__ = ["MODE_FACTOR", "dense_pairs", "attended_pairs", "attention_flops", "densities"]

# FLOPs of a mode in units of the forward pass.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def dense_pairs(seq_q: int, seq_k: int, causal: bool = False) -> int:
    """Token pairs of one head without a block mask; ``causal`` keeps ``j <= i + seq_k - seq_q``."""
    if not causal:
        return seq_q * seq_k
    off = seq_k - seq_q
    # Row i attends min(seq_k, max(0, i + off + 1)) keys. Rows with i + off + 1 <= 0 see none, rows
    # with i + off + 1 >= seq_k see all; in between the count grows by one per row.
    lo = max(0, -off)  # first row that sees a key
    hi = min(seq_q, seq_k - off - 1)  # first row that sees every key
    ramp = 0
    if hi > lo:  # sum_{i=lo}^{hi-1} (i + off + 1)
        ramp = (hi - lo) * (lo + hi - 1) // 2 + (hi - lo) * (off + 1)
    full = max(0, seq_q - max(hi, lo)) * seq_k
    return ramp + full


def attended_pairs(mask: BlockMask | None, batch: int, heads: int, seq_q: int, seq_k: int, causal: bool = False) -> int:
    """Attended token pairs summed over ``batch x heads`` (per-head / per-batch masks exact)."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mask is None:
        return batch * heads * dense_pairs(seq_q, seq_k, causal)
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a sparseflash.BlockMask or None, got {type(mask).__name__}")
    if (mask.seq_q, mask.seq_k) != (seq_q, seq_k):
        raise ValueError(f"mask is for seq_q={mask.seq_q}, seq_k={mask.seq_k}, not {seq_q}, {seq_k}")
    mask.check_broadcast(batch, heads)
    per_slice = mask.attended_pairs(causal)  # [B', H']
    b, h = per_slice.shape
    return int(per_slice.sum()) * (batch // b) * (heads // h)


def attention_flops(pairs: int, head_dim: int, mode: str) -> float:
    """Effective FLOPs of ``mode`` ('fwd', 'bwd' or 'fwdbwd') for ``pairs`` attended pairs summed over heads."""
    if mode not in MODE_FACTOR:
        raise ValueError(f"mode must be one of {tuple(MODE_FACTOR)}, got {mode!r}")
    return 4.0 * pairs * head_dim * MODE_FACTOR[mode]


def densities(mask: BlockMask | None, batch: int, heads: int, causal: bool = False) -> dict:
    """The three densities a benchmark row reports.

    - ``density``: fraction of on blocks in the layout (the mask's own block density);
    - ``token_density``: attended pairs / all ``seq_q x seq_k`` pairs (causal and tails included);
    - ``rel_density``: attended pairs / pairs of dense attention with the same ``causal``, i.e.
      the fraction of dense work left; 1.0 for dense. Plots use this on the x axis.
    """
    if mask is None:
        raise ValueError("densities() needs a BlockMask; dense rows have density 1 by definition")
    sq, sk = mask.seq_q, mask.seq_k
    pairs = attended_pairs(mask, batch, heads, sq, sk, causal)
    all_pairs = batch * heads * sq * sk
    return {
        "density": mask.density(),
        "token_density": pairs / all_pairs,
        "rel_density": pairs / (batch * heads * dense_pairs(sq, sk, causal)),
    }
