"""How much of a marker-neighbourhood model's cue survives more ink, before any further training.

A model trained on the pixels within R = 6 of the two markers (``neighbourhood.py``) is evaluated,
unchanged, on fresh hard release 128 px images masked at wider radii and on the whole images
(every drawn pixel: the real Path-X input). If it keeps part of its accuracy on whole images, a
whole-image fine-tune starts from a model that already reads the cue there; if it falls to chance
at R = 12 already, the curriculum needs its intermediate radii.

    PYTHONPATH=. python experiments/studies/pathx/zero_shot.py CHECKPOINT [CHECKPOINT ...] \\
        --num 2000 --radii 6 12 24 48 full [--seed 1] [--out results/neighbourhood/zero_shot]

Writes ``OUT/zero_shot.csv`` and ``.json`` (one row a checkpoint and input: accuracy, its standard
error, loss, mean drawn tokens) and ``zero_shot.png`` (``--replot`` redraws it from the JSON). The images are drawn with ``--seed`` (default
1; the neighbourhood runs drew theirs with seed 0, so none of these was trained on) and cached in
``--cache``. On a CPU the faithful attention becomes SDPA (as in ``neighbourhood.py``); evaluation
has no dropout, so the function is the same.

``--swap R [R ...]``: where in a whole image does a model find its answer? Each image A is paired
with an image B of the other label. The test image is B with the pixels within R of B's markers
blackened, and the pixels within R of A's markers copied in from A: A's markers and the ends of
its snakes, in B's ink otherwise. Input ``swapR``'s accuracy is then the share of answers that
follow A's marker neighbourhoods; 1 minus it is the share that follows the rest of B. A model
that reads a cue at the markers (their places, or the snakes' ends there) keeps its whole-image
accuracy. A model that traces B's paths falls below 50%: B's paths now end in blackened
neighbourhoods, not at its markers. A model that needs both is near 50%.

``--markers-from FIDELITY``: the whole images with each marker disc (radius marker_radius + 1)
replaced by the disc of an image of the *other label* drawn by the other generator. Each image keeps
its own paths and its own marker places; the markers' rendering changes (release markers: interior
207-214 inside a brighter ring; clean: 255), and the few snake pixels inside the discs come from
an image of the other label. A model that finds the markers by their rendering and answers from
their places recovers on clean images given release discs. One that reads the paths does not care.
One that reads the snake ends inside the discs falls below 50%.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from sparseflash.experiments.lra.checkpoints import load_checkpoint
from sparseflash.experiments.studies.pathx.neighbourhood import DEFAULT_CACHE, radius_arg
from sparseflash.experiments.studies.pathx.neighbourhood import DEFAULT_OUT as NEIGHBOURHOOD_OUT

DEFAULT_OUT = NEIGHBOURHOOD_OUT / "zero_shot"


def masked_sets(images, tips, labels, radii) -> dict:
    """The evaluation set at each radius (None: whole images), masked once for every checkpoint."""
    from sparseflash.experiments.studies.pathx.neighbourhood import NeighbourhoodDataset, mask_images

    return {r: NeighbourhoodDataset(images if r is None else mask_images(images, tips, r), labels, "zero-shot")
            for r in radii}


def swapped_images(images, tips, labels, radius: float, seed: int = 0):
    """The ``--swap`` set (docstring): ``(images [m, res, res], labels [m])`` of A's label, one
    composite for each image A of the smaller class and each of the same number of images of the
    other (2 x the smaller class's count in all), every A paired with a distinct B of the other
    label (random pairing, ``seed``)."""
    from sparseflash.experiments.studies.pathx.neighbourhood import neighbourhood_mask

    images, labels = np.asarray(images), np.asarray(labels)
    rng = np.random.default_rng(seed)
    ones, zeros = rng.permutation(np.flatnonzero(labels == 1)), rng.permutation(np.flatnonzero(labels == 0))
    m = min(len(ones), len(zeros))
    if m == 0:
        raise ValueError("--swap needs images of both labels")
    a = np.concatenate([ones[:m], zeros[:m]])
    b = np.concatenate([zeros[:m], ones[:m]])  # each A's partner has the other label
    out = np.empty((2 * m,) + images.shape[1:], images.dtype)
    chunk = 2048
    for s in range(0, 2 * m, chunk):
        ia, ib = a[s:s + chunk], b[s:s + chunk]
        keep_a = neighbourhood_mask(tips[ia], radius, images.shape[-1])
        keep_b = neighbourhood_mask(tips[ib], radius, images.shape[-1])
        out[s:s + chunk] = np.where(keep_a, images[ia], np.where(keep_b, 0, images[ib]))
    return out, labels[a]


def swapped_sets(images, tips, labels, radii, seed: int = 0) -> dict:
    """`swapped_images` at each radius, keyed ``"swapR"`` as `masked_sets`' are keyed by radius."""
    from sparseflash.experiments.studies.pathx.neighbourhood import NeighbourhoodDataset

    sets = {}
    for r in radii:
        composite, lab = swapped_images(images, tips, labels, r, seed)
        sets[f"swapR{r:g}"] = NeighbourhoodDataset(composite, lab, "zero-shot")
    return sets


def opposite_partners(labels, partner_labels, seed: int = 0) -> np.ndarray:
    """For each of ``labels`` an index into ``partner_labels`` of the other label (random, ``seed``)."""
    labels, partner_labels = np.asarray(labels), np.asarray(partner_labels)
    rng = np.random.default_rng(seed)
    pools = {v: np.flatnonzero(partner_labels != v) for v in (0, 1)}
    if not len(pools[0]) or not len(pools[1]):
        raise ValueError("partners of the other label need partner images of both labels")
    return np.array([rng.choice(pools[int(v)]) for v in labels], np.int64)


def transplant_markers(images, tips, donor_images, donor_tips, radius: float, donor_index=None) -> np.ndarray:
    """``images`` with the pixels within ``radius`` of each marker centre replaced by the donor
    image's pixels at the same offsets from its marker (donor ``donor_index[i]`` for image ``i``,
    default ``i``), the markers of both taken in raster order; offsets outside either image are left
    alone."""
    images, donor_images = np.asarray(images), np.asarray(donor_images)
    if images.shape[1:] != donor_images.shape[1:]:
        raise ValueError(f"images {images.shape} and donor images {donor_images.shape} must have one size")
    donor_index = np.arange(len(images)) if donor_index is None else np.asarray(donor_index)
    size = images.shape[-1]
    r = int(math.floor(radius))
    dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
    disc = dy ** 2 + dx ** 2 <= radius * radius
    dy, dx = dy[disc], dx[disc]
    out = np.array(images)
    for i, j in enumerate(donor_index):
        for (ty, tx), (sy, sx) in zip(sorted(map(tuple, np.asarray(tips[i]).tolist())),
                                      sorted(map(tuple, np.asarray(donor_tips[j]).tolist()))):
            y, x, v, u = ty + dy, tx + dx, sy + dy, sx + dx
            ok = (y >= 0) & (y < size) & (x >= 0) & (x < size) & (v >= 0) & (v < size) & (u >= 0) & (u < size)
            out[i, y[ok], x[ok]] = donor_images[j, v[ok], u[ok]]
    return out


def _input_name(key) -> str:
    """A set's key (a radius, None for whole images, or a named set) as the table's ``input``."""
    return "full" if key is None else key if isinstance(key, str) else f"R{key:g}"


def _input_radius(key) -> float | None:
    """The table's ``radius`` of a set: its radius, a swap set's radius, else None."""
    if isinstance(key, str):
        return float(key[len("swapR"):]) if key.startswith("swapR") else None
    return key


def evaluate_checkpoint(path: Path, sets: dict, device: str, batch_size: int, rescale_pooling: bool = False) -> list[dict]:
    """Accuracy of the checkpoint's model (its own config, ``model.black_is_padding`` as trained) on
    each of `masked_sets`' sets (radius: set; None: whole images). A Path-X (128 px) model on 256 px images
    runs as a Path-256 model with its position grid upsampled 2x2 (`model.load_pretrained`, as the
    recipe's Path-256 fine-tune starts). ``rescale_pooling``: such a model's mean pooling divides by
    the positions it was trained on (16,384), not the input's (65,536), so the pooled vector keeps
    its scale (black-as-padding pooling sums the drawn pixels' outputs over all positions)."""
    import contextlib
    import dataclasses

    import torch

    from sparseflash.experiments.lra.configs import config_from_dict
    from sparseflash.experiments.lra.model import load_pretrained
    from sparseflash.experiments.lra.train import build_model, evaluate
    from sparseflash.experiments.studies.pathx.neighbourhood import TASKS

    ck = load_checkpoint(path)
    if "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path}: not a training checkpoint (needs 'config' and 'model'); give a run's best.pt")
    cfg = config_from_dict(ck["config"])
    res = next(iter(sets.values())).resolution
    if cfg.task not in ("pathx", "path256") or (cfg.task == "path256" and res != 256):
        raise SystemExit(f"{path}: a {cfg.task!r} model; this check takes a Path-X model (128 or 256 px images) "
                         f"or a Path-256 one (256 px images)")
    upsampled = cfg.task != TASKS[res]
    if upsampled:
        cfg.task = TASKS[res]
        cfg.model = dataclasses.replace(cfg.model, seq_len=res * res, grid=(res, res))
    if torch.device(device).type == "cpu":
        cfg.model.attention = "sdpa"  # the same function without the GPU kernels
    model = build_model(cfg.validate())
    load_pretrained(model, ck["model"])  # the whole encoder and head; a smaller (compacted or Path-X) grid upsampled
    if rescale_pooling and upsampled:
        trained = int(np.prod(ck["config"]["model"]["grid"]))
        encode = model.encoder.forward
        model.encoder.forward = lambda tokens, lengths: encode(tokens, lengths) * (tokens.shape[1] / trained)
    model.to(device)
    rows = []
    for r, ds in sets.items():
        t0 = time.perf_counter()
        ev = evaluate(model, ds, batch_size=batch_size, max_batches=None, device=torch.device(device),
                      autocast=contextlib.nullcontext())
        acc, n = float(ev["acc"]), int(ev["n"])
        rows.append({"checkpoint": str(path), "step": ck.get("step"), "input": _input_name(r),
                     "radius": _input_radius(r), "n": n, "acc": round(acc, 4), "se": round(math.sqrt(acc * (1 - acc) / n), 4),
                     "loss": round(float(ev["loss"]), 4), "mean_tokens": round(float(ds.kept_counts().mean()), 1),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{path.parent.parent.name if path.parent.name == 'checkpoints' else path.name}: "
              f"{rows[-1]['input']:>5}: {100 * acc:.1f} +- {100 * rows[-1]['se']:.1f}% "
              f"({rows[-1]['mean_tokens']:.0f} tokens an image, {rows[-1]['seconds']} s)", flush=True)
    return rows


def plot(out: Path, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(dict.fromkeys(r["label"] for r in rows))
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    for name in names:
        rs = {r["input"]: r for r in rows if r["label"] == name}
        xs = [i for i, k in enumerate(inputs) if k in rs]
        ys = [100 * rs[inputs[i]]["acc"] for i in xs]
        es = [100 * rs[inputs[i]]["se"] for i in xs]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name)
    ax.axhline(50, color="gray", ls=":", lw=0.8)
    ax.set_xticks(range(len(inputs)), [f"{k}\n({np.mean([r['mean_tokens'] for r in rows if r['input'] == k]):.0f} tokens)"
                                       for k in inputs])
    notes = ["input: pixels within R of either marker, or the whole image"]
    if any(k.startswith("swap") for k in inputs):
        notes.append("swapR: one image's marker neighbourhoods in an image of the other label")
    if any(k.startswith("markers-from") for k in inputs):
        notes.append("markers-from-X: whole images, marker discs drawn by generator X (from the other label)")
    ax.set_xlabel("\n".join(notes), fontsize=8)
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("Trained models on fresh images of other inputs, no further training")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "zero_shot.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="*", type=Path, help="best.pt of neighbourhood (or Path-X) runs")
    ap.add_argument("--labels", nargs="*", default=None, help="a name for each checkpoint in the table and figure")
    ap.add_argument("--num", type=int, default=2000, help="fresh images to evaluate on (default 2000)")
    ap.add_argument("--seed", type=int, default=1, help="their seed (default 1; the training images used 0)")
    ap.add_argument("--radii", nargs="+", type=radius_arg, default=[6.0, 12.0, 24.0, None],
                    help="radii in pixels, 'full' for the whole image (default 6 12 24 full)")
    ap.add_argument("--resolution", type=int, choices=(128, 256), default=128,
                    help="128 (Path-X, default) or 256 (Path-256; a Path-X model's grid upsampled 2x2)")
    ap.add_argument("--swap", nargs="+", type=float, default=[], metavar="R",
                    help="also the swap test at these radii (docstring): A's marker neighbourhoods in B's image")
    ap.add_argument("--markers-from", choices=("release", "clean"), default=None,
                    help="also the whole images with their marker discs drawn by this generator (docstring)")
    ap.add_argument("--rescale-pooling", action="store_true",
                    help="with --resolution 256 and a Path-X model: mean pooling over the 16,384 positions it was "
                         "trained on, not 65,536 (tells a scale mismatch from a lost cue)")
    ap.add_argument("--fidelity", choices=("release", "clean"), default="release",
                    help="generator of the images (default release, the training images'; clean: the cross-evaluation)")
    ap.add_argument("--workers", type=int, default=2, help="processes drawing the images (default 2)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"image cache folder (default {DEFAULT_CACHE})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    ap.add_argument("--device", default=None, help="cpu or cuda (default cuda if available)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--replot", action="store_true", help="redraw OUT/zero_shot.png from OUT/zero_shot.json and stop")
    a = ap.parse_args(argv)
    if a.replot:
        rows = json.loads((a.out / "zero_shot.json").read_text())["rows"]
        print(f"wrote {plot(a.out, rows)}", flush=True)
        return 0
    if not a.checkpoints:
        ap.error("give at least one checkpoint (or --replot)")
    if a.labels is not None and len(a.labels) != len(a.checkpoints):
        ap.error(f"--labels: {len(a.labels)} names for {len(a.checkpoints)} checkpoints")
    if a.markers_from == a.fidelity:
        ap.error(f"--markers-from {a.markers_from}: the images are already {a.fidelity}; name the other generator")
    if any(r <= 0 for r in a.swap):
        ap.error(f"--swap: radii must be positive, got {' '.join(f'{r:g}' for r in a.swap)}")
    if a.num < 2:
        ap.error(f"--num must be at least 2, got {a.num}")
    for c in a.checkpoints:
        if not c.is_file():
            ap.error(f"checkpoint {c}: no such file")
    import torch

    from sparseflash.experiments.studies.pathx.neighbourhood import load_or_generate

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    images, tips, labels, _ = load_or_generate(a.cache, a.num, a.seed, a.workers, fidelity=a.fidelity,
                                               resolution=a.resolution)
    sets = masked_sets(images, tips, labels, a.radii)
    sets.update(swapped_sets(images, tips, labels, a.swap, a.seed))
    if a.markers_from:
        from sparseflash.experiments.lra.data import pathfinder as pf
        from sparseflash.experiments.studies.pathx.neighbourhood import NeighbourhoodDataset

        donor, donor_tips, donor_labels, _ = load_or_generate(a.cache, a.num, a.seed, a.workers,
                                                              fidelity=a.markers_from, resolution=a.resolution)
        # donors of the other label: a disc's snake pixels cannot hand an image its own label
        partners = opposite_partners(labels, donor_labels, a.seed)
        radius = pf.RESOLUTIONS[a.resolution]["marker_radius"] + 1
        sets[f"markers-from-{a.markers_from}"] = NeighbourhoodDataset(
            transplant_markers(images, tips, donor, donor_tips, radius, partners), labels, "zero-shot")
    rows = []
    for i, c in enumerate(a.checkpoints):
        label = a.labels[i] if a.labels else str(c)
        rows += [dict(r, label=label) for r in evaluate_checkpoint(c, sets, device, a.batch_size, a.rescale_pooling)]
    from sparseflash.experiments.bench.results import write_tidy
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta

    meta = {"num": a.num, "seed": a.seed, "resolution": a.resolution, "swap": a.swap, "markers_from": a.markers_from,
            "rescale_pooling": a.rescale_pooling,
            "fidelity": a.fidelity, "device": device, **run_meta(argv)}
    write_tidy(rows, meta, a.out, "zero_shot", "pathx-zero-shot/1")
    print(f"wrote {a.out / 'zero_shot.csv'}, .json, {plot(a.out, rows).name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
