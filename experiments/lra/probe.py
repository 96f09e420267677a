"""How much of a Pathfinder score needs no path tracing: the shortcut probe.

A Pathfinder label says whether the two markers lie on one snake. A model that traces paths can
score up to 100%; one that reads only where the markers are, or what the few pixels around them
look like, should score 50%, unless the generator leaves cues there. The authors' generator does:
at 32 px its seeds can only point up-left (see ``pathfinder.seed_allowed``), so where the markers
sit relative to each other says something about the label. This probe measures it:

    sparseflash lra probe --resolution 32 --fidelity release clean --num 16000 --out runs/probe

For each (resolution, fidelity) it draws ``num`` hard images (balanced labels; the generator's
layers give the true marker centres), keeps 25% aside, and trains a small MLP on the rest from
three feature sets, the two markers always in raster order (an image does not say which is
which):

- ``coords``: the two marker centres (4 numbers);
- ``patches``: the gray levels of a (2k+1)^2 patch around each marker, k = ceil(radius) + 3;
- ``coords+patches``: both.

Held-out accuracy with its standard error sqrt(p (1 - p) / n) goes to ``probe.json`` /
``probe.csv`` and ``probe.png``. The classifier (an MLP with two hidden layers of 128, Adam,
early stopping on a validation slice of the training part) is deliberately small: a high score
is a lower bound on what the cue carries, a score at 50% says this probe found nothing.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import numpy as np

FEATURES = ("coords", "patches", "coords+patches")
COLUMNS = ["resolution", "fidelity", "features", "n_train", "n_test", "acc", "se", "seconds"]


def patch_half(resolution: int) -> int:
    """The patches' half-size k = ceil(marker radius) + 3 (6 at 128 px)."""
    from sparseflash.experiments.lra.data import pathfinder as pf

    return int(math.ceil(pf.RESOLUTIONS[resolution]["marker_radius"])) + 3


def marker_patches(images, tips, half: int) -> np.ndarray:
    """float32 ``[n, 2 (2 half + 1)^2]``: the square patch around each marker of ``images`` ``[n, H, W]``
    (``tips [n, 2, 2]``, (y, x)), the markers in raster order (an image does not say which is which),
    zeros outside the image, gray levels / 255."""
    images = np.asarray(images)
    s = 2 * half + 1
    big = np.pad(images, ((0, 0), (half, half), (half, half)))
    out = np.empty((len(images), 2, s * s), np.float32)
    for i, (img, t) in enumerate(zip(big, np.asarray(tips))):
        for m, (y, x) in enumerate(sorted((int(a), int(b)) for a, b in t)):
            out[i, m] = img[y:y + s, x:x + s].ravel()
    return out.reshape(len(images), -1) / 255.0


def marker_coords(tips, resolution: int) -> np.ndarray:
    """float32 ``[n, 4]``: the two marker centres (``tips [n, 2, 2]``, (y, x)) in raster order, / resolution."""
    return np.asarray([[v / resolution for t in sorted(tuple(int(a) for a in t) for t in ts) for v in t]
                       for ts in np.asarray(tips)], np.float32).reshape(-1, 4)


def _probe_chunk(job):
    from sparseflash.experiments.lra.data import pathfinder as pf

    resolution, fidelity, seed, chunk, k, count = job
    p = pf.params_for(resolution, "hard", fidelity)
    labels = [(chunk * pf.CHUNK[resolution] + i) % 2 for i in range(pf.CHUNK[resolution])]
    made = pf.render_many(p, np.random.default_rng([seed, resolution, 3, chunk]), labels, True)[:count]
    tips = np.asarray([[tuple(int(v) for v in t) for t in lay["tips"]] for _, lay in made])
    return (marker_coords(tips, resolution), marker_patches(np.stack([img for img, _ in made]), tips, k),
            np.asarray(labels[:count], np.int64))


def probe_data(resolution: int, fidelity: str, num: int, *, seed: int = 0, workers: int = 1,
               show_progress: bool = True):
    """Features of ``num`` generated hard images: (coords [n, 4], patches [n, 2 (2k+1)^2], labels [n])."""
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.data._parallel import run_ordered

    k = patch_half(resolution)
    K = pf.CHUNK[resolution]
    jobs = [(resolution, fidelity, seed, c, k, min(K, num - c * K)) for c in range(-(-num // K))]
    parts = list(run_ordered(_probe_chunk, jobs, workers, f"probe data {resolution}px {fidelity}", total=num,
                             weight=lambda res: len(res[2]), show_progress=show_progress))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def fit_mlp(x_train, y_train, x_test, y_test, *, seed: int = 0, epochs: int = 60, hidden: int = 128,
            lr: float = 1e-3, batch_size: int = 256) -> float:
    """Held-out accuracy of a small MLP (features standardised on the training part; the epoch with
    the best accuracy on a 15% validation slice of the training part is the one tested)."""
    return fit_mlp_tests(x_train, y_train, {"test": (x_test, y_test)}, seed=seed, epochs=epochs, hidden=hidden, lr=lr,
                         batch_size=batch_size)["test"]


def fit_mlp_tests(x_train, y_train, tests: dict, *, seed: int = 0, epochs: int = 60, hidden: int = 128,
                  lr: float = 1e-3, batch_size: int = 256) -> dict:
    """`fit_mlp` with several test sets: ``tests`` maps a name to ``(x, y)``; returns each one's
    accuracy with the same weights (the epoch best on the validation slice), e.g. a probe trained
    on one generator fidelity and tested on both."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x_train = np.asarray(x_train, np.float32)
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    xt, yt = torch.from_numpy((x_train - mu) / sd), torch.as_tensor(y_train)
    ts = {k: (torch.from_numpy((np.asarray(x, np.float32) - mu) / sd), torch.as_tensor(y)) for k, (x, y) in tests.items()}
    model = nn.Sequential(nn.Linear(xt.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 2))
    return _best_on_validation(model, xt, yt, ts, g, epochs=epochs, lr=lr, batch_size=batch_size)


def fit_cnn(x_train, y_train, x_test, y_test, *, side: int, seed: int = 0, epochs: int = 40, lr: float = 1e-3,
            batch_size: int = 256) -> float:
    """Held-out accuracy of a small CNN on the two marker patches as two channels (``x``: ``[n, 2 side^2]``,
    as `marker_patches` gives them, gray levels / 255): a second learner beside `fit_mlp`, with the
    locality and translation prior the MLP lacks (three 3x3 convolutions, one 2x2 pooling, two dense
    layers; the epoch best on a 15% validation slice of the training part is the one tested, as for the
    MLP)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    as_img = lambda x: torch.from_numpy(np.asarray(x, np.float32).reshape(-1, 2, side, side))  # noqa: E731
    half = side // 2
    model = nn.Sequential(nn.Conv2d(2, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(64 * half * half, 128), nn.ReLU(), nn.Linear(128, 2))
    return _best_on_validation(model, as_img(x_train), torch.as_tensor(y_train),
                               {"test": (as_img(x_test), torch.as_tensor(y_test))}, g, epochs=epochs, lr=lr,
                               batch_size=batch_size)["test"]


def _best_on_validation(model, xt, yt, tests: dict, g, *, epochs: int, lr: float, batch_size: int) -> dict:
    """Train ``model`` (Adam, cross-entropy) on 85% of ``(xt, yt)`` in shuffles drawn from ``g``; each
    of ``tests`` (name -> (x, y) tensors) scored with the weights of the epoch best on the other 15%."""
    import torch
    from torch import nn

    perm = torch.randperm(len(xt), generator=g)
    n_val = max(1, int(0.15 * len(xt)))
    val, fit = perm[:n_val], perm[n_val:]
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    best, best_tests = -1.0, {k: 0.5 for k in tests}
    for _ in range(epochs):
        model.train()
        order = fit[torch.randperm(len(fit), generator=g)]
        for s in range(0, len(order), batch_size):
            b = order[s:s + batch_size]
            loss = nn.functional.cross_entropy(model(xt[b]), yt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc_val = (model(xt[val]).argmax(1) == yt[val]).float().mean().item()
            if acc_val > best:
                best = acc_val
                best_tests = {k: (model(x).argmax(1) == y).float().mean().item() for k, (x, y) in tests.items()}
    return best_tests


def run_probe(resolutions, fidelities, num: int, *, seed: int = 0, workers: int = 1, epochs: int = 60,
              show_progress: bool = True) -> list[dict]:
    rows = []
    for res in resolutions:
        for fid in fidelities:
            coords, patches, labels = probe_data(res, fid, num, seed=seed, workers=workers,
                                                 show_progress=show_progress)
            n_test = max(1, len(labels) // 4)
            split = np.random.default_rng([seed, res, 7]).permutation(len(labels))
            te, tr = split[:n_test], split[n_test:]
            for name in FEATURES:
                x = {"coords": coords, "patches": patches,
                     "coords+patches": np.concatenate([coords, patches], 1)}[name]
                t0 = time.perf_counter()
                acc = fit_mlp(x[tr], labels[tr], x[te], labels[te], seed=seed, epochs=epochs)
                rows.append({"resolution": res, "fidelity": fid, "features": name, "n_train": int(tr.size),
                             "n_test": int(te.size), "acc": acc, "se": math.sqrt(acc * (1 - acc) / te.size),
                             "seconds": round(time.perf_counter() - t0, 2)})
                print(f"probe {res}px {fid:7s} {name:15s} held-out acc {100 * acc:.1f} +- {100 * rows[-1]['se']:.1f}% "
                      f"({te.size} test images)", flush=True)
    return rows


def save(rows: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    with open(out / "probe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "probe.png")


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = sorted({r["resolution"] for r in rows})
    fids = [f for f in ("release", "clean") if any(r["fidelity"] == f for r in rows)]
    fig, axes = plt.subplots(1, len(res), figsize=(4.8 * len(res), 3.8), squeeze=False)
    colors = {"release": "tab:red", "clean": "tab:blue"}
    for ax, R in zip(axes[0], res):
        w = 0.8 / max(len(fids), 1)
        for i, fid in enumerate(fids):
            sel = {r["features"]: r for r in rows if r["resolution"] == R and r["fidelity"] == fid}
            acc = [100 * sel[f]["acc"] if f in sel else np.nan for f in FEATURES]
            err = [200 * sel[f]["se"] if f in sel else 0 for f in FEATURES]
            ax.bar(np.arange(len(FEATURES)) + (i - (len(fids) - 1) / 2) * w, acc, w, yerr=err, capsize=3,
                   color=colors.get(fid, "gray"), label=fid)
        ax.axhline(50, color="black", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(FEATURES)), FEATURES)
        ax.set_ylim(40, max(80, ax.get_ylim()[1]))
        ax.set_ylabel("held-out accuracy (%), bars: 2 SE")
        ax.set_title(f"Pathfinder-{R} hard: label without tracing a path")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PROBE_FILES = ("probe.json", "probe.csv", "probe.png")  # what `save` writes


def _main(args) -> int:
    from sparseflash.cmdline import check_output_dir, claim_output_files

    check_output_dir(args.out)
    claim_output_files(args.out, PROBE_FILES, overwrite=args.overwrite)
    t0 = time.perf_counter()
    rows = run_probe(args.resolution, args.fidelity, args.num, seed=args.seed, workers=args.workers,
                     epochs=args.epochs, show_progress=not args.no_progress)
    save(rows, Path(args.out), {"num": args.num, "seed": args.seed, "epochs": args.epochs,
                                "seconds": round(time.perf_counter() - t0, 1)})
    print(f"wrote {Path(args.out) / 'probe.json'}, probe.csv and probe.png")
    return 0


def register_lra(sub) -> None:
    from sparseflash.cmdline import positive_int
    from sparseflash.experiments.lra.data._parallel import default_workers

    p = sub.add_parser("probe", help="how much of a Pathfinder label the marker positions alone give away",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--resolution", type=int, nargs="+", choices=(32, 64, 128, 256), default=[32])
    p.add_argument("--fidelity", nargs="+", choices=("release", "clean"), default=["release", "clean"])
    p.add_argument("--num", type=positive_int, default=16000, help="images per resolution and fidelity (25%% held out)")
    p.add_argument("--epochs", type=positive_int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=positive_int, default=default_workers())
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="folder for probe.json, probe.csv, probe.png")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the probe.* files of an earlier run in --out; without it they are refused")
    p.set_defaults(func=_main)
