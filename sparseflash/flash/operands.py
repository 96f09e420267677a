"""The portable kernels' operands: what `sparseflash.flash.launch` passes besides q, k, v and the
outputs, computed from a call's inputs (no policy: tiles and TMA are `sparseflash.flash.tiles`'s).

- Strides: the leading strides of each launch's tensors are passed divided by their common
  power-of-two alignment when it is 2, 4 or 8 (`aligned_strides`), for the kernels to multiply back.
- Block lists as the kernels read them (`list_args`, `gather`), the dropout constants
  (`drop_consts`, `checked_rng`), the dot precision of a dtype (`dot_precision`).
- The per-call extras and their constexpr flags: segment ids, `KeyRanges`, `Alibi` (`with_alibi`,
  `seg_args`), `ExactTiles` (`check_exact`, `exact_flag`), softcap (`softcap_flag`).
- The order of each kernel's tensors (`fwd_tensors`, `dq_tensors`, `dkdv_tensors`), written once
  for the launchers and the quick launches.
"""

from __future__ import annotations

import functools

import torch

from sparseflash.flash import tiles
from sparseflash import _env

__all__ = ["dot_precision", "cdiv", "aligned_strides", "GATHER_MAX", "gather", "list_args", "checked_rng",
           "drop_consts", "KeyRanges", "ExactTiles", "check_exact", "exact_flag", "Alibi", "with_alibi", "seg_pair",
           "seg_args", "softcap_flag", "bwd_consts", "fwd_tensors", "dq_tensors", "dkdv_tensors"]


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' DOT_PREC for inputs of ``dtype``."""
    # fp32 inputs: dots as torch.matmul makes them, full precision by default and tf32 when
    # torch.set_float32_matmul_precision is "high" or "medium" (the interpreter always multiplies
    # fp32 exactly). 16-bit inputs: tensor-core dots; the interpreter multiplies them in fp32 (what
    # tensor cores do; its own bf16 dot is wrong).
    if dtype == torch.float32:
        if tiles.interpreting() or torch.get_float32_matmul_precision() == "highest":
            return "ieee"
        return "tf32"
    return "upcast" if tiles.interpreting() else "tf32"


# Plain integer helpers: triton.cdiv / next_power_of_2 are ConstexprFunction objects in newer
# Triton, whose call costs microseconds on every launch.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of positive ints."""
    return -(-a // b)


def _nb_p2(n: int) -> int:
    return max(2, 1 << max(0, n - 1).bit_length())


def aligned_strides(*ts: torch.Tensor) -> tuple[tuple, int]:
    """The strides of 4-D tensors ``ts`` as kernel arguments, and the ALIGN constexpr: the largest
    power of two dividing every stride but the last of each tensor, when each has a unit last
    stride and that power is 2, 4 or 8 (else 1), with the leading strides then divided by it for
    the kernels to multiply back (kernels._aligned). The compiler then knows where rows start:
    Triton's own specialisation only recognises strides divisible by 16, and a head_dim of 40 (row
    stride 40) would otherwise get element-wise loads, no async copies and spills (sm_90 compile:
    dQ 255 registers and 551 instructions per step instead of 155 and 285). Strides divisible by
    16 need no help (ALIGN 1: the same kernel as without it), nor can strides of 2**31 or more
    have it: divided, one could pass as int32 and wrap when multiplied back."""
    return _align_plan(tuple(t.stride() for t in ts))


@functools.lru_cache(maxsize=1024)
def _align_plan(all_strides: tuple[tuple[int, ...], ...]) -> tuple[tuple, int]:
    """`aligned_strides` on the tensors' stride tuples (cached: a model calls with few layouts)."""
    strides = ()
    lead = 0  # OR of the leading strides: its lowest set bit is their common power-of-two alignment
    for st in all_strides:
        sb, sh, sm, sd = st
        if sd != 1:
            return tuple(x for st in all_strides for x in st), 1
        lead |= sb | sh | sm
        strides += st
    align = lead & -lead
    if not lead & 15 or align == 1 or max(strides) >= 2**31:
        return strides, 1
    return tuple(x if i % 4 == 3 else x // align for i, x in enumerate(strides)), align


# Lists up to this many entries are read from registers in the loop (GATHER), longer ones from
# memory; see kernels._tile_start. SPARSEFLASH_GATHER_MAX overrides it (for measurement).
GATHER_MAX = int(_env.text("SPARSEFLASH_GATHER_MAX", "512"))


def gather(nb_p2: int) -> bool:
    """The GATHER constexpr: lists of ``nb_p2`` entries are read from registers."""
    return nb_p2 <= GATHER_MAX


# Pointer arguments a kernel variant never reads (no lists when dense, no key_lengths, no
# dropout) get an input tensor of the call as a placeholder. Never a cached tensor allocated on
# first use: under torch.compile's CUDA graphs that first use can fall inside the graph's memory
# pool, which then holds a live allocation it does not track and refuses to run.
def list_args(idx, B, H, placeholder: torch.Tensor):
    """(lists, their strides, NB_P2) for a kernel; the lists' [B', H', ...] read as [B, H, ...]
    (stride 0 where the mask is shared). Dense attention (idx None) passes the placeholder."""
    if idx is None:
        return placeholder, (0, 0, 0), 1
    (ib, ih, _, nb), (sb, sh, sr, _) = idx.shape, idx.stride()
    if ib not in (1, B) or ih not in (1, H):
        raise ValueError(f"block lists of shape {tuple(idx.shape)} do not broadcast to batch {B}, heads {H}")
    return idx, (0 if ib == 1 else sb, 0 if ih == 1 else sh, sr), _nb_p2(nb)


def checked_rng(rng, device) -> torch.Tensor:
    """``rng`` (a `sparseflash.dropout.draw_rng` tensor) when it is one for ``device``; raises otherwise."""
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.int64 and rng.shape == (3,) and rng.device == device):
        got = f"{rng.dtype} {tuple(rng.shape)} on {rng.device}" if isinstance(rng, torch.Tensor) else type(rng).__name__
        raise ValueError(f"rng must be an int64 tensor [3] (seed_lo, seed_hi, offset) on {device} when dropout_p > 0, "
                         f"got {got} (sparseflash.dropout.draw_rng makes one)")
    return rng


def drop_consts(dropout_p: float) -> tuple[int, float]:
    """(threshold on 8 random bits, scale of kept values); (0, 1.0) without dropout."""
    if dropout_p <= 0.0:
        return 0, 1.0
    from sparseflash.dropout import effective_p, threshold

    # Scale by the probability the 8-bit threshold really applies; p = 1 keeps nothing and
    # scales by 0 (not 1/0).
    p = effective_p(dropout_p)
    return threshold(dropout_p), (1.0 / (1.0 - p) if p < 1.0 else 0.0)


class KeyRanges(tuple):
    """The ``seg`` of a call with key ranges instead of segment ids: ``(table, table)``, the int32
    table [1 or B, 2, Nq] (contiguous) of each query's key range [start, end) (the kernels'
    KEY_RANGES; it takes the slot of the query segment ids)."""


class ExactTiles(tuple):
    """The bits of a call whose mask applies a token-level definition inside its partial blocks:
    ``(bits, kv_tile, q_tile)``, `sparseflash.mask.ExactBits`'s words [P, block_q, ceil(block_k /
    32)] and its int32 tables laid out exactly as the call's row lists (kv_idx) and column lists
    (q_idx) (the kernels' EXACT). Calls with them take the portable kernels when
    `dispatch.HOPPER_EXACT` is "off"."""


def exact_flag(exact) -> dict:
    """The EXACT constexpr, passed only when on (other plans keep their kwargs)."""
    return {} if exact is None else dict(EXACT=True)


def check_exact(exact, idx, what: str):
    """The (table, bits) of a launch: the table must be laid out as the list it follows."""
    bits, table = exact[0], exact[1] if what == "kv_idx" else exact[2]
    if idx is None or table.shape != idx.shape or table.stride() != idx.stride() or table.dtype != torch.int32 \
            or bits.dtype != torch.int32 or not bits.is_contiguous():
        raise ValueError(f"exact tiles must come with block lists: an int32 table shaped and strided as {what} "
                         f"{None if idx is None else tuple(idx.shape)}, got {tuple(table.shape)} {table.dtype}")
    return table, bits


class Alibi(tuple):
    """The ``seg`` of a call with ALiBi slopes: ``(table, slopes)``. ``slopes``: float32 [1 or B,
    Hq], contiguous (the kernels' SEG_K slot); ``table`` (the SEG_Q slot): None, a `KeyRanges`
    table (``inner`` "ranges"), or the segment ids packed as one int32 table [1 or B, Nq + Nk],
    query ids then key ids (``inner`` "segments"). Made by `with_alibi`."""

    def __new__(cls, table, slopes, inner):
        self = super().__new__(cls, (table, slopes))
        self.inner = inner
        return self


def with_alibi(seg, slopes: torch.Tensor | None):
    """The ``seg`` of a call (None, segment ids (seg_q, seg_k), or a `KeyRanges`) with ALiBi
    ``slopes`` ([1 or B, Hq]) added: an `Alibi` (``seg`` itself when ``slopes`` is None)."""
    if slopes is None:
        return seg
    slopes = slopes.to(torch.float32).contiguous()
    if seg is None:
        return Alibi(None, slopes, None)
    if isinstance(seg, KeyRanges):
        return Alibi(seg[0], slopes, "ranges")
    sq, sk = seg
    b = max(sq.shape[0], sk.shape[0])
    return Alibi(torch.cat([sq.expand(b, -1), sk.expand(b, -1)], dim=1), slopes, "segments")


def seg_pair(seg, placeholder: torch.Tensor) -> tuple:
    """The tensors of the SEG_Q and SEG_K slots (the placeholder where a variant reads none)."""
    if seg is None:
        return placeholder, placeholder
    sq, sk = seg
    return placeholder if sq is None else sq, sk


def seg_args(seg, placeholder: torch.Tensor):
    """Kernel arguments of segment ids: (SEG_Q, SEG_K, their batch strides) and the constexpr
    flags (SEGMENTS, and KEY_RANGES=True / ALIBI=True only when on, so other plans keep their
    kwargs). ``seg``: None, int32 (seg_q [1 or B, Nq], seg_k [1 or B, Nk]) with unit last stride,
    a `KeyRanges`, or an `Alibi`."""
    if seg is None:
        return (placeholder, placeholder, 0, 0), dict(SEGMENTS=False)
    sq, sk = seg
    if isinstance(seg, Alibi):
        flags = dict(SEGMENTS=seg.inner == "segments", ALIBI=True)
        if seg.inner == "ranges":
            flags["KEY_RANGES"] = True
        sq = placeholder if sq is None else sq
        return (sq, sk, sq.stride(0) if sq.shape[0] > 1 else 0, sk.stride(0) if sk.shape[0] > 1 else 0), flags
    if isinstance(seg, KeyRanges):
        return (sq, sq, sq.stride(0) if sq.shape[0] > 1 else 0, 0), dict(SEGMENTS=False, KEY_RANGES=True)
    return (sq, sk, sq.stride(0) if sq.shape[0] > 1 else 0, sk.stride(0) if sk.shape[0] > 1 else 0), dict(SEGMENTS=True)


# The tensors of each kernel's launch in the order its plan's slots take them. Placeholders for
# arguments a variant never reads are q (or the lists). Also called with role markers instead of
# the per-call tensors (`launch.quick_fwd`, `launch.quick_bwd`), so the order is written once.
# ``ex``: the (tile table, bits) pair of an exact call (`check_exact`), in the slots after the list.
def fwd_tensors(q, k, v, o, lse, kv_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    idx = q if kv_idx is None else kv_idx
    sq, sk = seg_pair(seg, q)
    return (q, k, v, o, lse, idx, *(ex or ()), idx if key_lengths is None else key_lengths, sq, sk,
            q if rng is None else rng, *descs)


def dq_tensors(q, k, v, o, do, lse, dlse, delta, dq, kv_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    return (q, k, v, o, do, lse, lse if dlse is None else dlse, delta, dq, q if kv_idx is None else kv_idx,
            *(ex or ()), *_bwd_tensors(q, key_lengths, rng, seg), *descs)


def dkdv_tensors(q, k, v, do, lse, delta, dk, dv, q_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    return (q, k, v, do, lse, delta, dk, dv, q if q_idx is None else q_idx, *(ex or ()),
            *_bwd_tensors(q, key_lengths, rng, seg), *descs)


def softcap_flag(softcap: float) -> dict:
    """The SOFTCAP constexpr, passed only when on (other plans keep their kwargs)."""
    return dict(SOFTCAP=float(softcap)) if softcap else {}


def _bwd_tensors(q, key_lengths, rng, seg) -> tuple:
    """The per-call tensors both backward kernels take after their lists: KEY_LEN, SEG_Q, SEG_K, RNG
    (``rng`` None without dropout)."""
    sq, sk = seg_pair(seg, q)
    return q if key_lengths is None else key_lengths, sq, sk, q if rng is None else rng


def bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap=0.0, exact=None) -> tuple[tuple, dict]:
    """(segment batch strides, the constexprs) both backward kernels take."""
    D = q.shape[-1]
    (_, _, *seg_strides), seg_flags = seg_args(seg, q)
    return tuple(seg_strides), dict(HEAD_DIM=D, BLOCK_D=tiles.block_d(D), CAUSAL=causal,
                                    HAS_KEYLEN=key_lengths is not None, DROPOUT=dropout_p > 0.0,
                                    DOT_PREC=dot_precision(q.dtype), **seg_flags, **softcap_flag(softcap),
                                    **exact_flag(exact))
