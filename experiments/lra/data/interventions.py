"""Pathfinder images changed on purpose: the cut test and cue-balanced sets.

A Pathfinder label says whether the two markers lie on one snake. A model that traces the path
must change its answer when the path changes far from the markers; a model that reads the marker
neighbourhoods (where the markers are, how the snake ends meet them) must not. Both tests here
work from the generator's own record of an image (``pathfinder.render(..., return_layers=True)``:
which pixels each snake draws, its paddles, the marker centres), not from image heuristics.

- ``cut(image, layers, params)``, positives: a run of ``n_paddles`` consecutive paddles of the
  marked snake is taken out, chosen as near the middle of the snake as allows every changed pixel
  to lie more than ``radius`` from both marker centres, and only if what is left of the snake no
  longer links the markers (`chained`: its drawn pixels with gaps of up to 2 (margin + 2) px
  bridged, wider than the gaps between its paddles). Other snakes may still pass near the gap (at
  32 px the ink is dense enough that plain pixel connectivity links most markers, of either label).
  The answer a path tracer gives flips to 0.
- ``join(image, layers, params)``, negatives: a stroke drawn as the paddles are (same width,
  antialiasing and contrast as the target snakes) joins the two target snakes between their
  closest drawn pixels that lie, with the whole stroke, more than ``radius`` from both marker
  centres, and only if the two snakes and the stroke then link the markers (`chained`). A path
  tracer's answer flips to 1.

- ``control_cut(image, layers, params)``, either label: the matched control of a cut. A run of
  ``n_paddles`` consecutive paddles of a *distractor* is taken out, every changed pixel more than
  ``radius`` from both markers and none on a target snake's drawn pixels, so the path and the
  label are untouched; with ``match`` (the pixels a cut changed) the run whose edit is closest to
  that size. A model whose answer flips as often under the control as under the cut is reacting
  to any edit of that size, not to the path. At 32 px the ink and the margins around the markers
  leave room for such a run in about half the images (of 40: 9 of either label); at 64 px and up
  in nearly all.
- ``dashed_join(image, layers, params)``, negatives: the two target snakes' free ends (the ends
  without a marker) joined by dashes drawn as paddles (the paddle width, about the paddle length,
  the gap between a snake's paddles between them, first and last dash a gap from the snake ends),
  so the joined path looks like one longer snake: no stroke ending mid-snake in a T-junction,
  which positives never have. Valid only if every changed pixel lies more than ``radius`` from both
  markers and the snakes and dashes link the markers (`chained`).

Either way every pixel within ``radius`` of a marker centre keeps its value (the image is redrawn
from its paddles by `compose` at the original intensity scale, so no other pixel moves), which
`unchanged_within` checks. An image where no such cut or join exists is left out and counted.

``balance(features, labels)``: a subset whose features carry no label information, by
propensity-score stratification: out-of-fold probabilities p(label = 1 | features) from a small
MLP (five folds), cut into ``bins`` quantile strata, and in each stratum the larger class subsampled
to the smaller one's count. With the features the shortcut probe reads (marker coordinates,
``probe.marker_coords``) and the relative direction of the two end paddles (``paddle_cosine``:
cos(theta_origin - theta_terminal), the 128 px cue of ``studies/pathx/rim_probe.py``), the
probe retrained on the balanced set should find 50%; `cue_tests.py` measures that.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["DEFAULT_RADIUS", "default_radius", "compose", "chained", "unchanged_within", "cut", "join",
           "control_cut", "dashed_join", "paddle_cosine", "balance", "propensity"]

_DRAWN = 0.2  # a paddle draws a pixel where its line reaches this (the generator's threshold)
_AA = 2  # the generator's antialias scale


def default_radius(resolution: int) -> float:
    """How far from a marker centre nothing may change: 1.5 x the probe's patch half-size
    (ceil(marker radius) + 3): 7.5 px at 32, 9 at 64 and 128, 12 at 256."""
    from sparseflash.experiments.lra.data.pathfinder import RESOLUTIONS

    return 1.5 * (math.ceil(RESOLUTIONS[resolution]["marker_radius"]) + 3)


DEFAULT_RADIUS = {r: default_radius(r) for r in (32, 64, 128, 256)}


def _need_layers(layers) -> None:
    missing = [k for k in ("snakes", "pad", "peak", "markers", "tips", "tip_snakes", "margin", "ids") if k not in layers]
    if missing:
        raise ValueError(f"layers must come from pathfinder.render(..., return_layers=True); missing {missing}")


def compose(layers: dict, drop=(), extra: np.ndarray | None = None) -> np.ndarray:
    """The image (uint8) redrawn from ``layers`` as the generator drew it, without the paddles in
    ``drop`` (pairs (snake index from 0, paddle index from 0, seed first)) and with ``extra`` (float
    ``[H, W]`` intensities, e.g. a stroke) added by maximum. The intensity scale is the original
    image's (``peak`` becomes 255, anything brighter is clipped), so pixels that no dropped or added
    stroke touches keep their values; with nothing dropped or added this is the original image."""
    _need_layers(layers)
    drop = {(int(s), int(k)) for s, k in drop}
    P, markers = layers["pad"], layers["markers"]
    H, W = markers.shape
    img = np.zeros((H + 2 * P, W + 2 * P), np.float32)
    for s, (contrast, paddles) in enumerate(layers["snakes"]):
        for k, (sl, line) in enumerate(paddles):
            if (s, k) not in drop:
                np.maximum(img[sl], line * contrast, out=img[sl])
    image = np.maximum(img[P:P + H, P:P + W], markers)
    if extra is not None:
        image = np.maximum(image, extra)
    return np.clip(np.floor(image * (255.0 / layers["peak"]) + 0.5), 0, 255).astype(np.uint8)


def _disk(r: int) -> np.ndarray:
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return x * x + y * y <= r * r


def _drawn(layers: dict, snakes, drop=()) -> np.ndarray:
    """bool ``[H, W]``: the pixels the paddles of ``snakes`` (indices from 0) draw (line >= 0.2, the
    generator's ``ids`` threshold), less the paddles in ``drop``."""
    drop = {(int(s), int(k)) for s, k in drop}
    P, (H, W) = layers["pad"], layers["markers"].shape
    out = np.zeros((H + 2 * P, W + 2 * P), bool)
    for s in snakes:
        for k, (sl, line) in enumerate(layers["snakes"][s][1]):
            if (s, k) not in drop:
                out[sl] |= line >= _DRAWN
    return out[P:P + H, P:P + W]


def chained(drawn: np.ndarray, tips, margin: int) -> bool:
    """Whether ``drawn`` (bool ``[H, W]``) links the two marker centres once gaps of up to 2 (margin
    + 2) px are bridged: the gaps between consecutive paddles of one snake always are (a target
    snake is one such chain), a gap of a paddle or more taken out is not."""
    from scipy import ndimage

    comp, _ = ndimage.label(ndimage.binary_dilation(drawn, _disk(int(margin) + 2)))
    (ay, ax), (by, bx) = [tuple(int(v) for v in t) for t in tips]
    return bool(comp[ay, ax] == comp[by, bx] != 0)


def _distance_to_markers(shape, tips) -> np.ndarray:
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    return np.min([np.hypot(yy - int(y), xx - int(x)) for y, x in tips], axis=0)


def unchanged_within(a: np.ndarray, b: np.ndarray, tips, radius: float) -> bool:
    """Whether images ``a`` and ``b`` agree on every pixel whose centre lies within ``radius`` of a marker centre."""
    near = _distance_to_markers(np.shape(a), tips) <= radius
    return bool(np.array_equal(np.asarray(a)[near], np.asarray(b)[near]))


def _check(image, layers, params, label: int, what: str) -> None:
    _need_layers(layers)
    if np.shape(image) != layers["markers"].shape:
        raise ValueError(f"image has shape {np.shape(image)}, its layers {layers['markers'].shape}")
    so, st = layers["tip_snakes"]
    if int(so == st) != label:
        raise ValueError(f"{what} takes images of label {label}; this one has {int(so == st)}")
    if params.resolution != np.shape(image)[0]:
        raise ValueError(f"params are for {params.resolution} px, the image is {np.shape(image)[0]} px")


def cut(image: np.ndarray, layers: dict, params, *, radius: float | None = None, n_paddles: int = 2):
    """A positive image with its path severed (module docstring): ``(image, info)`` or None when no
    run of ``n_paddles`` paddles of the marked snake can go. ``info``: ``snake`` (0 or 1),
    ``paddles`` (the indices taken out), ``changed`` (pixels that changed)."""
    _check(image, layers, params, 1, "cut")
    if n_paddles < 1:
        raise ValueError(f"n_paddles must be at least 1, got {n_paddles}")
    radius = default_radius(params.resolution) if radius is None else float(radius)
    tips, s = layers["tips"], layers["tip_snakes"][0] - 1
    far = _distance_to_markers(np.shape(image), tips) > radius
    K = len(layers["snakes"][s][1])
    starts = sorted(range(1, K - n_paddles), key=lambda i: (abs(i + (n_paddles - 1) / 2 - (K - 1) / 2), i))
    for i in starts:
        drop = [(s, k) for k in range(i, i + n_paddles)]
        new = compose(layers, drop)
        changed = new != image
        if not changed.any() or not far[changed].all():
            continue
        if chained(_drawn(layers, [s], drop), tips, layers["margin"]):
            continue
        return new, {"snake": s, "paddles": [k for _, k in drop], "changed": int(changed.sum())}
    return None


def _stroke(params, a, b, size: int) -> np.ndarray:
    """A stroke from pixel ``a`` to pixel ``b`` ((y, x)) drawn as the generator draws paddles: a
    line ``thickness * 2`` wide on a canvas twice as fine, Lanczos-resized (in float with its
    overshoot for release fidelity), times the target snakes' contrast."""
    from PIL import Image, ImageDraw

    fine = Image.new("L", (size * _AA, size * _AA), 0)
    ends = [(_AA * int(p[1]) + _AA // 2, _AA * int(p[0]) + _AA // 2) for p in (a, b)]
    ImageDraw.Draw(fine).line(ends, fill=255, width=int(round(params.paddle_thickness * _AA)))
    if params.release:
        line = np.asarray(Image.fromarray(np.asarray(fine, np.float32)).resize((size, size), Image.LANCZOS), np.float32)
    else:
        line = np.asarray(fine.resize((size, size), Image.LANCZOS), np.float32)
    return line / 255 * (params.paddle_contrast * params.snake_contrast)


def join(image: np.ndarray, layers: dict, params, *, radius: float | None = None, tries: int = 40):
    """A negative image with its two target snakes joined (module docstring): ``(image, info)`` or
    None when none of the ``tries`` closest pairs of far-enough pixels gives a valid join.
    ``info``: ``ends`` (the two joined pixels, (y, x)), ``length`` (px), ``changed``."""
    _check(image, layers, params, 0, "join")
    radius = default_radius(params.resolution) if radius is None else float(radius)
    tips, ids, size = layers["tips"], layers["ids"], np.shape(image)[0]
    dist = _distance_to_markers(np.shape(image), tips)
    # the stroke's ends stay clear of the markers by its own half-width and its antialiasing
    clear = radius + params.paddle_thickness + 2
    a = np.argwhere((ids == 1) & (dist > clear))
    b = np.argwhere((ids == 2) & (dist > clear))
    if not len(a) or not len(b):
        return None
    d = np.hypot(a[:, None, 0] - b[None, :, 0], a[:, None, 1] - b[None, :, 1])
    order = np.argsort(d, axis=None, kind="stable")
    seen_a, seen_b = set(), set()
    for flat in order:
        if tries <= 0:
            break
        i, j = np.unravel_index(flat, d.shape)
        if i in seen_a or j in seen_b:  # one try per pixel of either snake
            continue
        seen_a.add(i)
        seen_b.add(j)
        tries -= 1
        stroke = _stroke(params, a[i], b[j], size)
        new = compose(layers, extra=stroke)
        changed = new != image
        drawn = _drawn(layers, [0, 1]) | (stroke >= _DRAWN * params.paddle_contrast * params.snake_contrast)
        if not (dist[changed] > radius).all() or not chained(drawn, tips, layers["margin"]):
            continue
        return new, {"ends": (tuple(int(v) for v in a[i]), tuple(int(v) for v in b[j])),
                     "length": float(d[i, j]), "changed": int(changed.sum())}
    return None


def control_cut(image: np.ndarray, layers: dict, params, *, radius: float | None = None, n_paddles: int = 2,
                match: int | None = None):
    """The matched control of `cut` (module docstring), for an image of either label: ``(image,
    info)`` or None when no run of ``n_paddles`` paddles of a distractor can go. ``info``:
    ``snake`` (its index, 2 or more), ``paddles``, ``changed`` (pixels that changed). ``match``:
    choose the run whose number of changed pixels is closest to it (ties: the earlier snake and
    paddle), else the first valid run."""
    _need_layers(layers)
    if np.shape(image) != layers["markers"].shape:
        raise ValueError(f"image has shape {np.shape(image)}, its layers {layers['markers'].shape}")
    if params.resolution != np.shape(image)[0]:
        raise ValueError(f"params are for {params.resolution} px, the image is {np.shape(image)[0]} px")
    if n_paddles < 1:
        raise ValueError(f"n_paddles must be at least 1, got {n_paddles}")
    if match is not None and match < 1:
        raise ValueError(f"match must be a positive pixel count, got {match}")
    radius = default_radius(params.resolution) if radius is None else float(radius)
    far = _distance_to_markers(np.shape(image), layers["tips"]) > radius
    targets = _drawn(layers, [0, 1])
    best = None
    for s in range(2, len(layers["snakes"])):
        K = len(layers["snakes"][s][1])
        for i in range(0, K - n_paddles + 1):
            drop = [(s, k) for k in range(i, i + n_paddles)]
            new = compose(layers, drop)
            changed = new != image
            n = int(changed.sum())
            if not n or not far[changed].all() or targets[changed].any():
                continue
            if match is None:
                return new, {"snake": s, "paddles": [k for _, k in drop], "changed": n}
            if best is None or abs(n - match) < abs(best[1]["changed"] - match):
                best = (new, {"snake": s, "paddles": [k for _, k in drop], "changed": n})
    return best


def _free_ends(layers: dict) -> tuple:
    """The ends of the two target snakes that carry no marker, (y, x) each, in snake order."""
    tips = {tuple(int(v) for v in t) for t in layers["tips"]}
    ends = []
    for o, t in zip(layers["origins"], layers["terminals"]):
        o, t = tuple(int(v) for v in o), tuple(int(v) for v in t)
        ends.append(t if o in tips else o)
    return tuple(ends)


def dashed_join(image: np.ndarray, layers: dict, params, *, radius: float | None = None):
    """A negative image with its two target snakes joined end to end by paddle-like dashes (module
    docstring): ``(image, info)`` or None when that join is not valid. ``info``: ``ends`` (the two
    free snake ends, (y, x)), ``dashes`` (their end points, float (y, x) pairs), ``length`` (px
    between the ends), ``changed``."""
    _check(image, layers, params, 0, "dashed_join")
    if "origins" not in layers or "terminals" not in layers:
        raise ValueError("layers must come from pathfinder.render(..., return_layers=True); missing origins/terminals")
    radius = default_radius(params.resolution) if radius is None else float(radius)
    size, gap, L = np.shape(image)[0], int(layers["margin"]), float(params.paddle_length)
    a, b = (np.asarray(e, np.float64) for e in _free_ends(layers))
    dist = float(np.hypot(*(b - a)))
    span = dist - 2 * gap  # the dashes lie a paddle gap from either snake end
    if span < 1:
        return None
    n = max(1, int(round((span + gap) / (L + gap))))
    dash = (span - (n - 1) * gap) / n
    if dash < 1:
        n = max(1, int((span + gap) // (1 + gap)))
        dash = (span - (n - 1) * gap) / n
    u = (b - a) / dist
    dashes, stroke = [], np.zeros((size, size), np.float32)
    for k in range(n):
        p0 = a + u * (gap + k * (dash + gap))
        p1 = p0 + u * dash
        dashes.append((tuple(float(v) for v in p0), tuple(float(v) for v in p1)))
        np.maximum(stroke, _stroke(params, np.rint(p0).astype(int), np.rint(p1).astype(int), size), out=stroke)
    new = compose(layers, extra=stroke)
    changed = new != image
    far = _distance_to_markers(np.shape(image), layers["tips"]) > radius
    drawn = _drawn(layers, [0, 1]) | (stroke >= _DRAWN * params.paddle_contrast * params.snake_contrast)
    if not changed.any() or not far[changed].all() or not chained(drawn, layers["tips"], layers["margin"]):
        return None
    return new, {"ends": (tuple(int(v) for v in a), tuple(int(v) for v in b)), "dashes": dashes,
                 "length": dist, "changed": int(changed.sum())}


def paddle_cosine(layers: dict) -> float:
    """cos(theta_origin - theta_terminal): the seed paddle of the snake under the origin marker
    against the last paddle of the snake under the terminal marker (``studies/pathx/rim_probe.py``)."""
    so, st = layers["tip_snakes"]
    return math.cos(layers["thetas"][so - 1][0] - layers["thetas"][st - 1][-1])


def propensity(features, labels, *, folds: int = 5, seed: int = 0, epochs: int = 60, hidden: int = 64) -> np.ndarray:
    """Out-of-fold p(label = 1 | features) ``[n]`` from a small MLP (features standardised per fold)."""
    import torch
    from torch import nn

    x, y = np.asarray(features, np.float32), np.asarray(labels, np.int64)
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(f"features must be [n, d] and labels [n], got {x.shape} and {y.shape}")
    rng = np.random.default_rng(seed)
    fold = rng.permutation(len(y)) % folds
    out = np.empty(len(y), np.float64)
    for f in range(folds):
        tr, te = fold != f, fold == f
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-6
        xt, yt = torch.from_numpy((x[tr] - mu) / sd), torch.from_numpy(y[tr])
        torch.manual_seed(seed + f)
        model = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                              nn.Linear(hidden, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
        g = torch.Generator().manual_seed(seed + f)
        for _ in range(epochs):
            for b in torch.randperm(len(xt), generator=g).split(256):
                loss = nn.functional.cross_entropy(model(xt[b]), yt[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            out[te] = torch.softmax(model(torch.from_numpy((x[te] - mu) / sd)), -1)[:, 1].double().numpy()
    return out


def balance(features, labels, *, bins: int = 20, seed: int = 0, folds: int = 5, epochs: int = 60) -> np.ndarray:
    """Sorted indices of a subset in which ``features`` carry no label information (module
    docstring): within each of ``bins`` quantile strata of the out-of-fold propensity score, as
    many images of either label (the larger class subsampled at random, ``seed``)."""
    labels = np.asarray(labels, np.int64)
    if not set(np.unique(labels)) <= {0, 1} or len(np.unique(labels)) != 2:
        raise ValueError("labels must hold both 0 and 1 and nothing else")
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    score = propensity(features, labels, folds=folds, seed=seed, epochs=epochs)
    edges = np.quantile(score, np.linspace(0, 1, bins + 1)[1:-1])
    stratum = np.searchsorted(edges, score, side="right")
    rng = np.random.default_rng([seed, 1])
    keep = []
    for s in np.unique(stratum):
        pos = np.flatnonzero((stratum == s) & (labels == 1))
        neg = np.flatnonzero((stratum == s) & (labels == 0))
        m = min(len(pos), len(neg))
        keep += [rng.choice(pos, m, replace=False), rng.choice(neg, m, replace=False)]
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, np.int64)
