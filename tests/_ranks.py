"""Spawned gloo ranks for the CPU tests of context parallelism (test_distributed, test_cp_train): each
rank joins the group and runs the test's check function; a rank that fails leaves its traceback,
which fails the test (a spawned process's exception alone says only that it died)."""

import datetime
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, check, world, init, out_dir):
    try:
        # a bounded timeout: a collective that never matches fails the test instead of hanging it
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=180))
        torch.set_num_threads(1)
        check(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(check, world: int, tmp_path) -> None:
    """``check(rank, world)`` in ``world`` spawned ranks of one gloo group (``check``: a module-level
    function, which the ranks import); fails the calling test with the failing ranks' tracebacks."""
    init = f"file://{tempfile.mktemp(dir=tmp_path)}"
    try:
        mp.spawn(_rank, args=(check, world, init, str(tmp_path)), nprocs=world, join=True)
    except Exception:
        errs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".err"))
        pytest.fail("ranks failed:\n" + "\n".join(open(os.path.join(tmp_path, p)).read() for p in errs))
