"""sparseflash.distributed on CPU + gloo: 2 and 4 spawned ranks against the one-process attention.

Each spawned group runs every case in one go (process start-up dominates); a failing case raises in
the ranks and fails the test with the rank's traceback.
"""

import csv
import datetime
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

import sparseflash
import sparseflash.distributed as sfd
from sparseflash import BlockMask
from sparseflash.patterns import butterfly
from tests._ranks import run_ranks


def _docs(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


def _cases(w):
    """(name, N, block, heads_q, heads_kv, d, plan kwargs, backend); ``stage_tokens`` in some plans cuts the
    exchange into chunks of 1-3 blocks (the others: one stage per peer)."""
    g = torch.Generator().manual_seed(7)
    cases = []
    cases.append(("dense-N333", 333, 64, 2, 2, 16, {}, "reference"))
    cases.append(("causal-N613-gqa-stage64", 613, 32, 4, 2, 16, {"causal": True, "stage_tokens": 64}, "reference"))
    cases.append(("butterfly-N500-stage96", 500, 32, 2, 1, 16, {"mask": butterfly(500, block_size=32),
                                                                "stage_tokens": 96}, "reference"))
    window = BlockMask.from_fn(lambda b, h, q, k: (k <= q) & (q - k < 45), 450, block_size=32)
    cases.append(("window45-causal-N450", 450, 32, 2, 2, 16, {"mask": window}, "reference"))
    seg = _docs([100, 7, 20, 250, 3, 233])  # crosses rank boundaries, some shorter than a block
    cases.append(("docs-causal-N613-stage32", 613, 32, 2, 2, 16, {"causal": True, "segment_ids": seg,
                                                                  "stage_tokens": 32}, "reference"))
    empty = BlockMask.from_fn(lambda b, h, q, k: ((q - k).abs() < 70) & ~((q >= 50) & (q < 90)) & (k < 380),
                              397, block_size=32)  # rows 50..89 attend nothing; keys past 380 never
    cases.append(("empty-rows-N397", 397, 32, 2, 2, 16, {"mask": empty}, "reference"))
    lay = torch.rand(1, 2, 10, 10, generator=g) < 0.3
    cases.append(("per-head-layout-N301", 301, 32, 2, 1, 16,
                  {"mask": BlockMask.from_layout(lay, 32, 301), "causal": True}, "reference"))
    # whole-shard own stage under plain causal attention: the kernels' causal walk (`Plan.causal_stage`)
    cases.append(("causal-whole-N640-stage64", 640, 32, 2, 1, 16, {"causal": True, "stage_tokens": 64}, "reference"))
    if w == 2:  # (the interpreter's kernels once: slow)
        cases.append(("interpreter-causal-whole-N128", 128, 32, 2, 1, 16, {"causal": True}, "triton"))
        cases.append(("interpreter-docs-N90-stage32", 90, 32, 2, 1, 16, {"segment_ids": _docs([40, 50]),
                                                                          "stage_tokens": 32}, "triton"))
    return cases


def _check_case(rank, w, name, n, bs, hq, hk, d, kw, backend):
    g = torch.Generator().manual_seed(1234)  # the same tensors on every rank
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hk, n, d, generator=g)
    v = torch.randn(1, hk, n, d, generator=g)
    go = torch.randn(1, hq, n, d, generator=g)
    gl = torch.randn(1, hq, n, generator=g)
    # one process, full sequence
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    seg = kw.get("segment_ids")
    o_ref, lse_ref = sparseflash.attention(qr, kr, vr, kw.get("mask"), causal=kw.get("causal", False),
                                           segment_ids=None if seg is None else seg[None], return_lse=True,
                                           backend=backend)
    lse_ref_f = torch.where(torch.isfinite(lse_ref), lse_ref, torch.zeros_like(lse_ref))
    ((o_ref * go).sum() + (lse_ref_f * gl).sum()).backward()
    # distributed
    plan = sfd.plan(n, None, block_size=bs, **kw)
    own = plan.stages()[0]
    causal_own = [plan.causal_stage(st) for st in own]
    # the own stage runs as plain causal attention exactly when the plan is plain causal without padding
    assert causal_own == ([True] if "causal-whole" in name else [False] * len(own)), (name, causal_own)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    o_l, lse_l = sfd.attention(plan.shard(qd), plan.shard(kd), plan.shard(vd), plan, return_lse=True,
                               backend=backend)
    assert o_l.shape == (1, hq, plan.local_len, d)
    o = plan.unshard(o_l)
    lse = plan.unshard(lse_l.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_ref)), name
    lse_f = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    ((o * go).sum() + (lse_f * gl).sum()).backward()
    grads = [qd.grad, kd.grad, vd.grad]
    for t in grads:
        dist.all_reduce(t)  # each rank holds its own rows' gradients
    tol = dict(atol=2e-5, rtol=2e-4) if backend == "reference" else dict(atol=2e-4, rtol=2e-3)
    for what, a, b in (("out", o, o_ref), ("lse", lse_f, lse_ref_f), ("dq", grads[0], qr.grad),
                       ("dk", grads[1], kr.grad), ("dv", grads[2], vr.grad)):
        assert not torch.isnan(a).any(), f"{name}: {what} has NaN"
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name} ({w} ranks, {plan.placement}): {what}: {m}")
    # traffic: the forward and backward exchanges each send what the plan says
    expected = plan.expected_bytes(plan.shard(k), plan.shard(v), backward=True)
    assert plan.bytes_sent == expected, (name, plan.bytes_sent, expected)


def _check_bytes(rank, w):
    n, bs = 512, 32
    # documents that start and end on rank boundaries: nothing is sent
    seg = torch.arange(n) // (n // w)
    plan = sfd.plan(n, None, causal=True, segment_ids=seg, block_size=bs)
    assert plan.placement == "contiguous", plan.placement
    k = torch.randn(1, 2, n, 16)
    kl = plan.shard(k)
    ql = plan.shard(torch.randn(1, 2, n, 16))
    sfd.attention(ql, kl, kl, plan, backend="reference")
    assert plan.bytes_sent == 0 and plan.expected_bytes(kl, kl) == 0
    # a local window of 40 tokens sends only the halo: one block from the left neighbour, none else
    win = BlockMask.from_fn(lambda b, h, q, k: (q - k).abs() < 40, n, block_size=bs)
    plan = sfd.plan(n, None, mask=win, block_size=bs)
    assert plan.placement == "contiguous", plan.placement
    for s in range(w):
        if s != rank:
            assert len(plan.needed[rank][s]) == (2 if abs(s - rank) == 1 else 0), plan.needed[rank]
    kl = plan.shard(k)
    sfd.attention(ql, kl, kl, plan, backend="reference")
    # the halo's stage computes only the rows it reaches (two blocks), the own stage every row, in one stage
    own, remote = plan.stages()
    assert len(own) == 1
    for st, op in zip(own + remote, plan.stage_ops("cpu")):
        if st.blocks:
            want = plan.local_len if st.source == rank else 2 * bs
            assert op.rows.stop - op.rows.start == want and op.mask.seq_q == want, (rank, st.source, op.rows)
    per_block = kl[:, :, :bs].numel() * kl.element_size() * 2
    neighbours = sum(1 for s in range(w) if abs(s - rank) == 1)
    assert plan.bytes_sent == plan.expected_bytes(kl, kl) == 2 * neighbours * per_block


def _check_errors(rank, w):
    n = 300
    plan = sfd.plan(n, None, causal=True, block_size=32)
    with pytest.raises(ValueError, match="x: the plan was built for seq_len=300"):
        plan.shard(torch.randn(1, 1, 299, 16))
    ql = plan.shard(torch.randn(1, 2, n, 16))
    with pytest.raises(ValueError, match="k_l: this plan's shards hold local_len"):
        sfd.attention(ql, ql[:, :, :-1], ql, plan)
    with pytest.raises(ValueError, match="v_l is on meta"):
        sfd.attention(ql, ql, torch.empty(ql.shape, device="meta"), plan)
    with pytest.raises(ValueError, match="o_l: this plan's shards"):
        plan.unshard(ql[:, :, :5])
    with pytest.raises(ValueError, match="mask was built for"):
        sfd.plan(n, None, mask=butterfly(200, block_size=32), block_size=32)
    with pytest.raises(ValueError, match="mask has block size"):
        sfd.plan(n, None, mask=butterfly(n, block_size=64), block_size=32)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        sfd.plan(n, None, segment_ids=torch.zeros(n + 1, dtype=torch.int64), block_size=32)
    # ranks that disagree all raise (nobody hangs)
    with pytest.raises(ValueError, match=r"the ranks disagree \(causal: rank 0 True, rank 1 False"):
        sfd.plan(n, None, causal=(rank == 0), block_size=32)
    # a shard of a plan for another length
    other = sfd.plan(n + 200, None, block_size=32)
    with pytest.raises(ValueError, match="q_l: this plan's shards hold local_len"):
        sfd.attention(other.shard(torch.randn(1, 2, n + 200, 16)), ql, ql, plan)


class _Flaky:
    """A mask_mod that works while the mask is built and raises afterwards (a rank failing for no checked reason)."""

    def __init__(self):
        self.broken = False

    def __call__(self, b, h, q, k):
        if self.broken:
            raise ZeroDivisionError("the mask_mod failed")
        return (q - k).abs() < 45


def _check_bad_input(rank, w):
    """A rank's bad input (its own checks fail, or it differs from the others) raises the same error on every
    rank before any exchange; nobody waits for the backend's timeout (the group's is 60 s, as a guard)."""
    grp = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    n, bs = 300, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 16, generator=g)
    plan = sfd.plan(n, grp, causal=True, block_size=bs)
    ql, kl = plan.shard(q), plan.shard(q[:, :2])
    # one rank fails its own checks: every rank raises its message
    with pytest.raises(ValueError, match=r"attention: k_l: this plan's shards hold local_len=.* \(rank 1\)$"):
        sfd.attention(ql, kl[:, :, :-1] if rank == 1 else kl, kl, plan)
    with pytest.raises(ValueError, match=r"unshard: o_l: this plan's shards .* \(rank 0\)$"):
        plan.unshard(ql[:, :, :5] if rank == 0 else ql)
    # checks that pass on each rank but differ between ranks: heads, dtype, dropout
    with pytest.raises(ValueError, match=r"the ranks disagree \(q_l heads: rank 0 4, rank 1 2\)"):
        sfd.attention(ql if rank == 0 else ql[:, :2], kl, kl, plan)
    with pytest.raises(ValueError, match=r"q_l dtype: rank 0 float32, rank 1 float64; k_l dtype: .*; v_l dtype"):
        sfd.attention(*((ql, kl, kl) if rank == 0 else (ql.double(), kl.double(), kl.double())), plan)
    with pytest.raises(ValueError, match=r"dropout_p: rank 0 0.0, rank 1 0.5"):
        sfd.attention(ql, kl, kl, plan, dropout_p=0.5 * rank)
    # a backward on one rank only would hang: whether one follows is part of the call
    with pytest.raises(ValueError, match=r"gradient \(a backward will follow\): rank 0 False, rank 1 True"):
        sfd.attention(ql.requires_grad_(rank == 1), kl, kl, plan)
    ql.requires_grad_(False)
    o = sfd.attention(ql, kl, kl, plan, backend="reference")  # (the group's point-to-point works after all that)
    assert torch.isfinite(plan.unshard(o)).all() and plan.bytes_sent > 0
    # plans: one rank's arguments fail its checks; arguments that differ (block size, the mask's token-level
    # definition inside equal layouts); a rank that fails for another reason
    with pytest.raises(ValueError, match=r"plan: mask was built for \(200, 200\) tokens, expected .* \(rank 1\)"):
        sfd.plan(n, grp, mask=butterfly(200 if rank else n, block_size=bs), block_size=bs)
    with pytest.raises(ValueError, match=r"block_size: rank 0 32, rank 1 64"):
        sfd.plan(n, grp, causal=True, block_size=32 * (rank + 1))
    win = [BlockMask.from_fn(lambda b, h, q, k, r=r: (q - k).abs() < r, n, block_size=bs) for r in (45, 46)]
    assert torch.equal(win[0].layout, win[1].layout) and torch.equal(win[0].full, win[1].full)
    with pytest.raises(ValueError, match=r"the ranks disagree \(mask: rank 0 [0-9a-f]+, rank 1 [0-9a-f]+; plan: "):
        sfd.plan(n, grp, mask=win[rank], block_size=bs)
    flaky = _Flaky()
    mask = BlockMask.from_fn(flaky, n, block_size=bs)
    flaky.broken = rank == 0
    with pytest.raises(RuntimeError, match=r"plan: the mask_mod failed \(rank 0\)"):
        sfd.plan(n, grp, mask=mask, block_size=bs)
    # a rank without a plan joins the check on the default group's
    plan = sfd.plan(n, None, causal=True, block_size=bs)
    with pytest.raises(TypeError, match=r"plan must be a sparseflash.distributed.Plan .*got str \(rank 1\)"):
        sfd.attention(ql, kl, kl, plan if rank == 0 else "plan")
    # and after all that, a good call still works
    o = sfd.attention(ql, kl, kl, plan, backend="reference")
    assert o.shape == ql.shape and torch.isfinite(o).all()


def _check_pipeline(rank, w):
    """The exchange's structure on a causal plan in one-block stages: each remote stage's transfer is posted
    before the stage before it computes; at most two stages' received keys / values are alive at once,
    each one stage long; only stages with keys compute; the backward fetches one stage ahead and returns a
    stage's dK, dV while the next computes; only q, k, v, the output and its LSE are saved; a second call
    builds nothing new."""
    n, bs = 613, 32
    plan = sfd.plan(n, None, causal=True, block_size=bs, stage_tokens=bs)
    own, remote = plan.stages()
    index = {id(st): i for i, st in enumerate(own + remote)}
    g = torch.Generator().manual_seed(0)
    q, k, v = (plan.shard(torch.randn(1, 2, n, 16, generator=g)).requires_grad_() for _ in range(3))
    log, live, most = [], set(), [0]
    spied = sfd._Fetch, sfd._Return, sfd._Kernels.fwd, sfd._Kernels.bwd

    class Fetch(spied[0]):
        def __init__(self, plan_, st, *a):
            super().__init__(plan_, st, *a)
            log.append(("post", index[id(st)]))
            for t in self.kv or ():
                assert t.shape[2] <= bs
                live.add(id(t))
                weakref.finalize(t, live.discard, id(t))
            most[0] = max(most[0], len(live))

    class Return(spied[1]):
        def __init__(self, plan_, st, *a):
            super().__init__(plan_, st, *a)
            self.i = index[id(st)]
            log.append(("return", self.i))

        def finish(self, *a):
            log.append(("returned", self.i))
            super().finish(*a)

    sfd._Fetch, sfd._Return = Fetch, Return
    sfd._Kernels.fwd = lambda self, *a, **kw: log.append(("fwd", a[-1])) or spied[2](self, *a, **kw)
    sfd._Kernels.bwd = lambda self, *a, **kw: log.append(("bwd", a[-1])) or spied[3](self, *a, **kw)
    saved = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            o, lse = sfd.attention(q, k, v, plan, return_lse=True, backend="reference")
        fwd_log, log[:] = list(log), []
        (o.sum() + lse.sum()).backward()
        bwd_log = list(log)
    finally:
        sfd._Fetch, sfd._Return, sfd._Kernels.fwd, sfd._Kernels.bwd = spied
    assert saved == [tuple(q.shape)] * 3 + [tuple(o.shape), tuple(lse.shape)], saved
    at = lambda lg, e: lg.index(e)  # noqa: E731
    computes = [i for i, st in enumerate(own + remote) if st.blocks]
    assert [e[1] for e in fwd_log if e[0] == "fwd"] == computes
    assert [e[1] for e in bwd_log if e[0] == "bwd"] == computes
    if w == 2:  # zig-zag: rank 0 needs rank 1's 10 blocks, rank 1 rank 0's first 5: 5 stages only send there
        assert len(remote) == 10 and sum(not st.blocks for st in remote) == 5 * rank
    first = len(own)
    for lg in (fwd_log, bwd_log):
        assert at(lg, ("post", first)) < min(at(lg, (kind, i)) for kind in ("fwd", "bwd") for i in computes
                                             if (kind, i) in lg)
        for i in range(first, first + len(remote) - 1):
            if i in computes:
                kind = "fwd" if lg is fwd_log else "bwd"
                assert at(lg, ("post", i + 1)) < at(lg, (kind, i)), (i, lg)
    assert 2 <= most[0] <= 4, most  # K and V of two stages at most
    for i in range(first, first + len(remote) - 1):
        if i in computes and i + 1 in computes:
            assert at(bwd_log, ("bwd", i)) < at(bwd_log, ("return", i)) < at(bwd_log, ("bwd", i + 1)) \
                < at(bwd_log, ("returned", i)), (i, bwd_log)
    expected = plan.expected_bytes(k, v, backward=True)
    assert plan.bytes_sent == expected, (plan.bytes_sent, expected)
    cache = dict(plan._cache)
    with torch.no_grad():
        sfd.attention(q, k, v, plan, backend="reference")
    assert plan._cache.keys() == cache.keys() and all(plan._cache[x] is cache[x] for x in cache)


def _check_dropout(rank, w):
    """With dropout (one-block stages, float64, reference): the backward regenerates each stage's bits, so the
    gradients are the forward's derivative (central differences along a random direction agree)."""
    n, bs = 200, 32
    plan = sfd.plan(n, None, causal=True, block_size=bs, stage_tokens=bs)
    g = torch.Generator().manual_seed(0)
    q, k, v, go, dq, dk, dv = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(7))

    def loss(qq, kk, vv, p=0.3):
        torch.manual_seed(11)  # the same bits at every call
        o = sfd.attention(plan.shard(qq), plan.shard(kk), plan.shard(vv), plan, dropout_p=p, backend="reference")
        return (plan.unshard(o) * go).sum()

    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    value = loss(qq, kk, vv)
    value.backward()
    grads = [qq.grad, kk.grad, vv.grad]
    for t in grads:
        dist.all_reduce(t)
    assert abs(float(value.detach()) - float(loss(q, k, v, p=0.0))) > 1e-3, "dropout changed nothing"
    eps = 1e-5
    with torch.no_grad():
        up, down = loss(q + eps * dq, k + eps * dk, v + eps * dv), loss(q - eps * dq, k - eps * dk, v - eps * dv)
        fd = (up - down) / (2 * eps)
    analytic = sum((gr * d).sum() for gr, d in zip(grads, (dq, dk, dv)))
    assert abs(float(fd) - float(analytic)) <= 1e-6 * max(1.0, abs(float(analytic))), (float(fd), float(analytic))


def _check_torch_bytes(rank, w):
    """The benchmark's count of what torch's context parallelism sends, on the collectives its attention module
    really holds: a ring step (permute) sends its input, an all-gather W - 1 times it; results pass through."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from sparseflash.experiments.bench.context_parallel import TorchBytes

    module = sys.modules[set_rotate_method.__module__]
    held = module.ft_c
    t = torch.arange(6, dtype=torch.float32) + 10 * rank
    with TorchBytes(module, w) as counted:
        ring = module._maybe_wait(module.ft_c.permute_tensor(t, [(r + 1) % w for r in range(w)], dist.group.WORLD))
        every = module._maybe_wait(module.ft_c.all_gather_single(t, 0, dist.group.WORLD))
    assert module.ft_c is held and counted.bytes == 24 + (w - 1) * 24
    assert torch.equal(ring, torch.arange(6.0) + 10 * ((rank - 1) % w))
    assert torch.equal(every, torch.cat([torch.arange(6.0) + 10 * r for r in range(w)]))


def _checks(rank, w):
    for case in _cases(w):
        _check_case(rank, w, *case)
    _check_bytes(rank, w)
    _check_pipeline(rank, w)
    if w == 2:
        _check_dropout(rank, w)
        _check_torch_bytes(rank, w)
        _check_errors(rank, w)
        _check_bad_input(rank, w)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_matches_one_process(world, tmp_path):
    run_ranks(_checks, world, tmp_path)


def test_plan_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="group: torch.distributed is not initialised"):
        sfd.plan(128, None)


def test_benchmark_script_smoke(tmp_path):
    """experiments/bench/context_parallel.py end to end on 2 gloo ranks at tiny sizes (its GPU run is the lead's)."""
    out = tmp_path / "cp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(29500 + os.getpid() % 1000), "-m", "experiments.bench.context_parallel",
           "--out", str(out), "--device", "cpu", "--backend", "reference", "--check-len", "200",
           "--dense-lens", "256", "--sparse-lens", "448", "--block", "32", "--heads", "2", "--dim", "16",
           "--window", "64", "--reps", "1", "--warmup", "0", "--one-gpu-max", "1000", "--stage-tokens", "64",
           "--profile"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "context_parallel.csv") as f:
        rows = list(csv.DictReader(f))
    checks = [r for r in rows if r["kind"] == "check"]
    assert {r["case"] for r in checks} == {"dense-causal", "documents", "butterfly"}
    assert all(r["passed"] == "True" for r in checks), checks
    cp = {r["case"]: r for r in rows if r["provider"] == "sparseflash-cp" and r["kind"] == "time"}
    assert set(cp) == {"dense-causal", "window", "documents", "butterfly"}
    for r in cp.values():
        assert float(r["ms"]) > 0 and float(r["fwd_ms"]) > 0 and r["sent_bytes"] == r["plan_bytes"], r
        assert float(r["work_max_over_mean"]) <= 1.1, r
        assert r["stage_tokens"] == "64" and r["peak_gib"] == r["extra_gib"] == "", r  # (no memory figures on CPU)
    assert not any(r["provider"].startswith("torch-cp") for r in rows)  # (CUDA only)
    # the A/B switch: the own stage through block lists again, its rows beside the default's
    res = subprocess.run(cmd[:cmd.index("--check-len")] + ["--skip-check", "--dense-lens", "256", "--sparse-lens", "",
                                                           "--block", "32", "--heads", "2", "--dim", "16", "--reps", "1",
                                                           "--warmup", "0", "--one-gpu-max", "0", "--own-stage-lists"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "context_parallel.csv") as f:
        both = {(r["provider"], r["case"]) for r in csv.DictReader(f) if r["kind"] == "time"}
    assert {("sparseflash-cp", "dense-causal"), ("sparseflash-cp-lists", "dense-causal")} <= both
    assert (out / "context_parallel.png").exists()
    for name in ("butterfly-448-cp-rank0.txt", "butterfly-448-cp-rank1.txt", "window-448-1gpu.txt"):
        assert "Self CPU" in (out / "profile" / name).read_text(), name  # a profiler table


def test_benchmark_rows_merge_and_plot(tmp_path):
    """A re-run replaces the rows it measures again and keeps the others; the figure draws time and memory
    of every provider and GPU count in the file."""
    from sparseflash.experiments.bench import context_parallel as cp

    base = {f: "" for f in cp.FIELDS}
    providers = ((4, "sparseflash-cp", 1.0, 0.5), (4, "torch-cp-alltoall", 2.0, 0.9), (1, "sparseflash-1gpu", 3.0, 0.2))
    rows = [dict(base, kind="time", case="dense-causal", seq_len=n, world=w, provider=p, ms=ms, extra_gib=gib,
                 gpu="H200", commit="abc") for n in (1024, 2048) for w, p, ms, gib in providers]
    path = str(tmp_path / "cp.csv")
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, cp.FIELDS)
        wr.writeheader()
        wr.writerows(rows)
    again = [dict(rows[0], ms=0.5), dict(rows[0], world=8, ms=0.3)]
    table = cp.merge(path, again)
    ours = [r["ms"] for r in table if str(r["seq_len"]) == "1024" and r["provider"] == "sparseflash-cp"]
    assert len(table) == 7 and ours == [0.5, 0.3]
    cp.plot(table, tmp_path / "cp.png")
    assert (tmp_path / "cp.png").stat().st_size > 0


def _predicate_cases():
    g = torch.Generator().manual_seed(3)
    window = BlockMask.from_fn(lambda b, h, q, k: (k <= q) & (q - k < 45), 333, block_size=32)
    per_head = BlockMask.from_layout(torch.rand(2, 3, 11, 11, generator=g) < 0.4, 32, 333)
    sorted_ids = _docs([100, 7, 20, 150, 3, 53])
    shuffled = torch.randint(0, 4, (2, 333), generator=g)  # two batch rows, ids in no order
    return {
        "dense": {}, "causal": {"causal": True}, "window": {"mask": window},
        "per-head-causal": {"mask": per_head, "causal": True},
        "docs-causal": {"causal": True, "segment_ids": sorted_ids[None]},
        "docs-window": {"mask": window, "segment_ids": sorted_ids[None]},
        "shuffled-ids": {"segment_ids": shuffled}, "shuffled-ids-causal-mask": {"segment_ids": shuffled,
                                                                               "mask": per_head, "causal": True},
    }


@pytest.mark.parametrize("name", list(_predicate_cases()))
def test_plan_predicate_is_the_token_level_truth(name):
    """The plan's block predicate (intervals, and a dense part only where a layout or unordered ids need one)
    against the token-level truth: every attended pair lies in an on block, every full block is attended
    whole, and with ordered ids no on block is empty; work and needed blocks equal the dense evaluation's."""
    kw = _predicate_cases()[name]
    n, bs, w = 333, 32, 3
    nb = 11
    per = math.ceil(nb / w)
    pred = sfd._Predicate(n, bs, w * per, kw.get("mask"), kw.get("causal", False), kw.get("segment_ids"))
    assert pred.dense == ("mask" in kw or name.startswith("shuffled"))
    rows = torch.arange(w * per)
    on, full = pred.rows(rows, full=True)
    # the truth, token by token, padded to the plan's blocks
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    t = torch.ones(1, 1, n, n, dtype=torch.bool)
    if kw.get("causal"):
        t = t & (j <= i)
    if "mask" in kw:
        t = t & kw["mask"].to_dense(exact=True)
    if "segment_ids" in kw:
        ids = kw["segment_ids"]
        t = t & (ids[:, None, :, None] == ids[:, None, None, :])
    pad = w * per * bs - n
    real = torch.nn.functional.pad(torch.ones(n, n, dtype=torch.bool), (0, pad, 0, pad))
    tiles = torch.nn.functional.pad(t, (0, pad, 0, pad)).unflatten(-1, (-1, bs)).unflatten(-3, (-1, bs))
    some = tiles.any(-1).any(-2)  # [B, H, nbp, nbp]
    whole = (tiles | ~real.unflatten(-1, (-1, bs)).unflatten(-3, (-1, bs))).all(-1).all(-2) & some
    on, full = torch.broadcast_tensors(on, full, some)[:2]
    assert not (some & ~on).any(), "an attended pair outside the on blocks"
    assert not (full & ~whole).any(), "a full block with a pair not attended"
    if not name.startswith("shuffled"):
        assert torch.equal(on, some.expand_as(on)), "an on block with no attended pair"
    # work and needed: the interval arithmetic (or the single pass) against the rows evaluated whole
    assert torch.equal(pred.row_work(), pred.rows(rows).sum(dim=(0, 1, 3)))
    owners = [torch.arange(w * per) // per, torch.randperm(w * per, generator=torch.Generator().manual_seed(1)) % w]
    for o, need in zip(owners, pred.needed(owners, w)):
        expect = torch.stack([pred.rows(rows[o == r]).any(dim=(0, 1, 2)) for r in range(w)])
        assert torch.equal(need, expect)


def test_place_one_million_tokens_quickly():
    """The layout half of a plan for 1M tokens, causal, 4 ranks: zig-zag, balanced, the blocks each rank
    needs, in well under 2 s (the dense [nb, nb] grids before took 3.8-13.6 s)."""
    import time

    t0 = time.perf_counter()
    lay = sfd.place(1 << 20, 4, causal=True, block_size=128)
    took = time.perf_counter() - t0
    assert lay["placement"] == "zigzag" and len(set(lay["work"])) == 1
    half = 1024  # 8192 blocks, 4 ranks: chunks of 1024
    assert lay["owned"][1] == list(range(half, 2 * half)) + list(range(6 * half, 7 * half))
    # rank 1 (chunks 1 and 6 of 8) needs chunks 0..6: chunk 0 of rank 0 (not 7), both of its own, of 2 and of 3
    assert [len(x) for x in lay["needed"][1]] == [half, 2 * half, 2 * half, 2 * half]
    assert took < 2.0, f"place took {took:.2f} s"
