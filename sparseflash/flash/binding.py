"""Bound launches: a kernel's later launches straight through the compiled kernel's C launcher.

Triton's own launch (``kernel[grid](**args)``, `JITFunction.run`) binds, specialises and looks up
the compiled kernel at every call: 150-300 µs a launch of a ~45-argument kernel on an H200 host
(experiments/studies/hopper_threshold/). The launchers launch through Triton once per combination
of what it specialises on, keep the CompiledKernel it returns, and launch later calls with its
launcher directly:

- `sparseflash.flash.launch.run`: a plan's launch (the plan key fixes every scalar);
- `call`: kernels launched without a plan (the Hopper kernels, plans with TMA descriptors, decoding,
  the index build and selection), keyed per call on the arguments' specialisations.

``FAST_LAUNCH = False`` (``SPARSEFLASH_FAST_LAUNCH=0``) sends every launch through Triton's own path.
"""

from __future__ import annotations

import inspect

import torch

from sparseflash import _env
from sparseflash.flash import tiles

__all__ = ["FAST_LAUNCH", "call", "CALLS", "bind", "hooks_idle", "raw_stream", "current_device", "has_cuda",
           "runtime_knobs"]


# Bound launches: after a plan's first launch through Triton (`kernel[grid](**args)`, which
# specialises, compiles or finds the compiled kernel, and launches), `launch.run` keeps the
# CompiledKernel Triton returned and launches later calls of the plan with its C launcher
# directly: ``compiled.run(grid, stream, function, packed_metadata, launch_metadata=None,
# enter_hook=None, exit_hook=None, *every parameter's value)``, the call JITFunction.run itself
# ends with (the same in triton 3.6 and 3.9). That skips Triton's per-launch binding of ~45
# arguments, its cache key, its option parsing, its launch metadata and the launcher's
# data_ptr() call and pointer-attribute query per tensor (tensors go as their addresses).
#
# Safe because everything Triton specialises a compiled kernel on is in the bound launch's key:
# the plan key fixes every scalar argument (so whether each int is 1, divisible by 16, int32 or
# int64, or None), the constexprs and the options; per call the key adds the current device, each
# tensor's dtype and whether its address is 16-byte aligned. Plans with TMA descriptors (made per
# call) bind through `call` instead, keyed on the descriptors' types. Anything else takes Triton's
# own path: the interpreter, active launch hooks (profilers such as proton), pre-run hooks,
# TRITON_DEBUG, and a first launch whose result does not look like a CompiledKernel.
# FAST_LAUNCH = False (SPARSEFLASH_FAST_LAUNCH=0) turns it off, for A/B timing or to let tools that
# hook JITFunction.run see every launch.
FAST_LAUNCH = _env.flag("SPARSEFLASH_FAST_LAUNCH", True)


_KNOBS = None


def runtime_knobs():
    """triton.knobs.runtime (triton 3.4+), or None: no bound launches without it."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs

            _KNOBS = knobs.runtime
        except (ImportError, AttributeError):
            _KNOBS = False
    return _KNOBS or None


def hooks_idle() -> bool:
    """Triton has its launch knobs and no launch hook is set (triton 3.6+ keeps them in
    HookChains, empty by default; a profiler such as proton adds to them)."""
    rt = runtime_knobs()
    if rt is None:
        return False
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def current_device() -> int:
    return torch.cuda.current_device()  # the device Triton launches on (its driver asks the same)


try:  # what Triton's own CUDA driver asks for the current stream
    from torch._C import _cuda_getCurrentRawStream as raw_stream
except ImportError:  # pragma: no cover
    def raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


# Keyword launches without a plan (the Hopper kernels, plans with TMA descriptors, decoding, the
# index build and selection): `call` binds the same way, keyed per call on a superset of what Triton
# specialises a launch on: every argument's value except tensors and TMA descriptors, which count by
# what Triton reads of them (a tensor's dtype and 16-byte alignment; a descriptor's type, dtype, block
# shape, layout and padding, its mangled type). A bound launch fills in only the call's tensors (as
# addresses) and descriptors; a call with other scalars (another shape, say) binds anew, once.
# CALLS: those bound launches by key (tests count and clear it).
CALLS: dict = {}
_CALLS_MAX = 1024
_PARAMS: dict = {}
_SCALARS = frozenset((int, float, bool, str, type(None)))


def _params(kernel) -> tuple:
    """(names, defaults) of ``kernel``'s parameters, in order."""
    info = _PARAMS.get(kernel)
    if info is None:
        ps = list(inspect.signature(kernel.fn).parameters.values())
        info = _PARAMS[kernel] = (tuple(p.name for p in ps), tuple(p.default for p in ps))
    return info


def _desc_spec(a):
    """A TMA descriptor's part of the key (triton.tools' or Gluon's descriptor), else None."""
    block = getattr(a, "block_shape", None)
    if block is None:
        return None
    return (type(a), a.base.dtype, tuple(block), getattr(a, "layout", None), getattr(a, "padding", None),
            getattr(a, "round_f32_to_tf32", None))


def call(kernel, grid: tuple, *pos, **args) -> None:
    """``kernel[grid](*pos, **args)``; after the first launch of a combination (see above), straight
    through the compiled kernel's C launcher (FAST_LAUNCH)."""
    if not FAST_LAUNCH or tiles.INTERPRETING or not has_cuda() or not hooks_idle():
        kernel[grid](*pos, **args)  # (without CUDA: a compile-only check's hooked launch)
        return
    if pos:
        args = dict(zip(_params(kernel)[0], pos), **args)
    device = current_device()
    key = (kernel, device, tuple(args), tuple(map(_spec, args.values())))
    try:
        bound = CALLS.get(key)
    except TypeError:  # an argument that cannot be a key: Triton's own path
        kernel[grid](**args)
        return
    if bound is None:
        compiled = kernel[grid](**args)
        try:
            bound = bind(kernel, compiled, args)
        except Exception:  # an unexpected Triton: keep its own launch path
            bound = None
        if bound is not None:
            if len(CALLS) >= _CALLS_MAX:
                CALLS.clear()
            CALLS[key] = bound
        return
    run_c, function, meta, values, slots = bound
    values = list(values)
    for i, n in slots:
        values[i] = _addresses(args[n])
    g = tuple(grid) + (1, 1)
    run_c(g[0], g[1], g[2], raw_stream(device), function, meta, None, None, None, *values)


def _spec(a):
    """An argument's part of `call`'s key: a scalar with its type (True == 1 == 1.0 as keys, but
    Triton types them apart), a tensor by dtype and 16-byte alignment, a descriptor by
    `_desc_spec`, a tuple by its elements' (the kernels' strides; an optional part's tensors with
    its scalars)."""
    if type(a) in _SCALARS:
        return type(a), a
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if type(a) is tuple:
        return tuple, tuple(map(_spec, a))
    return _desc_spec(a) or (type(a), a)


def _holds_tensor(a) -> bool:
    """Whether an argument is, or is a tuple holding, a tensor or a TMA descriptor: a bound launch
    fills it in per call."""
    if type(a) is tuple:
        return any(map(_holds_tensor, a))
    return isinstance(a, torch.Tensor) or _desc_spec(a) is not None


def _addresses(a):
    """An argument as a bound launch passes it: tensors as their addresses (inside tuples too)."""
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    if type(a) is tuple:
        return tuple(map(_addresses, a))
    return a


_HAS_CUDA = None


def has_cuda() -> bool:
    """torch.cuda.is_available(), asked once; `call` binds only with CUDA (tools that time the
    launchers' Python on a CPU replace this function)."""
    global _HAS_CUDA
    if _HAS_CUDA is None:
        _HAS_CUDA = torch.cuda.is_available()
    return _HAS_CUDA


def bind(kernel, compiled, args: dict) -> tuple | None:
    """What a bound launch of ``kernel`` needs from its first launch with ``args`` (by parameter
    name; ``compiled`` the CompiledKernel Triton returned): (run, function, packed_metadata, every
    parameter's value in order with None where a tensor, a descriptor or a tuple holding one goes,
    (position, name) of those), or None when it cannot be bound (pre-run hooks, TRITON_DEBUG, not a CompiledKernel, a
    parameter with neither an argument nor a default)."""
    if getattr(kernel, "pre_run_hooks", None) or runtime_knobs().debug:
        return None
    run_c, function, meta = getattr(compiled, "run", None), getattr(compiled, "function", None), \
        getattr(compiled, "packed_metadata", None)
    if run_c is None or function is None or meta is None:
        return None
    names, defaults = _params(kernel)
    values, slots = [], []
    for i, (n, d) in enumerate(zip(names, defaults)):
        if n in args:
            a = args[n]
            if _holds_tensor(a):  # (a tuple holding one is filled in whole per call)
                slots.append((i, n))
                a = None
            values.append(a)
        elif d is not inspect.Parameter.empty:
            values.append(d)
        else:
            return None
    return run_c, function, meta, tuple(values), tuple(slots)
