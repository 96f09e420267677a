"""Pathfinder's two target snakes, sampled by many attempts at once (the ``batched`` method).

The reference sampler (``pathfinder._two_snakes``) makes one attempt at a time and discards it at
the first step that fails; at 64 px hard about 2000 attempts are made per image, each a few dozen
small NumPy calls, so nearly all time is interpreter overhead on attempts that die. Here a batch of
attempts advances in lockstep: one seed stage for all of them, then ``2 * (contour_length - 1)``
growth steps, each a handful of array operations over the attempts still alive, with the dead ones
dropped. Every attempt is the reference's step for step (same seeds, candidate heads, weights,
occupancy and collision tests, same retries), and attempts are independent and identically
distributed, so the successful ones, taken in attempt order, are independent draws from exactly
the reference's distribution of accepted pairs. All successes are used: a chunk of images asks for
as many pairs as it has images (per margin), and batches run until it has them.

Exact up to floating-point order: occupancy is kept as uint8 (every mask value the reference uses
is k / 255, and its maxima stay so), the reference's float32 collision test ``(occupancy + mask)
.max() < 1.8`` is a per-mask-value threshold table computed with the same float32 sums, and its
``1 - occupancy`` weights a table of the same float32 values; only the sums behind the sampling
cumulative distribution are formed in another order (differences of an ulp). Candidates whose
continuity weight is below 1e-12 (it is cos(pi/2)^2 ~ 4e-33 at the cut-off, else 0) are left out.
The first target seed lies on an empty canvas whose free space is a rectangle, so "uniform over the
pixels where its footprint fits" is a uniform draw in a smaller rectangle (checked at build time).

Cost. A batch has a few hundred live attempts (at 64 px most die at their seed), fewer at every
step, so each growth step's cost is about half NumPy call overhead: the live attempts' state is one
int64 array compacted by one gather, per-orientation tables are gathered with ``ndarray.take``, no
retry is made once every attempt has a paddle, and only rasters that got paddles are reset. The
random draws are those of the first version of this sampler, in the same order: its output is
pinned by hashes in tests/test_lra_pathfinder_batched.py.
"""

from __future__ import annotations

import math

import numpy as np

_BATCH_BYTES = 12 << 20  # the two occupancy rasters of one batch of attempts (fits a shared L3)
_MIN_BATCH = 256
_WEIGHT_FLOOR = 1e-12

_THRESHOLDS = None


def _collision_thresholds() -> np.ndarray:
    """T[b]: the least occupancy a (uint8) at which the reference's float32 ``a/255 + b/255 < 1.8``
    fails, for every mask value b (256 where it never fails)."""
    global _THRESHOLDS
    if _THRESHOLDS is None:
        vals = np.arange(256).astype(np.uint8).astype(np.float32) / 255
        t = np.full(256, 256, np.int16)
        for b in range(256):
            for a in range(max(0, 455 - b), 256):  # the sum reaches 1.8 only near a + b = 459
                if not (vals[a] + vals[b]) < 1.8:  # numpy float32 scalars, as (R[sl] + mask).max()
                    t[b] = a
                    break
        _THRESHOLDS = t
    return _THRESHOLDS


class BatchedTargets:
    """Tables for one geometry (params, margin) and a reusable raster buffer."""

    def __init__(self, g):
        self.g = g
        self.release = g.p.release  # one shared occupancy, the original's commits (pathfinder._grow_release)
        self.P, self.H, self.W, self.Wc, self.L, self.m = g.P, g.H, g.W, g.Wc, g.L, g.m
        self.S = g.M0.size
        self.M0 = np.round(g.M0.ravel() * 255).astype(np.uint8)
        # Orientation table: ids 0..359 are the seeds' whole degrees -180..179, 360 + k candidate k.
        thetas = [d * np.pi / 180 for d in range(-180, 180)] + [float(o) for o in g.corient]
        self.thetas = np.array(thetas)
        self.sin = np.array([math.sin(t) for t in thetas])
        self.cos = np.array([math.cos(t) for t in thetas])
        w = np.stack([g.weights(t) for t in thetas])
        keep = w > _WEIGHT_FLOOR
        self.nc = keep.sum(1)
        kc = int(self.nc.max())
        self.ci = np.zeros((len(thetas), kc), np.int64)
        self.cw = np.zeros((len(thetas), kc))
        for t in range(len(thetas)):
            idx = np.flatnonzero(keep[t])
            self.ci[t, :idx.size] = idx
            self.ci[t, idx.size:] = idx[-1] if idx.size else 0
            self.cw[t, :idx.size] = w[t, idx]
        self.cdy, self.cdx = g.cdy, g.cdx
        # [disk, orientation, Kc]: the dilation disk around each kept candidate (disk first, so the
        # max over it is an elementwise maximum of contiguous slabs, not a reduction of a short axis)
        # int32: a gather indexed by int32 offsets through np.take is ~2x faster than int64 fancy
        # indexing (flat raster offsets stay below 2**31: checked below).
        self.cring = np.ascontiguousarray(g.cring[self.ci].transpose(2, 0, 1)).astype(np.int32)
        self.reach = g.reach
        self.cflat = self.cdy * self.Wc + self.cdx  # candidate head offsets from the pivot
        self.last = self.nc - 1
        # the pivot's step along each orientation, as the reference computes it
        self.step_sin = (self.L + 2 * self.m) * self.sin
        self.step_cos = (self.L + 2 * self.m) * self.cos
        vals = np.arange(256).astype(np.uint8).astype(np.float32) / 255
        self.free = (1 - vals).astype(np.float64)  # the reference's float32 1 - occupancy
        thr = _collision_thresholds()
        # Patch table: ids 0..359 seed paddles at -180..179 degrees (anchored at the tail), 360 + k
        # the paddle whose head is candidate k (anchored at the head). Support pixels only, padded
        # by repeating the first one (so a scatter writes it twice with the same value).
        pats = [g.seed_paddle(d)[0] for d in range(-180, 180)] + list(g.cpatch)
        offs, vals8 = [], []
        for y0, x0, _, mask in pats:
            m8 = np.round(mask * 255).astype(np.uint8)
            yy, xx = np.nonzero(m8)
            offs.append(((yy + y0) * self.Wc + xx + x0).astype(np.int64))
            vals8.append(m8[yy, xx])
        q = max(o.size for o in offs)
        self.poff = np.stack([np.concatenate([o, np.full(q - o.size, o[0])]) for o in offs])
        self.pval = np.stack([np.concatenate([v, np.full(q - v.size, v[0])]) for v in vals8])
        # The collision test can only fail where the mask reaches thr < 256 (b >= 204): test there only.
        core = [np.flatnonzero(thr[v] <= 255) for v in vals8]
        qc = max(c.size for c in core)
        self.coff = np.stack([np.concatenate([o[c], np.full(qc - c.size, o[c[0]])])
                              for o, c in zip(offs, core)]).astype(np.int32)
        self.cthr = np.stack([np.concatenate([thr[v[c]], np.full(qc - c.size, thr[v[c[0]]])])
                              for v, c in zip(vals8, core)]).astype(np.uint8)  # all <= 255 on the core
        self.kcoff, self.kcthr = self.coff[360:], self.cthr[360:]  # by candidate k
        # First seed: M1's free space must be a rectangle [y0, y1] x [x0, x1] of image pixels.
        M1 = g.M1[self.P:self.P + self.H, self.P:self.P + self.W] <= 0.3
        ys, xs = np.flatnonzero(M1.any(1)), np.flatnonzero(M1.any(0))
        y0, y1, x0, x1 = ys[0], ys[-1], xs[0], xs[-1]
        if not (M1[y0:y1 + 1, x0:x1 + 1].all() and M1.sum() == (y1 - y0 + 1) * (x1 - x0 + 1)):
            raise AssertionError("the first seed's free space is not a rectangle")
        self.seed_box = np.zeros((360, 4), np.int64)  # tail y range, tail x range (inclusive)
        for d in range(-180, 180):
            if not g.seed_allowed(d):  # no place at all (release: the original's seed search fails)
                self.seed_box[d + 180] = (1, 0, 1, 0)
                continue
            foot = g.seed_paddle(d)[1]
            fy = (foot + self.Wc // 2) // self.Wc  # offsets are small: decode (dy, dx) from dy * Wc + dx
            fx = foot - fy * self.Wc
            if not self.release:  # clean: the tail pixel itself must be free too
                fy, fx = np.append(fy, 0), np.append(fx, 0)
            self.seed_box[d + 180] = (y0 - fy.min(), y1 - fy.max(), x0 - fx.min(), x1 - fx.max())
        self.B = max(_MIN_BATCH, _BATCH_BYTES // (2 * self.S))
        self.kc_rows = np.arange(self.B) * self.ci.shape[1]  # row starts of a flattened [n, Kc], n <= B
        if (self.B + 1) * self.S >= 2 ** 31:
            raise AssertionError("flat raster offsets of a batch overflow int32")
        # What a commit can change: the image minus its border band (outside it M0 is 255 already,
        # the maximum), so a used raster is reset by zeroing this box of every row.
        Hc = g.M0.shape[0]
        self.box = (Hc, self.P + g.p.padding, self.P + self.H - g.p.padding,
                    self.P + g.p.padding, self.P + self.W - g.p.padding)
        if not (g.M0[self.box[1]:self.box[2], self.box[3]:self.box[4]] == 0).all() \
                or np.count_nonzero(g.M0 == 0) != (self.box[2] - self.box[1]) * (self.box[4] - self.box[3]):
            raise AssertionError("the initial occupancy is not 1 outside a box of zeros")
        self._R = None

    # ------------------------------------------------------------------------------------ helpers
    def _flat(self, y, x):
        return (y + self.P) * self.Wc + x + self.P

    def _inside(self, y, x):
        return (y >= 0) & (y < self.H) & (x >= 0) & (x < self.W)

    def _commit(self, R, anchor, pid):
        """Paste paddles pid (max) into R at flat offsets anchor (each row's raster offset included)."""
        idx = self.poff.take(pid, axis=0)  # int64: a scatter through int32 indices is ~2x slower
        idx += anchor[:, None]
        v = R.take(idx)
        np.maximum(v, self.pval.take(pid, axis=0), out=v)
        R[idx] = v

    # ------------------------------------------------------------------------------------- stages
    def _seeds(self, rng, n):
        """Seed paddles of both snakes for n attempts: (ok, tail y/x, degree index) per snake."""
        L, m, sd = self.L, self.m, self.g.p.seed_distance
        tries = self.g.p.max_paddle_retrial + 1
        ty1, tx1, d1 = (np.zeros(n, np.int64) for _ in range(3))
        todo = np.arange(n)
        dead = np.zeros(n, bool)
        for _ in range(tries):  # snake 1: a uniform tail where the footprint fits, head and pivot inside
            deg = rng.integers(-180, 180, size=todo.size) + 180
            box = self.seed_box[deg]
            empty = (box[:, 0] > box[:, 1]) | (box[:, 2] > box[:, 3])
            dead[todo[empty]] = True  # no place at all: the reference gives up on this seed
            todo, deg, box = todo[~empty], deg[~empty], box[~empty]
            y = rng.integers(box[:, 0], box[:, 1] + 1)
            x = rng.integers(box[:, 2], box[:, 3] + 1)
            hy = np.ceil(y + L * self.sin[deg]).astype(np.int64)
            hx = np.ceil(x + L * self.cos[deg]).astype(np.int64)
            vy = np.ceil(hy - (L + m) * self.sin[deg]).astype(np.int64)
            vx = np.ceil(hx - (L + m) * self.cos[deg]).astype(np.int64)
            ok = self._inside(hy, hx) & self._inside(vy, vx)
            ty1[todo[ok]], tx1[todo[ok]], d1[todo[ok]] = y[ok], x[ok], deg[ok]
            todo = todo[~ok]
        dead[todo] = True
        ty2, tx2, d2 = (np.zeros(n, np.int64) for _ in range(3))
        todo = np.flatnonzero(~dead)
        for _ in range(tries):  # snake 2: seed_distance away in a random direction
            deg = rng.integers(-180, 180, size=todo.size) + 180
            phi = rng.integers(0, 360, size=todo.size) * np.pi / 180
            y = np.round(ty1[todo] + sd * np.sin(phi)).astype(np.int64)
            x = np.round(tx1[todo] + sd * np.cos(phi)).astype(np.int64)
            hy = np.ceil(y + L * self.sin[deg]).astype(np.int64)
            hx = np.ceil(x + L * self.cos[deg]).astype(np.int64)
            vy = np.ceil(hy - (L + m) * self.sin[deg]).astype(np.int64)
            vx = np.ceil(hx - (L + m) * self.cos[deg]).astype(np.int64)
            ok = self._inside(hy, hx) & self._inside(vy, vx)
            if not self.release:  # (release checks head and pivot only; see pathfinder._two_snakes)
                ok &= self._inside(y, x)
            ty2[todo[ok]], tx2[todo[ok]], d2[todo[ok]] = y[ok], x[ok], deg[ok]
            todo = todo[~ok]
        dead[todo] = True
        return ~dead, (ty1, tx1, d1), (ty2, tx2, d2)

    def candidates(self, R, offset, npy, npx, t):
        """Candidate heads around pivots (npy, npx) after orientations t on rasters R (flat, one per
        row at ``offset``): their indices [n, Kc] and unnormalised probabilities, continuity weight
        times 1 - occupancy dilated by the margin, 0 outside the image (the reference's pmf)."""
        return self._pmf(R, offset + (npy + self.P) * self.Wc + npx + self.P, t)

    def _pmf(self, R, base, t):
        """``candidates`` at flat pivot offsets ``base``. A candidate head outside the image needs no
        test of its own: the head pixel (the disk's centre) lies in the border band, occupancy 255
        in every raster, so its 1 - occupancy factor is exactly 0 already."""
        idx = self.cring.take(t, axis=1)
        idx += base.astype(np.int32)[None, :, None]
        pmf = self.free.take(R.take(idx).max(0))  # [n, Kc]: 1 - occupancy dilated by the margin
        pmf *= self.cw.take(t, axis=0)
        return self.ci.take(t, axis=0), pmf

    def _blocked(self, R, anchor, k):
        """Whether candidate k's paddle with its head at flat offset anchor collides (the reference's
        ``(R + mask).max() >= 1.8``, on the mask's core only)."""
        idx = self.kcoff.take(k, axis=0)
        idx += anchor.astype(np.int32)[:, None]
        return (R.take(idx) >= self.kcthr.take(k, axis=0)).any(1)

    # The attempts still alive are the rows of one int64 array Z (kept in attempt order, so a step's
    # survivors are one gather): their attempt, the raster offset of their canvas's pixel (0, 0)
    # and, per snake i, columns 2 + 4i..: pivot y, pivot x, orientation id (which is also the id of
    # its newest paddle, not yet committed) and the flat offset of that paddle's anchor.
    def _extend(self, rng, R, Z, i, hist_k, hist_h, s):
        """One growth step of snake i on the attempts Z: returns the rows of Z that survive, updated."""
        c = 2 + 4 * i
        Ri = R[i]
        t = Z[:, c + 2]
        npy = np.ceil(Z[:, c] + self.step_sin.take(t)).astype(np.int64)
        npx = np.ceil(Z[:, c + 1] + self.step_cos.take(t)).astype(np.int64)
        base = Z[:, 1] + npy * self.Wc
        base += npx
        cand, pmf = self._pmf(Ri, base, t)
        total = pmf.sum(1)
        live = total >= 1e-4
        pos = None  # usual: every row lives, so skip the copies that select the live ones
        if not live.all():
            pos = np.flatnonzero(live)
            if pos.size == 0:
                return Z[:0]
            t, npy, npx, base, cand, pmf, total = (a[pos] for a in (t, npy, npx, base, cand, pmf, total))
        n = t.size
        cmf = np.cumsum(pmf, 1)
        cmf /= total[:, None]
        last = self.last.take(t)
        kc = cand.shape[1]
        j = (cmf <= rng.random(n)[:, None]).sum(1)
        np.minimum(j, last, out=j)
        j += self.kc_rows[:n]
        k = cand.take(j)
        anchor = base + self.cflat.take(k)
        bad = np.flatnonzero(self._blocked(Ri, anchor, k))
        if bad.size:  # retries, for the rows whose paddle collided (no draws once none is left)
            k[bad] = -1
            todo = bad
            for _ in range(self.g.p.max_paddle_retrial):
                u = rng.random(todo.size)
                j = (cmf[todo] <= u[:, None]).sum(1)
                np.minimum(j, last[todo], out=j)
                j += todo * kc
                kt = cand.take(j)
                at = base[todo] + self.cflat.take(kt)
                hit = self._blocked(Ri, at, kt)
                ok = ~hit
                k[todo[ok]], anchor[todo[ok]] = kt[ok], at[ok]
                todo = todo[hit]
                if todo.size == 0:
                    break
            good = np.flatnonzero(k >= 0)
            k, anchor, npy, npx = k[good], anchor[good], npy[good], npx[good]
            pos = good if pos is None else pos[good]
        if pos is not None:
            Z = Z.take(pos, axis=0)
        # The snake's previous paddle joins its own reference; the new one is the other's obstacle
        # (release: R[0] is R[1], the shared occupancy, which gets only the previous paddle).
        self._commit(Ri, Z[:, c + 3], Z[:, c + 2])
        pid = k + 360
        if not self.release:
            self._commit(R[1 - i], anchor, pid)
        rows = Z[:, 0]
        hist_k[i, s, rows] = k
        hist_h[i, s, rows] = anchor - Z[:, 1]
        Z[:, c], Z[:, c + 1], Z[:, c + 2], Z[:, c + 3] = npy, npx, pid, anchor
        return Z

    def _batch(self, rng, n):
        """n attempts; returns (the state of the successful ones, in attempt order; the occupancy rasters)."""
        S, L, m, P, Wc = self.S, self.L, self.m, self.P, self.Wc
        if self._R is None:
            self._R = (np.empty(self.B * S, np.uint8), np.empty(self.B * S, np.uint8))
            for r in self._R:
                r.reshape(self.B, S)[:] = self.M0
            self._dirty = np.zeros(0, np.int64)
        if n > self.B:
            raise AssertionError(f"a batch of {n} attempts exceeds the buffer's {self.B}")
        Hc, y0, y1, x0, x1 = self.box
        if self._dirty.size:  # only rows that got paddles differ from M0: reset those
            for r in self._R[:2 - self.release]:
                r.reshape(self.B, Hc, Wc)[self._dirty, y0:y1, x0:x1] = 0
        R = (self._R[0][:n * S], self._R[1][:n * S])
        if self.release:
            R = (R[0], R[0])
        ok, s1, s2 = self._seeds(rng, n)
        rows = np.flatnonzero(ok)
        self._dirty = rows
        steps = self.g.p.contour_length - 1
        Z = np.empty((rows.size, 10), np.int64)
        Z[:, 0] = rows
        Z[:, 1] = rows * S + P * Wc + P
        for i, (ty, tx, d) in enumerate((s1, s2)):
            ty, tx, d = ty[rows], tx[rows], d[rows]
            hy = np.ceil(ty + L * self.sin[d]).astype(np.int64)
            hx = np.ceil(tx + L * self.cos[d]).astype(np.int64)
            c = 2 + 4 * i
            Z[:, c] = np.ceil(hy - (L + m) * self.sin[d]).astype(np.int64)
            Z[:, c + 1] = np.ceil(hx - (L + m) * self.cos[d]).astype(np.int64)
            Z[:, c + 2] = d
            Z[:, c + 3] = Z[:, 1] + ty * Wc + tx
        if not self.release:  # clean: each seed is the other snake's obstacle from the start
            self._commit(R[0], Z[:, 9], Z[:, 8])
            self._commit(R[1], Z[:, 5], Z[:, 4])
        # Every surviving attempt has all steps of both snakes written: the rest may stay garbage.
        hist_k = np.empty((2, steps, n), np.int64)
        hist_h = np.empty((2, steps, n), np.int64)  # the head's y * Wc + x
        for s in range(steps):
            for i in (0, 1):
                if Z.shape[0] == 0:
                    return {"Z": Z}, R
                Z = self._extend(rng, R, Z, i, hist_k, hist_h, s)
        return {"Z": Z, "k": hist_k, "h": hist_h, "seeds": (s1, s2)}, R

    def sample(self, rng, count: int, max_attempts: int):
        """``count`` pairs of target snakes: a list of (occupancy float32 canvas, [snake dict] * 2)."""
        out = []
        attempts = succ = 0
        while len(out) < count:
            if attempts >= max_attempts:
                raise RuntimeError(f"could not place the two target snakes in {attempts} attempts ({self.g.p})")
            need = count - len(out)
            rate = (succ + 1) / (attempts + 2)  # this chunk's own history: deterministic
            n = int(min(self.B, max_attempts - attempts, max(_MIN_BATCH, math.ceil(1.2 * need / rate))))
            st, R = self._batch(rng, n)
            got = st["Z"].shape[0]
            attempts += n
            succ += got
            for q in range(min(need, got)):
                out.append(self._pair(q, st, R))
        return out

    def _pair(self, q, st, R):
        """Successful attempt q of a batch (counted among the successes) as (occupancy, snakes)."""
        g, S, P, Wc = self.g, self.S, self.P, self.Wc
        a = int(st["Z"][q, 0])
        M = R[0][a * S:(a + 1) * S].copy()
        c = 6 if self.release else 2  # release: only snake 2's last paddle is committed
        self._commit(M, st["Z"][q:q + 1, c + 3] - a * S, st["Z"][q:q + 1, c + 2])
        M = (M.astype(np.float32) / 255).reshape(g.M0.shape)
        snakes = []
        for i, (ty, tx, d) in enumerate(st["seeds"]):
            tail = (int(ty[a]), int(tx[a]))
            deg = int(d[a]) - 180
            patches = [g.slices(tail[0], tail[1], g.seed_paddle(deg)[0])]
            thetas = [deg * np.pi / 180]
            head = tail
            for s in range(st["k"].shape[1]):
                k = int(st["k"][i, s, a])
                h = int(st["h"][i, s, a]) + P * Wc + P  # the head's flat canvas offset
                head = (h // Wc - P, h % Wc - P)
                patches.append(g.slices(head[0], head[1], g.cpatch[k]))
                thetas.append(float(g.corient[k]))
            snakes.append({"origin": tail, "terminal": head, "patches": patches, "thetas": thetas})
        return M, snakes
