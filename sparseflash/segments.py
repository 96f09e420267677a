"""Packed variable-length sequences: segment ids, their validation, and the block lists they prune.

Several documents packed into one row of the batch attend only within themselves: query ``i``
and key ``j`` of batch row ``b`` are a candidate pair iff ``seg_q[b, i] == seg_k[b, j]``, on top
of the block mask, ``causal`` and ``key_lengths``. The test is exact at token level: document
boundaries need not fall on block edges.

Conventions:

- ``segment_ids`` is an integer tensor ``[B, N]`` (self-attention, ``seq_q == seq_k``), or a
  pair ``(q_segment_ids [B, seq_q], kv_segment_ids [B, seq_k])``; a leading dimension of 1
  broadcasts over the batch. Values are any integers that fit in int32.
- ``causal`` applies to positions of the packed row (``j <= i + seq_k - seq_q``, bottom-right
  aligned as without segments): for self-attention that is ordinary causal attention inside
  every document. With ``seq_q != seq_k`` (e.g. the last ``seq_q`` tokens of each packed row as
  queries against a longer packed key row) the offset is the rows', not each document's.
- Padding: give it an id of its own, or mask its keys with ``key_lengths`` (then padding queries
  attend to nothing and return exactly 0, with zero gradients). A query whose id no attended key
  shares returns 0 as any empty row does.
- Ids that never decrease along the row (what ``cu_seqlens`` gives: `segments_from_cu_seqlens`)
  let the kernels skip the most: a block pair is visited only when the id ranges of its query
  and key blocks overlap (`segment_block_layout`), which for sorted ids is exactly when they
  share a document. Ids in any other order stay exact (each visited tile still compares ids
  element by element) but prune less: padding marked ``-1`` after documents ``0..n`` makes the
  last block's range ``[-1, n]``, which overlaps every block. Give such padding ``n + 1``.

In the Triton kernels a tile of which every query and every key carries one and the same id
skips the element-wise comparison (a scalar test per tile on the ids' min and max); others AND
``seg_q == seg_k`` into the score mask. The block lists are rebuilt on the device at every call
(a few small tensor ops, no host synchronisation: usable under torch.compile and CUDA graphs).
"""

from __future__ import annotations

import torch

__all__ = ["segments_from_cu_seqlens", "check_segment_ids", "segment_block_layout"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _tracing() -> bool:
    from sparseflash.mask import _tracing as tracing

    return tracing()


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Segment ids ``[1, total]`` (int32) of documents packed as flash-attn's varlen interface
    describes them: document ``d`` holds tokens ``cu_seqlens[d] <= t < cu_seqlens[d + 1]``.

    ``cu_seqlens``: integer tensor ``[n_docs + 1]``, starting at 0, non-decreasing (empty
    documents are allowed). ``total`` (default ``cu_seqlens[-1]``, read from the device): the
    packed row's length; tokens from ``cu_seqlens[-1]`` to ``total`` are padding and get the id
    ``n_docs`` (ids stay non-decreasing, so block pruning stays exact). Pass ``total`` to avoid
    reading ``cu_seqlens`` on the host (inside torch.compile or a CUDA graph it must be given).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an integer torch.Tensor [n_docs + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n_docs + 1] with at least one document, got shape {tuple(cu_seqlens.shape)}")
    if total is None:
        if _tracing():
            raise ValueError("segments_from_cu_seqlens needs total= inside torch.compile or CUDA-graph capture")
        total = int(cu_seqlens[-1])
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"total must be a positive int number of tokens, got {total!r}")
    if not _tracing():
        cu = cu_seqlens.cpu().long()
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at most at total={total}, "
                             f"got {cu.tolist() if cu.numel() <= 16 else cu}")
    pos = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    # the number of document ends at or before each position: its document's index
    seg = torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), pos, right=True)
    return seg.to(torch.int32).unsqueeze(0)


def _check_one(t, name: str, batch: int, seq: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor [batch, seq], got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (int32 preferred), got {t.dtype}")
    if t.dim() != 2 or t.shape[0] not in (1, batch) or t.shape[1] != seq:
        raise ValueError(f"{name} must have shape [batch, seq] = [{batch}, {seq}] (or [1, {seq}]), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if t.dtype == torch.int64 and not _tracing():
        lo, hi = int(t.min()), int(t.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{name} values must fit in int32, got values in [{lo}, {hi}]")
    return t if t.dtype == torch.int32 and t.stride(1) == 1 else t.to(torch.int32).contiguous()


def check_segment_ids(segment_ids, batch: int, seq_q: int, seq_k: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate ``segment_ids`` (a tensor or a ``(q, kv)`` pair) and return ``(seg_q, seg_k)``
    as int32 tensors ``[1 or batch, seq]`` with unit last stride, or None."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, torch.Tensor):
        if seq_q != seq_k:
            raise ValueError(f"one segment_ids tensor is for self-attention (seq_q == seq_k), got seq_q={seq_q}, "
                             f"seq_k={seq_k}: pass a pair (q_segment_ids, kv_segment_ids)")
        s = _check_one(segment_ids, "segment_ids", batch, seq_q, device)
        return s, s
    if isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2:
        return (_check_one(segment_ids[0], "segment_ids[0] (queries)", batch, seq_q, device),
                _check_one(segment_ids[1], "segment_ids[1] (keys)", batch, seq_k, device))
    raise TypeError(f"segment_ids must be an integer tensor [batch, seq] or a pair (q_segment_ids, kv_segment_ids), "
                    f"got {type(segment_ids).__name__}")


def _block_range(seg: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` tokens: (min id, max id), each ``[B, n_blocks]`` (a partial last
    block over its real tokens only)."""
    b, n = seg.shape
    nb = -(-n // block)
    pad = nb * block - n
    s = seg.to(torch.int32)
    if pad:
        lo = torch.cat([s, s.new_full((b, pad), _INT32_MAX)], dim=1)
        hi = torch.cat([s, s.new_full((b, pad), _INT32_MIN)], dim=1)
    else:
        lo = hi = s
    return lo.view(b, nb, block).amin(-1), hi.view(b, nb, block).amax(-1)


def segment_block_layout(seg_q: torch.Tensor, seg_k: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """Bool ``[B, 1, q_blocks, k_blocks]``: block pair (r, c) may hold a pair of one segment,
    i.e. the id ranges [min, max] of q block r and k block c overlap. Never misses a pair that
    shares an id; for non-decreasing ids it is on exactly when the blocks share a document."""
    q_lo, q_hi = _block_range(seg_q, block_q)
    k_lo, k_hi = _block_range(seg_k, block_k)
    if q_lo.shape[0] != k_lo.shape[0]:
        b = max(q_lo.shape[0], k_lo.shape[0])
        q_lo, q_hi, k_lo, k_hi = (t.expand(b, -1) for t in (q_lo, q_hi, k_lo, k_hi))
    on = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    return on.unsqueeze(1)
