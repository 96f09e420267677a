"""Can the Path-X Transformer learn the marker-neighbourhood cue when it sees only the neighbourhoods?

    PYTHONPATH=. python experiments/studies/pathx/neighbourhood.py --num 20000 --radius 6 \\
        --runs scratch pretrained-frozen pretrained --minutes 12 [--device cpu|cuda] [--out DIR]

The probe (`experiments/lra/probe.py`) found that the gray levels around the two markers of a hard
128 px Pathfinder image predict its label at ~75% (the relative direction of the two end paddles),
while the faithful Path-X Transformer stays at chance on whole images. This script asks whether
that Transformer learns the cue at all when it is given nothing else:

1. Data: ``--num`` hard release-fidelity 128 px images (``--resolution 256``: Path-256's, with its
   config and a 256x256 position grid, a Path-X checkpoint's grid upsampled 2x2; cached as
   ``path256-hard-release-...``) drawn by the generator with their layers
   (true marker centres ``tips``), balanced labels (alternating within each chunk of 10), chunk c
   from the seed ``(seed, resolution, 17, c)``, over ``--workers`` processes; split 80 / 10 / 10 by a
   permutation seeded with ``seed``. Cached as ``CACHE/pathx-hard-release-n{num}-s{seed}.*.npy``.
2. Mask: every pixel farther than ``--radius`` (Euclidean, pixel centres, default the probe's
   k = ceil(marker radius) + 3 = 6) from both marker centres is set to black; ``--keep full`` keeps
   the whole image (the control; slow on a CPU).
3. Tokens exactly as the Path-X loader (`LRADataset` of ``get_dataset("pathx", ...)``): gray level
   + 1 in raster order, 16,384 of them, ``length`` 16,384, pad id 0, vocabulary 257. With
   ``model.black_is_padding`` the model drops the black pixels (token 1), so it attends to the
   few hundred kept pixels at their true 128x128 grid positions.
4. Train: ``get_config("pathx", "faithful")`` with ``model.black_is_padding=True`` (dense
   attention, the faithful recipe's lr 1e-4, batch 32, cosine with one warm-up epoch) on
   ``train.steps`` = ``--steps``; on a CPU ``model.attention=sdpa`` (on CUDA the faithful
   ``sparseflash``, or ``--attention``). Presets (``--runs``): ``scratch`` (fresh weights),
   ``pretrained`` (``--init-from``, the Pathfinder-64 weights, position grid upsampled 2x2),
   ``pretrained-frozen`` (the same with ``train.freeze=("encoder.pos",)``); ``--freeze`` adds
   prefixes to every run. ``--minutes`` sizes ``--steps`` from a measured step time when
   ``--steps`` is not given, and is a deadline in any case.
5. Beside it, the probe's MLP (`probe.fit_mlp`) on the same train / test images: the two
   (2R+1)^2 square patches around the markers (raster order) of the masked image, i.e. exactly
   the pixels the Transformer sees, the same held-out test images.
6. Out: ``OUT/runs/<tag>/`` (the training run: train.csv, eval.csv, summary.json, checkpoints),
   ``OUT/probe-<data tag>.json``, and the table of every run in OUT, rebuilt at the end of each
   command: ``neighbourhood.csv`` / ``.json`` (settings, steps, wall time, held-out accuracy with
   its standard error sqrt(p (1 - p) / n), the curve files) and ``neighbourhood.png`` (training and
   validation accuracy against steps, the MLP's held-out accuracy as a horizontal line).
   ``--report-only`` rebuilds just the table and figure (e.g. after runs started side by side).
7. A curriculum (``--radius-stages 9 12 16 24 full``, one preset: the first stage from ``--init-from``,
   or from fresh weights with ``scratch``, whose later stages run as ``pretrained``):
   one run a stage, in order, each on the same images masked at the stage's radius (``full``: the
   whole image, the real Path-X input) and initialised from the previous stage's best-on-val
   weights (the first from ``--init-from``), checkpoints kept; each stage gets ``--stage-minutes``
   (one value, or one a stage)
   (default: the minutes left shared equally among the stages not yet run), and a later command
   skips the stages already done. ``--no-probe``
   skips the probe MLP (a minute a radius on 100K images).
8. ``--export-weights DIR``: when a run finishes (a curriculum: when its last stage does), its
   best-on-val weights go to ``DIR/<run name>/`` in bf16 (``model.pt``, ``config.json``:
   `lra.weights.export_run`), once; ``neighbourhood_gpus.sh`` passes ``STATE/weights``, whose
   folders are committed under ``experiments/lra/weights/``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sparseflash.experiments.lra.checkpoints import load_checkpoint
from sparseflash.experiments.lra.probe import marker_patches, patch_half  # the probe's features

RES = 128  # the default resolution (Path-X); --resolution 256: Path-256
TASKS = {128: "pathx", 256: "path256"}  # resolution: the LRA task (config, position grid) of its images
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_OUT = HERE / "results" / "neighbourhood"
DEFAULT_CACHE = REPO / "runs" / "neighbourhood-cache"  # /runs/ is git-ignored
DEFAULT_INIT = REPO / "pxstate" / "pretrain" / "checkpoints" / "best.pt"
PRESETS = {  # name: (start from --init-from, freeze the position table)
    "scratch": (False, False),
    "pretrained": (True, False),
    "pretrained-frozen": (True, True),
}
STREAM = 17  # the generator stream of this study's images (the probe uses 3)
COLUMNS = ["tag", "preset", "resolution", "keep", "radius", "num", "n_train", "n_val", "n_test", "init_from", "freeze", "overrides", "pos_emb", "lr",
           "batch_size", "schedule_steps", "steps", "warmup_steps", "attention", "attn_dropout", "device", "threads", "wall_s",
           "step_ms", "mean_tokens", "train_acc_last", "val_best", "val_best_step", "test_acc", "test_se",
           "test_final_acc", "test_final_se", "mlp_acc", "mlp_se", "mlp_features", "curve_train", "curve_eval",
           "commit", "date", "torch", "cpu"]


def default_radius(resolution: int = RES) -> int:
    """The probe's patch half-size k = ceil(marker radius) + 3 (6 at 128 px, 8 at 256)."""
    return patch_half(resolution)


# ------------------------------------------------------------------------------------------ data
def _chunk(job):
    """Images, marker centres and labels of one generator chunk (10 images at 128 or 256 px)."""
    from sparseflash.experiments.lra.data import pathfinder as pf

    seed, chunk, count, fidelity, res = job
    p = pf.params_for(res, "hard", fidelity)
    labels = [(chunk * pf.CHUNK[res] + i) % 2 for i in range(pf.CHUNK[res])]
    made = pf.render_many(p, np.random.default_rng([seed, res, STREAM, chunk]), labels, True)[:count]
    images = np.stack([img for img, _ in made]).astype(np.uint8)
    tips = np.asarray([[tuple(int(v) for v in t) for t in lay["tips"]] for _, lay in made], np.int16)
    return images, tips, np.asarray(labels[:count], np.int8)


def generate(num: int, seed: int = 0, workers: int = 1, show_progress: bool = True, fidelity: str = "release",
             resolution: int = RES):
    """(images uint8 [num, res, res], tips int16 [num, 2, 2] as (y, x), labels int8 [num]) of hard
    ``resolution`` px images (128: Path-X, 256: Path-256) of the generator's ``fidelity`` ("release",
    this study's data, or "clean")."""
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.data._parallel import run_ordered

    if resolution not in TASKS:
        raise ValueError(f"resolution must be one of {tuple(TASKS)}, got {resolution!r}")
    K = pf.CHUNK[resolution]
    jobs = [(seed, c, min(K, num - c * K), fidelity, resolution) for c in range(-(-num // K))]
    parts = list(run_ordered(_chunk, jobs, workers, f"{TASKS[resolution]} hard {fidelity} {num} images", total=num,
                             weight=lambda r: len(r[2]), show_progress=show_progress))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def load_or_generate(cache: Path, num: int, seed: int, workers: int, show_progress: bool = True,
                     fidelity: str = "release", resolution: int = RES):
    """`generate`'s arrays, read from ``cache`` when a previous command made them: three ``.npy``
    files ``CACHE/<task>-hard-<fidelity>-n<num>-s<seed>.{images,tips,labels}.npy``, the images
    memory-mapped read-only (runs side by side share one copy through the page cache, and a 6.5 GB
    Path-256 set opens at once instead of decompressing in every process). A ``.npz`` of the same
    name (what earlier commits wrote) is read as it is."""
    if resolution not in TASKS:
        raise ValueError(f"resolution must be one of {tuple(TASKS)}, got {resolution!r}")
    stem = Path(cache) / f"{TASKS[resolution]}-hard-{fidelity}-n{num}-s{seed}"
    old = stem.with_name(stem.name + ".npz")
    if old.is_file():
        z = np.load(old)
        return z["images"], z["tips"], z["labels"], {"cache": str(old), "generated_s": None}
    files = {k: stem.with_name(f"{stem.name}.{k}.npy") for k in ("tips", "labels", "images")}
    if all(f.is_file() for f in files.values()):
        return (np.load(files["images"], mmap_mode="r"), np.load(files["tips"]), np.load(files["labels"]),
                {"cache": str(files["images"]), "generated_s": None})
    t0 = time.perf_counter()
    arrays = dict(zip(("images", "tips", "labels"), generate(num, seed, workers, show_progress, fidelity, resolution)))
    dt = time.perf_counter() - t0
    stem.parent.mkdir(parents=True, exist_ok=True)
    for k, f in files.items():  # the images last: their file's presence says the set is complete
        tmp = f.with_name(f".{f.name}-{os.getpid()}.npy")
        np.save(tmp, arrays[k])
        os.replace(tmp, f)
    print(f"generated {num} images in {dt:.0f} s on {workers} workers -> {files['images']}", flush=True)
    return arrays["images"], arrays["tips"], arrays["labels"], {"cache": str(files["images"]), "generated_s": round(dt, 1)}


def split_indices(n: int, seed: int = 0) -> dict:
    """80 / 10 / 10 split of ``n`` images by a permutation seeded with (seed, 23)."""
    perm = np.random.default_rng([seed, 23]).permutation(n)
    a, b = int(0.8 * n), int(0.9 * n)
    return {"train": np.sort(perm[:a]), "val": np.sort(perm[a:b]), "test": np.sort(perm[b:])}


# ------------------------------------------------------------------------------------------ mask
def neighbourhood_mask(tips, radius: float, size: int = RES) -> np.ndarray:
    """bool ``[n, size, size]``: pixels whose centre lies within ``radius`` of either marker centre
    (``tips [n, 2, 2]``, (y, x))."""
    tips = np.asarray(tips, np.float64).reshape(-1, 2, 2)
    ax = np.arange(size, dtype=np.float64)
    keep = np.zeros((len(tips), size, size), bool)
    for m in range(2):
        # dy^2 + dx^2 <= r^2 as dx^2 <= r^2 - dy^2: two [n, size] arrays and one broadcast compare, no
        # [n, size, size] float temporaries (10x faster; 100K Path-256 masks in ~15 s, not ~3 minutes).
        # For integer centres both sides are exact in float64, so the set is the same.
        room = radius * radius - (ax[None, :] - tips[:, m, 0, None]) ** 2  # [n, size]: each row's room for dx^2
        dx2 = (ax[None, :] - tips[:, m, 1, None]) ** 2  # [n, size]
        keep |= dx2[:, None, :] <= room[:, :, None]
    return keep


def mask_images(images, tips, radius: float | None) -> np.ndarray:
    """The images with every pixel outside the two markers' neighbourhoods set to black (gray 0);
    ``radius`` None: the images unchanged (a copy)."""
    images = np.asarray(images)
    if radius is None:
        return np.array(images)
    out = np.zeros(images.shape, images.dtype)
    chunk = 2048
    for s in range(0, len(images), chunk):
        keep = neighbourhood_mask(tips[s:s + chunk], radius, images.shape[-1])
        out[s:s + chunk] = np.where(keep, images[s:s + chunk], 0)
    return out


# -------------------------------------------------------------------------------------- dataset
class NeighbourhoodDataset:
    """Path-X (or Path-256) images ``[n, res, res]`` held in memory, read as the task's loader reads
    them (`LRADataset`): ``{"tokens": int16 Tensor[res^2] (gray level + 1, raster order; the loader's
    are int64, same values), "length": res^2, "label": int}``, vocabulary 257, pad id 0, two classes."""

    def __init__(self, images, labels, split: str = "train", index=None):
        """``index``: the images of this split, as indices into ``images`` and ``labels`` (which then
        hold every image): the split reads the shared array, no copy (6.5 GB for 100K Path-256 images)."""
        images = np.asarray(images, np.uint8)
        if images.ndim != 3 or images.shape[1] != images.shape[2] or images.shape[1] not in TASKS:
            raise ValueError(f"images must be [n, res, res] with res in {tuple(TASKS)}, got shape {images.shape}")
        labels = np.asarray(labels, np.int64)
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.resolution = images.shape[1]
        self.task = TASKS[self.resolution]
        self.images = np.ascontiguousarray(images).reshape(len(images), -1)
        self.index = np.arange(len(images)) if index is None else np.asarray(index, np.int64).reshape(-1)
        if len(self.index) and (self.index.min() < 0 or self.index.max() >= len(images)):
            raise ValueError(f"index must lie in [0, {len(images)}), got values in [{self.index.min()}, {self.index.max()}]")
        self.label_array = labels[self.index]
        self.split = split
        self.seq_len = self.max_len = self.images.shape[1]
        self.vocab_size, self.num_classes, self.pad_id, self.offset = 257, 2, 0, 1

    def __len__(self) -> int:
        return len(self.label_array)

    def __getitem__(self, i: int) -> dict:
        import torch

        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.split} of size {len(self)}")
        # int16 (gray + 1 <= 256): a quarter of int64's bytes through the loader (`train.collate`)
        tokens = torch.from_numpy(self.images[self.index[i]].astype(np.int16)) + self.offset
        return {"tokens": tokens, "length": self.seq_len, "label": int(self.label_array[i])}

    @property
    def labels(self) -> np.ndarray:
        return self.label_array.copy()

    @property
    def lengths(self) -> np.ndarray:
        return np.full(len(self), self.seq_len, np.int64)

    def kept_counts(self) -> np.ndarray:
        """Tokens a ``black_is_padding`` model attends to in each image (drawn pixels)."""
        step = 4096
        return np.concatenate([(self.images[self.index[s:s + step]] > 0).sum(1) for s in range(0, len(self), step)]
                              or [np.zeros(0, np.int64)])


# ------------------------------------------------------------------------------------- run info
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _se(p, n) -> float | None:
    return None if p is None or not n else math.sqrt(p * (1 - p) / n)


# ----------------------------------------------------------------------------------------- probe
def run_probe(out: Path, data_tag: str, images_masked, tips, labels, idx, half: int, epochs: int, seed: int) -> dict:
    """The probe's MLP on the masked marker patches: train on the train split (its own 15% slice for
    early stopping), test on the test split. Cached in ``OUT/probe-<data_tag>.json``."""
    path = out / f"probe-{data_tag}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from sparseflash.experiments.lra.probe import fit_mlp

    t0 = time.perf_counter()
    tr, te = idx["train"], idx["test"]
    x_tr = marker_patches(images_masked[tr], tips[tr], half)
    x_te = marker_patches(images_masked[te], tips[te], half)
    acc = fit_mlp(x_tr, labels[tr].astype(np.int64), x_te, labels[te].astype(np.int64), seed=seed, epochs=epochs)
    r = {"data": data_tag, "acc": acc, "se": _se(acc, len(te)), "n_train": int(len(tr)), "n_test": int(len(te)),
         "features": int(x_tr.shape[1]), "patch_half": half, "epochs": epochs,
         "seconds": round(time.perf_counter() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1) + "\n")
    print(f"probe MLP on the same pixels ({r['features']} features): held-out {100 * acc:.1f} +- "
          f"{100 * r['se']:.1f}% ({len(te)} test images, {r['seconds']} s)", flush=True)
    return r


def mlp_controls(out: Path, data_tag: str, images_masked, tips, labels, idx, half: int, seed: int) -> dict:
    """How the probe's MLP does with few epochs (1, 2, 4; the Transformer runs see a few) and without
    the alignment the patches give it: the same MLP on the whole masked image (16,384 pixels at their
    absolute positions, what a model without translation invariance sees). ``OUT/mlp_controls-<data_tag>.json``."""
    from sparseflash.experiments.lra.probe import fit_mlp

    tr, te = idx["train"], idx["test"]
    r = {"data": data_tag, "n_train": int(len(tr)), "n_test": int(len(te)), "seed": seed}
    xp = marker_patches(images_masked, tips, half)
    for ep in (1, 2, 4):
        r[f"patches_epochs{ep}"] = fit_mlp(xp[tr], labels[tr], xp[te], labels[te], seed=seed, epochs=ep)
    xf = images_masked.reshape(len(labels), -1).astype(np.float32) / 255.0
    for ep in (4, 20):
        r[f"whole_masked_image_epochs{ep}"] = fit_mlp(xf[tr], labels[tr], xf[te], labels[te], seed=seed, epochs=ep)
    for k in list(r):
        if k.startswith(("patches_", "whole_")):
            print(f"MLP control {k}: held-out {100 * r[k]:.1f} +- {100 * _se(r[k], len(te)):.1f}%", flush=True)
    (out / f"mlp_controls-{data_tag}.json").write_text(json.dumps(r, indent=1) + "\n")
    return r


# ------------------------------------------------------------------------------------ CNN control
# "+markers": a second input channel with the two marker disks, so the CNN is told where the markers
# are (what the aligned probe is given) and has only to compare them
CNN_INPUTS = ("masked", "full", "masked+markers", "full+markers")
MARKER_DISK = 3.0  # radius of the disks of the marker channel (the markers' own radius)


def build_cnn(width: int = 8, hidden: int = 64, pool: str = "meanmax", in_ch: int = 1):
    """A small translation-equivariant CNN: five 3x3 convolutions (no bias, BatchNorm, ReLU), total
    stride 8 (a stride-2 first convolution, whose 3x3 kernel still reads every pixel, and two 2x2 max
    pools), then global pooling over positions (``meanmax``: mean and max concatenated; ``mean``;
    ``max``) and a two-layer head (``hidden`` units, 2 logits). Input ``[n, in_ch, H, W]`` in [0, 1].
    ``width`` 8: 1 -> 16 (stride 2, 64 px) -> 32, pool -> 32 -> 64 (32 px), pool -> 64 (16 px);
    receptive field 45 px; 78K parameters. ``model.features(x)`` is the pooled vector."""
    import torch
    from torch import nn

    def block(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    w = width
    if pool not in ("meanmax", "mean", "max"):
        raise ValueError(f"pool must be meanmax, mean or max, got {pool!r}")

    class CNN(nn.Module):
        stride = 8

        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(*block(in_ch, 2 * w, 2), *block(2 * w, 4 * w), nn.MaxPool2d(2),
                                      *block(4 * w, 4 * w), *block(4 * w, 8 * w), nn.MaxPool2d(2),
                                      *block(8 * w, 8 * w))
            self.pool = pool
            n_feat = 8 * w * (2 if pool == "meanmax" else 1)
            self.head = nn.Sequential(nn.Linear(n_feat, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 2))

        def features(self, x):
            h = self.body(x.contiguous(memory_format=torch.channels_last))  # ~1.5x faster on a CPU
            parts = []
            if self.pool in ("meanmax", "mean"):
                parts.append(h.mean((2, 3)))
            if self.pool in ("meanmax", "max"):
                parts.append(h.amax((2, 3)))
            return torch.cat(parts, 1)

        def forward(self, x):
            return self.head(self.features(x))

    return CNN()


def _cnn_batch(images, ix):
    import torch

    x = torch.from_numpy(images[ix]).float().div_(255.0)
    return x.unsqueeze(1) if x.dim() == 3 else x  # [n, H, W] (gray) or [n, C, H, W] (gray + marker channel)


def _cnn_eval(model, images, labels, ix, batch: int = 250):
    import torch
    import torch.nn.functional as F

    model.eval()
    correct, loss = 0, 0.0
    with torch.inference_mode():
        for s in range(0, len(ix), batch):
            b = ix[s:s + batch]
            y = torch.from_numpy(labels[b].astype(np.int64))
            out = model(_cnn_batch(images, b))
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
    model.train()
    return correct / len(ix), loss / len(ix)


def train_cnn(images, labels, idx, *, epochs: float = 3, batch_size: int = 64, lr: float = 2e-3, width: int = 8,
              hidden: int = 64, pool: str = "meanmax", evals_per_epoch: int = 4, patience: int = 4,
              minutes: float | None = None, seed: int = 0, log=print) -> dict:
    """Train `build_cnn` on ``images`` (uint8 ``[n, H, W]`` or ``[n, C, H, W]``, scaled to [0, 1]) with the split ``idx``: Adam,
    ``lr`` with a cosine decay to 0 over ``epochs`` epochs (100 warm-up steps), weight decay 0; validation
    on the whole val split ``evals_per_epoch`` times an epoch; stops early after ``patience`` evaluations
    without a better val accuracy, or at ``minutes``. Test accuracy with the best-on-val weights and
    the last ones. Returns the result and the curve (one row per evaluation)."""
    import copy

    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    labels = np.asarray(labels)
    tr, va, te = (np.asarray(idx[s]) for s in ("train", "val", "test"))
    in_ch = 1 if np.asarray(images[:1]).ndim == 3 else int(images.shape[1])
    model = build_cnn(width, hidden, pool, in_ch).to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in model.parameters())
    spe = max(1, len(tr) // batch_size)
    total = max(1, int(round(epochs * spe)))
    eval_every = max(1, spe // evals_per_epoch)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warm = min(100, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    deadline = time.monotonic() + 60 * minutes if minutes else None
    t0 = time.perf_counter()
    curve, best, best_state, since_best, stopped_by = [], None, None, 0, None
    run_loss = run_correct = run_n = 0
    step, order, pos, epoch = 0, None, len(tr), -1
    model.train()
    while step < total:
        if pos + batch_size > len(tr):
            epoch += 1
            order, pos = tr[np.random.default_rng([seed, 31, epoch]).permutation(len(tr))], 0
        b = np.sort(order[pos:pos + batch_size])
        pos += batch_size
        x, y = _cnn_batch(images, b), torch.from_numpy(labels[b].astype(np.int64))
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        run_loss += loss.item() * len(b)
        run_correct += int((out.argmax(1) == y).sum())
        run_n += len(b)
        late = deadline is not None and time.monotonic() > deadline
        if step % eval_every == 0 or step == total or late:
            va_acc, va_loss = _cnn_eval(model, images, labels, va)
            row = {"step": step, "epoch": round(step / spe, 3), "train_loss": round(run_loss / run_n, 4),
                   "train_acc": round(run_correct / run_n, 4), "val_loss": round(va_loss, 4), "val_acc": round(va_acc, 4),
                   "lr": round(sched.get_last_lr()[0], 6), "elapsed_s": round(time.perf_counter() - t0, 1)}
            curve.append(row)
            run_loss = run_correct = run_n = 0
            log(f"  step {step}/{total} (epoch {row['epoch']:.2f}): train {100 * row['train_acc']:.1f}% "
                f"(loss {row['train_loss']:.3f}), val {100 * va_acc:.1f}% (loss {va_loss:.4f}), {row['elapsed_s']:.0f} s")
            if best is None or va_acc > best["val_acc"]:
                best, best_state, since_best = row, copy.deepcopy(model.state_dict()), 0
            else:
                since_best += 1
            if since_best >= patience:
                stopped_by = "early stopping"
                break
            if late:
                stopped_by = "deadline"
                break
    wall = time.perf_counter() - t0
    final_acc, _ = _cnn_eval(model, images, labels, te)
    model.load_state_dict(best_state)
    test_acc, test_loss = _cnn_eval(model, images, labels, te)
    n = len(te)
    return {"test_acc": test_acc, "test_se": _se(test_acc, n), "test_loss": round(test_loss, 4),
            "test_final_acc": final_acc, "test_final_se": _se(final_acc, n), "n_train": int(len(tr)),
            "n_val": int(len(va)), "n_test": int(n), "val_best": best["val_acc"], "val_best_step": best["step"],
            "val_best_epoch": best["epoch"], "steps": step, "schedule_steps": total, "epochs_run": round(step / spe, 3),
            "stopped_by": stopped_by, "train_s": round(wall, 1), "ms_per_step": round(1e3 * wall / step, 1),
            "params": n_params, "width": width, "hidden": hidden, "pool": pool, "batch_size": batch_size, "lr": lr,
            "epochs": epochs, "evals_per_epoch": evals_per_epoch, "patience": patience, "seed": seed,
            "threads": torch.get_num_threads(), "curve": curve}


def cnn_controls(out: Path, data_tag: str, images, tips, labels, idx, radius: float, args, meta: dict) -> dict:
    """`train_cnn` on the masked images (the pixels within ``radius`` of either marker at their absolute
    positions: the Transformer's and the whole-image MLP's input) and on the full images (the real
    Path-X input), same split. ``OUT/cnn_controls-<data_tag>.json`` (one entry an input, merged with the
    file's earlier entries) and ``.csv`` (the table), ``OUT/cnn_controls-<data_tag>-<input>-curve.csv``."""
    import torch

    path = out / f"cnn_controls-{data_tag}.json"
    res = json.loads(path.read_text()) if path.is_file() else {"data": data_tag, "inputs": {}}
    out.mkdir(parents=True, exist_ok=True)
    for name in args.cnn_inputs:
        x = mask_images(images, tips, radius) if name.startswith("masked") else np.asarray(images)
        if name.endswith("+markers"):  # a second channel: the two marker disks (radius 3), given
            x = np.stack([x, 255 * neighbourhood_mask(tips, MARKER_DISK, x.shape[-1]).astype(np.uint8)], 1)
        print(f"CNN control on the {name} images ({data_tag}; {args.cnn_epochs:g} epochs max, batch "
              f"{args.cnn_batch_size}, lr {args.cnn_lr:g}, width {args.cnn_width}, pool {args.cnn_pool}, "
              f"torch threads {torch.get_num_threads()})", flush=True)
        t0 = time.perf_counter()
        r = train_cnn(x, labels, idx, epochs=args.cnn_epochs, batch_size=args.cnn_batch_size, lr=args.cnn_lr,
                      width=args.cnn_width, pool=args.cnn_pool, patience=args.cnn_patience,
                      minutes=args.cnn_minutes, seed=args.seed, log=lambda s: print(s, flush=True))
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        r.update(input=name, radius=radius if name.startswith("masked") else None,
                 marker_channel=MARKER_DISK if name.endswith("+markers") else None, **meta)
        curve = r.pop("curve")
        cpath = out / f"cnn_controls-{data_tag}-{name}-curve.csv"
        with open(cpath, "w", newline="") as f:
            w = csv.DictWriter(f, list(curve[0]))
            w.writeheader()
            w.writerows(curve)
        r["curve"] = cpath.name
        res["inputs"][name] = r
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(f"CNN on the {name} images: held-out (best-on-val weights, step {r['val_best_step']}) "
              f"{100 * r['test_acc']:.1f} +- {100 * r['test_se']:.1f}%, final weights {100 * r['test_final_acc']:.1f}%; "
              f"{r['steps']} steps ({r['epochs_run']:g} epochs, {r['stopped_by'] or 'schedule done'}) in "
              f"{r['wall_s'] / 60:.1f} min", flush=True)
    cols = ["input", "radius", "marker_channel", "test_acc", "test_se", "test_final_acc", "val_best", "val_best_epoch", "epochs_run",
            "steps", "stopped_by", "wall_s", "ms_per_step", "params", "width", "pool", "batch_size", "lr", "threads",
            "commit", "date"]
    with open(out / f"cnn_controls-{data_tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(res["inputs"].values())
    return res


# ----------------------------------------------------------------------------------------- train
def build_config(args, preset: str, n_train: int, device_type: str):
    from sparseflash.experiments.lra.configs import get_config

    cfg = get_config(TASKS[args.resolution], "faithful")
    cfg.model.black_is_padding = True
    cfg.model.attention = args.attention or ("sdpa" if device_type == "cpu" else cfg.model.attention)
    if args.pattern:
        cfg.model.pattern = args.pattern
    # attention dropout sends SDPA on a CPU to its math path (3-5x slower there): off on a CPU unless asked
    cfg.model.attn_dropout = (args.attn_dropout if args.attn_dropout is not None
                              else 0.0 if device_type == "cpu" else cfg.model.attn_dropout)
    tc = cfg.train
    spe = max(1, n_train // args.batch_size)
    tc.batch_size, tc.lr, tc.seed = args.batch_size, args.lr, args.seed
    tc.epochs, tc.warmup_epochs = None, None
    tc.steps = args.steps
    tc.warmup_steps = min(spe, max(1, args.steps // 10)) if args.warmup is None else args.warmup  # faithful: 1 epoch
    tc.eval_every = args.eval_every or max(50, args.steps // args.evals)
    tc.eval_batches = None  # the whole val split
    tc.save_every = max(tc.eval_every, args.steps)
    tc.log_every = args.log_every or max(10, min(100, tc.eval_every // 5))
    tc.freeze = tuple(dict.fromkeys((("encoder.pos",) if PRESETS[preset][1] else ()) + tuple(args.freeze)))
    if args.set:
        from sparseflash.experiments.lra.configs import apply_overrides

        apply_overrides(cfg, args.set)
    return cfg.validate()


def _read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def measure_step_s(cfg, datasets, device: str, init_from, n_steps: int | None = None, num_workers: int = 0,
                   cuda_graphs: bool = False) -> float:
    """Seconds per training step of ``cfg`` on ``device``: a throw-away run of ``n_steps`` (default
    6 on a CPU, 60 on a GPU) with the run's own loader processes (and CUDA graphs, if the run replays
    its steps from them: each new width is captured in the first half), the median over its second half.
    The first steps of a GPU run pay for kernel compilation at each new packed width and for the
    loader's start; a 6-step measurement there read 35-46 ms for a 16-19 ms step, and the
    schedules it sized used half their minutes."""
    import tempfile

    import torch

    from sparseflash.experiments.lra.train import train

    if n_steps is None:
        n_steps = 6 if torch.device(device).type == "cpu" else 60

    with tempfile.TemporaryDirectory() as tmp:
        from sparseflash.experiments.lra.configs import config_from_dict

        c = config_from_dict(cfg.to_dict())
        c.train.steps, c.train.eval_every, c.train.save_every = n_steps, 10**6, 10**6
        c.train.log_every = max(2, n_steps // 10)
        small = {"train": datasets["train"], "val": _Head(datasets["val"], 32)}
        train(c, tmp, datasets=small, device=device, init_from=init_from, show_progress=False, num_workers=num_workers,
              cuda_graphs=cuda_graphs)
        rows = _read_csv(Path(tmp) / "train.csv")
    ms = [float(r["step_ms"]) for r in rows[len(rows) // 2:]] or [float(r["step_ms"]) for r in rows]
    return float(np.median(ms)) / 1e3


class _Head:
    """The first ``n`` items of a dataset (same attributes)."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, min(n, len(ds))
        for a in ("seq_len", "vocab_size", "num_classes", "pad_id", "task", "split"):
            setattr(self, a, getattr(ds, a))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.ds[i % self.n]


def held_out(run_dir: Path, cfg, datasets, device: str) -> dict:
    """Test accuracy with the best-on-val and the final weights (from the run's summary, or evaluated
    here from its checkpoints when the run stopped before its own test evaluation)."""
    import torch

    from sparseflash.experiments.lra.train import build_model, evaluate

    s = json.loads((run_dir / "summary.json").read_text())
    out = {}
    for w in ("best", "final"):
        r = s.get(f"test_{w}")
        if r is None:
            ck = run_dir / "checkpoints" / ("best.pt" if w == "best" else "last.pt")
            if not ck.is_file():
                continue
            state = load_checkpoint(ck)["model"]
            model = build_model(cfg)
            model.load_state_dict(state)
            model.to(device)
            r = evaluate(model, datasets["test"], batch_size=cfg.train.batch_size, max_batches=None,
                         device=torch.device(device), autocast=__import__("contextlib").nullcontext())
        out[w] = r
    return out


def run_one(args, preset: str, data_tag: str, datasets, probe: dict, meta: dict) -> dict:
    import torch

    from sparseflash.experiments.lra.train import train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    init = str(args.init_from) if PRESETS[preset][0] else None
    if init and not Path(init).is_file():
        raise SystemExit(f"--init-from {init}: no such file (the Pathfinder-64 pretrained weights; see the "
                         f"study README: campaign.sh makes them)")
    tag = args.tag or (f"{preset}-{data_tag}" + (f"-lr{args.lr:g}" if args.lr != 1e-4 else "")
                       + "".join(f"-{o.rpartition('.')[2]}" for o in args.set))
    if args.tag and len(args.runs) > 1:
        tag = f"{args.tag}-{preset}"
    run_dir = args.out / "runs" / tag
    if (run_dir / "result.json").is_file() and not args.overwrite:
        print(f"{tag}: done before ({run_dir / 'result.json'}); --overwrite to train again", flush=True)
        return json.loads((run_dir / "result.json").read_text())
    resuming = bool(args.resume and (run_dir / "checkpoints" / "last.pt").is_file() and not args.overwrite)
    if run_dir.exists() and not resuming:
        import shutil

        shutil.rmtree(run_dir)
    # the first run's --minutes count from the command's start (data, masks and probe included), so a
    # command given MINUTES ends within them; later runs' from their own start
    t_start, args.t_command = getattr(args, "t_command", None) or time.monotonic(), None
    deadline = t_start + 60 * args.minutes if args.minutes else None
    workers = args.loader_workers if args.loader_workers is not None else (0 if torch.device(device).type == "cpu" else 4)
    if args.steps is None:
        if not args.minutes:
            raise SystemExit("give --steps, or --minutes to size them from a measured step time")
        probe_cfg = build_config(_with(args, steps=100), preset, len(datasets["train"]), torch.device(device).type)
        step_s = measure_step_s(probe_cfg, datasets, device, init, num_workers=workers,
                                cuda_graphs=bool(args.cuda_graphs))
        n_val = len(datasets["val"])
        # the training budget less ~20 evaluations of val (a forward is ~1/3 of a step) and two of test
        budget = (deadline - time.monotonic()) * 0.92 - (args.evals * n_val / args.batch_size + 2 * len(datasets["test"]) / args.batch_size) * step_s / 3
        steps = max(20, int(budget / step_s) - 10)
        print(f"{tag}: {1e3 * step_s:.0f} ms a step measured; {steps} steps fit in {args.minutes} min", flush=True)
        args_steps = _with(args, steps=steps)
    else:
        args_steps = args
    cfg = build_config(args_steps, preset, len(datasets["train"]), torch.device(device).type)
    print(f"{tag}: {cfg.train.steps} steps of {cfg.train.batch_size}, lr {cfg.train.lr:g}, warm-up "
          f"{cfg.train.warmup_steps}, eval every {cfg.train.eval_every}, attention {cfg.model.attention} "
          f"(dropout {cfg.model.attn_dropout}), "
          f"init {init or 'none'}, freeze {cfg.train.freeze or 'none'}, torch threads {torch.get_num_threads()}",
          flush=True)
    t0 = time.perf_counter()
    summary = train(cfg, run_dir, datasets=datasets, device=device, init_from=init, deadline=deadline,
                    show_progress=not args.no_progress, resume="auto" if resuming else None, num_workers=workers,
                    cuda_graphs=bool(args.cuda_graphs))
    if summary.get("stopped_by") and args.resume:
        print(f"{tag}: stopped at step {summary['steps']} of {cfg.train.steps} ({summary['stopped_by']}); the same "
              f"command continues it", flush=True)
        return None
    wall = float(summary.get("wall_s_total") or time.perf_counter() - t0)
    test = held_out(run_dir, cfg, datasets, device)
    tr_rows = _read_csv(run_dir / "train.csv")
    last = tr_rows[-5:]
    n_test = len(datasets["test"])
    best, final = test.get("best", {}), test.get("final", {})
    counts = datasets["train"].kept_counts()
    row = {
        "tag": tag, "preset": preset, "resolution": args.resolution, "keep": args.keep,
        "radius": None if args.keep == "full" else args.radius,
        "num": args.num, "n_train": len(datasets["train"]), "n_val": len(datasets["val"]), "n_test": n_test,
        "init_from": init, "freeze": ",".join(cfg.train.freeze), "overrides": " ".join(args.set),
        "pos_emb": cfg.model.pos_emb, "lr": cfg.train.lr, "batch_size": cfg.train.batch_size,
        "schedule_steps": cfg.train.steps, "steps": summary["steps"], "warmup_steps": cfg.train.warmup_steps,
        "attention": cfg.model.attention, "attn_dropout": cfg.model.attn_dropout, "device": str(device), "threads": torch.get_num_threads(),
        "wall_s": round(wall, 1),
        "step_ms": round(float(np.median([float(r["step_ms"]) for r in tr_rows])), 1) if tr_rows else None,
        "mean_tokens": round(float(counts.mean()), 1),
        "train_acc_last": round(float(np.mean([float(r["acc"]) for r in last])), 4) if last else None,
        "val_best": (summary.get("best_val") or {}).get("acc"), "val_best_step": (summary.get("best_val") or {}).get("step"),
        "test_acc": best.get("acc"), "test_se": _se(best.get("acc"), best.get("n")),
        "test_final_acc": final.get("acc"), "test_final_se": _se(final.get("acc"), final.get("n")),
        "mlp_acc": probe["acc"], "mlp_se": probe["se"], "mlp_features": probe["features"],
        "curve_train": str((run_dir / "train.csv").relative_to(args.out)),
        "curve_eval": str((run_dir / "eval.csv").relative_to(args.out)),
        **meta, "stopped_by": summary.get("stopped_by"),
    }
    (run_dir / "result.json").write_text(json.dumps(row, indent=1) + "\n")
    if getattr(args, "export_weights", None):  # a finished run's weights, to commit (lra/weights.py)
        export_final(run_dir / "checkpoints" / "best.pt", args.export_weights / tag)
    # the checkpoints are big (the 1M-number position table) and reproducible: keep only the summary
    if not args.keep_checkpoints:
        for ck in (run_dir / "checkpoints").glob("*.pt"):
            ck.unlink()
        try:
            (run_dir / "checkpoints").rmdir()
        except OSError:
            pass
    print(f"{tag}: {row['steps']} steps in {wall / 60:.1f} min; held-out (best-on-val weights) "
          f"{100 * (row['test_acc'] or 0):.1f} +- {100 * (row['test_se'] or 0):.1f}%, final weights "
          f"{100 * (row['test_final_acc'] or 0):.1f}%" + ("" if probe["acc"] is None else
          f"; probe MLP on the same pixels {100 * probe['acc']:.1f} +- {100 * probe['se']:.1f}%"), flush=True)
    return row


def _with(args, **kw):
    a = argparse.Namespace(**vars(args))
    for k, v in kw.items():
        setattr(a, k, v)
    return a


# ---------------------------------------------------------------------------------------- report
def report(out: Path) -> list[dict]:
    """neighbourhood.csv / .json / .png from every ``OUT/runs/*/result.json``."""
    rows = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/result.json"))]
    if not rows:
        print(f"no finished runs under {out / 'runs'}", flush=True)
        return rows
    with open(out / "neighbourhood.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "neighbourhood.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    plot(out, rows)
    return rows


def plot(out: Path, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(rows) > 4  # the legend beside the axes, not over the curves
    fig, ax = plt.subplots(figsize=(12.5 if many else 8, 4.8 if many else 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    mlp_seen = {}
    for i, r in enumerate(rows):
        c = colors[i % len(colors)]
        tr = _read_csv(out / r["curve_train"])
        ev = [e for e in _read_csv(out / r["curve_eval"]) if e["split"] == "val"]
        if tr:
            s = np.array([float(e["step"]) for e in tr])
            a = np.array([float(e["acc"]) for e in tr])
            k = max(1, len(a) // 40)  # running mean over ~1/40 of the run
            sm = np.convolve(a, np.ones(k) / k, mode="valid")
            ax.plot(s[k - 1:], 100 * sm, color=c, lw=1, alpha=0.6, label=f"{r['tag']}: train (dropout on)")
        if ev:
            ax.plot([float(e["step"]) for e in ev], [100 * float(e["acc"]) for e in ev], "o-", color=c, ms=3, lw=1.6,
                    label=f"{r['tag']}: val; test {100 * (r['test_acc'] or 0):.1f}±{100 * (r['test_se'] or 0):.1f}%")
        key = (r["keep"], r["radius"], r["num"])
        if key not in mlp_seen and r.get("mlp_acc") is not None:
            mlp_seen[key] = True
            ax.axhline(100 * r["mlp_acc"], color="black", ls="--", lw=1,
                       label=f"probe MLP, same pixels ({r['keep']} R={r['radius']}): "
                             f"{100 * r['mlp_acc']:.1f}±{100 * r['mlp_se']:.1f}%")
    ax.axhline(50, color="gray", ls=":", lw=0.8)
    ax.set_xlabel("training step (batch 32)")
    ax.set_ylabel("accuracy (%)")
    res = sorted({int(r.get("resolution") or RES) for r in rows})
    ax.set_title(f"The faithful Transformer on the marker neighbourhoods only (hard, release, {'/'.join(map(str, res))} px)")
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylim(40, 90)
    fig.tight_layout()
    path = out / "neighbourhood.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example (CPU, ~12 minutes a run): PYTHONPATH=. python experiments/studies/pathx/neighbourhood.py "
               "--num 20000 --runs scratch --minutes 12 --threads 1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ap.add_argument_group("data")
    d.add_argument("--num", type=int, default=20000, help="hard release images to draw (80/10/10 split); default 20000")
    d.add_argument("--resolution", type=int, choices=tuple(TASKS), default=RES,
                   help="128 (Path-X, default) or 256 (Path-256: its config, a 256x256 position grid; a Path-X "
                        "checkpoint's grid is upsampled 2x2)")
    d.add_argument("--seed", type=int, default=0, help="seed of the images, the split and the training order")
    d.add_argument("--workers", type=int, default=2, help="processes drawing the images (default 2)")
    d.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"folder of the cached arrays (default {DEFAULT_CACHE})")
    d.add_argument("--radius", type=float, default=None,
                   help="keep the pixels within this distance of either marker centre (default the probe's k = 6)")
    d.add_argument("--keep", choices=("neighbourhood", "full"), default="neighbourhood",
                   help="'full': the unmasked images (the control; slow on a CPU)")
    t = ap.add_argument_group("training")
    t.add_argument("--runs", nargs="+", choices=tuple(PRESETS), default=None,
                   help="presets, one after another: scratch | pretrained (--init-from) | pretrained-frozen "
                        "(--init-from, position table frozen); default scratch, or none with --cnn-controls")
    t.add_argument("--init-from", type=Path, default=DEFAULT_INIT,
                   help=f"checkpoint of the pretrained presets (default {DEFAULT_INIT.relative_to(REPO)}; its 64x64 "
                        f"position grid is upsampled 2x2)")
    t.add_argument("--freeze", nargs="*", default=[], help="parameter name prefixes to freeze in every run, e.g. encoder.pos")
    t.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (faithful: 1e-4)")
    t.add_argument("--steps", type=int, default=None, help="length of the cosine schedule; default: what fits in --minutes")
    t.add_argument("--minutes", type=float, default=None,
                   help="time limit of each run; the first run's counts from the command's start (data, masks and "
                        "probe included); sizes --steps if not given")
    t.add_argument("--warmup", type=int, default=None, help="warm-up steps (default min(one epoch, steps / 10))")
    t.add_argument("--batch-size", type=int, default=32, help="default 32 (faithful)")
    t.add_argument("--eval-every", type=int, default=None, help="validation interval (default steps / 20)")
    t.add_argument("--log-every", type=int, default=None)
    t.add_argument("--device", default=None, help="cpu or cuda (default cuda if available)")
    t.add_argument("--attention", default=None, help="model.attention (default sdpa on a CPU, faithful sparseflash on CUDA)")
    t.add_argument("--pattern", default=None, help="model.pattern (default dense, the faithful config's)")
    t.add_argument("--attn-dropout", type=float, default=None,
                   help="model.attn_dropout (default 0 on a CPU, where it costs 3-5x a step; faithful 0.1 on CUDA)")
    t.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                   help="config overrides applied last, e.g. model.pos_emb=grid_sincos (see configs.apply_overrides)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    t.add_argument("--radius-stages", nargs="+", default=None, metavar="R",
                   help="a curriculum: one run a stage at these radii in order ('full': the whole image), each "
                        "from the previous stage's best weights, the first from --init-from (docstring, 7.)")
    t.add_argument("--stage-minutes", type=float, nargs="+", default=None, metavar="M",
                   help="--radius-stages: minutes a stage, one value for all or one a stage (e.g. a long first "
                        "stage: 5 1 1 2); default: the minutes left shared by the stages left")
    t.add_argument("--no-probe", action="store_true", help="skip the probe MLP on the masked pixels")
    t.add_argument("--cuda-graphs", action="store_true",
                   help="replay the training steps from CUDA graphs (train.py's --cuda-graphs; CUDA only): the "
                        "eager step of a ~150-token model is host-bound (GPUs 10-15%% busy at 11-14 ms a step)")
    t.add_argument("--loader-workers", type=int, default=None,
                   help="data-loader processes feeding each run (default 0 on a CPU, 4 on CUDA: one process "
                        "cannot turn 16,384-token images into batches as fast as a GPU trains on ~150 tokens)")
    t.add_argument("--mlp-epochs", type=int, default=60, help="epochs of the probe MLP (default 60, the probe's)")
    t.add_argument("--mlp-controls", action="store_true",
                   help="also fit the MLP for 1, 2, 4 epochs and on the whole masked image (no alignment); "
                        "OUT/mlp_controls-<data>.json")
    c = ap.add_argument_group("CNN control (translation-equivariant, global pooling; see build_cnn)")
    c.add_argument("--cnn-controls", action="store_true",
                   help="train the small CNN on the masked images (radius --radius, default 6, whatever --keep says) "
                        "and on the full images, same split; OUT/cnn_controls-R<radius>-n<num>.json / .csv / "
                        "-<input>-curve.csv. Trains no Transformer unless --runs is given")
    c.add_argument("--cnn-inputs", nargs="+", choices=CNN_INPUTS, default=list(CNN_INPUTS[:2]),
                   help="which inputs (default: masked full; '+markers' adds a channel with the two marker "
                        "disks); entries already in the JSON are kept")
    c.add_argument("--cnn-epochs", type=float, default=3, help="length of the cosine schedule in epochs (default 3)")
    c.add_argument("--cnn-batch-size", type=int, default=64)
    c.add_argument("--cnn-lr", type=float, default=2e-3, help="Adam peak learning rate (default 2e-3)")
    c.add_argument("--cnn-width", type=int, default=8, help="channels of the first convolution (default 8: 78K parameters)")
    c.add_argument("--cnn-pool", choices=("meanmax", "mean", "max"), default="meanmax",
                   help="global pooling (default meanmax: mean and max concatenated)")
    c.add_argument("--cnn-patience", type=int, default=4,
                   help="stop after this many validations (4 an epoch) without a better val accuracy (default 6)")
    c.add_argument("--cnn-minutes", type=float, default=None, help="time limit of each CNN run")
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default the study's results/neighbourhood)")
    o.add_argument("--tag", default=None, help="run name (default <preset>-<data>)")
    o.add_argument("--overwrite", action="store_true", help="train a run again even if its result.json exists")
    o.add_argument("--resume", action="store_true",
                   help="continue a run that an earlier command (--minutes) stopped; needs --steps. Without it a "
                        "run stopped by --minutes is reported as it stands (its schedule unfinished)")
    o.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' .pt files (deleted by default)")
    o.add_argument("--export-weights", type=Path, default=None, metavar="DIR",
                   help="when a run (with --radius-stages: the chain's last stage) finishes, write its best-on-val "
                        "weights in bf16 to DIR/<run name>/ (model.pt, config.json: lra/weights.py export)")
    o.add_argument("--generate-only", action="store_true", help="make the cached images and stop")
    o.add_argument("--report-only", action="store_true", help="rebuild the table and the figure from OUT/runs and stop")
    o.add_argument("--no-progress", action="store_true")
    ap.set_defaults(evals=20)  # validations a run (radius stages: 5)
    a = ap.parse_args(argv)
    if a.num < 20:
        ap.error(f"--num must be at least 20, got {a.num}")
    if a.radius is not None and a.radius <= 0:
        ap.error("--radius must be positive")
    if a.resume and a.steps is None:
        ap.error("--resume needs --steps (the schedule must be the same in every command)")
    if a.keep == "full" and a.radius is not None:
        ap.error("--radius has no meaning with --keep full")
    if a.runs is None:
        a.runs = [] if a.cnn_controls else ["scratch"]
    if a.radius_stages:  # checked before minutes of data drawing, with the messages the command prints
        try:
            a.radius_stages = [radius_arg(v) for v in a.radius_stages]
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"--radius-stages: each stage is {e}") from None
        if len(a.runs) != 1:
            raise SystemExit(f"--radius-stages runs one preset (scratch: the first stage from fresh weights; "
                             f"pretrained or pretrained-frozen: from --init-from), got --runs {' '.join(a.runs)}")
        if PRESETS[a.runs[0]][0] and not a.init_from:
            raise SystemExit("--radius-stages: give --init-from, the first stage's starting weights")
    if a.stage_minutes is not None:
        if not a.radius_stages:
            ap.error("--stage-minutes is for --radius-stages")
        if len(a.stage_minutes) not in (1, len(a.radius_stages)) or min(a.stage_minutes) <= 0:
            ap.error(f"--stage-minutes: one positive value, or one for each of the {len(a.radius_stages)} stages, "
                     f"got {' '.join(f'{m:g}' for m in a.stage_minutes)}")
        if len(a.stage_minutes) == 1:
            a.stage_minutes = a.stage_minutes * len(a.radius_stages)
    for name in ("steps", "batch_size", "workers", "cnn_batch_size", "cnn_width"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return a


def run_meta(argv=None) -> dict:
    """Where and when a command ran: commit, date, torch, CPU, Python and its command line."""
    import torch

    from sparseflash.experiments.lra.provenance import code_commit

    return {"commit": code_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "cpu": f"{_cpu_name()} ({os.cpu_count()} logical)",
            "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}


NO_PROBE = {"acc": None, "se": None, "features": None}


def radius_arg(v: str) -> float | None:
    """A radius from the command line: a positive number of pixels, or ``"full"`` (None: the whole image)."""
    if v == "full":
        return None
    try:
        r = float(v)
    except ValueError:
        r = float("nan")
    if not r > 0:
        raise argparse.ArgumentTypeError(f"a positive radius in pixels or 'full', got {v!r}")
    return r


def compact_grid(path: Path) -> int:
    """Rewrite the checkpoint at ``path`` with its position grid stored as the smallest grid whose
    block duplication (`model.upsample_grid`) gives it back exactly; returns the factor (1: unchanged).
    Lossless: a frozen table that was upsampled 2x2 (Path-64 -> Path-X) or 4x4 (-> Path-256) keeps
    only its source (a 256x256x64 table: 17 MB -> 1 MB), and `model.load_pretrained`, which every
    stage and ``zero_shot.py`` load through, upsamples it again. A trained table is not
    block-constant and stays as it is. The carried state is limited to 64 MiB, the working tree
    included."""
    import torch

    from sparseflash.experiments.lra.model import upsample_grid

    ck = load_checkpoint(path)
    g = ck.get("model", {}).get("encoder.pos.grid")
    if g is None or g.dim() != 3:
        return 1
    H, W, _ = g.shape
    for f in (16, 8, 4, 2):
        if H % f == 0 and W % f == 0 and torch.equal(upsample_grid(g[::f, ::f], (H, W)), g):
            ck["model"]["encoder.pos.grid"] = g[::f, ::f].clone()
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(ck, tmp)
            os.replace(tmp, path)
            return f
    return 1


def export_final(best: Path, folder: Path) -> bool:
    """The bf16 export of a finished run's ``best.pt`` into ``folder`` (`lra.weights.export_run`:
    ``model.pt`` and ``config.json``), once: an export already there is kept (a rerun of a finished
    chain exports nothing new). False when there is no ``best.pt`` (a run stopped before its first
    validation)."""
    from sparseflash.experiments.lra.weights import export_run

    if (folder / "model.pt").is_file():
        return True
    if not best.is_file():
        print(f"export: {best} is missing; nothing exported to {folder}", flush=True)
        return False
    info = export_run(best, folder)
    print(f"exported {best} -> {folder}/ ({info['mb']} MB in bf16)", flush=True)
    return True


def _chain_start(best: Path, init):
    """The weights a stage hands to the next: its best-on-val ones; a stage cut before its first
    validation has only its last ones, and one cut before its first step hands on ``init``."""
    last = best.with_name("last.pt")
    return best if best.is_file() else last if last.is_file() else init


def run_stages(a, images, tips, labels, idx, meta: dict) -> int:
    """The curriculum of ``--radius-stages`` (docstring, 7.): 0 when every stage is done, 75 when the
    time ran out first (the same command continues with the next stage)."""
    radii = a.radius_stages  # parsed and checked with the other arguments
    base = a.tag or f"{a.runs[0]}-stages"
    end = a.t_command + 60 * a.minutes if a.minutes else None
    # a scratch chain starts from fresh weights; its later stages start from the previous stage's
    # (the "pretrained" preset: nothing frozen); the other presets start every stage from weights
    init, status = (a.init_from if PRESETS[a.runs[0]][0] else None), 0
    for k, r in enumerate(radii):
        name = "full" if r is None else f"R{r:g}"
        tag = f"{base}-{k + 1}-{name}"
        best = a.out / "runs" / tag / "checkpoints" / "best.pt"
        if (a.out / "runs" / tag / "result.json").is_file() and not a.overwrite:
            print(f"{tag}: done before", flush=True)
            init = _chain_start(best, init)
            continue
        left = None if end is None else (end - time.monotonic()) / 60
        if left is not None and left < 1:
            print(f"stages: no time left for {tag}; the same command continues", flush=True)
            status = 75
            break
        masked = images if r is None else mask_images(images, tips, r)  # whole images: read in place
        datasets = {s: NeighbourhoodDataset(masked, labels, s, index=ix) for s, ix in idx.items()}
        data_tag = f"{name}-n{a.num}" + (f"-s{a.seed}" if a.seed else "")
        probe = NO_PROBE
        if not a.no_probe:
            half = int(math.ceil(r)) if r is not None else default_radius(a.resolution)
            probe = run_probe(a.out, data_tag, masked, tips, labels.astype(np.int64), idx, half, a.mlp_epochs, a.seed)
        left = None if end is None else (end - time.monotonic()) / 60  # after the masks and the probe
        share = left if left is None else left / (len(radii) - k)
        if a.stage_minutes:
            share = a.stage_minutes[k] if left is None else min(a.stage_minutes[k], left)
        preset = a.runs[0] if init is None or PRESETS[a.runs[0]][0] else "pretrained"
        sa = _with(a, radius=r, keep="full" if r is None else "neighbourhood", init_from=init and Path(init), tag=tag,
                   keep_checkpoints=True, t_command=None, minutes=share, evals=5,  # short stages: 5 validations
                   export_weights=None)  # the chain's last stage is exported below, once the chain is done
        row = run_one(sa, preset, data_tag, datasets, probe, meta)
        del masked, datasets
        if row is None:  # stopped by its time limit with --resume: continue it next command
            status = 75
            break
        if not row["steps"]:  # no time for a single step: not done, the next command runs it
            (a.out / "runs" / tag / "result.json").unlink()
            status = 75
            break
        last = best.with_name("last.pt")
        previous, init = init, _chain_start(best, init)
        # the state is carried between machines (64 MiB in all): keep one set of weights a chain, the
        # newest stage's; earlier stages keep their curves and results
        if best.is_file() and last.is_file():
            last.unlink()
        if best.is_file():
            compact_grid(best)
        if k and previous and Path(previous) != Path(init) and Path(previous).parent.parent.parent == a.out / "runs":
            for ck in Path(previous).parent.glob("*.pt"):
                ck.unlink()
    if status == 0 and a.export_weights:  # the chain is done: its final model, to commit
        export_final(a.out / "runs" / tag / "checkpoints" / "best.pt", a.export_weights / tag)
    rows = report(a.out)
    print(f"wrote {a.out / 'neighbourhood.csv'}, .json, .png ({len(rows)} runs)", flush=True)
    return status


def main(argv=None, started: float | None = None) -> int:
    """``started``: the `time.monotonic` value the command's ``--minutes`` count from (default now)."""
    t_command = time.monotonic() if started is None else started
    a = parse_args(argv)
    a.t_command = t_command
    if a.report_only:
        report(a.out)
        return 0
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    images, tips, labels, gen = load_or_generate(a.cache, a.num, a.seed, a.workers, not a.no_progress,
                                                 resolution=a.resolution)
    if a.generate_only:
        return 0
    if a.keep == "neighbourhood" and a.radius is None:
        a.radius = default_radius(a.resolution)
    radius = a.radius if a.keep == "neighbourhood" else None
    data_tag = f"R{a.radius:g}" if radius is not None else "full"
    data_tag += f"-n{a.num}" + (f"-s{a.seed}" if a.seed else "")
    idx = split_indices(len(labels), a.seed)
    if a.radius_stages:
        return run_stages(a, images, tips, labels, idx, {**run_meta(argv), "data_cache": gen["cache"],
                                                         "generated_s": gen["generated_s"]})
    masked = images if radius is None else mask_images(images, tips, radius)  # whole images: read in place
    if a.cnn_controls:
        cnn_radius = a.radius if a.radius is not None else default_radius(a.resolution)
        cnn_tag = f"R{cnn_radius:g}-n{a.num}" + (f"-s{a.seed}" if a.seed else "")
        cnn_controls(a.out, cnn_tag, images, tips, labels, idx, cnn_radius, a,
                     {**run_meta(argv), "data_cache": gen["cache"]})
    del images
    datasets = {s: NeighbourhoodDataset(masked, labels, s, index=ix) for s, ix in idx.items()}
    counts = datasets["train"].kept_counts()
    print(f"{data_tag}: {len(labels)} images ({', '.join(f'{s} {len(ix)}' for s, ix in idx.items())}), "
          f"labels {100 * labels.mean():.1f}% positive; kept (drawn) pixels an image: mean {counts.mean():.0f}, "
          f"max {counts.max()}", flush=True)
    half = int(math.ceil(radius)) if radius is not None else default_radius(a.resolution)
    probe = NO_PROBE if a.no_probe else run_probe(a.out, data_tag, masked, tips, labels.astype(np.int64), idx, half,
                                                  a.mlp_epochs, a.seed)
    if a.mlp_controls:
        mlp_controls(a.out, data_tag, masked, tips, labels.astype(np.int64), idx, half, a.seed)
    meta = {**run_meta(argv), "data_cache": gen["cache"], "generated_s": gen["generated_s"]}
    if not a.runs:
        return 0
    unfinished = [p for p in a.runs if run_one(a, p, data_tag, datasets, probe, meta) is None]
    rows = report(a.out)
    print(f"wrote {a.out / 'neighbourhood.csv'}, .json, .png ({len(rows)} runs)", flush=True)
    return 75 if unfinished else 0  # 75: stopped, continue with the same command (train.EXIT_STOPPED)


if __name__ == "__main__":
    raise SystemExit(main())
