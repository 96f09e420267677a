"""Reference attention in plain PyTorch: the definition every kernel, test and benchmark checks against.

Semantics (identical to the Triton kernels):

- pair (i, j) is attended iff its block is on in ``mask`` (``None``: every block), and with
  ``exact`` and a mask built from a token-level definition iff ``mask.mask_mod`` attends it, and with
  ``causal`` ``j <= i + seq_k - seq_q`` (bottom-right aligned), and with ``key_lengths``
  ``j < key_lengths[b]``, and with ``segment_ids`` ``seg_q[b, i] == seg_k[b, j]`` (packed
  documents; `sparseflash.segments` states the conventions), and with ``key_ranges``
  ``key_ranges[b, i, 0] <= j < key_ranges[b, i, 1]``;
- the score of an attended pair is ``s = scale * q_i . k_j``, then with ``softcap``
  ``s = softcap * tanh(s / softcap)``, then with ``alibi_slopes``
  ``s = s - slope[b, h] * |i + seq_k - seq_q - j|`` (flash-attn's definitions, in that order);
- query head ``h`` reads key/value head ``h // (heads_q // heads_kv)`` (GQA / MQA);
- a query row that attends to nothing returns 0, its log-sum-exp is ``-inf``, and it passes
  zero gradient; nothing is NaN;
- with ``dropout_p > 0`` the normalised probabilities are multiplied by ``keep / (1 - p)``,
  where ``keep`` is a bool tensor ``[B, Hq, seq_q, seq_k]`` (the kernels' keep-mask comes from
  `sparseflash.dropout.keep_mask`).

Computation runs in float32 (float64 for float64 inputs) and returns the input dtype. Query rows
are processed in chunks so that long sequences never need a full ``N x N`` tensor per head; when
gradients are needed each chunk is recomputed in backward (activation checkpointing), so memory
stays ``O(chunk x N)`` there too.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

from sparseflash.mask import BlockMask

__all__ = ["attention", "naive_attention"]

# Score elements (batch x heads x rows x keys) processed at once: 2**25 fp32 = 128 MiB.
_CHUNK_ELEMS = 1 << 25


def _token_mask_rows(mask: BlockMask | None, rows: torch.Tensor, seq_k: int, causal: bool, seq_q: int,
                     key_lengths: torch.Tensor | None, device, segments=None, key_ranges=None,
                     exact: bool = False) -> torch.Tensor | None:
    """Bool [B' , H', len(rows), seq_k] (broadcastable) of attended pairs for the given query rows."""
    cols = torch.arange(seq_k, device=device)
    allowed = None
    if mask is not None:
        bq, bk = mask.block_size
        layout = mask.layout.to(device)
        allowed = layout[:, :, rows // bq][..., cols // bk]  # [B', H', R, seq_k]
        if exact and mask.mask_mod is not None:  # the token-level definition, on the mask's device
            d = mask.device
            b = torch.arange(layout.shape[0], device=d).view(-1, 1, 1, 1)
            h = torch.arange(layout.shape[1], device=d).view(1, -1, 1, 1)
            on = mask.mask_mod(b, h, rows.to(d).view(1, 1, -1, 1), cols.to(d).view(1, 1, 1, -1))
            allowed = allowed & on.to(device)
    if causal:
        c = (cols[None, :] <= rows[:, None] + (seq_k - seq_q))[None, None]
        allowed = c if allowed is None else allowed & c
    if key_lengths is not None:
        kl = (cols[None, :] < key_lengths.to(device)[:, None])[:, None, None, :]  # [B, 1, 1, seq_k]
        allowed = kl if allowed is None else allowed & kl
    if segments is not None:
        seg_q, seg_k = (t.to(device) for t in segments)
        same = (seg_q[:, rows][:, :, None] == seg_k[:, None, :])[:, None]  # [B or 1, 1, R, seq_k]
        allowed = same if allowed is None else allowed & same
    if key_ranges is not None:
        r = key_ranges.to(device)[:, rows]  # [B or 1, R, 2]
        inside = ((cols[None, None, :] >= r[..., :1]) & (cols[None, None, :] < r[..., 1:]))[:, None]
        allowed = inside if allowed is None else allowed & inside
    return allowed


def _alibi_rows(slopes: torch.Tensor, rows: torch.Tensor, seq_k: int, seq_q: int, dtype) -> torch.Tensor:
    """ALiBi's bias ``-slope[b, h] * |i + seq_k - seq_q - j|`` of the given query rows, ``[B or 1, Hq,
    len(rows), seq_k]`` in ``dtype`` (``slopes``: ``[Hq]`` or ``[B, Hq]``)."""
    cols = torch.arange(seq_k, device=rows.device)
    dist = (rows[:, None] + (seq_k - seq_q) - cols[None, :]).abs().to(dtype)  # [R, seq_k]
    sl = slopes.detach().to(device=rows.device, dtype=dtype)
    sl = sl.view(1, -1) if sl.dim() == 1 else sl
    return -sl[:, :, None, None] * dist


def _chunk(q, k, v, allowed, scale, keep, dropout_p, softcap=None, bias=None):
    """Attention for one chunk of query rows, in q's (float32/64) dtype. Returns (out, lse).
    ``softcap``: tanh soft-capping of the scaled scores; ``bias``: added after it (ALiBi)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, R, N]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()  # finite pivot for empty rows
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(denom)).squeeze(-1)  # -inf for empty rows
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v), lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None = None, *,
              causal: bool = False, scale: float | None = None, key_lengths: torch.Tensor | None = None,
              return_lse: bool = False, dropout_p: float = 0.0, dropout_keep: torch.Tensor | None = None,
              chunk_rows: int | None = None, compute_dtype: torch.dtype | None = None, segment_ids=None,
              key_ranges: torch.Tensor | None = None, softcap: float | None = None,
              alibi_slopes: torch.Tensor | None = None, exact: bool = False):
    """Reference block-sparse attention. Shapes as `sparseflash.attention`; no input validation
    beyond what the computation needs (`sparseflash.attention` validates).

    ``dropout_keep`` (bool ``[B, Hq, seq_q, seq_k]``) is required when ``dropout_p > 0``.
    ``segment_ids``: an integer tensor ``[B or 1, N]`` (``seq_q == seq_k``) or a pair
    ``(q [B or 1, seq_q], kv [B or 1, seq_k])``; pairs of different ids are not attended.
    ``key_ranges``: an integer tensor ``[B or 1, seq_q, 2]``; query i attends only keys
    ``key_ranges[b, i, 0] <= j < key_ranges[b, i, 1]``.
    ``softcap`` (a float > 0): scores become ``softcap * tanh(s / softcap)``; ``alibi_slopes``
    (``[Hq]`` or ``[B, Hq]``, no gradient): ``- slope * |i + seq_k - seq_q - j|`` is added after.
    ``exact``: apply ``mask.mask_mod`` (a mask built from a token-level definition) to every pair,
    as `sparseflash.attention`'s default ``exact=True`` does; False: block-level.
    ``compute_dtype`` overrides the float32 / float64 computation (e.g. ``q.dtype`` to measure
    what the same computation in bf16 costs in accuracy, as the tests do).
    Returns ``out`` or ``(out, lse)`` with ``lse`` float32 ``[B, Hq, seq_q]``.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if dropout_p > 0 and dropout_keep is None:
        raise ValueError("reference attention with dropout_p > 0 needs dropout_keep (see sparseflash.dropout.keep_mask)")
    if dropout_p >= 1.0:
        dropout_keep = None  # everything dropped: output is exactly zero below
    compute = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    group = Hq // Hkv
    segments = (segment_ids, segment_ids) if isinstance(segment_ids, torch.Tensor) else segment_ids
    qc = q.to(compute)
    kc = k.to(compute).repeat_interleave(group, dim=1) if group > 1 else k.to(compute)
    vc = v.to(compute).repeat_interleave(group, dim=1) if group > 1 else v.to(compute)

    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMS // max(1, B * Hq * Nk))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    for r0 in range(0, Nq, chunk_rows):
        rows = torch.arange(r0, min(Nq, r0 + chunk_rows), device=q.device)
        allowed = _token_mask_rows(mask, rows, Nk, causal, Nq, key_lengths, q.device, segments, key_ranges, exact)
        keep = None if dropout_keep is None else dropout_keep[:, :, r0 : r0 + len(rows)]
        bias = None if alibi_slopes is None else _alibi_rows(alibi_slopes, rows, Nk, Nq, compute)
        args = (qc[:, :, r0 : r0 + len(rows)], kc, vc, allowed, scale, keep, dropout_p, softcap, bias)
        if needs_grad and chunk_rows < Nq:
            o, lse = torch.utils.checkpoint.checkpoint(_chunk, *args, use_reentrant=False)
        else:
            o, lse = _chunk(*args)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    if dropout_p >= 1.0:
        out = out * 0.0
    out = out.to(q.dtype)
    if return_lse:
        return out, lse if compute == torch.float64 else lse.float()
    return out


def naive_attention(q, k, v, token_mask: torch.Tensor | None = None, scale: float | None = None):
    """Textbook softmax(QK^T) V over a token-level bool mask (broadcast to [B, Hq, Nq, Nk]), in q's
    dtype, with empty rows set to 0. Only for tests: materialises the whole score matrix."""
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if token_mask is not None:
        s = s.masked_fill(~token_mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return p @ v
