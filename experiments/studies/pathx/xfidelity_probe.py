"""Is the marker cue of hard 128 px (or 256 px) images the same in both generator fidelities?

The probe MLP reads ~73-75% of the labels from the patches around the two markers in release and in
clean images alike (`sparseflash lra probe`), yet the Transformer trained on release marker
neighbourhoods is at chance on clean ones, even when it sees nothing but the neighbourhoods (R = 6;
`zero_shot.py --fidelity clean`). This script trains the probe's MLP on one fidelity's patches and
tests the same weights on held-out patches of both: if the cue were one property drawn the same way,
it would carry over.

    PYTHONPATH=. python experiments/studies/pathx/xfidelity_probe.py --num 10000 [--half 6] [--out DIR]

Images: hard 128 px, drawn by `neighbourhood.generate` with seed ``--seed`` for each fidelity (cached
as neighbourhood's are), split 80 / 20 by `neighbourhood.split_indices` (val and test together form the
held-out part). Features: `probe.marker_patches` with half-size ``--half`` (default the probe's k = 6).
``--features coords``: the two marker coordinates instead (the probe's ``coords``: does the
coordinate cue, 64% of Path-256 labels in either fidelity, mean the same in both?).
Writes ``OUT/xfidelity_probe.csv`` / ``.json`` (``-256`` with ``--resolution 256``; ``-coords`` with
``--features coords``; ``-binary`` with ``--binarize``: drawn or not instead of gray levels): one row per (trained on, tested on) with the accuracy and its standard error.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from sparseflash.experiments.lra.probe import fit_mlp_tests, marker_coords, marker_patches
from sparseflash.experiments.studies.pathx.neighbourhood import (DEFAULT_CACHE, default_radius, load_or_generate,
                                                                 split_indices)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "xfidelity_probe"
FIDELITIES = ("release", "clean")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=10000, help="images per fidelity (default 10000: 8K train, 2K held out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resolution", type=int, choices=(128, 256), default=128, help="128 (Path-X, default) or 256 (Path-256)")
    ap.add_argument("--half", type=int, default=None, help="patch half-size (default the probe's k: 6 at 128 px)")
    ap.add_argument("--features", choices=("patches", "coords"), default="patches",
                    help="patches (default) or the two marker coordinates alone (the probe's coords)")
    ap.add_argument("--binarize", action="store_true",
                    help="drawn or not (gray > 0) instead of gray levels: leaves the geometry, removes the renderings' "
                         "gray-level differences (release markers 213-226 inside a 255 ring)")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if a.num < 20:
        ap.error(f"--num must be at least 20, got {a.num}")
    if a.binarize and a.features != "patches":
        ap.error("--binarize applies to --features patches (coordinates have no gray levels)")
    half = a.half if a.half is not None else default_radius(a.resolution)
    if half < 1:
        ap.error(f"--half must be positive, got {half}")
    data = {}
    for fid in FIDELITIES:
        images, tips, labels, _ = load_or_generate(a.cache, a.num, a.seed, a.workers, fidelity=fid,
                                                   resolution=a.resolution)
        idx = split_indices(len(labels), a.seed)
        held = np.sort(np.concatenate([idx["val"], idx["test"]]))
        x = marker_patches(images, tips, half) if a.features == "patches" else marker_coords(tips, a.resolution)
        if a.binarize:
            x = (x > 0).astype(np.float32)
        y = labels.astype(np.int64)
        data[fid] = {"train": (x[idx["train"]], y[idx["train"]]), "held": (x[held], y[held])}
    rows = []
    for train_on in FIDELITIES:
        t0 = time.perf_counter()
        accs = fit_mlp_tests(*data[train_on]["train"], {f: data[f]["held"] for f in FIDELITIES}, seed=a.seed,
                             epochs=a.epochs)
        for test_on in FIDELITIES:
            n = len(data[test_on]["held"][1])
            acc = accs[test_on]
            rows.append({"resolution": a.resolution, "trained_on": train_on, "tested_on": test_on, "acc": round(acc, 4),
                         "se": round(math.sqrt(acc * (1 - acc) / n), 4), "n_train": len(data[train_on]["train"][1]),
                         "n_test": n, "feature_set": a.features, "patch_half": half, "binarize": a.binarize,
                         "features": int(data[train_on]["train"][0].shape[1]),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(f"trained on {train_on:7s} tested on {test_on:7s}: {100 * acc:.1f} +- {100 * rows[-1]['se']:.1f}%",
                  flush=True)
    from sparseflash.experiments.bench.results import write_tidy
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta

    meta = {"num": a.num, "seed": a.seed, "resolution": a.resolution, "features": a.features, "half": half,
            "binarize": a.binarize,
            "epochs": a.epochs, **run_meta(argv)}
    name = ("xfidelity_probe" + ("" if a.resolution == 128 else f"-{a.resolution}") + ("-coords" if a.features == "coords" else "")
            + ("-binary" if a.binarize and a.features == "patches" else ""))
    write_tidy(rows, meta, a.out, name, "pathx-xfidelity-probe/1")
    print(f"wrote {a.out / name}.csv, .json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
