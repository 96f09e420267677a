"""The cut test and cue-balanced sets (experiments/lra/data/interventions.py, studies/pathx/cue_tests.py):
redrawing an image from the generator's layers gives it back byte for byte; a cut severs the marked
snake and a join links the two target snakes, both leaving every pixel near the markers as it was;
balancing removes the label information from features that carry it. Small images, CPU, ~10 s."""

import math

import numpy as np
import pytest
from scipy import ndimage

from sparseflash.experiments.lra.data import interventions as iv
from sparseflash.experiments.lra.data import pathfinder as pf


def _made(resolution, fidelity, n, seed=3):
    p = pf.params_for(resolution, "hard", fidelity)
    return p, pf.render_many(p, np.random.default_rng([seed, resolution]), [i % 2 for i in range(n)], True)


@pytest.mark.parametrize("resolution,fidelity", [(32, "release"), (32, "clean"), (64, "release"), (128, "clean")])
def test_compose_redraws_the_image_exactly(resolution, fidelity):
    _, made = _made(resolution, fidelity, 4)
    for img, lay in made:
        assert np.array_equal(iv.compose(lay), img)
        assert iv.chained(iv._drawn(lay, [lay["tip_snakes"][0] - 1]), [lay["origins"][lay["tip_snakes"][0] - 1],
                                                                         lay["terminals"][lay["tip_snakes"][0] - 1]],
                          lay["margin"])  # a whole target snake is one chain


def _far(shape, tips, radius):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    return np.min([np.hypot(yy - y, xx - x) for y, x in tips], axis=0) > radius


@pytest.mark.parametrize("resolution,fidelity", [(32, "release"), (128, "release"), (128, "clean")])
def test_cut_and_join_change_the_path_and_nothing_near_the_markers(resolution, fidelity):
    p, made = _made(resolution, fidelity, 12)
    radius = iv.default_radius(resolution)
    done = {0: 0, 1: 0}
    for img, lay in made:
        label = int(lay["tip_snakes"][0] == lay["tip_snakes"][1])
        out = iv.cut(img, lay, p) if label else iv.join(img, lay, p)
        if out is None:
            continue
        new, info = out
        done[label] += 1
        changed = new != img
        assert changed.sum() == info["changed"] > 0 and new.dtype == np.uint8 and new.shape == img.shape
        assert iv.unchanged_within(img, new, lay["tips"], radius)
        assert _far(img.shape, lay["tips"], radius)[changed].all()
        if label:  # the marked snake, less the paddles taken out, no longer links the markers
            s, ks = info["snake"], info["paddles"]
            assert len(ks) == 2 and 0 < min(ks) and max(ks) < len(lay["snakes"][s][1]) - 1
            assert (new <= img).all()
            assert not iv.chained(iv._drawn(lay, [s], [(s, k) for k in ks]), lay["tips"], lay["margin"])
        else:  # only ink added, and it touches both target snakes
            assert (new >= img).all()
            grown = ndimage.binary_dilation(changed, iterations=2)
            assert (grown & (lay["ids"] == 1)).any() and (grown & (lay["ids"] == 2)).any()
    assert done[1] >= 2 and done[0] >= 2, done  # most images take a cut or a join


@pytest.mark.parametrize("resolution,fidelity", [(64, "release"), (128, "release"), (256, "clean")])
def test_control_cut_takes_out_a_distractor_run_of_the_cuts_size(resolution, fidelity):
    """The matched control: paddles of a distractor only, far from the markers, no target pixel
    touched (so the path is as it was), and about as many pixels changed as the cut it matches."""
    p, made = _made(resolution, fidelity, 12)
    radius = iv.default_radius(resolution)
    matched = []
    for img, lay in made:
        label = int(lay["tip_snakes"][0] == lay["tip_snakes"][1])
        real = iv.cut(img, lay, p) if label else None
        out = iv.control_cut(img, lay, p, match=real[1]["changed"] if real else None)
        if out is None:
            continue
        new, info = out
        changed = new != img
        assert info["snake"] >= 2 and changed.sum() == info["changed"] > 0 and (new <= img).all()
        assert new.shape == img.shape and new.dtype == np.uint8
        assert _far(img.shape, lay["tips"], radius)[changed].all() and iv.unchanged_within(img, new, lay["tips"], radius)
        assert not changed[iv._drawn(lay, [0, 1])].any()  # the target snakes keep every drawn pixel
        assert np.array_equal(new, iv.compose(lay, [(info["snake"], k) for k in info["paddles"]]))
        assert np.array_equal(new[lay["ids"] == 1], img[lay["ids"] == 1])  # as seen in the image, too
        assert np.array_equal(new[lay["ids"] == 2], img[lay["ids"] == 2])
        if real is not None:
            matched.append((real[1]["changed"], info["changed"]))
    assert len(matched) >= 3, matched
    off = [abs(a - b) / a for a, b in matched]
    assert max(off) <= 0.25 and np.median(off) <= 0.05, matched  # the same size of edit, a few pixels either way
    with pytest.raises(ValueError, match="n_paddles"):
        iv.control_cut(made[0][0], made[0][1], p, n_paddles=0)
    with pytest.raises(ValueError, match="match"):
        iv.control_cut(made[0][0], made[0][1], p, match=0)


@pytest.mark.parametrize("resolution,fidelity", [(128, "release"), (128, "clean"), (256, "release")])
def test_dashed_join_links_the_free_snake_ends_with_paddle_like_dashes(resolution, fidelity):
    """The dashed join starts and stops a paddle gap from the two target snakes' free ends (never at
    a marker's end, never mid-snake), is made of separate dashes about a paddle long, changes
    nothing near the markers and links them."""
    p, made = _made(resolution, fidelity, 16)
    radius, done = iv.default_radius(resolution), 0
    for img, lay in made:
        if lay["tip_snakes"][0] == lay["tip_snakes"][1]:
            with pytest.raises(ValueError, match="label 0"):
                iv.dashed_join(img, lay, p)
            continue
        out = iv.dashed_join(img, lay, p)
        if out is None:
            continue
        done += 1
        new, info = out
        changed = new != img
        assert (new >= img).all() and changed.sum() == info["changed"] > 0
        assert _far(img.shape, lay["tips"], radius)[changed].all() and iv.unchanged_within(img, new, lay["tips"], radius)
        # the joined ends are the snakes' ends without a marker
        ends = {tuple(map(int, e)) for e in info["ends"]}
        snake_ends = {tuple(map(int, e)) for e in (*lay["origins"], *lay["terminals"])}
        tips = {tuple(map(int, t)) for t in lay["tips"]}
        assert len(ends) == 2 and ends <= snake_ends and not ends & tips
        gap = lay["margin"]
        (a, b), dashes = info["ends"], info["dashes"]
        assert math.isclose(math.dist(a, dashes[0][0]), gap, abs_tol=1e-6)
        assert math.isclose(math.dist(b, dashes[-1][1]), gap, abs_tol=1e-6)
        lengths = [math.dist(*d) for d in dashes]
        assert all(0.5 * p.paddle_length <= x <= 2 * p.paddle_length for x in lengths), lengths
        # separate strokes: the new ink falls apart into about one piece a dash
        pieces = ndimage.label(changed & (new >= 0.2 * 255))[1]
        assert pieces >= max(2, len(dashes) // 2), (pieces, len(dashes))
        drawn = iv._drawn(lay, [0, 1]) | (changed & (new > 0))
        assert iv.chained(drawn, lay["tips"], lay["margin"])
    assert done >= 3, done


def test_interventions_refuse_the_wrong_class_and_bad_layers():
    p, made = _made(32, "release", 2)
    (neg, lay0), (pos, lay1) = made
    with pytest.raises(ValueError, match="cut takes images of label 1"):
        iv.cut(neg, lay0, p)
    with pytest.raises(ValueError, match="join takes images of label 0"):
        iv.join(pos, lay1, p)
    with pytest.raises(ValueError, match="missing"):
        iv.compose({"tips": lay1["tips"]})
    with pytest.raises(ValueError, match="params are for 64 px"):
        iv.cut(pos, lay1, pf.params_for(64, "hard"))
    with pytest.raises(ValueError, match="n_paddles"):
        iv.cut(pos, lay1, p, n_paddles=0)


def test_balance_removes_what_the_features_say_about_the_label():
    from sparseflash.experiments.lra.probe import fit_mlp

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 1600)
    x = np.stack([labels + rng.normal(0, 1.0, labels.size), rng.normal(0, 1, labels.size)], 1)  # feature 0 leaks
    keep = iv.balance(x, labels, bins=10, epochs=15)
    assert len(keep) > 400 and labels[keep].sum() * 2 == len(keep)  # as many of either label
    te = keep[: len(keep) // 4]
    tr = keep[len(keep) // 4:]
    before = fit_mlp(x[400:], labels[400:], x[:400], labels[:400], epochs=15)
    after = fit_mlp(x[tr], labels[tr], x[te], labels[te], epochs=15)
    assert before > 0.65 and abs(after - 0.5) < 0.1, (before, after)
    with pytest.raises(ValueError, match="both 0 and 1"):
        iv.balance(x, np.zeros(len(x), int))


def test_score_follow_and_flip_rates():
    from sparseflash.experiments.studies.pathx.cue_tests import score

    labels = np.array([1, 1, 0, 0, 1, 0])
    ok = np.array([True, True, True, True, False, True])
    data = {"labels": labels, "ok": ok}
    pred = labels.copy()  # right on every unchanged image
    tracer = 1 - labels[ok]  # follows every change
    rows = score(pred, tracer, data, {"swapR4": (np.array([1, 0]), np.array([1, 1]))}, (np.array([1, 0]), np.array([1, 0])))
    by = {(r["set"], r["class"]): r for r in rows}
    assert by["fresh", "all"]["acc"] == 1.0
    assert by["cut", "cut positives"]["follow"] == 1.0 and by["cut", "cut positives"]["flip"] == 1.0
    assert by["cut", "cut positives"]["n"] == 2 and by["cut", "cut positives"]["n_skipped"] == 1
    assert by["cut", "joined negatives"]["follow"] == 1.0 and by["cut", "joined negatives"]["n"] == 3
    assert by["swapR4", "all"]["acc"] == 0.5 and by["balanced", "all"]["acc"] == 1.0
    reader = labels[ok]  # answers as before: follows nothing
    rows = score(pred, reader, data, {}, (np.array([1]), np.array([1])))
    assert all(r["follow"] == 0.0 and r["flip"] == 0.0 for r in rows if r["set"] == "cut")
    # the controls: a model that flips on any edit flips on the distractor cut too; the dashed join
    data.update(control_ok=np.array([True, False, True, True, True, False]),
                dashed_ok=np.array([False, False, True, False, False, True]))
    edgy = 1 - labels[data["control_ok"]]  # answers the other way after any edit
    rows = score(pred, tracer, data, {}, (np.array([1]), np.array([1])), edgy, np.array([1, 0]))
    by = {(r["set"], r["class"]): r for r in rows}
    assert by["control", "positives"]["flip"] == 1.0 and by["control", "positives"]["acc"] == 0.0
    assert (by["control", "positives"]["n"], by["control", "positives"]["n_skipped"]) == (2, 1)
    assert (by["control", "negatives"]["n"], by["control", "negatives"]["flip"]) == (2, 1.0)
    assert by["dashed-join", "joined negatives"]["follow"] == 0.5 and by["dashed-join", "joined negatives"]["n"] == 2
    assert by["dashed-join", "joined negatives"]["n_skipped"] == 1
    steady = labels[data["control_ok"]]
    rows = score(pred, tracer, data, {}, (np.array([1]), np.array([1])), steady, np.array([0, 0]))
    assert all(r["flip"] == 0.0 for r in rows if r["set"] in ("control", "dashed-join"))


def test_cue_tests_command_on_a_tiny_model(tmp_path):
    """The whole command at 32 px on a small untrained Pathfinder-32 model (CPU), given as an exported
    run's folder (``<run>/model.pt``, labelled by the folder's name): the tables it writes; the images
    come from the interventions' stream (57), not the untouched stream 56."""
    import json

    import torch

    from sparseflash.experiments.lra.configs import get_config
    from sparseflash.experiments.lra.train import build_model
    from sparseflash.experiments.studies.pathx import cue_tests

    cfg = get_config("pathfinder32", "quick", ["model.d_model=16", "model.d_ff=16", "model.attention=sdpa"])
    torch.manual_seed(0)
    (tmp_path / "tiny").mkdir()
    torch.save({"config": cfg.to_dict(), "model": build_model(cfg.validate()).state_dict(), "step": 7},
               tmp_path / "tiny" / "model.pt")
    assert cue_tests.main([str(tmp_path / "tiny"), "--resolution", "32", "--num", "40",
                           "--balance-pool", "200", "--workers", "1", "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    rows = json.loads((tmp_path / "o" / "cue_tests.json").read_text())["rows"]
    assert [(r["set"], r["class"]) for r in rows] == [
        ("fresh", "all"), ("cut", "cut positives"), ("cut", "joined negatives"), ("control", "positives"),
        ("control", "negatives"), ("dashed-join", "joined negatives"), ("swapR5", "all"), ("balanced", "all")]
    assert all(r["label"] == "tiny" and r["step"] == 7 and r["checkpoint"].endswith("model.pt") for r in rows)
    assert rows[0]["n"] == 40 and rows[1]["n"] + rows[1]["n_skipped"] == 20
    assert rows[3]["n"] + rows[3]["n_skipped"] == 20 and rows[4]["n"] + rows[4]["n_skipped"] == 20
    assert rows[5]["n"] + rows[5]["n_skipped"] == 20
    probe = json.loads((tmp_path / "o" / "balance_probe.json").read_text())
    assert {(r["set"], r["feature"], r["learner"]) for r in probe["rows"]} == {
        (s, f, lr) for s in ("all", "balanced") for f, lr in (("coords", "mlp"), ("paddle-directions", "threshold"),
                                                               ("patches", "mlp"), ("patches", "cnn"), ("patches-r7", "cnn"))}
    assert probe["meta"]["cut_positives"] == rows[1]["n"] and probe["meta"]["commit"]
    assert probe["meta"]["stream"] == cue_tests.STREAM == 57 and cue_tests.HELD_OUT == 56
    held_out = cue_tests.make_images(32, 2, 2, controls=False, stream=cue_tests.HELD_OUT)["images"]
    assert not np.array_equal(cue_tests.make_images(32, 2, 2, controls=False)["images"], held_out)
    with pytest.raises(SystemExit, match="'pathfinder32' model; --resolution 128"):
        cue_tests.load_model(tmp_path / "tiny", 128, "cpu")


def test_weights_export_is_bf16_small_and_loads_where_best_pt_does(tmp_path):
    """experiments/lra/weights.py: a faithful Path-X model exports under 5 MB; the export of a
    Pathfinder-32 checkpoint loads in cue_tests and answers like the fp32 weights."""
    import json

    import torch

    from sparseflash.cmdline import CommandError
    from sparseflash.experiments.lra import weights
    from sparseflash.experiments.lra.configs import config_from_dict, get_config
    from sparseflash.experiments.lra.train import build_model
    from sparseflash.experiments.studies.pathx import cue_tests

    px = get_config("pathx", "faithful", ["model.attention=sdpa"])
    (tmp_path / "px" / "checkpoints").mkdir(parents=True)
    torch.save({"config": px.to_dict(), "model": build_model(px.validate()).state_dict(), "step": 3},
               tmp_path / "px" / "checkpoints" / "best.pt")
    r = weights.export(tmp_path / "px" / "checkpoints" / "best.pt", tmp_path / "px.pt")
    assert 1.0e6 < r["parameters"] < 1.3e6 and r["mb"] < 5 and r["commit"] == "unknown"
    with pytest.raises(ValueError, match="over --max-mb 1"):
        weights.export(tmp_path / "px" / "checkpoints" / "best.pt", tmp_path / "big.pt", max_mb=1)
    assert not (tmp_path / "big.pt").exists()

    cfg = get_config("pathfinder32", "quick", ["model.d_model=16", "model.d_ff=16", "model.attention=sdpa"])
    torch.manual_seed(0)
    run = tmp_path / "pf" / "checkpoints"
    run.mkdir(parents=True)
    torch.save({"config": cfg.to_dict(), "model": build_model(cfg.validate()).state_dict(), "step": 5}, run / "best.pt")
    (tmp_path / "pf" / "summary.json").write_text(json.dumps({"commit": "abc1234", "pattern": "dense",
                                                             "density": 1.0}))
    assert weights.main(["export", str(run / "best.pt"), str(tmp_path / "w" / "pf")]) == 0
    saved = torch.load(tmp_path / "w" / "pf" / "model.pt", weights_only=True)
    assert saved["commit"] == "abc1234" and saved["step"] == 5 and len(saved["sha256"]) == 64
    assert all(v.dtype == torch.bfloat16 for v in saved["model"].values() if v.is_floating_point())
    info = json.loads((tmp_path / "w" / "pf" / "config.json").read_text())
    assert (info["run"], info["task"], info["pattern"], info["density"], info["step"]) == ("pf", "pathfinder32",
                                                                                          "dense", 1.0, 5)
    assert config_from_dict(info["config"]).to_dict() == cfg.to_dict() and info["sha256"] == saved["sha256"]
    with pytest.raises(CommandError, match="already holds model.pt, config.json"):
        weights.main(["export", str(run / "best.pt"), str(tmp_path / "w" / "pf")])
    images = pf.render_many(pf.params_for(32, "hard"), np.random.default_rng(1), [0, 1] * 8)
    images = np.stack(images)
    full, _ = cue_tests.load_model(run / "best.pt", 32, "cpu")
    small, step = cue_tests.load_model(tmp_path / "w" / "pf" / "model.pt", 32, "cpu")
    assert step == 5
    agree = (cue_tests.predict(full, images, "cpu") == cue_tests.predict(small, images, "cpu")).mean()
    assert agree >= 0.8
    with pytest.raises(ValueError, match="not a checkpoint of sparseflash lra train"):
        torch.save({"x": 1}, tmp_path / "other.pt")
        weights.export(tmp_path / "other.pt", tmp_path / "o.pt")


def test_load_model_reads_a_curriculum_checkpoint_with_a_compacted_grid(tmp_path):
    """A Path-X curriculum stage keeps its frozen 128x128 position table as its 64x64 source
    (`neighbourhood.compact_grid`); cue_tests.load_model upsamples it again (through
    `model.load_pretrained`) and gives the saved model back: the same weights, the same outputs.
    Loading with ``load_state_dict`` fails on this file (size mismatch)."""
    import torch

    from sparseflash.experiments.lra.configs import get_config
    from sparseflash.experiments.lra.model import upsample_grid
    from sparseflash.experiments.lra.train import build_model
    from sparseflash.experiments.studies.pathx import cue_tests
    from sparseflash.experiments.studies.pathx.neighbourhood import compact_grid

    cfg = get_config("pathx", "quick", ["model.d_model=8", "model.d_ff=8", "model.n_layers=1",
                                        "model.attention=sdpa", "model.black_is_padding=True"])
    torch.manual_seed(0)
    model = build_model(cfg.validate()).eval()
    with torch.no_grad():  # a frozen table upsampled 2x2 from Path-64, as the recipe starts
        model.encoder.pos.grid.copy_(upsample_grid(torch.randn(64, 64, 8), (128, 128)))
    path = tmp_path / "best.pt"
    torch.save({"config": cfg.to_dict(), "model": model.state_dict(), "step": 11}, path)
    assert compact_grid(path) == 2
    saved = torch.load(path, weights_only=True)["model"]
    assert tuple(saved["encoder.pos.grid"].shape) == (64, 64, 8)
    with pytest.raises(RuntimeError, match="size mismatch"):
        build_model(cfg.validate()).load_state_dict(saved)

    loaded, step = cue_tests.load_model(path, 128, "cpu")
    assert step == 11 and not loaded.training
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # one forward: a sparse 128 px image (black pixels are padding), the same logits
    img = np.zeros((1, 128 * 128), np.int64)
    img[0, np.random.default_rng(0).choice(128 * 128, 300, replace=False)] = 200
    x, lengths = torch.from_numpy(img + 1), torch.full((1,), 128 * 128)
    with torch.no_grad():
        assert torch.allclose(loaded(x, lengths), model(x, lengths), atol=1e-6, rtol=0)

    # weights that do not fit the config (another width) are named as such, not loaded half-way
    other = get_config("pathx", "quick", ["model.d_model=16", "model.d_ff=8", "model.n_layers=1",
                                          "model.attention=sdpa"])
    torch.save({"config": other.to_dict(), "model": saved}, tmp_path / "bad.pt")
    with pytest.raises(SystemExit, match="bad.pt: .*shape"):
        cue_tests.load_model(tmp_path / "bad.pt", 128, "cpu")


def test_weights_evaluate_scores_every_exported_model_and_says_when_there_is_none(tmp_path, capsys):
    """``weights evaluate``: each WEIGHTS/<run>/model.pt on fresh, clean and swap-test images of its
    task, one CSV row a model and set, with the bf16 model's answers; no weights: one line naming
    --weights, before any work."""
    import csv
    import json

    import torch

    from sparseflash.cmdline import CommandError
    from sparseflash.experiments.lra import weights
    from sparseflash.experiments.lra.configs import get_config
    from sparseflash.experiments.lra.train import build_model
    from sparseflash.experiments.studies.pathx import cue_tests

    with pytest.raises(CommandError, match="--weights .*nowhere: no such folder"):
        weights.main(["evaluate", "--weights", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CommandError, match="--weights .*empty: no exported weights"):
        weights.main(["evaluate", "--weights", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()

    cfg = get_config("pathfinder32", "quick", ["model.d_model=16", "model.d_ff=16", "model.n_layers=1",
                                               "model.attention=sdpa", "model.black_is_padding=True"])
    torch.manual_seed(0)
    model = build_model(cfg.validate())
    with torch.no_grad():  # large random weights: answers that differ from image to image
        for p in model.parameters():
            p.mul_(30)
    run = tmp_path / "runs" / "tiny-bip"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"config": cfg.to_dict(), "model": model.state_dict(), "step": 3}, run / "checkpoints" / "best.pt")
    weights.export_run(run / "checkpoints" / "best.pt", tmp_path / "w" / "tiny-bip")
    with pytest.raises(CommandError, match="--runs other: no"):
        weights.main(["evaluate", "--weights", str(tmp_path / "w"), "--runs", "other", "--out", str(tmp_path / "o")])
    assert weights.main(["evaluate", "--weights", str(tmp_path / "w"), "--num", "16", "--workers", "1",
                         "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "o" / "weights_eval.csv")))
    assert [(r["run"], r["task"], r["set"], r["n"]) for r in rows] == [
        ("tiny-bip", "pathfinder32", "fresh", "16"), ("tiny-bip", "pathfinder32", "swap-R5", "16"),
        ("tiny-bip", "pathfinder32", "clean", "16")]
    # the rows are the exported model's answers on those very images
    sets = weights.evaluation_sets(32, 16, 1, workers=1)
    model, _ = cue_tests.load_model(tmp_path / "w" / "tiny-bip" / "model.pt", 32, "cpu")
    answers = set()
    for r in rows:
        images, labels = sets[r["set"]]
        pred = cue_tests.predict(model, images, "cpu")
        answers |= set(pred.tolist())
        assert float(r["acc"]) == round(float(np.mean(pred == labels)), 4)
        assert r["headline_acc"] == "" and r["step"] == "3"
    assert answers == {0, 1}  # not a constant model
    assert not np.array_equal(sets["fresh"][0], sets["clean"][0])
    meta = json.loads((tmp_path / "o" / "weights_eval.json").read_text())["meta"]
    assert meta["num"] == 16 and meta["seed"] == 1 and meta["device"] == "cpu"
    with pytest.raises(CommandError, match="already holds weights_eval.csv"):  # an earlier table is kept
        weights.main(["evaluate", "--weights", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
