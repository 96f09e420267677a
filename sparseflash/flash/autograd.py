"""Autograd and torch.library wrappers around the launchers, and `flash_attention`: the layer
between `sparseflash.attention` (api.py, which calls `flash_attention` after validation) and the
launchers `launch.fwd` / `launch.bwd` (launch.py), which the ops' implementations call.

Two custom ops, ``sparseflash::flash_fwd`` and ``sparseflash::flash_bwd``, carry the kernels
(with fake implementations, so ``torch.compile`` traces models that call them without a graph
break); `FlashAttentionFunction` (a ``torch.autograd.Function``) ties them together. The mask
enters as its compressed index tensors, so the ops see only tensors and scalars.

Dropout bits are keyed by (seed_lo, seed_hi, offset), an int64 [3] tensor on the inputs' device
that the forward op draws from torch's generator when none is passed (`sparseflash.dropout.draw_rng`)
and returns for backward; the kernels read it from memory, so CUDA graphs replay fresh draws.
Without dropout an eager call makes none (`flash_fwd_eager`); the op returns a placeholder.

Exact masks: a mask's partial-block bits and the tables aligning them with the block lists
(`exact_tables`) ride along both ops as three more optional tensors (`operands.ExactTiles`).

Score modifications: ``softcap`` (a float, 0 off) and ``slopes`` (ALiBi, float32 [1 or B, Hq] or
None; no gradient) ride along both ops; the launchers take them as their ``slopes`` and ``softcap``.
Segment ids (``seg_q``, ``seg_k``) and the key-range table (``ranges``) are separate arguments of
both ops, as of the launchers (`_tables`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparseflash import dropout
from sparseflash.flash import launch, operands, tiles
from sparseflash.mask import BlockMask, sorted_nonzero
from sparseflash.segments import key_range_block_layout, segment_block_layout
from sparseflash import _env

__all__ = ["flash_attention", "FlashAttentionFunction"]


def _rng_draw(rng: Optional[Tensor], device) -> Tensor:
    """A fresh dropout draw (or a copy of the one passed), int64 [3] on ``device``."""
    if rng is None:
        return dropout.draw_rng(device)
    return rng.clone()  # an op's output may not alias its input


def estimate_work(q: Tensor, k: Tensor, density: float) -> float:
    """A call's estimated forward FLOPs, 4 B Hq Nq Nk D x the mask's density (causal, key_lengths
    and segment ids not counted: an upper bound); -1 when the density is unknown. Computed in the
    ops' implementations, where shapes are concrete even under torch.compile."""
    if density < 0:
        return -1.0
    B, Hq, Nq, D = q.shape
    return 4.0 * B * Hq * Nq * k.shape[2] * D * density


def flash_fwd_eager(q: Tensor, k: Tensor, v: Tensor, kv_idx: Optional[Tensor],
               key_lengths: Optional[Tensor], rng: Optional[Tensor], seg_q: Optional[Tensor], seg_k: Optional[Tensor],
               scale: float, causal: bool, mask_bq: int, mask_bk: int, dropout_p: float,
               density: float, slopes: Optional[Tensor], softcap: float, bits: Optional[Tensor] = None,
               kv_tile: Optional[Tensor] = None, q_tile: Optional[Tensor] = None, ranges: Optional[Tensor] = None
               ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The forward outside torch.compile: without dropout no rng tensor (None: nothing reads it),
    so an eager call allocates only its outputs."""
    rng = _rng_draw(rng, q.device) if dropout_p > 0.0 else None
    o, lse = launch.fwd(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq or None, mask_bk or None, dropout_p, rng,
                        work=estimate_work(q, k, density), **_tables(seg_q, seg_k, ranges, slopes), softcap=softcap,
                        exact=_exact(bits, kv_tile, q_tile))
    return o, lse, rng


def flash_fwd_impl(q: Tensor, k: Tensor, v: Tensor, kv_idx: Optional[Tensor],
               key_lengths: Optional[Tensor], rng: Optional[Tensor], seg_q: Optional[Tensor], seg_k: Optional[Tensor],
               scale: float, causal: bool, mask_bq: int, mask_bk: int, dropout_p: float,
               density: float, slopes: Optional[Tensor], softcap: float, bits: Optional[Tensor] = None,
               kv_tile: Optional[Tensor] = None, q_tile: Optional[Tensor] = None,
               ranges: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    o, lse, rng = flash_fwd_eager(q, k, v, kv_idx, key_lengths, rng, seg_q, seg_k, scale, causal, mask_bq, mask_bk,
                             dropout_p, density, slopes, softcap, bits, kv_tile, q_tile, ranges)
    if rng is None:  # an op returns tensors: a placeholder, never read
        rng = torch.empty(3, dtype=torch.int64, device=q.device)
    return o, lse, rng


_flash_fwd = torch.library.custom_op("sparseflash::flash_fwd", flash_fwd_impl, mutates_args=())


@_flash_fwd.register_fake
def _(q, k, v, kv_idx, key_lengths, rng, seg_q, seg_k, scale, causal, mask_bq, mask_bk, dropout_p, density, slopes,
      softcap, bits=None, kv_tile=None, q_tile=None, ranges=None):
    B, Hq, Nq, _ = q.shape
    return (torch.empty_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            torch.empty(3, dtype=torch.int64, device=q.device))


def flash_bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor],
               kv_idx: Optional[Tensor], q_idx: Optional[Tensor],
               key_lengths: Optional[Tensor], rng: Optional[Tensor], seg_q: Optional[Tensor], seg_k: Optional[Tensor],
               scale: float, causal: bool, mask_bq: int, mask_bk: int,
               dropout_p: float, density: float, slopes: Optional[Tensor], softcap: float,
               bits: Optional[Tensor] = None, kv_tile: Optional[Tensor] = None,
               q_tile: Optional[Tensor] = None, deterministic: bool = False,
               ranges: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return launch.bwd(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths, scale, causal,
                      mask_bq or None, mask_bk or None, dropout_p, rng, work=estimate_work(q, k, density),
                      **_tables(seg_q, seg_k, ranges, slopes), softcap=softcap, exact=_exact(bits, kv_tile, q_tile),
                      deterministic=deterministic)


_flash_bwd = torch.library.custom_op("sparseflash::flash_bwd", flash_bwd_impl, mutates_args=())


@_flash_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths, rng, seg_q, seg_k, scale, causal, mask_bq, mask_bk,
      dropout_p, density, slopes, softcap, bits=None, kv_tile=None, q_tile=None, deterministic=False, ranges=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op(custom, impl):
    """The registered op while torch.compile traces; in eager mode its implementation directly,
    which skips the dispatcher's per-call cost (tens of microseconds, as much as a small kernel)."""
    return custom if torch.compiler.is_compiling() else impl


class FlashAttentionFunction(torch.autograd.Function):
    """The one autograd Function of `sparseflash.attention`, for both ways a call reaches the kernels:

    - general: ``o, lse = FlashAttentionFunction.apply(None, q, k, v, key_lengths, kv_idx, q_idx, rng, seg_q,
      seg_k, scale, causal, mask_bq, mask_bk, dropout_p, density[, slopes, softcap, bits, kv_tile, q_tile,
      deterministic, ranges])``: forward and backward through the ops ``sparseflash::flash_fwd`` /
      ``flash_bwd`` (their implementations `flash_fwd_eager` / `flash_bwd_impl` directly in eager mode) ->
      `launch.fwd` / `launch.bwd`. lse holds +inf for rows that attend to nothing.
    - short path: ``o = FlashAttentionFunction.apply(entry, q, k, v, key_lengths[, kv_idx, q_idx])``, ``entry``
      a cached `fast.Entry` (the plan of a repeated eager call: its scalars and bound launches); ``kv_idx``,
      ``q_idx``: a per-call mask's lists for this call (kept for its backward: the entry is shared by every
      call of its shapes, whose forwards may all run before the first backward), left out: the entry's own.
      Forward and backward run the entry's launches (`fast.Entry.forward`, `backward`); one output.

    The arguments: ``slopes``: ALiBi's float32 [1 or B, Hq]
    or None (no gradient); ``softcap``: a float, 0 off; ``deterministic``: the backward adds without
    atomics (bitwise repeatable). ``seg_q``, ``seg_k``: int32 segment ids [1 or B, seq] (packed
    documents), both or neither; ``ranges``: the int32 key-range table [1 or B, 2, seq_q]
    (`sparseflash.segments.check_key_ranges`) or None, never with segment ids.
    ``density``: the mask's fraction of on blocks (1 dense, -1 unknown), for the launchers'
    estimate of the call's work (`estimate_work`, `tiles.tma_plan`).
    ``bits``, ``kv_tile``, ``q_tile`` (all or none): a mask's partial-block bits and its tile tables
    aligned with ``kv_idx`` / ``q_idx`` (`sparseflash.mask.ExactBits`): token-exact partial blocks."""

    @staticmethod
    def forward(ctx, entry, q, k, v, key_lengths, kv_idx=None, q_idx=None, rng=None, seg_q=None, seg_k=None, scale=None,
                causal=False, mask_bq=0, mask_bk=0, dropout_p=0.0, density=1.0, slopes=None, softcap=0.0, bits=None,
                kv_tile=None, q_tile=None, deterministic=False, ranges=None):
        ctx.entry = entry
        if entry is not None:  # the short path: the entry's launches (its key fixed everything else)
            o, lse = entry.forward(q, k, v, key_lengths, kv_idx)
            ctx.save_for_backward(q, k, v, o, lse, key_lengths, kv_idx, q_idx)
            return o  # (an unused output's gradient arrives materialised: zeros)
        o, lse, rng = _op(torch.ops.sparseflash.flash_fwd, flash_fwd_eager)(q, k, v, kv_idx, key_lengths, rng, seg_q, seg_k,
                                                                       scale, causal, mask_bq, mask_bk, dropout_p, density,
                                                                       slopes, softcap, bits, kv_tile, q_tile, ranges)
        ctx.save_for_backward(q, k, v, o, lse, rng, kv_idx, q_idx, key_lengths, seg_q, seg_k, slopes, bits, kv_tile,
                              q_tile, ranges)
        ctx.params = (scale, causal, mask_bq, mask_bk, dropout_p, density, softcap, deterministic)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse=None):
        entry = ctx.entry
        if entry is not None:
            q, k, v, o, lse, key_lengths, kv_idx, q_idx = ctx.saved_tensors
            dq, dk, dv = entry.backward(do, q, k, v, o, lse, key_lengths, kv_idx, q_idx)
            return None, dq, dk, dv, None, None, None  # (the Nones past the inputs given are dropped)
        q, k, v, o, lse, rng, kv_idx, q_idx, key_lengths, seg_q, seg_k, slopes, bits, kv_tile, q_tile, ranges = \
            ctx.saved_tensors
        scale, causal, mask_bq, mask_bk, dropout_p, density, softcap, deterministic = ctx.params
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _op(torch.ops.sparseflash.flash_bwd, flash_bwd_impl)(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths,
                                                                     rng, seg_q, seg_k, scale, causal, mask_bq, mask_bk,
                                                                     dropout_p, density, slopes, softcap, bits, kv_tile,
                                                                     q_tile, deterministic, ranges)
        return (None, dq, dk, dv) + (None,) * 19


def _tables(seg_q: Optional[Tensor], seg_k: Optional[Tensor], ranges: Optional[Tensor],
            slopes: Optional[Tensor]) -> dict:
    """The launchers' optional tables by name: ``segments`` (seg_q, seg_k) or None, ``key_ranges``,
    ALiBi's ``slopes`` (float32, contiguous: `flash_attention` made them so)."""
    return dict(segments=None if seg_q is None else (seg_q, seg_k), key_ranges=ranges, slopes=slopes)


def _exact(bits: Optional[Tensor], kv_tile: Optional[Tensor], q_tile: Optional[Tensor]):
    """The launchers' ``exact``: a `operands.ExactTiles`, or None without bits."""
    return None if bits is None else operands.ExactTiles((bits, kv_tile, q_tile))


def exact_tables(mask: BlockMask | None, exact: bool, device, kv_idx: Optional[Tensor], q_idx: Optional[Tensor],
                 per_call: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(bits, kv_tile, q_tile) of a call: the mask's partial-block bits (`BlockMask.exact_bits`) with
    tables aligned with the call's lists (the mask's own, cached; ``per_call``: lists pruned for
    this call, gathered anew), or three None when ``exact`` is off or the mask has none."""
    eb = None if mask is None or not exact else mask.exact_bits(device)
    if eb is None:
        return None, None, None
    kv_tile, q_tile = eb.tables(kv_idx, q_idx) if per_call else (eb.kv_tile, eb.q_tile)
    return eb.bits, kv_tile, q_tile


# Block size of the lists that segments alone (mask=None) prune to: the tiles the kernels are
# tuned for divide it, and FlexAttention's document masks use the same.
SEGMENT_BLOCK = 128


def segment_lists(segments: tuple[Tensor, Tensor] | None, key_ranges: Tensor | None, mask: BlockMask | None, device,
                  seq_k: int | None = None) -> tuple[Tensor, Tensor, int, int]:
    """(kv_idx, q_idx, block_q, block_k): the row and column block lists of ``mask`` (None: every
    block, at SEGMENT_BLOCK) restricted to the block pairs whose query and key id ranges overlap
    (``segments``: (seg_q, seg_k), `sparseflash.segments.segment_block_layout`), or, given instead
    the key-range table ``key_ranges``, the pairs its ranges reach (`key_range_block_layout`, keys
    ``seq_k``); ``[B or B', H', QB, KB]``. Built on the device at every call (a sort per list, no
    host synchronisation)."""
    bq, bk = (SEGMENT_BLOCK, SEGMENT_BLOCK) if mask is None else mask.block_size
    if segments is None:
        layout = key_range_block_layout(key_ranges, seq_k, bq, bk)
    else:
        layout = segment_block_layout(*segments, bq, bk)
    if mask is not None:
        layout = mask.layout.to(device) & layout
    _, kv_idx = sorted_nonzero(layout)
    _, q_idx = sorted_nonzero(layout.transpose(-1, -2))
    return kv_idx, q_idx, bq, bk


def mask_lists(mask: BlockMask | None, device) -> tuple[Optional[Tensor], Optional[Tensor], int, int, float]:
    """(kv_idx, q_idx, block_q, block_k, density) of ``mask`` on ``device`` as the kernels take
    them: (None, None, 0, 0, 1.0) for dense attention; density -1 when unknown (an index built
    inside a trace), or for a dynamic mask the upper bound it knows from its shapes
    (`BlockMask.density_bound`: the work estimate is an upper bound anyway, and unknown counts as
    large). A mask block the kernels cannot tile is refused here, early."""
    if mask is None:
        return None, None, 0, 0, 1.0
    index = mask.index(device)
    mask_bq, mask_bk = mask.block_size
    tiles.fit_tile(16, mask_bq, "block_q")
    tiles.fit_tile(16, mask_bk, "block_k")
    density = index.density
    if density is None:
        density = -1.0 if mask.density_bound is None else mask.density_bound
    return index.kv_idx, index.q_idx, mask_bq, mask_bk, density


def check_runnable(q: Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the triton backend takes float16, bfloat16 or float32 inputs, got {q.dtype} "
                        f"(use backend='reference' for float64)")
    if q.shape[-1] > 256:
        raise ValueError(f"the triton backend supports head_dim up to 256, got {q.shape[-1]}")
    if q.device.type == "cpu" and not _env.interpreting():
        raise RuntimeError("the triton backend on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                           "in the environment before triton is imported, or use backend='reference'")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"the triton backend runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {q.device}")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | None = None, *, causal: bool = False,
                    scale: float, key_lengths: Tensor | None = None, return_lse: bool = False,
                    dropout_p: float = 0.0, generator: torch.Generator | None = None,
                    segments: tuple[Tensor, Tensor] | None = None, key_ranges: Tensor | None = None,
                    softcap: float | None = None, alibi_slopes: Tensor | None = None, exact: bool = True,
                    deterministic: bool = False):
    """The Triton path of `sparseflash.attention` (inputs already validated there; ``segments``:
    the int32 (seg_q, seg_k) of `sparseflash.segments.check_segment_ids`; ``key_ranges``: the
    int32 table of `sparseflash.segments.check_key_ranges`; not both; ``softcap`` a float > 0 or
    None; ``alibi_slopes`` [1 or B, Hq] or None; ``exact``: apply a mask's token-level definition
    inside its partial blocks, `exact_tables`; ``deterministic``: a backward without atomics)."""
    check_runnable(q)
    density = 1.0
    seg_q, seg_k = (None, None) if segments is None else segments
    per_call = segments is not None or key_ranges is not None  # lists pruned for this call
    if per_call:
        if mask is not None:  # the work estimate: the mask's density, an upper bound (as causal is not counted)
            index = mask.index(q.device)
            density = -1.0 if index.density is None else index.density
        kv_idx, q_idx, mask_bq, mask_bk = segment_lists(segments, key_ranges, mask, q.device, k.shape[2])
        tiles.fit_tile(16, mask_bq, "block_q")
        tiles.fit_tile(16, mask_bk, "block_k")
    else:
        kv_idx, q_idx, mask_bq, mask_bk, density = mask_lists(mask, q.device)
    bits, kv_tile, q_tile = exact_tables(mask, exact, q.device, kv_idx, q_idx, per_call)
    rng = None
    if dropout_p > 0.0 and generator is not None:
        rng = dropout.draw_rng(q.device, generator)
    if key_lengths is not None:
        key_lengths = key_lengths.contiguous()
    # Self-attention may pass one tensor as q, k and v; dynamo cannot trace an autograd.Function
    # given the same tensor twice, so give each role its own (free) view.
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    if seg_k is not None and seg_k is seg_q:
        seg_k = seg_k.view_as(seg_k)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32).contiguous()
    o, lse = FlashAttentionFunction.apply(None, q, k, v, key_lengths, kv_idx, q_idx, rng, seg_q, seg_k, scale, causal,
                                          mask_bq, mask_bk, float(dropout_p), float(density), slopes,
                                          float(softcap or 0.0), bits, kv_tile, q_tile, bool(deterministic), key_ranges)
    if return_lse:
        return o, torch.where(lse == float("inf"), float("-inf"), lse)
    return o
