"""Tests of sparseflash.analysis: pictures, row statistics, reach (against token-level brute force),
the zoo table, density scaling and the `sparseflash patterns` command."""

import csv
import json
import math
import struct

import pytest
import torch

from sparseflash import BlockMask
from sparseflash.analysis import (
    density_sweep, fit_exponents, format_table, plot_density, plot_mask, plot_zoo, reach_layers, row_stats, zoo,
    zoo_table,
)
from sparseflash.cli import main
from sparseflash.patterns import butterfly, causal, dense, dilated, fixed, local, random, stack, strided

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) of a PNG, after checking its signature and IHDR chunk."""
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def ink_fraction(path):
    """Fraction of pixels that are not near-white: the picture actually shows something."""
    import matplotlib.image

    img = matplotlib.image.imread(path)[..., :3]
    return float((img.mean(-1) < 0.9).mean())


# ---------------------------------------------------------------- pictures
def test_plot_mask_writes_png(tmp_path):
    m = butterfly(1000, block_size=64)
    ax = m.plot(tmp_path / "b.png")
    w, h = png_size(tmp_path / "b.png")
    assert w >= 400 and h >= 400
    assert 0.02 < ink_fraction(tmp_path / "b.png") < 0.6
    title = ax.get_title()
    assert "N=1000" in title and "block 64" in title and "grid 16x16" in title
    st = row_stats(m)
    assert f"density {m.density():.3f}" in title
    assert f"min {st['rows_min']} / mean {st['rows_mean']:.1f} / max {st['rows_max']}" in title
    # the token axes cover exactly the sequence, not the padded grid
    assert ax.get_xlim() == (0, 1000) and ax.get_ylim() == (1000, 0)


def test_plot_mask_on_axes_heads_and_big_grids(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    axes = fig.subplots(1, 3)
    m = stack([local(300, 20, block_size=16), random(300, 2, block_size=16, heads=2)])
    for h, ax in enumerate(axes):
        assert plot_mask(m, ax=ax, slice_index=(0, h), title=f"head {h}") is ax
        assert ax.get_title().startswith(f"head {h}\n") and f"slice (0, {h}) of 1x3" in ax.get_title()
    cross = local(100, 30, block_size=(16, 8), seq_k=250)
    assert "seq_q=100, seq_k=250, block 16x8" in plot_mask(cross).get_title()
    big = local(2048 * 8, 8, block_size=8)  # 2048 x 2048 blocks: drawn OR-pooled
    plot_mask(big, path=tmp_path / "big.png")
    assert png_size(tmp_path / "big.png")[0] > 0 and ink_fraction(tmp_path / "big.png") > 0.001
    assert "cell = 4x4 blocks" in plot_mask(big).get_title()
    with pytest.raises(ValueError, match="slice_index"):
        plot_mask(m, slice_index=(0, 3))
    with pytest.raises(TypeError, match="slice_index"):
        plot_mask(m, slice_index=0)
    with pytest.raises(TypeError, match="BlockMask"):
        plot_mask(m.layout)


def test_row_stats():
    st = row_stats(local(16 * 20, 16, block_size=16))
    assert (st["rows_min"], st["rows_max"], st["cols_min"], st["cols_max"]) == (2, 3, 2, 3)
    assert st["rows_mean"] == pytest.approx((20 * 3 - 2) / 20)
    r = random(4096, 5, block_size=64, heads=3)
    st = row_stats(r)
    assert st["rows_min"] == st["rows_max"] == 5 and st["cols_mean"] == pytest.approx(5)
    assert st["cols_max"] > 5  # random columns are unbalanced: the backward pass sees it


# ---------------------------------------------------------------- reach
def brute_reach(mask, is_causal, target):
    """Token-level: smallest L with (T | I)^L covering the target pairs, T[i, j] = i attends j."""
    n = mask.seq_q
    T = mask.to_dense().any(dim=1)  # union of heads: [B', n, n]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if is_causal:
        T = T & (j <= i)
    want = torch.ones(n, n, dtype=torch.bool) if target == "all" else (j <= i)
    worst = 0
    for Tb in T:
        step = (Tb | torch.eye(n, dtype=torch.bool)).float()
        R, L = torch.eye(n, dtype=torch.bool), 0
        while not R[want].all():
            nxt = (step @ R.float()) > 0
            if torch.equal(nxt, R):
                return None
            R, L = nxt, L + 1
        worst = max(worst, L)
    return worst


def reach_cases():
    cases = []
    for n, b in ((64, 8), (67, 8), (65, 8), (100, 16), (9, 8), (1, 8), (40, 1)):
        cases += [
            (f"local-{n}-{b}", local(n, b, block_size=b)), (f"local0-{n}-{b}", local(n, 0, block_size=b)),
            (f"bfly-{n}-{b}", butterfly(n, block_size=b)), (f"strided-{n}-{b}", strided(n, 3 * b, block_size=b)),
            (f"fixed-{n}-{b}", fixed(n, 2 * b, 1, block_size=b, causal=False)),
            (f"dilated-{n}-{b}", dilated(n, 6 * b, 2 * b, block_size=b)), (f"causal-{n}-{b}", causal(n, block_size=b)),
            (f"dense-{n}-{b}", dense(n, block_size=b)),
        ]
        for seed in range(4):  # random without the diagonal: same-block pairs need a cycle
            cases.append((f"rand{seed}-{n}-{b}", random(n, 2, block_size=b, heads=1 + seed % 2, seed=seed)))
    cases.append(("batch", BlockMask(torch.stack([local(64, 8, block_size=8).layout[0], dense(64, block_size=8).layout[0]]), 8, 64)))
    cases.append(("rand-nodiag", BlockMask(torch.tensor([[0, 1], [1, 0]], dtype=torch.bool), 8, 16)))
    # a one-token tail block needs no cycle back to itself (its cycle, 3, exceeds the diameter, 2)
    tail = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    cases.append(("tail-1-token", BlockMask(tail, 8, 17)))
    return cases


@pytest.mark.parametrize("name,mask", reach_cases(), ids=[c[0] for c in reach_cases()])
def test_reach_matches_token_brute_force(name, mask):
    for is_causal in (False, True):
        for target in ("all", "past"):
            assert reach_layers(mask, causal=is_causal, target=target) == brute_reach(mask, is_causal, target), (is_causal, target)


def test_reach_known_values():
    for nb in (2, 8, 32, 128):
        assert reach_layers(butterfly(nb * 16, block_size=16)) == int(math.log2(nb))  # a hypercube: one bit per layer
        assert reach_layers(local(nb * 16, 16, block_size=16)) == nb - 1
        assert reach_layers(causal(nb * 16, block_size=16), causal=True) is None
        assert reach_layers(causal(nb * 16, block_size=16), causal=True, target="past") == 1
    # Sparse Transformer: strided (one head or split over two) reaches the whole past in 2 layers
    n, l = 64 * 64, 8 * 64
    assert reach_layers(strided(n, l, block_size=64), causal=True, target="past") == 2
    split = stack([local(n, l - 1, block_size=64, causal=True), dilated(n, n, l, block_size=64, causal=True)])
    assert reach_layers(split, causal=True, target="past") == 2
    # the window head alone moves 8 blocks per layer: 63 blocks back take ceil(63 / 8) layers
    assert reach_layers(BlockMask(split.layout[:, :1], 64, n), causal=True, target="past") == 8
    # dilation by two blocks splits the blocks into two classes that never meet
    assert reach_layers(dilated(n, n, 128, block_size=64)) is None


def test_reach_errors():
    with pytest.raises(ValueError, match="self-attention"):
        reach_layers(local(100, 8, block_size=16, seq_k=200))
    with pytest.raises(ValueError, match="square"):
        reach_layers(local(128, 8, block_size=(16, 32)))
    with pytest.raises(ValueError, match="target"):
        reach_layers(local(128, 8, block_size=16), target="future")
    with pytest.raises(TypeError, match="causal"):
        reach_layers(local(128, 8, block_size=16), causal=1)


# ---------------------------------------------------------------- zoo, table, density
def test_zoo_and_table():
    entries = zoo(1000, block_size=64)
    names = [e.name for e in entries]
    assert len(names) == len(set(names)) >= 12 and {"butterfly", "bigbird", "longformer", "strided", "fixed", "random"} <= set(names)
    for e in entries:
        assert (e.mask.seq_q, e.mask.seq_k, e.mask.block_size) == (1000, 1000, (64, 64)) and e.build_ms >= 0
    rows = zoo_table(entries)
    by = {r["pattern"]: r for r in rows}
    assert by["dense"]["reach_all"] == 1 and by["dense"]["density"] == 1.0
    assert by["causal"]["reach_all"] is None and by["causal"]["reach_past"] == 1
    assert by["causal"]["token_density"] == pytest.approx(1001 / 2000)
    assert by["butterfly"]["rows_min"] == by["butterfly"]["rows_max"] == 5  # 16 blocks: 1 + log2 16
    assert by["strided split heads"]["heads"] == 2
    text = format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows) and "never" in text and lines[0].split()[0] == "pattern"
    assert len({len(line) for line in lines}) == 1  # aligned


def test_density_exponents_and_plot(tmp_path):
    lengths = [16 * 2**k for k in range(3, 10)]
    rows = density_sweep(lengths, block_size=16)
    ex = fit_exponents(rows)
    assert ex["dense"] == pytest.approx(2, abs=0.01) and ex["causal"] == pytest.approx(2, abs=0.02)
    for name in ("local", "dilated", "random", "longformer", "bigbird", "global tokens"):
        assert ex[name] == pytest.approx(1, abs=0.05), name
    assert 1.05 < ex["butterfly"] < 1.25  # N log N
    for name in ("strided", "fixed", "strided split heads"):
        assert ex[name] == pytest.approx(1.5, abs=0.1), name
    plot_density(rows, tmp_path / "d.png", exponents=ex)
    w, h = png_size(tmp_path / "d.png")
    assert w > 1000 and h > 400 and ink_fraction(tmp_path / "d.png") > 0.01
    with pytest.raises(ValueError, match="lengths"):
        density_sweep([], block_size=16)
    with pytest.raises(ValueError, match="lengths"):
        density_sweep([100, 0], block_size=16)


def test_plot_zoo(tmp_path):
    entries = zoo(512, block_size=32)
    plot_zoo(entries, tmp_path / "z.png", title="zoo")
    w, h = png_size(tmp_path / "z.png")
    assert w > 1500 and h > 1500 and ink_fraction(tmp_path / "z.png") > 0.05


def test_cli_patterns(tmp_path, capsys):
    out = tmp_path / "zoo"
    assert main(["patterns", "--seq-len", "777", "--block-size", "32", "--out", str(out), "--lengths", "128", "256", "512", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "pattern" in printed and "butterfly" in printed and "wrote" in printed
    for f in ("zoo_777.png", "density.png"):
        png_size(out / f)
    rows = list(csv.DictReader(open(out / "zoo_777.csv")))
    data = json.load(open(out / "zoo_777.json"))
    assert len(rows) == len(data["rows"]) == len(zoo(777, block_size=32))
    assert data["seq_len"] == 777 and data["block_size"] == 32 and "torch" in data
    assert {r["reach_all"] for r in rows} >= {"never", "1"}
    assert any(r["reach_all"] is None for r in data["rows"])
    sweep = json.load(open(out / "density.json"))["rows"]
    assert {r["seq_len"] for r in sweep} == {128, 256, 512, 1024}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["patterns", "--seq-len", "0", "--out", str(out)])
    assert e.value.code == 2 and "--seq-len" in capsys.readouterr().err
