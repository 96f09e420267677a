"""Ordered, deterministic fan-out of generator chunks over worker processes.

Every chunk carries its own seed (derived from the user seed and the chunk's index), so the bytes
written never depend on how many workers ran or in which order they finished; results come back
in chunk order. Workers are forked where the platform allows it (the generators import neither
torch nor triton, and forking skips re-importing them), spawned elsewhere.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from sparseflash._progress import Progress


def default_workers() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def check_workers(workers) -> int:
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    return workers


def run_ordered(fn, tasks, workers: int, desc: str, total: int | None = None, weight=lambda result: 1,
                show_progress: bool = True):
    """Yield ``fn(task)`` for every task, in task order, computed on ``workers`` processes.

    ``weight(result)`` is how far one result moves the progress bar (e.g. images in a chunk).
    """
    tasks = list(tasks)
    with Progress(total if total is not None else len(tasks), desc, disable=not show_progress) as bar:
        if workers == 1 or len(tasks) <= 1:
            for t in tasks:
                r = fn(t)
                bar.update(weight(r))
                yield r
            return
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with mp.get_context(method).Pool(min(workers, len(tasks))) as pool:
            for r in pool.imap(fn, tasks, chunksize=1):
                bar.update(weight(r))
                yield r
