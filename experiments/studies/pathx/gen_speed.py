"""Pathfinder generation speed per resolution, and the trimmed sequence length of its images.

    PYTHONPATH=. python -m sparseflash.experiments.studies.pathx.gen_speed [--num 64=300 128=300 256=600]
        [--slowdown 1.4] [--cores 16] [--count 200000] [--profile 256]

For each resolution (release fidelity, hard, batched method): the per-process tables are built
(timed apart: forked workers inherit them), then ``write_pathfinder`` writes ``num`` images with
one worker (PNG and metadata included, as in a real run) into a temporary folder. Reported per
image: wall and CPU seconds of this process (BLAS/OpenMP threads pinned to 1), and the projection
for ``count`` images on ``cores`` processes each ``slowdown`` times slower than this machine's
(perfect scaling assumed; the tables' build added once), and a second projection that scales the
GPU host's measured 64 px rate (``--host-ms64``) by each resolution's cost relative to 64 px here
(robust to this shared machine's load, which moves all resolutions alike). Then, from the PNGs written: the share of
drawn pixels (gray level > 0: what ``model.kept_pixels`` keeps) and the packed width of a batch
(``--batch``: 32, and 8 as path256's config trains; its widest image's drawn count rounded up to
128, ``model.packed_width``), mean and p95 over 4000 batches drawn at random (without replacement
within a batch) from the images made.
``--profile R`` also runs cProfile over the writing at resolution R and prints the top entries.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_v] = "1"  # before NumPy loads: one thread per process, as each generator worker runs

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from sparseflash.experiments.lra.data import pathfinder as pf  # noqa: E402

BLOCK = 128  # the block size the packed width is rounded up to


def _tables(p):
    t = time.perf_counter()
    for m in p.margins:
        pf._batched(pf._geometry(p, int(m)))
    return time.perf_counter() - t


def _write(out, res, num):
    pf.write_pathfinder(out, res, "hard", num, seed=0, workers=1, per_batch=1000, show_progress=False,
                        fidelity="release")


def measure(res: int, num: int, profile: bool = False, batches=(32,)) -> dict:
    p = pf.params_for(res, "hard", "release")
    build = _tables(p)
    with tempfile.TemporaryDirectory() as tmp:
        prof = cProfile.Profile() if profile else None
        w0, c0 = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        _write(tmp, res, num)
        if prof:
            prof.disable()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        imgs = sorted(Path(tmp).rglob("*.png"))
        drawn = np.array([np.count_nonzero(np.asarray(Image.open(f))) for f in imgs])
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        print(s.getvalue())
    out = {"res": res, "num": int(drawn.size), "build_s": build, "wall_s": wall / num, "cpu_s": cpu / num,
           "drawn_share": float(drawn.mean() / (res * res)), "drawn_p95": float(np.percentile(drawn, 95))}
    for b in batches:
        rng = np.random.default_rng(0)
        widest = np.array([drawn[rng.choice(drawn.size, b, replace=False)].max() for _ in range(4000)])
        width = np.minimum(res * res, -(-widest // BLOCK) * BLOCK)
        out[b] = (float(width.mean()), float(np.percentile(width, 95)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", nargs="+", default=["64=300", "128=300", "256=600"], help="RES=IMAGES ...")
    ap.add_argument("--count", type=int, default=200_000, help="images projected")
    ap.add_argument("--cores", type=int, default=16, help="worker processes projected")
    ap.add_argument("--slowdown", type=float, default=1.4, help="per-process slowdown of the projected cores")
    ap.add_argument("--host-ms64", type=float, default=448 * 14 / 200_000 * 1000,
                    help="per-process ms per 64 px image measured on the GPU host (default: 200K in 448 s on 14 "
                         "workers); with 64 px measured here, also projects each resolution by its cost relative to 64 px")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 8],
                    help="batch sizes of the trimmed-length estimate (path256's config trains with 8)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the resolutions (interleaved); each resolution reports its fastest")
    ap.add_argument("--profile", type=int, default=None, help="cProfile the writing at this resolution")
    a = ap.parse_args(argv)
    specs = [tuple(int(v) for v in spec.split("=")) for spec in a.num]
    runs: dict[int, list] = {}
    for rep in range(a.repeat):
        for res, num in specs:
            runs.setdefault(res, []).append(measure(res, num, a.profile == res and rep == 0, a.batch))
    # the same seed every round, so the images (and drawn counts) are the same: only the time differs
    rows = [{**min(runs[res], key=lambda r: r["wall_s"]), "build_s": runs[res][0]["build_s"]} for res, _ in specs]
    if a.repeat > 1:
        print("s/image wall per round: " + "; ".join(f"{res} px " + ", ".join(f"{r['wall_s']:.4f}" for r in runs[res])
                                                      for res, _ in specs))
    print(f"release fidelity, hard; one process here; projection: {a.count} images on {a.cores} processes "
          f"{a.slowdown}x slower")
    ref = {r["res"]: r for r in rows}.get(64)
    print("| px | images | tables s | s/image wall | s/image CPU | projected min | by 64 px host | drawn share "
          "| drawn p95 | " + " | ".join(f"trimmed, batch {b}: mean / p95" for b in a.batch) + " | of |")
    print("|---:" * (10 + len(a.batch)) + "|")
    for r in rows:
        proj = (r["build_s"] + r["wall_s"] * a.count / a.cores) * a.slowdown / 60
        # the GPU host's measured 64 px rate, scaled by this resolution's cost relative to 64 px here
        cal = "" if ref is None else f"{r['wall_s'] / ref['wall_s'] * a.host_ms64 / 1000 * a.count / a.cores / 60:.1f}"
        print(f"| {r['res']} | {r['num']} | {r['build_s']:.1f} | {r['wall_s']:.4f} | {r['cpu_s']:.4f} | {proj:.1f} | {cal} "
              f"| {r['drawn_share']:.3f} | {r['drawn_p95']:.0f} | "
              + " | ".join(f"{r[b][0]:.0f} / {r[b][1]:.0f}" for b in a.batch) + f" | {r['res'] ** 2} |")


if __name__ == "__main__":
    main()
