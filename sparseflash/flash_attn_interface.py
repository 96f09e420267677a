"""flash-attn 2's interface on sparseflash: `flash_attn_func`, `flash_attn_varlen_func`, the packed variants.

Same names, argument order, defaults and return values as ``flash_attn.flash_attn_interface``
(flash-attn 2), plus ``mask=`` (a `BlockMask`, or torch's FlexAttention BlockMask), so code
written for flash-attn switches by changing an import. Both are thin: a transposed view of the
``[batch, seq, heads, dim]`` / ``[total, heads, dim]`` tensors goes to `sparseflash.attention`,
which takes any strides (no copy of q, k, v), and the output is transposed back.

Semantics as flash-attn 2 documents them:

- ``causal``: bottom-right aligned, ``j <= i + seqlen_k - seqlen_q``; in the varlen call per
  sequence, also when ``cu_seqlens_q != cu_seqlens_k`` (query ``i`` of a sequence of lengths
  ``(L_q, L_k)`` attends key ``j`` of the same sequence iff ``j <= i + L_k - L_q``). The varlen call
  gives each query the key range of its own sequence (`sparseflash.segments
  .key_ranges_from_cu_seqlens`), exact at token level in the kernels.
- ``window_size=(left, right)``: ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q
  + right`` (a negative side is unbounded; ``causal`` sets ``right = 0``), per sequence in the
  varlen call. Exact, through the same key ranges.
- How the key ranges run: without ``mask=`` on long calls, as a cached exact `BlockMask` of them
  (`BlockMask.from_key_ranges`: bit tiles in its partial blocks, which the kernels run faster than
  the key-range test; `_cached_mask`): a window from `WINDOW_MASK_MIN` tokens, built once per
  shape; a varlen call from `VARLEN_MASK_MIN` packed tokens without ALiBi, built once per
  cu_seqlens tensors and reused while they are the same, unchanged tensors (the layers of a model
  share them, so their values are read and checked on the host once, not per layer). Shorter calls
  (and shapes that change every call, a growing KV cache), and torch.compile, keep the key ranges.
- A query that attends to nothing (``L_q > L_k`` with causal; tokens past ``cu_seqlens_q[-1]``)
  returns 0 with zero gradients; its ``softmax_lse`` is ``+inf`` as flash-attn's.
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: ``softmax_lse`` float32
  ``[batch, nheads, seqlen_q]`` (varlen: ``[nheads, total_q]``), the log-sum-exp of each row of
  the scaled scores (differentiable here; flash-attn does not differentiate it); ``S_dmask`` is
  always ``None``: sparseflash never materialises the attention probabilities (flash-attn returns
  them only with ``dropout_p > 0``, for tests; `sparseflash.dropout.keep_mask` reproduces our
  dropout pattern).
- ``deterministic=True``: this call's backward is bitwise repeatable on every GPU
  (`sparseflash.attention(deterministic=True)`: the portable kernels, which add without atomics;
  on Hopper this replaces the one-pass backward for the call). Its cost, eager fwd+bwd at 16K
  tokens, 16 heads, d 128, causal, bf16 on an H200: 0.92-0.96x the default's time in three runs
  (the latest in `experiments/results/decode/deterministic.csv`, the others in its git history), so
  no slower there; why the one-pass backward is not faster in this [batch, seq, heads, dim] layout,
  as it is on [batch, heads, seq, dim] tensors in BENCHMARKS.md's Hopper table, is not yet measured.
- ``window_size``: any pair of ints: a tuple, a list or a 2-element integer tensor.
- ``mask``: a `BlockMask` for ``(seqlen_q, seqlen_k)`` (varlen: for the packed rows
  ``(total_q, total_k)``), ANDed with everything above. A mask built from a token-level definition
  is applied exactly inside its partial blocks, as in `sparseflash.attention`; ``exact=False``
  computes them whole (block-level).
- ``softcap > 0``: scores ``softcap * tanh(s / softcap)`` (``s`` the scaled score; 0.0: off), in
  the kernels forward and backward.
- ``alibi_slopes`` float32 ``[nheads]`` or ``[batch, nheads]``: ``-slope * |i + seqlen_k - seqlen_q
  - j|`` added to the (soft-capped) score, per sequence in the varlen call; no gradient for the
  slopes. The varlen call runs as one packed call when every sequence shares the diagonal offset
  ``seqlen_k - seqlen_q`` of the packed tensors (``cu_seqlens_q == cu_seqlens_k``, the usual
  self-attention) and the slopes are per head; otherwise (per-sequence slopes, ``cu_seqlens_q !=
  cu_seqlens_k``) it runs one call per sequence (correct, slower; not with ``mask=``, nor inside
  torch.compile).

Packed variants (``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen forms)
are views: ``unbind`` of the packed tensor, no copy, gradients flow back into it. A paged k / v in
the varlen call (``block_table``) is gathered page by page. Decoding against a KV cache,
``flash_attn_with_kvcache``, lives in `sparseflash.kvcache` (re-exported here).

Beyond flash-attn: float32 inputs, any head dim up to 256, ``mask=`` and ``exact=``.

Dropout draws its bits as `sparseflash.attention` does (the same probability law as flash-attn,
not the same bits).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from sparseflash.api import attention
from sparseflash.kvcache import flash_attn_with_kvcache, window_pair
from sparseflash.mask import BlockMask, tracing
from sparseflash.segments import key_ranges_from_cu_seqlens

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _check_tensors(q, k, v, dims: int, layout_q: str, layout_kv: str) -> None:
    for name, t, lay in (("q", q, layout_q), ("k", k, layout_kv), ("v", v, layout_kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {lay}, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {lay}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape {layout_kv}, got {tuple(k.shape)} and {tuple(v.shape)}")


def _window(window_size, causal: bool) -> tuple[int, int] | None:
    """(left, right) as flash-attn applies it (negative: unbounded; causal: right = 0), or None when
    it bounds nothing beyond ``causal``."""
    left, right = (w if w >= 0 else -1 for w in window_pair(window_size))
    if causal:
        right = 0
    if left < 0 and (right < 0 or (right == 0 and causal)):
        return None
    return left, right


def _check_options(softcap, deterministic) -> float | None:
    """Validates softcap and deterministic; returns attention's ``softcap`` (None when 0.0: off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: off), got {softcap!r}")
    if not softcap >= 0.0 or softcap == float("inf"):  # (NaN fails the first test)
        raise ValueError(f"softcap must be a finite float >= 0 (0.0: off), got {softcap!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    return float(softcap) if softcap > 0.0 else None


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _lse_as_flash_attn(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn reports +inf for a row that attends to nothing (ours: -inf)."""
    return torch.where(lse == float("-inf"), float("inf"), lse)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, mask=None, exact=True):
    """flash-attn 2's ``flash_attn_func`` (module docstring: semantics and what differs).

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]``.
        k, v: ``[batch, seqlen_k, nheads_k, headdim]``; ``nheads`` a multiple of ``nheads_k`` (MQA / GQA).
        dropout_p: dropout probability (pass 0.0 at eval).
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window, ``(-1, -1)`` none.
        softcap: tanh soft-capping of the scaled scores, ``softcap * tanh(s / softcap)``; 0.0 off.
        alibi_slopes: float32 ``[nheads]`` or ``[batch, nheads]``: ALiBi (module docstring).
        deterministic: a deterministic backward (see the module docstring on Hopper).
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask`` (None).
        mask: a `BlockMask` (or FlexAttention BlockMask) for ``(seqlen_q, seqlen_k)``.
        exact: apply the mask's token-level definition inside its partial blocks (as
            `sparseflash.attention`; False: block-level).

    Returns:
        ``out`` ``[batch, seqlen_q, nheads, headdim]``, or ``(out, softmax_lse [batch, nheads,
        seqlen_q], None)`` with ``return_attn_probs``.
    """
    _check_tensors(q, k, v, 4, "[batch, seqlen_q, nheads, headdim]", "[batch, seqlen_k, nheads_k, headdim]")
    _check_flag("causal", causal)
    _check_flag("return_attn_probs", return_attn_probs)
    softcap = _check_options(softcap, deterministic)
    window = _window(window_size, causal)
    key_ranges = None
    if window is not None:  # one sequence per batch row: its key ranges, shared by the batch
        nq, nk = q.shape[1], k.shape[1]
        window_mask = _window_mask(nq, nk, window, q.device) if mask is None else None
        if window_mask is not None:
            mask, exact = window_mask, True
        else:
            key_ranges = _window_ranges(nq, nk, window, q.device)
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                    causal=causal and window is None, scale=softmax_scale, dropout_p=dropout_p,
                    key_ranges=key_ranges, return_lse=return_attn_probs, softcap=softcap, alibi_slopes=alibi_slopes,
                    exact=exact, deterministic=deterministic)
    if not return_attn_probs:
        return out.transpose(1, 2).contiguous()
    o, lse = out
    return o.transpose(1, 2).contiguous(), _lse_as_flash_attn(lse), None


# Long calls without mask= run their key ranges as a cached exact mask (module docstring, "How the key
# ranges run"): bit tiles, which the kernels run faster than the key-range test (1.1-1.7x on an H200 at
# 16K: experiments/studies/exact-predicates/, BENCHMARKS.md). Below these lengths the key ranges stay.
WINDOW_MASK_MIN = 1024  # tokens, queries and keys alike
VARLEN_MASK_MIN = 1024  # packed tokens, queries and keys alike
_WINDOW_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()  # (lengths, window, device) -> ((), mask)
_VARLEN_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()  # (cu_seqlens ids and versions, ...) -> (weakrefs, mask)
_WINDOW_MASKS_MAX = 16
_VARLEN_MASKS_MAX = 4


def _cached_mask(cache: OrderedDict, limit: int, key: tuple, build=None, owners: tuple = ()) -> BlockMask | None:
    """The exact mask ``cache`` (an LRU of ``limit`` entries) holds under ``key``; on a miss, the key
    ranges ``build()`` returns, ``(key_ranges, seq_k)``, made into one (`BlockMask.from_key_ranges`,
    its bits and lists built) and cached, or None without ``build`` or inside a trace (a build reads
    the partial-block count back to the host). ``owners``: the tensors ``key`` names by identity,
    held by weak references (a freed tensor's id may be reused)."""
    hit = cache.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], owners)):
        cache.move_to_end(key)
        return hit[1]
    if build is None or tracing():
        return None
    key_ranges, seq_k = build()
    mask = BlockMask.from_key_ranges(key_ranges, seq_k)
    mask.exact_bits(key_ranges.device)
    mask.index(key_ranges.device)
    cache[key] = (tuple(weakref.ref(t) for t in owners), mask)
    while len(cache) > limit:
        cache.popitem(last=False)
    return mask


def _window_ranges(nq: int, nk: int, window: tuple[int, int], device) -> torch.Tensor:
    """flash-attn's window (``causal`` folded in) over one sequence as key ranges ``[1, nq, 2]``."""
    ends = (torch.tensor([0, nq], dtype=torch.int32, device=device),
            torch.tensor([0, nk], dtype=torch.int32, device=device))
    return key_ranges_from_cu_seqlens(*ends, nq, False, window)


def _window_mask(nq: int, nk: int, window: tuple[int, int], device) -> BlockMask | None:
    """The cached exact mask of flash-attn's window over one sequence, per (lengths, window, device);
    None below `WINDOW_MASK_MIN` tokens, and inside a trace for a shape not yet cached."""
    if min(nq, nk) < WINDOW_MASK_MIN:
        return None
    return _cached_mask(_WINDOW_MASKS, _WINDOW_MASKS_MAX, (nq, nk, window, device),
                        lambda: (_window_ranges(nq, nk, window, device), nk))


def _check_cu_seqlens(cu, name: str, total: int, max_seqlen, max_name: str, device, values: bool = True) -> None:
    """Validate a cu_seqlens tensor and its max_seqlen; ``values`` False: only what needs no host read
    of the values (their type, shape, device)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor [batch + 1], got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 (or int64), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D [batch + 1] with at least one sequence, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    if tracing() or not values:
        return
    c = cu.cpu().long()
    lengths = c[1:] - c[:-1]
    if int(c[0]) != 0 or bool((lengths < 0).any()) or int(c[-1]) > total:
        raise ValueError(f"{name} must start at 0, never decrease and end at most at the {total} packed tokens, "
                         f"got {c.tolist() if c.numel() <= 16 else c}")
    if int(lengths.max()) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence of {name} ({int(lengths.max())})")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, mask=None, exact=True):
    """flash-attn 2's ``flash_attn_varlen_func`` (module docstring: semantics and what differs).

    Args:
        q: ``[total_q, nheads, headdim]``, the sequences packed one after another.
        k, v: ``[total_k, nheads_k, headdim]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]``: sequence ``b`` holds query tokens
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key tokens ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.
        max_seqlen_q, max_seqlen_k: the longest sequences (checked against the cu_seqlens).
        block_table: int32 ``[batch, max_blocks_per_seq]``, a paged k / v: then k, v are
            ``[num_blocks, page_block_size, nheads_k, headdim]`` and key ``p`` of sequence ``b`` is row
            ``p % page_block_size`` of page ``block_table[b, p // page_block_size]`` (``cu_seqlens_k`` gives
            the sequences' lengths). The pages are gathered (a copy of the keys in use; gradients flow
            back to k and v).
        Others: as `flash_attn_func`, per sequence; ``mask`` (and ``exact``) for the packed rows
            ``(total_q, total_k)``.

    Returns:
        ``out`` ``[total_q, nheads, headdim]``, or ``(out, softmax_lse [nheads, total_q], None)``.
        Tokens past ``cu_seqlens_q[-1]`` get 0.
    """
    if block_table is not None:
        k, v = _gather_pages(k, v, block_table, cu_seqlens_k, max_seqlen_k)
    _check_tensors(q, k, v, 3, "[total_q, nheads, headdim]", "[total_k, nheads_k, headdim]")
    _check_flag("causal", causal)
    _check_flag("return_attn_probs", return_attn_probs)
    softcap = _check_options(softcap, deterministic)
    window = _window(window_size, causal) or ((-1, 0) if causal else (-1, -1))
    cached = vkey = None  # the exact mask of these very cu_seqlens tensors, checked and built before
    # (not under torch.compile, which cannot key a cache on tensor identity; inside a CUDA-graph capture a
    # cached mask is used, but none is built: a build reads cu_seqlens on the host)
    use_mask = mask is None and alibi_slopes is None and min(q.shape[0], k.shape[0]) >= VARLEN_MASK_MIN \
        and not torch.compiler.is_compiling()
    owners = (cu_seqlens_q, cu_seqlens_k)
    if use_mask:
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q", q.device, False)
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k", q.device, False)
        vkey = (id(cu_seqlens_q), cu_seqlens_q._version, id(cu_seqlens_k), cu_seqlens_k._version, q.shape[0],
                k.shape[0], max_seqlen_q, max_seqlen_k, window, q.device)
        cached = _cached_mask(_VARLEN_MASKS, _VARLEN_MASKS_MAX, vkey, owners=owners)
    if cached is None:
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q", q.device)
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k", q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    if alibi_slopes is not None and not _alibi_packed(alibi_slopes, q, k, cu_seqlens_q, cu_seqlens_k, mask):
        return _varlen_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, return_attn_probs, deterministic)
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = alibi_slopes.reshape(-1)  # one sequence: its slopes are the packed call's
    key_ranges = None
    if cached is None:
        key_ranges = key_ranges_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], False, window)
        if use_mask:
            cached = _cached_mask(_VARLEN_MASKS, _VARLEN_MASKS_MAX, vkey, lambda: (key_ranges, k.shape[0]), owners)
    if cached is not None:
        mask, exact, key_ranges = cached, True, None
    out = attention(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                    mask, scale=softmax_scale, dropout_p=dropout_p, key_ranges=key_ranges,
                    return_lse=return_attn_probs, softcap=softcap, alibi_slopes=alibi_slopes, exact=exact,
                    deterministic=deterministic)
    if not return_attn_probs:
        return out[0].transpose(0, 1).contiguous()
    o, lse = out
    return o[0].transpose(0, 1).contiguous(), _lse_as_flash_attn(lse[0]), None


def _gather_pages(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k):
    """A paged k / v (``[num_blocks, page_block_size, nheads_k, headdim]``, ``block_table [batch,
    max_blocks]``) as packed ``[total_k, nheads_k, headdim]`` tensors, sequence ``b`` holding
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys read page by page (a differentiable gather)."""
    for name, t in (("k", k_cache), ("v", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} with block_table must be a paged cache [num_blocks, page_block_size, nheads_k, "
                             f"headdim], got {got}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k and v must have the same pages [num_blocks, page_block_size, nheads_k], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", 1 << 62, max_seqlen_k, "max_seqlen_k", k_cache.device)
    rows = page_rows(block_table, cu_seqlens_k.long().diff(), k_cache.shape[0], k_cache.shape[1], "block_table")
    return k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]


def page_rows(block_table, lengths: torch.Tensor, num_blocks: int, page: int, name: str) -> torch.Tensor:
    """Rows of the flattened pages ``[num_blocks * page]`` that hold keys ``0 .. lengths[b] - 1`` of
    every sequence ``b`` in turn (one host read of ``lengths``), after checking ``block_table``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 \
            or block_table.dtype not in (torch.int32, torch.int64):
        got = (f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor)
               else type(block_table).__name__)
        raise TypeError(f"{name} must be an int32 tensor [batch, max_blocks_per_seq] of page ids, got {got}")
    if block_table.shape[0] != lengths.numel():
        raise ValueError(f"{name} must have one row per sequence ({lengths.numel()}), got shape "
                         f"{tuple(block_table.shape)}")
    lens = lengths.long().to(block_table.device)
    need = int(lens.max()) if lens.numel() else 0
    if need > block_table.shape[1] * page:
        raise ValueError(f"{name} holds {block_table.shape[1]} pages of {page} tokens per sequence, fewer than the "
                         f"longest sequence's {need} keys")
    b = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    p = torch.arange(b.numel(), device=lens.device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    pages = block_table.long()[b, p // page]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_blocks):
        raise ValueError(f"{name} holds page ids outside [0, {num_blocks}) for keys in use")
    return pages * page + p % page


def _alibi_packed(slopes, q, k, cu_q, cu_k, mask) -> bool:
    """Whether ALiBi in a varlen call can run as one packed call (`sparseflash.attention` measures
    ALiBi's distance from the packed tensors' diagonal ``i + total_k - total_q``): the slopes are
    per head (or there is one sequence) and every sequence ends ``total_k - total_q`` keys after
    its last query (``cu_seqlens_k[b + 1] - cu_seqlens_q[b + 1]`` equal to it for every sequence
    with queries and keys). Otherwise the
    call runs per sequence, which ``mask`` (over the packed rows) and torch.compile rule out."""
    n_seq = cu_q.numel() - 1
    if not isinstance(slopes, torch.Tensor) or slopes.dim() not in (1, 2) \
            or (slopes.dim() == 2 and tuple(slopes.shape) != (n_seq, q.shape[1])):
        got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise ValueError(f"alibi_slopes must be a float32 tensor [nheads] = [{q.shape[1]}] or [batch, nheads] = "
                         f"[{n_seq}, {q.shape[1]}] (batch: the sequences of cu_seqlens_q), got {got}")
    per_head = slopes.dim() == 1 or n_seq == 1
    if tracing():
        same = cu_q is cu_k and q.shape[0] == k.shape[0]
        if not (per_head and same):
            raise NotImplementedError("alibi_slopes in flash_attn_varlen_func under torch.compile needs per-head "
                                      "slopes [nheads] and one cu_seqlens tensor for q and k (with total_q == "
                                      "total_k): other cases run per sequence, which reads cu_seqlens on the host")
        return True
    cq, ck = cu_q.long().cpu(), cu_k.long().cpu()
    both = (cq[1:] > cq[:-1]) & (ck[1:] > ck[:-1])  # sequences with queries and keys (the others give 0)
    packed = per_head and bool(((ck[1:] - cq[1:] == k.shape[0] - q.shape[0]) | ~both).all())
    if not packed and mask is not None:
        raise NotImplementedError("alibi_slopes in flash_attn_varlen_func with per-sequence slopes or cu_seqlens_q != "
                                  "cu_seqlens_k runs one call per sequence, which mask= (over the packed rows) does not "
                                  "support; pass mask=None or call flash_attn_func per sequence")
    return packed


def _varlen_per_sequence(q, k, v, cu_q, cu_k, dropout_p, softmax_scale, causal, window_size, softcap, slopes,
                         return_attn_probs, deterministic=False):
    """flash_attn_varlen_func one sequence at a time through `flash_attn_func` (ALiBi cases the
    packed call cannot express, `_alibi_packed`); sequences with no key and tokens past the last
    sequence get 0 (lse +inf)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    H, D = q.shape[1], v.shape[2]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        a, e, c, f = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == a:
            continue
        if f == c:  # no keys: 0, and lse +inf as flash-attn's
            outs.append(q.new_zeros(e - a, H, D))
            lses.append(torch.full((H, e - a), float("inf"), device=q.device))
            continue
        sl = slopes if slopes.dim() == 1 else slopes[b]
        r = flash_attn_func(q[None, a:e], k[None, c:f], v[None, c:f], dropout_p, softmax_scale, causal, window_size,
                            softcap or 0.0, sl, deterministic, return_attn_probs)
        o, lse = (r[0], r[1]) if return_attn_probs else (r, None)
        outs.append(o[0])
        if return_attn_probs:
            lses.append(lse[0])
    pad = q.shape[0] - cq[-1]
    if pad:
        outs.append(q.new_zeros(pad, H, D))
        lses.append(torch.full((H, pad), float("inf"), device=q.device))
    out = torch.cat(outs) if outs else q.new_zeros(q.shape[0], H, D)
    if not return_attn_probs:
        return out
    lse = torch.cat(lses, dim=1) if lses else torch.full((H, q.shape[0]), float("inf"), device=q.device)
    return out, lse, None


def _unpack(t, name: str, dims: int, n: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``n`` views a packed tensor holds along its dim ``-3`` (no copy; gradients flow back)."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[-3] != n:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be {dims}-D {layout} with {n} at dim -3, got {got}")
    return t.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False, *, mask=None,
                              exact=True):
    """flash-attn 2's ``flash_attn_qkvpacked_func``: ``qkv [batch, seqlen, 3, nheads, headdim]``, then
    as `flash_attn_func` on its three views."""
    q, k, v = _unpack(qkv, "qkv", 5, 3, "[batch, seqlen, 3, nheads, headdim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, mask=mask, exact=exact)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False, *, mask=None, exact=True):
    """flash-attn 2's ``flash_attn_kvpacked_func``: ``kv [batch, seqlen_k, 2, nheads_k, headdim]``, then
    as `flash_attn_func`."""
    k, v = _unpack(kv, "kv", 5, 2, "[batch, seqlen_k, 2, nheads_k, headdim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, mask=mask, exact=exact)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, mask=None, exact=True):
    """flash-attn 2's ``flash_attn_varlen_qkvpacked_func``: ``qkv [total, 3, nheads, headdim]``, one
    ``cu_seqlens`` for queries and keys, then as `flash_attn_varlen_func`."""
    q, k, v = _unpack(qkv, "qkv", 4, 3, "[total, 3, nheads, headdim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  mask=mask, exact=exact)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, mask=None,
                                    exact=True):
    """flash-attn 2's ``flash_attn_varlen_kvpacked_func``: ``kv [total_k, 2, nheads_k, headdim]``, then
    as `flash_attn_varlen_func`."""
    k, v = _unpack(kv, "kv", 4, 2, "[total_k, 2, nheads_k, headdim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, mask=mask, exact=exact)

