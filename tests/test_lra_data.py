"""Tests of sparseflash.experiments.lra.data: the ListOps and Pathfinder generators (grammar,
semantics, statistics, geometry, release layout, determinism across worker counts), the loaders of
every task on tiny fixtures in the release formats (ListOps tsv, AAN tsv, aclImdb, CIFAR-10 python
pickles, Pathfinder PNG + metadata), their caches and their errors, and the `sparseflash lra` commands."""

import csv
import os
import pickle
import random
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from sparseflash.cli import main
from sparseflash.experiments.lra import cli as lra_cli
from sparseflash.experiments.lra.data import TASKS, get_dataset
from sparseflash.experiments.lra.data import listops as lo
from sparseflash.experiments.lra.data import pathfinder as pf
from sparseflash.experiments.lra.data.datasets import DatasetNotFoundError, MalformedDataError, rgb_to_gray

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def release_tuple(node):
    """A tree in the LRA generator's own form: ((((op, a1), a2) ...), ']')."""
    if isinstance(node, int):
        return node
    op, children = node
    t = (op, release_tuple(children[0]))
    for c in children[1:]:
        t = (t, release_tuple(c))
    return (t, "]")


def release_to_string(t) -> str:
    """LRA's to_string, as written there: every pair in parentheses."""
    if isinstance(t, tuple):
        return "( " + release_to_string(t[0]) + " " + release_to_string(t[1]) + " )"
    return str(t)


# -------------------------------------------------------------------------------------------- ListOps
@pytest.fixture(scope="module")
def listops_sample():
    return lo.generate(400, seed=3)


def test_listops_text_matches_release_to_string():
    rng = random.Random(0)
    for _ in range(200):
        tree, _ = lo.generate_tree(rng, max_depth=4, max_args=4)
        assert lo.to_text(tree) == release_to_string(release_tuple(tree))
        assert lo.parse(lo.to_text(tree)) == tree
    assert lo.to_text(("[MIN", [3, 4])) == "( ( ( [MIN 3 ) 4 ) ] )"


def test_listops_generated_samples_parse_and_evaluate(listops_sample):
    samples, stats = listops_sample
    assert len(samples) == 400 and len({s.text for s in samples}) == 400
    for s in samples:
        tree = lo.parse(s.text)  # the exact release grammar, parentheses included
        toks = lo.tokenize(s.text)
        value, depth = lo.evaluate(toks)
        assert value == s.label == lo.value_of(tree)
        assert 500 < s.length < 2000 and s.length == len(toks) == lo.tree_stats(tree)["length"]
        assert depth == lo.tree_stats(tree)["depth"] <= 10
        assert set(toks) <= set(lo.VOCAB[1:])


def test_listops_statistics_match_lra(listops_sample):
    """Acceptance ~8%, mean length ~1060, labels 0 and 9 ~17% each (ANCHORS); uniform operators,
    2-10 arguments (mean 6), trees reaching depth 10."""
    samples, stats = listops_sample
    assert 0.06 < stats["acceptance"] < 0.11, stats
    lengths = np.array([s.length for s in samples])
    assert 950 < lengths.mean() < 1170
    labels = Counter(s.label for s in samples)
    assert 0.11 < labels[0] / 400 < 0.24 and 0.11 < labels[9] / 400 < 0.24
    assert all(labels[k] / 400 < 0.13 for k in range(1, 9))
    ops, nargs, depths = Counter(), [], []
    for s in samples:
        st = lo.tree_stats(lo.parse(s.text))
        ops += st["ops"]
        nargs += st["nargs"]
        depths.append(st["depth"])
    total = sum(ops.values())
    assert total > 50000
    assert all(0.24 < ops[o] / total < 0.26 for o in lo.OPERATORS), ops
    assert min(nargs) == 2 and max(nargs) == 10 and 5.85 < np.mean(nargs) < 6.15
    assert max(depths) == 10 and np.mean(np.array(depths) == 10) > 0.9


def test_listops_bounds_follow_parameters():
    samples, _ = lo.generate(150, seed=1, min_len=10, max_len=60, max_depth=4, max_args=3)
    for s in samples:
        st = lo.tree_stats(lo.parse(s.text))
        assert 10 < s.length < 60 and st["depth"] <= 4 and max(st["nargs"], default=2) <= 3
    with pytest.raises(ValueError, match="min_len"):
        lo.generate(5, min_len=100, max_len=101)
    with pytest.raises(ValueError, match="num"):
        lo.generate(0)


@pytest.mark.parametrize("text,value", [
    ("( ( ( [MED 1 ) 2 ) ] )", 1), ("( ( ( ( [MED 3 ) 1 ) 2 ) ] )", 2), ("( ( ( [SM 7 ) 5 ) ] )", 2),
    ("( ( ( [MAX ( ( ( [MIN 4 ) 6 ) ] ) ) 3 ) ] )", 4), ("( ( ( ( ( [MED 9 ) 0 ) 9 ) 0 ) ] )", 4), ("7", 7),
])
def test_listops_semantics(text, value):
    assert lo.evaluate(lo.tokenize(text))[0] == value
    assert lo.value_of(lo.parse(text)) == value


@pytest.mark.parametrize("tokens,match", [
    (["[MIN", "3"], "not closed"), (["[MIN", "3", "]", "4"], "extra token"), (["]"], "closes no operator"),
    (["[MIN", "]"], "without arguments"), (["[FOO", "1", "]"], "unknown"), ([], "no tokens"),
])
def test_listops_evaluate_rejects_malformed(tokens, match):
    with pytest.raises(ValueError, match=match):
        lo.evaluate(tokens)


def test_listops_encode():
    text = "( ( ( [SM ( ( ( [MED 3 ) 4 ) ] ) ) 9 ) ] )"
    assert lo.encode(text).tolist() == [14, 13, 4, 5, 15, 10, 15]
    for bad in ("( ( ( [FIRST 1 ) 2 ) ] )", "<pad>", "12", "[MINX 1 ]"):
        with pytest.raises(lo.UnknownTokenError, match="text 4: unknown ListOps token"):
            lo.encode(bad, 4)


@pytest.mark.parametrize("text", ["( ( [MIN 3 ) 4 ) ] )", "( ( ( [MIN 3 ) 4 ) ] ) )", "( ( ( [MIN 3 4 ) ] )"])
def test_listops_parse_rejects_wrong_parentheses(text):
    with pytest.raises(ValueError):
        lo.parse(text)


def test_write_listops_layout_splits_and_determinism(tmp_path):
    a = lo.write_listops(tmp_path / "a", train=300, val=60, test=60, seed=5, workers=1, show_progress=False)
    lo.write_listops(tmp_path / "b", train=300, val=60, test=60, seed=5, workers=2, show_progress=False)
    lo.write_listops(tmp_path / "c", train=300, val=60, test=60, seed=6, workers=1, show_progress=False)
    texts = {}
    for split, n in (("train", 300), ("val", 60), ("test", 60)):
        fa = tmp_path / "a" / "listops-1000" / f"basic_{split}.tsv"
        assert fa.read_bytes() == (tmp_path / "b" / "listops-1000" / f"basic_{split}.tsv").read_bytes()
        assert fa.read_bytes() != (tmp_path / "c" / "listops-1000" / f"basic_{split}.tsv").read_bytes()
        assert fa.read_text().startswith("Source\tTarget\n")
        rows = lo.read_tsv(fa)
        assert len(rows) == n
        texts[split] = {t for t, _ in rows}
    assert not (texts["train"] & texts["val"] or texts["train"] & texts["test"] or texts["val"] & texts["test"])
    assert a["sizes"] == {"train": 300, "val": 60, "test": 60}


def test_split_lengths_are_the_written_split_s(tmp_path):
    """`split_lengths` counts, without writing, the tokens of the split `write_listops` writes with the
    same arguments: equal lengths in order, the tsv's sha256, and the stream statistics the command prints."""
    import hashlib

    summary = lo.write_listops(tmp_path, train=120, val=30, test=40, seed=7, workers=1, show_progress=False)
    for split, n in (("test", 40), ("val", 30)):
        rec = lo.split_lengths(split, train=120, val=30, test=40, seed=7, bin_width=250)
        tsv = tmp_path / "listops-1000" / f"basic_{split}.tsv"
        assert rec["lengths"] == [len(lo.tokenize(t)) for t, _ in lo.read_tsv(tsv)]
        assert rec["sha256"] == hashlib.sha256(tsv.read_bytes()).hexdigest()
        assert rec["count"] == n and rec["mean"] == pytest.approx(np.mean(rec["lengths"]))
        assert (rec["min"], rec["max"]) == (min(rec["lengths"]), max(rec["lengths"]))
        assert sum(rec["histogram"].values()) == n and all(int(k) % 250 == 0 for k in rec["histogram"])
        assert rec["generator"] == {"train": 120, "val": 30, "test": 40, "seed": 7, "min_len": 500, "max_len": 2000,
                                    "max_depth": 10, "max_args": 10}
        assert rec["stream"]["examples"] == 190
        assert rec["stream"]["labels"] == {str(k): v for k, v in summary["labels"].items()}
        assert rec["stream"]["mean_length"] == summary["mean_length"]
    with pytest.raises(ValueError, match="split"):
        lo.split_lengths("dev", train=10, val=2, test=2)
    with pytest.raises(ValueError, match="test must be"):
        lo.split_lengths("test", train=10, val=2, test=0)


# ----------------------------------------------------------------------------------------- Pathfinder
def test_pathfinder_parameters_are_lra_s():
    p = pf.params_for(32, "hard")
    assert (p.padding, p.margins, p.seed_distance, p.marker_radius, p.paddle_length, p.paddle_thickness,
            p.continuity) == (1, (1,), 7, 1.5, 2, 0.5, 1.0)
    assert (p.contour_length, p.distractor_length, p.num_distractors) == (14, 4, 5)
    assert pf.params_for(128, "hard").margins == (2, 3) and pf.params_for(128).seed_distance == 20
    assert pf.params_for(256, "easy").padding == 22 and pf.params_for(256, "easy").contour_length == 6
    assert pf.params_for(64, "medium").num_distractors == 22 // 3
    with pytest.raises(ValueError, match="resolution"):
        pf.params_for(48)
    with pytest.raises(ValueError, match="difficulty"):
        pf.params_for(32, "extreme")
    with pytest.raises(ValueError, match="label"):
        pf.render(p, np.random.default_rng(0), 2)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        pf.render(p, 0, 1)


def _disk(r):
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return x * x + y * y <= r * r


@pytest.mark.parametrize("resolution,difficulty,n,fidelity",
                         [(32, "hard", 60, "clean"), (32, "easy", 40, "clean"), (64, "easy", 20, "clean"),
                          (128, "hard", 4, "clean"), (256, "hard", 6, "clean"), (32, "hard", 60, "release"),
                          (64, "hard", 8, "release")])
def test_pathfinder_geometry_and_markers(resolution, difficulty, n, fidelity):
    """On rendered images: each target snake is one chain of paddles (its drawn pixels connect once
    the inter-paddle gaps, at most 2 * (margin + 2), are bridged); the markers sit on the tips of
    the snakes they claim, the same snake exactly when the label is 1. Clean images also: no pixel
    is drawn by two snakes, nearly every distractor placed, markers on drawn pixels of their own
    snake (release images break these three by design: targets may touch, distractor seeds mostly
    fail, a distractor may cover snake 1's last paddle). Also reported: how often plain pixel
    connectivity of the whole image (no snake identities, gaps bridged by margin + 1) agrees with
    the label."""
    p = pf.params_for(resolution, difficulty, fidelity)
    clean = fidelity == "clean"
    agree = {0: [], 1: []}
    for i in range(n):
        label = i % 2
        img, lay = pf.render(p, np.random.default_rng([11, i]), label, return_layers=True)
        assert img.dtype == np.uint8 and img.shape == (resolution, resolution) and img.max() == 255
        ids, m = lay["ids"], lay["margin"]
        if clean:
            assert lay["count"].max() <= 1, "a pixel is drawn by two snakes"
            assert lay["num_distractors"] >= p.num_distractors - 2
        for s in (1, 2):
            drawn = (ids == s) if clean else (ids == s) | (lay["count"] > 1)
            comp, k = ndimage.label(ndimage.binary_dilation(drawn, _disk(m + 2)))
            o, t = lay["origins"][s - 1], lay["terminals"][s - 1]
            assert comp[o] == comp[t] != 0, f"target snake {s} is not one chain"
            assert k == 1 or not clean
        tips, snakes = lay["tips"], lay["tip_snakes"]
        if clean:
            assert [ids[t] for t in tips] == list(snakes), "a marker is not on a drawn pixel of its snake"
        assert (snakes[0] == snakes[1]) == bool(label)
        assert tips[0] == lay["origins"][snakes[0] - 1] and tips[1] == lay["terminals"][snakes[1] - 1]
        assert all(img[t] >= 0.75 * 255 for t in tips)  # markers are as bright as the brightest paddles
        comp, _ = ndimage.label(ndimage.binary_dilation(img >= 32, _disk(m + 1)))  # above the Lanczos rings
        agree[label].append((comp[tips[0]] == comp[tips[1]]) == bool(label))
    print(f"\npathfinder{resolution} {difficulty} {fidelity}: whole-image pixel connectivity agrees with the label "
          f"for {np.mean(agree[1]):.2f} of label-1 and {np.mean(agree[0]):.2f} of label-0 images")
    assert np.mean(agree[1]) >= 0.9  # connected markers are always pixel-connected along their snake


def test_pathfinder_render_is_deterministic():
    p = pf.params_for(32, "medium")
    a = pf.render(p, np.random.default_rng([1, 2]), 1)
    b = pf.render(p, np.random.default_rng([1, 2]), 1)
    c = pf.render(p, np.random.default_rng([1, 3]), 1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def _tree_bytes(root: Path) -> dict:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def pf_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("pf")
    pf.write_pathfinder(root / "w1", 32, "hard", 50, seed=4, workers=1, per_batch=20, show_progress=False)
    pf.write_pathfinder(root / "w2", 32, "hard", 50, seed=4, workers=2, per_batch=20, show_progress=False)
    return root


def test_write_pathfinder_is_identical_for_any_worker_count(pf_release):
    a, b = _tree_bytes(pf_release / "w1"), _tree_bytes(pf_release / "w2")
    assert len(a) == 50 + 3 + 1 and a == b  # images, 3 metadata files, generation.json


def test_write_pathfinder_resumes_an_interrupted_run(pf_release, tmp_path):
    """A run cut off after its first batch folder (later batches' metadata missing, images partly
    written, generation.json incomplete) and resumed ends byte-identical to one uninterrupted run."""
    import json

    out = tmp_path / "cut"
    shutil.copytree(pf_release / "w1", out)
    folder = out / "pathfinder32" / "curv_contour_length_14"
    for b in (1, 2):
        (folder / "metadata" / f"{b}.npy").unlink()
    shutil.rmtree(folder / "imgs" / "2")
    (folder / "imgs" / "1" / "sample_3.png").write_bytes(b"half a png")
    gen = folder / pf.GENERATION_FILE
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "complete": False}))
    with pytest.raises(MalformedDataError, match="unfinished generation"):
        get_dataset("pathfinder32", out, "train", cache_dir=tmp_path / "cache")
    with pytest.raises(FileExistsError, match="--resume"):
        pf.write_pathfinder(out, 32, "hard", 50, seed=4, workers=1, per_batch=20, show_progress=False)
    with pytest.raises(ValueError, match=r"differs in \['num'\]"):
        pf.write_pathfinder(out, 32, "hard", 60, seed=4, workers=1, per_batch=20, resume=True, show_progress=False)
    with pytest.raises(ValueError, match="exclude each other"):
        pf.write_pathfinder(out, 32, "hard", 50, seed=4, per_batch=20, resume=True, overwrite=True)
    summary = pf.write_pathfinder(out, 32, "hard", 50, seed=4, workers=1, per_batch=20, resume=True,
                                  show_progress=False)
    assert summary["resumed_batches"] == 1 and summary["label_ones"] == 25
    assert _tree_bytes(out) == _tree_bytes(pf_release / "w1")
    assert len(get_dataset("pathfinder32", out, "train", cache_dir=tmp_path / "cache")) == 40


def test_write_pathfinder_layout_metadata_and_balance(pf_release, tmp_path):
    folder = pf_release / "w1" / "pathfinder32" / "curv_contour_length_14"
    assert sorted(p.name for p in (folder / "imgs").iterdir()) == ["0", "1", "2"]
    assert sorted(p.name for p in (folder / "metadata").iterdir()) == ["0.npy", "1.npy", "2.npy"]
    listed = set()
    for b, n in ((0, 20), (1, 20), (2, 10)):
        text = (folder / "metadata" / f"{b}.npy").read_text()
        rows = [line.split(" ") for line in text.splitlines()]
        assert text.endswith("\n") and len(rows) == n
        labels = []
        for i, row in enumerate(rows):
            assert len(row) == 11 and row[0] == f"imgs/{b}" and row[1] == f"sample_{i}.png" and row[2] == str(i)
            assert row[4:] == ["1.0", "14", "4", "2", "0.5", "1", "1"]
            labels.append(int(row[3]))
            path = folder / row[0] / row[1]
            assert png_size(path) == (32, 32)
            with Image.open(path) as im:
                assert im.mode == "L"
            listed.add(path)
        assert sorted(Counter(labels).values()) == [n // 2, n // 2]
    assert listed == set((folder / "imgs").rglob("*.png"))
    with pytest.raises(FileExistsError, match="overwrite"):
        pf.write_pathfinder(pf_release / "w1", 32, "hard", 5, workers=1, show_progress=False)
    other = pf.write_pathfinder(tmp_path, 32, "hard", 6, seed=5, workers=1, show_progress=False)
    img_a = (folder / "imgs" / "0" / "sample_0.png").read_bytes()
    assert (Path(other["folder"]) / "imgs" / "0" / "sample_0.png").read_bytes() != img_a


def test_pathfinder_split_and_with_rows_locate_a_run_s_training_images(pf_release, tmp_path):
    """`pathfinder_split` gives the generation indices each split reads, and `with_rows` reads any
    of them: a prefix of a folder made again (same seed) can be split into images a run trained on
    and images it never saw."""
    from sparseflash.experiments.lra.data import pathfinder_split

    root, cache = pf_release / "w1", tmp_path / "cache"
    splits = {s: get_dataset("pathfinder32", root, s, cache_dir=cache) for s in ("train", "val", "test")}
    parts = [pathfinder_split(50, s) for s in ("train", "val", "test")]
    assert [len(p) for p in parts] == [40, 5, 5]
    assert sorted(np.concatenate(parts).tolist()) == list(range(50))
    for s, rows in zip(("train", "val", "test"), parts):
        again = splits["train"].with_rows(rows)
        assert len(again) == len(rows) and again.store_size == 50 and again.fidelity == splits[s].fidelity
        for i in (0, len(rows) - 1):
            assert torch.equal(again[i]["tokens"], splits[s][i]["tokens"]) and again[i]["label"] == splits[s][i]["label"]
    assert not np.array_equal(pathfinder_split(50, "train", seed=1), parts[0])
    with pytest.raises(ValueError, match=r"rows must be .* \[0, 50\)"):
        splits["train"].with_rows([0, 50])


# ------------------------------------------------------------------------------------------ fixtures
def write_png(path: Path, arr: np.ndarray):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr.astype(np.uint8)).save(path)


def make_pathfinder_fixture(root: Path, res: int, folder="curv_contour_length_14", n=20, binary_meta=False):
    base = root / f"pathfinder{res}" / folder
    rng = np.random.default_rng(res)
    rows, arrays = [], {}
    for i in range(n):
        arr = rng.integers(0, 256, (res, res))
        write_png(base / "imgs" / "0" / f"sample_{i}.png", arr)
        arrays[i] = arr
        rows.append(["imgs/0", f"sample_{i}.png", str(i), str(i % 2), "1.8", "14", "4", "5", "1.5", "2", "1"])
    (base / "metadata").mkdir(parents=True, exist_ok=True)
    if binary_meta:  # the authors' generator saved a NumPy string array
        np.save(base / "metadata" / "0.npy", np.array(rows))
    else:
        (base / "metadata" / "0.npy").write_text("".join(" ".join(r) + "\n" for r in rows))
    return base, arrays


# ---------------------------------------------------------------------------------- ListOps loader
def test_listops_loader_tokens_padding_and_cache(tmp_path):
    lo.write_listops(tmp_path, train=40, val=10, test=10, seed=2, workers=1, show_progress=False)
    rows = lo.read_tsv(tmp_path / "listops-1000" / "basic_val.tsv")
    ds = get_dataset("listops", tmp_path, "val")
    assert (len(ds), ds.seq_len, ds.vocab_size, ds.num_classes, ds.pad_id) == (10, 2048, 16, 10, 0)
    for i, (text, label) in enumerate(rows):
        item = ds[i]
        toks = lo.tokenize(text)
        assert item["tokens"].dtype == torch.long and item["tokens"].shape == (2048,)
        assert item["length"] == len(toks) and item["label"] == label
        assert item["tokens"][:len(toks)].tolist() == [lo.TOKEN_IDS[t] for t in toks]
        assert (item["tokens"][len(toks):] == 0).all() and (item["tokens"][:len(toks)] > 0).all()
        assert item["tokens"][len(toks) - 1] == lo.TOKEN_IDS["]"] == 15
    assert ds.lengths.tolist() == [len(lo.tokenize(t)) for t, _ in rows]
    assert ds.labels.tolist() == [lab for _, lab in rows]
    caches = sorted(p.name for p in (tmp_path / ".sparseflash_cache").iterdir())
    assert len(caches) == 1 and caches[0].startswith("listops-val-")
    # a second load reuses the cache; a changed source is re-read into a new cache
    ds2 = get_dataset("listops", tmp_path, "val")
    assert ds2.store == ds.store
    src = tmp_path / "listops-1000" / "basic_val.tsv"
    src.write_text("Source\tTarget\n( ( ( [MAX 2 ) 8 ) ] )\t8\n")
    os.utime(src, ns=(1, 1))
    ds3 = get_dataset("listops", tmp_path, "val")
    assert ds3.store != ds.store and len(ds3) == 1 and ds3[0]["tokens"][:4].tolist() == [12, 3, 9, 15]
    assert not ds.store.exists()  # the stale cache is removed
    # truncation option and a user cache_dir
    short = get_dataset("listops", tmp_path, "val", seq_len=4, cache_dir=tmp_path / "c")
    assert short[0]["tokens"].tolist() == [12, 3, 9, 15] and short.seq_len == 4
    assert (tmp_path / "c").is_dir()


def test_caches_of_different_sources_coexist(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        lo.write_listops(tmp_path / name, train=5, val=5, test=5, seed=seed, workers=1, show_progress=False)
    cache = tmp_path / "cache"
    a1 = get_dataset("listops", tmp_path / "a", "test", cache_dir=cache)
    b1 = get_dataset("listops", tmp_path / "b", "test", cache_dir=cache)
    a2 = get_dataset("listops", tmp_path / "a", "test", cache_dir=cache)
    assert a1.store == a2.store != b1.store and a1.store.exists() and b1.store.exists()
    assert not torch.equal(a1[0]["tokens"], b1[0]["tokens"])


def test_listops_loader_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="listops-1000.*sparseflash lra data listops"):
        get_dataset("listops", tmp_path, "train")
    folder = tmp_path / "listops-1000"
    folder.mkdir()
    for s in ("train", "val", "test"):
        (folder / f"basic_{s}.tsv").write_text("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t1\n")
    (folder / "basic_train.tsv").write_text("Source\tTarget\n( ( ( [FIRST 1 ) 2 ) ] )\t1\n")
    with pytest.raises(MalformedDataError, match=r"basic_train.tsv:2: unknown ListOps token '\[FIRST'"):
        get_dataset("listops", tmp_path, "train")
    (folder / "basic_train.tsv").write_text("src\ttgt\n")
    with pytest.raises(MalformedDataError, match="header"):
        get_dataset("listops", tmp_path, "train")
    (folder / "basic_train.tsv").write_text("Source\tTarget\n( 1 )\t12\n")
    with pytest.raises(MalformedDataError, match="basic_train.tsv:2: Target must be an integer 0-9"):
        get_dataset("listops", tmp_path, "train")
    assert len(get_dataset("listops", tmp_path / "listops-1000", "val")) == 1  # root may be the folder itself


# ---------------------------------------------------------------------------------- Retrieval / AAN
def write_aan(root: Path, rows_by_split):
    folder = root / "tsv_data"
    folder.mkdir(parents=True)
    for split, rows in rows_by_split.items():
        with open(folder / f"new_aan_pairs.{split}.tsv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f, delimiter="\t", lineterminator="\n").writerows(rows)


def test_retrieval_loader(tmp_path):
    long_doc = "x" * 5000
    write_aan(tmp_path, {
        "train": [["1.0", "P01", "P02", "caf\u00e9 au lait", "b"], ["0.0", "P03", "P04", long_doc, "abc def"]],
        "eval": [["0", "P05", "P06", "hello", "world!"]],
        "test": [["1", "P07", "P08", "a", "b"]],
    })
    ds = get_dataset("retrieval", tmp_path, "train")
    assert (len(ds), ds.seq_len, ds.vocab_size, ds.num_classes) == (2, 4096, 257, 2)
    x = ds[0]
    assert x["tokens"].shape == (2, 4096) and x["tokens"].dtype == torch.long and x["label"] == 1
    cafe = [b + 1 for b in "caf\u00e9 au lait".encode("utf-8")]
    assert x["length"].tolist() == [len(cafe), 1]
    assert x["tokens"][0, :len(cafe)].tolist() == cafe and (x["tokens"][0, len(cafe):] == 0).all()
    assert x["tokens"][1, 0] == ord("b") + 1
    y = ds[1]
    assert y["label"] == 0 and y["length"].tolist() == [4000, 7] and (y["tokens"][0, :4000] == ord("x") + 1).all()
    assert ds.lengths.tolist() == [[len(cafe), 1], [4000, 7]]
    val = get_dataset("retrieval", tmp_path, "val")
    assert len(val) == 1 and val[0]["tokens"][1, :6].tolist() == [c + 1 for c in b"world!"]
    (tmp_path / "tsv_data" / "new_aan_pairs.test.tsv").write_text("1\tP1\tP2\tonly four\n")
    with pytest.raises(MalformedDataError, match=r"new_aan_pairs.test.tsv:1: expected 5 tab-separated fields"):
        get_dataset("retrieval", tmp_path, "test")
    (tmp_path / "tsv_data" / "new_aan_pairs.test.tsv").write_text("2\tP1\tP2\ta\tb\n")
    with pytest.raises(MalformedDataError, match="label must be 0 or 1"):
        get_dataset("retrieval", tmp_path, "test")
    os.remove(tmp_path / "tsv_data" / "new_aan_pairs.test.tsv")
    with pytest.raises(DatasetNotFoundError, match="new_aan_pairs.test.tsv.*tsv_data"):
        get_dataset("retrieval", tmp_path, "test")


# --------------------------------------------------------------------------------------------- IMDb
def test_text_loader(tmp_path):
    reviews = {("train", "pos"): ["Great film!<br /><br />Loved it.", "A" * 1500], ("train", "neg"): ["Bad."],
               ("test", "pos"): ["Fine \u2014 really."], ("test", "neg"): ["No.", "Worst ever"]}
    for (part, lab), texts in reviews.items():
        d = tmp_path / "aclImdb" / part / lab
        d.mkdir(parents=True)
        for i, t in enumerate(texts):
            (d / f"{i}_{7 if lab == 'pos' else 2}.txt").write_bytes(t.encode("utf-8"))
    (tmp_path / "aclImdb" / "train" / "unsup").mkdir()
    (tmp_path / "aclImdb" / "train" / "unsup" / "0_0.txt").write_text("ignored")
    ds = get_dataset("text", tmp_path, "train")
    assert (len(ds), ds.seq_len, ds.vocab_size, ds.num_classes) == (3, 1024, 257, 2)
    items = [ds[i] for i in range(3)]
    assert [it["label"] for it in items] == [0, 1, 1]
    assert items[0]["tokens"][:4].tolist() == [c + 1 for c in b"Bad."] and items[0]["length"] == 4
    assert items[1]["length"] == len("Great film!<br /><br />Loved it.")
    assert items[2]["length"] == 1000 and (items[2]["tokens"][1000:] == 0).all()
    ds4k = get_dataset("text4k", tmp_path, "train")
    assert ds4k.seq_len == 4096 and ds4k[2]["length"] == 1500
    val, test = get_dataset("text", tmp_path, "val"), get_dataset("text", tmp_path, "test")
    assert len(val) == len(test) == 3 and all(torch.equal(val[i]["tokens"], test[i]["tokens"]) for i in range(3))
    dash = "Fine \u2014 really.".encode("utf-8")
    assert test[2]["length"] == len(dash) and test[2]["tokens"][:len(dash)].tolist() == [b + 1 for b in dash]
    with pytest.raises(DatasetNotFoundError, match="aclImdb.*never downloaded"):
        get_dataset("text", tmp_path / "aclImdb" / "train", "train")


# ------------------------------------------------------------------------------------------ CIFAR-10
def write_cifar(root: Path, n=5):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(folder / name, "wb") as f:  # python 2's format: byte-string keys, protocol 2
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n}, f, protocol=2)
        batches[name] = (data, labels)
    return folder, batches


def test_rgb_to_gray_matches_tensorflow_formula():
    px = np.zeros((1, 3072), np.uint8)
    px[0, 0], px[0, 1024 + 1], px[0, 2048 + 2] = 255, 255, 255  # red, green, blue pixels
    px[0, [3, 1027, 2051]] = 255  # white
    gray = rgb_to_gray(px)[0]
    assert gray[:4].tolist() == [int(0.2989 * 255.5), int(0.5870 * 255.5), int(0.1140 * 255.5), 255]


def test_image_loader(tmp_path):
    _, batches = write_cifar(tmp_path)
    train, val, test = (get_dataset("image", tmp_path, s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (22, 3, 5)  # 90% / 10% of the 25 training images
    assert (train.seq_len, train.vocab_size, train.num_classes) == (1024, 257, 10)
    all_train = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    x = val[2]
    assert x["label"] == labels[24] and x["length"] == 1024
    assert x["tokens"].tolist() == (rgb_to_gray(all_train[24:25])[0].astype(np.int64) + 1).tolist()
    assert int(x["tokens"].min()) >= 1 and int(x["tokens"].max()) <= 256
    assert test[0]["label"] == batches["test_batch"][1][0]


def test_image_loader_refuses_bad_pickles(tmp_path):
    folder, _ = write_cifar(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f, protocol=2)
    with pytest.raises(MalformedDataError, match="test_batch: not a CIFAR-10 python batch"):
        get_dataset("image", tmp_path, "test")
    assert not (tmp_path / "pwned").exists()
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(MalformedDataError, match=r"expected data uint8 \[n, 3072\]"):
        get_dataset("image", tmp_path, "test")
    os.remove(folder / "data_batch_3")
    with pytest.raises(DatasetNotFoundError, match="cifar-10-batches-py.*never downloaded"):
        get_dataset("image", tmp_path, "train")


# --------------------------------------------------------------------------------- Pathfinder loader
def test_pathfinder_loader_reads_generated_release(pf_release):
    root = pf_release / "w1"
    splits = {s: get_dataset("pathfinder32", root, s) for s in ("train", "val", "test")}
    assert [len(d) for d in splits.values()] == [40, 5, 5]
    folder = root / "pathfinder32" / "curv_contour_length_14"
    rows = []
    for b in range(3):
        rows += [r.split(" ") for r in (folder / "metadata" / f"{b}.npy").read_text().splitlines()]
    seen = set()
    for ds in splits.values():
        assert (ds.seq_len, ds.vocab_size, ds.num_classes, ds.difficulty) == (1024, 257, 2, "hard")
        for j, r in enumerate(ds.indices):
            x = ds[j]
            row = rows[r]
            pixels = np.asarray(Image.open(folder / row[0] / row[1])).astype(np.int64).ravel()
            assert x["tokens"].tolist() == (pixels + 1).tolist() and x["length"] == 1024 and x["label"] == int(row[3])
        seen |= set(ds.indices.tolist())
    assert seen == set(range(50))
    other = get_dataset("pathfinder32", root, "train", split_seed=7)
    assert set(other.indices.tolist()) != set(splits["train"].indices.tolist())


@pytest.mark.parametrize("task,res", [("pathx", 128), ("path256", 256), ("pathfinder64", 64)])
def test_pathfinder_loader_resolutions(tmp_path, task, res):
    make_pathfinder_fixture(tmp_path, res, n=10, binary_meta=res == 64)
    ds = get_dataset(task, tmp_path, "train", workers=2)
    assert len(ds) == 8 and ds.seq_len == res * res
    x = ds[0]
    assert x["tokens"].shape == (res * res,) and x["length"] == res * res


def test_pathfinder_loader_blacklist_and_errors(tmp_path):
    base, arrays = make_pathfinder_fixture(tmp_path, 32, folder="curv_baseline", n=12)
    meta = base / "metadata" / "0.npy"
    (base / "imgs" / "0" / "sample_172.png").write_bytes(b"")  # the release's known empty image
    meta.write_text(meta.read_text() + "imgs/0 sample_172.png 172 1 1.0 6 2 2 0.5 1 1\n")
    ds = get_dataset("pathfinder32", tmp_path, "test", difficulty="easy")
    assert ds.labels.size == 2 and len(np.load(ds.store / "labels.npy")) == 12
    for d in ("medium", "hard"):
        with pytest.raises(DatasetNotFoundError, match="sparseflash lra data pathfinder --resolution 32"):
            get_dataset("pathfinder32", tmp_path, "test", difficulty=d)
    # images rewritten in place keep the folder's fingerprint (entry count, times): drop the cache
    (base / "imgs" / "0" / "sample_3.png").write_bytes(b"not a png")
    shutil.rmtree(tmp_path / ".sparseflash_cache")
    with pytest.raises(MalformedDataError, match="sample_3.png: cannot read the image"):
        get_dataset("pathfinder32", tmp_path, "test", difficulty="easy")
    write_png(base / "imgs" / "0" / "sample_3.png", np.zeros((31, 32)))
    shutil.rmtree(tmp_path / ".sparseflash_cache")
    with pytest.raises(MalformedDataError, match="sample_3.png: image is 32x31, expected 32x32"):
        get_dataset("pathfinder32", tmp_path, "test", difficulty="easy")
    write_png(base / "imgs" / "0" / "sample_3.png", arrays[3])
    os.remove(base / "imgs" / "0" / "sample_5.png")
    with pytest.raises(MalformedDataError, match="1 images listed .* do not exist.*sample_5.png"):
        get_dataset("pathfinder32", tmp_path, "test", difficulty="easy")
    meta.write_text("imgs/0 sample_0.png 0\n")
    with pytest.raises(MalformedDataError, match="0.npy:1: expected at least 4 fields"):
        get_dataset("pathfinder32", tmp_path, "test", difficulty="easy")
    with pytest.raises(ValueError, match="difficulty must be one of"):
        get_dataset("pathfinder32", tmp_path, "test", difficulty="nightmare")


# ------------------------------------------------------------------------------------ get_dataset API
def test_get_dataset_validates_arguments(tmp_path):
    assert len(TASKS) == 9
    with pytest.raises(ValueError, match="task must be one of"):
        get_dataset("cifar", tmp_path, "train")
    with pytest.raises(ValueError, match="split must be one of"):
        get_dataset("listops", tmp_path, "dev")
    with pytest.raises(TypeError, match="root must be a path"):
        get_dataset("listops", 3, "train")
    with pytest.raises(DatasetNotFoundError, match="is not a folder"):
        get_dataset("listops", tmp_path / "nope", "train")
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['difficulty'\]"):
        get_dataset("listops", tmp_path, "train", difficulty="hard")
    with pytest.raises(TypeError, match="allowed: none"):
        get_dataset("image", tmp_path, "train", seq_len=10)
    with pytest.raises(ValueError, match="max_len"):
        get_dataset("text", tmp_path, "train", seq_len=100, max_len=200)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        get_dataset("text", tmp_path, "train", seq_len=0)


def test_dataset_pickles_without_its_data(tmp_path):
    lo.write_listops(tmp_path, train=30, val=5, test=5, seed=1, workers=1, show_progress=False)
    ds = get_dataset("listops", tmp_path, "train")
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    again = pickle.loads(blob)
    assert torch.equal(again[7]["tokens"], ds[7]["tokens"])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["tokens"].shape == (4, 2048) and batch["length"].tolist() == ds.lengths[:4].tolist()


# ------------------------------------------------------------------------------------------- the CLI
def test_cli_data_and_show(tmp_path, capsys):
    assert main(["lra", "data", "listops", "--out", str(tmp_path), "--train", "20", "--val", "5", "--test", "5",
                 "--workers", "1", "--no-progress"]) == 0
    assert main(["lra", "data", "pathfinder", "--resolution", "32", "--difficulty", "easy", "--out", str(tmp_path),
                 "--num", "8", "--workers", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "acceptance" in out and "wrote 8 images" in out
    assert (tmp_path / "pathfinder32" / "curv_baseline" / "generator.json").is_file()
    assert main(["lra", "show", "listops", str(tmp_path), "--out", str(tmp_path / "lo.png"), "--num", "2"]) == 0
    assert main(["lra", "show", "pathfinder", str(tmp_path), "--out", str(tmp_path / "pf.png"), "--num", "4"]) == 0
    out = capsys.readouterr().out
    assert "labels mismatching the evaluation: 0" in out and "8 images, 4 with label 1" in out
    assert png_size(tmp_path / "lo.png")[0] > 500 and png_size(tmp_path / "pf.png")[0] > 200
    with pytest.raises(SystemExit):
        main(["lra", "data", "pathfinder", "--resolution", "48", "--difficulty", "easy", "--out", "x", "--num", "1"])


def test_cli_extension_hook(monkeypatch, tmp_path):
    import argparse
    import sys
    import types

    module = types.ModuleType("fake_lra_ext")
    module.register_lra = lambda sub: sub.add_parser("speed").set_defaults(func=lambda a: 7)
    monkeypatch.setitem(sys.modules, "fake_lra_ext", module)
    monkeypatch.setattr(lra_cli, "EXTENSIONS", ["sparseflash.experiments.lra.not_written_yet", "fake_lra_ext"])
    parser = argparse.ArgumentParser()
    lra_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lra", "speed"])
    assert args.func(args) == 7
    # a subcommand module that exists but cannot import its own dependency is an error, not skipped
    (tmp_path / "broken_lra_ext.py").write_text("import surely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lra_cli, "EXTENSIONS", ["broken_lra_ext"])
    with pytest.raises(ModuleNotFoundError, match="surely_missing_dependency_xyz"):
        lra_cli.register(argparse.ArgumentParser().add_subparsers())
