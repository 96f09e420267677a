"""The short path of an eager `sparseflash.attention` call: less host time per repeated call.

One unit with its C++ half (`sparseflash.flash.native`, `_native.cpp`), entered here only:
`sparseflash.attention` calls `lookup` (None: the call takes the general path; a `Miss`: its key is
new, and after validating the call the caller asks `build` for the entry), then `call`. This module calls `launch`, `autograd`
and `native` through their public names; none of them imports it (`autograd.FlashAttentionFunction`
calls the `Entry` this module hands it with a call, a native plan's backward fallback is a callable
this module hands it with the plan).

A model calls attention with the same shapes, layouts, mask and scalars step after step. The
first call of each such combination goes the general way (the caller's validation, `flash_attention`,
the launchers' plans) and leaves an `Entry` keyed by everything that validation and the launch
plans read: shapes, strides, dtypes and devices of q, k, v and key_lengths, the mask (its own
cache, `BlockMask.fast_entries`, so entries go with the mask), causal and scale with their types, the
launchers' module state. A later call with the same key skips validation and planning: it
allocates the outputs and runs the launchers' plans (`launch.run`, by parameter name); under autograd the
general path's own Function carries it, given the entry in place of the general arguments
(`autograd.FlashAttentionFunction`: one autograd Function for both), without autograd (no_grad,
inference, inputs that need no grad) none does. On CUDA, once the entry's forward is
bound and the C++ module is built, the entry's `native.Plan` serves its calls instead: the same
kernels launched from C++, with a C++ autograd node whose backward runs the dQ and dK/dV launches
of each dO layout the Python backward has bound (`sparseflash.flash.native`); what it has no
launch for comes back to the entry's Python backward (`NativeFallback`).

What stays per call: the key_lengths range check when it is on (a host synchronisation, as in
the general path: ``check_key_lengths=False`` skips it), the alignment of every address (else the
general launch), the current device, and launch hooks (a profiler sees every launch).

Per-call masks (`BlockMask.dynamic` with a `density_bound`, as `from_indices` makes them) are new
objects every call: their entries live in one table keyed by the mask's shapes (layout shape, block
size, lengths, density bound: what validation and the plans read of it), and each call launches with
its own mask's lists, which the autograd Function keeps for that call's backward (the entry is shared
by every call of those shapes, e.g. a model's layers, whose forwards all run before their backwards).
The native plan, whose lists are fixed, never serves them.

Taken only for the common case: CUDA tensors (or CPU under the Triton interpreter) of exactly type
torch.Tensor, a mask made once or a per-call one as above, no dropout, no segment ids,
no return_lse, backend "auto" or "triton", outside torch.compile traces and CUDA-graph capture
(those keep the general path: the ops the compiler traces, TMA descriptors in captured graphs),
calls small enough that the launchers keep pointer loads (below `tiles.TMA_MIN_WORK`; larger calls
are GPU-bound, and the general path gives them TMA), and a contiguous key_lengths. Everything else
goes the general way, as does every call with ``sparseflash.flash.fast.ENABLED = False``
(``SPARSEFLASH_FAST_PATH=0``).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

from sparseflash._compat import check_interpreter_versions
from sparseflash.flash import binding, launch, native, tiles
from sparseflash.flash.autograd import FlashAttentionFunction, check_runnable, estimate_work, mask_lists
from sparseflash.mask import BlockMask
from sparseflash import _env

__all__ = ["ENABLED", "Miss", "lookup", "build", "call", "clear", "Entry", "EntryLaunch", "NativeFallback",
           "make_entry", "DENSE", "DYNAMIC", "ROLES", "ROLE"]

ENABLED = _env.flag("SPARSEFLASH_FAST_PATH", True)

DENSE: dict = {}  # mask=None entries; a mask's own are in mask.fast_entries
DYNAMIC: dict = {}  # per-call masks' entries, by the mask's shapes (each call brings its own lists)
_MAX_ENTRIES = 256
_NO = object()  # a key whose calls go the general way


def clear() -> None:
    """Forget the dense and per-call-mask entries (tests; a mask's entries go with the mask)."""
    DENSE.clear()
    DYNAMIC.clear()


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


try:  # the current CUDA device without torch.cuda.current_device's Python layers
    from torch._C import _cuda_getDevice as _cuda_device
except ImportError:  # pragma: no cover - a CPU-only build has no native plans either
    def _cuda_device() -> int:
        return torch.cuda.current_device()


# The short path's per-call tensors, by kernel parameter name, in the order of its role tuple
# ``ts`` (forward: the first six; backward: all): the native module's role indices.
ROLES = ("Q", "K", "V", "O", "LSE", "KEY_LEN", "DO", "DELTA", "DQ", "DK", "DV")
ROLE = {n: i for i, n in enumerate(ROLES)}  # name -> role index


class EntryLaunch:
    """One kernel of an entry: its `launch` plan, the entry's fixed tensors (the mask's lists) by
    name, the role index of each other tensor, and ``bound``: None until a launch with every
    address 16-byte aligned bound the plan, then that bound launch (`native.launch_of` reads it)."""

    __slots__ = ("plan", "fixed", "roles", "bound", "device")

    def __init__(self, plan, fixed: dict):
        self.plan, self.fixed = plan, fixed
        self.roles = tuple((n, ROLE[n]) for n in plan.tensors if n not in fixed)
        self.bound = self.device = None

    def __call__(self, ts: tuple, fixed: dict | None = None) -> None:
        """Launch on the role tensors ``ts``; ``fixed``: this call's lists in place of the entry's
        (a per-call mask: same shapes, other contents)."""
        tensors = dict(self.fixed if fixed is None else fixed)
        for n, r in self.roles:
            tensors[n] = ts[r]
        done = launch.run(self.plan, tensors)
        if self.bound is None and done is not None and all(done[0][1]):
            self.device, self.bound = done[0][0], done[1]

    def native(self):
        """Its native `Launch` (`native.launch_of`), or None."""
        return native.launch_of(self.plan, self.bound, self.fixed, dict(self.roles))


def _fwd_launch(q, k, v, kv_idx, kl, scale, causal, mask_bq, mask_bk, work) -> EntryLaunch | None:
    """The forward of an entry (no dropout, no tables); None when it would load through TMA."""
    if tiles.tma_plan(tiles.block_d(q.shape[-1]), q, k, v, work=work) is not None:
        return None
    plan = launch.plan_fwd(q, k, v, torch.empty_like(q), kv_idx, kl, scale, causal, mask_bq, mask_bk, 0.0)
    return EntryLaunch(plan, {} if kv_idx is None else {"KV_IDX": kv_idx})


def _bwd_launches(do, q, k, v, o, kv_idx, q_idx, kl, scale, causal, mask_bq, mask_bk, work):
    """The dQ and dK/dV launches of an entry for ``do``'s layout; None when a plan would load
    through TMA."""
    if tiles.tma_plan(tiles.block_d(q.shape[-1]), q, k, v, do, o, work=work) is not None:
        return None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # only their layouts are read
    plan_dq = launch.plan_dq(do, q, k, v, o, dq, kv_idx, kl, scale, causal, mask_bq, mask_bk, 0.0)
    plan_kv = launch.plan_dkdv(do, q, k, v, dk, dv, q_idx, kl, scale, causal, mask_bq, mask_bk, 0.0)
    return (EntryLaunch(plan_dq, {} if kv_idx is None else {"KV_IDX": kv_idx}),
            EntryLaunch(plan_kv, {} if q_idx is None else {"Q_IDX": q_idx}))


class Entry:
    """One combination's forward (an `EntryLaunch`) and, per layout of the incoming gradient, its
    backward pair; the mask's lists and the call's scalars."""

    __slots__ = ("fwd", "bwd", "kv_idx", "q_idx", "scale", "causal", "mask_bq", "mask_bk", "work", "cuda", "seq_k",
                 "rows", "has_kl", "native", "native_bwd", "dynamic", "__weakref__")

    def __init__(self, fwd, kv_idx, q_idx, scale, causal, mask_bq, mask_bk, work, q, k, has_kl, dynamic=False):
        self.fwd, self.bwd = fwd, {}
        self.has_kl, self.native_bwd = has_kl, set()  # native_bwd: the dO strides given to the native plan
        # a per-call mask's entry: its lists (kv_idx, q_idx: the first call's, for the plans' shapes) are
        # replaced by each call's own at launch; the native plan, whose lists are fixed, never serves it
        self.dynamic = dynamic
        # the native plan (`sparseflash.flash.native`): None not made yet, False never (CPU, a
        # failed build, a kernel it cannot launch, a per-call mask)
        self.native = None if q.device.type == "cuda" and not dynamic else False
        self.kv_idx, self.q_idx = kv_idx, q_idx
        self.scale, self.causal, self.mask_bq, self.mask_bk, self.work = scale, causal, mask_bq, mask_bk, work
        self.cuda = q.device.type == "cuda"
        self.seq_k = k.shape[2]
        # float32 [B, H, Nq] of no memory (a stride-0 view): torch.empty_like of it allocates the LSE and
        # delta, a third of what torch.empty(shape, device=, dtype=) costs on the host
        self.rows = torch.empty((), device=q.device, dtype=torch.float32).expand(q.shape[:3])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kl: Tensor | None, kv_idx: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """(o, lse) of a call; ``kv_idx``: a per-call mask's row lists for this call (None: the entry's own)."""
        o = torch.empty_like(q)
        lse = torch.empty_like(self.rows)
        if launch.POISON_OUTPUTS:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        self.fwd((q, k, v, o, lse, kl), None if kv_idx is None else {"KV_IDX": kv_idx})
        return o, lse

    def backward(self, do, q, k, v, o, lse, kl, kv_idx=None, q_idx=None) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv); ``kv_idx``, ``q_idx``: a per-call mask's lists for this call (None: the entry's own)."""
        lists = kv_idx is not None
        if not lists:
            kv_idx, q_idx = self.kv_idx, self.q_idx
        pair = self.bwd.get(do.stride(), _NO) if do.dtype == q.dtype else None
        if pair is _NO:
            if len(self.bwd) >= 8:
                self.bwd.clear()
            pair = self.bwd[do.stride()] = _bwd_launches(
                do, q, k, v, o, self.kv_idx, self.q_idx, kl, self.scale, self.causal, self.mask_bq or None,
                self.mask_bk or None, self.work)
        if pair is None or (self.cuda and _capturing()):
            return launch.bwd(do, q, k, v, o, lse, None, kv_idx, q_idx, kl, self.scale, self.causal,
                              self.mask_bq or None, self.mask_bk or None, 0.0, None, work=self.work)
        delta = torch.empty_like(self.rows)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if launch.POISON_OUTPUTS:
            for t in (delta, dq, dk, dv):
                t.fill_(float("nan"))
        ts = (q, k, v, o, lse, kl, do, delta, dq, dk, dv)
        pair[0](ts, {"KV_IDX": kv_idx} if lists else None)
        pair[1](ts, {"Q_IDX": q_idx} if lists else None)
        if self.native:
            self._native_bwd(do, pair)
        return dq, dk, dv

    def _native_bwd(self, do, pair) -> None:
        """Give the native plan ``do``'s layout's launches once both are bound."""
        if pair[0].bound is not None and pair[1].bound is not None and do.stride() not in self.native_bwd:
            self.native_bwd.add(do.stride())
            try:
                dq, dkdv = pair[0].native(), pair[1].native()
            except RuntimeError:  # the kernel's parameters are not what was packed: this layout stays in Python
                return
            if dq is not None and dkdv is not None:
                self.native.add_bwd(list(do.stride()), dq, dkdv)

    def make_native(self):
        """The native plan, made once the forward is bound and the module is built; False when
        it will not be (its kernel does not fit a plain launch, or the build failed)."""
        if self.fwd.bound is None or not native.ENABLED:
            return None
        if native.module() is None:
            if native.failed() is None:
                return None  # building: ask again on a later call
            self.native = False
            return False
        try:
            launch_fwd = self.fwd.native()
            plan = None if launch_fwd is None else native.make_plan(launch_fwd, self.fwd.device, self.rows, self.has_kl,
                                                                    NativeFallback(self))
        except Exception as e:  # noqa: BLE001 - an unexpected Triton ABI: the Python path serves the entry
            warnings.warn(f"sparseflash: the native short path does not take this call: {e}", RuntimeWarning,
                          stacklevel=3)
            plan = None
        self.native = plan if plan is not None else False
        return self.native


class NativeFallback:
    """The backward a native plan calls for what it has no launch for (a new dO layout, capture, a
    misaligned address): its entry's own (which gives the plan a new layout's launches), or the
    general backward with the entry's lists and scalars once the entry is gone (its cache cleared).
    It holds the entry weakly: the entry holds the plan, which holds this."""

    __slots__ = ("entry", "args")

    def __init__(self, entry: Entry):
        self.entry = weakref.ref(entry)
        self.args = (entry.kv_idx, entry.q_idx, entry.scale, entry.causal, entry.mask_bq or None,
                     entry.mask_bk or None, entry.work)

    def __call__(self, do, q, k, v, o, lse, kl):
        entry = self.entry()
        if entry is not None:
            return entry.backward(do, q, k, v, o, lse, kl)
        kv_idx, q_idx, scale, causal, mask_bq, mask_bk, work = self.args
        return launch.bwd(do, q, k, v, o, lse, None, kv_idx, q_idx, kl, scale, causal, mask_bq, mask_bk, 0.0, None,
                          work=work)


class Miss:
    """`lookup`'s answer for a key not seen yet: where `build` stores its entry."""

    __slots__ = ("cache", "key")

    def __init__(self, cache: dict, key: tuple):
        self.cache, self.key = cache, key


def lookup(q, k, v, mask, causal, scale, key_lengths):
    """The `Entry` serving this call; a `Miss` when its key is new (validate the call, then
    `build`); None when the short path does not take it (the general path does). For calls
    without dropout, segment ids or return_lse, with backend "auto" or "triton"."""
    T = Tensor
    if not ENABLED or type(q) is not T or type(k) is not T or type(v) is not T or torch.compiler.is_compiling() \
            or _forward_ad._current_level >= 0:  # forward-mode AD: the general path says it has no jvp
        return None
    dyn = None
    if mask is None:
        cache = DENSE
    elif type(mask) is BlockMask:
        if mask.dynamic:
            # a per-call mask is new at every call: its entry is keyed by what validation reads of it
            # (its shapes) and serves every mask of those shapes, each call launching with its own lists;
            # without a density bound its work estimate would differ per call: the general path
            if mask.density_bound is None or mask.mask_mod is not None:
                return None
            cache = DYNAMIC
            dyn = (mask.layout.shape, mask.block_size, mask.seq_q, mask.seq_k, mask.density_bound)
        else:
            cache = mask.fast_entries
    else:
        return None
    kl = key_lengths
    if kl is not None and type(kl) is not T:
        return None
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, causal, causal.__class__, scale, scale.__class__,
           None if kl is None else (kl.shape, kl.stride(), kl.dtype, kl.device), launch.plan_state(),
           torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None, dyn)
    try:
        entry = cache.get(key)
    except TypeError:  # an unhashable argument: the general path names what is wrong with it
        return None
    if entry is None:
        if q.is_cuda and _capturing():
            return None  # decided outside capture, where the general path's choices are the eager ones
        return Miss(cache, key)
    if entry is _NO or (entry.cuda and _capturing()):
        return None
    return entry


def build(miss: Miss, q, k, v, mask, causal, scale: float, key_lengths, triton: bool):
    """The entry for ``miss``'s key, stored, for a call the general path validated; None (also
    stored) when the short path does not take such calls. ``scale``: the call's, resolved (a
    float); ``triton``: the backend resolves to the kernels."""
    entry = make_entry(q, k, v, mask, causal, scale, key_lengths) if triton else _NO
    if len(miss.cache) >= _MAX_ENTRIES:
        miss.cache.clear()
    miss.cache[miss.key] = entry
    return None if entry is _NO else entry


def call(entry: Entry, q, k, v, key_lengths, mask: BlockMask | None = None) -> Tensor:
    """The output of a call that `entry` serves (its key_lengths already checked as asked);
    ``mask``: the call's, whose lists a per-call mask's entry launches with."""
    kv_idx = q_idx = None  # the entry's own lists
    if entry.dynamic:  # (its block sizes are in the key: checked when the entry was built)
        index = mask.index(q.device)
        kv_idx, q_idx = index.kv_idx, index.q_idx
    nat = entry.native  # (False for a per-call mask's entry)
    if nat is None:
        nat = entry.make_native()
    if nat and native.ENABLED and binding.FAST_LAUNCH and not launch.POISON_OUTPUTS and binding.hooks_idle():
        dev = _cuda_device()
        if dev == nat.device:
            o = nat.forward(q, k, v, key_lengths, binding.raw_stream(dev))
            if o is not None:
                return o
            err = native.last_error()  # "" without an error: an address the plan does not take
            if err:
                raise RuntimeError(err)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if kv_idx is None:
            return FlashAttentionFunction.apply(entry, q, k, v, key_lengths)
        return FlashAttentionFunction.apply(entry, q, k, v, key_lengths, kv_idx, q_idx)
    return entry.forward(q, k, v, key_lengths, kv_idx)[0]  # nothing to differentiate: no autograd node


def make_entry(q, k, v, mask, causal, scale, kl):
    """The `Entry` of a new key for a call the general path validated (`build` stores it), or the
    marker `build` stores for keys whose calls go the general way."""
    try:
        check_runnable(q)
    except (TypeError, ValueError, RuntimeError):
        return _NO  # the general path raises it
    if q.device.type == "cpu":
        check_interpreter_versions()
    if kl is not None and not kl.is_contiguous():
        return _NO
    kv_idx, q_idx, mask_bq, mask_bk, density = mask_lists(mask, q.device)
    if density < 0:
        return _NO
    work = estimate_work(q, k, density)
    fwd = _fwd_launch(q, k, v, kv_idx, kl, scale, causal, mask_bq or None, mask_bk or None, work)
    if fwd is None:
        return _NO
    return Entry(fwd, kv_idx, q_idx, scale, causal, mask_bq, mask_bk, work, q, k, kl is not None,
                  dynamic=mask is not None and mask.dynamic)

