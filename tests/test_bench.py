"""Tests of the benchmark suite (sparseflash.experiments.bench): FLOP / density accounting against
hand counts, the pattern sweep, the FlexAttention mask conversion, failure handling, and the
CLI end to end on the CPU (CSV / JSON / PNG outputs, the plot command)."""

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparseflash import BlockMask
from sparseflash.cli import main
from sparseflash.experiments.bench import masks, providers, runner
from sparseflash.experiments.bench.config import BenchConfig, defaults
from sparseflash.experiments.bench.flops import attended_pairs, attention_flops, dense_pairs, densities
from sparseflash.experiments.bench.results import CPU_NOTE, COLUMNS, load_results
from sparseflash.experiments.bench.timing import TimingConfig, pooled

from _hopper import ptxas_available


# ----------------------------------------------------------------------------- accounting
def _brute_pairs(layout, block, seq_q, seq_k, causal, batch, heads):
    """Count attended pairs by materialising the token mask."""
    m = BlockMask.from_layout(layout, block, seq_q, seq_k).to_dense().expand(batch, heads, seq_q, seq_k)
    if causal:
        i = torch.arange(seq_q)[:, None]
        j = torch.arange(seq_k)[None, :]
        m = m & (j <= i + seq_k - seq_q)
    return int(m.sum())


def test_dense_pairs_hand_counts():
    assert dense_pairs(4, 4) == 16
    assert dense_pairs(4, 4, causal=True) == 10  # 1 + 2 + 3 + 4
    assert dense_pairs(3, 5, causal=True) == 3 + 4 + 5  # bottom-right: row i sees j <= i + 2
    assert dense_pairs(5, 3, causal=True) == 0 + 0 + 1 + 2 + 3  # rows 0, 1 see nothing
    assert dense_pairs(1, 1, causal=True) == 1
    for sq, sk in [(7, 7), (1, 9), (9, 1), (13, 6), (6, 13)]:
        full = torch.ones(1, 1, dtype=torch.bool)
        assert dense_pairs(sq, sk, True) == _brute_pairs(full, (sq, sk), sq, sk, True, 1, 1)


def test_attended_pairs_hand_counts_tails_and_causal():
    # seq 5, block 2: a 3 x 3 grid whose last row / column hold one token.
    layout = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    m = BlockMask.from_layout(layout, 2, seq_q=5)
    # blocks (0,0), (1,0), (1,1): 2x2 each; (2,2): the 1x1 tail
    assert attended_pairs(m, 1, 1, 5, 5) == 4 + 4 + 4 + 1
    # causal: (0,0) keeps 3 of 4, (1,0) all 4, (1,1) 3 of 4, (2,2) its single pair
    assert attended_pairs(m, 1, 1, 5, 5, causal=True) == 3 + 4 + 3 + 1
    assert attention_flops(13, 64, "fwd") == 4 * 13 * 64
    assert attention_flops(13, 64, "fwdbwd") == pytest.approx(3.5 * 4 * 13 * 64)
    assert attention_flops(13, 64, "bwd") == pytest.approx(2.5 * 4 * 13 * 64)
    d = densities(m, 1, 1, causal=False)
    assert d["density"] == pytest.approx(4 / 9)
    assert d["token_density"] == pytest.approx(13 / 25)
    assert d["rel_density"] == pytest.approx(13 / 25)
    dc = densities(m, 1, 1, causal=True)
    assert dc["token_density"] == pytest.approx(11 / 25)
    assert dc["rel_density"] == pytest.approx(11 / 15)  # dense causal at 5 tokens: 15 pairs


def test_attended_pairs_per_head_and_batch_masks():
    g = torch.Generator().manual_seed(0)
    layout = torch.rand(2, 3, 4, 4, generator=g) > 0.5  # per batch and head; seq 7 -> tails
    m = BlockMask(layout, 2, 7, 7)
    for causal in (False, True):
        assert attended_pairs(m, 2, 3, 7, 7, causal) == _brute_pairs(layout, 2, 7, 7, causal, 2, 3)
    shared = BlockMask(layout[:1, :1], 2, 7, 7)  # broadcast over batch 2 x heads 3
    assert attended_pairs(shared, 2, 3, 7, 7, True) == 6 * _brute_pairs(layout[:1, :1], 2, 7, 7, True, 1, 1)
    with pytest.raises(ValueError, match="broadcast"):
        attended_pairs(m, 2, 4, 7, 7)
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 64, "forward")
    with pytest.raises(ValueError, match="seq_q"):
        attended_pairs(m, 2, 3, 8, 8)


# ----------------------------------------------------------------------------- masks
def test_sweep_points_reach_targets_and_skip_missing_patterns(monkeypatch):
    pts = masks.sweep_points("random", 2048, 64, causal=False, targets=(1.0, 0.25, 1 / 32))
    assert [p.param for p in pts] == ["blocks_per_row=32", "blocks_per_row=8", "blocks_per_row=1"]
    assert [p.rel_density for p in pts] == pytest.approx([1.0, 0.25, 1 / 32])
    local = masks.sweep_points("local", 4096, 128, causal=True)
    assert local[0].rel_density == pytest.approx(1.0)
    dens = [p.rel_density for p in local]
    assert dens == sorted(dens, reverse=True) and dens[-1] < 0.05
    bf = masks.sweep_points("butterfly", 4096, 128, causal=False, targets=(1.0, 0.5, 0.1))
    assert [round(p.rel_density, 4) for p in bf] == [1.0, 0.5, round(3 / 32, 4)]
    with pytest.raises(ValueError, match="pattern must be one of"):
        masks.sweep_points("nope", 1024, 128, False)
    import sparseflash.patterns as zoo

    monkeypatch.delattr(zoo, "local")
    with pytest.raises(masks.PatternUnavailable, match="local"):
        masks.sweep_points("local", 1024, 128, False)
    notes = []
    cfg = BenchConfig(**{**defaults("sparsity", "cpu"), "patterns": ("local", "random"), "seq_lens": (256,),
                         "targets": (1.0, 0.5)})
    from sparseflash.experiments.bench import sparsity

    pts = sparsity.mask_points(cfg, notes)
    assert {p.pattern for p in pts[256]} == {"random"}
    assert any("pattern local skipped" in n for n in notes)
    assert all(p.mask_ms >= 0 for p in pts[256])


def test_flex_block_mask_conversion_is_identical():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(1)
    layout = torch.rand(1, 2, 5, 5, generator=g) > 0.4
    m = BlockMask(layout, 32, 150, 150)  # tail block of 22 tokens
    for causal in (False, True):
        fb = providers.to_flex_block_mask(m, causal)
        assert isinstance(fb, flex.BlockMask)
        attended = m.pair_counts(causal)
        total = m.pair_counts(False)

        def blocks(num, idx):
            return {(h, i, int(j)) for h in range(2) for i in range(5) for j in idx[0, h, i, : num[0, h, i]]}

        full = blocks(fb.full_kv_num_blocks, fb.full_kv_indices)
        partial = blocks(fb.kv_num_blocks, fb.kv_indices)
        on = {(h, i, j) for h in range(2) for i in range(5) for j in range(5)
              if layout[0, h, i, j] and attended[i, j] > 0}
        assert full | partial == on and not full & partial
        assert full == {b for b in on if attended[b[1], b[2]] == total[b[1], b[2]]}
        assert (not causal) == (not partial)
        assert fb.BLOCK_SIZE == (32, 32)


def test_fa4_provider_reasons_and_what_it_passes(monkeypatch):
    """FlashAttention-4's providers: a clear reason where they cannot run (a CPU, no flash_attn.cute,
    blocks other than 128 x 128); where they run (a stand-in flash_attn.cute, no GPU needed), the
    [B, N, H, D] views of the same memory (no copy), the scale and causal flag, and a block mask as
    Flex's lists, the kv-direction ones for the forward and the q-direction ones for the backward,
    with the output handed back as [B, H, N, D]."""
    import sys
    import types

    pytest.importorskip("torch.nn.attention.flex_attention")
    m = BlockMask(torch.rand(1, 1, 4, 4, generator=torch.Generator().manual_seed(2)) > 0.3, 128, 512, 512)
    s = providers.Setting(torch.device("cpu"), torch.bfloat16, 2, 3, 512, 64, True, "fwd", m)
    assert "CUDA" in providers.PROVIDERS["fa4"].check(s)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    gpu = dataclasses.replace(s, device=torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    assert "flash-attn-4" in providers.PROVIDERS["fa4"].check(gpu)
    calls = []

    def flash_attn_func(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return q * 2, None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    bs = types.ModuleType("flash_attn.cute.block_sparsity")
    bs.BlockSparseTensorsTorch = lambda *a, block_size=None: (a, block_size)
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.block_sparsity", bs)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert providers.PROVIDERS["fa4"].check(gpu) is None
    assert "128 x 128" in providers.PROVIDERS["fa4"].check(dataclasses.replace(gpu, mask=BlockMask(
        torch.ones(1, 1, 8, 8, dtype=torch.bool), 64, 512, 512)))
    q, k, v = (torch.randn(2, 3, 512, 64, dtype=torch.bfloat16) for _ in range(3))
    for name in ("fa4", "fa4-dense"):
        p = providers.PROVIDERS[name]
        ctx = p.prepare(s)
        out = p.forward(ctx, s, q, k, v)
        qq, kk, vv, kw = calls[-1]
        assert qq.shape == (2, 512, 3, 64) and qq.data_ptr() == q.data_ptr() and vv.data_ptr() == v.data_ptr()
        assert torch.equal(out, q * 2) and out.shape == q.shape
        assert kw["causal"] is True and kw["softmax_scale"] == s.scale
        if name == "fa4-dense":
            assert kw["block_sparse_tensors"] is None and kw["block_sparse_tensors_bwd"] is None
            continue
        fm = providers.to_flex_block_mask(m, True)
        (fwd, size), (bwd, _) = kw["block_sparse_tensors"], kw["block_sparse_tensors_bwd"]
        assert size == (128, 128)
        for got, want in zip(fwd, (fm.kv_num_blocks, fm.kv_indices, fm.full_kv_num_blocks, fm.full_kv_indices)):
            assert torch.equal(got, want)
        for got, want in zip(bwd, (fm.q_num_blocks, fm.q_indices, fm.full_q_num_blocks, fm.full_q_indices)):
            assert torch.equal(got, want)


# ----------------------------------------------------------------------------- runner failures
def _fake(name, kind="sparse", check=None, forward=None):
    def fwd(ctx, s, q, k, v):
        return forward(q) if forward else q + k + v

    return providers.Provider(name, name, kind, "test provider", check or (lambda s: None), lambda s: None, fwd)


def test_failures_become_rows_and_the_sweep_goes_on(frozen_gc):
    def boom(q):
        raise ValueError("boom")

    def oom(q):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")

    provs = [_fake("boom", forward=boom), _fake("oom", forward=oom), _fake("gone", check=lambda s: "no such device"),
             _fake("fine")]
    mp = masks.sweep_points("random", 128, 32, False, targets=(0.5, 0.25))
    pts = [runner.Point(p.pattern, p.param, p.mask, p.density, p.token_density, p.rel_density) for p in mp]
    jobs = []
    for mode in ("fwd", "fwdbwd"):
        shape = runner.Shape(1, 1, 128, 16, "fp32", False, mode, 32)
        jobs += runner.jobs_for(shape, pts, provs)
    env = {"device": "cpu", "device_name": "test"}
    rows = runner.run_jobs(jobs, env, "sparsity", torch.device("cpu"), "reference", TimingConfig(rep_ms=1),
                           show_progress=False)
    by = {}
    for r in rows:
        by.setdefault(r["provider"], []).append(r)
    assert {r["status"] for r in by["boom"]} == {"error: ValueError: boom"}
    assert {r["status"] for r in by["oom"]} == {"OOM"}
    assert len(by["gone"]) == 1 and by["gone"][0]["status"] == "unavailable: no such device"
    assert len(by["fine"]) == 4 and all(r["status"] == "ok" and r["ms"] > 0 for r in by["fine"])
    assert all(math.isnan(r["ms"]) for r in by["boom"] + by["oom"])
    assert all(r["note"] == CPU_NOTE for r in rows)
    assert all(r["max_err"] is None for r in rows)  # nothing checked unless asked
    # with check=True the output is compared with the reference: q + k + v is not attention
    checked = runner.run_jobs(runner.jobs_for(shape, pts, [_fake("fine")]), env, "sparsity", torch.device("cpu"),
                              "reference", TimingConfig(rep_ms=1), show_progress=False, check=True)
    assert all(r["max_err"] > 0.5 for r in checked)


def test_cpu_rows_pool_interleaved_rounds_and_show_their_spread(frozen_gc):
    """CPU: every row measured in each round, in alternating order, its samples pooled (median and
    quartiles); providers labelled for what runs on a CPU."""
    order = []

    def fwd(ctx, s, q, k, v):
        order.append(s.mode)
        return q + k + v

    prov = providers.Provider("fine", "fine", "dense", "test provider", lambda s: None, lambda s: None, fwd)
    shapes = [runner.Shape(1, 1, 64, 16, "fp32", False, mode, 32) for mode in ("fwd", "fwdbwd")]
    pt = runner.dense_point(64, False)
    jobs = [j for sh in shapes for j in runner.jobs_for(sh, [pt], [prov])]
    cfg = TimingConfig(warmup_ms=0, rep_ms=1, min_runs=4, rounds=3)
    rows = runner.run_jobs(jobs, {"device": "cpu", "device_name": "test"}, "sparsity", torch.device("cpu"),
                           "reference", cfg, show_progress=False)
    assert len(rows) == 2 and [r["mode"] for r in rows] == ["fwd", "fwdbwd"]
    for r in rows:
        assert r["status"] == "ok" and r["n_runs"] >= 3 * 4 and r["ms_lo"] <= r["ms"] <= r["ms_hi"]
        assert r["tflops"] == pytest.approx(r["flops"] / (r["ms"] * 1e-3) / 1e12)
    runs = [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]  # consecutive calls of one row
    assert runs == ["fwd", "fwdbwd", "fwd", "fwdbwd"]  # fwd fwdbwd | fwdbwd fwd | fwd fwdbwd: rounds alternate
    assert pooled([3.0, 1.0, 2.0, 10.0, 4.0]) == {"ms": 3.0, "ms_lo": 2.0, "ms_hi": 4.0, "n_runs": 5}
    s = providers.Setting(torch.device("cpu"), torch.float32, 1, 1, 64, 16, False, "fwd", sf_backend="reference")
    assert providers.device_label(providers.PROVIDERS["sdpa-flash"], s) == "SDPA (CPU flash kernel)"
    assert "CPU reference" in providers.device_label(providers.PROVIDERS["sparseflash"], s)
    gpu = dataclasses.replace(s, device=torch.device("cuda"))
    assert providers.device_label(providers.PROVIDERS["sdpa-flash"], gpu) == "SDPA flash"


def test_bad_configuration_is_rejected():
    base = defaults("sparsity", "cpu")
    with pytest.raises(ValueError, match="seq_lens"):
        BenchConfig(**{**base, "seq_lens": (0,)})
    with pytest.raises(ValueError, match="modes"):
        BenchConfig(**{**base, "modes": ("backward",)})
    with pytest.raises(ValueError, match="target densities"):
        BenchConfig(**{**base, "targets": (1.5,)})
    with pytest.raises(ValueError, match="providers must be names"):
        providers.get_providers("sparseflash,nope")
    with pytest.raises(ValueError, match="warmup_ms"):
        TimingConfig(rep_ms=0)
    with pytest.raises(SystemExit):
        main(["bench", "sparsity", "--densities", "2"])


# ----------------------------------------------------------------------------- end to end (CPU)
_TINY = ["--device", "cpu", "--seq-len", "128", "--tokens", "256", "--heads", "2", "--head-dim", "16",
         "--block-size", "32", "--rep-ms", "1", "--no-progress"]


def _png_ok(path):
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] > 200 and im.size[1] > 200


def test_sparsity_cli_end_to_end_on_cpu(tmp_path, capsys, frozen_gc):
    out = tmp_path / "sparsity"
    rc = main(["bench", "sparsity", *_TINY, "--pattern", "butterfly", "random", "--densities", "1", "0.25",
               "--mode", "fwd", "fwdbwd", "--backend", "reference", "--dtype", "fp32", "--out", str(out),
               "--providers", "sparseflash,sparseflash-dense,torch,torch-masked,sdpa-flash,sdpa-cudnn,flex"])
    assert rc == 0
    text = capsys.readouterr().out
    assert CPU_NOTE in text and "possible mismatch" not in text
    data = json.loads((out / "sparsity.json").read_text())
    rows = data["rows"]
    with open(out / "sparsity.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and tuple(csv_rows[0]) == COLUMNS
    assert data["meta"]["note"] == CPU_NOTE and data["meta"]["command"].startswith("sparseflash bench sparsity")
    assert all(r["device"] == "cpu" and CPU_NOTE in r["note"] for r in rows)
    # CUDA-only providers: skipped with one row and a note each, not crashed on
    for name in ("sdpa-cudnn", "flex"):
        skipped = [r for r in rows if r["provider"] == name]
        assert len(skipped) == 1 and skipped[0]["status"].startswith("unavailable")
        assert any(n.startswith(f"provider {name} skipped") for n in data["meta"]["notes"])
    ok = [r for r in rows if r["status"] == "ok"]
    # dense providers once per mode; sparse ones per mask point (2 patterns x 2 densities x 2 modes)
    assert sorted({r["provider"] for r in ok}) == ["sdpa-flash", "sparseflash", "sparseflash-dense", "torch",
                                                  "torch-masked"]
    assert len([r for r in ok if r["provider"] == "sparseflash"]) == 8
    assert len([r for r in ok if r["provider"] == "sparseflash-dense"]) == 2
    for r in ok:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["max_err"] < 1e-4, r
        pairs = r["flops"] / (4 * r["head_dim"] * {"fwd": 1, "fwdbwd": 3.5}[r["mode"]])
        assert pairs == pytest.approx(r["token_density"] * r["batch"] * r["heads"] * 128 * 128)
        assert r["tflops"] == pytest.approx(r["flops"] / r["ms"] / 1e9)
        if r["pattern"] == "dense":
            factor = {"fwd": 1, "fwdbwd": 3.5}[r["mode"]]
            assert r["rel_density"] == 1.0 and r["flops"] == 4 * 2 * 2 * 128 * 128 * 16 * factor
        else:
            assert r["mask_ms"] >= 0 and r["batch"] == 2
    quarter = [r for r in ok if r["pattern"] == "random" and r["param"] == "blocks_per_row=1"]
    assert quarter and all(r["rel_density"] == pytest.approx(0.25) for r in quarter)
    pngs = sorted(p.name for p in out.glob("*.png"))
    kinds, pats = ("runtime", "speedup", "tflops"), ("butterfly", "random")
    assert pngs == sorted(f"sparsity_{k}_{p}.png" for k in kinds for p in pats)
    for p in out.glob("*.png"):
        _png_ok(p)
    assert "| provider |" in (out / "sparsity_table.md").read_text()

    # the plot command redraws the same figures from the saved JSON, and from the CSV alone
    redraw = tmp_path / "redraw"
    assert main(["plot", str(out), "--out", str(redraw)]) == 0
    assert sorted(p.name for p in redraw.glob("*.png")) == pngs
    only_csv = tmp_path / "csv_only"
    only_csv.mkdir()
    (only_csv / "sparsity.csv").write_text((out / "sparsity.csv").read_text())
    rows_csv, _ = load_results(only_csv)
    assert len(rows_csv) == len(rows) and rows_csv[0]["causal"] is False and isinstance(rows_csv[0]["seq_len"], int)
    # ... from a CSV file alone: its butterfly and dense rows (one pattern's three figures; the loop over
    # patterns is drawn twice above)
    lines = (out / "sparsity.csv").read_text().splitlines(keepends=True)
    kept = [x for x in lines[1:] if next(csv.DictReader([lines[0], x]))["pattern"] in ("butterfly", "dense")]
    assert 0 < len(kept) < len(lines) - 1
    (only_csv / "sparsity.csv").write_text(lines[0] + "".join(kept))
    assert main(["plot", str(only_csv / "sparsity.csv"), "--out", str(tmp_path / "redraw_csv")]) == 0
    assert sorted(p.name for p in (tmp_path / "redraw_csv").glob("*.png")) == [p for p in pngs if "butterfly" in p]
    for p in (tmp_path / "redraw_csv").glob("*.png"):
        _png_ok(p)


def test_seqlen_cli_end_to_end_with_interpreter_or_reference(tmp_path, capsys, frozen_gc):
    out = tmp_path / "seqlen"
    rc = main(["bench", "seqlen", *_TINY[2:], "--device", "cpu", "--seq-len", "64", "128", "--mode", "fwd",
               "--causal", "--providers", "sparseflash,sparseflash-dense,torch-masked,sdpa-efficient",
               "--out", str(out)])
    assert rc == 0
    assert CPU_NOTE in capsys.readouterr().out
    rows, metas = load_results(out)
    assert metas[0]["bench"] == "seqlen"
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["seq_len"] for r in ok} == {64, 128}
    assert all(r["causal"] for r in rows)
    sf = [r for r in rows if r["provider"] == "sparseflash"]
    assert {r["pattern"] for r in sf} == {"butterfly"} and len(sf) == 2
    import os

    expect = "triton-interpreter" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "reference"
    assert {r["backend"] for r in sf} == {expect}
    assert all(r["status"] == "ok" for r in sf), [r["status"] for r in sf]
    for r in ok:
        assert r["max_err"] < 0.06, r  # bf16 outputs against the float32 reference
    assert sorted(p.name for p in out.glob("*.png")) == ["seqlen_memory.png", "seqlen_runtime.png"]
    for p in out.glob("*.png"):
        _png_ok(p)
    # without --check nothing is compared, and nothing is reported as a mismatch
    rc = main(["bench", "seqlen", *_TINY, "--seq-len", "64", "--mode", "fwd", "--providers", "torch",
               "--no-check", "--no-plot", "--out", str(tmp_path / "nocheck")])
    assert rc == 0 and "possible mismatch" not in capsys.readouterr().out
    rows, _ = load_results(tmp_path / "nocheck")
    assert rows and all(r["status"] == "ok" and math.isnan(r["max_err"]) for r in rows)


def test_oom_rows_are_kept_and_plotted(tmp_path):
    from sparseflash.experiments.bench.plots import plot_rows

    base = {c: None for c in COLUMNS}
    rows = []
    for n, status in ((256, "ok"), (512, "ok"), (1024, "OOM")):
        for prov, kind, pattern in (("torch", "dense", "dense"), ("sparseflash", "sparse", "butterfly")):
            st = status if prov == "torch" else "ok"
            rows.append({**base, "bench": "seqlen", "device": "cuda", "device_name": "fake GPU", "provider": prov,
                         "label": prov, "kind": kind, "pattern": pattern, "seq_len": n, "batch": 1, "heads": 1,
                         "head_dim": 16, "dtype": "bf16", "causal": False, "mode": "fwd", "status": st,
                         "ms": 1.0 * n if st == "ok" else float("nan"),
                         "peak_mem_mb": n / 8 if st == "ok" else float("nan"), "rel_density": 1.0})
    written = plot_rows(rows, tmp_path)
    assert sorted(Path(p).name for p in written) == ["seqlen_memory.png", "seqlen_runtime.png"]
    from sparseflash.experiments.bench.results import seqlen_table

    header, lines = seqlen_table(rows, "fwd")
    torch_line = next(line for line in lines if line[0] == "torch")
    assert torch_line[header.index("1024")] == "OOM"


def test_presets_and_defaults_resolve_without_a_gpu():
    from sparseflash.cli import build_parser
    from sparseflash.experiments.bench.cli import command_line, config_from_args

    parse = build_parser().parse_args
    cfg = config_from_args(parse(["bench", "sparsity", "--preset", "kernel-check", "--device", "cuda"]))
    assert (cfg.seq_lens, cfg.head_dims, cfg.heads, cfg.tokens) == ((4096, 16384), (64, 128), 16, 16384)
    assert cfg.dtype == "bf16"
    assert cfg.patterns == ("random", "butterfly") and cfg.targets == (1.0, 0.5, 0.25, 0.1)
    assert cfg.providers == ("sparseflash", "sparseflash-dense", "sdpa-flash", "sdpa-cudnn", "flex", "fa4", "fa4-dense")
    assert cfg.modes == ("fwd", "fwdbwd") and cfg.check and not cfg.causal
    assert [cfg.batch_for(n) for n in cfg.seq_lens] == [4, 1]
    # explicit options win over the preset; "all" modes expand
    cfg = config_from_args(parse(["bench", "sparsity", "--preset", "kernel-check", "--device", "cuda",
                                  "--seq-len", "8K", "--mode", "all", "--providers", "sparseflash", "flex",
                                  "--rep-ms", "50"]))
    assert cfg.seq_lens == (8192,) and cfg.modes == ("fwd", "bwd", "fwdbwd")
    assert cfg.providers == ("sparseflash", "flex") and cfg.timing.rep_ms == 50 and cfg.timing.warmup_ms == 25
    # the GPU full sweep of the issue, and the command line that reruns it
    full = config_from_args(parse(["bench", "sparsity", "--device", "cuda"]))
    assert full.patterns == ("butterfly", "local", "random") and full.seq_lens == (4096, 16384)
    assert full.head_dims == (64, 128) and full.modes == ("fwd", "fwdbwd") and not full.check
    again = config_from_args(parse(command_line(full).split()[1:]))
    assert again.as_dict() == full.as_dict()
    graph = config_from_args(parse(["bench", "sparsity", "--preset", "kernel-check", "--device", "cuda", "--cuda-graph"]))
    assert graph.timing.cuda_graph and not full.timing.cuda_graph and graph.timing.rep_ms == full.timing.rep_ms
    rerun = config_from_args(parse(command_line(graph).split()[1:])).as_dict()
    assert rerun == {**graph.as_dict(), "preset": None}  # the spelled-out command names no preset
    seq = config_from_args(parse(["bench", "seqlen", "--device", "cuda"]))
    assert seq.seq_lens == tuple(512 * 2**i for i in range(8)) and seq.patterns == ("butterfly",)
    with pytest.raises(ValueError, match="providers must be names"):
        config_from_args(parse(["bench", "seqlen", "--providers", "sdpa-fast"]))


def test_tune_configs_parse():
    from sparseflash.experiments.bench import tune_tiles
    from sparseflash.flash import tiles

    assert tune_tiles.parse_config("64,64,4,3") == (64, 64, 4, 3)
    assert tune_tiles.parse_config("64,64,4,3,168") == (64, 64, 4, 3, 168)
    assert tune_tiles.parse_config("64,64,4,3,,1") == (64, 64, 4, 3, None, True)
    assert tiles.TileConfig(*tune_tiles.parse_config("128,64,8,3,128,0")) == tiles.TileConfig(128, 64, 8, 3, 128, False)
    for bad in ("64,64,4", "64,,4,3"):
        with pytest.raises(ValueError, match="tile config"):
            tune_tiles.parse_config(bad)
    # 7 fields: more than a tile has
    with pytest.raises(ValueError, match=r"tile config is M,N,WARPS,STAGES\[,MAXNREG\[,Q_ROWS\]\] \(4 to 6 fields\)"):
        tune_tiles.parse_config("64,64,4,3,,1,264")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_timing_of_every_mode(tmp_path):
    """--cuda-graph times fwd, bwd (backward alone, its forward made outside the graph) and fwdbwd;
    mode bwd once invalidated the capture (its forward ran on the default stream) and the broken
    capture then failed every later row."""
    out = tmp_path / "graph"
    rc = main(["bench", "sparsity", "--device", "cuda", "--seq-len", "512", "--tokens", "1024", "--heads", "2",
               "--head-dim", "64", "--pattern", "random", "--densities", "1", "0.5", "--mode", "all",
               "--providers", "sparseflash", "--cuda-graph", "--rep-ms", "5", "--no-plot", "--no-progress",
               "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "sparsity.json").read_text())["rows"]
    assert sorted({r["mode"] for r in rows}) == ["bwd", "fwd", "fwdbwd"] and len(rows) == 6
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), [(r["mode"], r["note"]) for r in rows]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA calls")
def test_gpu_stream_ms_is_gpu_time_or_host_time_whichever_is_longer():
    """Eager timing (``stream_ms``): a GPU-bound call reads its GPU time (as graph replays do), a
    host-bound one its host time, the part do_bench's L2 flush used to hide at random."""
    import time

    from sparseflash.experiments.bench.timing import graph_ms, stream_ms

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gpu_bound = lambda: a @ a  # noqa: E731  ~0.2 ms of GPU, a few us of host
    g, e = graph_ms(gpu_bound, rep_ms=50), stream_ms(gpu_bound, 1, warmup_ms=10, rep_ms=50)
    assert abs(e - g) <= 0.1 * g, (e, g)

    def host_bound():  # 1 ms of host, then a tiny kernel
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-3:
            pass
        a[0, :8].add_(0)

    e = stream_ms(host_bound, 1, warmup_ms=5, rep_ms=30)
    assert 0.95 <= e <= 1.5, e


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles CUDA calls")
def test_gpu_kernel_ms_is_the_calls_own_kernels():
    """``kernel_ms``: the profiled kernels of an eager call, per call: a matmul's time (as a graph
    replay reads it) whatever the host adds around it, with the kernel named."""
    import time

    from sparseflash.experiments.bench.timing import graph_ms, kernel_ms

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = graph_ms(lambda: a @ a, rep_ms=50)

    def slow_host():  # 1 ms of host, then the matmul
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-3:
            pass
        return a @ a

    ms, names = kernel_ms(slow_host, calls=10)
    assert abs(ms - g) <= 0.15 * g, (ms, g, names)
    assert len(names) >= 1 and max(names.values()) >= 0.8 * ms


def _inspect_kernels(*argvs):
    """The rows `inspect_kernels --json` prints for each argument list, from one child process
    (outside the interpreter: it compiles for sm_90), which calls its main once per list (one
    start-up of torch and triton instead of one per list)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys\nfrom sparseflash.experiments.bench.inspect_kernels import main\n"
            "for argv in json.loads(sys.argv[1]):\n    assert main(['--json', *argv]) == 0\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == len(argvs), out.stdout[-2000:]
    return rows


@pytest.mark.skipif(not ptxas_available(), reason="needs the ptxas bundled with Linux triton wheels")
def test_inspect_kernels_row_alignment_for_hopper():
    """Compiled for sm_90 (no GPU needed), head_dim 40 (row stride 80 bytes, not a multiple of 16
    elements) gives the same kernels as head_dim 64 on the same tiles, thanks to the row-alignment
    hint: the async-copy K/V pipeline (same shared memory), no extra spills, loops as long. Without
    the hint the d=40 forward had 24 KB of shared memory and a 458-instruction loop (d=64: 344)."""
    tiles = ["--tile", "fwd=128,64,8,3", "--tile", "dkdv=32,128,4,3", "--tile", "dq=64,64,4,3"]
    d40, d64 = ({r["kernel"]: r for r in rows}
                for rows in _inspect_kernels(["--head-dim", "40", *tiles], ["--head-dim", "64", *tiles]))
    assert sorted(d40) == ["bwd_dkdv_kernel", "bwd_dq_kernel", "fwd_kernel"]
    problems = []
    for name, a in d40.items():
        b = d64[name]
        loop_a, loop_b = (int(r["loops"].split("/")[0]) for r in (a, b))
        # spills vary a little with the triton version (dK/dV at 3.9: 32 vs 24 bytes; at 3.6: 144
        # vs 104); without the hint d=40 dK/dV spilled 840 bytes
        if not (a["regs"] <= 255 and a["shared"] == b["shared"] and a["stack"] <= b["stack"] + 64
                and loop_a <= 1.05 * loop_b):
            problems.append((name, {k: (a[k], b[k]) for k in ("regs", "shared", "stack", "loops")}))
    assert not problems, problems


@pytest.mark.skipif(not ptxas_available(), reason="needs the ptxas bundled with Linux triton wheels")
def test_wide_head_dim_default_tiles_fit_hopper():
    """The default tiles past head_dim 128, compiled for sm_90 (no GPU needed), fit in shared
    memory in bf16 and in fp32 (the bf16 dQ tile would need 303 KB in fp32; fp32 keeps smaller ones)."""
    extras = ([], ["--fp32"])
    for extra, rows in zip(extras, _inspect_kernels(*(["--head-dim", "256", *extra] for extra in extras))):
        assert sorted(r["kernel"] for r in rows) == ["bwd_dkdv_kernel", "bwd_dq_kernel", "fwd_kernel"]
        too_big = [(r["kernel"], r["shared"]) for r in rows if r["shared"] > 227 * 1024]
        assert not too_big, (extra, too_big)


# ----------------------------------------------------------------- host cost per call against GPU time
@pytest.mark.interpreter
def test_host_bench_cpu_smoke(tmp_path):
    """`bench.host` on CPU (kernels as no-ops): every provider x setting x pass gets a positive
    host time, the CSV and JSON agree, and the real kernels are back afterwards."""
    from sparseflash.experiments.bench import host
    from sparseflash.flash import kernels

    before = kernels.fwd_kernel
    assert host.main(["--device", "cpu", "--out", str(tmp_path), "--seq-len", "128", "--tokens", "256",
                      "--heads", "2", "--head-dims", "16", "--blocks", "1", "--calls", "3"]) == 0
    assert kernels.fwd_kernel is before
    rows = list(csv.DictReader(open(tmp_path / "host.csv")))
    data = json.loads((tmp_path / "host.json").read_text())
    # dense: our 4 + sdpa, + the autograd floor without key_lengths; mask: our 4; x key_lengths x 2 passes
    assert len(rows) == len(data["rows"]) == 2 * (6 + 5 + 4 + 4)
    assert {r["provider"] for r in rows} == set(host.PROVIDERS)
    assert all(r["part"] == "host" and float(r["host_us"]) > 0 for r in rows)
    assert {(r["mask"], r["key_lengths"]) for r in rows} == {("dense", "False"), ("dense", "True"),
                                                             ("random1", "False"), ("random1", "True")}
    assert "sparseflash-unbound" in host.table(data["rows"])


def test_a_rerun_replaces_the_table_instead_of_adding_files(tmp_path):
    """Results are current truth: write_results writes one table per benchmark under fixed names,
    every row stamped; a re-run (another commit) replaces it, history is git's."""
    from sparseflash.experiments.bench.results import write_results

    def rows(commit, ms):
        return [dict(bench="sparsity", provider="sparseflash", pattern="random", mode="fwd", seq_len=256, head_dim=16,
                     ms=ms, status="ok", device_name="GPU", torch="t", triton="tr", commit=commit, date="2026-01-01")]

    write_results(rows("aaaaaaa", 1.0), {"command": "first"}, tmp_path, "sparsity")
    write_results(rows("bbbbbbb", 2.0), {"command": "second"}, tmp_path, "sparsity")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sparsity.csv", "sparsity.json", "sparsity_table.md"]
    got, metas = load_results(tmp_path)
    assert [(r["commit"], r["ms"]) for r in got] == [("bbbbbbb", 2.0)] and metas[0]["command"] == "second"
    with open(tmp_path / "sparsity.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert all(row[k] for k in ("device_name", "torch", "triton", "commit", "date"))
