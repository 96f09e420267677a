"""experiments/studies/pathx/neighbourhood.py: the mask, the tokens against the Path-X loader, and a
tiny end-to-end run (CPU, well under a minute)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

nb = pytest.importorskip("sparseflash.experiments.studies.pathx.neighbourhood")


@pytest.fixture(scope="module")
def drawn():
    """12 generated hard release 128 px images with their marker centres and labels."""
    return nb.generate(12, seed=5, workers=1, show_progress=False)


def test_mask_keeps_exactly_the_pixels_within_radius():
    rng = np.random.default_rng(0)
    tips = np.array([[[0, 0], [127, 64]], [[40, 41], [45, 50]], [[3, 125], [90, 7]]], np.int16)
    images = rng.integers(1, 256, (3, 128, 128)).astype(np.uint8)  # no black pixel: black means masked
    for radius in (6, 6.5, 12):
        out = nb.mask_images(images, tips, radius)
        for n in range(len(tips)):
            want = np.zeros((128, 128), bool)
            for y in range(128):
                for x in range(128):
                    want[y, x] = any(math.hypot(y - ty, x - tx) <= radius for ty, tx in tips[n])
            assert np.array_equal(out[n] > 0, want), (n, radius)
            assert np.array_equal(out[n][want], images[n][want])  # kept pixels are unchanged
    # the default radius is the probe's k = ceil(3) + 3, and a disk of radius 6 holds 113 pixels
    assert nb.default_radius() == 6
    assert (nb.neighbourhood_mask(np.array([[[64, 64], [64, 64]]]), 6)[0]).sum() == 113
    assert np.array_equal(nb.mask_images(images, tips, None), images)


def test_marker_patches_are_the_probes(drawn):
    images, tips, _ = drawn
    k = 6
    p = nb.marker_patches(images, tips, k).reshape(len(images), 2, 2 * k + 1, 2 * k + 1)
    big = np.pad(images, ((0, 0), (k, k), (k, k)))
    for i in range(len(images)):
        first = sorted(tuple(int(v) for v in t) for t in tips[i])[0]
        y, x = first
        assert np.allclose(p[i, 0], big[i, y:y + 2 * k + 1, x:x + 2 * k + 1] / 255.0)
        assert p[i, 0, k, k] > 0  # the marker's centre is drawn


def test_tokens_match_the_pathx_loader(drawn, tmp_path):
    from PIL import Image

    from sparseflash.experiments.lra.data import get_dataset
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.model import kept_pixels

    images, tips, labels = drawn
    masked = nb.mask_images(images, tips, 6)
    p = pf.params_for(128, "hard", "release")
    for name, imgs in (("whole", images), ("masked", masked)):
        folder = tmp_path / name / "pathfinder128" / pf.DIFFICULTIES["hard"][0]
        (folder / "imgs" / "0").mkdir(parents=True)
        (folder / "metadata").mkdir()
        rows = []
        for i, img in enumerate(imgs):
            Image.fromarray(img).save(folder / "imgs" / "0" / f"sample_{i}.png")
            rows.append(pf.format_metadata_row(0, i, int(labels[i]), p, 2).split())
        np.save(folder / "metadata" / "0.npy", np.asarray(rows))
        ours = nb.NeighbourhoodDataset(imgs, labels)
        for split in ("train", "test"):
            ref = get_dataset("pathx", tmp_path / name, split, cache_dir=tmp_path / "cache" / name)
            assert (ours.seq_len, ours.vocab_size, ours.num_classes, ours.pad_id) == (
                ref.seq_len, ref.vocab_size, ref.num_classes, ref.pad_id)
            for i, j in enumerate(ref.indices):
                a, b = ref[i], ours[int(j)]
                assert a["tokens"].dtype == b["tokens"].dtype == torch.long
                assert torch.equal(a["tokens"], b["tokens"]), (name, split, i)
                assert int(a["length"]) == int(b["length"]) == 128 * 128
                assert a["label"] == b["label"]
    # black_is_padding keeps exactly the drawn pixels of the neighbourhoods: no pad/black off-by-one
    ds = nb.NeighbourhoodDataset(masked, labels)
    for i in range(len(ds)):
        it = ds[i]
        assert int(it["tokens"].min()) >= 1  # pad id 0 never appears: the image has no padding
        keep = kept_pixels(it["tokens"][None], torch.tensor([it["length"]]))[0]
        want = torch.from_numpy((masked[i] > 0).ravel())
        assert torch.equal(keep, want)
        assert keep.sum() == ds.kept_counts()[i] > 0
        near = nb.neighbourhood_mask(tips[i:i + 1], 6)[0].ravel()
        assert not bool((keep & ~torch.from_numpy(near)).any())


def test_end_to_end_writes_the_table(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--runs", "scratch",
            "--steps", "3", "--batch-size", "8", "--eval-every", "2", "--mlp-epochs", "2", "--threads", "1",
            "--device", "cpu", "--no-progress"]
    assert nb.main(args) == 0
    assert (cache / "pathx-hard-release-n40-s0.npz").is_file()
    with open(out / "neighbourhood.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    r = rows[0]
    assert r["preset"] == "scratch" and int(r["steps"]) == 3 and int(r["n_test"]) == 4 and r["radius"] == "6"
    assert 0 <= float(r["test_acc"]) <= 1 and 0 <= float(r["mlp_acc"]) <= 1
    assert float(r["test_se"]) == pytest.approx(math.sqrt(float(r["test_acc"]) * (1 - float(r["test_acc"])) / 4))
    data = json.loads((out / "neighbourhood.json").read_text())
    assert data["rows"][0]["tag"] == r["tag"]
    assert (out / r["curve_train"]).is_file() and (out / "neighbourhood.png").is_file()
    assert not list((out / "runs").glob("*/checkpoints/*.pt"))  # deleted unless --keep-checkpoints
    # a second command reuses the cache and the finished run
    assert nb.main(args) == 0
    assert len(list(csv.DictReader(open(out / "neighbourhood.csv")))) == 1
