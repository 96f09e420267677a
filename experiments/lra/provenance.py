"""Which code made a result: the commit every LRA run record carries.

``code_commit()`` is ``SPARSEFLASH_COMMIT`` when that is set: a tree sent to a GPU machine is a
snapshot whose copied ``.git`` (if any) still names an older HEAD, so the scripts that send it set
the commit the snapshot was made from (``experiments/gpu_session.sh``, the campaigns' ``COMMIT``
file). Otherwise it is the checkout's HEAD, with ``+dirty`` appended when tracked or untracked code
(``*.py``, ``*.sh``, ``*.cpp``; ignored files never count) differs from HEAD, ``+unchecked`` when git
cannot be run to tell, and ``unknown`` outside a checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["ROOT", "CODE", "code_commit"]

ROOT = Path(__file__).resolve().parents[2]
CODE = ("*.py", "*.sh", "*.cpp")  # git pathspecs: '*' also matches '/', so these cover every folder


def code_commit(root: Path | str | None = None) -> str:
    """The commit of the code that runs (see the module docstring)."""
    if os.environ.get("SPARSEFLASH_COMMIT"):
        return os.environ["SPARSEFLASH_COMMIT"]
    root = Path(root) if root is not None else ROOT
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0:
            return "unknown"  # not a checkout (or one without commits)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *CODE],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        from sparseflash.experiments.bench.results import git_commit

        commit = git_commit(root / "x")
        return commit if commit == "unknown" else commit + "+unchecked"
    commit = head.stdout.strip()
    if status.returncode != 0:
        return commit + "+unchecked"
    return commit + "+dirty" if status.stdout.strip() else commit
