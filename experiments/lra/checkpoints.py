"""Reading the LRA checkpoints (``last.pt``, ``best.pt``, exported weights) without running code.

A checkpoint holds tensors and plain Python values only (dicts, lists, tuples, numbers, strings,
None): the RNG states of ``last.pt`` are stored as tensors and tuples (train.py), so every file a
run writes loads with ``torch.load(weights_only=True)``. Older checkpoints hold the NumPy RNG
state as an array: NumPy's array and dtype classes, data only, are let through for them. A file
that needs anything else -- a pickled function or class, an object the unpickler would have to
call -- could run code on load (a checkpoint downloaded from elsewhere, say) and is refused with
a ValueError naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path

__all__ = ["load_checkpoint"]

# what a NumPy array needs to unpickle (older checkpoints stored the NumPy RNG state as one): data,
# no code; anything else stays refused
_NUMPY_DATA = {"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
               "numpy.dtype"}


def _numpy_data_globals(path) -> list:
    """The NumPy array / dtype classes a file needs beyond weights_only's defaults, when that is all
    it needs; else []."""
    import importlib

    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - an unreadable file: the caller's refusal stands
        return []
    if not names or not all(n in _NUMPY_DATA or n.startswith("numpy.dtypes.") for n in names):
        return []
    objs = []
    for name in names:
        module, _, attr = name.rpartition(".")
        objs.append(getattr(importlib.import_module(module), attr))
    import numpy as np  # a dtype's own class (UInt32DType ...) is built too, though not listed above

    dtypes = getattr(np, "dtypes", None)
    objs += [c for n in getattr(dtypes, "__all__", ()) if isinstance(c := getattr(dtypes, n), type)
             and issubclass(c, np.dtype)]
    return objs


def load_checkpoint(path, what: str = "checkpoint"):
    """``torch.load(path, map_location="cpu", weights_only=True)``; a file that holds more than
    tensors and plain values raises ValueError (``what`` names the argument it came from)."""
    import torch

    try:
        return torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        numpy_data = _numpy_data_globals(path)
        if numpy_data:  # a checkpoint of an older version: its NumPy RNG state is an array, data only
            with torch.serialization.safe_globals(numpy_data):
                return torch.load(Path(path), map_location="cpu", weights_only=True)
        first = str(e).strip().splitlines()
        detail = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), "")
        raise ValueError(
            f"{what} {path}: refused, it holds more than tensors and plain values"
            + (f" ({detail})" if detail else "")
            + "; loading it could run code. Load only checkpoints written by sparseflash lra train (or "
              "weights.py), or re-save a file you trust as a dict of tensors") from None
