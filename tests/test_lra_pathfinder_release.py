"""The release fidelity of the Pathfinder generator: the authors' code's behaviour, quirks included.

Pins the seed orientations the original can place per resolution (checked against an independent
emulation of OpenCV's float dilation with its -DBL_MAX border, not the quadrant rule the generator
uses), and the measured statistics that separate release images from clean ones at 32 px."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparseflash.experiments.lra.data import pathfinder as pf

# (resolution, margin) -> orientations (whole degrees) at which the original can seed a snake
PINNED = {(32, 1): 30, (64, 1): 95, (128, 2): 354, (128, 3): 360, (256, 3): 360}


def _opencv_dilate_min(src: np.ndarray, kernel: np.ndarray) -> float:
    """min of cv2.dilate(src float64, kernel) with the default border (-DBL_MAX for dilation):
    dst[y, x] = max over kernel[i, j] != 0 of src[y + i - c, x + j - c], out of the image -inf."""
    c = kernel.shape[0] // 2
    H, W = src.shape
    pad = np.full((H + 2 * c, W + 2 * c), -np.inf)
    pad[c:c + H, c:c + W] = src
    out = np.full(src.shape, -np.inf)
    for i, j in zip(*np.nonzero(kernel)):
        np.maximum(out, pad[i:i + H, j:j + W], out=out)
    return float(out.min())


def _struct(g, deg: int) -> np.ndarray:
    """The original's seed kernel: the paddle's mask drawn in a (2(L+m)+1)^2 square from one pixel
    right of and below its centre, cast to uint8 (only exact ones survive)."""
    c = g.L + g.m
    _, _, _, mask = g.patch(deg * np.pi / 180)
    R = mask.shape[0] // 2
    square = np.zeros((2 * c + 1, 2 * c + 1))
    for a in range(mask.shape[0]):
        for b in range(mask.shape[1]):
            i, j = a - R + c + 1, b - R + c + 1
            if 0 <= i <= 2 * c and 0 <= j <= 2 * c:
                square[i, j] = mask[a, b]
    return square.astype(np.uint8)


@pytest.mark.parametrize("resolution,margin", sorted(PINNED))
def test_release_seed_orientations_are_pinned(resolution, margin):
    g = pf._geometry(pf.params_for(resolution, "hard", "release"), margin)
    allowed = [d for d in range(-180, 180) if g.seed_allowed(d)]
    assert len(allowed) == PINNED[resolution, margin]
    occupancy = np.zeros((resolution, resolution))
    occupancy[:1], occupancy[-1:], occupancy[:, :1], occupancy[:, -1:] = 1, 1, 1, 1
    step = 1 if resolution <= 64 else 15  # every orientation where it matters, a sample where nearly all pass
    for deg in range(-180, 180, step):
        fails = _opencv_dilate_min(occupancy, _struct(g, deg)) < 0
        assert fails == (not g.seed_allowed(deg)), deg
    # the footprint the generator tests is that kernel's nonzero set, relative to the anchor
    for deg in allowed[:: max(1, len(allowed) // 6)]:
        K = _struct(g, deg)
        c = K.shape[0] // 2
        ky, kx = np.nonzero(K)
        offs = g.seed_paddle(deg)[1]
        assert sorted(((ky - c) * g.Wc + kx - c).tolist()) == sorted(offs.tolist())
    assert all(pf._geometry(pf.params_for(resolution, "hard", "clean"), margin).seed_allowed(d) for d in range(-180, 180))
    if resolution == 32:  # all pointing up-left (image coordinates: y down)
        assert allowed == list(range(-150, -120))


def test_release_marker_and_lines_keep_their_overshoot():
    """The release resampled markers and lines in float (a ring above the disk's level), the clean
    generator through 8 bits (clipped)."""
    rel, cln = pf._marker_patch(2.5, True), pf._marker_patch(2.5, False)
    assert rel.max() > 1.05 and cln.max() <= 1.0
    k = rel.shape[0] // 2
    assert rel.max() > rel[k, k] and abs(rel[k, k] - 1) < 0.05  # the ring, not the centre, is brightest
    g_rel = pf._geometry(pf.params_for(64, "hard", "release"), 1)
    g_cln = pf._geometry(pf.params_for(64, "hard", "clean"), 1)
    line_rel, line_cln = g_rel.patch(0.3)[2], g_cln.patch(0.3)[2]
    assert line_rel.min() < 0 <= line_cln.min()  # Lanczos' negative lobes kept in float, clipped in 8 bits
    # otherwise the same drawing (8-bit resampling also clips between its two passes: a few levels)
    assert np.abs(np.clip(line_rel, 0, 1) - line_cln).max() < 16 / 255
    assert np.array_equal(g_rel.patch(0.3)[3], g_cln.patch(0.3)[3])  # the occupancy mask is the same


def _stats(fidelity, n=100):
    p = pf.params_for(32, "hard", fidelity)
    out = []
    for c in range(n // 50):
        out += pf.render_many(p, np.random.default_rng([77, c]), [i % 2 for i in range(50)], True)
    return p, out


def test_release_statistics_at_32_differ_from_clean_as_measured():
    """At 32 px the release's distractor seeds mostly fail (about 1.3 distractors per image against
    4.6), so more pixels are exactly black (0.62-0.66 against 0.54); every target snake leaves its
    origin at a seedable orientation; the two targets may share pixels, the clean ones never."""
    p_rel, rel = _stats("release")
    p_cln, cln = _stats("clean")
    d_rel = np.mean([lay["num_distractors"] for _, lay in rel])
    d_cln = np.mean([lay["num_distractors"] for _, lay in cln])
    b_rel = np.mean([(img == 0).mean() for img, _ in rel])
    b_cln = np.mean([(img == 0).mean() for img, _ in cln])
    assert 0.9 <= d_rel <= 1.8 and d_cln >= 4.0, (d_rel, d_cln)
    assert 0.60 <= b_rel <= 0.68 and 0.50 <= b_cln <= 0.57, (b_rel, b_cln)
    g = pf._geometry(p_rel, 1)
    first = [round(math.degrees(lay["thetas"][0][0])) for _, lay in rel]
    assert all(g.seed_allowed(d) for d in first)
    assert max(lay["count"].max() for _, lay in rel) >= 2 and max(lay["count"].max() for _, lay in cln) == 1
    # markers: the release's float rendering puts the marker interior below the image maximum
    assert all(img.max() == 255 for img, _ in rel)


def test_loader_refuses_the_other_fidelity(tmp_path):
    from sparseflash.experiments.lra.data import get_dataset
    from sparseflash.experiments.lra.data.datasets import MalformedDataError, folder_fidelity

    pf.write_pathfinder(tmp_path / "r", 32, "hard", 20, seed=1, workers=1, per_batch=20, show_progress=False)
    pf.write_pathfinder(tmp_path / "c", 32, "hard", 20, seed=1, workers=1, per_batch=20, show_progress=False,
                        fidelity="clean")
    assert folder_fidelity(tmp_path / "r" / "pathfinder32" / "curv_contour_length_14") == "release"
    assert get_dataset("pathfinder32", tmp_path / "c", "test", fidelity="clean").fidelity == "clean"
    assert get_dataset("pathfinder32", tmp_path / "r", "test").fidelity == "release"
    with pytest.raises(MalformedDataError, match="holds 'clean' Pathfinder data, but 'release' was asked for"):
        get_dataset("pathfinder32", tmp_path / "c", "test", fidelity="release")
    with pytest.raises(ValueError, match="fidelity must be one of"):
        get_dataset("pathfinder32", tmp_path / "c", "test", fidelity="authors")
    with pytest.raises(ValueError, match="differs in \\['fidelity'\\]"):
        pf.write_pathfinder(tmp_path / "c", 32, "hard", 20, seed=1, workers=1, per_batch=20, show_progress=False,
                            resume=True)


def test_probe_classifier_finds_a_planted_cue_and_nothing_in_noise():
    """The probe's MLP learns a label that is a function of marker coordinates, and stays at chance
    (within 3 standard errors) on labels independent of them: its score can go either way."""
    from sparseflash.experiments.lra.probe import fit_mlp

    rng = np.random.default_rng(0)
    x = rng.random((1600, 4)).astype(np.float32)
    y = ((x[:, 0] - x[:, 2]) * (x[:, 1] - x[:, 3]) > 0).astype(np.int64)  # markers in "\" order
    acc = fit_mlp(x[:1200], y[:1200], x[1200:], y[1200:], epochs=40)
    assert acc > 0.9
    y_noise = rng.integers(0, 2, 1600)
    acc = fit_mlp(x[:1200], y_noise[:1200], x[1200:], y_noise[1200:], epochs=40)
    assert abs(acc - 0.5) < 3 * math.sqrt(0.25 / 400)


def test_probe_cnn_finds_a_translated_patch_cue_and_nothing_in_noise():
    """The second learner (`probe.fit_cnn`, two 7x7 patches as channels) learns a label carried by a
    short bar's orientation at a random place in the first patch, and stays at chance (within 3 standard
    errors) on labels independent of the patches."""
    from sparseflash.experiments.lra.probe import fit_cnn

    rng = np.random.default_rng(1)
    n, side = 1600, 7
    x = rng.random((n, 2, side, side)).astype(np.float32) * 0.3
    y = rng.integers(0, 2, n)
    for i in range(n):
        r, c = rng.integers(1, side - 1, 2)
        if y[i]:
            x[i, 0, r - 1:r + 2, c] = 1.0  # vertical bar
        else:
            x[i, 0, r, c - 1:c + 2] = 1.0  # horizontal bar
    x = x.reshape(n, -1)
    assert fit_cnn(x[:1200], y[:1200], x[1200:], y[1200:], side=side, epochs=15) > 0.9
    y_noise = rng.integers(0, 2, n)
    acc = fit_cnn(x[:1200], y_noise[:1200], x[1200:], y_noise[1200:], side=side, epochs=15)
    assert abs(acc - 0.5) < 3 * math.sqrt(0.25 / 400)


def test_probe_data_and_command_on_tiny_data(tmp_path):
    """Features come from the true marker centres (the patch centre is a marker pixel), in raster
    order; the command writes its table and figure."""
    import json

    from sparseflash.experiments.lra.probe import probe_data, run_probe, save

    coords, patches, labels = probe_data(32, "release", 60, workers=1, show_progress=False)
    assert coords.shape == (60, 4) and labels.tolist() == [i % 2 for i in range(60)]
    k = 2 + 3  # ceil(1.5) + 3
    side = 2 * k + 1
    assert patches.shape == (60, 2 * side * side)
    centre = patches.reshape(60, 2, side, side)[:, :, k, k]
    assert (centre > 0.3).all()  # marker disks are drawn where the layers say
    first, second = coords[:, :2], coords[:, 2:]
    assert ((first[:, 0] < second[:, 0]) | ((first[:, 0] == second[:, 0]) & (first[:, 1] <= second[:, 1]))).all()
    rows = run_probe([32], ["release", "clean"], 60, epochs=2, show_progress=False)
    save(rows, tmp_path, {"num": 60})
    saved = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert len(saved) == 6 and {r["fidelity"] for r in saved} == {"release", "clean"}
    assert all(0 <= r["acc"] <= 1 and r["n_test"] == 15 for r in saved)
    assert (tmp_path / "probe.png").stat().st_size > 0 and (tmp_path / "probe.csv").read_text().count("\n") == 7


def test_cross_evaluation_of_a_run_on_the_other_fidelity(tmp_path):
    """A run trained on release data is evaluated on clean data only when asked for explicitly."""
    from sparseflash.experiments.lra.configs import get_config
    from sparseflash.experiments.lra.crosseval import evaluate_run
    from sparseflash.experiments.lra.data.datasets import MalformedDataError
    from sparseflash.experiments.lra.train import train

    for fid in ("release", "clean"):
        pf.write_pathfinder(tmp_path / fid, 32, "hard", 40, seed=1, workers=1, per_batch=40, show_progress=False,
                            fidelity=fid)
    cfg = get_config("pathfinder32", "quick", ["model.d_model=16", "model.d_ff=16", "train.batch_size=8",
                                               "train.eval_every=2", "train.eval_batches=1", "model.attention=torch"])
    train(cfg, tmp_path / "run", data_root=tmp_path / "release", max_steps=2, device="cpu", show_progress=False)
    with pytest.raises(MalformedDataError, match="holds 'clean'"):
        evaluate_run(tmp_path / "run", tmp_path / "clean", device="cpu")
    r = evaluate_run(tmp_path / "run", tmp_path / "clean", fidelity="clean", split="all", device="cpu")
    assert r["trained_on"] == "release" and r["fidelity"] == "clean" and r["n"] == 40 and 0 <= r["acc"] <= 1
    from sparseflash.experiments.lra.provenance import code_commit

    assert r["commit"] == code_commit() and r["date"][:2] == "20" and r["gpu"] is None  # the code that ran, recorded
