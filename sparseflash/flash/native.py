"""The native short path, for the host cost of repeated eager calls: `_native.cpp`, built on first use, runs a repeated eager call's
forward, autograd node and backward in C++ with the Triton kernels that `sparseflash.flash.fast`
compiled and bound. It removes the Python autograd Function and Triton's per-launch argument
parsing from the hot path; what it launches is exactly what the Python short path launches.

Building: the first CUDA call that the short path serves starts a compile in a background thread
(about a minute; its calls go the Python way meanwhile) and caches the module under
``$SPARSEFLASH_CACHE`` (default ``~/.cache/sparseflash``), keyed by the source, torch and Python.
`load()` builds in the foreground (benchmarks, tests). ``SPARSEFLASH_NATIVE=0`` (or
``sparseflash.flash.native.ENABLED = False``) turns the path off; a failed build warns once and
leaves it off. It needs a C++20 compiler (``$CXX``, else ``c++``) and torch's headers.

The C++ half of the short path, whose one entry point is `sparseflash.flash.fast`: it calls this
module, never the other way round. `make_plan` makes a `Plan` per fast-path entry once the entry's
forward is bound; the entry gives it the backward launches per layout of the incoming gradient once
its Python backward has bound them. A backward the plan has no launch for (a new dO layout,
CUDA-graph capture, a misaligned address) calls the ``fallback`` given with the plan (the Python
short path's backward). Launch hooks (a profiler): the forward checks them per call and goes the
Python way while one is set; a backward whose forward ran native stays native.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from sparseflash import _env

__all__ = ["ENABLED", "load", "module", "ready", "failed", "last_error", "launch_of", "make_plan", "cache_dir", "build_tag"]

ENABLED = _env.flag("SPARSEFLASH_NATIVE", True)

_SOURCE = Path(__file__).with_name("_native.cpp")
_MOD = None
_FAILED: str | None = None
_THREAD: threading.Thread | None = None
_LOCK = threading.Lock()


def cache_dir() -> Path:
    return Path(_env.text("SPARSEFLASH_CACHE") or Path.home() / ".cache" / "sparseflash") / "native"


def _extra_flags() -> list[str]:
    return _env.text("SPARSEFLASH_NATIVE_CXXFLAGS").split()


def build_tag() -> str:
    """The built module's name tag: a hash of the C++ source, torch, Python, the C++ ABI and the extra flags."""
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    h = hashlib.sha1(_SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{torch.__file__}|{sys.version}|{abi}|{_extra_flags()}".encode())
    return h.hexdigest()[:16]


def _compile(name: str, out: Path) -> None:
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    cmd = [_env.text("CXX", "c++"), "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    # torch's own pybind11 ABI tags where it still sets them (torch < 2.10), so that this module
    # shares pybind11's internals, exception translators among them, with torch's
    abi_flags = getattr(cpp_extension, "_get_pybind11_abi_build_flags", lambda: [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmd += list(abi_flags())
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    cmd += _extra_flags() + [str(_SOURCE), "-o", str(out)]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building sparseflash's native path failed ({' '.join(cmd[:1])} exit {r.returncode}):\n"
                           + (r.stderr or r.stdout)[-3000:])


def _build_and_import():
    name = f"sparseflash_native_{build_tag()}"
    folder = cache_dir()
    so = folder / (name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not so.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(fd)
        try:
            _compile(name, Path(tmp))
            os.replace(tmp, so)  # atomic: concurrent builders leave one complete file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load():
    """The native module, built now if needed (blocking); raises if it cannot be built."""
    global _MOD, _FAILED
    with _LOCK:
        if _MOD is None:
            try:
                _MOD = _build_and_import()
            except Exception as e:
                _FAILED = f"{type(e).__name__}: {e}"
                raise
        return _MOD


def _background() -> None:
    try:
        load()
    except Exception as e:  # noqa: BLE001 - reported once, the Python path goes on
        warnings.warn(f"sparseflash: the native short path is off: {e}", RuntimeWarning, stacklevel=1)


def module():
    """The native module if built; else None, starting a background build the first time."""
    global _THREAD
    if _MOD is not None or not ENABLED or _FAILED is not None:
        return _MOD
    if _THREAD is None:
        _THREAD = threading.Thread(target=_background, name="sparseflash-native-build", daemon=True)
        _THREAD.start()
    return None


def ready() -> bool:
    return _MOD is not None


def failed() -> str | None:
    """Why the build failed (the path then stays off), or None: built, building or not started."""
    return _FAILED


def last_error() -> str:
    """The launch error of the last `Plan.forward` that returned None for one, "" when none (an
    address the plan does not take is no error); reading it clears it."""
    return _MOD.last_error() if _MOD is not None else ""


_FLOATS = {"fp32", "f32"}
_INTS = {"i1": (1, 0xFF), "u1": (1, 0xFF), "i8": (1, 0xFF), "u8": (1, 0xFF), "i16": (2, 0xFFFF), "u16": (2, 0xFFFF),
         "i32": (4, 0xFFFFFFFF), "u32": (4, 0xFFFFFFFF), "i64": (8, 2**64 - 1), "u64": (8, 2**64 - 1)}


def launch_of(plan, bound, fixed: dict, roles: dict, mod=None):
    """The native `Launch` of ``plan`` (a `launch` plan) from its ``bound`` launch (`launch.run`'s:
    run, function, packed metadata, every parameter's value, the compiled kernel), with ``fixed``
    tensors (name -> tensor: their addresses go into the launch) and ``roles`` (name -> role
    index of a per-call tensor); None when its kernel does not fit the plain launch (clusters,
    cooperative or PDL launches, scratch buffers, TMA arguments; a tuple argument's elements are
    packed in order). Raises RuntimeError
    when the kernel's own parameter list disagrees with the packed one."""
    mod = mod or _MOD
    if mod is None or bound is None or plan.slots is None:
        return None
    _run, function, meta, values, compiled = bound
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) \
            or getattr(md, "launch_pdl", False) or getattr(md, "global_scratch_size", 0) \
            or getattr(md, "profile_scratch_size", 0):
        return None
    sig = list(getattr(getattr(compiled, "src", None), "signature", {}).values())
    if len(sig) != len(values):
        return None
    values = list(values)
    role_of = {}
    for i, name in plan.slots:
        if name in fixed:
            values[i] = fixed[name].data_ptr()
        elif name in roles:
            role_of[i] = roles[name]
        else:
            return None
    slots, sizes, roles_packed = [], [], []
    for i, ty, val in _flat(sig, values):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None
        if i in role_of:
            if ty[0] != "*":
                return None
            roles_packed.append((len(slots), int(role_of[i])))
            slots.append(0)
            sizes.append(8)
        elif ty[0] == "*":
            slots.append(int(val or 0))
            sizes.append(8)
        elif ty in _FLOATS:
            slots.append(struct.unpack("<I", struct.pack("<f", float(val)))[0])
            sizes.append(4)
        elif ty in _INTS:
            size, m = _INTS[ty]
            slots.append(int(val) & m)
            sizes.append(size)
        else:
            return None
    slots += [0, 0]  # Triton's global and profile scratch pointers: none
    sizes += [8, 8]
    g = plan.grid
    made = mod.make_launch(int(function), [int(g[0]), int(g[1]), 1], 32 * int(meta[0]), int(meta[2]), slots, sizes,
                           roles_packed)
    if isinstance(made, str):
        raise RuntimeError(made)
    return made


def _flat(sig, values):
    """(parameter position, type, value) of each parameter, a tuple parameter's elements in order
    under its position (Triton passes them as consecutive kernel parameters; the kernels' strides
    come as tuples); a tuple whose value does not match its type gives a type `launch_of` refuses."""
    for i, (ty, val) in enumerate(zip(sig, values)):
        if isinstance(ty, tuple):
            if not isinstance(val, tuple) or len(val) != len(ty):
                yield i, None, val
                continue
            for t, v in zip(ty, val):
                yield from ((i, t2, v2) for _, t2, v2 in _flat([t], [v]))
        else:
            yield i, ty, val


def make_plan(fwd, device: int, rows, has_kl: bool, fallback):
    """A native `Plan` whose forward is the native `Launch` ``fwd`` (`launch_of`) on CUDA device
    ``device``, or None (no module yet). ``rows``: the float32 [B, H, Nq] that empty_like turns
    into the LSE and delta; ``has_kl``: calls pass key_lengths; ``fallback(do, q, k, v, o, lse,
    key_lengths) -> (dq, dk, dv)``: the backward of what the plan has no launch for."""
    mod = _MOD
    if mod is None or fwd is None:
        return None
    return mod.Plan(device, fwd, rows, has_kl, fallback)
