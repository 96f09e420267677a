"""Reading the LRA checkpoints (``last.pt``, ``best.pt``, exported weights) without running code.

A checkpoint holds tensors and plain Python values only (dicts, lists, tuples, numbers, strings,
None): the RNG states of ``last.pt`` are stored as tensors and tuples (train.py), so every file a
run writes loads with ``torch.load(weights_only=True)``. A file that needs anything else -- a
pickled function or class, an object the unpickler would have to call -- could run code on load
(a checkpoint downloaded from elsewhere, say) and is refused with a ValueError naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path

__all__ = ["load_checkpoint"]


def load_checkpoint(path, what: str = "checkpoint"):
    """``torch.load(path, map_location="cpu", weights_only=True)``; a file that holds more than
    tensors and plain values raises ValueError (``what`` names the argument it came from)."""
    import torch

    try:
        return torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), "")
        raise ValueError(
            f"{what} {path}: refused, it holds more than tensors and plain values"
            + (f" ({detail})" if detail else "")
            + "; loading it could run code. Load only checkpoints written by sparseflash lra train (or "
              "weights.py), or re-save a file you trust as a dict of tensors") from None
