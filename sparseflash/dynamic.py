"""Block selection from the data, every call: `topk_blocks` (MoBA's gate, NSA's shared selection).

    mask = sparseflash.topk_blocks(q, k, num_blocks=8, block_size=128, causal=True)
    o = sparseflash.attention(q, k, v, mask, causal=True)

Scores: the mean-pooled query block times the mean-pooled key block (means over the real tokens
of a block, so a partial tail block is not diluted), per query head against its KV head (GQA).
Selection: the ``num_blocks`` best scores among the blocks a call allows, plus blocks that are
always on and not counted: with ``causal`` the query block's own key blocks (those the causal
boundary crosses), and the first ``sink_blocks`` key blocks. Causal allows the key blocks wholly
before a query block's own ones; fewer allowed blocks than ``num_blocks`` means all of them.

Everything runs on the inputs' device with fixed shapes, then `BlockMask.from_indices`: no host
synchronisation, capturable in a CUDA graph, traceable by ``torch.compile``. CUDA calls of up to
`index_kernels.MAX_SELECT_KB` key blocks pool q and k in one Triton launch (`index_kernels.pool_pair`), then
score, mask and pick in another (`index_kernels.topk_ids`); compile traces and wider rows take the
torch ops (`block_scores`, ``torch.topk`` of a static width), which give the same ids but where two
scores tie to float32 rounding (summed in another order). The selection is a discrete choice and is made without autograd (the
attention with the mask is differentiable as usual).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sparseflash import index_kernels
from sparseflash.mask import BlockMask, block_pair, tracing

__all__ = ["topk_blocks", "topk_indices", "block_scores", "pool_blocks"]

# per-head counts on their device, made once (a host-to-device copy inside a CUDA-graph capture would fail)
_COUNTS: dict = {}
# tensors that depend only on a call's shapes (`_shape_parts`, `pool_blocks`'s token counts), made once per
# shape and device outside traces and captures: an eager call then launches only the data-dependent ops
_SHAPES: dict = {}
_MAX_SHAPES = 256


def _cached(key, build):
    """``build()``, kept under ``key`` when made outside torch.compile traces and CUDA-graph captures (a
    tensor made inside one belongs to that graph)."""
    if torch.compiler.is_compiling():
        return build()  # (in the traced graph, where the compiler folds it)
    out = _SHAPES.get(key)
    if out is None:
        out = build()
        if not tracing():
            if len(_SHAPES) >= _MAX_SHAPES:
                _SHAPES.clear()
            _SHAPES[key] = out
    return out


def pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Means of ``x [B, H, N, D]`` over blocks of ``block`` tokens along N: ``[B, H, ceil(N / block), D]``
    (float32; the tail block's mean is over its real tokens)."""
    B, H, N, D = x.shape
    nb = math.ceil(N / block)
    if N % block == 0:  # whole blocks: a mean, with no padded copy
        return x.reshape(B, H, nb, block, D).mean(3, dtype=torch.float32)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - N))
    sums = padded.view(B, H, nb, block, D).sum(3)
    # tokens per block, made on the device (no host-to-device copy: none may run inside a graph capture)
    counts = _cached(("counts", N, block, x.device),
                     lambda: (N - torch.arange(nb, device=x.device) * block).clamp(max=block).to(torch.float32)[:, None])
    return sums / counts


def block_scores(q: torch.Tensor, k: torch.Tensor, block_size=128, group_size: int = 1) -> torch.Tensor:
    """Mean-pooled query block · mean-pooled key block, float32 ``[B, Hq // group_size, QB, KB]``:
    query head h against KV head ``h // (Hq // Hk)``, averaged over each group of ``group_size``
    consecutive query heads (which then share one selection)."""
    bq, bk = block_pair(block_size)
    B, Hq = q.shape[:2]
    Hk = k.shape[1]
    qp = pool_blocks(q, bq)
    kp = pool_blocks(k, bk)
    if Hq != Hk:
        kp = kp.repeat_interleave(Hq // Hk, dim=1)
    s = qp @ kp.transpose(-1, -2)  # [B, Hq, QB, KB]
    if group_size > 1:
        s = s.view(B, Hq // group_size, group_size, *s.shape[-2:]).mean(2)
    return s


def _check_qk(q, k) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.dtype.is_floating_point:
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor [batch, heads, seq, head_dim], got {what}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k's heads ({k.shape[1]}) must divide q's heads ({q.shape[1]}) (grouped-query attention)")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"q and k need at least one token, got shapes {tuple(q.shape)} and {tuple(k.shape)}")


def _counts(num_blocks, n_sel: int, device) -> tuple[int, torch.Tensor | None]:
    """(the widest count, per-selection counts int64 [n_sel] or None when all are equal)."""
    if isinstance(num_blocks, bool):
        raise TypeError("num_blocks must be an int or one int per selection, got a bool")
    if isinstance(num_blocks, int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks, None
    if isinstance(num_blocks, torch.Tensor):
        if num_blocks.dtype.is_floating_point or num_blocks.dtype == torch.bool or num_blocks.dim() != 1:
            raise TypeError(f"num_blocks as a tensor must be 1-D integer [heads], got {num_blocks.dtype} "
                            f"{tuple(num_blocks.shape)}")
        num_blocks = num_blocks.tolist()  # the counts fix topk's width: read once, on the host
    if not isinstance(num_blocks, Sequence) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                       for n in num_blocks):
        raise TypeError(f"num_blocks must be an int or a sequence of ints (one per selection), got {num_blocks!r}")
    if len(num_blocks) != n_sel:
        raise ValueError(f"num_blocks must have one count per selection ({n_sel}: query heads / group_size), "
                         f"got {len(num_blocks)}")
    if any(n < 0 for n in num_blocks):
        raise ValueError(f"num_blocks must be >= 0, got {list(num_blocks)}")
    key = (tuple(num_blocks), str(device))
    if key not in _COUNTS:
        _COUNTS[key] = torch.tensor(num_blocks, device=device)
    return max(num_blocks), _COUNTS[key]


def topk_blocks(q: torch.Tensor, k: torch.Tensor, num_blocks, block_size=128, causal: bool = False, *,
                group_size: int = 1, sink_blocks: int = 0, check: bool = False) -> BlockMask:
    """The top ``num_blocks`` key blocks of every query block, as a per-call `BlockMask` (module docstring).

    ``q [B, Hq, seq_q, D]``, ``k [B, Hk, seq_k, D]`` (Hk divides Hq). ``num_blocks``: an int, or one
    int per selection (per query head; per group with ``group_size``; read on the host, it fixes
    the width of the top-k). ``causal``: bottom-right aligned as `sparseflash.attention`'s (key j
    is visible to query i when ``j <= i + seq_k - seq_q``); the own blocks are always on and not
    counted. ``group_size``: consecutive query heads sharing one selection, scored by their mean
    (``Hq // Hk`` shares one per KV head, as NSA). ``sink_blocks``: the first key blocks, always on
    (where causal allows them) and not counted. ``check``: passed to `BlockMask.from_indices` (the
    ids made here are in range by construction).

    Returns a mask of layout ``[B, Hq, QB, KB]`` for ``seq_q`` x ``seq_k`` tokens: `topk_indices`
    through `BlockMask.from_indices`.
    """
    indices = topk_indices(q, k, num_blocks, block_size, causal, group_size=group_size, sink_blocks=sink_blocks)
    return BlockMask.from_indices(indices, q.shape[2], k.shape[2], block_size, check=check)


def _shape_parts(qb: int, kb: int, bq: int, bk: int, seq_q: int, seq_k: int, causal: bool, sink_blocks: int,
                 dev) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What `topk_indices` takes from the shapes alone: (the always-on ids int64 ``[QB, n]`` -- with
    ``causal`` the own blocks, then the sinks; -1 = none -- or None, the blocks the top-k may pick,
    bool ``[QB, KB]``)."""
    cols = torch.arange(kb, device=dev)
    parts = []
    if causal:
        off = seq_k - seq_q
        q0 = torch.arange(qb, device=dev) * bq
        q1 = (q0 + bq).clamp(max=seq_q)
        # own blocks: those holding keys q0 + off .. q1 - 1 + off (clipped to the keys there are)
        first = torch.div(q0 + off, bk, rounding_mode="floor").clamp(0, kb)  # [QB]
        last = torch.div(q1 - 1 + off, bk, rounding_mode="floor").clamp(max=kb - 1)  # [QB], < first: none
        own = first[:, None] + torch.arange(math.ceil(bq / bk) + 1, device=dev)  # [QB, n_own]
        parts.append(torch.where(own <= last[:, None], own, -1))
        allowed = cols[None, :] < first[:, None]  # [QB, KB]: wholly before the own blocks
        if sink_blocks:
            sinks = torch.arange(min(sink_blocks, kb), device=dev)
            parts.append(torch.where(sinks[None, :] <= last[:, None], sinks, -1))
    else:
        allowed = torch.ones(qb, kb, dtype=torch.bool, device=dev)
        if sink_blocks:
            parts.append(torch.arange(min(sink_blocks, kb), device=dev).expand(qb, -1))
    allowed = allowed & (cols >= sink_blocks)
    fixed = torch.cat(parts, dim=-1).long().contiguous() if parts else None
    return fixed, allowed


@torch.no_grad()
def topk_indices(q: torch.Tensor, k: torch.Tensor, num_blocks, block_size=128, causal: bool = False, *,
                 group_size: int = 1, sink_blocks: int = 0) -> torch.Tensor:
    """The key-block ids `topk_blocks` selects, int64 ``[B, Hq, QB, W]`` (-1 = none; the own and
    sink blocks, then the top-k best first), the input of `BlockMask.from_indices`: the selection
    alone (benchmarks time it apart from the index build)."""
    _check_qk(q, k)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    bq, bk = block_pair(block_size)
    B, Hq, seq_q, _ = q.shape
    seq_k = k.shape[2]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or Hq % group_size:
        raise ValueError(f"group_size must be a positive divisor of q's heads ({Hq}), got {group_size!r}")
    if isinstance(sink_blocks, bool) or not isinstance(sink_blocks, int) or sink_blocks < 0:
        raise ValueError(f"sink_blocks must be an int >= 0, got {sink_blocks!r}")
    n_sel = Hq // group_size
    width, per_sel = _counts(num_blocks, n_sel, q.device)
    qb, kb = math.ceil(seq_q / bq), math.ceil(seq_k / bk)
    dev = q.device
    fixed, allowed = _cached(("parts", qb, kb, bq, bk, seq_q, seq_k, causal, sink_blocks, dev),
                             lambda: _shape_parts(qb, kb, bq, bk, seq_q, seq_k, causal, sink_blocks, dev))
    width = min(width, kb)
    if index_kernels.select_takes(q, kb, width):  # scores, masking and top-k in one launch
        qp, kp = index_kernels.pool_pair(q, k, bq, bk)
        indices = index_kernels.topk_ids(qp, kp, fixed, width, per_sel, group_size, bq, bk, seq_q, seq_k, causal,
                                         sink_blocks)
        return indices.repeat_interleave(group_size, dim=1) if group_size > 1 else indices
    scores = block_scores(q, k, (bq, bk), group_size)  # [B, n_sel, QB, KB]
    parts = [] if fixed is None else [fixed.expand(B, n_sel, qb, -1)]
    if width:
        masked = torch.where(allowed, scores, float("-inf"))
        top, pick = masked.topk(width, dim=-1)  # [B, n_sel, QB, width], best first
        keep = top > float("-inf")
        if per_sel is not None:
            keep = keep & (torch.arange(width, device=dev) < per_sel[:, None, None])
        parts.append(torch.where(keep, pick, -1))
    if not parts:
        parts.append(torch.full((B, n_sel, qb, 1), -1, dtype=torch.long, device=dev))
    # (cat also copies a lone cached part, which the caller must not be able to write into)
    indices = parts[0] if len(parts) == 1 and fixed is None else torch.cat(parts, dim=-1)
    if group_size > 1:
        indices = indices.repeat_interleave(group_size, dim=1)
    return indices
