"""What the Hopper (sm_90) forward (`forward.py`) and one-pass backward (`backward.py`) share: the
guarded Gluon import, the tile size, the Gluon helpers both kernels call (a list walk's step start,
a tile's descriptor coordinates, the wgmma accumulator and list layouts, the TMA load and store
under their names in this Triton) and the host's TMA descriptors and SM count.

Without Gluon's Hopper module (an older Triton, a CPU-only install) ``GLUON_ERROR`` says why, the
Gluon helpers are not defined, and every call takes the portable kernels.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["GLUON_ERROR", "TILE", "LN2", "LOG2E", "descriptor", "sm_count"]

TILE = 128  # q rows per forward CTA (two warpgroups of 64), keys per forward step and per backward CTA
from sparseflash._consts import LN2, LOG2E  # noqa: E402,F401 (re-exported for the kernels)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: F401
                                                                  warpgroup_mma, warpgroup_mma_wait)

    # triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 renamed it async_load (and the
    # store async_copy_shared_to_global, async_store)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (likewise)
    GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - no gluon / no hopper module: every call takes the portable path
    GLUON_ERROR = f"{type(e).__name__}: {e}"


if GLUON_ERROR is None:

    @gluon.constexpr_function
    def list_layout(nb_p2, warps):
        # a row list spread over the lanes (replicated over warps): counting entries is a warp reduction
        return gl.BlockedLayout([max(1, nb_p2 // 32)], [32], [warps], [0])

    @gluon.constexpr_function
    def wgmma_layout(n):
        # one warpgroup's wgmma accumulator of [64, n]: 4 warps stacked along the rows
        n = getattr(n, "value", n)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def bnhd(desc):
        # whether a descriptor reads [B, N, H, D] memory: its box is then [1, rows, 1, D], else
        # [1, 1, rows, D] (`descriptor`); False for None (no descriptor)
        return desc is not None and desc.block_type.shape[2] == 1

    @gluon.jit
    def list_start(p_list, j, DENSE: gl.constexpr, MASK_B: gl.constexpr, STEP: gl.constexpr):
        """First row (key or query) of step j of a walk in steps of STEP rows: dense, every step;
        else every step of each listed block of MASK_B rows (a row walk's keys, the forward's, or
        a column walk's queries, the backward's)."""
        if DENSE:
            return j * STEP
        else:
            SUB: gl.constexpr = MASK_B // STEP
            return gl.load(p_list + j // SUB) * MASK_B + (j % SUB) * STEP

    @gluon.jit
    def tile_coord(b, h, n, BNHD: gl.constexpr):
        """A tile's descriptor coordinates: [B, H, N, D] memory, or [B, N, H, D] (BNHD)."""
        if BNHD:
            return [b, n, h, 0]
        else:
            return [b, h, n, 0]


@functools.lru_cache(maxsize=None)
def sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype: torch.dtype):
    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


# A descriptor's fields past its base, per (shape, strides, dtype, block): Gluon's TensorDescriptor
# validates them all at construction (dtype names, block shape, stride alignment; ~10 us of Python a
# descriptor, four a forward call), though only the base changes between calls of one layout.
_DESC_FIELDS: dict = {}
_DESC_FIELDS_MAX = 1024


def make_descriptor(t: torch.Tensor, shape: list, strides: list, block: tuple, smem=None):
    """Gluon's TensorDescriptor of ``t`` (``shape``, ``strides``: the view TMA reads; ``block``: its
    box; ``smem``: its shared-memory layout, default NVMMA's for the block and dtype), validated by its constructor the first time a layout is seen and copied from that one after
    (with this call's base, whose 16-byte alignment is checked each time)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (tuple(shape), tuple(strides), t.dtype, block, smem)
    fields = _DESC_FIELDS.get(key)
    if fields is None or t.data_ptr() & 15:
        d = TensorDescriptor(t, list(shape), list(strides), list(block), smem or _smem_layout(block, t.dtype))
        if fields is None and hasattr(d, "__dict__"):
            if len(_DESC_FIELDS) >= _DESC_FIELDS_MAX:
                _DESC_FIELDS.clear()
            _DESC_FIELDS[key] = {k: v for k, v in vars(d).items() if k != "base"}  # (never holds a tensor)
        return d
    d = object.__new__(TensorDescriptor)
    vars(d).update(fields)
    d.base = t
    return d


def descriptor(t: torch.Tensor, layout, rows: int, cols: int | None = None):
    """A TMA descriptor of [B, H, N, D] ``t`` in ``layout`` (`hopper.tensor_layout`'s (strides,
    bnhd)), blocks of ``rows`` x ``cols`` (default: all of D)."""
    strides, bnhd = layout
    B, H, N, D = t.shape
    cols = cols or D
    shape, block = ([B, N, H, D], (1, rows, 1, cols)) if bnhd else ([B, H, N, D], (1, 1, rows, cols))
    return make_descriptor(t, shape, strides, block)
