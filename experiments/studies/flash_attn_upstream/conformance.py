"""The project's flash-attn conformance test (tests/test_flash_attn_conformance.py) as one command,
with a summary per family that can be committed (experiments/results/conformance/).

    python -m sparseflash.experiments.studies.flash_attn_upstream.conformance OUT_DIR [--n 24] [--jobs 12]

On a GPU it runs a seeded sample of ``--n`` cases of every family (output, qkvpacked, varlen, causal,
varlen_causal with paged k/v, splitkv, kvcache; dropout is not among them: its bits differ from
flash-attn's by design) in ``--jobs`` processes sharing the GPU (compiling each case's kernels is
what takes the time, about 7 s a case on an H200 host; 12 processes ran 194 cases in 225 s, so the processes spread it over the CPU
cores); on a CPU, the test's small CPU lane under the Triton interpreter in one process. Cases not
finished by ``--timeout-s`` are counted as not run. Writes ``conformance_cases.csv`` (every case:
outcome, seconds, first message line), ``conformance_summary.csv`` (per family: passed / failed /
skipped, the skip reasons, the first failures) and ``conformance.json`` (GPU, versions, commit,
totals), and prints the table last. Exit status 0 when every case ran and passed or was skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from sparseflash.experiments.studies.flash_attn_upstream import _summary

TEST_FILE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests",
                                          "test_flash_attn_conformance.py"))


def family_of(nodeid: str) -> str:
    """The family is the first part of a case id (``test_x[output-float16-...]`` -> output)."""
    m = re.search(r"\[([a-z_]+)-", nodeid)
    return m.group(1) if m else nodeid


def _shard(stream: str, pytest_args: list[str]) -> int:
    """One process: pytest over this shard's cases, each finished case appended to ``stream``."""
    import pytest

    return int(pytest.main([TEST_FILE, "-q", "-p", "no:cacheprovider", *pytest_args],
                           plugins=[_summary.Recorder(family_of, stream)]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the CSV/JSON files")
    p.add_argument("--n", type=int, default=24, help="cases per family on a GPU (SPARSEFLASH_CONFORMANCE_N)")
    p.add_argument("--jobs", type=int, default=None, help="processes (default: 12 on a GPU, 1 on a CPU)")
    p.add_argument("--timeout-s", type=float, default=225.0, help="stop unfinished processes after this long")
    p.add_argument("--shard-stream", help=argparse.SUPPRESS)  # internal: run one shard into this file
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = p.parse_args(argv)
    if a.shard_stream:
        return _shard(a.shard_stream, a.pytest_args)
    if a.n < 1:
        p.error(f"--n must be a positive number of cases per family, got {a.n}")
    import torch

    jobs = a.jobs if a.jobs is not None else (12 if torch.cuda.is_available() else 1)
    if jobs < 1:
        p.error(f"--jobs must be a positive number of processes, got {jobs}")
    t0 = time.time()
    rows, timed_out, codes = _summary.run_shards(
        __spec__.name, a.out, jobs, a.timeout_s,
        lambda i, stream: ["--shard-stream", stream, a.out, *(["--", *a.pytest_args] if a.pytest_args else [])],
        lambda i: dict(SPARSEFLASH_CONFORMANCE_N=str(a.n), SPARSEFLASH_CONFORMANCE_SHARD=f"{i}/{jobs}"))
    wall = time.time() - t0
    summary = _summary.write(a.out, "conformance", rows, dict(cases_per_family=a.n, jobs=jobs, wall_s=round(wall, 1),
                                                              timed_out=timed_out, exit_codes=codes))
    _summary.print_table(summary, f"flash-attn conformance: {len(rows)} cases in {wall:.0f} s, {jobs} processes"
                         + (" (stopped at --timeout-s: the rest not run)" if timed_out else ""))
    ok = not timed_out and all(c == 0 for c in codes) and all(s["failed"] == 0 for s in summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
