"""Global tokens: listed positions attend to every key and are attended by every query."""

from __future__ import annotations

import torch

from sparseflash.mask import BlockMask
from sparseflash.patterns._grid import Grid, check_bool, global_positions, grid

_FAR = 1 << 62


def global_layout(g: Grid, pos: torch.Tensor, causal: bool) -> torch.Tensor:
    """Tiles holding a pair (i, j) with p in ``pos`` or j in ``pos`` (and j <= p if causal)."""
    qb, kb = g.shape
    off = g.seq_k - g.seq_q
    # Global keys: the smallest one in each key block (it is the first any query can see).
    k_min = torch.full((kb,), _FAR, dtype=torch.int64, device=g.p_lo.device)
    k_min = k_min.scatter_reduce(0, pos // g.bk, pos, "amin")
    # Global queries: positions p = i + off with 0 <= i < seq_q; the largest one in each block row.
    qpos = pos[(pos - off >= 0) & (pos - off < g.seq_q)]
    q_max = torch.full((qb,), -_FAR, dtype=torch.int64, device=g.p_lo.device)
    q_max = q_max.scatter_reduce(0, (qpos - off) // g.bq, qpos, "amax")
    if causal:
        rows = q_max[:, None] >= g.k_lo
        cols = k_min[None, :] <= g.p_hi
    else:
        rows = (q_max > -_FAR)[:, None].expand(qb, kb)
        cols = (k_min < _FAR)[None, :].expand(qb, kb)
    return rows | cols


def global_tokens(seq_len: int, tokens, *, block_size=128, seq_k: int | None = None, causal: bool = False,
                  device=None) -> BlockMask:
    """Pair (i, j) attended iff ``p`` or ``j`` is a global position (causal: and ``j <= p``).

    ``tokens``: an int ``g`` (the first g positions, e.g. CLS tokens) or a sequence / 1-D tensor of
    positions in ``[0, seq_k)``. ``p = i + seq_k - seq_q`` is the query's position, so with
    ``seq_k != seq_q`` a query row is global when its aligned position is listed. Alone this is a
    cross of block rows and columns; it is meant to be combined (`longformer`, `bigbird`, ``|``).
    """
    g = grid(seq_len, seq_k, block_size, device)
    pos = global_positions(tokens, g.seq_k, g.p_lo.device)
    return g.mask(global_layout(g, pos, check_bool(causal, "causal")))
