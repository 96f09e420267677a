"""Pathfinder / Path-X / Path-256 (Linsley et al. 2018; Kim et al. 2020; LRA): generator.

An image holds two long target "snakes" (chains of short line segments, "paddles"), shorter
distractor snakes, and two disk markers on snake tips. Label 1: both markers lie on the two ends of
one snake; label 0: they lie on ends of different snakes. The algorithm is that of the authors'
``snakes2.py`` as run for LRA (parameters per resolution from LRA's ``pathfinder.py``):

1. Target seeds. The first paddle of snake 1 starts at a random pixel at least ``2 * seed_distance``
   from the border whose paddle does not touch occupied pixels, at a random whole-degree
   orientation; snake 2 starts ``seed_distance`` away in a random direction. Their start pixels are
   the *origin tips*.
2. Growth, alternating between the two snakes, ``contour_length - 1`` times each: the next pivot
   lies ``length + 2 margin`` ahead of the last one; candidate heads are the distinct pixels on the
   circle of radius ``length + margin`` around it, weighted by ``max(cos(min(continuity *
   |turn|, pi/2)), 0)^2`` (smooth curvature) times ``1 - occupancy`` (occupancy dilated by a disk of
   radius ``margin``); a sampled paddle runs from the head back towards the pivot and is rejected
   if its margin-dilated mask overlaps occupied space (sum > 1.8); up to 3 samples, else the pair
   of snakes is discarded and drawn again. The last heads are the *terminal tips*.
3. Distractors: ``distractor_budget // (contour_length // 3)`` snakes of ``contour_length // 3``
   paddles each, seeded anywhere free (stop when < 1% of the image is free), up to 5 tries each,
   skipped if they do not fit.
4. Markers: a disk of radius ``marker_radius`` on the origin tip of a random target snake, the
   other on the terminal tip of the same snake (label 1) or of the other one (label 0).
5. The image (max of all paddles times their contrast, and markers at 1) is scaled so its maximum
   is 255 and saved as 8-bit grayscale PNG (what ``scipy.misc.imsave`` did).

Paddles and markers are drawn as the authors drew them: a PIL line ``thickness * 2`` wide on a
canvas 2x finer, dilated by a disk of radius ``2 * margin`` for the occupancy mask, both
Lanczos-resized to pixels (``scipy.misc.imresize`` was PIL's Lanczos), contrast applied. Because
paddles start on whole pixels and their orientations come from a fixed set (whole degrees for
seeds, the candidate directions around a pivot otherwise), every patch is rendered once per
process and images are assembled by pasting patches: this, not vectorising the drawing, is what
makes the generator fast. Where we differ from the original code, and why:

- Collision checks include the newest paddle of the *other* target snake (the original checked a
  new paddle only against paddles committed one step earlier, so the two target snakes could touch
  at their growing ends), and both target snakes are committed before the distractors (the
  original committed only snake 2's last paddle).
- A seed paddle's footprint is where its mask reaches 0.9 at the tail itself (the original used
  mask = 1 shifted by one pixel diagonally, a kernel-anchor quirk that lets a seed's edge pixels
  land on another snake). With this, no pixel is ever drawn (line >= 0.2) by two snakes.
- A seed is found by rejection sampling (uniform over free pixels, accepted if its footprint is
  free): the same distribution as the original's dilate-then-sample, without whole-image work.
- Labels are exactly balanced within every batch folder (a seeded permutation of 0s and 1s) rather
  than drawn independently per image.

Cost. Most attempts at the two target snakes fail (14 paddles must fit in the image without
touching anything), in the original as here: per attempt we measured success rates of about 3% at
32 hard, 0.08% at 64 hard, 0.3-0.6% at 128 hard and 12% at 256 hard (an emulation of the original
code: 2.5% at 32, 0.08% at 64). Made one at a time (``method="reference"``) nearly all time goes to
the Python and NumPy call overhead of attempts that die (at 64 px about 2000 attempts and 13000
growth steps per image): on 16 CPU threads 200K Pathfinder-32 hard took 4.3 minutes (770 images/s),
Path-X hard ran at 65 images/s, Path-256 at 380, Pathfinder-64 at only 11 (200K in 5 hours). The
default ``method="batched"`` (``_pathfinder_batched``) advances thousands of attempts in lockstep as
array operations and uses every success; the statistical comparison with the reference
(experiments/studies/pathfinder-generator: 64 two-sample tests over path length, tip distance,
turn angles, distractors, marker distance, intensity, smallest p = 0.016, every |effect| < 0.15
reference sd) finds no difference. CPU time per image on one core of the 2-core development machine
(``write_pathfinder``, PNG included), batched vs reference: 2.0 vs 11 ms at 32, 28 vs 530 ms at 64,
19-20 vs 141 ms at 128, 4.8 vs 13 ms at 256. On the 16-core GPU host: 3727 / 201 / 355 / 909 images/s at 32 / 64 / 128 / 256 px
hard (200K Path-X in 9.4 minutes; 64 and 256 px measured before the last change, which cut ~20% at
128 px). A later rewrite of the growth step (byte-identical) made target sampling 1.8x faster at 64
px and 1.3x at 128 px on the 2-core machine. What remains at 128 px: gathers of the dilated
occupancy ~35% of a growth step, commits and collision tests ~15% each; distractors (still one at a
time) ~15% of an image, then image assembly and PNG (see the study's README).

Determinism: with the reference method image g of a (resolution, difficulty) is drawn from a
generator seeded by ``(seed, resolution, difficulty, g)``; with the batched one it is slot g % K of
chunk g // K (K = ``CHUNK[resolution]``), drawn from a generator seeded by ``(seed, resolution,
difficulty, g // K)``. Either way output never depends on the number of workers or of images.
Layout written (exactly the release's): ``pathfinder{R}/{curv_baseline | curv_contour_length_9 |
curv_contour_length_14}/imgs/<batch>/sample_<i>.png`` and ``metadata/<batch>.npy``, which is text:
one line per image, ``imgs/<batch> sample_<i>.png <i> <label> <continuity> <contour_length>
<distractor_length> <paddle_length> <paddle_thickness> <margin> <n_paddle_contrasts>``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["DIFFICULTIES", "RESOLUTIONS", "METHODS", "FIDELITIES", "CHUNK", "PathfinderParams", "params_for", "render",
           "render_many", "image_stats", "batch_labels", "write_pathfinder", "format_metadata_row"]

# difficulty -> (folder, contour length in paddles)
DIFFICULTIES = {"easy": ("curv_baseline", 6), "medium": ("curv_contour_length_9", 9),
                "hard": ("curv_contour_length_14", 14)}
_DIFF_CODE = {"easy": 0, "medium": 1, "hard": 2}

# LRA's per-resolution settings (lra_benchmarks/data/pathfinder.py docstrings, on top of the
# defaults of the authors' snakes2_wrapper.py): padding, paddle margins (one drawn per image),
# seed distance, marker radius, paddle length and thickness, continuity, distractor budget
# (num_distractor_snakes = budget // distractor_length), snake and paddle contrast.
RESOLUTIONS = {
    32: dict(padding=1, margins=(1,), seed_distance=7, marker_radius=1.5, paddle_length=2, paddle_thickness=0.5,
             continuity=1.0, distractor_budget=20, snake_contrast=2.0, paddle_contrast=0.75),
    64: dict(padding=1, margins=(1,), seed_distance=12, marker_radius=2.5, paddle_length=5, paddle_thickness=1.0,
             continuity=1.8, distractor_budget=22, snake_contrast=0.8, paddle_contrast=1.0),
    128: dict(padding=1, margins=(2, 3), seed_distance=20, marker_radius=3.0, paddle_length=5, paddle_thickness=1.5,
              continuity=1.8, distractor_budget=35, snake_contrast=0.9, paddle_contrast=1.0),
    256: dict(padding=22, margins=(3,), seed_distance=27, marker_radius=5.0, paddle_length=5, paddle_thickness=2.0,
              continuity=1.8, distractor_budget=30, snake_contrast=1.0, paddle_contrast=1.0),
}

# "release": the images the authors' code makes, quirks included (what the LRA release holds and what
# published scores were measured on); "clean": the corrected generator described in this docstring.
FIDELITIES = ("release", "clean")

_AA = 2  # antialias_scale of every LRA setting
_DRAWN = 0.2  # a paddle draws a pixel where its line reaches this (its Lanczos ringing stays below 0.03)
_FOOT = 0.9  # a seed paddle's footprint: where its mask reaches this (every drawn pixel does)


@dataclass(frozen=True)
class PathfinderParams:
    resolution: int
    contour_length: int
    padding: int
    margins: tuple
    seed_distance: int
    marker_radius: float
    paddle_length: int
    paddle_thickness: float
    continuity: float
    distractor_budget: int
    snake_contrast: float
    paddle_contrast: float = 1.0
    max_paddle_retrial: int = 2
    max_distractor_retrial: int = 4
    max_target_attempts: int = 1_000_000  # ours: give up (RuntimeError) rather than loop forever
    fidelity: str = "release"

    @property
    def release(self) -> bool:
        return self.fidelity == "release"

    @property
    def distractor_length(self) -> int:
        return self.contour_length // 3

    @property
    def num_distractors(self) -> int:
        return self.distractor_budget // self.distractor_length


def params_for(resolution: int, difficulty: str = "hard", fidelity: str = "release") -> PathfinderParams:
    """The LRA parameters of one resolution (32, 64, 128, 256) and difficulty (easy, medium, hard),
    for one generator fidelity ("release": the authors' code as run for LRA, quirks included;
    "clean": the corrected generator)."""
    if resolution not in RESOLUTIONS:
        raise ValueError(f"resolution must be one of {tuple(RESOLUTIONS)}, got {resolution!r}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {tuple(DIFFICULTIES)}, got {difficulty!r}")
    if fidelity not in FIDELITIES:
        raise ValueError(f"fidelity must be one of {FIDELITIES}, got {fidelity!r}")
    return PathfinderParams(resolution=resolution, contour_length=DIFFICULTIES[difficulty][1],
                            fidelity=fidelity, **RESOLUTIONS[resolution])


def _ceil2(y, x):
    return int(math.ceil(y)), int(math.ceil(x))


def _flip(theta: float) -> float:
    return theta + np.pi if theta < 0 else theta - np.pi


class _Geometry:
    """What depends only on (params, margin), computed once per process: the padded canvas size,
    the dilation disk, the candidate heads around a pivot and every paddle patch they can need."""

    def __init__(self, p: PathfinderParams, margin: int):
        self.p, self.m = p, margin
        self.L, self.t = p.paddle_length, p.paddle_thickness
        self.H = self.W = p.resolution
        # Pivots stay within margin + 1 of the image, candidates and their dilation reach 2 margins
        # + length further: a padding this wide keeps every lookup inside the canvas.
        self.P = int(math.ceil(max(self.L + 3 * margin + self.t, p.marker_radius))) + 4
        self.Wc = self.W + 2 * self.P
        # Initial occupancy: the border band of `padding` pixels and everything outside is occupied.
        self.M0 = np.ones((self.H + 2 * self.P, self.Wc), np.float32)
        P, pad = self.P, p.padding
        self.M0[P + pad:P + self.H - pad, P + pad:P + self.W - pad] = 0
        self.M1 = self.M0.copy()  # where the first target seed may go: 2 * seed_distance from the border
        band = 2 * p.seed_distance
        self.M1[:P + band] = 1
        self.M1[P + self.H - band:] = 1
        self.M1[:, :P + band] = 1
        self.M1[:, P + self.W - band:] = 1
        r = np.arange(-margin, margin + 1)
        yy, xx = np.meshgrid(r, r, indexing="ij")
        inside = yy ** 2 + xx ** 2 <= margin ** 2
        self.disk = (yy[inside] * self.Wc + xx[inside]).astype(np.int64)
        # Candidate heads: the distinct pixels hit by points one pixel of arc apart on the circle of
        # radius length + margin around an integer pivot (pixel = integer part, as the original).
        step = self.L + margin
        ang = np.arange(0, 360, 360.0 / (2 * step * np.pi)) * np.pi / 180
        off = np.stack([np.floor(step * np.sin(ang)), np.floor(step * np.cos(ang))], 1).astype(np.int64)
        off = np.unique(off, axis=0)
        self.cdy, self.cdx = off[:, 0], off[:, 1]
        self.corient = np.arctan2(self.cdy, self.cdx)
        self.cring = (self.cdy * self.Wc + self.cdx)[:, None] + self.disk[None, :]
        self.reach = int(np.abs(off).max()) + 1  # pivots at least this far inside see no candidate outside
        self.cpatch = [self.patch(_flip(float(o))) for o in self.corient]
        self._seed: dict[int, tuple] = {}
        self._weights: dict[float, np.ndarray] = {}
        self.batched = None  # the batched sampler's tables, built on first use

    def patch(self, theta: float):
        """A paddle from (0, 0) along theta: (y0, x0, line, mask), arrays covering rows y0.. and columns x0..

        Drawn as the authors did: a line ``thickness * aa`` wide and ``length * aa`` long on a canvas
        ``aa`` = 2 times finer, Lanczos-resized to pixels (``line``); the same line dilated by a
        disk of radius ``margin * aa`` and resized the same way is the occupancy ``mask``.
        """
        from PIL import Image, ImageDraw
        from scipy import ndimage

        L, t, m, aa = self.L, self.t, self.m, _AA
        R = L + int(math.ceil(t)) + m
        S, C = 2 * R * aa + 1, R * aa
        head = (math.ceil(C + L * aa * math.cos(theta)), math.ceil(C + L * aa * math.sin(theta)))  # (x, y)
        fine = Image.new("L", (S, S), 0)
        ImageDraw.Draw(fine).line([(C, C), head], fill=255, width=int(round(t * aa)))
        r = np.arange(-m * aa, m * aa + 1)
        disk = r[:, None] ** 2 + r[None, :] ** 2 <= (m * aa) ** 2
        dilated = ndimage.grey_dilation(np.asarray(fine), footprint=disk, mode="constant", cval=0)
        n = 2 * R + 1
        # The release's lines were resampled in float, overshoot kept (the 8-bit occupancy mask was not)
        line = _resize(np.asarray(fine), n, self.p.release)
        mask = np.asarray(Image.fromarray(dilated).resize((n, n), Image.LANCZOS), np.float32) / 255
        return -R, -R, line, mask

    def seed_paddle(self, deg: int):
        """Patch of a seed paddle at a whole-degree orientation, and the flat offsets of its footprint
        relative to the tail: the pixels that must be free (occupancy <= 0.3) for the seed to go there.

        clean: where the paddle's mask reaches 0.9, around the tail itself.
        release: the original's, from its dilation of the occupancy by the paddle's mask drawn in a
        (2(L+m)+1)^2 square with the tail one pixel right of and below the centre and the kernel
        anchored at the centre: pixels where the mask is exactly 1, shifted one pixel down-right,
        cut to that square (see ``seed_allowed``)."""
        if deg not in self._seed:
            pt = self.patch(deg * np.pi / 180)
            if self.p.release:
                dy, dx = _release_footprint(pt[3], self.L + self.m)
            else:
                yy, xx = np.nonzero(pt[3] >= _FOOT)
                dy, dx = yy + pt[0], xx + pt[1]
            self._seed[deg] = (pt, (dy * self.Wc + dx).astype(np.int64), _quadrants_covered(dy, dx))
        return self._seed[deg][:2]

    def seed_allowed(self, deg: int) -> bool:
        """Whether a seed at this whole-degree orientation can be placed at all.

        Always for clean. In the original code a seed's occupancy is dilated by OpenCV with the
        paddle's footprint as kernel; for float images OpenCV's default constant border is the
        neutral element of max, -DBL_MAX, so wherever the kernel lies wholly outside the image the
        dilated value is -DBL_MAX. That happens at a corner of the image unless the footprint has a
        pixel in each of the four closed quadrants around the anchor; then the available-coordinate
        search sees a negative minimum, returns nothing, and the seed (for target snakes the whole
        attempt) fails. At 32 px only 30 orientations of 360 survive, 95 at 64 px, nearly all at 128.
        """
        if not self.p.release:
            return True
        self.seed_paddle(deg)
        return self._seed[deg][2]

    def slices(self, y: int, x: int, pt):
        y0, x0 = y + pt[0] + self.P, x + pt[1] + self.P
        return (slice(y0, y0 + pt[2].shape[0]), slice(x0, x0 + pt[2].shape[1])), pt[2], pt[3]

    def inside(self, y, x) -> bool:
        return 0 <= y < self.H and 0 <= x < self.W

    def seed(self, rng, M, stop_with_availability=None):
        """A seed paddle on free space of occupancy M: (tail, theta, pivot, patch) or None."""
        P, H, W, L, m, Wc = self.P, self.H, self.W, self.L, self.m, self.Wc
        Mf = M.ravel()
        raw = None  # M does not change while seeding: its free pixels are found once
        for _ in range(self.p.max_paddle_retrial + 1):
            deg = int(rng.integers(-180, 180))
            theta = deg * np.pi / 180
            if raw is None:
                raw = np.flatnonzero(M[P:P + H, P:P + W] <= 0.3)
            if raw.size == 0 or (stop_with_availability is not None and raw.size < stop_with_availability * H * W):
                return None
            if not self.seed_allowed(deg):  # the original's seed search finds nothing: no retry
                return None
            pt, offs = self.seed_paddle(deg)
            free = raw  # tails whose first footprint pixel is free (clean: the tail itself)
            if self.p.release:
                dy0 = (int(offs[0]) + Wc // 2) // Wc
                dx0 = int(offs[0]) - dy0 * Wc
                free = np.flatnonzero(M[P + dy0:P + dy0 + H, P + dx0:P + dx0 + W] <= 0.3)
                if free.size == 0:
                    return None
            tail = None
            for _ in range(32):  # rejection sampling: uniform over the available pixels
                f = int(free[rng.integers(free.size)])  # canvas offset of the drawn pixel, only
                c = (f // W + P) * Wc + f % W + P
                if Mf[c + offs].max() <= 0.3:
                    tail = c
                    break
            if tail is None:  # crowded: enumerate the available pixels exactly
                cand = (free // W + P) * Wc + free % W + P
                ok = np.ones(cand.size, bool)
                for o in offs:
                    ok &= Mf[cand + o] <= 0.3
                avail = cand[ok]
                if avail.size == 0:
                    return None
                tail = avail[rng.integers(avail.size)]
            ty, tx = int(tail // Wc - P), int(tail % Wc - P)
            head = _ceil2(ty + L * math.sin(theta), tx + L * math.cos(theta))
            pivot = _ceil2(head[0] - (L + m) * math.sin(theta), head[1] - (L + m) * math.cos(theta))
            if self.inside(*head) and self.inside(*pivot):
                return (ty, tx), theta, pivot, self.slices(ty, tx, pt)
        return None

    def weights(self, theta: float) -> np.ndarray:
        """Continuity weight of every candidate head after a paddle of orientation theta (cached:
        theta is always a whole degree or one of the candidate orientations)."""
        w = self._weights.get(theta)
        if w is None:
            delta = np.abs(self.corient - theta)
            delta = np.minimum(np.minimum(delta, 2 * np.pi - delta) * self.p.continuity, np.pi / 2)
            w = self._weights[theta] = np.maximum(np.cos(delta), 0) ** 2
        return w

    def extend(self, rng, R, pivot, theta):
        """The paddle after (pivot, theta) on reference occupancy R: (head, theta, pivot, patch) or None."""
        L, m, P, H, W = self.L, self.m, self.P, self.H, self.W
        npy, npx = _ceil2(pivot[0] + (L + 2 * m) * math.sin(theta), pivot[1] + (L + 2 * m) * math.cos(theta))
        base = (npy + P) * self.Wc + npx + P
        occupied = R.ravel()[base + self.cring].max(1)  # occupancy dilated by the margin, at each candidate
        pmf = (1 - occupied) * self.weights(theta)
        r = self.reach
        if not (r <= npy < H - r and r <= npx < W - r):  # near the border: drop candidates outside the image
            hy, hx = npy + self.cdy, npx + self.cdx
            pmf[(hy < 0) | (hy >= H) | (hx < 0) | (hx >= W)] = 0
        total = pmf.sum()
        if total < 1e-4:
            return None
        cmf = np.cumsum(pmf / total)
        for _ in range(self.p.max_paddle_retrial + 1):
            k = min(int(np.searchsorted(cmf, rng.random(), side="right")), cmf.size - 1)
            head = (npy + int(self.cdy[k]), npx + int(self.cdx[k]))
            sl, line, mask = self.slices(head[0], head[1], self.cpatch[k])
            if (R[sl] + mask).max() < 1.8:
                return head, float(self.corient[k]), (npy, npx), (sl, line, mask)
        return None


_GEOMETRY: dict = {}


def _resize(fine: np.ndarray, n: int, in_float: bool) -> np.ndarray:
    """A 0..255 drawing Lanczos-resized to n x n, as 0..1 float32: through 8 bits (clipped), or in
    float with its overshoot kept (how the release's lines and markers were resampled: its marker
    disks read 213-226 inside a 255 ring once the image is scaled to its maximum)."""
    from PIL import Image

    if in_float:
        img = Image.fromarray(np.ascontiguousarray(fine, np.float32))  # mode "F"
        return np.asarray(img.resize((n, n), Image.LANCZOS), np.float32) / 255
    return np.asarray(Image.fromarray(np.asarray(fine, np.uint8)).resize((n, n), Image.LANCZOS), np.float32) / 255


def _release_footprint(mask: np.ndarray, c: int):
    """(dy, dx) offsets from the tail of the original's seed-dilation kernel (see ``seed_paddle``):
    mask pixels equal to 1 (the kernel is the float mask cast to uint8), shifted by one pixel down
    and right, kept where they fall inside the (2c+1)^2 kernel square."""
    R = mask.shape[0] // 2
    yy, xx = np.nonzero(mask >= 1.0)
    dy, dx = yy - R + 1, xx - R + 1
    keep = (np.abs(dy) <= c) & (np.abs(dx) <= c)
    return dy[keep], dx[keep]


def _quadrants_covered(dy, dx) -> bool:
    """Whether offsets (relative to a kernel's anchor) reach each of the four closed quadrants."""
    dy, dx = np.asarray(dy), np.asarray(dx)
    return bool(all(np.any(a & b) for a in (dy <= 0, dy >= 0) for b in (dx <= 0, dx >= 0)))


def _marker_patch(radius: float, in_float: bool = False) -> np.ndarray:
    """A marker disk as the authors drew it (at aa x resolution, Lanczos-resized), centred on the
    middle pixel of a (2k+1)^2 patch."""
    k = int(math.ceil(radius)) + 3
    yy, xx = np.ogrid[-k * _AA:(k + 1) * _AA, -k * _AA:(k + 1) * _AA]
    fine = ((yy ** 2 + xx ** 2 <= (radius * _AA) ** 2) * 255).astype(np.uint8)
    return _resize(fine, 2 * k + 1, in_float)


def _geometry(p: PathfinderParams, margin: int) -> _Geometry:
    key = (p, margin)
    if key not in _GEOMETRY:
        _GEOMETRY[key] = _Geometry(p, margin)
    return _GEOMETRY[key]


def _commit(M, patch):
    sl, _, mask = patch
    np.maximum(M[sl], mask, out=M[sl])


def _two_snakes(g: _Geometry, rng):
    """The two target snakes, or None when any step fails (the caller starts over)."""
    p = g.p
    s1 = g.seed(rng, g.M1)
    if s1 is None:
        return None
    tail1, th1, pivot1, patch1 = s1
    for _ in range(p.max_paddle_retrial + 1):
        deg2 = int(rng.integers(-180, 180))
        th2 = deg2 * np.pi / 180
        phi = int(rng.integers(0, 360)) * np.pi / 180
        tail2 = (int(np.round(tail1[0] + p.seed_distance * np.sin(phi))),
                 int(np.round(tail1[1] + p.seed_distance * np.cos(phi))))
        head2 = _ceil2(tail2[0] + g.L * math.sin(th2), tail2[1] + g.L * math.cos(th2))
        pivot2 = _ceil2(head2[0] - (g.L + g.m) * math.sin(th2), head2[1] - (g.L + g.m) * math.cos(th2))
        # (release: the original checks only head and pivot; tail 2 lies seed_distance from tail 1, which is
        # 2 seed_distance inside the image, so the tail check never decides anything there)
        if (p.release or g.inside(*tail2)) and g.inside(*head2) and g.inside(*pivot2):
            break
    else:
        return None
    patch2 = g.slices(tail2[0], tail2[1], g.seed_paddle(deg2)[0])
    snakes = [{"origin": tail, "terminal": tail, "pivot": pivot, "theta": th, "patches": [patch], "pending": patch,
               "thetas": [th]}
              for tail, th, pivot, patch in ((tail1, th1, pivot1, patch1), (tail2, th2, pivot2, patch2))]
    if p.release:
        return _grow_release(g, rng, snakes)
    # What snake i must avoid: every committed paddle and the other snake's newest one (refs[i] =
    # committed + pending of 1 - i), kept up to date patch by patch instead of rebuilt per step.
    refs = [g.M0.copy(), g.M0.copy()]
    _commit(refs[0], patch2)
    _commit(refs[1], patch1)
    for _ in range(p.contour_length - 1):
        for i, sn in enumerate(snakes):
            nxt = g.extend(rng, refs[i], sn["pivot"], sn["theta"])
            if nxt is None:
                return None
            head, th, pivot, patch = nxt
            _commit(refs[i], sn["pending"])  # its previous paddle is committed now
            _commit(refs[1 - i], patch)  # and its new one is the other snake's obstacle
            sn.update(terminal=head, theta=th, pivot=pivot, pending=patch)
            sn["patches"].append(patch)
            sn["thetas"].append(th)
    M = refs[0]
    _commit(M, snakes[0]["pending"])
    return M, snakes


def _grow_release(g: _Geometry, rng, snakes):
    """The two target snakes grown as the original does: both test a new paddle against one shared
    occupancy that holds each snake's paddles up to its previous one (a snake's newest paddle is
    committed only when it grows again), so neither sees the other's newest paddle, and at the end
    only snake 2's last paddle is committed: snake 1's terminal paddle stays out of the occupancy
    that the distractors avoid."""
    M = g.M0.copy()
    for _ in range(g.p.contour_length - 1):
        for sn in snakes:
            nxt = g.extend(rng, M, sn["pivot"], sn["theta"])
            if nxt is None:
                return None
            head, th, pivot, patch = nxt
            _commit(M, sn["pending"])
            sn.update(terminal=head, theta=th, pivot=pivot, pending=patch)
            sn["patches"].append(patch)
            sn["thetas"].append(th)
    _commit(M, snakes[1]["pending"])
    return M, snakes


def _distractor(g: _Geometry, rng, M, n_paddles):
    """One distractor snake on occupancy M: (new occupancy, patches), or None if it did not fit."""
    M = M.copy()
    s = g.seed(rng, M, stop_with_availability=0.01)
    if s is None:
        return None
    _, th, pivot, pending = s
    patches = [pending]
    for _ in range(n_paddles - 1):
        nxt = g.extend(rng, M, pivot, th)
        if nxt is None:
            return None
        _, th, pivot, patch = nxt
        _commit(M, pending)
        pending = patch
        patches.append(patch)
    _commit(M, pending)
    return M, patches


METHODS = ("batched", "reference")


def _check_render_args(params, rng, method):
    if not isinstance(params, PathfinderParams):
        raise TypeError(f"params must be a PathfinderParams (see params_for), got {type(params).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def render(params: PathfinderParams, rng, label: int, return_layers: bool = False, method: str = "batched"):
    """One Pathfinder image (uint8, R x R) with the given label (1: markers on the same snake).

    ``method``: ``"batched"`` (default) samples the target snakes by many attempts at once
    (``_pathfinder_batched``), ``"reference"`` one attempt at a time as the original code did; both
    draw from the same distribution, not the same images. ``render(p, rng, label)`` with the batched
    method is ``render_many(p, rng, [label])[0]``.

    With ``return_layers`` also a dict: ``ids`` (int16 R x R: the snake whose paddle is brightest at
    each drawn pixel, i.e. line >= 0.2; 0 none, 1-2 the target snakes, 3+ distractors), ``count``
    (how many snakes draw each pixel: never more than one), ``markers`` (float coverage of the
    two disks), ``tips`` (marker centres, (y, x)), ``tip_snakes`` (snake id under each marker),
    ``origins`` / ``terminals`` (tips of the two target snakes), ``thetas`` (the orientation of
    every paddle of each target snake, seed first, radians), ``margin``, ``num_distractors``, and
    what the image is drawn from: ``snakes`` (per snake, targets first: its contrast and its
    paddles, seed first, as (canvas slices, line patch)), ``pad`` (the canvas border) and ``peak``
    (the intensity scaled to 255); ``interventions.compose`` redraws the image from them.
    """
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    _check_render_args(params, rng, method)
    if method == "batched":
        return render_many(params, rng, [label], return_layers)[0]
    image, layers = _render_reference(params, rng, label, return_layers)
    return (image, layers) if return_layers else image


def render_many(params: PathfinderParams, rng, labels, return_layers: bool = False) -> list:
    """Images with the given labels, drawn together by the batched method from one generator.

    The random draws do not depend on the labels (a label only picks which terminal tip gets the
    second marker), so image i is a function of (rng's seed, len(labels), i, labels[i]). Margins
    are drawn first, then the target snakes of all images (per margin, in attempt order), then each
    image's distractors and markers in turn. Returns a list of images, or of (image, layers).
    """
    labels = [int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v for v in labels]
    if not labels or any(v not in (0, 1) for v in labels):
        raise ValueError(f"labels must be a non-empty sequence of 0s and 1s, got {labels!r}")
    _check_render_args(params, rng, "batched")
    out = _render_many(params, rng, labels, return_layers)
    return out if return_layers else [image for image, _ in out]


def _batched(g: _Geometry):
    """The batched sampler's tables of a geometry (built on first use, once per process)."""
    if g.batched is None:
        from sparseflash.experiments.lra.data._pathfinder_batched import BatchedTargets

        g.batched = BatchedTargets(g)
    return g.batched


def _render_many(p: PathfinderParams, rng, labels, return_layers: bool) -> list:
    n = len(labels)
    margins = (np.asarray(p.margins)[rng.integers(len(p.margins), size=n)] if len(p.margins) > 1
               else np.full(n, p.margins[0])).astype(int)
    targets = [None] * n
    for margin in sorted(set(margins.tolist())):
        slots = np.flatnonzero(margins == margin)
        for slot, pair in zip(slots, _batched(_geometry(p, margin)).sample(rng, slots.size, p.max_target_attempts)):
            targets[slot] = pair
    out = []
    for i, label in enumerate(labels):
        g = _geometry(p, int(margins[i]))
        out.append(_finish(p, g, rng, label, *targets[i], return_layers))
    return out


def _render_reference(p: PathfinderParams, rng, label: int, return_layers: bool):
    margin = int(p.margins[int(rng.integers(len(p.margins)))]) if len(p.margins) > 1 else int(p.margins[0])
    g = _geometry(p, margin)
    for _ in range(p.max_target_attempts):
        out = _two_snakes(g, rng)
        if out is not None:
            break
    else:
        raise RuntimeError(f"could not place the two target snakes in {p.max_target_attempts} attempts ({p})")
    M, targets = out
    return _finish(p, g, rng, label, M, targets, return_layers)


def _finish(p: PathfinderParams, g: _Geometry, rng, label: int, M, targets, return_layers: bool):
    """Distractors on occupancy M, markers, the image (and its layers) of two placed target snakes."""
    margin = g.m
    snakes = [(1, p.paddle_contrast * p.snake_contrast, t["patches"]) for t in targets]
    for _ in range(p.num_distractors):
        for _ in range(p.max_distractor_retrial + 1):
            d = _distractor(g, rng, M, p.distractor_length)
            if d is not None:
                M, patches = d
                snakes.append((1, p.snake_contrast, patches))
                break

    img = np.zeros_like(g.M0)
    ids = np.zeros(g.M0.shape, np.int16) if return_layers else None
    count = np.zeros(g.M0.shape, np.int16) if return_layers else None
    for sid, (_, contrast, patches) in enumerate(snakes, start=1):
        lit = np.zeros(g.M0.shape, bool) if return_layers else None
        for sl, line, _ in patches:
            val = line * contrast
            if return_layers:
                ids[sl][(val > img[sl]) & (line >= _DRAWN)] = sid
                lit[sl] |= line >= _DRAWN
            np.maximum(img[sl], val, out=img[sl])
        if return_layers:
            count += lit

    o = int(rng.integers(2))
    t = o if label == 1 else 1 - o
    tips = (targets[o]["origin"], targets[t]["terminal"])
    P, H, W = g.P, g.H, g.W
    disk = _marker_patch(p.marker_radius, p.release)
    k = disk.shape[0] // 2
    markers = np.zeros_like(img)
    for ty, tx in tips:
        sl = (slice(ty + P - k, ty + P + k + 1), slice(tx + P - k, tx + P + k + 1))
        np.maximum(markers[sl], disk, out=markers[sl])
    markers = markers[P:P + H, P:P + W]
    image = np.maximum(img[P:P + H, P:P + W], markers)
    peak = float(image.max())
    image = np.floor(image * (255.0 / peak) + 0.5).astype(np.uint8)
    if not return_layers:
        return image, {"margin": margin}
    layers = {
        "ids": ids[P:P + H, P:P + W].copy(), "count": count[P:P + H, P:P + W].copy(), "markers": markers,
        "tips": tips, "tip_snakes": (o + 1, t + 1),
        "origins": tuple(s["origin"] for s in targets), "terminals": tuple(s["terminal"] for s in targets),
        "thetas": tuple(list(s["thetas"]) for s in targets),
        "margin": margin, "num_distractors": len(snakes) - 2,
        # what the image is made of, to redraw it changed (`interventions.compose`): every snake's
        # contrast and paddles (canvas slices, which are offset by `pad`, and line patches), and the
        # intensity that became 255
        "snakes": tuple((contrast, tuple((sl, line) for sl, line, _ in patches)) for _, contrast, patches in snakes),
        "pad": P, "peak": peak,
    }
    return image, layers


def image_stats(image: np.ndarray, layers: dict) -> dict:
    """What the generator comparison measures on one image and its layers (``render(...,
    return_layers=True)``): for each target snake s = 1, 2 its drawn pixels (``pixels_s``), the
    distance between its tips (``end_to_end_s``) and the mean and largest absolute turn between
    consecutive paddles (``turn_mean_s``, ``turn_max_s``, radians); the distractors placed and their
    drawn pixels; the distance between the marker centres; the fraction of pixels at >= 10% of full
    intensity (``lit_fraction``) and the mean intensity (0..1); the margin; whether the marker
    centres are pixel-connected through pixels >= 32 once gaps of margin + 1 are bridged
    (``connected``: what a shortcut would see)."""
    from scipy import ndimage

    ids, out = layers["ids"], {}
    for s in (1, 2):
        (oy, ox), (ty, tx) = layers["origins"][s - 1], layers["terminals"][s - 1]
        turns = np.abs(np.angle(np.exp(1j * np.diff(np.asarray(layers["thetas"][s - 1])))))
        out.update({f"pixels_{s}": int((ids == s).sum()), f"end_to_end_{s}": math.hypot(ty - oy, tx - ox),
                    f"turn_mean_{s}": float(turns.mean()), f"turn_max_{s}": float(turns.max())})
    (ay, ax), (by, bx) = layers["tips"]
    m = int(layers["margin"])
    r = np.arange(-(m + 1), m + 2)
    disk = r[:, None] ** 2 + r[None, :] ** 2 <= (m + 1) ** 2
    comp, _ = ndimage.label(ndimage.binary_dilation(image >= 32, disk))
    out.update({"distractors": int(layers["num_distractors"]), "distractor_pixels": int((ids >= 3).sum()),
                "marker_distance": math.hypot(by - ay, bx - ax), "lit_fraction": float((image >= 26).mean()),
                "mean_intensity": float(image.mean() / 255), "margin": m,
                "connected": int(comp[ay, ax] == comp[by, bx] != 0)})
    return out


def _image_rng(seed, params: PathfinderParams, difficulty_code: int, index: int):
    """The generator of image ``index`` (counted over all batches) of a resolution and difficulty."""
    return np.random.default_rng([seed, params.resolution, difficulty_code, 0, index])


def batch_labels(seed: int, resolution: int, difficulty: str, batch: int, n: int) -> np.ndarray:
    """Labels of one batch folder: ceil(n/2) zeros and floor(n/2) ones in a seeded order."""
    rng = np.random.default_rng([seed, resolution, _DIFF_CODE[difficulty], 1, batch])
    return rng.permutation(np.arange(n) % 2)


def format_metadata_row(batch: int, i: int, label: int, p: PathfinderParams, margin: int) -> str:
    return " ".join(str(v) for v in (f"imgs/{batch}", f"sample_{i}.png", i, label, p.continuity, p.contour_length,
                                     p.distractor_length, p.paddle_length, p.paddle_thickness, margin, 1))


# Images per chunk of the batched method: image g is slot g % K of chunk g // K, drawn from a
# generator seeded by (seed, resolution, difficulty, chunk). Part of the data's definition.
CHUNK = {32: 50, 64: 25, 128: 10, 256: 10}


def _chunk_rng(seed, params: PathfinderParams, difficulty_code: int, chunk: int):
    return np.random.default_rng([seed, params.resolution, difficulty_code, 2, chunk])


def _render_chunk(job):
    from PIL import Image

    seed, resolution, difficulty, folder, batch, first, batch_size, start, stop, method, fidelity = job
    p = params_for(resolution, difficulty, fidelity)
    code = _DIFF_CODE[difficulty]
    labels = batch_labels(seed, resolution, difficulty, batch, batch_size)
    img_dir = Path(folder) / "imgs" / str(batch)
    img_dir.mkdir(parents=True, exist_ok=True)
    if method == "reference":
        made = [_render_reference(p, _image_rng(seed, p, code, first + i), int(labels[i]), False)
                for i in range(start, stop)]
    else:  # the chunk holding images first + start .. first + stop - 1 (jobs never straddle chunks)
        k = CHUNK[resolution]
        c = (first + start) // k
        if (first + stop - 1) // k != c:
            raise AssertionError("a job straddles two chunks")
        slots = np.zeros(k, np.int64)  # other slots' labels do not change this job's images
        slots[first + start - c * k:first + stop - c * k] = labels[start:stop]
        made = _render_many(p, _chunk_rng(seed, p, code, c), slots.tolist(), False)
        made = made[first + start - c * k:first + stop - c * k]
    rows = []
    for i, (image, info) in zip(range(start, stop), made):
        Image.fromarray(image).save(img_dir / f"sample_{i}.png", format="PNG")
        rows.append(format_metadata_row(batch, i, int(labels[i]), p, info["margin"]))
    return batch, rows


GENERATION_FILE = "generation.json"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def write_pathfinder(out, resolution: int, difficulty: str, num: int, *, seed: int = 0, workers: int | None = None,
                     per_batch: int = 1000, overwrite: bool = False, resume: bool = False,
                     show_progress: bool = True, method: str = "batched", fidelity: str = "release") -> dict:
    """Write ``num`` images of one resolution and difficulty in the release layout under ``out``.

    Images go to batch folders of ``per_batch`` (the last one may be smaller); each batch's
    metadata file is written once all its images exist. ``workers``: processes (default: every
    CPU this process may use). ``method``: ``"batched"`` or ``"reference"`` (see ``render``); the
    two write different images of the same distribution. ``fidelity``: ``"release"`` (default: the
    authors' code's images, quirks included, as in LRA's release) or ``"clean"`` (the corrected
    generator); it is recorded in ``GENERATION_FILE``, which the loaders check. Returns a summary dict.

    ``GENERATION_FILE`` in the difficulty folder records the arguments and ``complete``, false
    until the last batch is written (the loaders refuse an incomplete folder). ``resume=True``
    continues an interrupted run with the same arguments: batches whose metadata exists are kept,
    the others are drawn again, so the result is the same as one uninterrupted run (images are a
    pure function of the seed and their index). A run too long for one command (Pathfinder-64 or
    Path-X, 200K images, on a 10-minute GPU command) is split this way.
    """
    from sparseflash.experiments.lra.data._parallel import check_workers, run_ordered

    p = params_for(resolution, difficulty, fidelity)
    for name, v, lo in (("num", num, 1), ("seed", seed, 0), ("per_batch", per_batch, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    workers = check_workers(workers)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if overwrite and resume:
        raise ValueError("overwrite and resume exclude each other: resume keeps finished batches, overwrite drops them")
    folder = Path(out) / f"pathfinder{resolution}" / DIFFICULTIES[difficulty][0]
    meta_dir = folder / "metadata"
    record = {"resolution": resolution, "difficulty": difficulty, "num": num, "seed": seed, "per_batch": per_batch,
              "method": method, "fidelity": fidelity}
    has_meta = meta_dir.is_dir() and any(meta_dir.glob("*.npy"))
    done: set[int] = set()
    if has_meta and resume:
        gen = folder / GENERATION_FILE
        if not gen.is_file():
            raise FileExistsError(f"cannot resume in {folder}: it has metadata but no {GENERATION_FILE} "
                                  f"(written by another tool?); pass overwrite=True (--overwrite) to start again")
        old = json.loads(gen.read_text())
        old.setdefault("fidelity", "clean")  # written before fidelities existed: the clean generator
        differ = sorted(k for k in record if old.get(k) != record[k])
        if differ:
            raise ValueError(f"cannot resume in {folder}: its generation differs in {differ} "
                             f"({ {k: old.get(k) for k in differ} } there, { {k: record[k] for k in differ} } asked)")
        done = {int(f.stem) for f in meta_dir.glob("*.npy") if f.stem.isdigit()}
    elif has_meta and not overwrite:
        raise FileExistsError(f"{meta_dir} already holds metadata: pass overwrite=True (--overwrite) to replace it, "
                              f"or resume=True (--resume) to finish an interrupted run")
    if overwrite and meta_dir.is_dir():
        for f in meta_dir.glob("*.npy"):
            f.unlink()
    meta_dir.mkdir(parents=True, exist_ok=True)
    _write_json(folder / GENERATION_FILE, {**record, "complete": False})
    n_batches = -(-num // per_batch)
    jobs = []
    if method == "reference":
        chunk = 25 if resolution <= 64 else 5
        for b in range(n_batches):
            size = min(per_batch, num - b * per_batch)
            jobs += [(seed, resolution, difficulty, str(folder), b, b * per_batch, size, s, min(s + chunk, size),
                      method, fidelity) for s in range(0, size, chunk)]
    else:  # one job per (chunk, batch folder) overlap: a chunk that straddles two folders is drawn twice
        k = CHUNK[resolution]
        for c in range(-(-num // k)):
            lo, hi = c * k, min(num, (c + 1) * k)
            while lo < hi:
                b = lo // per_batch
                stop = min(hi, (b + 1) * per_batch)
                jobs.append((seed, resolution, difficulty, str(folder), b, b * per_batch,
                             min(per_batch, num - b * per_batch), lo - b * per_batch, stop - b * per_batch, method,
                             fidelity))
                lo = stop
        if workers > 1:  # tables built once here are inherited by forked workers
            for margin in p.margins:
                _batched(_geometry(p, int(margin)))
    pending: dict[int, list[str]] = {}
    sizes = {b: min(per_batch, num - b * per_batch) for b in range(n_batches)}
    n_ones = sum(int(line.split(" ")[3]) for b in done for line in (meta_dir / f"{b}.npy").read_text().splitlines()
                 if line.strip())
    jobs = [j for j in jobs if j[4] not in done]  # j[4]: the job's batch folder
    todo = num - sum(sizes[b] for b in done if b in sizes)
    for batch, rows in run_ordered(_render_chunk, jobs, workers, f"pathfinder{resolution} {difficulty}", total=todo,
                                   weight=lambda r: len(r[1]), show_progress=show_progress):
        pending.setdefault(batch, []).extend(rows)
        if len(pending[batch]) == sizes[batch]:
            text = "".join(r + "\n" for r in pending.pop(batch))
            n_ones += sum(int(r.split(" ")[3]) for r in text.splitlines())
            tmp = meta_dir / f"{batch}.npy.tmp"
            tmp.write_text(text)
            os.replace(tmp, meta_dir / f"{batch}.npy")
    _write_json(folder / GENERATION_FILE, {**record, "complete": True})
    return {"folder": str(folder), "num": num, "batches": n_batches, "label_ones": n_ones, "seed": seed,
            "method": method, "fidelity": fidelity, "resumed_batches": len(done),
            "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(p).items()}}
