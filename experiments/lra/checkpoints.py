"""Reading the LRA checkpoints (``last.pt``, ``best.pt``, exported weights) without running code.

A checkpoint holds tensors and plain Python values only (dicts, lists, tuples, numbers, strings,
None): the RNG states of ``last.pt`` are stored as tensors and tuples (train.py), so every file a
run writes loads with ``torch.load(weights_only=True)``. Older checkpoints hold the NumPy RNG
state as an array: the globals such an array needs, each named exactly in `NUMPY_ARRAY_GLOBALS`,
are let through for them, and nothing else of NumPy. A file that needs anything else -- a pickled
function or class, an object the unpickler would have to call -- could run code on load (a
checkpoint downloaded from elsewhere, say) and is refused with a ValueError naming the file.

A file that is no checkpoint at all -- empty, truncated (what a crash or a full disk during a save
or a copy leaves), random bytes -- is refused with a ValueError that names the file and says it is
damaged; so is a checkpoint that lacks what the caller reads from it (``keys``: a bare tensor, a
dict without ``model``). A path that cannot be opened keeps the system's own error (OSError).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

__all__ = ["load_checkpoint", "model_weights", "NUMPY_ARRAY_GLOBALS"]

# what the NumPy RNG state of an older checkpoint (a uint32 array) needs to unpickle, name by name:
# NumPy's array constructor, its array and dtype classes, and the uint32 dtype's class; no function
# that does anything but build data, and no other name of these modules
NUMPY_ARRAY_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
                       "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType")

# what weights_only says when a file names a function or class it does not allow (else the pickle
# stream itself is malformed: a damaged file)
_NEEDS_CODE = re.compile(r"GLOBAL|allowlisted|unrecognized function")

_DAMAGED = ("; a crash or a full disk during a save or a copy leaves such a file: use another checkpoint "
            "(a run's last.pt or best.pt), or copy the file again")


def _unsafe_globals(path) -> list[str] | None:
    """The globals a torch.save (zip) file names beyond weights_only's own, or None when the file
    cannot be read that way (damaged, or the legacy format)."""
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - an unreadable file: the caller says so
        return None


def _numpy_array_objects(names) -> list:
    """(object, name) pairs for weights_only's allow-list: each of ``names`` (all in
    `NUMPY_ARRAY_GLOBALS`) bound to exactly that name, plus the uint32 dtype's class, which the
    unpickler checks when it restores a dtype, though no file names it."""
    import importlib

    import numpy as np

    pairs = [(getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2]), name)
             for name in names if name != "numpy.dtypes.UInt32DType"]
    return pairs + [(type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType")]


def _reason(e: BaseException) -> str:
    """The line of an error that says what went wrong (not torch's advice around it), shortened."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = next((ln for ln in lines if _NEEDS_CODE.search(ln) or ln.startswith("Unsupported")), None)
    said = said or (f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__)
    said = said.split(". ")[0].rstrip(".")
    return said if len(said) <= 160 else said[:157] + "..."


def _damaged(what: str, path, e: BaseException | None) -> ValueError:
    how = "is empty" if e is None else f"is damaged or truncated, not a whole checkpoint ({_reason(e)})"
    return ValueError(f"{what} {path}: the file {how}{_DAMAGED}")


def _kind(obj) -> str:
    if isinstance(obj, dict):
        return f"a dict of {sorted(map(str, obj))[:6]}"
    return f"a {type(obj).__name__}"


def load_checkpoint(path, what: str = "checkpoint", *, keys=()):
    """``torch.load(path, map_location="cpu", weights_only=True)``; a file that holds more than
    tensors and plain values, a damaged file, or (with ``keys``) one that is not a dict holding
    every one of ``keys`` raises ValueError (``what`` names the argument it came from)."""
    import torch

    path = Path(path)
    with open(path, "rb") as f:  # missing, unreadable, a folder: the system's error names the path
        if not f.read(1):
            raise _damaged(what, path, None)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        obj = _load_refused(path, what, e)
    except Exception as e:  # noqa: BLE001 - torch's reader fails in many ways on a damaged file
        raise _damaged(what, path, e) from None
    if keys and not (isinstance(obj, dict) and all(k in obj for k in keys)):
        raise ValueError(f"{what} {path}: holds {_kind(obj)}, not a checkpoint of sparseflash lra train (a dict with "
                         f"{', '.join(map(repr, keys))}); give a checkpoint that sparseflash lra train wrote")
    return obj


def _load_refused(path, what: str, e: pickle.UnpicklingError):
    """A file weights_only refused: a checkpoint of an older version (its NumPy array loaded with
    `NUMPY_ARRAY_GLOBALS`), else a ValueError that says whether it needs code or is damaged."""
    import torch

    unsafe = _unsafe_globals(path)
    if unsafe and set(unsafe) <= set(NUMPY_ARRAY_GLOBALS):
        try:
            with torch.serialization.safe_globals(_numpy_array_objects(unsafe)):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as again:
            e = again
        except Exception as again:  # noqa: BLE001
            raise _damaged(what, path, again) from None
    if unsafe or _NEEDS_CODE.search(str(e)):
        named = f"names {', '.join(sorted(unsafe)[:3])}" if unsafe else _reason(e)
        raise ValueError(
            f"{what} {path}: refused, it holds more than tensors and plain values ({named}); loading it could run "
            "code. Load only checkpoints written by sparseflash lra train (or weights.py), or re-save a file you "
            "trust as a dict of tensors") from None
    raise _damaged(what, path, e) from None


def model_weights(obj, path, what: str = "checkpoint") -> dict:
    """The model's tensors in a loaded file: a checkpoint's ``model``, or the file itself when it
    is a dict of tensors (a bare state dict); else ValueError naming ``what`` and ``path``."""
    import torch

    weights = obj.get("model", obj) if isinstance(obj, dict) else obj
    if not isinstance(weights, dict) or not weights or not all(torch.is_tensor(v) for v in weights.values()):
        raise ValueError(f"{what} {path}: holds {_kind(obj)}, not model weights (a checkpoint with 'model', or a "
                         f"dict of tensors)")
    return weights
