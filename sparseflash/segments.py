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

Key ranges (`sparseflash.attention`'s ``key_ranges``) say the same for documents that lie in one
contiguous span each, and more: query ``i`` attends keys ``start[i] <= j < end[i]`` only. Flash-attn's
varlen call (``cu_seqlens_q != cu_seqlens_k`` too) is such a table (`key_ranges_from_cu_seqlens`):
sequence ``d``'s queries take its keys ``[cu_k[d], cu_k[d + 1])``, and with ``causal`` query ``i`` ends
at ``i - cu_q[d + 1] + cu_k[d + 1] + 1`` (bottom-right aligned inside each sequence), which a causal
offset for the whole packed row cannot express when the sequences' length differences differ.

In the Triton kernels a tile of which every query and every key carries one and the same id
skips the element-wise comparison (a scalar test per tile on the ids' min and max); others AND
``seg_q == seg_k`` into the score mask. The block lists are rebuilt on the device at every call
(a few small tensor ops, no host synchronisation: usable under torch.compile and CUDA graphs).
"""

from __future__ import annotations

import torch

__all__ = ["segments_from_cu_seqlens", "check_segment_ids", "segment_block_layout", "key_ranges_from_cu_seqlens",
           "check_key_ranges", "key_range_block_layout"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _tracing() -> bool:
    from sparseflash.mask import tracing

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


def key_ranges_from_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                               causal: bool = False, window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Key ranges ``[1, total_q, 2]`` (int32 ``(start, end)`` per query) of flash-attn's varlen
    call: query ``i`` of sequence ``d`` (``cu_seqlens_q[d] <= i < cu_seqlens_q[d + 1]``) attends the
    keys ``cu_seqlens_k[d] <= j < cu_seqlens_k[d + 1]``; in sequence coordinates (``L_q``, ``L_k``
    its lengths) with ``causal`` only ``j <= i + L_k - L_q`` (bottom-right aligned: the last query
    of each sequence sees its last key; with ``L_q > L_k`` its first ``L_q - L_k`` queries see
    nothing), and with ``window_size = (left, right)`` (negative: unbounded; ``causal`` sets
    ``right = 0``) only ``i + L_k - L_q - left <= j <= i + L_k - L_q + right``, as flash-attn.
    Queries past ``cu_seqlens_q[-1]`` attend nothing. Built on the device (no host read);
    ``cu_seqlens_q`` and ``cu_seqlens_k`` are validated by the caller (`sparseflash.flash_attn_varlen_func`).
    """
    left, right = window_size
    if causal:
        right = 0
    device = cu_seqlens_q.device
    cq = cu_seqlens_q.to(torch.int64)
    ck = cu_seqlens_k.to(device=device, dtype=torch.int64)
    i = torch.arange(total_q, device=device, dtype=torch.int64)
    d = torch.searchsorted(cq[1:].contiguous(), i, right=True)  # each query's sequence; n_seq past the end
    n_seq = cq.numel() - 1
    inside = d < n_seq
    dc = d.clamp(max=n_seq - 1)
    start, end = ck[dc], ck[dc + 1]
    diag = i - cq[dc + 1] + end  # the key on query i's bottom-right diagonal
    if right >= 0:
        end = torch.minimum(end, diag + right + 1)
    if left >= 0:
        start = torch.maximum(start, diag - left)
    start = torch.where(inside, start, 0)
    end = torch.where(inside, torch.maximum(end, start), 0)  # empty ranges as (start, start)
    return torch.stack([start, end], dim=-1).to(torch.int32).unsqueeze(0)


def check_key_ranges(key_ranges, batch: int, seq_q: int, seq_k: int, device) -> torch.Tensor | None:
    """Validate ``key_ranges`` (an integer tensor ``[batch or 1, seq_q, 2]``) and return the
    kernels' table: int32 ``[batch or 1, 2, seq_q]``, contiguous, values clamped to ``[0, seq_k]``
    (the same pairs), or None."""
    if key_ranges is None:
        return None
    if not isinstance(key_ranges, torch.Tensor):
        raise TypeError(f"key_ranges must be an integer torch.Tensor [batch, seq_q, 2], got {type(key_ranges).__name__}")
    if key_ranges.dtype not in _INT_DTYPES:
        raise TypeError(f"key_ranges must have an integer dtype, got {key_ranges.dtype}")
    if key_ranges.dim() != 3 or key_ranges.shape[0] not in (1, batch) or key_ranges.shape[1] != seq_q \
            or key_ranges.shape[2] != 2:
        raise ValueError(f"key_ranges must have shape [batch, seq_q, 2] = [{batch}, {seq_q}, 2] (or [1, {seq_q}, 2]): "
                         f"(start, end) of each query's keys, got {tuple(key_ranges.shape)}")
    if key_ranges.device != device:
        raise ValueError(f"key_ranges must be on q's device {device}, got {key_ranges.device}")
    return key_ranges.clamp(0, seq_k).to(torch.int32).transpose(1, 2).contiguous()


def key_range_block_layout(table: torch.Tensor, seq_k: int, block_q: int, block_k: int) -> torch.Tensor:
    """Bool ``[B, 1, q_blocks, k_blocks]`` of a key-range table (`check_key_ranges`'s int32
    ``[B, 2, seq_q]``): block pair (r, c) is on iff key block c meets the span from the smallest
    start to the largest end of q block r's non-empty ranges (never misses an attended pair; for
    flash-attn's varlen ranges, only blocks that hold keys of a query's own sequence)."""
    b, _, n = table.shape
    lo, hi = table[:, 0], table[:, 1]
    some = hi > lo
    lo = torch.where(some, lo, _INT32_MAX)
    hi = torch.where(some, hi, _INT32_MIN)
    nb = -(-n // block_q)
    pad = nb * block_q - n
    if pad:
        lo = torch.cat([lo, lo.new_full((b, pad), _INT32_MAX)], dim=1)
        hi = torch.cat([hi, hi.new_full((b, pad), _INT32_MIN)], dim=1)
    lo_min = lo.view(b, nb, block_q).amin(-1)
    hi_max = hi.view(b, nb, block_q).amax(-1)
    c0 = torch.arange(0, seq_k, block_k, device=table.device, dtype=torch.int32)
    c1 = (c0 + block_k).clamp(max=seq_k)
    on = (c0[None, None, :] < hi_max[:, :, None]) & (c1[None, None, :] > lo_min[:, :, None])
    return on.unsqueeze(1)
