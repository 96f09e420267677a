"""Shared by the two conformance runners: a pytest plugin that records every case's outcome, and
the writer of the per-case and per-group CSV files plus a JSON header (GPU, versions, commit)."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import time
from collections import defaultdict


class Recorder:
    """Pytest plugin: one row per test id with outcome, seconds and the first line of the failure
    or skip message. ``group_of(nodeid)`` names the row's group (a family, or a test function)."""

    def __init__(self, group_of, stream: str | None = None):
        self.group_of = group_of
        self.rows: dict[str, dict] = {}
        self.stream = stream  # a JSON-lines file that gets each finished case at once (survives a kill)

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.stream and nodeid in self.rows:
            with open(self.stream, "a") as f:
                f.write(json.dumps(self.rows[nodeid]) + "\n")

    def pytest_runtest_logreport(self, report):
        row = self.rows.setdefault(report.nodeid, dict(id=report.nodeid, group=self.group_of(report.nodeid),
                                                       outcome="passed", seconds=0.0, message=""))
        row["seconds"] += report.duration
        if report.skipped:
            row["outcome"] = "skipped"
            lr = report.longrepr
            row["message"] = (lr[2] if isinstance(lr, tuple) else str(lr)).splitlines()[0][:300]
        elif report.failed:
            row["outcome"] = "failed" if report.when == "call" else "error"
            row["message"] = _first_error_line(str(report.longrepr))


def _first_error_line(text: str) -> str:
    """The line pytest marks with 'E' first (the exception), else the last line."""
    for ln in text.splitlines():
        if ln.startswith("E "):
            return ln[1:].strip()[:300]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def header() -> dict:
    import torch
    import triton

    from sparseflash.experiments.bench.results import git_commit

    # (SPARSEFLASH_COMMIT first: a device's copy of the tree has no trustworthy git history)
    commit = git_commit()
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                commit=commit, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write(out_dir: str, name: str, rows: list[dict], extra: dict, first_messages: int = 3) -> list[dict]:
    """Writes ``{name}_cases.csv`` (every case) and ``{name}_summary.csv`` (per group: counts, the
    distinct skip reasons, the first failure messages) and ``{name}.json`` (header, totals); returns
    the summary rows."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}_cases.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["group", "id", "outcome", "seconds", "message"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "seconds": f"{r['seconds']:.3f}"})
    groups: dict[str, dict] = defaultdict(lambda: dict(passed=0, failed=0, error=0, skipped=0, seconds=0.0,
                                                       skip_reasons=set(), failures=[]))
    for r in rows:
        g = groups[r["group"]]
        g[r["outcome"]] += 1
        g["seconds"] += r["seconds"]
        if r["outcome"] == "skipped":
            g["skip_reasons"].add(r["message"])
        elif r["outcome"] in ("failed", "error") and len(g["failures"]) < first_messages:
            g["failures"].append(f"{r['id'].split('[')[-1].rstrip(']')}: {r['message']}")
    summary = [dict(group=k, passed=g["passed"], failed=g["failed"] + g["error"], skipped=g["skipped"],
                    seconds=round(g["seconds"], 1), skip_reasons=" | ".join(sorted(g["skip_reasons"])),
                    first_failures=" || ".join(g["failures"])) for k, g in groups.items()]
    with open(os.path.join(out_dir, f"{name}_summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]) if summary else ["group"])
        w.writeheader()
        w.writerows(summary)
    totals = {k: sum(s[k] for s in summary) for k in ("passed", "failed", "skipped")}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({**header(), **extra, **totals}, f, indent=1)
    return summary


def print_table(summary: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'group':<44}{'passed':>8}{'failed':>8}{'skipped':>8}{'s':>8}")
    for s in summary:
        print(f"{s['group'][:43]:<44}{s['passed']:>8}{s['failed']:>8}{s['skipped']:>8}{s['seconds']:>8.0f}")
    for s in summary:
        if s["skip_reasons"]:
            print(f"  {s['group']} skipped: {s['skip_reasons'][:200]}")
        if s["first_failures"]:
            print(f"  {s['group']} failed: {s['first_failures'][:300]}")


def run_shards(module: str, out: str, jobs: int, timeout_s: float, args_of, env_of=lambda i: {}):
    """Runs ``python -m module *args_of(i, stream)`` in ``jobs`` processes at once (each a shard of
    the cases, streaming finished cases to its JSON-lines file); kills what is left at ``timeout_s``.
    Returns (rows, timed_out, exit codes); the log of a process that crashed is printed."""
    import glob
    import sys

    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "shard-*.jsonl")):
        os.remove(old)
    t0 = time.time()
    procs = []
    for i in range(jobs):
        stream = os.path.join(out, f"shard-{i}.jsonl")
        log = open(os.path.join(out, f"shard-{i}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", module, *args_of(i, stream)],
                                       env=dict(os.environ, **env_of(i)), stdout=log, stderr=subprocess.STDOUT), log))
    timed_out = False
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        log.close()
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "shard-*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(ln) for ln in f if ln.strip()]
        os.remove(path)
    codes = [proc.returncode for proc, _ in procs]
    for i, c in enumerate(codes):
        log = os.path.join(out, f"shard-{i}.log")
        if c not in (0, 1, 5, -9):  # 1: a case failed, 5: no case in this shard, -9: stopped at the timeout
            with open(log) as f:
                print(f"process {i} exited with {c}:", *f.readlines()[-8:], sep="\n  ")
        else:
            os.remove(log)
    return rows, timed_out, codes
