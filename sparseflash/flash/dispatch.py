"""Which kernel family runs a call: the portable Triton kernels (`kernels.py`, everywhere) or the
Hopper Gluon kernels (`hopper/forward.py`, `hopper/backward.py`; sm_90 only). `hopper_plan`
is the one place this is decided; the launchers (`launch.fwd`, `launch.bwd`) ask it first and run
the portable kernels when it answers None.

The Hopper kernels take a call when, in this order:
- it uses none of what they do not implement: dropout, segment ids or key ranges, ALiBi, softcap,
  a scale <= 0 (their running max is taken on raw scores), and exact-mask bits when
  `HOPPER_EXACT` is "off" (``SPARSEFLASH_HOPPER_EXACT=off``; "on", the default since the GPU tests
  checked the Hopper kernels' bits against the float64 reference on an H200);
- it runs on an sm_90 GPU, compiled (not the interpreter), and TMA_MODE gives it descriptors
  (`tiles.tma_wanted`: "on", or in "auto" calls of at least `tiles.TMA_MIN_WORK` FLOPs or captured
  in a CUDA graph);
- `hopper.plan` takes it (``SPARSEFLASH_HOPPER``, gluon present, fp16 / bf16, head_dim 64 or 128,
  mask blocks multiples of 128, layouts TMA takes);
- backward only: the call did not ask for a deterministic backward (``deterministic=True``: the
  portable backward, which adds without atomics), and `hopper_bwd.plan` takes dO and O (``SPARSEFLASH_HOPPER_BWD``, deterministic
  algorithms off) and block-sparse column lists are long enough (`hopper_bwd.LIST_MIN_BLOCKS`).
Gluon is imported only past the device test, so CPU runs never import it. The device-dependent
halves, `fwd_layouts` and `bwd_layouts`, are module attributes that tests and the host-cost
studies replace to send a CPU call down the Hopper route.
"""

from __future__ import annotations


from sparseflash.flash import tiles
from sparseflash import _env

__all__ = ["hopper_plan", "HOPPER_EXACT", "fwd_layouts", "bwd_layouts"]

# "on": calls with exact-mask bits may take the Hopper kernels (their EXACT), as other calls do;
# "off": they keep the portable kernels.
HOPPER_EXACT = _env.text("SPARSEFLASH_HOPPER_EXACT", "on")


def hopper_plan(q, k, v, mask_bq, mask_bk, work: float, *, scale: float, dropout_p: float = 0.0,
                tables=(None, None, None), softcap: float = 0.0, exact=None, do=None, o=None, lists: bool = False,
                deterministic: bool = False):
    """The Hopper kernels' layouts when they run this call, else None (the portable kernels). The
    forward's with ``do`` None: `hopper.layouts` of (q, k, v); the backward's: (those,
    `hopper_bwd.do_layout` of dO), ``lists`` saying whether the call walks block lists. ``work``:
    the call's estimated forward FLOPs (-1 unknown); ``tables``: the call's (segments, key_ranges,
    slopes); the other arguments as `launch.fwd` takes them."""
    if dropout_p > 0.0 or any(t is not None for t in tables) or softcap or not scale > 0.0:
        return None  # features the Hopper kernels do not have
    if do is not None and deterministic:
        return None  # the Hopper backward adds dQ in arrival order; the portable one has no atomics
    if exact is not None:  # exact bits: the Hopper kernels unless HOPPER_EXACT is "off"
        if HOPPER_EXACT not in ("on", "off"):
            raise ValueError(f"dispatch.HOPPER_EXACT (SPARSEFLASH_HOPPER_EXACT) must be 'on' or 'off', got {HOPPER_EXACT!r}")
        if HOPPER_EXACT == "off":
            return None
    if do is None:
        return fwd_layouts(q, k, v, mask_bq, mask_bk, work)
    return bwd_layouts(do, q, k, v, o, mask_bq, mask_bk, work, lists, exact is not None)


def bwd_layouts(do, q, k, v, o, mask_bq, mask_bk, work: float, lists: bool = False, exact: bool = False):
    """(q, k, v layouts, dO layout) when the backward runs the Hopper kernel, else None: where the
    forward would (`fwd_layouts`) and `hopper_bwd.plan` takes dO, O and the walk (``lists``:
    block lists, whose mean length per key tile comes from the work estimate; ``exact``: the call
    has exact-mask bits)."""
    lay = fwd_layouts(q, k, v, mask_bq, mask_bk, work)
    if lay is None:
        return None
    from sparseflash.flash.hopper import backward as hopper_bwd, forward as hopper

    cols = None
    if lists:  # 128-row q blocks per key tile's walk: work = 4 B H Nq Nk D x density (-1: unknown)
        B, H, _, D = q.shape
        cols = work / (4.0 * B * H * k.shape[2] * D * hopper.TILE) if work > 0 else -1.0
    return hopper_bwd.plan(do, q, o, lay, cols, exact=exact)


def fwd_layouts(q, k, v, mask_bq, mask_bk, work: float):
    """The descriptor layouts (`hopper.layouts`) when the forward runs the warp-specialised Hopper
    kernel, else None: on sm_90, for the calls TMA_MODE gives descriptors (`tiles.tma_wanted`),
    then as `hopper.plan` decides."""
    if q.device.type != "cuda" or tiles.interpreting() or tiles.sm_major(q.device.index) != 9:
        return None
    if not tiles.tma_wanted(q, tiles.block_d(q.shape[-1]), work):
        return None
    from sparseflash.flash.hopper import forward as hopper

    return hopper.plan(q, k, v, mask_bq=mask_bq, mask_bk=mask_bk)
