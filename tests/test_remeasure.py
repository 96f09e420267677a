"""experiments/bench/remeasure.sh, the one GPU call behind today's results, run on a CPU with a budget
that leaves room for one small stage only: the stages that do not fit are skipped, the one that runs
writes its bench files stamped with SPARSEFLASH_COMMIT and the kernels it measured, and the summary
names every stage. About 15 s on 2 cores (one tiny `bench seqlen` through the reference)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "bench" / "remeasure.sh"


def _run(out, **env):
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_remeasure_runs_what_fits_and_stamps_the_commit(tmp_path):
    tiny = ("--device cpu --backend reference --seq-len 128 --head-dim 32 --heads 1 --tokens 128 --mode fwd "
            "--warmup-ms 1 --rep-ms 1 --providers sparseflash sparseflash-dense --no-plot")
    res = _run(tmp_path, SPARSEFLASH_COMMIT="c0ffee1", BUDGET_S="60", RESERVE_S="0", TINY_ARGS=tiny)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "remeasure.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    # kernel-check needs 120 s and the density sweep 100 s plus 50 kept for seqlen: both skipped;
    # seqlen runs; its GPU-time twin needs 75 s more than are left
    assert status == {"kernel-check": "skipped", "sparsity": "skipped", "seqlen": "ok", "seqlen-gpu-time": "skipped"}
    assert summary["commit"] == "c0ffee1"
    meta = json.loads((tmp_path / "seqlen" / "seqlen.json").read_text())["meta"]
    assert meta["commit"] == "c0ffee1" and meta["kernels"].startswith("portable (")  # no sm_90 GPU here
    rows = [s["rows"] for s in summary["stages"] if s["stage"] == "seqlen"][0]
    assert rows == len(json.loads((tmp_path / "seqlen" / "seqlen.json").read_text())["rows"]) > 0
    assert "seqlen-gpu-time  skipped" in res.stdout.splitlines()[-1]  # the table is printed last


def test_remeasure_needs_the_commit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPARSEFLASH_COMMIT"}
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "set SPARSEFLASH_COMMIT" in res.stderr
