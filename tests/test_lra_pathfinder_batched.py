"""Tests of the batched Pathfinder sampler (experiments/lra/data/_pathfinder_batched.py): its tables
against the reference's arithmetic, purity and worker-count independence of what the writer
writes, geometry invariants at every resolution, a small statistical comparison with the
reference generator at 32 px that fails if the task drifts, and pinned hashes of a few images (a
speed-up must not change a single draw). About 30 s on one core."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from scipy import ndimage, stats

from sparseflash.experiments.lra.data import pathfinder as pf


@pytest.mark.parametrize("resolution,margin", [(32, 1), (64, 1), (128, 3)])
def test_batched_pmf_and_collision_match_the_reference(resolution, margin):
    """On a real occupancy (two target snakes and distractors), at pivots all over the image and every
    orientation kind: the batched candidate probabilities equal the reference's ``extend`` pmf, and
    the uint8 threshold collision test decides as its float32 ``(R + mask).max() < 1.8``."""
    p = pf.params_for(resolution, "hard")
    g = pf._geometry(p, margin)
    b = pf._batched(g)
    rng = np.random.default_rng(resolution)
    M, _ = b.sample(rng, 1, p.max_target_attempts)[0]
    for _ in range(3):
        d = pf._distractor(g, rng, M, p.distractor_length)
        M = M if d is None else d[0]
    M8 = np.round(M.ravel() * 255).astype(np.uint8)
    assert np.array_equal(M8.astype(np.float32) / 255, M.ravel())  # occupancy is exactly k / 255
    n = 400
    t = rng.integers(0, b.thetas.size, n)
    py, px = rng.integers(0, p.resolution, n), rng.integers(0, p.resolution, n)
    cand, pmf = b.candidates(M8, np.zeros(n, np.int64), py, px, t)
    for r in range(n):  # the reference's formula, on the full candidate set
        theta = float(b.thetas[t[r]])
        ref = (1 - M.ravel()[(py[r] + g.P) * g.Wc + px[r] + g.P + g.cring].max(1)) * g.weights(theta)
        hy, hx = py[r] + g.cdy, px[r] + g.cdx
        ref[(hy < 0) | (hy >= g.H) | (hx < 0) | (hx >= g.W)] = 0
        ours = np.zeros_like(ref)
        ours[cand[r, :b.nc[t[r]]]] = pmf[r, :b.nc[t[r]]]
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)
        k = int(rng.integers(g.cdy.size))  # collision of candidate k's paddle at a random head
        hy, hx = int(rng.integers(0, g.H)), int(rng.integers(0, g.W))
        sl, _, mask = g.slices(hy, hx, g.cpatch[k])
        anchor = (hy + g.P) * g.Wc + hx + g.P
        ours_ok = not (M8[anchor + b.coff[360 + k]] >= b.cthr[360 + k]).any()
        assert ours_ok == bool((M[sl] + mask).max() < 1.8)


@pytest.mark.parametrize("fidelity", pf.FIDELITIES)
def test_batched_first_seed_rectangle_is_the_available_set(fidelity):
    """The first seed's tail is uniform on a rectangle per degree: exactly the pixels where the
    reference's seed search succeeds (clean: free pixel, footprint free; release: an orientation
    the original can seed at all, footprint free)."""
    for res, margin in ((32, 1), (128, 2)):
        g = pf._geometry(pf.params_for(res, "hard", fidelity), margin)
        b = pf._batched(g)
        Mf = g.M1.ravel()
        yy, xx = np.mgrid[0:g.H, 0:g.W]
        cand = ((yy + g.P) * g.Wc + xx + g.P).ravel()
        for deg in (-180, -140, -97, 0, 45, 179):
            offs = g.seed_paddle(deg)[1]
            ok = Mf[cand[:, None] + offs[None, :]].max(1) <= 0.3
            ok &= (Mf[cand] <= 0.3) if fidelity == "clean" else g.seed_allowed(deg)
            y0, y1, x0, x1 = b.seed_box[deg + 180]
            box = (yy.ravel() >= y0) & (yy.ravel() <= y1) & (xx.ravel() >= x0) & (xx.ravel() <= x1)
            assert np.array_equal(ok, box), (res, deg)


def _disk(r):
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return x * x + y * y <= r * r


@pytest.mark.parametrize("resolution,n", [(32, 40), (64, 6), (128, 4), (256, 4)])
def test_batched_geometry_invariants(resolution, n):
    """Hard, batched, clean: no pixel drawn by two snakes, each target snake one chain, markers on
    drawn pixels of the snakes they claim (origin tip of one, terminal tip of the same or the
    other), margins from the resolution's set, and the labels' randomness only in the markers."""
    p = pf.params_for(resolution, "hard", "clean")
    labels = [i % 2 for i in range(n)]
    made = pf.render_many(p, np.random.default_rng([5, resolution]), labels, return_layers=True)
    flipped = pf.render_many(p, np.random.default_rng([5, resolution]), [1 - v for v in labels], return_layers=True)
    for label, (img, lay), (_, lay_f) in zip(labels, made, flipped):
        assert img.dtype == np.uint8 and img.shape == (resolution, resolution) and img.max() == 255
        ids, m = lay["ids"], lay["margin"]
        assert m in p.margins and lay["count"].max() <= 1
        assert 0 <= lay["num_distractors"] <= p.num_distractors
        for s in (1, 2):
            comp, k = ndimage.label(ndimage.binary_dilation(ids == s, _disk(m + 2)))
            assert k == 1 and comp[lay["origins"][s - 1]] == comp[lay["terminals"][s - 1]] == 1
            assert len(lay["thetas"][s - 1]) == p.contour_length
        tips, snakes = lay["tips"], lay["tip_snakes"]
        assert [ids[t] for t in tips] == list(snakes) and (snakes[0] == snakes[1]) == bool(label)
        assert tips[0] in lay["origins"] and tips[1] in lay["terminals"]
        assert np.array_equal(lay_f["ids"], ids) and lay_f["tips"][0] == tips[0]  # same draws, other label


def test_batched_render_errors_and_reference_method():
    p = pf.params_for(32, "hard")
    with pytest.raises(ValueError, match="method"):
        pf.render(p, np.random.default_rng(0), 1, method="fast")
    with pytest.raises(ValueError, match="labels"):
        pf.render_many(p, np.random.default_rng(0), [0, 2])
    with pytest.raises(ValueError, match="labels"):
        pf.render_many(p, np.random.default_rng(0), [])
    img = pf.render(p, np.random.default_rng([1, 2]), 1, method="reference")
    assert np.array_equal(img, pf.render(p, np.random.default_rng([1, 2]), 1, method="reference"))
    assert not np.array_equal(img, pf.render(p, np.random.default_rng([1, 2]), 1))  # other draws, same law
    tight = dataclasses.replace(pf.params_for(64, "hard"), max_target_attempts=5)
    with pytest.raises(RuntimeError, match="could not place the two target snakes"):
        pf.render(tight, np.random.default_rng(3), 0)
    with pytest.raises(ValueError, match="method"):
        pf.write_pathfinder("unused", 32, "hard", 1, method="fast")


def _tree_bytes(root):
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_batched_writer_images_are_pure_functions_of_their_index(tmp_path):
    """Image g does not depend on the worker count or on how many images are written, also where a
    chunk (50 images at 32 px) straddles batch folders and is cut short by ``num``; the reference
    method's writer is worker-count independent too."""
    pf.write_pathfinder(tmp_path / "a", 32, "hard", 60, seed=2, workers=1, per_batch=20, show_progress=False)
    pf.write_pathfinder(tmp_path / "b", 32, "hard", 40, seed=2, workers=2, per_batch=20, show_progress=False)
    a, b = _tree_bytes(tmp_path / "a"), _tree_bytes(tmp_path / "b")
    # images, metadata files and generation.json (which records num, so it differs)
    assert len(a) == 60 + 3 + 1 and len(b) == 40 + 2 + 1
    assert all(a[k] == v for k, v in b.items() if not k.endswith(pf.GENERATION_FILE))
    for w in (1, 2):
        pf.write_pathfinder(tmp_path / f"r{w}", 32, "hard", 12, seed=1, workers=w, per_batch=5, show_progress=False,
                            method="reference")
    assert _tree_bytes(tmp_path / "r1") == _tree_bytes(tmp_path / "r2")


@pytest.mark.parametrize("fidelity", pf.FIDELITIES)
def test_batched_matches_reference_statistics_at_32(fidelity):
    """200 images per method at 32 px hard (fixed seeds, so deterministic): every measured quantity's
    two-sample test stays above p = 0.001 and its mean within 0.35 reference standard deviations.
    A sampler that, e.g., dropped the continuity weight, the occupancy term or a retry fails this,
    and so does one whose commits (shared or per-snake occupancy) differ from the reference's."""
    p = pf.params_for(32, "hard", fidelity)
    ref = [pf.image_stats(*pf.render(p, np.random.default_rng([9, i]), i % 2, True, method="reference"))
           for i in range(200)]
    new = []
    for c in range(4):
        new += [pf.image_stats(img, lay) for img, lay in
                pf.render_many(p, np.random.default_rng([10, c]), [i % 2 for i in range(50)], True)]
    for q in ("pixels_1", "pixels_2", "end_to_end_1", "end_to_end_2", "turn_mean_1", "turn_mean_2", "turn_max_1",
              "distractor_pixels", "marker_distance", "lit_fraction", "mean_intensity"):
        a, b = np.array([r[q] for r in ref], float), np.array([r[q] for r in new], float)
        assert stats.ks_2samp(a, b).pvalue > 1e-3, q
        assert abs(b.mean() - a.mean()) <= 0.35 * a.std(), q
    a, b = np.array([r["distractors"] for r in ref]), np.array([r["distractors"] for r in new])
    levels = np.union1d(a, b)
    table = np.array([[np.sum(a == v) for v in levels], [np.sum(b == v) for v in levels]])
    assert stats.chi2_contingency(table).pvalue > 1e-3


# sha256 (first 16 hex digits) of the images of render_many(params_for(resolution, difficulty,
# fidelity), default_rng([4, resolution]), [0, 1, 0, ...][:n]), as drawn by the sampler before its
# rewrite for speed (commit 8d8dfcc). Tied to the resampling of the NumPy and Pillow in use: if an
# upgrade of either changes them, check the images, then re-pin.
_PINNED = {
    ("release", 32, "hard", 6): "f803db93e8ddc589",
    ("release", 64, "hard", 2): "fdb8966325ef2378",
    ("release", 128, "hard", 3): "be62131d049e40d7",
    ("clean", 64, "hard", 2): "9176efadc184483e",
    ("clean", 128, "easy", 2): "794ed4a837411eab",
    ("release", 256, "hard", 2): "9227f1de43f7382e",
}


@pytest.mark.parametrize("key", list(_PINNED), ids=lambda k: "-".join(map(str, k)))
def test_batched_images_are_pinned(key):
    """The batched sampler's output is part of the data's definition (datasets are regenerated on
    every machine): the same seed must give byte-identical images, at both fidelities."""
    fidelity, resolution, difficulty, n = key
    p = pf.params_for(resolution, difficulty, fidelity)
    imgs = pf.render_many(p, np.random.default_rng([4, resolution]), [i % 2 for i in range(n)])
    assert hashlib.sha256(b"".join(i.tobytes() for i in imgs)).hexdigest()[:16] == _PINNED[key]
