"""sparseflash.distributed on two GPUs over NCCL (skipped without two CUDA devices).

Two spawned ranks, one GPU each, run the context-parallel op in bf16 with the GPU kernels on the masks
that stress the plan (causal zig-zag with GQA, packed documents crossing the rank boundary, butterfly,
a causal window, rows that attend to nothing, per-head layouts), in stages short enough that every case
pipelines several. Each output and q/k/v gradient is compared with the float64 reference of the whole
sequence: its error must be at most twice the one-GPU bf16 call's plus 1e-3 (the benchmark's rule). Also:
the bytes sent are the plan's, rows with nothing to attend give exactly 0 (never NaN), and on NCCL a
rank whose input differs still makes every rank raise (the checks talk on a gloo group beside NCCL).
"""

import pytest
import torch
import torch.distributed as dist

import sparseflash.distributed as sfd
from sparseflash import BlockMask
from sparseflash.experiments.bench.context_parallel import one_gpu_call
from sparseflash.patterns import butterfly
from tests._ranks import run_ranks
from tests.test_distributed import _docs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs (NCCL)")


def _cases(dev):
    """(name, N, block, heads_q, heads_kv, d, plan kwargs)."""
    g = torch.Generator().manual_seed(3)
    window = BlockMask.from_fn(lambda b, h, q, k: (k <= q) & (q - k < 700), 3000, block_size=128, device=dev)
    empty = BlockMask.from_fn(lambda b, h, q, k: ((q - k).abs() < 500) & ~((q >= 900) & (q < 1300)) & (k < 2600),
                              2777, block_size=128, device=dev)  # rows 900..1299 attend nothing
    lay = torch.rand(1, 4, 20, 20, generator=g) < 0.3
    return [
        ("causal-N4096-gqa-d128", 4096, 128, 4, 2, 128, {"causal": True, "stage_tokens": 512}),
        ("causal-N3001-d64", 3001, 128, 2, 2, 64, {"causal": True, "stage_tokens": 256}),
        ("docs-causal-N3500", 3500, 128, 2, 1, 64,
         {"causal": True, "segment_ids": _docs([700, 40, 1100, 300, 1000, 360]), "stage_tokens": 384}),
        ("butterfly-N4096", 4096, 128, 2, 2, 128, {"mask": butterfly(4096, block_size=128, device=dev),
                                                    "stage_tokens": 512}),
        ("window700-causal-N3000", 3000, 128, 2, 2, 64, {"mask": window, "stage_tokens": 256}),
        ("empty-rows-N2777", 2777, 128, 2, 2, 64, {"mask": empty}),
        ("per-head-layout-N2560", 2560, 128, 4, 2, 64,
         {"mask": BlockMask.from_layout(lay.to(dev), 128, 2560), "causal": True, "stage_tokens": 256}),
    ]


def _check_case(rank, name, n, bs, hq, hk, d, kw, dev):
    g = torch.Generator().manual_seed(1234)  # the same tensors on every rank
    q, k, v, do = (torch.randn(1, h, n, d, generator=g).to(dev) for h in (hq, hk, hk, hq))
    want = {}
    for who, dtype, backend in (("ref64", torch.float64, "reference"), ("1gpu", torch.bfloat16, "auto")):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        o = one_gpu_call(qq, kk, vv, kw, backend)
        o.backward(do.to(dtype))
        want[who] = [o.detach().double(), qq.grad.double(), kk.grad.double(), vv.grad.double()]
    plan = sfd.plan(n, None, block_size=bs, **kw)
    qd, kd, vd = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    o = plan.unshard(sfd.attention(plan.shard(qd), plan.shard(kd), plan.shard(vd), plan))
    o.backward(do.to(torch.bfloat16))
    grads = [t.grad.float() for t in (qd, kd, vd)]
    for t in grads:
        dist.all_reduce(t)  # each rank holds its own rows' gradients
    got = [o.detach().double()] + [t.double() for t in grads]
    for what, a, r, one in zip(("out", "dq", "dk", "dv"), got, want["ref64"], want["1gpu"]):
        assert not torch.isnan(a).any(), f"{name}: {what} has NaN"
        err, err1 = float((a - r).abs().max()), float((one - r).abs().max())
        assert err <= 2 * err1 + 1e-3, f"{name} ({plan.placement}, rank {rank}): {what} error {err:.3g}, " \
                                       f"one GPU {err1:.3g}"
    if name.startswith("empty-rows"):
        assert torch.equal(o[:, :, 900:1300], torch.zeros_like(o[:, :, 900:1300])), name
    expected = plan.expected_bytes(plan.shard(kd.detach()), plan.shard(vd.detach()), backward=True)
    assert plan.bytes_sent == expected, (name, plan.bytes_sent, expected)
    assert plan.bytes_sent > 0 or name.startswith("docs"), name


def _check_mismatch(rank, dev):
    """On NCCL a rank whose heads differ makes both ranks raise (nobody waits in the exchange)."""
    plan = sfd.plan(1024, None, causal=True, block_size=128)
    q = plan.shard(torch.randn(1, 4, 1024, 64, device=dev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"the ranks disagree \(q_l heads: rank 0 4, rank 1 2\)"):
        sfd.attention(q if rank == 0 else q[:, :2], q[:, :2], q[:, :2], plan)
    o = sfd.attention(q, q[:, :2], q[:, :2], plan)  # and the group still works
    assert torch.isfinite(o).all()


def _gpu_checks(rank, w):
    dev = torch.device("cuda", rank)
    for case in _cases(dev):
        _check_case(rank, *case, dev)
    _check_mismatch(rank, dev)
    torch.cuda.synchronize(dev)


def test_two_gpus_match_the_float64_reference(tmp_path):
    run_ranks(_gpu_checks, 2, tmp_path, backend="nccl")
