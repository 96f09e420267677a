"""Does the batched Pathfinder generator draw the same task as the reference one?

Renders N images per resolution (hard) with each method, measures every image
(``pathfinder.image_stats``: target-snake pixels, tip-to-tip distance, turn angles, distractors
placed, marker distance, lit fraction, mean intensity, margin, pixel connectivity of the markers)
and compares the two samples per quantity: two-sample Kolmogorov-Smirnov for continuous ones,
chi-square on the contingency table for counts (distractors, margin, connected), and the effect
size (mean_batched - mean_reference) / sd_reference. Labels alternate 0, 1 (as the writer's
balanced batches) so label balance is by construction; ``connected`` is reported per label.

    python experiments/studies/pathfinder-generator/compare.py --num 32=3000 64=600 128=600 256=2000 --workers 2
    python experiments/studies/pathfinder-generator/compare.py --plot-only      # figure from metrics.csv

Writes metrics.csv (one row per image), summary.csv / summary.json (one row per resolution x
quantity) and histograms.png next to this file (or under --out).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONTINUOUS = ["pixels_1", "pixels_2", "end_to_end_1", "end_to_end_2", "turn_mean_1", "turn_mean_2", "turn_max_1",
              "turn_max_2", "distractor_pixels", "marker_distance", "lit_fraction", "mean_intensity"]
COUNTS = ["distractors", "margin", "connected_label0", "connected_label1"]
PLOTTED = ["pixels_1", "end_to_end_1", "turn_mean_1", "distractors", "distractor_pixels", "marker_distance",
           "lit_fraction", "mean_intensity"]


def _task(job):
    from sparseflash.experiments.lra.data import pathfinder as pf

    method, resolution, start, stop = job
    p = pf.params_for(resolution, "hard")
    rows = []
    if method == "reference":
        for i in range(start, stop):
            img, lay = pf.render(p, np.random.default_rng([7, resolution, i]), i % 2, True, method="reference")
            rows.append((i, i % 2, pf.image_stats(img, lay)))
    else:  # the writer's way: chunks of CHUNK[resolution] images from one generator
        k = pf.CHUNK[resolution]
        for c in range(start // k, -(-stop // k)):
            labels = [i % 2 for i in range(c * k, (c + 1) * k)]
            made = pf.render_many(p, np.random.default_rng([8, resolution, c]), labels, True)
            rows += [(c * k + j, labels[j], pf.image_stats(img, lay)) for j, (img, lay) in enumerate(made)
                     if start <= c * k + j < stop]
    return [{"method": method, "resolution": resolution, "index": i, "label": lab, **st} for i, lab, st in rows]


def generate(num: dict, workers: int) -> list[dict]:
    jobs = []
    for res, n in num.items():
        step = 50 if res == 32 else 10
        for method in ("reference", "batched"):
            jobs += [(method, res, s, min(s + step, n)) for s in range(0, n, step)]
    jobs.sort(key=lambda j: (j[0] != "reference", -j[1]))  # slowest first
    rows, t0 = [], time.perf_counter()
    with mp.get_context("fork").Pool(workers) as pool:
        for k, part in enumerate(pool.imap_unordered(_task, jobs)):
            rows += part
            if k % 20 == 0:
                print(f"  {k + 1}/{len(jobs)} jobs, {time.perf_counter() - t0:.0f}s", flush=True)
    rows.sort(key=lambda r: (r["resolution"], r["method"], r["index"]))
    return rows


def compare(rows: list[dict]) -> list[dict]:
    from scipy import stats

    out = []
    for res in sorted({r["resolution"] for r in rows}):
        sel = {m: [r for r in rows if r["resolution"] == res and r["method"] == m] for m in ("reference", "batched")}
        for q in CONTINUOUS + COUNTS:
            if q.startswith("connected_label"):
                lab = int(q[-1])
                a, b = ([r["connected"] for r in sel[m] if r["label"] == lab] for m in ("reference", "batched"))
            else:
                a, b = ([r[q] for r in sel[m]] for m in ("reference", "batched"))
            a, b = np.asarray(a, float), np.asarray(b, float)
            sd = a.std(ddof=1)
            row = {"resolution": res, "quantity": q, "n_reference": a.size, "n_batched": b.size,
                   "mean_reference": a.mean(), "mean_batched": b.mean(), "sd_reference": sd,
                   "effect_size": (b.mean() - a.mean()) / sd if sd > 0 else 0.0}
            if q in CONTINUOUS:
                row.update(test="ks", statistic=stats.ks_2samp(a, b).statistic, p_value=stats.ks_2samp(a, b).pvalue)
            else:
                levels = np.union1d(a, b)
                table = np.array([[np.sum(a == v) for v in levels], [np.sum(b == v) for v in levels]])
                if levels.size < 2:
                    row.update(test="chi2", statistic=0.0, p_value=1.0)
                else:
                    chi = stats.chi2_contingency(table)
                    row.update(test="chi2", statistic=float(chi.statistic), p_value=float(chi.pvalue))
            out.append({k: (round(float(v), 6) if isinstance(v, (float, np.floating)) else v) for k, v in row.items()})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ress = sorted({r["resolution"] for r in rows})
    fig, axes = plt.subplots(len(ress), len(PLOTTED), figsize=(2.6 * len(PLOTTED), 2.2 * len(ress)), squeeze=False)
    for i, res in enumerate(ress):
        for j, q in enumerate(PLOTTED):
            ax = axes[i, j]
            vals = {m: np.array([r[q] for r in rows if r["resolution"] == res and r["method"] == m], float)
                    for m in ("reference", "batched")}
            lo, hi = min(v.min() for v in vals.values()), max(v.max() for v in vals.values())
            integer = q in ("distractors", "pixels_1", "distractor_pixels")
            bins = np.arange(lo - 0.5, hi + 1.5) if integer and hi - lo < 60 else np.linspace(lo, hi + 1e-9, 31)
            for m, color in (("reference", "tab:blue"), ("batched", "tab:orange")):
                ax.hist(vals[m], bins=bins, density=True, histtype="step", color=color, lw=1.3,
                        label=f"{m} (n={vals[m].size})")
            if i == 0:
                ax.set_title(q, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{int(res)} px hard", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.set_yticks([])
    axes[0, 0].legend(fontsize=6, loc="upper left")
    fig.suptitle("Pathfinder hard: batched vs reference generator, per-image quantities (density)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _commit() -> str:
    from sparseflash.experiments.bench.results import git_commit

    return git_commit(HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", nargs="+", default=["32=3000", "64=600", "128=600", "256=2000"],
                    help="RES=N pairs: images per method per resolution")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure and summary from metrics.csv")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        with open(out / "metrics.csv") as f:
            rows = [{k: (v if k == "method" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
    else:
        num = {}
        for item in args.num:
            res, _, n = item.partition("=")
            if int(res) not in (32, 64, 128, 256) or not n.isdigit() or int(n) < 2:
                raise SystemExit(f"--num expects RES=N with RES in 32, 64, 128, 256 and N >= 2, got {item!r}")
            num[int(res)] = int(n)
        t0 = time.perf_counter()
        rows = generate(num, args.workers)
        with open(out / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows([{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])
        print(f"rendered {len(rows)} images in {time.perf_counter() - t0:.0f}s")
    summary = compare(rows)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    worst = min(summary, key=lambda r: r["p_value"])
    (out / "summary.json").write_text(json.dumps(
        {"commit": _commit(), "difficulty": "hard", "tests": len(summary),
         "bonferroni_alpha_0.05": 0.05 / len(summary), "smallest_p": worst,
         "largest_abs_effect": max(summary, key=lambda r: abs(r["effect_size"])), "rows": summary}, indent=1))
    plot(rows, out / "histograms.png")
    for r in summary:
        flag = " <" if r["p_value"] < 0.05 / len(summary) else ""
        print(f"{int(r['resolution']):4d} {r['quantity']:18s} ref {r['mean_reference']:9.4f} "
              f"new {r['mean_batched']:9.4f}  d={r['effect_size']:+.3f}  {r['test']} p={r['p_value']:.3f}{flag}")
    print(f"smallest p {worst['p_value']:.4f} ({int(worst['resolution'])} {worst['quantity']}); "
          f"Bonferroni threshold {0.05 / len(summary):.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
