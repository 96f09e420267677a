"""Does a Pathfinder model trace the path? The cut test, the swap test and cue-balanced sets, at any resolution.

    PYTHONPATH=. python experiments/studies/pathx/cue_tests.py [CHECKPOINT ...] --resolution 32|64|128|256 \\
        [--labels NAME ...] [--num 2000] [--seed 2] [--stream 57] [--swap R ...] [--balance-pool 8000] --out DIR

Fresh hard release images (``--seed``, default 2: the training sets used 0, the earlier fresh
sets 1) are drawn with the generator's layers on the generator stream ``--stream`` (default
``STREAM``, 57: the interventions' images), and each checkpoint is evaluated, unchanged. A
checkpoint is a ``sparseflash lra train`` or ``neighbourhood.py`` run's ``best.pt`` of the image's
task (Pathfinder-32 / 64, Path-X, Path-256), an exported ``model.pt`` or the folder holding one
(``experiments/lra/weights/<run>/``, `experiments/lra/weights.py`; its label defaults to the
folder's name). Stream 56 (``HELD_OUT``) holds the untouched sets of issue 68, which no model
has answered yet: they are for the final scores, used once (``--stream 56``), not for these tests.
The sets:

- ``fresh``: the images as drawn (accuracy).
- ``cut``: ``interventions.cut`` on the positives (the marked snake severed by taking out paddles
  more than ``--radius`` from both markers) and ``interventions.join`` on the negatives (the two
  target snakes joined by a stroke that far from the markers); every pixel within the radius of a
  marker keeps its value. Per class: the *follow rate* (share of answers equal to the changed
  image's label: 0 for a cut positive, 1 for a joined negative) and the *flip rate* (share of
  answers that differ from the answer on the same image unchanged). A path tracer follows; a
  reader of the marker neighbourhoods does not (follow rate = 1 - its accuracy on that class).
  Images where no valid cut or join exists are left out and counted (``n_skipped``).
- ``control``: the matched control (`interventions.control_cut`): as many pixels of a distractor
  taken out, as far from the markers, none on the target snakes, so the label stays; per class the
  flip rate (beside the cut's: a model that flips as often here reacts to any edit of that size)
  and the accuracy.
- ``dashed-join``: negatives joined by paddle-like dashes from one target snake's free end to the
  other's (`interventions.dashed_join`; no T-junction, no solid stroke): follow and flip as for
  the join.
- ``swapR`` (``--swap R``): `zero_shot.swapped_images`: each image's marker neighbourhoods (radius R)
  pasted into an image of the other label; accuracy is the share of answers that follow the
  pasted neighbourhoods.
- ``balanced``: ``interventions.balance`` of a pool of ``--balance-pool`` images on the marker
  coordinates (`probe.marker_coords`) and the end-paddle cosine (`interventions.paddle_cosine`), so
  neither carries label information; the shortcut probe retrained on the balanced set measures
  that (``balance_probe.csv``: the coordinate MLP, the one-threshold paddle-direction rule and,
  as a check on what balancing leaves, the marker-patch MLP, held out, before and after
  balancing). This part needs no checkpoint.

The six committed Pathfinder-32 exports (seeds 0-2, dense and butterfly 0.5; the run of
``results/cue_tests_pf32``, 30 minutes on 2 CPU cores; results in the study's README):

    OMP_NUM_THREADS=2 PYTHONPATH=. python experiments/studies/pathx/cue_tests.py experiments/lra/weights/dense-bip-s{0,1,2} \
        experiments/lra/weights/butterfly-bip-s{0,1,2} --resolution 32 --num 3000 --balance-pool 8000 --swap 5 7.5 \
        --device cpu --workers 2 --threads 2 --out experiments/studies/pathx/results/cue_tests_pf32

The Path-X / Path-256 headline models (their checkpoints are not kept in the repository; the paths
are where the campaigns write them, as `experiments/studies/pathx/results/*/zero_shot.json` name them):

    python experiments/studies/pathx/cue_tests.py pxstate/nb-cont-lr3e-4/runs/cont-lr3e-4-1-full/checkpoints/best.pt \
        pxstate/nb-cont-dense/runs/cont-dense-1-full/checkpoints/best.pt pxstate/nb-cont-bfly/runs/cont-bfly-1-full/checkpoints/best.pt \
        --labels dense-lr3e-4 dense butterfly --resolution 128 --workers 16 --out OUT/r128
    python experiments/studies/pathx/cue_tests.py pxstate/nb-p256-sincos-stages/runs/sincos-stages-9-full/checkpoints/best.pt \
        --labels sincos-lr3e-4 --resolution 256 --workers 16 --out OUT/r256

Writes ``OUT/cue_tests.csv`` / ``.json`` (one row a checkpoint and set), ``OUT/balance_probe.csv``
/ ``.json`` and prints a table last. On a CPU the faithful attention becomes SDPA (as in
``zero_shot.py``); evaluation has no dropout, so the function is the same.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from sparseflash.experiments.lra.checkpoints import load_checkpoint

TASK_OF = {32: "pathfinder32", 64: "pathfinder64", 128: "pathx", 256: "path256"}
STREAM = 57  # the generator stream of the intervention sets (weights.py's evaluation sets use 68)
HELD_OUT = 56  # the untouched sets (issue 68): the final scores, used once
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cue_tests"


# ----------------------------------------------------------------------------- the image sets
def _chunk(job):
    """One generator chunk of fresh images with their cut/joined versions and cue features."""
    from sparseflash.experiments.lra.data import interventions as iv
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.probe import marker_coords, marker_patches, patch_half

    seed, chunk, count, fidelity, res, radius, n_paddles, controls, stream = job
    p = pf.params_for(res, "hard", fidelity)
    labels = [(chunk * pf.CHUNK[res] + i) % 2 for i in range(pf.CHUNK[res])]
    made = pf.render_many(p, np.random.default_rng([seed, res, stream, chunk]), labels, True)[:count]
    images = np.stack([img for img, _ in made]).astype(np.uint8)
    tips = np.asarray([[tuple(int(v) for v in t) for t in lay["tips"]] for _, lay in made], np.int16)
    changed, ok = np.zeros_like(images), np.zeros(len(made), bool)
    control, control_ok = np.zeros_like(images), np.zeros(len(made), bool)
    dashed, dashed_ok = np.zeros_like(images), np.zeros(len(made), bool)
    for i, (img, lay) in enumerate(made):
        r = iv.cut(img, lay, p, radius=radius, n_paddles=n_paddles) if labels[i] else iv.join(img, lay, p, radius=radius)
        if r is not None:
            changed[i], ok[i] = r[0], True
        if controls:  # the same size of edit on a distractor; the join as dashes from snake end to snake end
            c = iv.control_cut(img, lay, p, radius=radius, n_paddles=n_paddles, match=r[1]["changed"] if r else None)
            if c is not None:
                control[i], control_ok[i] = c[0], True
            d = None if labels[i] else iv.dashed_join(img, lay, p, radius=radius)
            if d is not None:
                dashed[i], dashed_ok[i] = d[0], True
    cos = np.asarray([iv.paddle_cosine(lay) for _, lay in made], np.float32)
    return (images, tips, np.asarray(labels[:count], np.int8), changed, ok, marker_coords(tips, res), cos,
            marker_patches(images, tips, patch_half(res)), control, control_ok, dashed, dashed_ok)


def make_images(resolution: int, num: int, seed: int, *, fidelity: str = "release", workers: int = 1,
                radius: float | None = None, n_paddles: int = 2, show_progress: bool = False,
                controls: bool = True, stream: int = STREAM) -> dict:
    """``num`` fresh hard images (generator stream ``stream``) and what the tests need: ``images``, ``tips``, ``labels``,
    ``changed`` (the cut / joined image, where ``ok``), ``ok``, ``coords`` ``[n, 4]``, ``cos`` ``[n]``,
    ``patches`` (`probe.marker_patches`); with ``controls`` also ``control`` / ``control_ok``
    (`interventions.control_cut` matched to the image's cut or join) and ``dashed`` / ``dashed_ok``
    (`interventions.dashed_join`, negatives)."""
    from sparseflash.experiments.lra.data import interventions as iv
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.data._parallel import run_ordered

    if resolution not in TASK_OF:
        raise ValueError(f"resolution must be one of {tuple(TASK_OF)}, got {resolution!r}")
    if num < 2:
        raise ValueError(f"num must be at least 2, got {num}")
    radius = iv.default_radius(resolution) if radius is None else float(radius)
    K = pf.CHUNK[resolution]
    jobs = [(seed, c, min(K, num - c * K), fidelity, resolution, radius, n_paddles, controls, stream)
            for c in range(-(-num // K))]
    parts = list(run_ordered(_chunk, jobs, workers, f"cue tests {resolution}px {fidelity}", total=num,
                             weight=lambda r: len(r[2]), show_progress=show_progress))
    keys = ("images", "tips", "labels", "changed", "ok", "coords", "cos", "patches", "control", "control_ok",
            "dashed", "dashed_ok")
    out = {k: np.concatenate([part[i] for part in parts]) for i, k in enumerate(keys)}
    out.update(resolution=resolution, radius=radius, n_paddles=n_paddles, fidelity=fidelity, seed=seed, stream=stream)
    return out


def balance_probe(data: dict, *, seed: int = 0, bins: int = 20, epochs: int = 60) -> tuple[np.ndarray, list[dict]]:
    """(indices of the balanced subset, probe rows): the shortcut probe's MLP (`probe.fit_mlp`) on
    the marker coordinates and on the marker patches, and the paddle-direction threshold rule
    (`rim_probe.threshold_accuracy`), each fitted on 75% and tested on 25%, on all images and on
    the balanced subset (balanced on the coordinates and the paddle direction, not the patches).
    A second learner on the patches (`probe.fit_cnn`, a small CNN, rows ``learner`` "cnn"): on the
    probe's patches and on wider ones (radius + 2 px: the swap test's 7.5 px at 32 px)."""
    from sparseflash.experiments.lra.data.interventions import balance
    from sparseflash.experiments.lra.probe import fit_cnn, fit_mlp, marker_patches, patch_half
    from sparseflash.experiments.studies.pathx.rim_probe import threshold_accuracy

    feats = np.concatenate([data["coords"], data["cos"][:, None]], 1)
    labels = data["labels"].astype(np.int64)
    keep = balance(feats, labels, bins=bins, seed=seed)
    half = patch_half(data["resolution"])
    wide = marker_patches(data["images"], data["tips"], half + 2)
    rows = []
    for name, idx in (("all", np.arange(len(labels))), ("balanced", keep)):
        perm = np.random.default_rng([seed, 7]).permutation(idx)
        n_test = len(perm) // 4
        te, tr = perm[:n_test], perm[n_test:]
        if n_test < 2 or len(np.unique(labels[tr])) < 2:
            raise ValueError(f"the {name} set has {len(idx)} images: too few to probe (draw more with --balance-pool)")
        for feature, learner, acc in (
                ("coords", "mlp", fit_mlp(data["coords"][tr], labels[tr], data["coords"][te], labels[te],
                                          epochs=epochs, seed=seed)),
                ("paddle-directions", "threshold", threshold_accuracy(data["cos"][tr], labels[tr], data["cos"][te],
                                                                      labels[te])),
                ("patches", "mlp", fit_mlp(data["patches"][tr], labels[tr], data["patches"][te], labels[te],
                                           epochs=epochs, seed=seed)),
                ("patches", "cnn", fit_cnn(data["patches"][tr], labels[tr], data["patches"][te], labels[te],
                                           side=2 * half + 1, seed=seed)),
                (f"patches-r{half + 2}", "cnn", fit_cnn(wide[tr], labels[tr], wide[te], labels[te],
                                                         side=2 * half + 5, seed=seed))):
            rows.append({"resolution": data["resolution"], "fidelity": data["fidelity"], "set": name,
                         "feature": feature, "learner": learner, "n": int(len(idx)), "n_test": int(n_test),
                         "positives": float(labels[idx].mean()), "acc": round(float(acc), 4),
                         "se": round(math.sqrt(acc * (1 - acc) / n_test), 4)})
    return keep, rows


# ----------------------------------------------------------------------------- the models
def checkpoint_file(path) -> Path:
    """``path`` itself, or ``path/model.pt`` when ``path`` is an exported run's folder."""
    path = Path(path)
    return path / "model.pt" if path.is_dir() else path


def default_label(path) -> str:
    """A checkpoint's name in the table: an export's folder name (``.../weights/dense-bip-s0``), else the path."""
    path = Path(path)
    if path.is_dir():
        return path.name
    return path.parent.name if path.name == "model.pt" else str(path)


def load_model(path: Path, resolution: int, device: str):
    """The checkpoint's model in eval mode (a task of ``resolution``; SDPA attention on a CPU).

    Loaded through `model.load_pretrained`, as ``zero_shot.py`` and every curriculum stage load: a
    curriculum stage's ``best.pt`` keeps its frozen position table compacted to its source
    (`neighbourhood.compact_grid`: 128x128 stored as 64x64), which is upsampled back here; any other
    mismatch with the model the config builds is an error."""
    import torch

    from sparseflash.experiments.lra.configs import config_from_dict
    from sparseflash.experiments.lra.model import load_pretrained
    from sparseflash.experiments.lra.train import build_model

    path = checkpoint_file(path)
    ck = load_checkpoint(path)
    if "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path}: not a training checkpoint (needs 'config' and 'model'); give a run's best.pt")
    cfg = config_from_dict(ck["config"])
    if cfg.task != TASK_OF[resolution]:
        raise SystemExit(f"{path}: a {cfg.task!r} model; --resolution {resolution} takes a {TASK_OF[resolution]!r} one")
    if torch.device(device).type == "cpu":
        cfg.model.attention = "sdpa"  # the same function without the GPU kernels
    model = build_model(cfg.validate())
    own = set(model.state_dict())
    if set(ck["model"]) != own:  # load_pretrained would leave a head fresh or skip one: not this model's weights
        raise SystemExit(f"{path}: the weights do not fit the model its config builds (missing "
                         f"{sorted(own - set(ck['model']))}, unexpected {sorted(set(ck['model']) - own)})")
    try:
        load_pretrained(model, ck["model"])  # a compacted (block-constant) position grid upsampled again
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None
    return model.to(device).eval(), ck.get("step")


def predict(model, images: np.ndarray, device: str, batch_size: int = 64) -> np.ndarray:
    """The model's answers (int64 ``[n]``) on uint8 images ``[n, R, R]``, read as the loader reads
    them (gray level + 1, raster order; bf16 autocast on a GPU, as in training)."""
    import contextlib

    import torch

    dev = torch.device(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
    out = []
    with torch.no_grad():
        for s in range(0, len(images), batch_size):
            x = torch.from_numpy(np.asarray(images[s:s + batch_size]).reshape(-1, images.shape[1] * images.shape[2])
                                 .astype(np.int64) + 1).to(dev)
            lengths = torch.full((len(x),), x.shape[1], dtype=torch.long, device=dev)
            with autocast:
                out.append(model(x, lengths).argmax(-1).cpu())
    return torch.cat(out).numpy() if out else np.zeros(0, np.int64)


def _rate(x) -> float:
    return round(float(np.mean(x)), 4) if len(x) else float("nan")


def _se(p, n) -> float:
    return round(math.sqrt(p * (1 - p) / n), 4) if n else float("nan")


def score(pred: np.ndarray, pred_changed: np.ndarray, data: dict, swaps: dict, balanced: tuple,
          pred_control: np.ndarray | None = None, pred_dashed: np.ndarray | None = None) -> list[dict]:
    """The table's rows of one model: ``pred`` on every fresh image, ``pred_changed`` on the
    cut / joined ones (``data["ok"]``), ``swaps`` {name: (predictions, labels)}, ``balanced``
    (predictions, labels) on the balanced set; ``pred_control`` on the control-cut images
    (``data["control_ok"]``: set ``control``, per class the flip rate, beside the cut's, and the
    accuracy, the label unchanged) and ``pred_dashed`` on the dashed joins (``data["dashed_ok"]``,
    negatives: set ``dashed-join``, follow and flip as for the join)."""
    labels, ok = data["labels"].astype(np.int64), data["ok"]
    rows = [{"set": "fresh", "class": "all", "n": len(labels), "acc": _rate(pred == labels),
             "se": _se(np.mean(pred == labels), len(labels))}]
    for cls, name in ((1, "cut positives"), (0, "joined negatives")):
        sel = ok[labels == cls]
        orig, new = pred[labels == cls][sel], pred_changed[labels[ok] == cls]
        follow = new == 1 - cls
        rows.append({"set": "cut", "class": name, "n": int(sel.sum()), "n_skipped": int((~sel).sum()),
                     "acc_unchanged": _rate(orig == cls), "follow": _rate(follow), "se": _se(np.mean(follow), len(follow)),
                     "flip": _rate(new != orig)})
    if pred_control is not None:
        cok = data["control_ok"]
        for cls, name in ((1, "positives"), (0, "negatives")):
            sel = cok[labels == cls]
            orig, new = pred[labels == cls][sel], pred_control[labels[cok] == cls]
            flip = new != orig
            rows.append({"set": "control", "class": name, "n": int(sel.sum()), "n_skipped": int((~sel).sum()),
                         "acc_unchanged": _rate(orig == cls), "acc": _rate(new == cls), "flip": _rate(flip),
                         "se": _se(np.mean(flip), len(flip)) if len(flip) else float("nan")})
    if pred_dashed is not None:
        dok = data["dashed_ok"]
        sel = dok[labels == 0]
        orig, new = pred[labels == 0][sel], pred_dashed
        follow = new == 1
        rows.append({"set": "dashed-join", "class": "joined negatives", "n": int(sel.sum()),
                     "n_skipped": int((~sel).sum()), "acc_unchanged": _rate(orig == 0), "follow": _rate(follow),
                     "se": _se(np.mean(follow), len(follow)) if len(follow) else float("nan"), "flip": _rate(new != orig)})
    for name, (p, lab) in swaps.items():
        rows.append({"set": name, "class": "all", "n": len(lab), "acc": _rate(p == lab), "se": _se(np.mean(p == lab), len(lab))})
    bp, bl = balanced
    rows.append({"set": "balanced", "class": "all", "n": len(bl), "acc": _rate(bp == bl), "se": _se(np.mean(bp == bl), len(bl))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="*", type=Path,
                    help="best.pt of runs of the resolution's task, exported model.pt or their folders "
                         "(experiments/lra/weights/<run>); none: the probe part only")
    ap.add_argument("--labels", nargs="*", default=None, help="a name for each checkpoint")
    ap.add_argument("--resolution", type=int, choices=tuple(TASK_OF), required=True)
    ap.add_argument("--num", type=int, default=2000, help="fresh images (default 2000)")
    ap.add_argument("--seed", type=int, default=2, help="their seed (default 2; training used 0, earlier fresh sets 1)")
    ap.add_argument("--stream", type=int, default=STREAM,
                    help=f"their generator stream (default {STREAM}; {HELD_OUT}: the untouched sets, for the final scores only)")
    ap.add_argument("--fidelity", choices=("release", "clean"), default="release")
    ap.add_argument("--radius", type=float, default=None,
                    help="nothing changes within this many px of a marker (default 1.5 x the probe's patch half-size)")
    ap.add_argument("--n-paddles", type=int, default=2, help="paddles a cut takes out (default 2)")
    ap.add_argument("--swap", nargs="*", type=float, default=None, metavar="R",
                    help="swap-test radii (default: the probe's patch half-size, ceil(marker radius) + 3)")
    ap.add_argument("--balance-pool", type=int, default=8000, help="images drawn for the balanced set (default 8000)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default=None, help="cpu or cuda (default cuda if available)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if a.labels is not None and len(a.labels) != len(a.checkpoints):
        ap.error(f"--labels: {len(a.labels)} names for {len(a.checkpoints)} checkpoints")
    if a.num < 2 or a.balance_pool < 16:
        ap.error("--num must be at least 2 and --balance-pool at least 16")
    if a.radius is not None and a.radius <= 0:
        ap.error(f"--radius must be positive, got {a.radius}")
    if a.n_paddles < 1:
        ap.error(f"--n-paddles must be at least 1, got {a.n_paddles}")
    for c in a.checkpoints:
        if not checkpoint_file(c).is_file():
            ap.error(f"checkpoint {c}: no such file" + (" (a folder without model.pt)" if c.is_dir() else ""))
    import torch

    from sparseflash.experiments.bench.results import write_tidy
    from sparseflash.experiments.lra.data.pathfinder import RESOLUTIONS
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta
    from sparseflash.experiments.studies.pathx.zero_shot import swapped_images

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    swap_radii = a.swap if a.swap is not None else [float(math.ceil(RESOLUTIONS[a.resolution]["marker_radius"]) + 3)]
    t0 = time.perf_counter()
    data = make_images(a.resolution, a.num, a.seed, fidelity=a.fidelity, workers=a.workers, radius=a.radius,
                       n_paddles=a.n_paddles, stream=a.stream)
    pool = make_images(a.resolution, a.balance_pool, a.seed + 100, fidelity=a.fidelity, workers=a.workers,
                       radius=a.radius, n_paddles=a.n_paddles, controls=False, stream=a.stream)
    balanced, probe_rows = balance_probe(pool, seed=a.seed)
    made_s = round(time.perf_counter() - t0, 1)
    meta = {"resolution": a.resolution, "num": a.num, "seed": a.seed, "stream": a.stream, "balance_pool": a.balance_pool,
            "balance_seed": a.seed + 100, "fidelity": a.fidelity, "radius": data["radius"], "n_paddles": a.n_paddles,
            "swap": swap_radii, "device": device, "images_s": made_s,
            "cut_positives": int(data["ok"][data["labels"] == 1].sum()), "positives": int((data["labels"] == 1).sum()),
            "joined_negatives": int(data["ok"][data["labels"] == 0].sum()), "negatives": int((data["labels"] == 0).sum()),
            "control_cuts": int(data["control_ok"].sum()),
            "dashed_joins": int(data["dashed_ok"][data["labels"] == 0].sum()),
            "gpu": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None, **run_meta(argv)}
    write_tidy(probe_rows, meta, a.out, "balance_probe", "cue-tests-balance-probe/1")
    rows = []
    swap_sets = {f"swapR{r:g}": swapped_images(data["images"], data["tips"], data["labels"], r, a.seed) for r in swap_radii}
    for i, c in enumerate(a.checkpoints):
        model, step = load_model(c, a.resolution, device)
        t1 = time.perf_counter()
        pred = predict(model, data["images"], device, a.batch_size)
        pred_changed = predict(model, data["changed"][data["ok"]], device, a.batch_size)
        pred_control = predict(model, data["control"][data["control_ok"]], device, a.batch_size)
        pred_dashed = predict(model, data["dashed"][data["dashed_ok"]], device, a.batch_size)
        swaps = {k: (predict(model, im, device, a.batch_size), lab.astype(np.int64)) for k, (im, lab) in swap_sets.items()}
        bal = (predict(model, pool["images"][balanced], device, a.batch_size), pool["labels"][balanced].astype(np.int64))
        label = a.labels[i] if a.labels else default_label(c)
        for r in score(pred, pred_changed, data, swaps, bal, pred_control, pred_dashed):
            rows.append({"label": label, "checkpoint": str(checkpoint_file(c)), "step": step, **r,
                         "seconds": round(time.perf_counter() - t1, 1)})
    if rows:
        write_tidy(rows, meta, a.out, "cue_tests", "cue-tests/1")
    print(f"\n{a.resolution} px {a.fidelity}, seed {a.seed}, stream {a.stream}: {int(data['ok'].sum())} of {a.num} images cut or joined "
          f"(radius {data['radius']:g} px), balanced set {len(balanced)} of {a.balance_pool} images ({made_s} s)")
    for r in probe_rows:
        print(f"  probe {r['feature']:17s} {r['learner']:9s} on {r['set']:8s} ({r['n']:5d} images): {100 * r['acc']:.1f} +- {100 * r['se']:.1f}%")
    for r in rows:
        what = (f"follow {100 * r['follow']:.1f}% flip {100 * r['flip']:.1f}% (n {r['n']}, unchanged acc "
                f"{100 * r['acc_unchanged']:.1f}%)" if "follow" in r else
                f"flip {100 * r['flip']:.1f}% acc {100 * r['acc']:.1f}% (n {r['n']})" if r["set"] == "control" else
                f"acc {100 * r['acc']:.1f} +- {100 * r['se']:.1f}% (n {r['n']})")
        print(f"  {r['label'][:24]:24s} {r['set']:9s} {r['class']:16s} {what}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
