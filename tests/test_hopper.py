"""The Hopper forward (sparseflash/flash/hopper/forward.py) and the one-pass backward (hopper_bwd.py):
compiled for sm_90 on any machine, checked against the float64 reference on an H100 through the
public API (outputs and gradients; the GPU tests run the backward on block lists too)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

import sparseflash
from sparseflash.flash import dispatch, tiles
from sparseflash.flash.hopper import backward as hopper_bwd, forward as hopper
from sparseflash.patterns import butterfly, random as random_mask

from _attn_check import check_attention, make_qkv
from _hopper import gluon_hopper_available, ptxas_available
from conftest import HAS_CUDA

SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


# ----------------------------------------------------------------------------- any machine
@pytest.fixture(scope="module")
def sm90_compiles():
    """compile_check's rows for the forward and the backward, from one child process (outside the
    interpreter, which the test session may run under) that calls its main for each kernel in turn,
    so torch and triton start once: {"rows": {kernel: rows}, "stdout": ..., "stderr": ...}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys\nfrom sparseflash.experiments.studies.hopper.compile_check import main\n"
            "for kernel in ('fwd', 'bwd'):\n"
            "    print('kernel', kernel, flush=True)\n"
            "    main(['--kernel', kernel, '--json', '--seq', '300', '--head-dims', '64', '128', '--cases', 'dense',\n"
            "          'sparse256 causal', 'exact256 causal+keylen', '--exact'])\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    rows, kernel = {}, None
    for line in out.stdout.splitlines():
        if line.startswith("kernel "):
            kernel = line.split()[1]
        elif line.startswith("["):  # the rows of the kernel's main, printed last
            rows[kernel] = json.loads(line)
    return {"rows": rows, "stdout": out.stdout, "stderr": out.stderr}


@pytest.mark.skipif(not (ptxas_available() and gluon_hopper_available()), reason="needs ptxas and gluon's hopper module")
@pytest.mark.parametrize("kernel, consumer_regs", [("fwd", "232"), ("bwd", "240")])
def test_compiles_for_sm90(kernel, consumer_regs, sm90_compiles):
    """The forward and the one-pass backward build for sm_90 with this machine's triton (in a
    subprocess: the test session may run under the interpreter), at head_dim 64 and 128: wgmma
    and TMA loads, registers handed to the consumer warpgroups with setmaxnreg (232 each in the
    forward, 160 with three warpgroups at head_dim 64 without lists, 240 in the backward), within the 227 KB of shared memory; also with exact-mask bits
    (EXACT)."""
    out = sm90_compiles
    assert kernel in out["rows"], out["stderr"][-3000:]
    rows = out["rows"][kernel]
    cases = ["dense", "sparse256 causal", "exact256 causal+keylen"]
    assert [r["case"] for r in rows] == cases * 2 and all(r["status"] == "ok" for r in rows), out["stdout"][-3000:]
    for r in rows:
        assert r["wgmma"] > 0 and r["tma_loads"] > 0, r
        three = kernel == "fwd" and r["head_dim"] == 64 and r["case"] == "dense"  # three consumer warpgroups
        assert (str(hopper.CONSUMER_REGS_3) if three else consumer_regs) in r["setmaxnreg"].split("/"), r
        assert r["shared"] <= 227 * 1024, r
        if kernel == "bwd":  # dK / dV by TMA store on every walk (causal ones in two loops)
            assert r["tma_stores"] > 0, r


@pytest.mark.skipif(not (ptxas_available() and gluon_hopper_available()), reason="needs ptxas and gluon's hopper module")
def test_named_turns_build_for_sm90(tmp_path):
    """The forward's study switch `named_turns` builds for sm_90 (two ping-pong warpgroups: d=128, block
    lists) without spills, meeting hardware named barriers 14 and 15 with 256 threads in pairs (an arrive
    by one warpgroup for each sync by the other, plus warpgroup 1's first pass and warpgroup 0's last
    wait), and the default build uses neither id: Triton's own barriers must keep off them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys\nfrom sparseflash.flash.hopper import forward\n"
            "from sparseflash.experiments.studies.hopper.compile_check import main\n"
            f"for named, out in ((False, {str(tmp_path / 'default')!r}), (True, {str(tmp_path / 'named')!r})):\n"
            "    forward.OVERRIDES['named_turns'] = named\n"
            "    main(['--kernel', 'fwd', '--json', '--seq', '300', '--head-dims', '128', '--cases', 'sparse256 causal',\n"
            "          '--dump', out])\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2 and all(r[0]["status"] == "ok" and r[0]["local"] == 0 for r in rows), out.stderr[-3000:]
    ptx = {k: (tmp_path / k / "fwd_d128_sparse256_causal.ptx").read_text() for k in ("default", "named")}
    ids = re.compile(r"\bbar(?:rier)?\.(?:sync|arrive)(?:\.\w+)*\s+(\d+)")
    found = set(ids.findall(ptx["default"]))
    assert {"0", "1"} <= found and not {"14", "15"} & found, found
    named = {k.replace(" ", "_"): len(re.findall(rf"bar\.{k}, 256;", ptx["named"])) for k in
             ("sync 14", "arrive 14", "sync 15", "arrive 15")}
    assert named["sync_15"] == named["arrive_15"] > 0 and named["sync_14"] == named["arrive_14"] == named["sync_15"] + 1, named


@pytest.mark.skipif(not (ptxas_available() and gluon_hopper_available()), reason="needs ptxas and gluon's hopper module")
def test_dynamic_schedule_builds_for_sm90(tmp_path):
    """The forward's dynamic schedule builds for sm_90 without spills (three consumer warpgroups at d=64,
    two at d=128), with one lane of the loader warp taking each next tile and one resetting the counters
    (atomic adds and exchanges), and the static build has no atomics."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys\nfrom sparseflash.flash.hopper import forward\n"
            "from sparseflash.experiments.studies.hopper.compile_check import main\n"
            f"for dyn, out in ((False, {str(tmp_path / 'static')!r}), (True, {str(tmp_path / 'dynamic')!r})):\n"
            "    forward.OVERRIDES['dynamic'] = dyn\n"
            "    main(['--kernel', 'fwd', '--json', '--seq', '300', '--cases', 'causal+keylen', '--dump', out])\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2 and all(len(r) == 2 and all(x["status"] == "ok" and x["local"] == 0 for x in r) for r in rows), \
        out.stderr[-3000:]
    for d in (64, 128):
        ptx = {k: (tmp_path / k / f"fwd_d{d}_causal+keylen.ptx").read_text() for k in ("static", "dynamic")}
        assert "atom." not in ptx["static"]
        atoms = re.findall(r"atom\.global\.gpu\.acq_rel\.(add|exch)", ptx["dynamic"])
        assert sorted(atoms) == ["add", "add", "exch", "exch"], atoms


def test_dynamic_schedule_sections():
    """Causal sections (`section`): the heads whose K and V make SECTION_BYTES on short walks; all heads at
    once (None) on walks longer than SECTION_MAX_TILES q tiles or when one section would hold them all."""
    mb = 1 << 20
    assert hopper.SECTION_BYTES == 16 * mb and hopper.SECTION_MAX_TILES == 32
    assert hopper.section(64, 32, 4096, 128, 2, 1) == 8  # 2 MB of K and V a head
    assert hopper.section(64, 22, 4096, 64, 2, 1) == 16
    assert hopper.section(64, 32, 4096, 128, 2, 4) == 32  # GQA: four heads share one K / V
    assert hopper.section(16, 128, 16384, 128, 2, 1) is None  # long walks
    assert hopper.section(8, 32, 4096, 128, 2, 1) is None  # one section would hold every head
    assert hopper.section(4, 8, 1 << 20, 128, 2, 1) == 1


def test_dynamic_switch_named(monkeypatch):
    """A schedule switch value that does not exist is refused by name."""
    monkeypatch.setattr(hopper, "DYNAMIC", "sometimes")
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="SPARSEFLASH_HOPPER_DYNAMIC"):
        hopper.unsupported(q, q, q)


def test_bwd_study_overrides_named(monkeypatch):
    """A study override the backward does not know is refused by name before anything runs."""
    q = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 128)
    monkeypatch.setitem(hopper_bwd.OVERRIDES, "causal_spilt", True)
    with pytest.raises(ValueError, match=r"OVERRIDES takes the keys \('q_step', 'dkdv_tma', 'causal_split', 'grid_all', "
                                         r"'dp_zero'\), got \['causal_spilt'\]"):
        hopper_bwd.bwd(q, q, q, q, q, lse, None, None, None, 0.125, False, None, None, None, None)


def test_ptx_same_verdicts():
    """one_interface.ptx_same: PTX that differs only in debug information, labels and its
    parameters' names and order is "same"; the same instructions in another order with registers
    renumbered "reordered"; another instruction or operand "differs"."""
    from sparseflash.experiments.studies.one_interface.ptx_same import normalised, verdict

    old = ("\t.entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1\n)\n{\n"
           "\tld.param.u32 \t%r1, [k_param_1];\n$L__tmp3:\n\tadd.s32 \t%r2, %r1, 1;\n"
           "\tmul.lo.s32 \t%r3, %r1, 7;\n\tret;\n}\n\t.section\t.debug_info\n\t.b8 1\n")
    renamed = old.replace("k_param_1", "k_param_9").replace("$L__tmp3", "$L__tmp8").replace(".b8 1", ".b8 7")
    swapped = old.replace("\tadd.s32 \t%r2, %r1, 1;\n\tmul.lo.s32 \t%r3, %r1, 7;",
                          "\tmul.lo.s32 \t%r2, %r1, 7;\n\tadd.s32 \t%r3, %r1, 1;")
    n = normalised
    assert verdict(n(old), n(renamed)) == "same"
    assert verdict(n(old), n(swapped)) == "reordered"
    assert verdict(n(old), n(old.replace("mul.lo.s32", "mul.hi.s32"))) == "differs"
    assert verdict(n(old), n(old.replace(", 7;", ", 8;"))) == "differs"


def test_bwd_choice(monkeypatch):
    """The backward runs walks without block lists by default (MODE "auto"), and block-sparse walks
    whose column lists are long enough (`LIST_MIN_BLOCKS`; shorter ones keep the portable backward,
    faster there), all of them with "on", none with "off"; the value is checked, CPU calls never
    take it, and dO needs a layout descriptors take."""
    assert hopper_bwd.MODE in ("auto", "on", "off")
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    assert dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0) is None
    assert hopper_bwd.do_layout(q) is not None
    assert hopper_bwd.do_layout(q.transpose(2, 3)) is None
    assert hopper_bwd.unsupported(q, q, q, q) == "not an sm_90 GPU"
    monkeypatch.setattr(dispatch, "fwd_layouts", lambda *a: "lay")  # as if on an sm_90 GPU
    monkeypatch.setattr(hopper_bwd, "MODE", "off")
    assert dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0) is None
    monkeypatch.setattr(hopper_bwd, "MODE", "on")
    assert dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, -1.0, True) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.bwd_layouts(q.float(), q, q, q, q, None, None, -1.0) is None  # dO dtype differs
    monkeypatch.setattr(hopper_bwd, "MODE", "auto")
    assert dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, -1.0, True) is None  # unknown list length: portable
    # block lists: this kernel once a key tile's column holds LIST_MIN_BLOCKS q blocks of 128 rows on average
    B, H, N, D = q.shape
    per_block = 4.0 * B * H * N * D * hopper.TILE  # the work of one 128-row q block in every column
    long_lists = per_block * hopper_bwd.LIST_MIN_BLOCKS
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, long_lists, True) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, long_lists * 0.99, True) is None
    # ... except for calls with exact-mask bits, whatever their lists' length
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, long_lists * 0.1, True, True) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, -1.0, True, True) == ("lay", hopper_bwd.do_layout(q))
    monkeypatch.setattr(hopper_bwd, "LIST_MIN_BLOCKS", 0.5)
    assert dispatch.bwd_layouts(q, q, q, q, q, 128, 128, per_block * 0.5, True) == ("lay", hopper_bwd.do_layout(q))
    # dQ's reductions add in arrival order: deterministic algorithms keep the portable backward
    torch.use_deterministic_algorithms(True)
    try:
        assert dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0) is None
        assert "deterministic" in hopper_bwd.do_unsupported(q, q)
    finally:
        torch.use_deterministic_algorithms(False)
    # ... and so does a call that asks for a deterministic backward, whatever the global switch
    monkeypatch.setattr(dispatch, "fwd_layouts", lambda *a: "lay")
    assert dispatch.hopper_plan(q, q, q, None, None, -1.0, scale=0.1, do=q, o=q) == ("lay", hopper_bwd.do_layout(q))
    assert dispatch.hopper_plan(q, q, q, None, None, -1.0, scale=0.1, do=q, o=q, deterministic=True) is None
    assert dispatch.hopper_plan(q, q, q, None, None, -1.0, scale=0.1, deterministic=True) == "lay"  # forward: no atomics
    monkeypatch.setattr(hopper_bwd, "MODE", "fast")
    with pytest.raises(ValueError, match="SPARSEFLASH_HOPPER_BWD"):
        dispatch.bwd_layouts(q, q, q, q, q, None, None, -1.0)


def test_list_threshold_per_gpu(monkeypatch):
    """The column length from which block lists take the one-pass backward: the GPU's measured
    value where one is recorded (H200), the default elsewhere and on CPU tensors."""
    assert hopper_bwd.list_min_blocks(torch.device("cpu")) == hopper_bwd.LIST_MIN_BLOCKS
    monkeypatch.setattr(hopper_bwd, "gpu_name", lambda i: "NVIDIA H200")
    assert hopper_bwd.list_min_blocks(torch.device("cuda", 0)) == hopper_bwd.LIST_MIN_BLOCKS_BY_GPU["H200"] == 4.0
    monkeypatch.setattr(hopper_bwd, "gpu_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert hopper_bwd.list_min_blocks(torch.device("cuda", 0)) == hopper_bwd.LIST_MIN_BLOCKS


def test_unsupported_reasons(monkeypatch):
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    assert hopper.unsupported(q, q, q) == "not an sm_90 GPU"
    monkeypatch.setattr(hopper, "MODE", "off")
    assert hopper.unsupported(q, q, q) == "SPARSEFLASH_HOPPER=off"
    monkeypatch.setattr(hopper, "MODE", "fast")
    with pytest.raises(ValueError, match="SPARSEFLASH_HOPPER"):
        hopper.unsupported(q, q, q)


def test_bwd_delta_padding(device):
    """The backward's delta pass (a Triton kernel, so it runs under the interpreter too): the
    accumulators' starts -LSE / scale and -(rowsum(dO * O) - dLSE), padded with -inf and 0 to the rows
    a walk can visit."""
    g = torch.Generator().manual_seed(0)
    o, do = (torch.randn(2, 3, 70, 32, generator=g).to(device) for _ in range(2))
    lse, dlse = (torch.randn(2, 3, 70, generator=g).to(device) for _ in range(2))
    acc = torch.full((6 * 128 * 32,), float("nan"), device=device)  # the dQ sums (n_pad rows), zeroed by the same launch
    lse2, delta = hopper_bwd.delta_rows(o, do, lse, dlse, 128, 1 / 0.125, acc)
    assert (acc == 0).all()
    assert lse2.shape == delta.shape == (6, 128)
    want = ((o.double() * do.double()).sum(-1) - dlse.double()).reshape(6, 70)
    torch.testing.assert_close(-delta[:, :70].double(), want, rtol=1e-5, atol=1e-5)  # (stored negated: the starts)
    torch.testing.assert_close(-lse2[:, :70].double(), lse.double().reshape(6, 70) / 0.125, rtol=1e-6, atol=1e-6)
    assert torch.isinf(lse2[:, 70:]).all() and (lse2[:, 70:] < 0).all()
    assert (delta[:, 70:] == 0).all()
    with pytest.raises(ValueError, match=r"acc must be a contiguous float32 tensor of B \* H \* n_pad \* D = 24576"):
        hopper_bwd.delta_rows(o, do, lse, dlse, 128, 1 / 0.125, acc[:-32])
    assert torch.equal(hopper_bwd.delta_rows(o, do, lse, None, 128, 1 / 0.125)[0], lse2)  # (no acc: the same rows)
    # the rows a walk visits: 64-row steps when dense, whole mask blocks with lists
    assert [hopper_bwd.padded_rows(n, bq, 64) for n, bq in [(1050, None), (1050, 128), (1000, 256), (1024, 128)]] == [
        1088, 1152, 1024, 1024]


@pytest.mark.parametrize("n", [32, 64, 128])
def test_bwd_dq_order_and_cast(device, n):
    """The float32 dQ sums hold each warpgroup's [64, n] share of a step whole, in `dq_order` (the
    order the Gluon kernel stages and adds them in: offset bit i is coordinate dq_order(n)[i]); the
    cast kernel (Triton, so it runs under the interpreter too) reads them back into dQ's rows."""
    bases = hopper_bwd.dq_order(n)
    assert sorted(bases) == sorted([(1 << i, 0) for i in range(6)] + [(0, 1 << i) for i in range(n.bit_length() - 1)])
    with pytest.raises(ValueError, match="n must be 32, 64 or 128 columns, got 16"):
        hopper_bwd.dq_order(16)
    B, H, N, D, n_pad = 2, 3, 100, {32: 64, 64: 128, 128: 128}[n], 128  # (the shapes d 64 and 128 steps take)
    g = torch.Generator().manual_seed(0)
    sums = torch.randn(B, H, n_pad, D, generator=g)
    off = torch.arange(64 * n)
    r = sum(((off >> i) & 1) * br for i, (br, _) in enumerate(bases))
    c = sum(((off >> i) & 1) * bc for i, (_, bc) in enumerate(bases))
    # shares in order: (batch, head), 64-row group, column group; each share's floats in dq_order
    shares = sums.reshape(B, H, n_pad // 64, 64, D // n, n).permute(0, 1, 2, 4, 3, 5)[..., r, c]
    acc = shares.contiguous().reshape(-1).to(device)
    dq = torch.empty(B, N, H, D, device=device).transpose(1, 2)  # [B, N, H, D] memory; float32: exact
    sq = dq.stride()
    hopper_bwd.dq_cast_kernel[(triton.cdiv(N, hopper_bwd.CAST_ROWS), B * H)](
        acc, dq, sq[0], sq[1], sq[2], H, N, n_pad, 0.5, HEAD_DIM=D, BLOCK=hopper_bwd.CAST_ROWS, DQ_N=n)
    assert torch.equal(dq.cpu(), sums[:, :, :N] * 0.5)


def test_layouts():
    """[B, H, N, D] memory and [B, N, H, D] memory (a transposed view) take descriptors, read in
    their own dimension order; a last dimension that is not contiguous, 16-byte misaligned
    strides, or K and V in different orders do not."""
    x = torch.zeros(2, 3, 40, 64, dtype=torch.bfloat16)
    t = torch.zeros(2, 40, 3, 64, dtype=torch.bfloat16).transpose(1, 2)
    (sq, bq), (sk, bk), _ = hopper.layouts(x, t, t)
    assert (sq, bq) == ((3 * 40 * 64, 40 * 64, 64, 1), False) and (sk, bk) == ((40 * 3 * 64, 3 * 64, 64, 1), True)
    assert hopper.layouts(x, x, t) is None  # K and V in different orders
    assert hopper.layouts(x.transpose(2, 3), x, x) is None
    odd = torch.zeros(2, 3, 40, 68, dtype=torch.bfloat16)[..., :64]  # row stride 136 bytes
    assert hopper.layouts(odd, x, x) is None


def test_cpu_calls_never_take_it(monkeypatch, device):
    """Descriptor loads on CPU (the interpreter, TMA_MODE on) keep the portable forward."""
    if device != "cpu":
        pytest.skip("a CPU run")
    monkeypatch.setattr(tiles, "TMA_MODE", "on")
    called = []
    monkeypatch.setattr(hopper, "fwd", lambda *a, **k: called.append(1))
    q = torch.randn(1, 1, 32, 16)
    assert dispatch.fwd_layouts(q, q, q, None, None, -1.0) is None
    assert not called


# ----------------------------------------------------------------------------- sm_90 GPU
def _count_calls(monkeypatch, module, name):
    """Wrap ``module.name`` to record each call's first argument's shape; returns the list."""
    calls = []
    real = getattr(module, name)

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def hopper_spy(monkeypatch):
    """Every call takes descriptors (so small shapes reach the kernel); counts the Hopper forwards."""
    from sparseflash.flash import fast

    monkeypatch.setattr(tiles, "TMA_MODE", "on")
    monkeypatch.setattr(fast, "ENABLED", False)
    return _count_calls(monkeypatch, hopper, "fwd")


@pytest.fixture
def hopper_bwd_spy(monkeypatch):
    """Turns the Hopper backward on for every walk, block lists included (taken where the Hopper
    forward is, see `hopper_spy`), and counts its calls."""
    monkeypatch.setattr(hopper_bwd, "MODE", "on")
    return _count_calls(monkeypatch, hopper_bwd, "bwd")


def _mask(kind, n, nk=None):
    if kind == "dense":
        return None
    if kind == "random128":
        return random_mask(n, 3, block_size=128, seq_k=nk, heads=2, seed=1, device="cuda")
    if kind == "random256":
        return random_mask(n, 2, block_size=256, seq_k=nk, seed=2, device="cuda")
    if kind == "butterfly":
        return butterfly(n, block_size=128, device="cuda")
    raise ValueError(kind)


CASES = [  # (B, Hq, Hkv, Nq, Nk, D, mask, causal, key_lengths)
    (2, 2, 2, 512, 512, 64, "dense", False, None),
    (2, 2, 2, 512, 512, 128, "dense", False, None),
    (1, 2, 2, 1000, 1000, 128, "dense", True, None),        # tails, causal
    (1, 2, 2, 384, 700, 64, "dense", True, None),           # bottom-right causal, seq_q < seq_k
    (1, 2, 2, 700, 384, 128, "dense", True, None),          # seq_q > seq_k: the first rows see no key
    (2, 4, 2, 640, 640, 64, "dense", False, [640, 77]),      # GQA, key_lengths
    (2, 2, 2, 512, 512, 128, "dense", False, [0, 300]),      # a batch with no keys: O = 0
    (2, 2, 2, 1024, 1024, 64, "random128", False, None),     # per-head lists
    (1, 2, 2, 1000, 1000, 128, "random128", True, [900]),    # list walk with tails, causal, key_lengths
    (2, 2, 2, 1024, 1024, 128, "random256", False, None),    # 256 blocks: two steps per list entry
    (1, 2, 2, 1050, 1050, 128, "random128", False, None),    # the last block's 2nd step starts past row 1050
    (1, 2, 2, 2048, 2048, 64, "butterfly", False, None),
    (2, 16, 16, 2048, 2048, 64, "dense", True, None),        # 512 tiles over 132 CTAs: phases wrap many times
    # d=64 without lists: 192-row tiles on three consumer warpgroups; tails that are not a multiple of 192
    (1, 2, 2, 700, 384, 64, "dense", True, None),           # seq_q > seq_k: a whole 192-row tile sees no key
    (2, 4, 1, 1000, 1000, 64, "dense", False, [0, 500]),     # GQA 4:1, a batch with no keys, key_lengths in a tile
    (1, 2, 2, 193, 1100, 64, "dense", True, [1000]),          # one row past a tile, bottom-right causal, key_lengths
]


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-d{c[5]}-{c[6]}"
                         f"{'-causal' if c[7] else ''}{'-kl' if c[8] else ''}")
def test_gpu_against_reference(case, dtype, hopper_spy, hopper_bwd_spy):
    B, Hq, Hkv, Nq, Nk, D, kind, causal, kl = case
    q, k, v, do = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, "cuda", seed=Nq + D)
    mask = _mask(kind, Nq, Nk if Nk != Nq else None)
    key_lengths = None if kl is None else torch.tensor(kl, device="cuda")
    check_attention(lambda a, b, c: sparseflash.attention(a, b, c, mask=mask, causal=causal, key_lengths=key_lengths),
                    q, k, v, do, mask=mask, causal=causal, key_lengths=key_lengths)
    assert hopper_spy, "the Hopper forward did not run"
    assert hopper_bwd_spy, "the Hopper backward did not run"
    if kl is not None and 0 in kl:
        o = sparseflash.attention(q, k, v, mask=mask, causal=causal, key_lengths=key_lengths)
        assert o[kl.index(0)].abs().max().item() == 0.0


def _exact_mask(kind, n):
    from sparseflash import BlockMask

    if kind == "window":  # causal sliding window of 300 over 128-blocks
        return BlockMask.from_fn(lambda b, h, i, j: (i >= j) & (i - j < 300), n, block_size=128, device="cuda")
    if kind == "documents":  # document ids over 256-blocks (two steps per list entry)
        doc = torch.cumsum(torch.rand(n, generator=torch.Generator().manual_seed(5)) < 0.004, 0).to("cuda")
        return BlockMask.from_fn(lambda b, h, i, j: doc[i] == doc[j], n, block_size=256, device="cuda")
    if kind == "tokens":  # a random token mask per head with fully masked rows
        g = torch.Generator().manual_seed(6)
        tok = torch.rand(1, 2, n, n, generator=g) < 0.05  # [B, H, N, N]
        tok[:, :, 100:140] = False
        return BlockMask.from_dense(tok.to("cuda"), block_size=128)
    raise ValueError(kind)


EXACT_CASES = [  # (B, Hq, Hkv, N, D, mask, causal, key_lengths, dtype)
    (1, 2, 2, 1000, 64, "window", False, None, torch.bfloat16),
    (2, 4, 2, 1050, 128, "documents", False, [1050, 900], torch.float16),
    (1, 2, 2, 640, 64, "tokens", False, None, torch.bfloat16),
    (1, 2, 1, 1000, 128, "window", True, [777], torch.bfloat16),
]


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}-d{c[4]}-{c[5]}"
                         f"{'-causal' if c[6] else ''}{'-kl' if c[7] else ''}-{str(c[8])[6:]}")
def test_gpu_exact_bits_against_reference(case, monkeypatch, hopper_spy, hopper_bwd_spy):
    """The Hopper kernels with exact-mask bits (HOPPER_EXACT on): output and gradients against the
    float64 reference on the mask's exact pairs; rows a token mask leaves empty give 0."""
    monkeypatch.setattr(dispatch, "HOPPER_EXACT", "on")
    B, Hq, Hkv, N, D, kind, causal, kl, dtype = case
    q, k, v, do = make_qkv(B, Hq, Hkv, N, N, D, dtype, "cuda", seed=N + D)
    mask = _exact_mask(kind, N)
    assert mask.exact_bits("cuda") is not None
    key_lengths = None if kl is None else torch.tensor(kl, device="cuda")
    check_attention(lambda a, b, c: sparseflash.attention(a, b, c, mask=mask, causal=causal, key_lengths=key_lengths),
                    q, k, v, do, mask=mask, causal=causal, key_lengths=key_lengths, ref_kwargs=dict(exact=True))
    assert hopper_spy, "the Hopper forward did not run"
    assert hopper_bwd_spy, "the Hopper backward did not run"
    if kind == "tokens":
        o = sparseflash.attention(q, k, v, mask=mask)
        assert o[:, :, 100:140].abs().max().item() == 0.0


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_layouts_and_lse(hopper_spy):
    """[B, N, H, D] memory (a transposed view), and the LSE against the reference's; rows with no
    key give -inf through the API."""
    B, H, N, D = 2, 4, 768, 128
    base = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    q = base.transpose(1, 2)
    k = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kl = torch.tensor([0, 500], device="cuda")
    o, lse = sparseflash.attention(q, k, v, key_lengths=kl, return_lse=True)
    assert hopper_spy
    o_ref, lse_ref = sparseflash.attention(q.double(), k.double(), v.double(), key_lengths=kl, return_lse=True,
                                           backend="reference")
    assert (o.double() - o_ref).abs().max().item() < 2e-2
    assert torch.isneginf(lse[0]).all()
    assert (lse[1].double() - lse_ref[1]).abs().max().item() < 1e-3


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("bnhd", [False, True])
def test_gpu_register_store_epilogue(monkeypatch, hopper_spy, bnhd):
    """O through the registers-to-global stores (what an O layout without a descriptor gets:
    `hopper.o_layout` None) is bitwise the TMA-store epilogue's: a tail whose last tile's second
    half lies wholly past seq_q (1050), causal, GQA, key_lengths with a batch of no keys (O = 0),
    [B, H, N, D] and [B, N, H, D] memory."""
    B, Hq, Hk, N, D = 2, 4, 2, 1050, 128
    q, k, v = (torch.randn(*((B, N, h, D) if bnhd else (B, h, N, D)), device="cuda", dtype=torch.bfloat16)
               for h in (Hq, Hk, Hk))
    if bnhd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kl = torch.tensor([1050, 0], device="cuda")
    with torch.no_grad():
        o_tma = sparseflash.attention(q, k, v, causal=True, key_lengths=kl)
        monkeypatch.setattr(hopper, "o_layout", lambda o: None)
        o_st = sparseflash.attention(q, k, v, causal=True, key_lengths=kl)
    assert len(hopper_spy) == 2
    assert torch.equal(o_tma, o_st)
    assert o_st[1].abs().max().item() == 0.0
    o_ref = sparseflash.attention(q.double(), k.double(), v.double(), causal=True, key_lengths=kl, backend="reference")
    assert (o_st.double() - o_ref).abs().max().item() < 2e-2


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal, split", [(False, True), (True, True), (True, False)])
def test_gpu_bwd_dkdv_stores_agree(monkeypatch, hopper_spy, hopper_bwd_spy, causal, split):
    """dK and dV stored by TMA through the dQ staging buffers and stored from registers are bitwise
    equal (the same sums; only the epilogue differs), on causal walks in two loops (the default) and
    in one (a study's): a tail (1050), GQA, key_lengths with a batch of no keys, d 64 (128-row
    steps) and 128."""
    monkeypatch.setitem(hopper_bwd.OVERRIDES, "causal_split", split)
    for D in (64, 128):
        q, k, v, do = make_qkv(2, 4, 2, 1050, 1050, D, torch.bfloat16, "cuda", seed=D)
        kl = torch.tensor([1050, 0], device="cuda")
        got = []
        for tma in (True, False):
            monkeypatch.setitem(hopper_bwd.OVERRIDES, "dkdv_tma", tma)
            ts = [t.clone().requires_grad_() for t in (q, k, v)]
            got.append(torch.autograd.grad(sparseflash.attention(*ts, causal=causal, key_lengths=kl), ts, do))
        for a, b in zip(got[0][1:], got[1][1:]):
            assert torch.equal(a, b)
        assert got[0][1][1].abs().max().item() == 0.0  # no keys: dK = 0
        dq_a, dq_b = got[0][0].float(), got[1][0].float()  # dQ: float32 sums in arrival order, then bf16
        assert (dq_a - dq_b).abs().max() <= 2 * 2.0 ** -7 * dq_a.abs().max()
    assert len(hopper_bwd_spy) == 4


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bwd_grid_all_agrees(monkeypatch, hopper_spy, hopper_bwd_spy, causal):
    """A study's non-persistent backward grid (`grid_all`: one CTA a key tile, or a causal pair of
    them) gives the persistent grid's dK and dV bitwise, dQ within its float32 sum order, with more
    units than SMs (256 at 4096 tokens, 8 kv heads, 2 batches) so the two grids differ."""
    q, k, v, do = make_qkv(2, 8, 8, 4096, 4096, 128, torch.bfloat16, "cuda", seed=21)
    got = []
    for grid_all in (False, True):
        monkeypatch.setitem(hopper_bwd.OVERRIDES, "grid_all", grid_all)
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        got.append(torch.autograd.grad(sparseflash.attention(*ts, causal=causal), ts, do))
    for a, b in zip(got[0][1:], got[1][1:]):
        assert torch.equal(a, b)
    dq_a, dq_b = got[0][0].float(), got[1][0].float()
    assert (dq_a - dq_b).abs().max() <= 2 * 2.0 ** -7 * dq_a.abs().max()
    assert len(hopper_bwd_spy) == 2


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fwd_head_sections_agree(monkeypatch, hopper_spy, D):
    """A study's causal tile order in sections of (batch, head)s (`sec_heads`; 3 of 10, so the last
    section has one) and its grid of one CTA a tile (`one_tile`), alone and together, give the default
    order's output and LSE bitwise (each tile's sums are the same;
    only which CTA runs it, and when, changes), with more tiles than SMs."""
    q, k, v, _ = make_qkv(2, 5, 5, 4000, 4000, D, torch.bfloat16, "cuda", seed=D + 5)
    got = []
    for over in ({}, {"sec_heads": 3}, {"one_tile": True}, {"one_tile": True, "sec_heads": 3}):
        for key in hopper.OVERRIDE_KEYS:
            monkeypatch.delitem(hopper.OVERRIDES, key, raising=False)
        for key, value in over.items():
            monkeypatch.setitem(hopper.OVERRIDES, key, value)
        got.append(sparseflash.attention(q, k, v, causal=True, return_lse=True))
    for o, lse in got[1:]:
        assert torch.equal(got[0][0], o) and torch.equal(got[0][1], lse)
    assert len(hopper_spy) == 4


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("D, mask_on, causal", [(128, False, True), (128, False, False), (64, True, True), (128, True, False)])
def test_gpu_fwd_named_turns_agree(monkeypatch, hopper_spy, D, mask_on, causal):
    """A study's turns between the two ping-pong warpgroups by named barriers (`named_turns`) give the
    mbarrier turns' output and LSE bitwise (the turn orders issue only), over several persistent rounds
    (more tiles than SMs), an empty tile's walk (key lengths) and d=64 with block lists (two warpgroups)."""
    q, k, v, _ = make_qkv(3, 6, 3, 3000, 3000, D, torch.bfloat16, "cuda", seed=D + 9)
    kl = torch.tensor([3000, 1, 2048], device="cuda")
    mask = random_mask(3000, 4, block_size=128, heads=6, seed=5, device="cuda") if mask_on else None
    got = []
    for named in (False, True):
        if named:
            monkeypatch.setitem(hopper.OVERRIDES, "named_turns", True)
        else:
            monkeypatch.delitem(hopper.OVERRIDES, "named_turns", raising=False)
        got.append(sparseflash.attention(q, k, v, mask=mask, causal=causal, key_lengths=kl, return_lse=True))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert len(hopper_spy) == 2


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("D, mask_on, causal, groups", [(128, False, True, 6), (64, False, True, 3), (128, True, False, 6),
                                                        (64, True, True, 2), (128, False, False, 6)])
def test_gpu_fwd_dynamic_schedule_agrees(monkeypatch, hopper_spy, D, mask_on, causal, groups):
    """The dynamic schedule (each CTA takes its next tile from a counter) gives the static schedule's
    output and LSE bitwise, with causal sections of 1, 2 and all heads and of `section`'s size, over many
    more tiles than SMs, GQA, key lengths with an empty walk."""
    q, k, v, _ = make_qkv(3, 6, groups, 3000, 3000, D, torch.bfloat16, "cuda", seed=D + 13)
    kl = torch.tensor([3000, 1, 2048], device="cuda")
    mask = random_mask(3000, 4, block_size=128, heads=6, seed=7, device="cuda") if mask_on else None
    runs = [{"dynamic": False}, {"dynamic": True}, {"dynamic": True, "sec_heads": 1}, {"dynamic": True, "sec_heads": 2},
            {"dynamic": True, "sec_heads": None}]
    got = []
    for over in runs:
        for key in ("dynamic", "sec_heads"):
            monkeypatch.delitem(hopper.OVERRIDES, key, raising=False)
        for key, value in over.items():
            monkeypatch.setitem(hopper.OVERRIDES, key, value)
        for _ in range(2):  # (the second launch reads the counters the first left)
            got.append(sparseflash.attention(q, k, v, mask=mask, causal=causal, key_lengths=kl, return_lse=True))
    torch.cuda.synchronize()
    for o, lse in got[1:]:
        assert torch.equal(got[0][0], o) and torch.equal(got[0][1], lse)
    assert len(hopper_spy) == 2 * len(runs)


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("D, mask_on, causal", [(128, False, True), (64, False, False), (128, True, False), (64, True, True)])
def test_gpu_bwd_dp_zero_against_reference(monkeypatch, hopper_spy, hopper_bwd_spy, D, mask_on, causal):
    """The backward with dP^T started at zero and -delta added after its wgmma (the study switch
    `dp_zero`): gradients against the float64 reference, GQA, key lengths, block lists."""
    monkeypatch.setitem(hopper_bwd.OVERRIDES, "dp_zero", True)
    q, k, v, do = make_qkv(2, 4, 2, 1000, 1000, D, torch.bfloat16, "cuda", seed=D + 21)
    mask = random_mask(1000, 3, block_size=128, heads=4, seed=6, device="cuda") if mask_on else None
    kl = torch.tensor([1000, 611], device="cuda")
    check_attention(lambda a, b, c: sparseflash.attention(a, b, c, mask=mask, causal=causal, key_lengths=kl),
                    q, k, v, do, mask=mask, causal=causal, key_lengths=kl)
    assert hopper_bwd_spy, "the Hopper backward did not run"


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_bwd_64_row_steps_at_d64(monkeypatch, hopper_spy, hopper_bwd_spy):
    """The backward's 64-row steps at d=64 (`q_step`'s other size, which studies compare with the
    default 128-row steps): causal, GQA, key_lengths, a block list, against the float64 reference."""
    monkeypatch.setitem(hopper_bwd.OVERRIDES, "q_step", {64: 64})
    q, k, v, do = make_qkv(2, 4, 2, 1000, 1000, 64, torch.bfloat16, "cuda", seed=11)
    mask = random_mask(1000, 3, block_size=128, heads=4, seed=4, device="cuda")
    kl = torch.tensor([1000, 555], device="cuda")
    check_attention(lambda a, b, c: sparseflash.attention(a, b, c, mask=mask, causal=True, key_lengths=kl),
                    q, k, v, do, mask=mask, causal=True, key_lengths=kl)
    assert hopper_bwd_spy, "the Hopper backward did not run"


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_off_switch(monkeypatch, hopper_spy):
    monkeypatch.setattr(hopper, "MODE", "off")
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    sparseflash.attention(q, q, q)
    assert not hopper_spy


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_bwd_lse_grad_and_layouts(hopper_spy, hopper_bwd_spy):
    """The Hopper backward with a gradient on the LSE too (delta takes dLSE), GQA, key_lengths, a
    causal block list and [B, N, H, D] memory for q, k, v and dO: gradients within 2x PyTorch's
    error against the float64 reference."""
    from sparseflash import reference
    from _attn_check import assert_within_torch_error

    B, Hq, Hkv, N, D = 2, 4, 2, 1000, 128
    g = torch.Generator(device="cpu").manual_seed(7)
    q, do = (torch.randn(B, N, Hq, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, N, Hkv, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(2))
    w = torch.randn(B, Hq, N, generator=g).to("cuda")
    kl = torch.tensor([1000, 613], device="cuda")
    mask = random_mask(N, 3, block_size=128, heads=Hq, seed=3, device="cuda")

    def grads(fn, dtype):
        ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, lse = fn(*ts)
        loss = (o * do.to(o.dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w.to(lse.dtype)).sum()
        return torch.autograd.grad(loss, ts)

    kw = dict(mask=mask, causal=True, key_lengths=kl)
    got = grads(lambda a, b, c: sparseflash.attention(a, b, c, return_lse=True, **kw), torch.bfloat16)
    assert hopper_bwd_spy, "the Hopper backward did not run"
    ref = grads(lambda a, b, c: reference.attention(a, b, c, return_lse=True, **kw), torch.float64)
    pt = grads(lambda a, b, c: reference.attention(a, b, c, return_lse=True, compute_dtype=torch.bfloat16, **kw),
               torch.bfloat16)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, pt, ref):
        assert_within_torch_error(name, a, b, c, torch.bfloat16)


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_deterministic_algorithms_keep_the_portable_backward(monkeypatch, hopper_spy):
    """Under torch.use_deterministic_algorithms(True) a dense backward (which MODE "auto" gives
    the Hopper kernel, whose dQ reductions add in arrival order) runs the portable kernels, and two
    runs give bitwise equal gradients."""
    calls = _count_calls(monkeypatch, hopper_bwd, "bwd")
    q, k, v, do = make_qkv(2, 16, 16, 2048, 2048, 128, torch.bfloat16, "cuda", seed=5)

    def grads():
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(sparseflash.attention(*ts), ts, do)

    monkeypatch.setattr(hopper_bwd, "MODE", "auto")
    grads()
    assert calls, "MODE auto: the Hopper backward runs a dense call"
    calls.clear()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(False)
    assert not calls
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_deterministic_call_keeps_the_portable_backward(monkeypatch, hopper_spy):
    """``deterministic=True`` on one call runs that call's backward on the portable kernels (bitwise
    equal across runs), while the next call without it takes the Hopper backward again."""
    calls = _count_calls(monkeypatch, hopper_bwd, "bwd")
    monkeypatch.setattr(hopper_bwd, "MODE", "auto")
    q, k, v, do = make_qkv(2, 8, 8, 2048, 2048, 128, torch.bfloat16, "cuda", seed=6)

    def grads(**kw):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(sparseflash.attention(*ts, causal=True, **kw), ts, do)

    first, second = grads(deterministic=True), grads(deterministic=True)
    assert not calls
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    grads()
    assert calls, "without deterministic=True the Hopper backward runs the call"
