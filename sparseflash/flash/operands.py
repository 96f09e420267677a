"""The portable kernels' operands: what `sparseflash.flash.launch` passes besides q, k, v and the
outputs, computed from a call's inputs (no policy: tiles and TMA are `sparseflash.flash.tiles`'s).

- Strides: the leading strides of each launch's tensors are passed divided by their common
  power-of-two alignment when it is 2, 4 or 8 (`aligned_strides`), for the kernels to multiply back.
- Block lists as the kernels read them (`list_args`, `gather`), the dropout constants
  (`drop_consts`, `checked_rng`), the dot precision of a dtype (`dot_precision`).
- The optional tables, each one tuple parameter with its batch strides (`table_packs`,
  `table_pack_tensors`: segment ids, key ranges, ALiBi slopes), `ExactTiles` (`check_exact`),
  softcap (`softcap_arg`); `TENSOR` marks a plan argument (or a tuple argument's element) a call's
  tensor fills, None one it never reads (the kernels derive each feature's flag from whether it is
  None).
"""

from __future__ import annotations

import functools

import torch

from sparseflash.flash import tiles
from sparseflash import _env

__all__ = ["dot_precision", "cdiv", "aligned_strides", "GATHER_MAX", "gather", "list_args", "checked_rng",
           "drop_consts", "drop_args", "drop_pack", "ExactTiles", "check_exact", "softcap_arg", "TENSOR",
           "table_layout", "table_packs", "table_pack_tensors", "list_plan_args", "optional_tensors",
           "bwd_consts"]


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


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): `triton.next_power_of_2` without its
    constexpr-function wrapper, which costs microseconds a call in host code."""
    return 1 << (max(n, 1) - 1).bit_length()


def _nb_p2(n: int) -> int:
    return max(2, next_pow2(n))


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


def drop_args(dropout_p: float) -> dict:
    """The forward's plan arguments of dropout: RNG (a tensor of the call) and drop_thresh
    (`drop_consts`), None without dropout; drop_scale, the output's scale (1.0 without dropout)."""
    if dropout_p <= 0.0:
        return dict(RNG=None, drop_thresh=None, drop_scale=1.0)
    thresh, scale = drop_consts(dropout_p)
    return dict(RNG=TENSOR, drop_thresh=thresh, drop_scale=scale)


def drop_pack(dropout_p: float) -> dict:
    """The backward kernels' plan arguments of dropout: ``dropout`` (TENSOR, drop_scale), the RNG
    tensor of the call and the kept values' scale, and drop_thresh (`drop_consts`; a parameter of
    its own, which the kernels do not specialise on); both None without dropout."""
    if dropout_p <= 0.0:
        return dict(dropout=None, drop_thresh=None)
    thresh, scale = drop_consts(dropout_p)
    return dict(dropout=(TENSOR, scale), drop_thresh=thresh)


def drop_consts(dropout_p: float) -> tuple[int, float]:
    """(threshold on 8 random bits, scale of kept values); (0, 1.0) without dropout."""
    if dropout_p <= 0.0:
        return 0, 1.0
    from sparseflash.dropout import effective_p, threshold

    # Scale by the probability the 8-bit threshold really applies; p = 1 keeps nothing and
    # scales by 0 (not 1/0).
    p = effective_p(dropout_p)
    return threshold(dropout_p), (1.0 / (1.0 - p) if p < 1.0 else 0.0)


class ExactTiles(tuple):
    """The bits of a call whose mask applies a token-level definition inside its partial blocks:
    ``(bits, kv_tile, q_tile)``, `sparseflash.mask.ExactBits`'s words [P, block_q, ceil(block_k /
    32)] and its int32 tables laid out exactly as the call's row lists (kv_idx) and column lists
    (q_idx) (the kernels' EXACT). Calls with them take the portable kernels when
    `dispatch.HOPPER_EXACT` is "off"."""


def check_exact(exact, idx, what: str):
    """The (table, bits) of a launch: the table must be laid out as the list it follows."""
    bits, table = exact[0], exact[1] if what == "kv_idx" else exact[2]
    if idx is None or table.shape != idx.shape or table.stride() != idx.stride() or table.dtype != torch.int32 \
            or bits.dtype != torch.int32 or not bits.is_contiguous():
        raise ValueError(f"exact tiles must come with block lists: an int32 table shaped and strided as {what} "
                         f"{None if idx is None else tuple(idx.shape)}, got {tuple(table.shape)} {table.dtype}")
    return table, bits


def softcap_arg(softcap: float) -> dict:
    """The SOFTCAP constexpr, passed only when on (the kernels' default, None, is off)."""
    return dict(SOFTCAP=float(softcap)) if softcap else {}


# ----------------------------------------------------------------------------- named arguments
# A plan (`launch.Plan`) holds every kernel argument by its parameter name: the value of a
# scalar, `TENSOR` where the call passes a tensor, a tuple with TENSOR markers where it passes a
# tuple of tensors (an optional part's tensors with its scalars: `launch.Plan.packs`), None where
# the variant reads nothing (a constexpr to Triton: the compiled kernel then has neither the
# parameter nor code for it, and derives the feature's flag from it). The optional parts:
# segments (SEG_Q, SEG_K and their batch strides), ranges (the key-range table, its batch stride),
# alibi (the slopes, their batch stride), exact (the tile table KV_TILE / Q_TILE, BITS), the
# backward's dropout (RNG, drop_scale; the forward's RNG and drop_thresh are parameters of their
# own), key_lengths (KEY_LEN).

TENSOR = object()  # marks a plan argument that takes a tensor of the call


def _batch_stride(t: torch.Tensor) -> int:
    return 0 if t.shape[0] == 1 else t.stride(0)


def table_packs(segments, key_ranges, slopes) -> dict:
    """The plan arguments of the optional tables of a call, one tuple each, None when off:
    ``segments`` (TENSOR, TENSOR, stride_sqb, stride_skb): int32 (seg_q [1 or B, Nq], seg_k [1 or B,
    Nk]) with unit last stride; ``ranges`` (TENSOR, stride_rb): the int32 key-range table [1 or B,
    2, Nq] (contiguous; never with segments); ``alibi`` (TENSOR, stride_slb): ALiBi's float32 slopes
    [1 or B, Hq] (contiguous). A call gives their tensors by `table_pack_tensors`."""
    if segments is not None and key_ranges is not None:
        raise ValueError("segment ids and key ranges are exclusive")
    return dict(segments=None if segments is None else (TENSOR, TENSOR, *map(_batch_stride, segments)),
                ranges=None if key_ranges is None else (TENSOR, _batch_stride(key_ranges)),
                alibi=None if slopes is None else (TENSOR, _batch_stride(slopes)))


def table_pack_tensors(segments, key_ranges, slopes) -> dict:
    """The per-call tensors of the tables that are on, by parameter name: a tuple each (`table_packs`)."""
    ts = {}
    if segments is not None:
        ts["segments"] = tuple(segments)
    if key_ranges is not None:
        ts["ranges"] = (key_ranges,)
    if slopes is not None:
        ts["alibi"] = (slopes,)
    return ts


def table_layout(segments, key_ranges, slopes) -> tuple:
    """What `table_packs` reads of the tables (part of a plan's key)."""
    def lay(t):
        return None if t is None else (t.shape, t.stride())
    return (None if segments is None else (lay(segments[0]), lay(segments[1])), lay(key_ranges), lay(slopes))


def list_plan_args(idx, B, H, q, name: str, mask_bq: int, mask_bk: int) -> dict:
    """The plan arguments of the block lists: the list parameter ``name``, its (batch, head, row)
    strides ``stride_idx``, the mask block MASK_BQ x MASK_BK, NB_P2 (the lists' vector length) and
    GATHER (`gather`); all None for dense attention (``idx`` None), which reads none of them."""
    if idx is None:
        return {name: None, "stride_idx": None, "MASK_BQ": None, "MASK_BK": None, "NB_P2": None, "GATHER": None}
    _, st, nb_p2 = list_args(idx, B, H, q)
    return {name: TENSOR, "stride_idx": st, "MASK_BQ": mask_bq, "MASK_BK": mask_bk, "NB_P2": nb_p2,
            "GATHER": gather(nb_p2)}


def optional_tensors(**named) -> dict:
    """``named`` without the None entries (a plan's None arguments take no tensor)."""
    return {k: t for k, t in named.items() if t is not None}


def bwd_consts(q, causal, softcap=0.0) -> dict:
    """The constexprs both backward kernels take."""
    D = q.shape[-1]
    return dict(HEAD_DIM=D, CAUSAL=causal, DOT_PREC=dot_precision(q.dtype),
                **softcap_arg(softcap))
