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
def px40(tmp_path_factory):
    """The 40 hard release Path-X images of seed 0 (what ``--num 40`` draws), generated once for the module."""
    folder = tmp_path_factory.mktemp("px40")
    nb.load_or_generate(folder, 40, 0, 1, False)
    return folder


@pytest.fixture
def cache(tmp_path, px40):
    """A test's own cache folder holding a copy of `px40`'s files (as the test's first command would have
    written them); every other set a test's commands draw is generated into it, as before."""
    import shutil

    folder = tmp_path / "cache"
    shutil.copytree(px40, folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        f"pathx-hard-release-n40-s0.{k}.npy" for k in ("images", "labels", "tips")]
    return folder


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
    # at 256 px, against the squared distance of every pixel in integers, for radii on and off the
    # integer grid (sqrt(50): r^2 rounds just above 50)
    tips = rng.integers(-3, 259, (40, 2, 2)).astype(np.int16)  # centres may sit off the image
    yy, xx = np.mgrid[:256, :256]
    for radius in (8, 9.5, 24, 96, math.sqrt(50)):
        want = np.zeros((40, 256, 256), bool)
        for m in range(2):
            d2 = (yy[None] - tips[:, m, 0, None, None].astype(np.int64)) ** 2 + (
                xx[None] - tips[:, m, 1, None, None].astype(np.int64)) ** 2
            want |= d2 <= radius * radius
        assert np.array_equal(nb.neighbourhood_mask(tips, radius, 256), want), radius


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
                # the same values; ours int16, a quarter of the bytes through the loader (collate keeps them)
                assert a["tokens"].dtype == torch.long and b["tokens"].dtype == torch.int16
                assert torch.equal(a["tokens"], b["tokens"].long()), (name, split, i)
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
    assert (cache / "pathx-hard-release-n40-s0.images.npy").is_file()
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


def test_minutes_count_from_the_command_start(tmp_path, cache):
    """A command that spent its minutes before training (data, masks, probe) stops its run at once,
    checkpointed and resumable, instead of training past the command's limit."""
    import time

    out = tmp_path / "out"
    args = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--runs",
            "scratch", "--steps", "12", "--batch-size", "8", "--mlp-epochs", "2", "--threads", "1", "--device",
            "cpu", "--no-progress", "--minutes", "0.5", "--resume"]
    assert nb.main(args, started=time.monotonic() - 60) == 75
    summary = json.loads((out / "runs" / "scratch-R6-n40" / "summary.json").read_text())
    assert summary["stopped_by"] == "time_limit" and summary["steps"] == 0
    assert nb.main(args[:-3] + ["--resume"]) == 0  # the same run, continued without a limit, finishes
    summary = json.loads((out / "runs" / "scratch-R6-n40" / "summary.json").read_text())
    assert summary["steps"] == 12 and not summary.get("stopped_by")


def test_cnn_control_writes_its_json(tmp_path, cache):
    out = tmp_path / "out"
    args = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--cnn-controls",
            "--cnn-epochs", "1", "--cnn-batch-size", "8", "--cnn-width", "2", "--mlp-epochs", "2", "--threads", "1",
            "--no-progress"]
    assert nb.main(args) == 0
    res = json.loads((out / "cnn_controls-R6-n40.json").read_text())
    assert set(res["inputs"]) == {"masked", "full"}
    for name, r in res["inputs"].items():
        assert r["input"] == name and r["n_train"] == 32 and r["n_val"] == 4 and r["n_test"] == 4
        assert r["test_acc"] in (0, 0.25, 0.5, 0.75, 1)
        assert r["test_se"] == pytest.approx(math.sqrt(r["test_acc"] * (1 - r["test_acc"]) / 4))
        assert 1 <= r["steps"] <= 4 and r["params"] == sum(p.numel() for p in nb.build_cnn(2).parameters())
        with open(out / r["curve"], newline="") as f:
            curve = list(csv.DictReader(f))
        assert curve and int(curve[-1]["step"]) == r["steps"]
        assert any(int(c["step"]) == r["val_best_step"] and float(c["val_acc"]) == r["val_best"] for c in curve)
    assert res["inputs"]["masked"]["radius"] == 6 and res["inputs"]["full"]["radius"] is None
    rows = list(csv.DictReader(open(out / "cnn_controls-R6-n40.csv")))
    assert [r["input"] for r in rows] == ["masked", "full"]
    # --cnn-controls alone trains no Transformer (and leaves the Transformer table alone)
    assert not (out / "runs").exists() and not (out / "neighbourhood.csv").exists()


def test_cnn_marker_channel_is_the_two_disks(tmp_path, monkeypatch):
    """'+markers' inputs reach the CNN as two channels: the gray levels (masked or full) and 255 on
    exactly the pixels within MARKER_DISK of either marker centre."""
    seen = {}

    def fake_train(images, labels, idx, **kw):
        seen[len(seen)] = np.asarray(images)
        return {"test_acc": 0.5, "test_se": 0.0, "test_final_acc": 0.5, "val_best_step": 1, "steps": 1,
                "epochs_run": 1, "stopped_by": None, "curve": [{"step": 1}]}

    monkeypatch.setattr(nb, "train_cnn", fake_train)
    images = np.zeros((3, 128, 128), np.uint8)
    images[:, 60:70, 60:70] = 200
    tips = np.array([[[10, 10], [64, 64]], [[0, 127], [127, 0]], [[50, 50], [52, 80]]], np.int16)

    class A:
        cnn_inputs = ["full+markers", "masked+markers"]
        cnn_epochs, cnn_batch_size, cnn_lr, cnn_width, cnn_pool, cnn_patience, cnn_minutes, seed = 1, 8, 1e-3, 2, "meanmax", 1, None, 0

    nb.cnn_controls(tmp_path, "t", images, tips, np.zeros(3, np.int8), {}, 6.0, A, {})
    full, masked = seen[0], seen[1]
    assert full.shape == masked.shape == (3, 2, 128, 128)
    assert np.array_equal(full[:, 0], images) and np.array_equal(masked[:, 0], nb.mask_images(images, tips, 6.0))
    yy, xx = np.mgrid[:128, :128]
    for i, t in enumerate(tips):
        disk = ((yy - t[0, 0]) ** 2 + (xx - t[0, 1]) ** 2 <= 9) | ((yy - t[1, 0]) ** 2 + (xx - t[1, 1]) ** 2 <= 9)
        assert np.array_equal(full[i, 1] == 255, disk) and np.array_equal(full[i, 1] != 0, disk)
    assert np.array_equal(full[:, 1], masked[:, 1])


def test_cnn_pooled_features_do_not_depend_on_where_a_pattern_sits():
    torch.manual_seed(0)
    model = nb.build_cnn(4).eval()  # fresh weights; BatchNorm the identity in eval mode
    pattern = torch.rand(9, 9)

    def image(y, x, p=pattern):
        img = torch.zeros(1, 1, 128, 128)
        img[0, 0, y:y + 9, x:x + 9] = p
        return img

    with torch.no_grad():
        f = model.features(torch.cat([image(40, 40), image(48, 64), image(72, 48), image(40, 40, pattern.T),
                                      torch.zeros(1, 1, 128, 128)]))
    scale = f[0].abs().max()
    # shifted by multiples of the total stride (8), away from the border: the same pooled features
    assert model.stride == 8
    assert torch.allclose(f[1], f[0], atol=1e-5 * scale) and torch.allclose(f[2], f[0], atol=1e-5 * scale)
    # ... while a different pattern (the transpose) or none changes them: the features see the pattern
    assert (f[3] - f[0]).abs().max() > 0.05 * scale and (f[4] - f[0]).abs().max() > 0.05 * scale


def test_cnn_learns_a_translated_orientation_cue():
    """Horizontal against vertical bars at random places in 32x32 images: the CNN trainer must learn it."""
    rng = np.random.default_rng(0)
    n = 600
    images = np.zeros((n, 32, 32), np.uint8)
    labels = np.arange(n) % 2
    for i in range(n):
        y, x = rng.integers(2, 24, 2)
        if labels[i]:
            images[i, y + 3, x:x + 7] = 255
        else:
            images[i, y:y + 7, x + 3] = 255
    idx = nb.split_indices(n, 0)
    torch.set_num_threads(1)
    r = nb.train_cnn(images, labels, idx, epochs=4, batch_size=16, lr=3e-3, width=2, hidden=16, patience=100,
                     log=lambda s: None)
    assert r["test_acc"] >= 0.9, r
    assert r["steps"] == r["schedule_steps"] == 4 * (480 // 16)


def test_radius_stages_chain_their_weights_and_resume(tmp_path, cache):
    """--radius-stages: one run a stage, each initialised from the previous stage's best weights, the
    whole image last; a second command finds them done. zero_shot.py then scores the stages' weights
    on fresh images at each radius."""
    out = tmp_path / "out"
    base = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--batch-size", "4",
            "--eval-every", "2", "--mlp-epochs", "2", "--threads", "1", "--device", "cpu", "--no-progress"]
    assert nb.main(base + ["--runs", "scratch", "--steps", "2", "--keep-checkpoints", "--tag", "seed", "--no-probe"]) == 0
    first = out / "runs" / "seed" / "checkpoints" / "best.pt"
    stages = base + ["--runs", "pretrained-frozen", "--init-from", str(first), "--radius-stages", "9", "full",
                     "--steps", "2", "--no-probe", "--tag", "cur", "--export-weights", str(tmp_path / "weights")]
    assert nb.main(stages) == 0
    # the finished chain's last stage, exported in bf16 for the repository (lra/weights.py); no other stage
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "weights").rglob("*")) == [
        "weights/cur-2-full", "weights/cur-2-full/config.json", "weights/cur-2-full/model.pt"]
    exported = json.loads((tmp_path / "weights" / "cur-2-full" / "config.json").read_text())
    assert exported["run"] == "cur-2-full" and exported["task"] == "pathx" and exported["dtype"] == "bfloat16"
    assert exported["source"] == str(out / "runs" / "cur-2-full" / "checkpoints" / "best.pt")
    export_mtime = (tmp_path / "weights" / "cur-2-full" / "model.pt").stat().st_mtime
    r1 = json.loads((out / "runs" / "cur-1-R9" / "result.json").read_text())
    r2 = json.loads((out / "runs" / "cur-2-full" / "result.json").read_text())
    assert r1["init_from"] == str(first) and r1["radius"] == 9 and r1["freeze"] == "encoder.pos"
    assert r2["init_from"] == str(out / "runs" / "cur-1-R9" / "checkpoints" / "best.pt") and r2["keep"] == "full"
    assert r1["mlp_acc"] is None
    # one set of weights a chain is kept (the state travels between machines): the newest stage's best
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("runs/cur-*/checkpoints/*.pt")) == [
        "runs/cur-2-full/checkpoints/best.pt"]
    assert first.is_file()  # weights from outside the chain are never deleted
    assert r2["mean_tokens"] > r1["mean_tokens"]  # the whole image: every drawn pixel
    mtime = (out / "runs" / "cur-2-full" / "result.json").stat().st_mtime
    assert nb.main(stages) == 0 and (out / "runs" / "cur-2-full" / "result.json").stat().st_mtime == mtime
    assert (tmp_path / "weights" / "cur-2-full" / "model.pt").stat().st_mtime == export_mtime  # exported once
    with pytest.raises(SystemExit, match="one preset"):
        nb.main(base + ["--runs", "scratch", "pretrained", "--radius-stages", "9", "--steps", "2"])
    # a scratch chain: fresh weights first (here with fixed sin-cos positions, no table), then each
    # stage from the previous one's
    assert nb.main(base + ["--runs", "scratch", "--radius-stages", "9", "full", "--steps", "2", "--no-probe", "--tag", "sc",
                           "--set", "model.pos_emb=grid_sincos"]) == 0
    s1 = json.loads((out / "runs" / "sc-1-R9" / "result.json").read_text())
    s2 = json.loads((out / "runs" / "sc-2-full" / "result.json").read_text())
    assert (s1["preset"], s1["init_from"]) == ("scratch", None) and s1["pos_emb"] == "grid_sincos"
    assert (s2["preset"], s2["init_from"]) == ("pretrained", str(out / "runs" / "sc-1-R9" / "checkpoints" / "best.pt"))
    assert s2["freeze"] == "" and s2["pos_emb"] == "grid_sincos"
    with pytest.raises(SystemExit, match="positive radius"):
        nb.main(base + ["--runs", "pretrained", "--init-from", str(first), "--radius-stages", "0", "--steps", "2"])

    zs = pytest.importorskip("sparseflash.experiments.studies.pathx.zero_shot")
    zout = tmp_path / "zs"
    assert zs.main([str(out / "runs" / "cur-2-full" / "checkpoints" / "best.pt"), "--labels", "curriculum",
                    "--num", "8", "--radii", "6", "full", "--cache", str(cache), "--out", str(zout), "--workers", "1",
                    "--device", "cpu", "--threads", "1"]) == 0
    rows = list(csv.DictReader(open(zout / "zero_shot.csv")))
    assert [r["input"] for r in rows] == ["R6", "full"] and all(int(r["n"]) == 8 for r in rows)
    assert float(rows[1]["mean_tokens"]) > float(rows[0]["mean_tokens"])
    assert (zout / "zero_shot.png").is_file()
    (zout / "zero_shot.png").unlink()
    assert zs.main(["--replot", "--out", str(zout)]) == 0 and (zout / "zero_shot.png").is_file()
    with pytest.raises(SystemExit):
        zs.main([str(tmp_path / "missing.pt"), "--out", str(zout)])
    # the swap test runs through the same command: one row a radius, every image paired
    assert zs.main([str(out / "runs" / "cur-2-full" / "checkpoints" / "best.pt"), "--num", "8", "--radii", "full",
                    "--swap", "6", "--markers-from", "clean", "--cache", str(cache), "--out", str(zout),
                    "--workers", "1", "--device", "cpu", "--threads", "1"]) == 0
    rows = list(csv.DictReader(open(zout / "zero_shot.csv")))
    assert [r["input"] for r in rows] == ["full", "swapR6", "markers-from-clean"] and float(rows[1]["radius"]) == 6
    assert all(int(r["n"]) == 8 for r in rows)
    with pytest.raises(SystemExit):
        zs.main([str(out / "runs" / "cur-2-full" / "checkpoints" / "best.pt"), "--swap", "0", "--out", str(zout)])


def test_swap_puts_one_images_marker_neighbourhoods_into_an_image_of_the_other_label():
    zs = pytest.importorskip("sparseflash.experiments.studies.pathx.zero_shot")
    rng = np.random.default_rng(3)
    n, size, r = 9, 32, 3.0
    images = rng.integers(1, 256, size=(n, size, size)).astype(np.uint8)  # every pixel drawn: nothing hides
    tips = rng.integers(4, size - 4, size=(n, 2, 2))
    labels = np.array([1, 0, 1, 1, 0, 1, 0, 1, 1])  # 3 zeros, 6 ones: 6 composites
    out, lab = zs.swapped_images(images, tips, labels, r, seed=0)
    assert out.shape == (6, size, size) and sorted(lab.tolist()) == [0, 0, 0, 1, 1, 1]
    yy, xx = np.mgrid[:size, :size]

    def near(t):
        return ((yy - t[0, 0]) ** 2 + (xx - t[0, 1]) ** 2 <= r * r) | ((yy - t[1, 0]) ** 2 + (xx - t[1, 1]) ** 2 <= r * r)

    used_a, used_b = set(), set()
    for img, la in zip(out, lab):
        # find A (its neighbourhoods are copied exactly) and B (the other label, the rest copied exactly)
        a = [i for i in range(n) if labels[i] == la and np.array_equal(img[near(tips[i])], images[i][near(tips[i])])]
        b = [j for j in range(n) if labels[j] != la
             and np.array_equal(img[~near(tips[a[0]]) & ~near(tips[j])], images[j][~near(tips[a[0]]) & ~near(tips[j])])
             and not img[near(tips[j]) & ~near(tips[a[0]])].any()]
        assert len(a) == 1 and len(b) == 1
        used_a.add(a[0]); used_b.add(b[0])
    assert len(used_a) == 6 and len(used_b) == 6  # distinct pairs, every A once
    with pytest.raises(ValueError, match="both labels"):
        zs.swapped_images(images, tips, np.ones(n, int), r)


def test_transplanted_marker_discs_come_from_a_donor_of_the_other_label():
    zs = pytest.importorskip("sparseflash.experiments.studies.pathx.zero_shot")
    rng = np.random.default_rng(4)
    n, size = 6, 24
    images = rng.integers(1, 100, size=(n, size, size)).astype(np.uint8)
    donors = rng.integers(150, 256, size=(n, size, size)).astype(np.uint8)
    tips = np.array([[[3, 4], [12, 20]]] * n)
    donor_tips = np.array([[[15, 10], [5, 5]]] * n)  # raster order pairs (5, 5) with (3, 4)
    labels, donor_labels = np.array([0, 1, 0, 1, 1, 0]), np.array([1, 1, 0, 0, 1, 0])
    partners = zs.opposite_partners(labels, donor_labels, seed=0)
    assert all(donor_labels[partners] != labels)
    out = zs.transplant_markers(images, tips, donors, donor_tips, 2.0, partners)
    for i, j in enumerate(partners):
        for (ty, tx), (sy, sx) in (((3, 4), (5, 5)), ((12, 20), (15, 10))):
            for dy in range(-2, 3):
                for dx in range(-2, 3):
                    want = donors[j, sy + dy, sx + dx] if dy * dy + dx * dx <= 4 else images[i, ty + dy, tx + dx]
                    assert out[i, ty + dy, tx + dx] == want
        changed = out[i] != images[i]
        assert changed.sum() == 2 * 13  # two discs of radius 2 (13 pixels each), nothing else
    with pytest.raises(ValueError, match="both labels"):
        zs.opposite_partners(labels, np.ones(n, int))


def test_path256_stage_starts_from_a_pathx_model_with_its_grid_upsampled(tmp_path, cache):
    """--resolution 256: Path-256 images, its config and a 256x256 position grid; a Path-X (128 px)
    checkpoint starts it with its table upsampled 2x2 (frozen, so the trained table is exactly the
    upsampled one). zero_shot.py scores a Path-X model on 256 px images the same way, and on clean
    images with --fidelity clean."""
    from sparseflash.experiments.lra.model import upsample_grid

    out = tmp_path / "out"
    base = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--batch-size", "4",
            "--eval-every", "2", "--threads", "1", "--device", "cpu", "--no-progress", "--no-probe"]
    assert nb.main(base + ["--runs", "scratch", "--steps", "2", "--keep-checkpoints", "--tag", "px"]) == 0
    px = out / "runs" / "px" / "checkpoints" / "best.pt"
    assert nb.main(base + ["--resolution", "256", "--runs", "pretrained-frozen", "--init-from", str(px),
                           "--radius-stages", "12", "--steps", "2", "--tag", "p256"]) == 0
    assert (cache / "path256-hard-release-n40-s0.images.npy").is_file()
    r = json.loads((out / "runs" / "p256-1-R12" / "result.json").read_text())
    assert r["resolution"] == 256 and r["radius"] == 12 and r["freeze"] == "encoder.pos"
    cfg = json.loads((out / "runs" / "p256-1-R12" / "config.json").read_text())
    assert cfg["task"] == "path256" and cfg["model"]["grid"] == [256, 256] and cfg["model"]["black_is_padding"]
    g128 = torch.load(px, map_location="cpu", weights_only=True)["model"]["encoder.pos.grid"]
    g256 = torch.load(out / "runs" / "p256-1-R12" / "checkpoints" / "best.pt", map_location="cpu",
                      weights_only=True)["model"]["encoder.pos.grid"]
    # the frozen 256 table is the 128 one duplicated 2x2, and the stage's kept weights store only that
    # source (compact_grid), which loading upsamples again
    assert torch.equal(g256, g128)
    big = {"encoder.pos.grid": upsample_grid(g128, (256, 256))}
    path = tmp_path / "big.pt"
    torch.save({"model": dict(big)}, path)
    assert nb.compact_grid(path) == 2
    assert torch.equal(torch.load(path, weights_only=True)["model"]["encoder.pos.grid"], g128)
    assert nb.compact_grid(path) == 1  # a random 128 table is not block-constant: kept
    with open(out / "neighbourhood.csv", newline="") as f:
        assert sorted(row["resolution"] for row in csv.DictReader(f)) == ["128", "256"]

    images, tips, labels, _ = nb.load_or_generate(cache, 40, 0, 1, False, resolution=256)
    assert images.shape == (40, 256, 256) and tips.shape == (40, 2, 2) and int(tips.max()) < 256
    ds = nb.NeighbourhoodDataset(images, labels)
    assert (ds.task, ds.seq_len, ds.resolution) == ("path256", 256 * 256, 256)
    with pytest.raises(ValueError, match="images must be"):
        nb.NeighbourhoodDataset(images.reshape(40, -1), labels)
    # a split as indices into the shared arrays: the same items as a copied split, no copy of the images
    ix = np.array([3, 17, 5])
    part, copied = nb.NeighbourhoodDataset(images, labels, "test", index=ix), nb.NeighbourhoodDataset(images[ix], labels[ix])
    assert np.shares_memory(part.images, images) and len(part) == 3
    for i in range(3):
        assert torch.equal(part[i]["tokens"], copied[i]["tokens"]) and part[i]["label"] == copied[i]["label"]
    assert np.array_equal(part.kept_counts(), copied.kept_counts()) and np.array_equal(part.labels, labels[ix])
    with pytest.raises(ValueError, match="index must lie"):
        nb.NeighbourhoodDataset(images, labels, index=[40])
    with pytest.raises(ValueError, match="resolution"):
        nb.generate(2, resolution=64)

    zs = pytest.importorskip("sparseflash.experiments.studies.pathx.zero_shot")
    for extra, cached in ((["--resolution", "256"], "path256-hard-release-n8-s1.images.npy"),
                          (["--fidelity", "clean"], "pathx-hard-clean-n8-s1.images.npy")):
        zout = tmp_path / ("zs-" + extra[1])
        assert zs.main([str(px), "--num", "8", "--radii", "8", "full", "--cache", str(cache), "--out", str(zout),
                        "--workers", "1", "--device", "cpu", "--threads", "1", *extra]) == 0
        assert (cache / cached).is_file()
        rows = list(csv.DictReader(open(zout / "zero_shot.csv")))
        assert [row["input"] for row in rows] == ["R8", "full"] and all(int(row["n"]) == 8 for row in rows)
        assert json.loads((zout / "zero_shot.json").read_text())["meta"][extra[0][2:]] == (
            256 if extra[1] == "256" else "clean")
    # the pooling rescaled to the 16,384 positions the model was trained on: the same images, another loss
    zout = tmp_path / "zs-rescaled"
    assert zs.main([str(px), "--num", "8", "--radii", "8", "full", "--cache", str(cache), "--out", str(zout),
                    "--workers", "1", "--device", "cpu", "--threads", "1", "--resolution", "256", "--rescale-pooling"]) == 0
    plain = list(csv.DictReader(open(tmp_path / "zs-256" / "zero_shot.csv")))
    rescaled = list(csv.DictReader(open(zout / "zero_shot.csv")))
    assert [r["mean_tokens"] for r in rescaled] == [r["mean_tokens"] for r in plain]
    assert all(a["loss"] != b["loss"] for a, b in zip(plain, rescaled))
    # a Path-256 stage's compacted weights load for scoring too
    assert zs.main([str(out / "runs" / "p256-1-R12" / "checkpoints" / "best.pt"), "--num", "8", "--radii", "full",
                    "--cache", str(cache), "--out", str(tmp_path / "zs-p256"), "--workers", "1", "--device", "cpu",
                    "--threads", "1", "--resolution", "256"]) == 0


def test_minutes_size_the_schedule_from_a_measured_step(tmp_path, monkeypatch, cache):
    """Without --steps, --minutes sizes the schedule from measure_step_s, which times the run's own
    loader settings over the later half of its steps."""
    seen = {}
    real = nb.measure_step_s

    def spy(cfg, datasets, device, init_from, n_steps=None, num_workers=0, cuda_graphs=False):
        seen.update(n_steps=n_steps, num_workers=num_workers, cuda_graphs=cuda_graphs)
        seen["step_s"] = real(cfg, datasets, device, init_from, n_steps, num_workers, cuda_graphs)
        return seen["step_s"]

    monkeypatch.setattr(nb, "measure_step_s", spy)
    out = tmp_path / "out"
    minutes = 0.1
    args = ["--num", "40", "--workers", "1", "--cache", str(cache), "--out", str(out), "--runs", "scratch",
            "--batch-size", "8", "--threads", "1", "--device", "cpu", "--no-progress", "--no-probe", "--minutes", str(minutes),
            "--loader-workers", "1", "--tag", "timed", "--log-every", "1"]  # (a curve even if the deadline comes early)
    assert nb.main(args) == 0
    assert seen["num_workers"] == 1 and seen["cuda_graphs"] is False and 0 < seen["step_s"] < 5
    r = json.loads((out / "runs" / "timed" / "result.json").read_text())
    # the budget (the minutes less evaluations) over the measured step, never below the floor of 20; a
    # loaded machine may stop the run at its deadline before the schedule's end
    assert 20 <= r["schedule_steps"] <= max(20, int(minutes * 60 * 0.92 / seen["step_s"]) - 10)
    assert 1 <= r["steps"] <= r["schedule_steps"]
    assert r["wall_s"] < minutes * 60 + 30


def test_stage_minutes_one_for_all_or_one_a_stage(tmp_path):
    base = ["--runs", "pretrained-frozen", "--init-from", str(tmp_path / "w.pt"), "--radius-stages", "8", "16", "full"]
    assert nb.parse_args(base + ["--stage-minutes", "1.5"]).stage_minutes == [1.5, 1.5, 1.5]
    assert nb.parse_args(base + ["--stage-minutes", "5", "1", "2"]).stage_minutes == [5, 1, 2]
    for bad in (["5", "1"], ["1", "0", "1"]):
        with pytest.raises(SystemExit):
            nb.parse_args(base + ["--stage-minutes", *bad])
    with pytest.raises(SystemExit):
        nb.parse_args(["--runs", "scratch", "--stage-minutes", "1"])  # only with --radius-stages


def test_curriculum_report_collects_runs_without_weights_and_orders_the_stages(tmp_path):
    cr = pytest.importorskip("sparseflash.experiments.studies.pathx.curriculum_report")
    state, out = tmp_path / "pxstate", tmp_path / "report"

    def run(folder, tag, radius, acc, tokens, pattern=None):
        d = state / folder / "runs" / tag
        (d / "checkpoints").mkdir(parents=True)
        (d / "checkpoints" / "best.pt").write_bytes(b"weights")
        (d / "train.csv").write_text("step,acc\n1,0.5\n")
        (d / "result.json").write_text(json.dumps({
            "tag": tag, "radius": radius, "mean_tokens": tokens, "lr": 3e-4, "steps": 10, "wall_s": 1.0, "step_ms": 11.0,
            "train_acc_last": acc, "val_best": acc, "val_best_step": 10, "test_acc": acc, "test_se": 0.005,
            "n_test": 10000, "init_from": f"x/runs/{tag}-prev/checkpoints/best.pt", "torch": "2.11", "commit": "abc",
            "date": "2026-11-27"}))
        (d / "summary.json").write_text(json.dumps({"pattern": pattern, "density": 0.06, "gpu": "H200"}))

    run("nb-f3", "frozen-lr3e-4", 6.0, 0.647, 149.0)
    run("nb-f3", "frozen-lr1e-3", 6.0, 0.515, 149.0)  # not the curriculum's start: left out
    run("nb-cur-coarse", "coarse-2-full", None, 0.581, 2154.0)
    run("nb-cur-coarse", "coarse-1-R9", 9.0, 0.636, 185.0)
    run("nb-cont-bfly", "cont-bfly-1-full", None, 0.572, 2154.0, "butterfly")
    assert cr.main(["--collect", str(state), "--out", str(out)]) == 0
    assert not list(out.rglob("*.pt")) and (out / "runs" / "coarse" / "coarse-1-R9" / "train.csv").is_file()
    rows = list(csv.DictReader(open(out / "curriculum.csv")))
    assert [(r["chain"], r["stage"], r["input"]) for r in rows] == [
        ("start", "0", "R6"), ("coarse", "1", "R9"), ("coarse", "2", "full"), ("cont-bfly", "1", "full")]
    assert rows[-1]["pattern"] == "butterfly" and rows[1]["pattern"] == "dense" and rows[1]["init_from"] == "coarse-1-R9-prev"
    assert (out / "curriculum.png").is_file()
    (out / "curriculum.png").unlink()
    assert cr.main(["--out", str(out)]) == 0 and (out / "curriculum.png").is_file()  # from the copies alone
    with pytest.raises(SystemExit):
        cr.main(["--out", str(tmp_path / "empty")])
    # Path-256: its own chains only (the Path-X folders above are not collected)
    run("nb-p256-sincos-stages", "sincos-stages-2-full", None, 0.62, 2451.0, "butterfly")
    run("nb-p256-sincos-stages", "sincos-stages-1-R8", 8.0, 0.651, 285.0, "butterfly")
    out256 = tmp_path / "report256"
    assert cr.main(["--resolution", "256", "--collect", str(state), "--out", str(out256)]) == 0
    rows = list(csv.DictReader(open(out256 / "curriculum.csv")))
    assert [(r["chain"], r["input"]) for r in rows] == [("sincos-stages", "R8"), ("sincos-stages", "full")]
    assert (out256 / "curriculum.png").is_file()


def test_probe_trained_on_one_set_scores_each_test_set(tmp_path):
    """fit_mlp_tests: one set of weights, several test sets (a cue that flips between the sets is
    read on one and inverted on the other); xfidelity_probe.py writes its table."""
    from sparseflash.experiments.lra.probe import fit_mlp, fit_mlp_tests

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1500, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    accs = fit_mlp_tests(x[:1000], y[:1000], {"same": (x[1000:], y[1000:]), "flipped": (x[1000:], 1 - y[1000:])},
                         epochs=20)
    assert accs["same"] > 0.9 and accs["flipped"] < 0.1
    assert fit_mlp(x[:1000], y[:1000], x[1000:], y[1000:], epochs=20) == accs["same"]  # the same weights

    xf = pytest.importorskip("sparseflash.experiments.studies.pathx.xfidelity_probe")
    out = tmp_path / "out"
    assert xf.main(["--num", "40", "--epochs", "2", "--workers", "1", "--cache", str(tmp_path / "cache"),
                    "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "xfidelity_probe.csv")))
    assert [(r["trained_on"], r["tested_on"]) for r in rows] == [
        ("release", "release"), ("release", "clean"), ("clean", "release"), ("clean", "clean")]
    assert all(int(r["n_test"]) == 8 and int(r["features"]) == 2 * 13 * 13 for r in rows)
    assert xf.main(["--num", "40", "--epochs", "2", "--workers", "1", "--cache", str(tmp_path / "cache"),
                    "--out", str(out), "--binarize"]) == 0
    rows = list(csv.DictReader(open(out / "xfidelity_probe-binary.csv")))
    assert len(rows) == 4 and all(r["binarize"] == "True" for r in rows)
    assert xf.main(["--num", "40", "--epochs", "2", "--workers", "1", "--cache", str(tmp_path / "cache"),
                    "--out", str(out), "--features", "coords"]) == 0
    rows = list(csv.DictReader(open(out / "xfidelity_probe-coords.csv")))
    assert len(rows) == 4 and all(int(r["features"]) == 4 and r["feature_set"] == "coords" for r in rows)
    with pytest.raises(SystemExit):
        xf.main(["--features", "coords", "--binarize", "--out", str(out)])
    assert xf.main(["--num", "40", "--epochs", "2", "--workers", "1", "--cache", str(tmp_path / "cache"),
                    "--out", str(out), "--resolution", "256"]) == 0
    rows = list(csv.DictReader(open(out / "xfidelity_probe-256.csv")))
    assert len(rows) == 4 and all(r["resolution"] == "256" and int(r["features"]) == 2 * 17 * 17 for r in rows)


def test_cache_is_memory_mapped_and_reads_old_npz(tmp_path):
    made = nb.load_or_generate(tmp_path, 12, 5, 1, False)
    again = nb.load_or_generate(tmp_path, 12, 5, 1, False)
    assert isinstance(again[0], np.memmap) and again[3]["generated_s"] is None
    for a, b in zip(made[:3], again[:3]):
        assert np.array_equal(a, b)
    assert np.array_equal(nb.mask_images(again[0], again[1], 6), nb.mask_images(made[0], made[1], 6))
    assert type(nb.mask_images(again[0], again[1], None)) is np.ndarray  # a copy in memory
    # a cache an earlier commit wrote (one compressed .npz) is read as it is
    np.savez_compressed(tmp_path / "pathx-hard-release-n12-s6.npz", images=made[0], tips=made[1], labels=made[2])
    old = nb.load_or_generate(tmp_path, 12, 6, 1, False)
    assert old[3]["cache"].endswith(".npz") and np.array_equal(old[0], made[0])


def test_position_codes_reads_coordinates_through_each_code(tmp_path):
    pc = pytest.importorskip("sparseflash.experiments.studies.pathx.position_codes")
    ck = tmp_path / "best.pt"
    torch.save({"model": {"encoder.pos.grid": torch.randn(8, 8, 6)}}, ck)
    out = tmp_path / "out"
    assert pc.main(["--checkpoint", str(ck), "--num", "40", "--epochs", "2", "--workers", "1", "--out", str(out),
                    "--cache", str(tmp_path / "cache")]) == 0
    assert (tmp_path / "cache" / "path256-hard-release-n40-s0.images.npy").is_file()
    rows = list(csv.DictReader(open(out / "position_codes.csv")))
    assert [(r["features"], int(r["dims"])) for r in rows] == [
        ("coordinates", 4), ("learned table at the markers", 12), ("2-D sin-cos codes at the markers", 12)]
    meta = json.loads((out / "position_codes.json").read_text())["meta"]
    assert meta["table"] == [8, 8] and -1 <= meta["neighbour_cosine"] <= 1
    r, c = pc.marker_cells(np.array([[[5, 1], [2, 9]]]), 256)  # raster order: (2, 9) first
    assert r.tolist() == [[2, 5]] and c.tolist() == [[9, 1]]
    torch.save({"model": {}}, ck)
    with pytest.raises(SystemExit):
        pc.main(["--checkpoint", str(ck), "--num", "40", "--out", str(out), "--cache", str(tmp_path / "cache")])
