"""Can a model read the marker coordinates through its position code?

At 256 px the two marker coordinates alone give ~64% of the labels (`sparseflash lra probe
--resolution 256`). A Transformer sees a coordinate only through its position code: a learned table
(the recipe's, from Pathfinder-64, upsampled to the image's grid) or fixed 2-D sinusoids. This
script gives the probe's MLP the code's vectors at the two markers (in raster order) instead of the
coordinates, on the same images and split, and reports how smooth the table is (cosine of
neighbouring cells' vectors, and of cells far apart).

    PYTHONPATH=. python experiments/studies/pathx/position_codes.py [--checkpoint pxstate/pretrain/checkpoints/best.pt]
        [--resolution 256] [--num 10000] [--out DIR]

Images: `neighbourhood.load_or_generate` (hard, release, seed ``--seed``), split by
`neighbourhood.split_indices` (val and test held out together). Writes ``OUT/position_codes.csv`` /
``.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from sparseflash.experiments.lra.checkpoints import load_checkpoint

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "position_codes"
DEFAULT_CKPT = HERE.parents[2] / "pxstate" / "pretrain" / "checkpoints" / "best.pt"


def marker_cells(tips, resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) ``[n, 2]`` of the two markers of each image, in raster order."""
    t = np.asarray(tips, np.int64)
    flat = np.sort(t[:, :, 0] * resolution + t[:, :, 1], axis=1)
    return flat // resolution, flat % resolution


def sincos_code(rows, cols, d: int) -> np.ndarray:
    """The model's ``grid_sincos`` vectors ``[n, d]`` of cells (rows, cols) (`model._sincos`)."""
    import torch

    from sparseflash.experiments.lra.model import _sincos

    half = d // 2
    r = _sincos(torch.as_tensor(rows, dtype=torch.float64).reshape(-1), half)
    c = _sincos(torch.as_tensor(cols, dtype=torch.float64).reshape(-1), d - half)
    return torch.cat([r, c], 1).numpy()


def cosine(a, b) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CKPT, help="a run's best.pt with a learned grid table")
    ap.add_argument("--resolution", type=int, choices=(128, 256), default=256)
    ap.add_argument("--num", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="image cache folder (default neighbourhood.py's)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if not a.checkpoint.is_file():
        ap.error(f"--checkpoint {a.checkpoint}: no such file")
    if a.num < 20:
        ap.error(f"--num must be at least 20, got {a.num}")
    from sparseflash.experiments.lra.model import upsample_grid
    from sparseflash.experiments.lra.probe import fit_mlp
    from sparseflash.experiments.studies.pathx.neighbourhood import DEFAULT_CACHE, load_or_generate, split_indices

    grid = load_checkpoint(a.checkpoint)["model"].get("encoder.pos.grid")
    if grid is None:
        ap.error(f"--checkpoint {a.checkpoint}: no learned grid table (encoder.pos.grid)")
    source = tuple(grid.shape[:2])
    table = upsample_grid(grid, (a.resolution, a.resolution)).numpy()
    g = grid.numpy()
    smooth = {"neighbour_cosine": float(np.mean(cosine(g[:-1], g[1:]))),
              "far_cosine": float(np.mean(cosine(g[: g.shape[0] // 2], g[g.shape[0] // 2:])))}
    images, tips, labels, _ = load_or_generate(a.cache or DEFAULT_CACHE, a.num, a.seed, a.workers, False,
                                               resolution=a.resolution)
    idx = split_indices(len(labels), a.seed)
    held = np.sort(np.concatenate([idx["val"], idx["test"]]))
    y = labels.astype(np.int64)
    rows_, cols_ = marker_cells(tips, a.resolution)
    d = table.shape[-1]
    features = {
        "coordinates": np.stack([rows_[:, 0], cols_[:, 0], rows_[:, 1], cols_[:, 1]], 1),
        "learned table at the markers": np.concatenate([table[rows_[:, m], cols_[:, m]] for m in range(2)], 1),
        "2-D sin-cos codes at the markers": np.concatenate([sincos_code(rows_[:, m], cols_[:, m], d) for m in range(2)], 1),
    }
    out_rows = []
    for name, x in features.items():
        t0 = time.perf_counter()
        x = x.astype(np.float32)
        acc = fit_mlp(x[idx["train"]], y[idx["train"]], x[held], y[held], seed=a.seed, epochs=a.epochs)
        out_rows.append({"features": name, "dims": int(x.shape[1]), "acc": round(acc, 4),
                         "se": round(math.sqrt(acc * (1 - acc) / len(held)), 4), "n_train": int(len(idx["train"])),
                         "n_test": int(len(held)), "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name:34s} {100 * acc:.1f} +- {100 * out_rows[-1]['se']:.1f}%", flush=True)
    print(f"table {source} from {a.checkpoint}: neighbouring cells' cosine {smooth['neighbour_cosine']:.3f}, "
          f"far cells' {smooth['far_cosine']:.3f}", flush=True)
    from sparseflash.experiments.bench.results import write_tidy
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta

    meta = {"checkpoint": str(a.checkpoint), "table": list(source), "resolution": a.resolution, "num": a.num,
            "seed": a.seed, **smooth, **run_meta(argv)}
    write_tidy(out_rows, meta, a.out, "position_codes", "pathx-position-codes/1")
    print(f"wrote {a.out / 'position_codes.csv'}, .json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
