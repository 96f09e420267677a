"""The project's flash-attn conformance test (tests/test_flash_attn_conformance.py) as one command,
with a summary per family that can be committed (experiments/results/conformance/).

    python -m sparseflash.experiments.studies.flash_attn_upstream.conformance OUT_DIR [--n 64] [-- PYTEST_ARGS]

On a GPU it runs a seeded sample of ``--n`` cases of every family (output, qkvpacked, varlen, causal,
varlen_causal with paged k/v, splitkv, kvcache; dropout is not among them: its bits differ from
flash-attn's by design); on a CPU, the test's small CPU lane under the Triton interpreter. Writes
``conformance_cases.csv`` (every case: outcome, seconds, first message line),
``conformance_summary.csv`` (per family: passed / failed / skipped, the skip reasons, the first
failures) and ``conformance.json`` (GPU, versions, commit, totals), and prints the table last.
Exit status: pytest's (0 when every case passed or was skipped).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from sparseflash.experiments.studies.flash_attn_upstream import _summary

TEST_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "test_flash_attn_conformance.py")


def family_of(nodeid: str) -> str:
    """The family is the first part of a case id (``test_x[output-float16-...]`` -> output)."""
    m = re.search(r"\[([a-z_]+)-", nodeid)
    return m.group(1) if m else nodeid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the CSV/JSON files")
    p.add_argument("--n", type=int, default=64, help="cases per family on a GPU (SPARSEFLASH_CONFORMANCE_N)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n must be a positive number of cases per family, got {a.n}")
    os.environ["SPARSEFLASH_CONFORMANCE_N"] = str(a.n)  # read when the test module is imported
    import pytest

    rec = _summary.Recorder(family_of)
    t0 = time.time()
    rc = pytest.main([os.path.normpath(TEST_FILE), "-q", "-p", "no:cacheprovider", *a.pytest_args], plugins=[rec])
    summary = _summary.write(a.out, "conformance", list(rec.rows.values()),
                             dict(cases_per_family=a.n, wall_s=round(time.time() - t0, 1)))
    _summary.print_table(summary, f"flash-attn conformance ({len(rec.rows)} cases, {time.time() - t0:.0f} s)")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
