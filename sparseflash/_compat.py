"""Version combinations that are known not to work, with an error that names them.

The Triton interpreter (``TRITON_INTERPRET=1``: the kernels on CPU tensors, as the CPU tests run
them) of triton 3.6 and older converts one-element NumPy arrays to Python ints with ``int(array)``
when a loop bound is a tensor (``tensor.__index__``). NumPy 2.4 made that conversion an error
(deprecated since 1.25), so every kernel launch fails inside the interpreter with
``InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python scalars')``.
Triton fixed it after 3.6 (triton-lang/triton#9171: ``int(array.squeeze())``); checked here: triton
3.6.0 + NumPy 2.4.6 fails, triton 3.6.0 + NumPy 2.3.5 and triton 3.8 / 3.9 + NumPy 2.4.6 pass.
Compiled kernels on a GPU are not affected. pyproject cannot state "numpy < 2.4 only with
triton < 3.7" (a requirement cannot depend on another package's version), so the interpreter path
checks it (`check_interpreter_versions`) and the README's set-up notes say it.
"""

from __future__ import annotations

import functools
import re

__all__ = ["interpreter_version_problem", "check_interpreter_versions"]

# The first triton release whose interpreter works with NumPy >= 2.4 (the fix is after 3.6.0).
TRITON_FIXED = (3, 7)
NUMPY_BREAKS = (2, 4)


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def interpreter_version_problem(triton_version: str, numpy_version: str) -> str | None:
    """None where the Triton interpreter works with these versions, else what is wrong and the fix."""
    if _version(triton_version) < TRITON_FIXED and _version(numpy_version) >= NUMPY_BREAKS:
        return (f"the Triton interpreter of triton {triton_version} fails with numpy {numpy_version} "
                f"(int() of a one-element array, an error since numpy 2.4): install 'numpy<2.4' "
                f"or triton >= {TRITON_FIXED[0]}.{TRITON_FIXED[1]}, or use backend='reference' on CPU")
    return None


@functools.lru_cache(maxsize=None)
def check_interpreter_versions() -> None:
    """Raise RuntimeError (`interpreter_version_problem`) for the installed triton and numpy."""
    import numpy
    import triton

    problem = interpreter_version_problem(triton.__version__, numpy.__version__)
    if problem is not None:
        raise RuntimeError(problem)
