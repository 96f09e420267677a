"""flash-attn 2's ``flash_attn_with_kvcache`` on sparseflash: decoding against a KV cache.

Semantics as flash-attn 2 documents them (``flash_attn.flash_attn_with_kvcache``):

- ``k_cache``, ``v_cache`` ``[batch_cache, seqlen_cache, nheads_k, headdim]``, or with ``block_table``
  (int32 ``[batch, max_blocks]``) a paged cache ``[num_blocks, page_block_size, nheads_k, headdim]``:
  key ``p`` of batch row ``b`` is row ``p % page_block_size`` of page ``block_table[b, p //
  page_block_size]`` (any page size here).
- ``cache_seqlens`` (int or int32 ``[batch]``; None: the whole cache) keys are in the cache. New
  ``k``, ``v`` ``[batch, seqlen_new, nheads_k, headdim]`` are written **in place** into the cache at
  positions ``cache_seqlens .. cache_seqlens + seqlen_new - 1`` (after rotary), then attended too:
  batch row ``b`` attends keys ``cache_leftpad[b] <= j < cache_seqlens[b] + seqlen_new``.
- ``cache_batch_idx`` (int32 ``[batch]``): batch row ``b`` uses cache row ``cache_batch_idx[b]``
  (None: row ``b``; the cache may hold more rows than the batch).
- ``cache_leftpad`` (int32 ``[batch]``): keys before it are padding, never attended.
- ``causal`` / ``window_size``: bottom-right aligned to each row's key end: query ``i`` of ``seqlen_q``
  sits at key position ``cache_seqlens[b] + seqlen_new - seqlen_q + i``; ALiBi measures distance
  from the same position.
- ``rotary_cos``, ``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]``: rotary embedding of the new k at
  its positions, and of q at positions ``cache_seqlens + i`` with ``causal`` or a window (else every
  query at position ``cache_seqlens``), on the first ``rotary_dim`` channels, pairs ``(2i, 2i + 1)``
  (``rotary_interleaved``) or ``(i, i + rotary_dim / 2)`` (GPT-NeoX).
- ``num_splits``: 0 picks the number of cache splits from the SM count and the cache length; 1: no
  split. ``return_softmax_lse``: also the float32 ``[batch, nheads, seqlen_q]`` log-sum-exp.

Differences: a row that attends nothing returns 0 and lse ``-inf`` (flash-attn: ``-inf`` when it
splits, ``+inf`` when not). ``rotary_cos`` without new ``k`` / ``v`` is an error (flash-attn ignores
it). The bounds below are checked (flash-attn checks only a paged cache's capacity).

Bounds: ``0 <= cache_seqlens`` and ``cache_seqlens + seqlen_new <= `` the cache's length (a paged
cache's capacity), ``0 <= cache_leftpad <= cache_seqlens + seqlen_new``, ``cache_batch_idx`` within the
cache's rows, the page ids in use within the pages. A tensor's values are checked on the device, with
no host read: one small kernel (`sparseflash.flash.decode.BoundsCheck`; for a read, the split kernel
itself: below) and ``torch._assert_async``, before anything is read or written. A bad value fails the
call loudly, with a message that lists the bounds: at once on a CPU (a RuntimeError); on CUDA a
device-side assert, which ends the process's CUDA context. The debug switch
``SPARSEFLASH_KVCACHE_HOST_CHECKS=1`` (`HOST_CHECKS`) reads them back and raises an error that names the
argument and, for ``cache_seqlens``, its values (`CacheBoundsError`, ValueError): one synchronisation
per call. An int ``cache_seqlens`` is checked on the host (no read
needed). A paged cache's capacity is also read on the host, as flash-attn reads
``max(cache_seqlens)`` for one, with its error (`CacheBoundsError`, a RuntimeError naming
``block_table``), unless ``SPARSEFLASH_CHECK_KEY_LENGTHS=0`` (`sparseflash.api.CHECK_KEY_LENGTHS`).
Host reads are skipped while a CUDA graph is captured (the device check runs instead); where no kernel
runs (a CPU without the interpreter) every bound is checked on the host, which costs no
synchronisation there. A read (no new keys, no pages) has its bounds checked by the split kernel itself,
which clamps its reads until the assert after it fails the call: one launch less (the switch
``check_in_split``, on by default; ``decode.OVERRIDES["check_in_split"] = False`` launches the check
before, as an append or a paged cache always does).

Host cost: the checks of shapes, dtypes and flags, and the split count, workspace and bound launches
(`sparseflash.flash.decode.DecodePlan`), are made once per call key (`CallPlan`: the arguments' kinds,
shapes, strides, dtypes, devices and flags), so a repeated decode step pays a key lookup, the bounds
check, its output and its launches. A call with ``mask=`` plans anew each time (its decode plan is
shared).

Beyond flash-attn: ``mask=``, block-sparse decoding: a `BlockMask` (or FlexAttention BlockMask made
block-level) for ``(seqlen_q, seqlen_cache)`` with a single query block, whose layout ``[batch or 1,
nheads_k or 1 (or nheads, equal within each GQA group), 1, cache_blocks]`` lists the cache blocks
each row attends (a top-k selection: ``BlockMask.from_layout(torch.zeros(batch, nheads_k, 1, nblocks,
dtype=torch.bool).scatter_(-1, topk[:, :, None], True), block_size=(128, block), seq_q=seqlen_q,
seq_k=seqlen_cache)``). Unlisted blocks are never read; listed ones are attended whole, within the
bounds above. The cache block must be a multiple of 16. A mask with a token-level definition
(``mask_mod``) is refused: pass ``mask.block_level()``.

Compute: the Triton split-KV kernel (`sparseflash.flash.decode`) on CUDA and under the Triton
interpreter, which also append the new keys (one launch); elsewhere (and for float64) the
plain-PyTorch `decode_reference`, which is also the tests' reference.
"""

from __future__ import annotations

import math
import numbers

import torch

from sparseflash import _env, api
from sparseflash.flash import decode
from sparseflash.mask import BlockMask, tracing

__all__ = ["flash_attn_with_kvcache", "decode_reference", "apply_rotary", "window_pair", "CacheBoundsError",
           "HOST_CHECKS"]

MAX_ROWS = 64  # query rows (tokens x GQA group) per kernel launch; longer query blocks run in chunks

# The debug switch: check cache_seqlens (and leftpad, batch index, page ids) on the host, one read and
# a synchronisation per call, for errors that name the argument and its values; off, they are checked
# on the device (module docstring).
HOST_CHECKS = _env.flag("SPARSEFLASH_KVCACHE_HOST_CHECKS", False)


def window_pair(window_size) -> tuple[int, int]:
    """window_size as two Python ints: a tuple or list of two ints, or a 2-element integer tensor
    (as flash-attn's tests pass it); anything else is a TypeError naming what was expected."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.dtype.is_floating_point or window_size.dtype.is_complex \
                or window_size.dtype == torch.bool:
            raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; a tensor must "
                            f"hold 2 integers, got dtype {window_size.dtype} shape {tuple(window_size.shape)}")
        return tuple(int(w) for w in window_size.reshape(-1).tolist())
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _int_vector(x, name: str, batch: int, device) -> torch.Tensor | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or x.shape != (batch,):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an int32 tensor [batch] = [{batch}], got {got}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
    return x.to(torch.int32)


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x [batch, seq, heads, d]`` at positions ``pos [batch, seq]`` on its first
    ``2 * cos.shape[1]`` channels (computed in float32 at least, returned in x's dtype)."""
    r = 2 * cos.shape[1]
    ct = torch.promote_types(x.dtype, torch.float32)
    c = cos[pos].to(ct)[:, :, None, :]  # [batch, seq, 1, r / 2]
    s = sin[pos].to(ct)[:, :, None, :]
    xr = x[..., :r].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


_ASSERT_MAX = 254  # characters of a message torch._assert_async takes on CUDA


def _assert_message(what: str, hint: str) -> str:
    """``what`` then ``hint``, cut (what first) to fit a device-side assert's message."""
    room = _ASSERT_MAX - len(hint)
    return (what if len(what) <= room else what[: room - 3] + "...") + hint


class CacheBoundsError(ValueError, RuntimeError):
    """cache_seqlens (+ the new keys) past the cache or the block table: a ValueError, as every bad
    argument here, and the RuntimeError flash-attn raises for it."""


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, mask=None):
    """flash-attn 2's ``flash_attn_with_kvcache`` (module docstring: semantics and differences).

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]``.
        k_cache, v_cache: ``[batch_cache, seqlen_cache, nheads_k, headdim]``, or paged
            ``[num_blocks, page_block_size, nheads_k, headdim]`` with ``block_table``; updated in place
            when ``k``, ``v`` are given.
        k, v: new keys / values ``[batch, seqlen_new, nheads_k, headdim]``, appended at ``cache_seqlens``.
        rotary_cos, rotary_sin: ``[seqlen_ro, rotary_dim / 2]``, ``seqlen_ro >= seqlen_cache``.
        cache_seqlens: int or int32 ``[batch]``: keys already in the cache (None: all of it).
        cache_batch_idx: int32 ``[batch]``: the cache row of each batch row (not with block_table).
        cache_leftpad: int32 ``[batch]``: where each row's keys start (not with block_table).
        block_table: int32 ``[batch, max_blocks_per_seq]``: pages of a paged cache.
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal, window_size, softcap, alibi_slopes: as `sparseflash.flash_attn_func`, bottom-right to
            each row's key end.
        rotary_interleaved: rotate channel pairs ``(2i, 2i + 1)`` (True) or ``(i, i + rotary_dim / 2)``.
        num_splits: cache splits per (batch, kv head); 0: chosen from the SMs and the cache length.
        return_softmax_lse: also return the float32 lse ``[batch, nheads, seqlen_q]``.
        mask: block-sparse decoding (module docstring).

    Returns:
        ``out [batch, seqlen_q, nheads, headdim]``, or ``(out, softmax_lse)``.
    """
    key = _call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_softmax_lse, mask)
    call = PLANS.get(key) if key is not None else None
    if call is None:
        call = CallPlan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                        alibi_slopes, num_splits, return_softmax_lse, mask)
        if key is not None:
            if len(PLANS) >= _PLANS_MAX:
                PLANS.clear()  # a decoder calls with a few shapes; this bounds a sweep over many
            PLANS[key] = call
    return call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes)


# Calls by key: a call whose arguments have the same kinds, shapes, strides, dtypes, devices and flags
# as an earlier one passed the same checks; it reuses that call's `CallPlan`. Calls with a mask (a
# new selection each step, its lists built per mask) or a tensor window_size plan anew each time
# (their decode plans are still shared through `decode.plan`).
PLANS: dict = {}
_PLANS_MAX = 256


def _spec(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
              return_softmax_lse, mask):
    """What a `CallPlan` depends on, or None where the call is planned anew (a mask; an argument of
    an unexpected kind, which the checks then name)."""
    if mask is not None or type(window_size) is not tuple or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int or type(causal) is not bool or type(num_splits) is not int \
            or type(rotary_interleaved) is not bool or type(return_softmax_lse) is not bool:
        return None
    try:
        return (_spec(q), _spec(k_cache), _spec(v_cache), _spec(k), _spec(v), _spec(rotary_cos), _spec(rotary_sin),
                int if type(cache_seqlens) is int else _spec(cache_seqlens), _spec(cache_batch_idx), _spec(cache_leftpad),
                _spec(block_table), _spec(alibi_slopes), type(softmax_scale), softmax_scale, type(softcap), softcap,
                causal, left, right, rotary_interleaved, num_splits, return_softmax_lse, HOST_CHECKS,
                api.CHECK_KEY_LENGTHS, MAX_ROWS, _env.interpreting(),
                tuple(sorted(decode.OVERRIDES.items())) if decode.OVERRIDES else ())
    except (AttributeError, TypeError):
        return None


def _int32(t, needs: bool):
    """``t`` as the contiguous int32 vector the kernels read (``needs``: it is not one already)."""
    return t.to(torch.int32).contiguous() if needs and t is not None else t


class CallPlan:
    """One call's checks of shapes, dtypes and flags, made once per `_call_key` (each raises the error
    that names the argument), and what the call derives from them: sizes, the window, how the bounds
    of ``cache_seqlens`` (and leftpad, batch index, page ids) are checked (`check_on_host`, or
    `decode.BoundsCheck` on the device), the append (`decode.Append`) and the kernel's
    `decode.DecodePlan`. Calling it runs one call with those arguments' values."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                 num_splits, return_softmax_lse, mask):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 4-D tensor ({'[batch, seqlen_q, nheads, headdim]' if name == 'q' else '[batch_cache, seqlen_cache, nheads_k, headdim] or pages [num_blocks, page_block_size, nheads_k, headdim]'}), got {got}")
        B, SQ, H, D = q.shape
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        Hk = k_cache.shape[2]
        if k_cache.shape[3] != D:
            raise ValueError(f"k_cache's head dim {k_cache.shape[3]} must equal q's {D}")
        if Hk == 0 or H % Hk:
            raise ValueError(f"q's nheads ({H}) must be a multiple of the cache's nheads_k ({Hk})")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"q must be float16, bfloat16 or float32 (float64: reference only), got {q.dtype}")
        for name, val in (("causal", causal), ("rotary_interleaved", rotary_interleaved),
                          ("return_softmax_lse", return_softmax_lse)):
            if not isinstance(val, bool):
                raise TypeError(f"{name} must be a bool, got {val!r}")
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < float("inf"):
            raise ValueError(f"softcap must be a finite float >= 0 (0.0: off), got {softcap!r}")
        dev = q.device
        paged = block_table is not None
        if paged:
            if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B \
                    or block_table.dtype not in (torch.int32, torch.int64):
                got = f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor) else \
                    type(block_table).__name__
                raise TypeError(f"block_table must be an int32 tensor [batch, max_blocks_per_seq] = [{B}, ...], got {got}")
            if block_table.device != dev:
                raise ValueError(f"block_table must be on q's device {dev}, got {block_table.device}")
            if cache_batch_idx is not None or cache_leftpad is not None:
                raise ValueError("cache_batch_idx and cache_leftpad are not supported with block_table (as flash-attn)")
            cap = block_table.shape[1] * k_cache.shape[1]
        else:
            cap = k_cache.shape[1]
        _int_vector(cache_batch_idx, "cache_batch_idx", B, dev)
        _int_vector(cache_leftpad, "cache_leftpad", B, dev)
        if cache_batch_idx is None and not paged and k_cache.shape[0] < B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {B}: pass cache_batch_idx")
        if cache_seqlens is None:
            lens = None
        elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
            lens = "int"
        else:
            _int_vector(cache_seqlens, "cache_seqlens", B, dev)
            lens = "tensor"
        if (k is None) != (v is None):
            raise ValueError("k and v must be given together (new keys and values to append) or both None")
        SN = 0
        if k is not None:
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[2:] != (Hk, D):
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{name} must be [batch, seqlen_new, nheads_k, headdim] = [{B}, ., {Hk}, {D}], got {got}")
                if t.dtype != q.dtype or t.device != dev:
                    raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {dev}), got {t.dtype}, {t.device}")
            if k.shape != v.shape:
                raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
            SN = k.shape[1]
        self.B, self.SQ, self.H, self.Hk, self.D, self.SN, self.cap, self.paged = B, SQ, H, Hk, D, SN, cap, paged
        self.device, self.lens, self.return_lse = dev, lens, return_softmax_lse
        self.what = (f"block_table's capacity: {block_table.shape[1]} pages of {k_cache.shape[1]} tokens" if paged
                     else "the cache's length")
        if lens is None and SN:  # the whole cache, and new keys after it
            raise self.bounds_error(torch.full((B,), cap))
        left, right = (w if w >= 0 else -1 for w in window_pair(window_size))
        if causal:
            right = 0
        self.local = causal or left >= 0 or right >= 0
        self.rotary = rotary_cos is not None or rotary_sin is not None
        if self.rotary:
            if k is None:
                raise ValueError("rotary_cos / rotary_sin rotate the new k and q: pass k and v too")
            if not (isinstance(rotary_cos, torch.Tensor) and isinstance(rotary_sin, torch.Tensor)
                    and rotary_cos.dim() == 2 and rotary_cos.shape == rotary_sin.shape):
                raise ValueError("rotary_cos and rotary_sin must both be tensors [seqlen_ro, rotary_dim / 2] of one shape")
            if 2 * rotary_cos.shape[1] > D or rotary_cos.shape[0] < cap:
                raise ValueError(f"rotary_cos must be [seqlen_ro >= {cap}, rotary_dim / 2 <= {D // 2}], got "
                                 f"{tuple(rotary_cos.shape)}")
        self.rotary_interleaved = rotary_interleaved
        if alibi_slopes is not None:
            if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape not in ((H,), (B, H)) \
                    or alibi_slopes.dtype != torch.float32:
                got = f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}" if isinstance(alibi_slopes, torch.Tensor) else \
                    type(alibi_slopes).__name__
                raise ValueError(f"alibi_slopes must be a float32 tensor [nheads] = [{H}] or [batch, nheads] = [{B}, {H}], "
                                 f"got {got}")
        self.alibi_move = alibi_slopes is not None and (alibi_slopes.device != dev or alibi_slopes.stride(-1) != 1)
        alibi = alibi_slopes.to(dev).contiguous() if self.alibi_move else alibi_slopes  # (as the kernel sees it)
        self.blocks = cache_blocks(mask, B, H, Hk, SQ, cap, dev)
        # which vectors need a cast to contiguous int32 (the key fixes their dtypes and strides)
        self.cast = tuple(t is not None and (t.dtype != torch.int32 or not t.is_contiguous()) for t in
                          (cache_seqlens if lens == "tensor" else None, cache_batch_idx, cache_leftpad, block_table))
        table = _int32(block_table, self.cast[3])  # (the layout the kernels see)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
        self.window, self.softcap = (left, right), float(softcap) if softcap > 0 else None
        # the bounds: the exact check on the host (HOST_CHECKS, or where no kernel runs: no synchronisation
        # there), else on the device, with a paged cache's capacity read on the host as flash-attn reads it
        interp = _env.interpreting()
        kernels_run = dev.type == "cuda" or interp
        self.host = "all" if HOST_CHECKS or not kernels_run else \
            "capacity" if paged and lens == "tensor" and api.CHECK_KEY_LENGTHS else None
        self.device_check = None
        self.kernel = kernels_run and q.dtype != torch.float64 and D <= 256
        # The switch "check_in_split" (on unless `decode.OVERRIDES` sets it False): a read without new keys
        # or pages, whose bounds need only what the split kernel loads, is checked there (no bounds launch);
        # an append writes at cache_seqlens before the split kernel runs, and page ids are read only by the
        # check, so those keep the check before.
        self.check_in_split = False
        if kernels_run and (lens == "tensor" or cache_leftpad is not None or cache_batch_idx is not None or paged):
            self.check_in_split = self.kernel and not paged and not SN and decode.switch("check_in_split")
            if not self.check_in_split:
                self.device_check = decode.bounds_check(
                    dev, B, seqlens=lens is not None, leftpad=cache_leftpad is not None,
                    batch_idx=cache_batch_idx is not None, block_table=table, seq_add=SN if lens else cap,
                    max_len=cap, n_rows=k_cache.shape[0], n_pages=k_cache.shape[0], page=k_cache.shape[1])
            # (CUDA's device-side assert takes messages of under 255 characters: the bounds, briefly)
            self.message = _assert_message(
                f"flash_attn_with_kvcache: out of bounds: cache_seqlens + seqlen_new ({SN}) in [0, {cap}]"
                + (f" ({self.what})" if paged else "")
                + (", cache_leftpad in [0, cache_seqlens + seqlen_new]" if cache_leftpad is not None else "")
                + (f", cache_batch_idx in [0, {k_cache.shape[0]})" if cache_batch_idx is not None else "")
                + (f", page ids in [0, {k_cache.shape[0]})" if paged else ""),
                "; SPARSEFLASH_KVCACHE_HOST_CHECKS=1 names the value")
        # the new keys and values: one launch writes them where the kernels run
        self.append = None
        if SN and kernels_run:
            k_seen = torch.empty(k.shape, dtype=k.dtype, device=dev) if self.rotary else k  # (rotated: a new k)
            self.append = decode.append(k_seen, v, k_cache, v_cache, batch_idx=cache_batch_idx is not None,
                                        block_table=table)
        self.plan = None
        if self.kernel:
            self.plan = decode.plan(
                q, k_cache, v_cache, scale=self.scale, window=self.window, softcap=self.softcap, alibi=alibi,
                batch_idx=cache_batch_idx is not None, block_table=table, blocks=self.blocks,
                seqlens=lens is not None, leftpad=cache_leftpad is not None, seq_add=SN if lens else cap,
                num_splits=int(num_splits), max_len=cap, rows=MAX_ROWS, store_lse=return_softmax_lse,
                check=self.check_in_split)

    def bounds_error(self, s_host: torch.Tensor) -> CacheBoundsError:
        return CacheBoundsError(f"cache_seqlens + seqlen_new ({self.SN}) must lie in [0, {self.cap}] ({self.what}), got "
                                f"{s_host.tolist() if self.B <= 16 else s_host}")

    def check_on_host(self, seqlens, leftpad, batch_idx, block_table, n_cache: int, page: int, capacity_only: bool):
        """The bounds read back and checked on the host (a synchronisation on a GPU): today's errors."""
        B, SN, cap = self.B, self.SN, self.cap
        s_host = seqlens.cpu().long() if seqlens is not None else torch.full((B,), cap)
        if bool((s_host < 0).any()) or int(s_host.max()) + SN > cap:
            raise self.bounds_error(s_host)
        if capacity_only:
            return
        if leftpad is not None:
            lp = leftpad.cpu().long()
            if bool((lp < 0).any()) or bool((lp > s_host + SN).any()):
                raise ValueError("cache_leftpad must lie in [0, cache_seqlens + seqlen_new] for every row")
        if batch_idx is not None and (int(batch_idx.min()) < 0 or int(batch_idx.max()) >= n_cache):
            raise ValueError(f"cache_batch_idx must index the cache's {n_cache} rows")
        if block_table is not None:
            need = (s_host + SN + page - 1) // page
            bt = block_table.cpu().long()
            used = torch.arange(bt.shape[1])[None, :] < need[:, None]
            if bool(((bt < 0) | (bt >= n_cache))[used].any()):
                raise ValueError(f"block_table holds page ids outside [0, {n_cache}) for keys in use")

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, alibi_slopes):
        dev, B, SN = self.device, self.B, self.SN
        c_lens, c_idx, c_pad, c_table = self.cast
        seqlens = None
        if self.lens == "tensor":
            seqlens = _int32(cache_seqlens, c_lens)
        elif self.lens == "int":  # known on the host: checked there, no read
            s = int(cache_seqlens)
            if s < 0 or s + SN > self.cap:
                raise self.bounds_error(torch.full((B,), s))
            seqlens = torch.full((B,), s, dtype=torch.int32, device=dev)
        batch_idx, leftpad = _int32(cache_batch_idx, c_idx), _int32(cache_leftpad, c_pad)
        block_table = _int32(block_table, c_table)
        verify = True  # (the device's verdict is asserted unless the host checked every bound)
        if self.host is not None and not _capturing(dev):
            self.check_on_host(seqlens, leftpad, batch_idx, block_table, k_cache.shape[0], k_cache.shape[1],
                               capacity_only=self.host == "capacity")
            verify = self.host != "all"
        check = self.device_check if verify else None
        route = self.plan.route() if self.kernel else None  # (shared by this call's launches)
        if check is not None:  # before anything reads or writes at those positions
            torch._assert_async(check(seqlens, leftpad, batch_idx, block_table, route), self.message)
        if self.rotary:
            pos_k = seqlens.long()[:, None] + torch.arange(SN, device=dev)
            k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, self.rotary_interleaved)
            pos_q = seqlens.long()[:, None] + (torch.arange(self.SQ, device=dev) if self.local else
                                               torch.zeros(self.SQ, dtype=torch.long, device=dev))
            q = apply_rotary(q, rotary_cos, rotary_sin, pos_q, self.rotary_interleaved)
        if self.append is not None:
            self.append(k, v, k_cache, v_cache, seqlens, batch_idx, block_table, route)
        elif SN:
            pos = seqlens.long()[:, None] + torch.arange(SN, device=dev)  # [B, SN]
            if self.paged:
                page = block_table.long().gather(1, pos // k_cache.shape[1])
                k_cache[page, pos % k_cache.shape[1]] = k
                v_cache[page, pos % k_cache.shape[1]] = v
            else:
                rows = (batch_idx.long() if batch_idx is not None else torch.arange(B, device=dev))[:, None].expand(B, SN)
                k_cache[rows, pos] = k
                v_cache[rows, pos] = v
        alibi = alibi_slopes
        if self.alibi_move:
            alibi = alibi.to(dev).contiguous()
        if self.kernel:
            out, lse, ok = self.plan(q, k_cache, v_cache, seqlens, leftpad, batch_idx, block_table, alibi, self.blocks,
                                     route)
            if ok is not None and verify:  # (check_in_split: the split kernel's verdict, same message)
                torch._assert_async(ok, self.message)
        else:
            seq_end = (seqlens + SN).to(torch.int32) if seqlens is not None else \
                torch.full((B,), self.cap, dtype=torch.int32, device=dev)
            seq_start = leftpad if leftpad is not None else torch.zeros(B, dtype=torch.int32, device=dev)
            out, lse = decode_reference(q, k_cache, v_cache, seq_start, seq_end, scale=self.scale, window=self.window,
                                        softcap=self.softcap, alibi=None if alibi is None else alibi.expand(B, self.H),
                                        batch_idx=batch_idx, block_table=block_table, blocks=self.blocks)
        return (out, lse) if self.return_lse else out


def cache_blocks(mask, B: int, H: int, Hk: int, SQ: int, cap: int, device):
    """``mask=`` of `flash_attn_with_kvcache` as the kernel's block lists: ``(indices [B, Hk, nblocks]
    int32, ascending, counts [B, Hk] int32, block)``; None without a mask."""
    if mask is None:
        return None
    if not isinstance(mask, BlockMask):
        if type(mask).__name__ == "BlockMask" and hasattr(mask, "kv_num_blocks"):
            mask = BlockMask.from_flex(mask)
        else:
            raise TypeError(f"mask must be a sparseflash BlockMask (or FlexAttention BlockMask) over the cache, got "
                            f"{type(mask).__name__}")
    if mask.mask_mod is not None:
        raise ValueError("mask: decoding applies a mask at block level (whole cache blocks); this mask has a "
                         "token-level definition (mask_mod): pass mask.block_level()")
    lay = mask.layout
    while lay.dim() < 4:
        lay = lay.unsqueeze(0)
    bk = mask.block_size[1]
    if bk % 16:
        raise ValueError(f"mask: the cache block size must be a multiple of 16 for the decode kernel, got {bk}")
    nkb = math.ceil(cap / bk)
    if lay.shape[-2] != 1 or mask.seq_k != cap:
        raise ValueError(f"mask must be built for (seqlen_q={SQ}, seqlen_cache={cap}) with one query block (block_q >= "
                         f"seqlen_q), got seq_q={mask.seq_q}, seq_k={mask.seq_k}, layout {tuple(mask.layout.shape)}")
    if lay.shape[0] not in (1, B) or lay.shape[1] not in (1, Hk, H):
        raise ValueError(f"mask's layout must be [1 or batch={B}, 1 or nheads_k={Hk} (or nheads={H}), 1, {nkb}], got "
                         f"{tuple(mask.layout.shape)}")
    key = (B, H, Hk, device)
    lists = mask.decode_lists.get(key)
    if lists is not None:
        return lists
    lay = lay[:, :, 0].to(device)
    if lay.shape[1] == H and H != Hk:
        grouped = lay.view(lay.shape[0], Hk, H // Hk, nkb)
        if not bool((grouped == grouped[:, :, :1]).all()):
            raise ValueError("mask: the query heads of a GQA group share their kv head's cache blocks in decoding; "
                             "this mask differs within a group (give it per kv head: [batch, nheads_k, 1, blocks])")
        lay = grouped[:, :, 0]
    lay = lay.expand(B, Hk, nkb)
    # Compaction by a running count instead of a sort: the j-th listed block goes to slot j, unlisted
    # ones to a spare last column that is cut off. Four elementwise launches and no segmented sort,
    # whose several launches were most of a short selection's decode time.
    slot = lay.cumsum(-1, dtype=torch.int32)  # [B, Hk, nkb]: listed blocks up to and including this one
    counts = slot[..., -1].contiguous()
    ar = torch.arange(nkb, device=device, dtype=torch.int32).expand(B, Hk, nkb)
    indices = torch.full((B, Hk, nkb + 1), nkb, device=device, dtype=torch.int32)
    indices.scatter_(-1, torch.where(lay, slot - 1, nkb).long(), ar)
    lists = indices[..., :nkb].contiguous(), counts, bk
    if not tracing():  # a mask reused over decoding steps builds its lists once (as Flex's block mask is)
        mask.decode_lists[key] = lists
    return lists


def decode_reference(q, k_cache, v_cache, seq_start, seq_end, *, scale: float, window: tuple[int, int],
                     softcap: float | None = None, alibi: torch.Tensor | None = None,
                     batch_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     blocks=None, compute_dtype: torch.dtype | None = None):
    """Plain PyTorch, the decode kernel's exact semantics (`sparseflash.flash.decode.decode_attention`'s
    arguments): scores in float32 (float64 for float64 inputs; ``compute_dtype`` overrides, e.g. the
    input dtype, for a test's PyTorch-in-the-same-dtype error); ``(out in q's dtype, lse float32)``,
    0 and ``-inf`` for rows that attend nothing."""
    B, SQ, H, D = q.shape
    Hk = k_cache.shape[2]
    G = H // Hk
    ct = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    if block_table is not None:
        pages = block_table.long().clamp(0, k_cache.shape[0] - 1)
        k_all = k_cache[pages].flatten(1, 2)  # [B, max_blocks * page, Hk, D]
        v_all = v_cache[pages].flatten(1, 2)
    else:
        rows = batch_idx.long() if batch_idx is not None else torch.arange(B, device=q.device)
        k_all, v_all = k_cache[rows], v_cache[rows]
    N = k_all.shape[1]
    kf = k_all.to(ct).repeat_interleave(G, dim=2)  # [B, N, H, D]
    vf = v_all.to(ct).repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), kf) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(N, device=q.device)
    qpos = seq_end.long()[:, None] - SQ + torch.arange(SQ, device=q.device)  # [B, SQ]
    rel = qpos[:, None, :, None] - j  # [B, 1, SQ, N]
    if alibi is not None:
        s = s - alibi.to(ct)[:, :, None, None] * rel.abs().to(ct)
    ok = (j >= seq_start.long()[:, None, None, None]) & (j < seq_end.long()[:, None, None, None])
    left, right = window
    if right >= 0:
        ok = ok & (rel >= -right)
    if left >= 0:
        ok = ok & (rel <= left)
    if blocks is not None:
        idx, cnt, bk = blocks
        nkb = math.ceil(N / bk)
        sel = torch.zeros(B, Hk, nkb + 1, dtype=torch.bool, device=q.device)
        live = torch.arange(idx.shape[-1], device=q.device) < cnt[..., None].long()
        sel.scatter_(-1, torch.where(live, idx.long(), nkb), True)
        sel = sel[..., :nkb].repeat_interleave(G, dim=1)  # [B, H, nkb]
        ok = ok & sel[:, :, None, j // bk]
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s.float() if ct != torch.float64 else s, dim=-1)  # [B, H, SQ], -inf for empty rows
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None].to(ct))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out.to(q.dtype), lse.float()
