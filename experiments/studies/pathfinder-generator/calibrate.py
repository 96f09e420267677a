"""Calibration of the Pathfinder generator's two fidelities against real release images.

The only real LRA Pathfinder images at hand are 8 at 64 px and 8 at 128 px (hard), in
``shared/pathfinder-release-samples`` (a torchvision grid: image i at x = 2 + i (S + 2), y = 2).
This script measures the same quantities on them and on images of both generator fidelities
(``release``: the authors' code, quirks included; ``clean``: our corrections):

- stroke directions: the share of ink (pixels >= 64) whose local stroke runs horizontally, along
  "/", vertically or along "\\" (structure tensor, Gaussian window sigma 1; bins of 45 degrees);
- the share of exactly black pixels and the ink per image (mean gray level / 255);
- marker gray levels, markers found from the pixels alone: the two strongest responses of a disk
  filter (mean over the marker's disk minus the mean over a ring around it); interior = median of
  the disk's inner pixels, ring = the brightest pixel within radius + 1.5;
- the snakes' level: the 99th percentile of ink away from the markers, over the image maximum.

    python experiments/studies/pathfinder-generator/calibrate.py [--num 160] [--samples DIR]
    python experiments/studies/pathfinder-generator/calibrate.py --plot-only

Writes calibration.json (per source: per-image values and means) and calibration.png beside this
file (or under --out).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SAMPLES = HERE.parents[2].parent / "shared" / "pathfinder-release-samples"
FILES = {64: "path64-curv_contour_length_14.png", 128: "pathX-curv_contour_length_14.png"}
BINS = ("-", "/", "|", "\\")
SOURCES = ("real", "release", "clean")


def real_images(samples: Path, resolution: int) -> list[np.ndarray]:
    """The 8 release images of one resolution cut out of the torchvision grid."""
    from PIL import Image

    grid = np.asarray(Image.open(samples / FILES[resolution]).convert("L"))
    S = resolution
    return [grid[2:2 + S, 2 + i * (S + 2):2 + i * (S + 2) + S].copy() for i in range(8)]


def generated(resolution: int, fidelity: str, num: int, seed: int = 0) -> list[np.ndarray]:
    from sparseflash.experiments.lra.data import pathfinder as pf

    p = pf.params_for(resolution, "hard", fidelity)
    k = pf.CHUNK[resolution]
    out = []
    for c in range(-(-num // k)):
        out += pf.render_many(p, np.random.default_rng([seed, resolution, c]), [i % 2 for i in range(k)])
    return out[:num]


def stroke_directions(img: np.ndarray) -> np.ndarray:
    """Share of ink per direction bin (BINS), in image terms ("/" rises to the right)."""
    from scipy import ndimage

    f = img.astype(np.float64) / 255
    gy = ndimage.sobel(f, 0)  # rows grow downwards
    gx = ndimage.sobel(f, 1)
    gy = -gy  # y up
    jxx, jyy, jxy = (ndimage.gaussian_filter(a, 1.0) for a in (gx * gx, gy * gy, gx * gy))
    grad = 0.5 * np.arctan2(2 * jxy, jxx - jyy)  # dominant gradient orientation
    stroke = np.degrees(grad + np.pi / 2) % 180  # the stroke runs across its gradient
    ink = img >= 64
    b = (((stroke + 22.5) % 180) // 45).astype(int)  # 0: -, 1: /, 2: |, 3: \
    w = f * ink
    h = np.bincount(b.ravel(), weights=w.ravel(), minlength=4)[:4]
    return h / max(h.sum(), 1e-12)


def markers(img: np.ndarray, radius: float):
    """Centres of the two markers (strongest disk-filter responses, non-overlapping)."""
    from scipy import ndimage

    r = radius
    k = int(math.ceil(r)) + 3
    yy, xx = np.mgrid[-k:k + 1, -k:k + 1]
    d = np.hypot(yy, xx)
    disk = (d <= r).astype(float)
    ring = ((d > r + 1) & (d <= r + 3)).astype(float)
    f = img.astype(np.float64)
    resp = ndimage.correlate(f, disk / disk.sum()) - ndimage.correlate(f, ring / ring.sum())
    found = []
    for _ in range(2):
        i = np.unravel_index(np.argmax(resp), resp.shape)
        found.append(i)
        y, x = np.ogrid[:img.shape[0], :img.shape[1]]
        resp[(y - i[0]) ** 2 + (x - i[1]) ** 2 <= (2 * r + 2) ** 2] = -np.inf
    return found


def measure(img: np.ndarray, radius: float) -> dict:
    y, x = np.ogrid[:img.shape[0], :img.shape[1]]
    interior, ring, away = [], [], np.ones(img.shape, bool)
    for cy, cx in markers(img, radius):
        d = np.hypot(y - cy, x - cx)
        interior.append(float(np.median(img[d <= max(radius - 1, 0.75)])))
        ring.append(float(img[d <= radius + 1.5].max()))
        away &= d > radius + 2
    ink = img[away & (img > 0)]
    dirs = stroke_directions(img)
    return {"black": float((img == 0).mean()), "ink": float(img.mean() / 255),
            "marker_interior": float(np.mean(interior)), "marker_ring": float(np.mean(ring)),
            "snake_level": float(np.percentile(ink, 99) / max(img.max(), 1)) if ink.size else 0.0,
            **{f"dir_{n}": float(v) for n, v in zip("h/v\\", dirs)}}


KEYS = ["dir_h", "dir_/", "dir_v", "dir_\\", "black", "ink", "marker_interior", "marker_ring", "snake_level"]


def run(num: int, samples: Path, out: Path) -> dict:
    from sparseflash.experiments.lra.data.pathfinder import RESOLUTIONS

    result = {"num_generated": num, "sources": {}}
    for res in (64, 128):
        radius = RESOLUTIONS[res]["marker_radius"]
        for src in SOURCES:
            imgs = real_images(samples, res) if src == "real" else generated(res, src, num)
            rows = [measure(im, radius) for im in imgs]
            summary = {k: {"mean": float(np.mean([r[k] for r in rows])),
                           "se": float(np.std([r[k] for r in rows], ddof=1) / math.sqrt(len(rows)))} for k in KEYS}
            result["sources"][f"{src}{res}"] = {"n": len(rows), "summary": summary, "rows": rows}
            print(f"{res} px {src:8s} n={len(rows):4d} " + " ".join(
                f"{k}={summary[k]['mean']:.3f}" for k in KEYS), flush=True)
    (out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def plot(result: dict, samples: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"real": "black", "release": "tab:red", "clean": "tab:blue"}
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.8), gridspec_kw={"width_ratios": [1.5, 1, 1, 1]})
    for row, res in enumerate((64, 128)):
        ax = axes[row, 0]  # 4 images of each source, one row per source
        tiles = [real_images(samples, res)[:4], generated(res, "release", 4, seed=99), generated(res, "clean", 4, seed=99)]
        S = res
        canvas = np.full((3 * (S + 2), 4 * (S + 2)), 128, np.uint8)
        for i, ims in enumerate(tiles):
            for j, im in enumerate(ims):
                canvas[i * (S + 2):i * (S + 2) + S, j * (S + 2):j * (S + 2) + S] = im
        ax.imshow(canvas, cmap="gray", vmin=0, vmax=255)
        ax.set_yticks([(i + 0.5) * (S + 2) for i in range(3)], ["real (LRA)", "release", "clean"])
        ax.set_xticks([])
        ax.set_title(f"{res} px hard: 4 images each")
        groups = [("stroke direction (share of ink)", ["dir_h", "dir_/", "dir_v", "dir_\\"], ["-", "/", "|", "\\"]),
                  ("pixels", ["black", "ink"], ["exactly black", "ink (mean / 255)"]),
                  ("gray levels", ["marker_interior", "marker_ring", "snake_level"],
                   ["marker interior / 255", "marker ring / 255", "snake / image max"])]
        for col, (title, keys, labels) in enumerate(groups, start=1):
            ax = axes[row, col]
            w = 0.26
            for s, src in enumerate(SOURCES):
                summ = result["sources"][f"{src}{res}"]["summary"]
                scale = [255.0 if k.startswith("marker") else 1.0 for k in keys]
                means = [summ[k]["mean"] / sc for k, sc in zip(keys, scale)]
                ses = [summ[k]["se"] / sc for k, sc in zip(keys, scale)]
                n = result["sources"][f"{src}{res}"]["n"]
                ax.bar(np.arange(len(keys)) + (s - 1) * w, means, w, yerr=ses, capsize=2, color=colors[src],
                       alpha=0.85, label=f"{src} (n={n})")
            ax.set_xticks(np.arange(len(keys)), labels, fontsize=8)
            ax.set_title(f"{res} px: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            if col == 1:
                ax.legend(fontsize=8)
    fig.suptitle("Pathfinder generator fidelities against the 16 real release images (means, bars: 1 standard error)")
    fig.tight_layout()
    path = out / "calibration.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser, CommandError, check_output_dir, positive_int

    ap = ArgumentParser(prog="calibrate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=positive_int, default=160, help="generated images per fidelity and resolution")
    ap.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES, help="folder of the release sample strips")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--plot-only", action="store_true", help="redraw calibration.png from calibration.json")
    args = ap.parse_args(argv)
    missing = [f for f in FILES.values() if not (args.samples / f).is_file()]
    if missing:
        raise CommandError(f"--samples {args.samples} lacks {', '.join(missing)}",
                           "point --samples at shared/pathfinder-release-samples")
    check_output_dir(args.out)
    if args.plot_only:
        if not (args.out / "calibration.json").is_file():
            raise CommandError(f"no {args.out / 'calibration.json'} to redraw", "run without --plot-only first")
        result = json.loads((args.out / "calibration.json").read_text())
    else:
        result = run(args.num, args.samples, args.out)
    print(plot(result, args.samples, args.out))
    return 0


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
