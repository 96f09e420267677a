"""Ranks in fresh processes for the tests of context parallelism (gloo on the CPU: test_distributed, test_cp_train;
NCCL on two GPUs: test_distributed_gpu): each rank joins the group and runs the test's check function;
a rank that fails leaves its traceback, which fails the test (a spawned process's exception alone says
only that it died)."""

import datetime
import multiprocessing
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, check, world, init, out_dir, backend):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # a bounded timeout: a collective that never matches fails the test instead of hanging it
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=180),
                                **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
        torch.set_num_threads(1)
        check(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _start_method(backend: str) -> str:
    """gloo ranks fork from one forkserver per test session, which imports torch and sparseflash once:
    a spawned rank re-imports them itself (3-5 s a rank on a 2-core CPU machine, most of a CPU test's
    time). The server starts at the session's first gloo call and its ranks see the environment of that
    moment (os.environ set later, e.g. by monkeypatch, does not reach them). NCCL ranks are spawned (a fresh
    process each, as the GPU tests always ran)."""
    if backend == "nccl" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "sparseflash", "sparseflash.distributed", "tests._ranks"])
    return "forkserver"


def run_ranks(check, world: int, tmp_path, backend: str = "gloo") -> None:
    """``check(rank, world)`` in ``world`` spawned ranks of one ``backend`` group (``check``: a module-level
    function, which the ranks import; with "nccl" rank r uses GPU r); fails the calling test with the
    failing ranks' tracebacks."""
    init = f"file://{tempfile.mktemp(dir=tmp_path)}"
    try:
        mp.start_processes(_rank, args=(check, world, init, str(tmp_path), backend), nprocs=world, join=True,
                           start_method=_start_method(backend))
    except Exception:
        errs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".err"))
        pytest.fail("ranks failed:\n" + "\n".join(open(os.path.join(tmp_path, p)).read() for p in errs))
