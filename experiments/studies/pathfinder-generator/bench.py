"""Pathfinder generator throughput: images/s of ``write_pathfinder`` (PNG + metadata, the real
writer) per resolution, worker count and method.

    python experiments/studies/pathfinder-generator/bench.py --workers 2            # what bench_2cores.* hold
    python experiments/studies/pathfinder-generator/bench.py --workers 16 --num 32=50000 64=10000 128=20000 256=20000 \\
        --tag 16cores

One row per (method, resolution, workers): wall seconds, images/s, and CPU seconds of this process
and its workers together (CPU ms per image is the per-core cost, robust on a shared machine where
wall time is not), with host, versions and commit. Images go to a temporary folder (deleted)
unless --keep DIR. Writes bench_<tag>.json and .csv next to this file (or under --out).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_NUM = {32: 5000, 64: 500, 128: 1000, 256: 2000}


def _cpu_seconds() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _host() -> dict:
    import numpy
    import PIL

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from sparseflash.experiments.bench.results import git_commit

    commit = git_commit(HERE)
    return {"host": platform.node(), "cpu": model, "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "numpy": numpy.__version__, "pillow": PIL.__version__,
            "commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv=None) -> int:
    from sparseflash.experiments.lra.data.pathfinder import METHODS, write_pathfinder

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resolutions", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    ap.add_argument("--num", nargs="*", default=[], help="RES=N pairs overriding the images per run "
                                                          f"(default {DEFAULT_NUM})")
    ap.add_argument("--method", choices=METHODS, nargs="+", default=["batched"])
    ap.add_argument("--difficulty", default="hard", choices=("easy", "medium", "hard"))
    ap.add_argument("--tag", default=None, help="output name bench_<tag> (default: <workers>cores)")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--keep", default=None, help="write the images here instead of a temporary folder")
    args = ap.parse_args(argv)
    num = dict(DEFAULT_NUM)
    for item in args.num:
        res, _, n = item.partition("=")
        if not (res.isdigit() and n.isdigit() and int(res) in DEFAULT_NUM and int(n) >= 1):
            raise SystemExit(f"--num expects RES=N with RES in {tuple(DEFAULT_NUM)} and N >= 1, got {item!r}")
        num[int(res)] = int(n)
    for r in args.resolutions:
        if r not in DEFAULT_NUM:
            raise SystemExit(f"--resolutions must be among {tuple(DEFAULT_NUM)}, got {r}")
    host = _host()
    rows = []
    for method in args.method:
        for res in args.resolutions:
            for w in args.workers:
                root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pfbench"))
                c0, t0 = _cpu_seconds(), time.perf_counter()
                write_pathfinder(root / f"{method}-w{w}", res, args.difficulty, num[res], seed=0, workers=w,
                                 overwrite=True, show_progress=False, method=method)
                wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
                row = {"method": method, "resolution": res, "difficulty": args.difficulty, "workers": w,
                       "num": num[res], "seconds": round(wall, 2), "images_per_s": round(num[res] / wall, 1),
                       "cpu_s": round(cpu, 2), "cpu_ms_per_image": round(1000 * cpu / num[res], 2),
                       "images_per_cpu_s": round(num[res] / cpu, 1), **host}
                rows.append(row)
                print(f"{method:9s} {res:3d} px {args.difficulty} workers={w:2d}: {num[res]} images in {wall:.1f}s = "
                      f"{row['images_per_s']} images/s ({row['cpu_ms_per_image']} CPU ms/image)", flush=True)
    tag = args.tag or "_".join(f"{w}" for w in args.workers) + "cores"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(rows, indent=1))
    with open(out / f"bench_{tag}.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
