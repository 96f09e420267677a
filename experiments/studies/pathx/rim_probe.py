"""Where in the marker patches the 128 px label cue sits: the shortcut probe (`lra.probe`) per region.

    python experiments/studies/pathx/rim_probe.py [--num 4000] [--fidelity clean release] [--out DIR]

The probe found that 13x13 patches around the two markers of a Path-X image predict its label
at 73-75% (`../pathfinder-generator/probe64_128/`). This script draws ``num`` hard 128 px images
per fidelity (the probe's generator call, true marker centres), holds out 25%, and fits the
probe's small MLP (`probe.fit_mlp`) on parts of the two patches, at distance r from the marker
centre (marker radius 3 at 128 px):

- ``patches``: the whole 13x13 patch of each marker (the probe's feature);
- ``interior``: r <= 2.5 (the disk's inside);
- ``rim``: 2.5 < r <= 3.5 (the disk's edge and whatever ink meets it; 16 pixels a marker);
- ``outside``: r > 3.5;
- ``rim-first`` / ``rim-second``: the rim of one marker only (raster order);
- ``rim-difference``: |rim of the first - rim of the second|, pixel by pixel;
- ``paddle-directions`` (no pixels): the generator's own record (its layers) of the direction of
  the paddle at each marker (the origin's seed paddle, the terminal's last one), reduced to one
  number, cos(theta_origin - theta_terminal), and one threshold chosen on the training part: how
  much of the label the relative direction of the two ends carries.

Writes rim_probe.csv / .json (held-out accuracy and its standard error per fidelity and region).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

REGIONS = ("patches", "interior", "rim", "outside", "rim-first", "rim-second", "rim-difference")


def region_features(patches: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The features of each region from probe patches ``[n, 2 (2k+1)^2]`` (two markers' patches)."""
    n, s = len(patches), 2 * k + 1
    two = patches.reshape(n, 2, s, s)
    g = np.mgrid[-k:k + 1, -k:k + 1].astype(float)
    r = np.sqrt(g[0] ** 2 + g[1] ** 2)
    interior, rim, outside = r <= 2.5, (r > 2.5) & (r <= 3.5), r > 3.5
    return {
        "patches": patches,
        "interior": two[:, :, interior].reshape(n, -1),
        "rim": two[:, :, rim].reshape(n, -1),
        "outside": two[:, :, outside].reshape(n, -1),
        "rim-first": two[:, 0, rim],
        "rim-second": two[:, 1, rim],
        "rim-difference": np.abs(two[:, 0, rim] - two[:, 1, rim]),
    }


def paddle_directions(fidelity: str, num: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(cos(theta_origin - theta_terminal) [num], labels [num]) of ``num`` hard 128 px images: the
    seed paddle of the snake under the origin marker against the last paddle of the snake under the
    terminal marker (`pathfinder.render`'s layers: ``thetas``, ``tip_snakes``)."""
    from sparseflash.experiments.lra.data import pathfinder as pf

    p = pf.params_for(128, "hard", fidelity)
    rng = np.random.default_rng([seed, 128, 11])
    cos, labels = [], []
    while len(labels) < num:
        for _, lay in pf.render_many(p, rng, [0, 1] * 5, True):
            so, st = lay["tip_snakes"]
            cos.append(math.cos(lay["thetas"][so - 1][0] - lay["thetas"][st - 1][-1]))
            labels.append(int(so == st))
    return np.asarray(cos[:num]), np.asarray(labels[:num])


def threshold_accuracy(x_train, y_train, x_test, y_test) -> float:
    """Held-out accuracy of the best one-number rule (x > t or x <= t) fitted on the training part."""
    best = (-1.0, 0.0, True)
    for t in np.quantile(x_train, np.linspace(0, 1, 201)):
        for above in (True, False):
            acc = float((((x_train > t) == above).astype(int) == y_train).mean())
            if acc > best[0]:
                best = (acc, t, above)
    _, t, above = best
    return float((((x_test > t) == above).astype(int) == y_test).mean())


def main(argv=None) -> int:
    from sparseflash.experiments.lra.probe import fit_mlp, probe_data

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=4000)
    ap.add_argument("--fidelity", nargs="+", default=["clean", "release"], choices=["clean", "release"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args(argv)
    if a.num < 8:
        ap.error(f"--num must be at least 8, got {a.num}")
    rows = []
    for fid in a.fidelity:
        coords, patches, labels = probe_data(128, fid, a.num, workers=a.workers, show_progress=False)
        k = (int(math.isqrt(patches.shape[1] // 2)) - 1) // 2
        n_test = len(labels) // 4
        split = np.random.default_rng([0, 128, 7]).permutation(len(labels))
        te, tr = split[:n_test], split[n_test:]
        for name, x in region_features(patches, k).items():
            acc = fit_mlp(x[tr], labels[tr], x[te], labels[te], epochs=a.epochs)
            rows.append({"resolution": 128, "fidelity": fid, "region": name, "features": int(x.shape[1]),
                         "n_train": int(tr.size), "n_test": int(te.size), "acc": round(acc, 4),
                         "se": round(math.sqrt(acc * (1 - acc) / te.size), 4)})
            print(f"{fid:7s} {name:15s} {x.shape[1]:4d} features: held-out {100 * acc:.1f} +- "
                  f"{100 * rows[-1]['se']:.1f}%", flush=True)
        cos, lab = paddle_directions(fid, a.num)
        acc = threshold_accuracy(cos[tr], lab[tr], cos[te], lab[te])
        rows.append({"resolution": 128, "fidelity": fid, "region": "paddle-directions", "features": 1,
                     "n_train": int(tr.size), "n_test": int(te.size), "acc": round(acc, 4),
                     "se": round(math.sqrt(acc * (1 - acc) / te.size), 4),
                     "mean_cos_same_snake": round(float(cos[lab == 1].mean()), 3),
                     "mean_cos_different": round(float(cos[lab == 0].mean()), 3)})
        print(f"{fid:7s} paddle-directions: cos same snake {rows[-1]['mean_cos_same_snake']}, different "
              f"{rows[-1]['mean_cos_different']}; one threshold: held-out {100 * acc:.1f}%", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "rim_probe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[-1]), restval="")
        w.writeheader()
        w.writerows(rows)
    (a.out / "rim_probe.json").write_text(json.dumps({"num": a.num, "epochs": a.epochs, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
