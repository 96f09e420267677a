"""Tests of the studies' scripts (sparseflash.experiments.studies): the host-cost probes, the
warp-specialisation / TMA / Gluon probes (forward against the reference on CPU, Hopper compiles
where triton's ptxas is bundled), the short-rows plot and the fixed-cost fit on synthetic sweeps
with known answers. About 7 s on CPU."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparseflash.experiments.bench.results import write_results
from sparseflash.experiments.studies.short_rows.fixed_cost import fit_fixed_cost, main as fixed_cost_main

from _hopper import gluon_hopper_available, ptxas_available


# ----------------------------------------------------------------------------- host cost and probes
def test_host_cost_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from sparseflash.experiments.studies.host_cost import host_cost

    with pytest.raises(SystemExit):
        host_cost.main([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA launches")
def test_host_cost_rows(tmp_path):
    """Every layer gets a positive host time (the GPU still asleep when the calls were issued) and
    the end-to-end rows a GPU time; the profile is written."""
    from sparseflash.experiments.studies.host_cost import host_cost

    assert host_cost.main(["--seq-len", "512", "--heads", "2", "--tokens", "512", "--calls", "5",
                           "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "host_cost.json").read_text())
    layers = {r["layer"]: r for r in res["rows"]}
    for name in ("attention fwd+bwd", "attention fwd", "launch fwd", "launch bwd", "kernel fwd_kernel",
                 "kernel bwd_dq_kernel", "kernel bwd_dkdv_kernel", "trivial Function fwd+bwd"):
        assert layers[name]["host_us"] > 0, name
    assert layers["attention fwd+bwd"]["gpu_us"] > 0
    assert "run_backward" in (tmp_path / "host_cost_profile.txt").read_text()


@pytest.mark.parametrize("pattern", ["dense", "sparse"])
@pytest.mark.parametrize("ws,gather", [(False, False), (True, False), (True, True)])
def test_ws_probe_forward_matches_reference(pattern, ws, gather):
    """The warp-specialisation probe's stripped forward computes attention (its timings would mean
    nothing otherwise): against the float64 reference, within twice PyTorch's own error."""
    from sparseflash import reference
    from sparseflash.experiments.studies.tma.ws_probe import probe_forward
    from sparseflash.patterns import random as random_mask

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    B, H, N, D = (2, 4, 1024, 64) if dev == "cuda" else (1, 2, 256, 32)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
    mask = None if pattern == "dense" else random_mask(N, 1 if dev == "cpu" else 3, block_size=128, seed=1, device=dev)
    o, lse = probe_forward(q, k, v, mask, 64, 32, 4, 2, ws, gather)
    ref, ref_lse = reference.attention(q.double(), k.double(), v.double(), mask, scale=D ** -0.5, return_lse=True)
    own = reference.attention(q, k, v, mask, scale=D ** -0.5)
    own_err = (own.double() - ref).abs().max().item()
    assert (o.double() - ref).abs().max().item() <= 2 * own_err + 1e-6
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-4)


@pytest.mark.interpreter
def test_host_python_times_without_launching():
    """The Python-side host timer runs on any machine and puts the real kernels back afterwards."""
    from sparseflash.experiments.studies.host_cost import host_python
    from sparseflash.flash import kernels

    before = {name: getattr(kernels, name) for name in host_python._KERNELS}
    interp = os.environ.get("TRITON_INTERPRET")
    # enough calls, and an odd number of repeats, that one slow stretch of a shared 2-core CI machine
    # cannot put the forward's median above the forward+backward's (calls=5, repeats=2 once did: 649 vs 585 us)
    r = host_python.measure(seq_len=256, head_dim=32, blocks=1, batch=1, heads=2, calls=30, repeats=5)
    assert r["fwd_us"] > 0 and r["fwd_bwd_us"] > r["fwd_us"]
    assert {name: getattr(kernels, name) for name in host_python._KERNELS} == before
    assert os.environ.get("TRITON_INTERPRET") == interp  # the environment is left as it was


def test_tma_ab_knows_which_path_ran(monkeypatch):
    """tma_ab refuses to report a TMA row that ran on pointer loads: its check follows the launcher."""
    from sparseflash.experiments.studies.tma import tma_ab
    from sparseflash.flash import tiles

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90 or newer")
    import sparseflash

    q, k, v = (torch.randn(1, 2, 64, 32, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))

    def fwd_bwd(*t):
        return lambda: sparseflash.attention(*t, backend="triton").backward(torch.ones_like(t[0]))

    from sparseflash.flash import fast

    monkeypatch.setattr(fast, "ENABLED", False)  # the launchers' own decisions on every call
    monkeypatch.setattr(tiles, "TMA_MODE", "on")
    assert tma_ab._takes_tma(tiles, fwd_bwd(q, k, v)) == [True] * 3  # forward, dQ, dK/dV
    # .sum().backward() hands the backward an expanded dO (stride 0): pointer loads there
    assert tma_ab._takes_tma(tiles, lambda: sparseflash.attention(q, k, v, backend="triton").sum().backward()) \
        == [True, False, False]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    assert tma_ab._takes_tma(tiles, fwd_bwd(q32, k32, v32)) == [False] * 3  # fp32: pointer loads
    monkeypatch.setattr(tiles, "TMA_MODE", "off")
    assert tma_ab._takes_tma(tiles, fwd_bwd(q, k, v)) == [False] * 3


@pytest.mark.skipif(not ptxas_available(), reason="needs the ptxas bundled with Linux triton wheels")
@pytest.mark.skipif(not gluon_hopper_available(), reason="needs triton.experimental.gluon with its hopper module")
def test_gluon_probe_compiles_for_hopper():
    """The Gluon probe's warp-specialised forward compiles for sm_90 without a GPU, at head_dim 64
    and 128, dense and sparse, with one and two consumer warpgroups: every kernel has its wgmma,
    its TMA loads and the register hand-over between the loader and the consumers (setmaxnreg),
    spills nothing and fits the 227 KB of shared memory of a Hopper SM."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "sparseflash.experiments.studies.gluon.gluon_probe", "--compile-only", "--json",
           "--head-dims", "64", "128", "--variant", "128x64:w8:s4", "--variant", "64x64:w4:s2:c2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    rows = json.loads(lines[-1])
    assert len(rows) == 8, rows
    errors = [(r["head_dim"], r["mask"], r["variant"], r["error"]) for r in rows if r["status"] != "ok"]
    assert not errors, errors
    assert out.returncode == 0, out.stderr[-3000:]
    for r in rows:
        where = (r["head_dim"], r["mask"], r["variant"])
        assert r["wgmma"] > 0 and r["tma_loads"] >= 3 and r["setmaxnreg"], (where, r)
        assert r["stack"] == 0 and r["local"] == 0, (where, r)
        assert 0 < r["shared"] <= 227 * 1024, (where, r)


def test_probe_variant_specs_and_dense_rates(capsys):
    """The probes' --variant specs parse to their tiles (bad ones are refused with the expected form),
    and the 80%-bar lines compute sparse rate = dense ms x density / sparse ms, skipping failed rows."""
    from sparseflash.experiments.studies.gluon import gluon_probe
    from sparseflash.experiments.studies.tma import ws_probe

    assert ws_probe.parse_variant("128x64:w8:s3:ws:gather") == (128, 64, 8, 3, True, True)
    assert gluon_probe.parse_variant("64x64:w4:s2:c2:ov") == gluon_probe.Variant(64, 64, 4, 2, True, 2, True)
    assert gluon_probe.parse_variant("128x64:w8:s4:np").persistent is False
    for bad in ("64x64:w4", "64:w4:s2", "64x64:w4:s2:zz", "32x64:w4:s2"):
        with pytest.raises(ValueError, match="128x64:w8:s4"):
            gluon_probe.parse_variant(bad)
    rows = [dict(head_dim=64, mask="dense", variant="sparseflash", ms=0.64),
            dict(head_dim=64, mask="3/row", variant="sparseflash", ms=0.08),
            dict(head_dim=64, mask="dense", variant="g", ms=0.32), dict(head_dim=64, mask="3/row", variant="g", ms=0.06),
            dict(head_dim=64, mask="3/row", variant="failed", ms=None)]
    ws_probe.print_dense_rates(rows, [64], 3, 4096, 12)
    out = capsys.readouterr().out
    # density 3/32: sparseflash 0.64 x 3/32 / 0.08 = 75%; g 0.32 x 3/32 / 0.06 = 50% of its own, 100% of ours
    assert "sparseflash  sparse 0.0800 ms: 75% of its dense rate, 75% of sparseflash's" in out
    assert "g            sparse 0.0600 ms: 50% of its dense rate, 100% of sparseflash's" in out
    assert "failed" not in out


def test_short_rows_plot_from_saved_rows(tmp_path):
    """short_rows.png is redrawn from short_rows.json alone (no GPU): block-sparse and dense-only
    implementations, both modes."""
    from sparseflash.experiments.studies.short_rows import short_rows

    rows = []
    for impl in ("sparseflash", "sdpa-cudnn"):
        for mode in ("fwd", "bwd"):
            for r in (3, 6):
                sparse = 60.0 + r if impl == "sparseflash" else None
                rows.append(dict(provider=impl, head_dim=64, mode=mode, blocks_per_row=r, dense_full_ms=1.0,
                                 dense_short_ms=0.1 * r, short_pct_of_full_rate=70.0 + r,
                                 sparse_ms=None if sparse is None else 0.1, sparse_pct_of_full_rate=sparse))
    meta = {"commit": "abc1234", "device_name": "test"}
    (tmp_path / "short_rows.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    assert short_rows.main(["--plot", str(tmp_path)]) == 0
    png = tmp_path / "short_rows.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- short rows: the fixed-cost fit
def _rows(fixed, per_block, n=4096, block=128, mode="fwd", noise=0.0):
    kb = n // block
    rows = []
    for i, bpr in enumerate((1, 2, 3, 4, 6, 8, 16, kb)):
        ms = (fixed + per_block * bpr) * (1 + noise * (-1) ** i)
        rows.append(dict(provider="sparseflash", pattern="random", seq_len=n, head_dim=64, mode=mode, dtype="bf16",
                         causal=False, block_size=block, rel_density=bpr / kb, ms=ms, tflops=bpr / ms, status="ok"))
    rows.append(dict(rows[-1], pattern="dense", block_size=None))  # dense rows are not fitted
    rows.append(dict(rows[0], rel_density=0.5, ms=float("nan"), status="error: boom"))  # nor failed ones
    return rows


def test_fit_recovers_fixed_and_per_block_cost():
    fits = fit_fixed_cost(_rows(0.06, 0.0375) + _rows(0.2, 0.1, mode="bwd", n=16384))
    assert [(f["mode"], f["seq_len"]) for f in fits] == [("fwd", 4096), ("bwd", 16384)]
    fwd, bwd = fits
    assert fwd["fixed_ms"] == pytest.approx(0.06) and fwd["per_block_ms"] == pytest.approx(0.0375)
    assert fwd["fixed_blocks"] == pytest.approx(1.6) and fwd["key_blocks"] == 32
    assert bwd["fixed_blocks"] == pytest.approx(2.0) and bwd["key_blocks"] == 128
    assert fwd["max_rel_residual"] < 1e-9
    assert len(fwd["points"]) == 8  # the full-mask point is reported, not fitted
    assert fwd["full_tflops"] == pytest.approx(32 / (0.06 + 0.0375 * 32))


def test_fit_ignores_the_full_mask_point_and_reports_residuals():
    rows = _rows(0.06, 0.0375, noise=0.02)
    rows[-3]["ms"] *= 10  # the full mask (rel_density 1): far off the line, but left out of the fit
    (f,) = fit_fixed_cost(rows)
    assert f["fixed_blocks"] == pytest.approx(1.6, rel=0.5) and 0.01 < f["max_rel_residual"] < 0.1
    assert fit_fixed_cost(rows[:2]) == []  # too few sparse points


def test_cli_writes_json_and_plot(tmp_path, capsys):
    write_results(_rows(0.03, 0.02), {"command": "test"}, tmp_path, "sparsity")
    assert fixed_cost_main([str(tmp_path), "--out", str(tmp_path / "fit")]) == 0
    assert "1.50" in capsys.readouterr().out
    data = json.loads((tmp_path / "fit" / "fixed_cost.json").read_text())
    assert math.isclose(data["fits"][0]["fixed_blocks"], 1.5)
    assert (tmp_path / "fit" / "fixed_cost.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def pathfinder32_data(tmp_path_factory):
    """One tiny generated Pathfinder-32 set (160 / 20 / 20 images) for every flag setting below: the
    runs only read it."""
    data = tmp_path_factory.mktemp("pathfinder32") / "data"
    subprocess.run([sys.executable, "-m", "sparseflash", "lra", "data", "pathfinder", "--resolution", "32",
                    "--difficulty", "hard", "--num", "200", "--out", str(data), "--no-progress"], check=True,
                   capture_output=True)
    return data


# (the two input variants cost ~10 s each and change only the tokeniser: run on GPU machines and with SPARSEFLASH_SLOW=1)
@pytest.mark.parametrize("flags", [[], pytest.param(["--black-is-padding"], marks=pytest.mark.slow),
                                   pytest.param(["--patch", "4"], marks=pytest.mark.slow)],
                         ids=["all-pixels", "black-is-padding", "patches"])
def test_pathfinder_minimal_transformer_runs_on_generated_data(tmp_path, pathfinder32_data, flags):
    # The independent control of the Pathfinder-32 study: a few steps on a tiny generated set end
    # with its eval log and a test result that is a real accuracy over the test split.
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "studies", "pathfinder32-recipe",
                          "minimal_transformer.py")
    out = tmp_path / "run"
    subprocess.run([sys.executable, script, "--data", str(pathfinder32_data), "--out", str(out), "--steps", "4",
                    "--batch-size", "4", "--eval-every", "2", "--eval-size", "8", "--no-compile", *flags], check=True,
                   capture_output=True, timeout=300)
    rows = (out / "eval.csv").read_text().splitlines()
    assert rows[0].startswith("step,train_loss,val_loss,val_acc") and [r.split(",")[0] for r in rows[1:]] == ["2", "4"]
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 4 and 0 <= result["test_acc"] <= 1 and result["test_loss"] > 0
    assert (result["test_acc"] * 20) == pytest.approx(round(result["test_acc"] * 20))  # 20 test images


def test_hopper_plot_from_saved_rows(tmp_path):
    """`studies.hopper.plot` draws fwd_bench's saved rows (no GPU): a panel per (tokens, head_dim,
    mode), failed rows skipped."""
    from sparseflash.experiments.studies.hopper.plot import main as hopper_plot

    rows = []
    for n in (4096, 16384):
        for mask in ("dense", "random"):
            for prov in ("hopper", "flex", "sdpa-cudnn"):
                for mode in ("fwd", "fwdbwd"):
                    if prov == "sdpa-cudnn" and mask != "dense":
                        continue
                    ms = {"hopper": 1.0, "flex": 1.4, "sdpa-cudnn": 1.05}[prov] * n / 4096
                    rows.append(dict(seq=n, head_dim=64, mask=mask, provider=prov, mode=mode, ms=ms, tflops=400 / ms,
                                     error=None))
    rows.append(dict(seq=4096, head_dim=64, mask="dense", provider="portable", mode="fwd", ms=None, tflops=None,
                     error="RuntimeError: boom"))
    src = tmp_path / "hopper_fwd.json"
    src.write_text(json.dumps(dict(meta=dict(commit="abc", device_name="GPU"), rows=rows)))
    assert hopper_plot([str(src), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "hopper_tflops.png").stat().st_size > 10_000


def _calibrate():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "studies", "pathfinder-generator", "calibrate.py")
    spec = importlib.util.spec_from_file_location("calibrate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pathfinder_calibration_measures_what_it_says():
    # The generator calibration's measures on images with known answers: a "/" stroke lands in the
    # "/" bin, markers are found where the generator's layers put them, black share and levels.
    import numpy as np

    from sparseflash.experiments.lra.data import pathfinder as pf

    cal = _calibrate()
    img = np.zeros((64, 64), np.uint8)
    for t in range(10, 50):
        img[60 - t, t] = 200  # y down: rising to the right is "/"
    d = cal.stroke_directions(img)
    assert d[1] > 0.8 and abs(d.sum() - 1) < 1e-9
    p = pf.params_for(64, "hard", "release")
    made = pf.render_many(p, np.random.default_rng(4), [0, 1, 0, 1], True)
    for image, layers in made:
        found = sorted(cal.markers(image, p.marker_radius))
        want = sorted(tuple(int(v) for v in t) for t in layers["tips"])
        assert all(abs(a - b) <= 1 for f, w in zip(found, want) for a, b in zip(f, w)), (found, want)
        m = cal.measure(image, p.marker_radius)
        assert m["black"] == pytest.approx((image == 0).mean()) and 200 <= m["marker_interior"] <= 240
    if os.path.isdir(cal.DEFAULT_SAMPLES):  # the 16 real release images (shared/, beside the checkout)
        real = cal.real_images(cal.DEFAULT_SAMPLES, 128)
        assert len(real) == 8 and all(r.shape == (128, 128) and r.max() == 255 for r in real)


# ----------------------------------------------------------------------------- Path-X campaign tools
def test_pathx_drift_measures_change_and_cell_spread():
    from sparseflash.experiments.studies.pathx.drift import drift

    grid = torch.randn(4, 4, 8)
    w = torch.randn(40, 40)
    before = {"encoder.pos.grid": grid, "encoder.w": w, "tiny.bias": torch.zeros(3)}
    same = {"encoder.pos.grid": grid.repeat_interleave(2, 0).repeat_interleave(2, 1), "encoder.w": w.clone(),
            "tiny.bias": torch.ones(3)}
    rows = {r[0]: r for r in drift(before, same)}
    assert set(rows) == {"encoder.pos.grid", "encoder.w"}  # small non-position tensors are left out
    assert rows["encoder.pos.grid"][1] == 0 and rows["encoder.pos.grid"][4] == 0 and rows["encoder.w"][4] is None
    moved = dict(same, **{"encoder.w": 3 * w})
    moved["encoder.pos.grid"] = same["encoder.pos.grid"].clone()
    moved["encoder.pos.grid"][0, 0] += 1.0  # one copy of one cell leaves its three twins
    rows = {r[0]: r for r in drift(before, moved)}
    assert rows["encoder.w"][1] == pytest.approx(2.0) and rows["encoder.w"][3] == pytest.approx(3 * float(w.norm()))
    assert rows["encoder.pos.grid"][4] > 0 and rows["encoder.pos.grid"][1] > 0


def test_pathx_curves_table_and_figure(tmp_path):
    from sparseflash.experiments.studies.pathx import curves

    run = tmp_path / "state" / "finetune"
    run.mkdir(parents=True)
    with open(run / "train.csv", "w") as f:  # 10 steps an epoch, logged every step
        f.write("step,epoch,lr,loss,acc\n")
        f.writelines(f"{s},{s / 10:.2f},0.001,{1 / s:.4f},{0.5 + s / 100:.4f}\n" for s in range(1, 41))
    (run / "eval.csv").write_text("step,split,weights,loss,acc,n,time_s\n10,val,current,0.69,0.5,64,1\n"
                                  "20,val,current,0.70,0.52,64,2\n20,val,best,0.70,0.52,64,2\n40,test,best,0.7,0.5,64,3\n")
    out = tmp_path / "out"
    assert curves.main(["--state", str(tmp_path / "state"), "--runs", "finetune", "--window", "20", "--out", str(out)]) == 0
    rows = list(curves.csv.DictReader(open(out / "curves.csv")))
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == ["20", "40"] and [r["epoch"] for r in train] == ["2.0", "4.0"]
    assert float(train[0]["acc"]) == pytest.approx(0.5 + 10.5 / 100, abs=1e-4)  # mean of steps 1-20
    assert [(r["step"], r["acc"]) for r in rows if r["split"] == "val"] == [("10", "0.5000"), ("20", "0.5200")]
    assert (out / "curves.png").stat().st_size > 10_000
    (out / "curves.png").unlink()
    assert curves.main(["--out", str(out)]) == 0 and (out / "curves.png").exists()  # redrawn from the table
    with pytest.raises(SystemExit):
        curves.main(["--state", str(tmp_path / "state"), "--runs", "missing", "--out", str(out)])


def test_pathx_rim_probe_regions_and_threshold():
    from sparseflash.experiments.studies.pathx.rim_probe import region_features, threshold_accuracy

    k = 6
    patches = np.arange(2 * 2 * 13 * 13, dtype=np.float32).reshape(2, 2 * 13 * 13)
    f = region_features(patches, k)
    assert f["patches"] is patches
    assert f["interior"].shape == (2, 2 * 21) and f["rim"].shape == (2, 2 * 16) and f["outside"].shape == (2, 2 * 132)
    centre = 6 * 13 + 6
    assert centre in f["interior"][0] and centre not in f["rim"][0]
    assert np.array_equal(f["rim-difference"], np.full((2, 16), 169.0))  # second patch = first + 169
    rng = np.random.default_rng(0)
    x = rng.normal(size=400)
    y = (x < 0.3).astype(int)  # a rule "below t": found, and perfect on held-out data
    assert threshold_accuracy(x[:300], y[:300], x[300:], y[300:]) > 0.97
    assert threshold_accuracy(x[:300], rng.integers(0, 2, 300), x[300:], rng.integers(0, 2, 100)) < 0.7


# ----------------------------------------------------------------------------- hopper dispatch threshold
def test_hopper_threshold_needs_an_sm90_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("has an sm_90 GPU")
    from sparseflash.experiments.studies.hopper_threshold import threshold

    with pytest.raises(SystemExit):
        threshold.main(["--out", "unused"])


def test_hopper_threshold_crossover_is_where_hopper_wins_from_on():
    """The crossover is the smallest work from which the Hopper setting is faster at every larger
    work; a loss above it moves it up; no win at the largest work means never."""
    from sparseflash.experiments.studies.hopper_threshold.threshold import crossovers

    def rows(times):  # work -> (hopper ms, portable ms)
        out = []
        for w, (h, p) in times.items():
            for setting, ms in (("hopper", h), ("portable", p)):
                out.append(dict(head_dim=64, mode="fwd", work=w, seq_len=4096, mask=f"m{w}", setting=setting,
                                eager_ms=ms, status="ok"))
        return out

    assert crossovers(rows({1e9: (2, 1), 1e10: (1, 2), 1e11: (1, 3)}))[0]["hopper_wins_from_work"] == 1e10
    assert crossovers(rows({1e9: (1, 2), 1e10: (3, 2), 1e11: (1, 3)}))[0]["hopper_wins_from_work"] == 1e11
    assert crossovers(rows({1e9: (1, 2), 1e11: (3, 2)}))[0]["hopper_wins_from_work"] is None

# ----------------------------------------------------------------------------- sparse backward: TMA dK/dV, K/V prefetch
def test_sparse_bwd_new_knobs_exist_default_off_and_route():
    """The study copy's TMA_DKDV and PREFETCH_KV knobs exist, are off by default (the copy is
    today's kernel), are accepted by `routed` and restored on exit; PREFETCH_KV takes a second
    K/V pair only where it fits (d=64), and unknown knobs are refused by name."""
    from sparseflash.experiments.studies.sparse_bwd import bwd_variants as bv
    from sparseflash.flash.hopper import backward as production

    assert {"TMA_DKDV", "PREFETCH_KV"} <= set(bv.KNOBS)
    assert bv.TMA_DKDV is False and bv.PREFETCH_KV is False
    assert (bv._kv_bufs(64), bv._kv_bufs(128)) == (1, 1)
    real = production.bwd
    with bv.routed("on", TMA_DKDV=True, PREFETCH_KV=True):
        assert bv.TMA_DKDV is True and bv.PREFETCH_KV is True and production.bwd is bv.bwd
        assert (bv._kv_bufs(64), bv._kv_bufs(128)) == (2, 1)
    assert bv.TMA_DKDV is False and bv.PREFETCH_KV is False and production.bwd is real
    with pytest.raises(ValueError, match="TMA_STORE"):
        bv.routed("on", TMA_STORE=True)


@pytest.mark.parametrize("argv, message", [
    (["--out", "X"], "needs a CUDA GPU"),
    ([], "--out DIR is required"),
    (["--out", "X", "--ks", "0"], "--ks"),
    (["--out", "X", "--seq", "1024", "--ks", "9"], "1 .. 8"),
    (["--out", "X", "--head-dims", "96"], "invalid choice"),
    (["--out", "X", "--variants", "prefetch_only"], "invalid choice"),
])
def test_sparse_bwd_tma_store_arguments_and_cpu_refusal(argv, message, capsys):
    if torch.cuda.is_available() and argv[:2] == ["--out", "X"] and len(argv) == 2:
        pytest.skip("has a GPU")
    from sparseflash.experiments.studies.sparse_bwd import tma_store

    with pytest.raises(SystemExit) as e:
        tma_store.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sparse_bwd_tma_store_ptx_checks():
    """The PTX checks of `tma_store --compile-only` on hand-written PTX and build reports: K/V
    load order by descriptor, and what each knob must add (stores, barriers, shared memory)."""
    from sparseflash.experiments.studies.sparse_bwd.tma_store import check_build, kv_order

    head = "\n".join(f"mov.b32 %r{i}, k_param_{9 * i};\ncvt.u64.u32 %rd{10 + i}, %r{i};\ncvta.param.u64 %rd{i}, %rd{10 + i};"
                     for i in range(3))  # descriptors 0 (Q), 1 (K), 2 (V)

    def load(i):
        return f"@%p1 cp.async.bulk.tensor.4d.shared::cta.global.mbarrier::complete_tx::bytes [%r9], [%rd{i}, {{%r1}}], [%r8];"
    wait = "mbarrier.try_wait.parity.shared::cta.b64 complete, [%r7], %r6;"
    assert kv_order("\n".join([head, wait, load(1), load(1), load(2), wait, load(0)])) == "K V"
    assert kv_order("\n".join([head, wait, load(2), wait, load(1), load(0)])) == "V wait K"
    assert kv_order(head) == ""

    off = dict(shared=231000, wgmma=88, tma_loads=10, tma_stores=0, mbarrier_waits=17, mbarrier_arrives=16, kv_order="K V")
    assert check_build(128, "off", off, None) == []
    tma = dict(off, tma_stores=4, mbarrier_waits=21, mbarrier_arrives=17)
    assert check_build(128, "tma", tma, off) == []
    assert check_build(128, "tma", dict(tma, tma_stores=0), off)  # no TMA stores: wrong
    split = dict(off, shared=231008, tma_loads=12, mbarrier_waits=19, mbarrier_arrives=20, kv_order="V wait K")
    assert check_build(128, "prefetch", split, off) == []
    assert check_build(128, "prefetch", dict(split, kv_order="K V"), off)  # K/V still loaded together
    assert check_build(128, "prefetch", dict(split, shared=240000), off)  # over 227 KB
    off64 = dict(off, shared=166500, wgmma=72, tma_loads=6)
    assert check_build(64, "prefetch", dict(off64, shared=166500 + 32768), off64) == []
    assert check_build(64, "prefetch", off64, off64)  # no second K/V pair


@pytest.mark.skipif(not ptxas_available(), reason="needs the ptxas bundled with Linux triton wheels")
@pytest.mark.skipif(not gluon_hopper_available(), reason="needs triton.experimental.gluon with its hopper module")
def test_sparse_bwd_tma_store_knobs_compile_for_hopper(tmp_path):
    """The study copy with TMA_DKDV, PREFETCH_KV and both compiles for sm_90 at d=128 on block
    lists (a GQA shape whose CTAs walk several key tiles), within 227 KB of shared memory, with
    its TMA stores of dK/dV, and V loaded before the wait for K's release."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "sparseflash.experiments.studies.sparse_bwd.tma_store", "--compile-only",
           "--head-dims", "128", "--cases", "sparse128", "--dump", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "builds.json").read_text())
    assert [r["variant"] for r in rows] == ["off", "tma", "prefetch", "tma_prefetch"]
    assert all(r["problems"] == "" for r in rows), rows
    assert [r["tma_stores"] for r in rows] == [0, 4, 0, 4]
    assert [r["kv_order"] for r in rows] == ["K V", "K V", "V wait K", "V wait K"]


def test_sparse_bwd_tma_store_times_only_variants_that_pass(tmp_path, monkeypatch, capsys):
    """The GPU run's plumbing with the GPU parts stood in for: a variant failing the float64 check
    (tma_prefetch at d=64), the comparison with the production kernel (tma's dK off by a lot at
    d=128) or raising (tma_prefetch at d=128) gets FAIL rows and is never timed; dQ one bf16 ulp off still passes; the CSV has a row
    per case x variant and the exit status says something failed."""
    from sparseflash.experiments.studies.sparse_bwd import tma_store as ts

    timed = []
    ref = [torch.full((2, 3), 1.0), torch.full((2, 3), 2.0), torch.full((2, 3), -1.0)]

    def grads(a, kw, variant):
        dq, dk, dv = (t.clone() for t in ref)
        if variant == "tma" and kw["d"] == 128:
            dk[0, 0] += 0.5
        if variant == "tma_prefetch" and kw["d"] == 128:
            raise RuntimeError("tma_prefetch: the kernel ran with {}, not as named")  # (an error fails it too)
        if variant is not None:
            dq[1, 2] += 2.0 ** -7  # one ulp of dQ's largest entry: arrival order
        return [dq, dk, dv]

    monkeypatch.setattr(ts, "_gpu_problem", lambda: None)
    monkeypatch.setattr(ts, "reference_check", lambda d, vs: {v: (not (d == 64 and v == "tma_prefetch"), {}) for v in vs})
    monkeypatch.setattr(ts, "_capture", lambda n, d, k, rows: ((), {"d": d}))
    monkeypatch.setattr(ts, "_grads", grads)
    monkeypatch.setattr(ts, "_time", lambda name, a, kw: timed.append((kw["d"], name)) or 1.0)
    from sparseflash.flash import fast, tiles

    before = (fast.ENABLED, tiles.TMA_MODE)
    rc = ts.main(["--out", str(tmp_path), "--seq", "2048", "--ks", "1", "13"])
    assert rc == 1
    import csv

    rows = list(csv.DictReader(open(tmp_path / "tma_store.csv")))
    assert len(rows) == 2 * 2 * 2 * 3
    bad = {(r["head_dim"], r["variant"]) for r in rows if r["status"] != "ok"}
    assert bad == {("128", "tma"), ("128", "tma_prefetch"), ("64", "tma_prefetch")}
    assert all("not as named" in r["error"] for r in rows if (r["head_dim"], r["variant"]) == ("128", "tma_prefetch"))
    assert all(r["ms"] == "" for r in rows if r["status"] != "ok")
    assert sorted(set(timed)) == [(64, "onepass"), (64, "tma"), (128, "onepass")]
    assert len(timed) == 3 * 4  # each timed variant at 2 masks x 2 K
    table = capsys.readouterr().out.split("(ms, one backward)")[-1]
    assert table.count("FAIL") == 12 and "tma 1.00x" in table
    assert (fast.ENABLED, tiles.TMA_MODE) == before  # (the run's launch-route settings are restored)


@pytest.mark.skipif(not gluon_hopper_available(), reason="needs gluon's Hopper module")
@pytest.mark.parametrize("flags", [[], ["--per-call"], ["--per-call", "--torch-select"], ["--backward"]])
def test_host_cpu_runs_the_hopper_host_path(flags, capsys):
    """host_cpu.py times the Hopper launchers' Python on a CPU with the launches stubbed, and leaves
    every module it patched as it found it."""
    from sparseflash import index_kernels
    from sparseflash.experiments.studies.hopper_threshold import host_cpu
    from sparseflash.flash import binding, dispatch, fast
    from sparseflash.flash.hopper import backward as hb, forward as hf

    before = (fast.ENABLED, dispatch.fwd_layouts, hf.hopper_fwd_kernel, hb.hopper_bwd_kernel, binding.current_device,
              index_kernels.ON_CPU, index_kernels.select_takes, index_kernels._topk_kernel)
    binding.CALLS.clear()
    assert host_cpu.main(["--calls", "3", *flags]) == 0
    assert " us per " in capsys.readouterr().out
    assert len(binding.CALLS) >= 1  # the stubbed launches went the bound route
    after = (fast.ENABLED, dispatch.fwd_layouts, hf.hopper_fwd_kernel, hb.hopper_bwd_kernel, binding.current_device,
             index_kernels.ON_CPU, index_kernels.select_takes, index_kernels._topk_kernel)
    assert all(a is b for a, b in zip(after, before))
    binding.CALLS.clear()


def test_decode_splits_times_each_setting_and_restores_the_launch(tmp_path, capsys):
    """decode_splits.py runs the decode kernel under each (splits, warps, stages, key tile) it lists,
    right against SDPA's answer, and leaves the kernel's launch settings empty again."""
    from sparseflash.experiments.studies.decode_splits import decode_splits
    from sparseflash.flash import decode

    assert decode_splits.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_splits.json").read_text())["rows"]
    ours = [r for r in rows if r["provider"] == "sparseflash"]
    assert [(r["num_splits"], r["block_n"]) for r in ours] == [(0, 64), (2, 32)]
    assert all(r["status"] == "ok" and r["max_err"] < 2e-2 for r in ours)
    assert decode.OVERRIDES == {}
    assert "best setting" in capsys.readouterr().out


def test_hopper_bwd_fa4_ncu_run_sets_the_variant_and_refuses_without_a_gpu(monkeypatch, capsys):
    """ncu_run.py and compare.py: a variant's overrides and MODE hold while its calls run (what ncu
    then profiles) and are restored after; a bad case or variant is a usage error; without a GPU
    the command refuses with exit 2."""
    from sparseflash.experiments.studies.hopper_bwd_fa4 import compare, ncu_run
    from sparseflash.flash.hopper import backward as hb

    monkeypatch.setattr(hb, "OVERRIDES", {})
    monkeypatch.setattr(hb, "MODE", "auto")
    with compare.variant(compare.VARIANTS["onepass-regstore"]):
        assert hb.OVERRIDES == {"dkdv_tma": False} and hb.MODE == "on"
    assert hb.OVERRIDES == {} and hb.MODE == "auto"
    with compare.variant(compare.VARIANTS["ours-q64"]):
        assert hb.OVERRIDES == {"q_step": {64: 64}} and hb.MODE == "auto"
    assert hb.OVERRIDES == {} and hb.MODE == "auto"
    from sparseflash.flash.hopper import forward as hf

    monkeypatch.setattr(hf, "OVERRIDES", {})
    with compare.variant(compare.VARIANTS["fwd-3wg-flat"]):  # the forward's overrides, under "fwd"
        assert hf.OVERRIDES == {"consumers": 3, "flat": True} and hb.OVERRIDES == {}
    assert hf.OVERRIDES == {}
    for argv in (["bogus-case"], ["dense-d64-4k", "no-such-variant"]):
        with pytest.raises(SystemExit) as e:
            ncu_run.main(argv)
        assert e.value.code == 2
    capsys.readouterr()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            ncu_run.main(["causal-d128-16k", "causal-one-loop"])
        assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_hopper_bwd_fa4_cases_variants_and_table(capsys):
    """compare.py: case names resolve (the table's, randomK, localW; a bad one is a one-line usage
    error), every variant names only knobs the backward has, a CPU run refuses with exit 2, and the
    table gives each row's speed relative to FA4's (FA4's time over the row's)."""
    from sparseflash.experiments.studies.hopper_bwd_fa4 import compare
    from sparseflash.flash.hopper import backward as hb, forward as hf

    assert compare.case("causal-d64-4k") == (4096, 64, True, None)
    assert compare.case("random13-d128-16k") == (16384, 128, False, ("random", 13))
    assert compare.case("local2048-d64-4k") == (4096, 64, True, ("local", 2048))
    with pytest.raises(ValueError, match="randomK-dD-Nk"):
        compare.case("random-d96-16k")
    assert compare._mask(("random", 3), 4096, False, "cpu").layout.shape == (1, compare.HEADS, 32, 32)
    for over in compare.VARIANTS.values():
        assert set(over) - {"MODE", "fwd"} <= set(hb.OVERRIDE_KEYS) and over.get("MODE", "on") in ("on", "off")
        assert set(over.get("fwd", {})) <= set(hf.OVERRIDE_KEYS)
    assert hb.OVERRIDES == {}
    with pytest.raises(SystemExit) as e:
        compare.main(["--out", "x", "--cases", "bogus"])
    assert e.value.code == 2 and "bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert compare.main(["--out", "x"]) == 2
    rows = [dict(case="c", provider="ours", status="ok", fwd_ms=1.0, bwd_ms=3.0, fwdbwd_ms=4.0),
            dict(case="c", provider="fa4", status="ok", fwd_ms=0.5, bwd_ms=2.5, fwdbwd_ms=3.0),
            dict(case="c", provider="cudnn", status="skipped: why")]
    t = compare.table(rows)
    assert "| c | ours | 1.000 | 3.000 | 4.000 | 0.500 | 0.750 |" in t and "skipped: why" in t


def test_decode_host_times_the_decode_path_and_restores_it(tmp_path, capsys):
    """decode_host/host_cpu.py times flash_attn_with_kvcache's host path with the decode kernels stubbed
    (bound route, no host read; launches of the default: a read's split kernel (which checks the bounds)
    and combine; an append's bounds check, append, split, combine; of the variant ``old``: the bounds check
    before a read too; of ``fused``: no combine), and leaves the modules it patched as it found them."""
    from sparseflash.experiments.studies.decode_host import host_cpu
    from sparseflash.flash import binding, decode

    import sparseflash.kvcache

    before = (decode.decode_split_kernel, decode.sm_count, decode.bound_launches, binding.current_device,
              binding.raw_stream, decode.INTERPRETING, decode.PLANS, decode.CHECKS, decode.APPENDS,
              sparseflash.kvcache.PLANS)
    assert host_cpu.main(["--out", str(tmp_path), "--calls", "5", "--repeats", "1", "--batches", "1", "--label", "t",
                          "--variants", "default,old,fused"]) == 0
    rows = json.loads((tmp_path / "host_cpu_t.json").read_text())["rows"]
    assert [(r["call"], r["batch"], r["variant"]) for r in rows] == [
        (c, 1, v) for c in ("read", "append") for v in ("default", "old", "fused")]
    for r in rows:
        assert r["host_reads"] == 0 and r["host_us_p10"] > 0
        append = r["call"] == "append"
        bounds = append or r["variant"] == "old"  # (an append keeps its check before the write)
        combine = r["variant"] != "fused"  # (fused: the split kernel merges its 33 splits)
        assert r["launches"] == dict(decode_split_kernel=1, **({"decode_bounds_kernel": 1} if bounds else {}),
                                     **({"decode_combine_kernel": 1} if combine else {}),
                                     **({"decode_append_kernel": 1} if append else {})), r
        assert r["overrides"] == dict(default={}, old=dict(balanced_splits=False, check_in_split=False),
                                      fused=dict(fused_combine=True))[r["variant"]]
    assert "host reads" in capsys.readouterr().out
    assert decode.OVERRIDES == {}
    with pytest.raises(SystemExit):
        host_cpu.main(["--out", str(tmp_path), "--variants", "bogus"])
    after = (decode.decode_split_kernel, decode.sm_count, decode.bound_launches, binding.current_device,
             binding.raw_stream, decode.INTERPRETING, decode.PLANS, decode.CHECKS, decode.APPENDS,
             sparseflash.kvcache.PLANS)
    assert all(a is b for a, b in zip(after, before))  # (the plans it made with the stand-ins dropped)
