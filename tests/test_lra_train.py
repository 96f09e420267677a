"""LRA training: schedules, data order, configs, a learning run, bit-identical resume (also across
SIGTERM, SIGKILL and --time-limit stops of a child process), DDP (gloo),
the Path-X initialisation, and the command line. Small in-memory datasets stand in for the
loaders (same interface)."""

import argparse
import csv
import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparseflash.experiments.lra import train as T
from sparseflash.experiments.lra.configs import TASKS, VARIANTS, apply_overrides, config_from_dict, get_config


class Majority:
    """A learnable toy task with the loader interface: each sequence is drawn mostly from token 1
    or mostly from token 2 (plus noise tokens); label 1 iff token 1 outnumbers token 2 among the
    real tokens (dual: iff both documents have the same majority). Padding is 0."""

    def __init__(self, n, seq_len=32, vocab=6, dual=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        docs = (n, 2) if dual else (n,)
        self.lengths = torch.randint(seq_len // 2, seq_len + 1, docs, generator=g)
        p1 = torch.where(torch.rand(docs, generator=g) < 0.5, 0.2, 0.6)[..., None]
        u = torch.rand(*docs, seq_len, generator=g)
        noise = torch.randint(3, vocab, (*docs, seq_len), generator=g)
        self.tokens = torch.where(u < p1, 1, torch.where(u < 0.8, 2, noise))
        self.tokens[torch.arange(seq_len) >= self.lengths[..., None]] = 0
        major = ((self.tokens == 1).sum(-1) > (self.tokens == 2).sum(-1)).long()
        self.labels = (major[:, 0] == major[:, 1]).long() if dual else major
        self.seq_len, self.vocab_size, self.num_classes, self.pad_id = seq_len, vocab, 2, 0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        length = self.lengths[i] if self.lengths.dim() == 2 else int(self.lengths[i])
        return {"tokens": self.tokens[i], "length": length, "label": int(self.labels[i])}


def toy_datasets(n=256, **kw):
    return {"train": Majority(n, seed=0, **kw), "val": Majority(64, seed=1, **kw), "test": Majority(64, seed=2, **kw)}


def toy_config(task="listops", **over):
    cfg = get_config(task, "quick")
    apply_overrides(cfg, {"model.d_model": 32, "model.d_ff": 64, "model.block_size": 8, "model.attention": "sparseflash",
                          "model.pattern": "butterfly", "model.dropout": 0.0, "model.attn_dropout": 0.0,
                          "train.batch_size": 16, "train.steps": 40, "train.lr": 3e-3, "train.warmup_steps": 4,
                          "train.eval_every": 20, "train.log_every": 5, "train.save_every": 100, **over})
    return cfg


def _params(out):
    return torch.load(os.path.join(out, "checkpoints", "last.pt"), map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------- pieces
def test_lr_factor_schedules():
    f = T.lr_factor
    assert [f(s, 100, 4, "cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, 100, 4, "cosine") == pytest.approx(1.0) and f(100, 100, 4, "cosine") == pytest.approx(0.0)
    assert f(52, 100, 4, "cosine") == pytest.approx(0.5)
    assert f(52, 100, 4, "linear") == pytest.approx(0.5) and f(52, 100, 4, "linear", 0.2) == pytest.approx(0.6)
    assert f(15, 100, 4, "inverse_sqrt") == pytest.approx(0.5)
    assert f(99, 100, 0, "constant") == 1.0
    seq = [f(s, 100, 10, "cosine") for s in range(10, 101)]
    assert all(a >= b for a, b in zip(seq, seq[1:]))


def test_step_batches_order_and_sharding():
    s = T.StepBatches(50, 8, seed=3)
    assert s.steps_per_epoch == 6
    it = iter(s)
    first = [next(it) for _ in range(12)]
    epoch0 = sum(first[:6], [])
    assert len(set(epoch0)) == 48 and set(epoch0) <= set(range(50))
    assert first[6:] != first[:6]  # a new permutation each epoch
    resumed = iter(T.StepBatches(50, 8, seed=3, start_step=7))
    assert next(resumed) == first[7]
    shards = [iter(T.StepBatches(50, 8, seed=3, rank=r, world=2, start_step=4)) for r in range(2)]
    assert next(shards[0]) + next(shards[1]) == first[4]
    with pytest.raises(ValueError, match="fewer than one batch"):
        T.StepBatches(5, 8, seed=0)


def test_collate_single_and_dual():
    b = T.collate([Majority(4)[i] for i in range(3)])
    assert b["tokens"].shape == (3, 32) and b["lengths"].shape == (3,) and b["labels"].shape == (3,)
    b = T.collate([Majority(4, dual=True)[i] for i in range(3)])
    assert b["tokens"].shape == (3, 2, 32) and b["lengths"].shape == (3, 2)
    # int16 / int32 tokens stay so (less to pass between processes); other dtypes become int64
    items = [{"tokens": torch.arange(5, dtype=dt), "length": 5, "label": 0} for dt in (torch.int16,) * 2]
    assert T.collate(items)["tokens"].dtype == torch.int16
    items = [{"tokens": np.arange(5, dtype=np.uint8), "length": 5, "label": 1}]
    assert T.collate(items)["tokens"].dtype == torch.long


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task", TASKS)
def test_every_config_loads(task, variant):
    cfg = get_config(task, variant)
    m = cfg.model
    assert cfg.task == task and cfg.variant == variant and m.dual == (task == "retrieval")
    assert (m.pos_emb == "grid") == (task in ("image", "pathfinder32", "pathfinder64", "pathx", "path256"))
    if m.grid:
        assert m.grid[0] * m.grid[1] == m.seq_len
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    from sparseflash.experiments.lra.model import LRAClassifier

    if m.seq_len <= 4096:
        LRAClassifier(m)  # builds


def test_config_overrides_and_errors():
    cfg = get_config("image", "faithful", ["model.n_layers=4", "train.lr=1", "train.betas=[0.9,0.98]",
                                           "model.pattern=butterfly", "data.difficulty=easy", "train.eval_batches=None"])
    assert cfg.model.n_layers == 4 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.betas == (0.9, 0.98) and cfg.model.pattern == "butterfly" and cfg.data["difficulty"] == "easy"
    assert get_config("pathx", "faithful").init_from_task == "pathfinder64"
    for bad, match in [(["model.nope=1"], "no field 'nope'"), (["model.n_layers=two"], "expected"),
                       (["optim.lr=1"], "section"), (["model.n_layers"], "section.field=value"),
                       (["train.schedule=step"], "train.schedule"), (["model.n_heads=3"], "divisible")]:
        with pytest.raises(ValueError, match=match):
            get_config("listops", "quick", bad)
    # a step count that an epoch count would overwrite is refused, naming the way out
    for steps, epochs in (("train.steps=3", "train.epochs=None"), ("train.warmup_steps=5", "train.warmup_epochs=None")):
        with pytest.raises(ValueError, match=rf"derives it from {epochs.split('=')[0]}=.*set {epochs}"):
            get_config("pathx", "faithful", [steps])
    both = get_config("pathx", "faithful", ["train.steps=3", "train.epochs=None"])
    assert both.train.steps == 3 and both.train.epochs is None
    with pytest.raises(ValueError, match="task must be one of"):
        get_config("cifar", "quick")
    with pytest.raises(ValueError, match="variant must be one of"):
        get_config("listops", "slow")


def test_cli_flags_reach_the_config():
    p = argparse.ArgumentParser()
    T.add_train_arguments(p)
    args = p.parse_args(["--task", "pathx", "--config", "faithful", "--out", "x", "--attention", "flex",
                         "--pattern", "butterfly:n_factors=3", "--pattern-arg", "global_blocks=1", "--block-size", "64",
                         "--seed", "7", "--set", "train.lr=2e-4"])
    cfg = T.config_from_args(args)
    assert (cfg.model.attention, cfg.model.pattern, cfg.model.block_size) == ("flex", "butterfly", 64)
    assert cfg.model.pattern_kwargs == {"n_factors": 3, "global_blocks": 1}
    assert cfg.train.seed == 7 and cfg.train.lr == 2e-4 and cfg.variant == "faithful"
    lra = argparse.ArgumentParser().add_subparsers()
    T.register_lra(lra)
    assert lra.choices["train"].parse_args(["--task", "listops", "--out", "o"]).func is T._cmd_train


# ---------------------------------------------------------------------------------- training
def test_tiny_run_learns(tmp_path):
    torch.manual_seed(0)
    summary = T.train(toy_config(**{"train.steps": 30, "train.eval_every": 15, "train.log_every": 2}), tmp_path,
                      datasets=toy_datasets(), device="cpu", show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(2, 31, 2))
    assert train_rows[0]["loss"] > 0.55  # chance is ln 2 = 0.69
    assert np.mean([r["loss"] for r in train_rows[-3:]]) < 0.2
    assert summary["best_val"]["acc"] > 0.9 and summary["test_best"]["acc"] > 0.9
    assert summary["density"] < 1 and summary["steps"] == 30
    with (tmp_path / "eval.csv").open() as f:
        evals = list(csv.DictReader(f))
    assert [(r["step"], r["split"], r["weights"]) for r in evals] == [
        ("15", "val", "current"), ("30", "val", "current"), ("30", "test", "final"), ("30", "test", "best")]
    for name in ("config.json", "summary.json", "train.csv", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (tmp_path / name).exists(), name
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["commit"] == summary["commit"] and config_from_dict(recorded).to_dict()["task"] == recorded["task"]


def test_dual_task_trains(tmp_path):
    summary = T.train(toy_config("retrieval", **{"train.steps": 4, "model.attention": "sdpa"}), tmp_path,
                      datasets=toy_datasets(64, dual=True), device="cpu", show_progress=False)
    assert summary["steps"] == 4 and math.isfinite(summary["test_final"]["loss"])


@pytest.mark.parametrize("objective", ["classify", "denoise"])
def test_resume_is_bit_identical(tmp_path, objective):
    """8 steps straight == 4 steps, stop, resume, 4 more: parameters, optimizer state and logs.
    Dropout is on (and, denoising, the masks are drawn), so the restored RNG streams matter; the
    data order crosses an epoch boundary."""
    over = {"model.attention": "torch", "model.dropout": 0.1, "model.attn_dropout": 0.1, "train.steps": 8,
            "train.eval_every": 3, "train.log_every": 1, "train.schedule": "cosine", "train.objective": objective}
    data = toy_datasets(80)  # 5 steps per epoch
    T.train(toy_config(**over), tmp_path / "straight", datasets=data, device="cpu", show_progress=False)
    T.train(toy_config(**over), tmp_path / "split", datasets=data, device="cpu", max_steps=4, show_progress=False)
    # a run that died after its checkpoint left a log line for step 5; resume drops it
    with (tmp_path / "split" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 5, "loss": 9.9}) + "\n")
    T.train(toy_config(**over), tmp_path / "split", datasets=data, device="cpu", resume="auto", show_progress=False)
    a, b = _params(tmp_path / "straight"), _params(tmp_path / "split")
    assert a["step"] == b["step"] == 8
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for (ka, sa), (kb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    losses = [[json.loads(x)["loss"] for x in (p / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
              for p in (tmp_path / "straight", tmp_path / "split")]
    assert losses[0] == losses[1] and len(losses[0]) == 8
    # the first command's closing validation at step 4 and its test evaluation are not in the run
    evals = [_records(p / "eval.csv") for p in (tmp_path / "straight", tmp_path / "split")]
    assert evals[0] == evals[1] and [e["step"] for e in evals[0]] == ["3", "6", "8", "8", "8"]
    assert ("tokens" in evals[0][0]) == (objective == "denoise")
    best = [torch.load(p / "checkpoints" / "best.pt", weights_only=True) for p in (tmp_path / "straight", tmp_path / "split")]
    assert best[0]["step"] == best[1]["step"] and all(torch.equal(t, best[1]["model"][n]) for n, t in best[0]["model"].items())
    with pytest.raises(ValueError, match=r"config differs in \['model.d_model'\]"):
        T.train(toy_config(**over, **{"model.d_model": 64}), tmp_path / "split", datasets=data, device="cpu",
                resume="auto", show_progress=False)


def test_init_from_upsamples_position_grid(tmp_path):
    small = {k: Majority(n, seq_len=16, seed=s) for k, n, s in (("train", 32, 0), ("val", 16, 1), ("test", 16, 2))}
    big = {k: Majority(n, seq_len=64, seed=s) for k, n, s in (("train", 32, 0), ("val", 16, 1), ("test", 16, 2))}
    over = {"train.steps": 2, "model.block_size": 8}
    T.train(toy_config("pathfinder32", **over), tmp_path / "small", datasets=small, device="cpu", show_progress=False)
    pre = _params(tmp_path / "small")["model"]["encoder.pos.grid"]
    assert pre.shape == (4, 4, 32)
    over["train.lr"] = 1e-12  # keep the initialisation visible after the steps
    T.train(toy_config("pathfinder32", **over), tmp_path / "big", datasets=big, device="cpu",
            init_from=str(tmp_path / "small" / "checkpoints" / "last.pt"), show_progress=False)
    post = _params(tmp_path / "big")["model"]["encoder.pos.grid"]
    assert post.shape == (8, 8, 32)
    torch.testing.assert_close(post, pre.repeat_interleave(2, 0).repeat_interleave(2, 1), rtol=0, atol=1e-9)


def test_freeze_keeps_named_parameters_and_trains_the_rest(tmp_path):
    data = {k: Majority(n, seq_len=16, seed=s) for k, n, s in (("train", 64, 0), ("val", 16, 1), ("test", 16, 2))}
    over = {"train.steps": 4, "model.block_size": 8, "train.lr": 1e-2}
    T.train(toy_config("pathfinder32", **over), tmp_path / "init", datasets=data, device="cpu", show_progress=False)
    init = _params(tmp_path / "init")["model"]
    T.train(toy_config("pathfinder32", **over, **{"train.freeze": ("encoder.pos", "head")}), tmp_path / "frozen",
            datasets=data, device="cpu", init_from=str(tmp_path / "init" / "checkpoints" / "last.pt"),
            show_progress=False)
    after = _params(tmp_path / "frozen")
    frozen = [n for n in init if n.startswith(("encoder.pos.", "head."))]
    assert "encoder.pos.grid" in frozen and len(frozen) >= 3
    for n, t in init.items():
        assert torch.equal(t, after["model"][n]) == (n in frozen), n
    summary = json.loads((tmp_path / "frozen" / "summary.json").read_text())
    assert summary["trainable_params"] == summary["params"] - sum(init[n].numel() for n in frozen)
    assert config_from_dict(json.loads((tmp_path / "frozen" / "config.json").read_text())).train.freeze == \
        ("encoder.pos", "head")
    with pytest.raises(ValueError, match=r"train.freeze: 'encoder.position' names no parameter"):
        T.train(toy_config("pathfinder32", **over, **{"train.freeze": ("encoder.position",)}), tmp_path / "typo",
                datasets=data, device="cpu", show_progress=False)
    with pytest.raises(ValueError, match="train.freeze must be a tuple"):
        toy_config("pathfinder32", **{"train.freeze": ("",)}).validate()


def test_frozen_run_keeps_frozen_weights_once_and_resumes(tmp_path):
    """last.pt keeps the best weights less the frozen parameters (equal to its "model"'s); a run
    stopped and resumed restores them: the same best.pt and weights as a run straight through."""
    data = {k: Majority(n, seq_len=16, seed=s) for k, n, s in (("train", 64, 0), ("val", 16, 1), ("test", 16, 2))}
    over = {"train.steps": 6, "model.block_size": 8, "train.lr": 1e-2, "train.eval_every": 2}
    T.train(toy_config("pathfinder32", **over), tmp_path / "init", datasets=data, device="cpu", show_progress=False)
    over["train.freeze"] = ("encoder.pos",)
    kw = dict(datasets=data, device="cpu", init_from=str(tmp_path / "init" / "checkpoints" / "last.pt"),
              show_progress=False)
    T.train(toy_config("pathfinder32", **over), tmp_path / "straight", **kw)
    T.train(toy_config("pathfinder32", **over), tmp_path / "split", max_steps=3, **kw)
    mid = _params(tmp_path / "split")
    assert mid["best"]["step"] == 2 and mid["best_model_from_model"] == ["encoder.pos.grid"]
    assert "encoder.pos.grid" not in mid["best_model"] and "encoder.embed.weight" in mid["best_model"]
    best_mid = torch.load(tmp_path / "split" / "checkpoints" / "best.pt", weights_only=True)
    # a resume rewrites best.pt from the restored best weights (the command itself runs no step here)
    T.train(toy_config("pathfinder32", **over), tmp_path / "split", max_steps=3, resume="auto", **kw)
    again = torch.load(tmp_path / "split" / "checkpoints" / "best.pt", weights_only=True)
    assert again["step"] == 2 and again["model"].keys() == best_mid["model"].keys()
    assert all(torch.equal(t, again["model"][n]) for n, t in best_mid["model"].items())
    T.train(toy_config("pathfinder32", **over), tmp_path / "split", resume="auto", **kw)
    a, b = _params(tmp_path / "straight"), _params(tmp_path / "split")
    assert a["step"] == b["step"] == 6 and a["best"] == b["best"]
    for key in ("model", "best_model"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(t, b[key][n]) for n, t in a[key].items()), key
    best = [torch.load(p / "checkpoints" / "best.pt", weights_only=True) for p in (tmp_path / "straight", tmp_path / "split")]
    assert best[0]["step"] == best[1]["step"] and best[0]["model"].keys() == best[1]["model"].keys()
    assert all(torch.equal(t, best[1]["model"][n]) for n, t in best[0]["model"].items())


def _ddp_worker(rank, world, init_file, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    T.train(toy_config(**_DDP_OVER), out, datasets=toy_datasets(96), device="cpu", show_progress=False)
    T.close_distributed()  # not in a finally: after a failure on one rank the barrier would wait for the dead one


# Adam eps well above float noise: the key bias has an exactly-zero true gradient (softmax ignores a
# per-row shift), and Adam would blow its rounding noise, which differs between the runs, up to lr.
_DDP_OVER = {"train.steps": 6, "train.eval_every": 3, "train.log_every": 2, "model.attention": "torch", "train.eps": 1e-3}


def test_ddp_two_cpu_processes_match_single(tmp_path):
    """Two gloo ranks with half the batch each == one process with the whole batch."""
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "ddp")), nprocs=2, join=True)
    single = T.train(toy_config(**_DDP_OVER), tmp_path / "single", datasets=toy_datasets(96), device="cpu",
                     show_progress=False)
    a, b = _params(tmp_path / "ddp"), _params(tmp_path / "single")
    assert a["world_size"] == 2 and len(a["rng"]) == 2
    for name, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][name], rtol=1e-5, atol=1e-6)
    ddp_summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp_summary["world_size"] == 2
    assert ddp_summary["test_final"]["n"] == single["test_final"]["n"] == 64  # every example counted once
    assert ddp_summary["test_final"]["acc"] == pytest.approx(single["test_final"]["acc"])


def test_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(T, "load_datasets", lambda cfg, root, cache_dir=None: toy_datasets(64))
    rc = T.main(["--task", "listops", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--attention", "sparseflash",
                 "--pattern", "butterfly", "--block-size", "8", "--max-steps", "3", "--device", "cpu", "--num-workers", "0",
                 "--no-progress", "--set", "model.d_model=32", "--set", "train.batch_size=16", "--set", "train.eval_batches=1"])
    assert rc == 0 and "listops: 3 steps" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["schedule_steps"] == get_config("listops", "quick").train.steps
    assert summary["pattern"] == "butterfly" and summary["test_final"]["n"] == 16
    with pytest.raises(ValueError, match="device must be"):
        T.main(["--task", "listops", "--data", str(tmp_path), "--out", str(tmp_path / "x"), "--device", "tpu"])


# ------------------------------------------------------------------------------- --cuda-graphs
class Pixels:
    """A toy pixel task for black_is_padding: ``side x side`` images of token ids (gray level + 1),
    black (id 1) but for a random share of drawn pixels (5-45% per image, so batches differ in
    width); label 1 iff the image's drawn pixels are bright."""

    def __init__(self, n, side=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        N = side * side
        drawn = torch.rand(n, N, generator=g) < torch.rand(n, 1, generator=g) * 0.4 + 0.05
        bright = torch.rand(n, 1, generator=g) < 0.5
        gray = torch.where(bright, torch.randint(128, 256, (n, N), generator=g), torch.randint(1, 128, (n, N), generator=g))
        self.tokens = torch.where(drawn, gray + 1, torch.ones_like(gray))
        self.labels = bright[:, 0].long()
        self.seq_len, self.vocab_size, self.num_classes, self.pad_id = N, 257, 2, 0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "length": self.seq_len, "label": int(self.labels[i])}


def pixel_datasets(n=128, side=32):
    return {"train": Pixels(n, side, seed=0), "val": Pixels(32, side, seed=1), "test": Pixels(32, side, seed=2)}


def pixel_config(**over):
    """pathfinder32 at toy size, black pixels as padding, dropout off."""
    return toy_config("pathfinder32", **{"model.black_is_padding": True, "model.d_model": 64, "model.d_ff": 128,
                                         "model.block_size": 64, "train.steps": 12, "train.eval_every": 6,
                                         "train.log_every": 1, "train.eps": 1e-3, **over})


def test_cuda_graphs_refused_where_it_cannot_run(tmp_path):
    """--cuda-graphs: a clear error on a CPU (before any folder is made) and for what it does not capture."""
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device, got device 'cpu'"):
        T.train(pixel_config(), tmp_path / "run", datasets=pixel_datasets(), device="cpu", cuda_graphs=True,
                show_progress=False)
    assert not (tmp_path / "run").exists()
    cuda = torch.device("cuda")  # only compared, never touched
    T.check_cuda_graphs(pixel_config(), cuda)  # what it is for
    for kw, over, match in [({"compile": True}, {}, "exclude each other"),
                            ({}, {"train.objective": "denoise", "model.black_is_padding": False}, "classifier"),
                            ({}, {"model.attention": "flex"}, "flex")]:
        with pytest.raises(ValueError, match=match):
            T.check_cuda_graphs(pixel_config(**over), cuda, **kw)


def test_cuda_graphs_command_line(tmp_path, monkeypatch):
    p = argparse.ArgumentParser()
    T.add_train_arguments(p)
    args = p.parse_args(["--task", "pathx", "--out", "x", "--cuda-graphs"])
    assert args.cuda_graphs and args.max_graphs == T.MAX_GRAPHS
    assert p.parse_args(["--task", "pathx", "--out", "x", "--max-graphs", "4"]).max_graphs == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--task", "pathx", "--out", "x", "--max-graphs", "0"])
    monkeypatch.setattr(T, "load_datasets", lambda cfg, root, cache_dir=None: pixel_datasets())
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        T.main(["--task", "pathfinder32", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--device", "cpu",
                "--cuda-graphs", "--no-progress", "--set", "model.black_is_padding=True"])
    assert not (tmp_path / "run").exists()


def test_graph_bucket_policy():
    """Each plan gets its own graph while fewer than the bound are captured; past it, the narrowest
    captured graph at least as wide that applies key lengths, else none (an eager step)."""
    bucket = T.graph_bucket
    assert bucket((256, False), {}, 2) == ((256, False), True)
    captured = {(256, False): 0}
    assert bucket((256, False), captured, 2) == ((256, False), False)
    assert bucket((128, False), captured, 2) == ((128, False), True)  # below the bound: its own
    captured[(512, False)] = 1
    assert bucket((128, False), captured, 2) == ((256, False), False)  # the narrowest wider one
    assert bucket((384, True), captured, 2) == ((512, False), False)  # lengths applied: same function
    assert bucket((640, False), captured, 2) is None  # nothing wide enough: eager
    assert bucket((128, True), {(128, True): 0, (256, True): 1}, 2) == ((128, True), False)
    assert bucket((64, False), {(128, True): 0, (256, True): 1}, 2) is None  # a graph without lengths fits only its own


def _pixel_model(**over):
    from sparseflash.experiments.lra.model import LRAClassifier, ModelConfig

    cfg = dict(vocab_size=257, num_classes=2, seq_len=256, grid=(16, 16), pos_emb="grid", d_model=16, n_heads=2,
               n_layers=2, d_ff=32, dropout=0.0, attn_dropout=0.0, block_size=16, black_is_padding=True,
               pattern="butterfly")
    cfg.update(over)
    torch.manual_seed(0)
    return LRAClassifier(ModelConfig(**cfg)).eval()


@pytest.mark.parametrize("over", [{}, {"pooling": "cls"}, {"black_is_padding": False}, {"conv_stem": 1}],
                         ids=["mean", "cls", "no-bip", "stem"])
def test_host_plan_is_what_the_encoder_reads(over):
    """`host_plan` computes on the CPU what the encoder reads back from the device (the width, and
    whether nothing is padding); under `Encoder.planned` with it, or with a wider plan that applies
    the lengths, the logits are the unplanned ones, and no device value is read (`int` of a tensor
    would fail: the encoder's reads are replaced)."""
    from sparseflash.experiments.lra.model import host_plan

    model = _pixel_model(**over)
    data = Pixels(6, side=16, seed=3)
    tokens = data.tokens
    lengths = torch.tensor([256, 256, 200, 256, 256, 100])
    for lens in (lengths, torch.full((6,), 256)):
        plan = host_plan(model.cfg, tokens, lens)
        if model.cfg.black_is_padding:
            _, packed, width = model.encoder._pack(tokens, lens)
            assert plan == (width, bool((packed >= width).all())) and width % 16 == 0 and width < 256
        else:
            assert plan == (256, bool((lens == 256).all()))
        with torch.no_grad():
            want = model(tokens, lens)
            with model.encoder.planned(*plan):
                torch.testing.assert_close(model(tokens, lens), want, rtol=0, atol=1e-6)
            if plan[0] + 16 <= 256:
                with model.encoder.planned(plan[0] + 16, False):
                    torch.testing.assert_close(model(tokens, lens), want, rtol=1e-5, atol=1e-5)
    assert model.encoder._plan is None  # the context restores it
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 256\]"):
        host_plan(model.cfg, tokens, lengths + 200)


def test_host_plan_checks_dihedral_inputs_and_collate_adds_it():
    from sparseflash.experiments.lra.model import host_plan

    model = _pixel_model(augment="dihedral")
    data = Pixels(4, side=16, seed=4)
    with pytest.raises(ValueError, match="augment='dihedral' needs unpadded"):
        host_plan(model.cfg, data.tokens, torch.tensor([256, 256, 255, 256]))
    b = T.collate_planned(model.cfg, [data[i] for i in range(4)])
    assert b["plan"] == host_plan(model.cfg, b["tokens"], b["lengths"]) and b["tokens"].shape == (4, 256)


class _ReplayedBody:
    """A CPU stand-in for a CUDA graph: its replay runs the captured step again (what the graph replays)."""

    def __init__(self, fn):
        self.replay = fn


class _CPUGraphedTrainStep(T.GraphedTrainStep):
    """GraphedTrainStep with its two CUDA pieces (the warm-up on a side stream, the capture) done on
    the CPU: everything else (buckets, static inputs and gradients, lr tensors, the window, the
    eager first step) is the class's own."""

    def _warm_up(self, key):
        rng = torch.get_rng_state()
        for _ in range(self.warmup):
            self._body(key, update=False)
        self.opt.zero_grad(set_to_none=False)
        torch.set_rng_state(rng)

    def _record(self, key):
        def replay():
            with self._device_lrs():
                self._body(key, update=True)
        return _ReplayedBody(replay)


def test_graphed_steps_match_eager_on_cpu(tmp_path, monkeypatch):
    """The whole --cuda-graphs path of train() (planned batches from the loader, buckets with a bound
    of 2, the eager first step, static gradients, lr tensors, the window, checkpoints, a resume in
    either direction), with graphs that rerun the captured step on the CPU: the eager run's
    per-step records and weights, up to the float32 lr tensor and capturable AdamW's rounding.
    The GPU tests check the real graphs."""
    import importlib

    adam = importlib.import_module("torch.optim.adam")  # (torch.optim.adam, the attribute, is a function)
    real = adam._get_capturable_supported_devices  # capturable AdamW on CPU tensors: its device-tensor arithmetic
    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: [*real(*a, **k), "cpu"])
    monkeypatch.setattr(T, "check_cuda_graphs", lambda *a, **k: None)
    monkeypatch.setattr(T, "GraphedTrainStep", _CPUGraphedTrainStep)
    over = {"model.block_size": 16, "model.d_model": 32, "model.d_ff": 64, "train.eval_every": 5}
    cfg = lambda: pixel_config(**over)  # noqa: E731
    kw = dict(datasets=pixel_datasets(64, side=16), device="cpu", show_progress=False)
    T.train(cfg(), tmp_path / "eager", **kw)
    summary = T.train(cfg(), tmp_path / "graphs", cuda_graphs=True, max_graphs=2, **kw)
    g = summary["cuda_graphs"]
    assert g["graphs"] == 2 and g["replayed"] + g["eager"] == 12 and g["replayed"] >= 6, g
    for first, second, name in ((False, True, "eager-then-graphs"), (True, False, "graphs-then-eager")):
        T.train(cfg(), tmp_path / name, cuda_graphs=first, max_graphs=2, max_steps=5, **kw)
        T.train(cfg(), tmp_path / name, cuda_graphs=second, max_graphs=2, resume="auto", **kw)
    want, want_rows = _params(tmp_path / "eager"), _train_records(tmp_path / "eager")
    for name in ("graphs", "eager-then-graphs", "graphs-then-eager"):
        got, rows = _params(tmp_path / name), _train_records(tmp_path / name)
        assert got["step"] == 12 and len(rows) == 12, name
        for r, w in zip(rows, want_rows):
            assert r == pytest.approx(w, rel=1e-4, abs=1e-6), (name, r, w)
        for key, t in want["model"].items():
            torch.testing.assert_close(got["model"][key], t, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
        assert [g["capturable"] for g in got["optimizer"]["param_groups"]] == [name != "graphs-then-eager"] * 2
        assert all(isinstance(g["lr"], float) for g in got["optimizer"]["param_groups"])  # the checkpoint keeps floats


def _cpu_graphs():
    """The --cuda-graphs path with graphs that rerun the captured step on the CPU (as the test above
    sets it up), for a process of its own."""
    import importlib

    adam = importlib.import_module("torch.optim.adam")
    real = adam._get_capturable_supported_devices
    adam._get_capturable_supported_devices = lambda *a, **k: [*real(*a, **k), "cpu"]
    T.check_cuda_graphs = lambda *a, **k: None
    T.GraphedTrainStep = _CPUGraphedTrainStep


def _graphed_ddp_worker(rank, world, init_file, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cpu_graphs()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    T.train(pixel_config(**_GRAPHED_DDP_OVER), out, datasets=pixel_datasets(64, side=16), device="cpu",
            cuda_graphs=True, max_graphs=2, show_progress=False)
    T.close_distributed()


_GRAPHED_DDP_OVER = {"model.block_size": 16, "model.d_model": 32, "model.d_ff": 64, "train.eval_every": 6,
                     "model.attention": "torch"}


def test_graphed_data_parallel_matches_one_process(tmp_path):
    """Two gloo ranks with --cuda-graphs (graphs rerun on the CPU, as above; no DDP wrapper: one
    all-reduce of the gradients inside each step, `average_gradients`) == one eager process with
    the whole batch; the ranks' halves may take different width buckets at different steps (a rank
    capturing while the other replays), and the collectives must still pair up."""
    import torch.multiprocessing as mp

    mp.spawn(_graphed_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "dp")), nprocs=2, join=True)
    T.train(pixel_config(**_GRAPHED_DDP_OVER), tmp_path / "single", datasets=pixel_datasets(64, side=16), device="cpu",
            show_progress=False)
    a, b = _params(tmp_path / "dp"), _params(tmp_path / "single")
    assert a["world_size"] == 2 and a["step"] == b["step"] == 12
    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    assert summary["cuda_graphs"]["replayed"] >= 6, summary["cuda_graphs"]
    for name, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _graphed_nccl_worker(rank, world, init_file, out):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    T.train(pixel_config(), out, datasets=pixel_datasets(), device=f"cuda:{rank}", precision="fp32",
            cuda_graphs=True, max_graphs=3, show_progress=False)
    T.close_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_graphed_data_parallel_matches_one_gpu(tmp_path):
    """Two NCCL ranks with --cuda-graphs (the gradient all-reduce captured in each rank's graphs)
    give the weights of one eager GPU with the whole batch, fp32, dropout off."""
    import torch.multiprocessing as mp

    mp.spawn(_graphed_nccl_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "dp")), nprocs=2, join=True)
    T.train(pixel_config(), tmp_path / "single", datasets=pixel_datasets(), device="cuda", precision="fp32",
            show_progress=False)
    a, b = _params(tmp_path / "dp"), _params(tmp_path / "single")
    assert a["world_size"] == 2 and a["step"] == b["step"] == 12
    assert json.loads((tmp_path / "dp" / "summary.json").read_text())["cuda_graphs"]["replayed"] >= 6
    for name, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _train_records(out):
    return [{k: float(v) for k, v in r.items() if k in ("loss", "acc", "grad_norm", "lr")} for r in _records(out / "train.csv")]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_cuda_graphs_match_eager(tmp_path, precision):
    """Dropout off, the same initialisation and data: training steps replayed from CUDA graphs (at
    most 3 captured, so batches also take a wider graph or an eager step) give the eager run's
    per-step loss, accuracy, grad norm and lr, its validation and its final weights, to float
    rounding; so does a run that switches between eager and graphs at a resume (an eager
    checkpoint into graphs, a graph checkpoint into eager)."""
    tol = {"fp32": dict(rtol=1e-4, atol=1e-4), "bf16": dict(rtol=2e-2, atol=2e-3)}[precision]
    kw = dict(datasets=pixel_datasets(), device="cuda", precision=precision, show_progress=False)
    T.train(pixel_config(), tmp_path / "eager", **kw)
    graphed = T.train(pixel_config(), tmp_path / "graphs", cuda_graphs=True, max_graphs=3, **kw)
    g = graphed["cuda_graphs"]
    assert 1 <= g["graphs"] <= 3 and g["replayed"] + g["eager"] == 12 and g["replayed"] >= 6, g
    for first, second, name in ((False, True, "eager-then-graphs"), (True, False, "graphs-then-eager")):
        T.train(pixel_config(), tmp_path / name, cuda_graphs=first, max_steps=5, **kw)
        T.train(pixel_config(), tmp_path / name, cuda_graphs=second, resume="auto", **kw)
    want = _params(tmp_path / "eager")
    want_rows, want_evals = _train_records(tmp_path / "eager"), _records(tmp_path / "eager" / "eval.csv")
    for name in ("graphs", "eager-then-graphs", "graphs-then-eager"):
        got = _params(tmp_path / name)
        assert got["step"] == 12, name
        rows = _train_records(tmp_path / name)
        assert len(rows) == len(want_rows) == 12, name
        for r, w in zip(rows, want_rows):
            assert r["lr"] == pytest.approx(w["lr"], rel=1e-12), name
            for col in ("loss", "grad_norm"):
                assert r[col] == pytest.approx(w[col], rel=tol["rtol"], abs=tol["atol"] * 10), (name, col, r, w)
            assert abs(r["acc"] - w["acc"]) <= 1 / 16 + 1e-9, (name, r, w)  # at most one prediction on the edge flips
        evals = _records(tmp_path / name / "eval.csv")
        assert [(e["step"], e["split"]) for e in evals] == [(e["step"], e["split"]) for e in want_evals]
        for e, w in zip(evals, want_evals):
            assert float(e["loss"]) == pytest.approx(float(w["loss"]), rel=tol["rtol"], abs=tol["atol"] * 10), name
        for key, t in want["model"].items():
            torch.testing.assert_close(got["model"][key], t, **tol, msg=lambda m: f"{name} {key}: {m}")
        for sa, sb in zip(want["optimizer"]["state"].values(), got["optimizer"]["state"].values()):
            assert float(sa["step"]) == float(sb["step"]) == 12, name


def _eager_step(model, opt, b, device):
    """The optimizer's first step, eagerly, as `_Run._eager_update` takes it: in a function, so its
    autograd graph is gone when it returns (as it is in a training run) and the capture that
    follows makes the parameters' gradient accumulators anew on its own stream."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(b["tokens"].to(device), b["lengths"].to(device))
    torch.nn.functional.cross_entropy(logits.float(), b["labels"].to(device)).backward()
    opt.step()


def test_graphed_step_refuses_a_live_autograd_graph(monkeypatch):
    """An eager step's graph still referenced (its logits kept) binds the parameters' gradient
    accumulators to its stream, which a capture cannot use: GraphedTrainStep says so before
    anything is captured (on a GPU the capture would fail and leave the process's CUDA state
    unusable), leaves the caller's gradients alone, and captures once the graph is dropped."""
    import importlib

    adam = importlib.import_module("torch.optim.adam")
    real = adam._get_capturable_supported_devices
    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: [*real(*a, **k), "cpu"])
    model = _pixel_model().train()
    opt = T._optimizer(model, pixel_config().train, torch.device("cpu"), capturable=True)
    step = _CPUGraphedTrainStep(model, opt, torch.zeros(4, dtype=torch.float64), grad_clip=1.0, autocast_dtype=None)
    data = Pixels(8, side=16, seed=6)
    b = T.collate([data[i] for i in range(8)])
    assert not step.run(b)
    logits = model(b["tokens"], b["lengths"])  # kept: its graph reaches every parameter
    torch.nn.functional.cross_entropy(logits, b["labels"]).backward()
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="autograd graph through .* still alive"):
        step.run(b)
    assert not step.graphs and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    del logits
    assert step.run(b) and step.summary()["graphs"] == 1
    assert step.run(b) and step.summary()["replayed"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, {"model.attn_dropout": 0.1}, {"model.dropout": 0.1},
                                  {"model.augment": "dihedral"}],
                         ids=["off", "attention", "residual", "dihedral"])
def test_gpu_cuda_graph_replays_draw_fresh_dropout(over):
    """Replays of one captured step on one batch with lr 0 (the weights never move): with dropout,
    torch's (residual / FFN) or sparseflash's (attention, whose seed is a device draw), or with the
    dihedral augmentation (a device draw of one grid symmetry per example), every replay gives
    another loss; without, every replay gives the same one, bit for bit."""
    from sparseflash.experiments.lra.model import LRAClassifier

    cfg = pixel_config(**over)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = LRAClassifier(cfg.model).to(device).train()
    opt = T._optimizer(model, cfg.train, device, capturable=True)
    for group in opt.param_groups:
        group["lr"] = 0.0
    window = torch.zeros(4, dtype=torch.float64, device=device)
    step = T.GraphedTrainStep(model, opt, window, grad_clip=1.0)
    data = Pixels(16, seed=5)
    b = T.collate([data[i] for i in range(16)])
    assert not step.run(b)  # no optimizer state yet: the caller steps eagerly (here by hand)
    _eager_step(model, opt, b, device)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(4):
        window.zero_()
        assert step.run(b)
        losses.append(window[0].item() / window[2].item())
    assert step.summary()["graphs"] == 1 and step.summary()["replayed"] == 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # lr 0: the same weights every time
    if over:
        assert len(set(losses)) == len(losses), losses
    else:
        assert len(set(losses)) == 1, losses


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_refuses_a_live_autograd_graph():
    """The state the capture cannot handle, on a GPU: the eager first step's logits kept, so its
    graph holds the parameters' gradient accumulators on the default stream (a captured backward
    would make the legacy stream wait on the capturing one: cudaErrorStreamCaptureImplicit). The
    step refuses before capturing, the process stays usable, and once the logits are dropped the
    step is captured and replayed. (Last of the graph tests: should the refusal ever miss, the
    failed capture could not spoil the others.)"""
    from sparseflash.experiments.lra.model import LRAClassifier

    cfg = pixel_config()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = LRAClassifier(cfg.model).to(device).train()
    opt = T._optimizer(model, cfg.train, device, capturable=True)
    window = torch.zeros(4, dtype=torch.float64, device=device)
    step = T.GraphedTrainStep(model, opt, window, grad_clip=1.0)
    data = Pixels(16, seed=5)
    b = T.collate([data[i] for i in range(16)])
    assert not step.run(b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(b["tokens"].to(device), b["lengths"].to(device))
    torch.nn.functional.cross_entropy(logits.float(), b["labels"].to(device)).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="autograd graph through .* still alive"):
        step.run(b)
    assert not step.graphs
    del logits
    for _ in range(2):
        window.zero_()
        assert step.run(b)
        assert torch.isfinite(window).all() and window[2].item() == 16
    torch.cuda.synchronize()
    assert step.summary()["graphs"] == 1 and step.summary()["replayed"] == 2


# ---------------------------------------------------------------- the speed experiment (speed.py)
def test_speed_summary_speedups_and_geomean():
    from sparseflash.experiments.lra.speed import summarize

    def row(task, provider, ms, status="ok"):
        return {"task": task, "provider": provider, "pattern": "dense", "density": 1.0, "status": status,
                "step_ms": ms if status == "ok" else None, "attn_ms": ms / 4 if status == "ok" else None}

    rows = [row("listops", "torch", 10), row("listops", "sdpa", 5), row("listops", "sparseflash", 4),
            row("text", "torch", 30), row("text", "sdpa", 20), row("text", "sparseflash", 10),
            row("pathx", "torch", 0, "oom"), row("pathx", "sdpa", 40), row("pathx", "sparseflash", 20)]
    s = {(r["task"], r["provider"]): r for r in summarize(rows)}
    assert s["listops", "sparseflash"]["speedup_vs_torch"] == pytest.approx(2.5)
    assert s["pathx", "sparseflash"]["speedup_vs_torch"] is None and s["pathx", "sparseflash"]["speedup_vs_sdpa"] == 2.0
    g = s["geomean(LRA)", "sparseflash"]
    assert g["speedup_vs_torch"] == pytest.approx(math.sqrt(2.5 * 3.0)) and g["tasks"] == 2
    assert s["geomean(all)", "sdpa"]["speedup_vs_sdpa"] == pytest.approx(1.0)
    assert ("pathx", "torch") not in s


def test_speed_merge_rounds_pools_timings_and_reports_spread():
    from sparseflash.experiments.lra.speed import merge_rounds

    def row(steps, attn, status="ok", peak=1.0):
        return {"task": "text", "provider": "sdpa", "status": status, "batch": 4, "seqs": 4, "seq_len": 100, "n_layers": 2,
                "step_times": steps, "attn_times": attn, "peak_mem_gb": peak}

    m = merge_rounds([row([10.0, 12.0, 11.0], [1.0, 1.0]), row([20.0, 21.0, 19.0], [3.0, 3.0], peak=2.0)])
    assert m["rounds"] == 2 and m["repeats"] == 6 and m["step_times"] == [10.0, 12.0, 11.0, 20.0, 21.0, 19.0]
    assert m["step_ms"] == pytest.approx(15.5) and m["step_ms_min"] == 10.0 and m["peak_mem_gb"] == 2.0
    assert m["step_ms_spread"] == pytest.approx((20 - 11) / 15.5)  # per-round medians 11 and 20
    assert m["attn_ms"] == pytest.approx(2.0) and m["attn_ms_per_step"] == pytest.approx(4.0)
    assert m["tokens_per_s"] == pytest.approx(4 * 100 / 0.0155)
    oom = {**row([], []), "status": "oom", "error": "step: oom"}
    part = merge_rounds([row([10.0], [1.0]), oom, row([12.0], [1.0])])  # the rounds that ran still count
    assert part["status"] == "ok" and part["rounds"] == 2 and part["failed_rounds"] == 1 and part["step_ms"] == 11.0
    failed = merge_rounds([oom])
    assert failed["status"] == "oom" and failed["rounds"] == 0 and failed["failed_rounds"] == 1
    assert "step_ms_spread" not in merge_rounds([row([10.0], [1.0])])  # one round: no spread


def test_speed_tiny_cpu_run(tmp_path):
    from sparseflash.experiments.lra import speed

    result = speed.run_speed(["listops"], tmp_path, device="cpu", tiny=True, providers=["torch", "sdpa", "flex", "sparseflash/butterfly"],
                             warmup=0, repeats=1, show_progress=False)
    rows = {r["provider"]: r for r in result["rows"]}
    assert set(rows) == {"torch", "sdpa", "flex", "sparseflash/butterfly", "flex/butterfly"}
    assert all(r["mode"] == "tiny" and r["seq_len"] == 256 and r["batch"] == 2 for r in rows.values())
    bf = rows["sparseflash/butterfly"]
    assert bf["status"] == "ok" and bf["step_ms"] > 0 and bf["attn_ms"] > 0 and 0 < bf["density"] < 1
    assert rows["torch"]["tokens_per_s"] == pytest.approx(2 * 256 / (rows["torch"]["step_ms"] / 1e3))
    if rows["flex"]["status"] != "ok":  # no FlexAttention backward on CPU: recorded, not raised
        assert rows["flex"]["status"] == "unsupported" and "backward" in rows["flex"]["error"]
    with (tmp_path / "speed.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 5
    for name in ("speedup.csv", "speed.json", "step_time_vs_density.png", "attn_time_vs_density.png", "speedup.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "speed.json").read_text())["environment"]["mode"] == "tiny"
    with pytest.raises(ValueError, match="unknown task"):
        speed.run_speed(["cifar"], tmp_path, device="cpu", tiny=True)


def test_speed_paired_tiny_cpu_run(tmp_path, monkeypatch):
    """--paired alternates single steps (A B, B A, ...), pairs each step with the reference's beside
    it and bounds the median ratio by a bootstrap interval; the reference's own ratio is 1."""
    from sparseflash.experiments.lra import speed

    calls = []
    real = speed._train_step

    def traced(cfg, batch, device, compile=False):
        step = real(cfg, batch, device, compile)
        label = cfg.attention + ("/" + cfg.pattern if cfg.pattern else "")

        def run():
            calls.append(label)
            step()
        return run
    monkeypatch.setattr(speed, "_train_step", traced)
    result = speed.run_paired(["listops"], tmp_path, device="cpu", tiny=True, providers=["sdpa", "sparseflash"],
                              warmup=1, steps=3, show_progress=False)  # "sparseflash": dense and every pattern
    rows = {r["provider"]: r for r in result["rows"]}
    order = [r["provider"].split(":")[0] for r in result["rows"]]
    assert order[:3] == ["sdpa", "sparseflash", "sparseflash/butterfly"] and len(order) > 3
    assert calls == order + order + order[::-1] + order
    assert rows["sdpa"]["ratio"] == 1.0 and rows["sdpa"]["reference"] == "sdpa"
    assert rows["sparseflash"]["vs_dense"] == 1.0
    bf = result["rows"][2]
    assert bf["status"] == "ok" and bf["steps"] == 3 and 0 < bf["density"] < 1
    for key, other in (("ratio", "sdpa"), ("vs_dense", "sparseflash")):
        pairs = [a / b for a, b in zip(bf["times"], rows[other]["times"])]
        assert bf[key] == pytest.approx(sorted(pairs)[1])
        assert bf[f"{key}_lo"] <= bf[key] <= bf[f"{key}_hi"]
    with (tmp_path / "paired.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert json.loads((tmp_path / "paired.json").read_text())["environment"]["paired"] is True
    assert (tmp_path / "paired.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="steps"):
        speed.run_paired(["listops"], tmp_path, device="cpu", tiny=True, steps=2)


def test_butterfly_sweep_densities():
    from sparseflash.experiments.lra.model import build_pattern
    from sparseflash.experiments.lra.speed import butterfly_sweep

    for n, expect in ((1024, [0.25, 0.375, 0.5, 0.75]), (16384, [2 / 128, 5 / 128, 8 / 128, 14 / 128])):
        got = [build_pattern("butterfly", n, 128, **kw).density() for kw in butterfly_sweep(n, 128)]
        assert got == pytest.approx(expect)
    assert butterfly_sweep(128, 128) == [{}]


# ------------------------------------------------------------------ stopping early and resuming
# A child process that trains through the command line (`T.main`) on tiny ListOps data written by
# the real generator; the N-th training item a process serves waits for a file, so the test can
# signal (or kill) the child at a known point of its run without racing it.
_CHILD = '''
import os, sys, time
from pathlib import Path
from sparseflash.experiments.lra import train as T

after, gate = int(os.environ["GATE_AFTER"]), Path(os.environ["GATE_DIR"])


class Gated:
    def __init__(self, ds):
        self.ds, self.calls = ds, 0
        self.seq_len, self.vocab_size, self.num_classes = ds.seq_len, ds.vocab_size, ds.num_classes

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.calls += 1
        if self.calls == after:
            (gate / f"ready-{os.getpid()}").touch()
            while not (gate / "go").exists():
                time.sleep(0.005)
        return self.ds[i]


load = T.load_datasets
T.load_datasets = lambda cfg, root, cache_dir=None: {
    k: Gated(v) if k == "train" else v for k, v in load(cfg, root, cache_dir).items()}
sys.exit(T.main(sys.argv[1:]))
'''

@pytest.fixture
def one_thread():
    """torch on one thread for the test (its child processes too): these toy models run faster so,
    and far faster on a busy machine, where two threads per process contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_TIMING = {"step_ms", "tokens_per_s", "time_s", "mem_gb"}  # wall-clock fields of the logs
_WALL = {"wall_s", "wall_s_total", "segments", "resumed_from"}  # ... and of summary.json


def _listops_args(data, out, *extra, objective="classify"):
    return ["--task", "listops", "--config", "quick", "--objective", objective, "--data", str(data), "--out", str(out),
            "--device", "cpu",
            "--attention", "torch", "--no-progress", "--set", "data.seq_len=64", "--set", "model.d_model=32",
            "--set", "model.d_ff=64", "--set", "model.dropout=0.1", "--set", "model.attn_dropout=0.1",
            "--set", "train.batch_size=16", "--set", "train.steps=30", "--set", "train.warmup_steps=4",
            "--set", "train.lr=3e-3", "--set", "train.eval_every=7", "--set", "train.log_every=1",
            "--set", "train.save_every=5", *extra]


def _run_child(tmp_path, args, gate_after, send, name):
    """Start the child, wait until a process of it reaches the gate, ``send(pgid)``, open the gate;
    return (exit status, stdout)."""
    import signal
    import subprocess
    import sys
    import time

    gate = tmp_path / f"gate-{name}"
    gate.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "GATE_AFTER": str(gate_after), "GATE_DIR": str(gate),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same float summation order as this process
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not any(gate.glob("ready-*")):
            assert proc.poll() is None, f"the child ended before the gate: {proc.communicate()}"
            assert time.monotonic() - t0 < 600, "the child never reached the gate"  # a hang guard, not a speed bound
            time.sleep(0.01)
        send(proc.pid)
        (gate / "go").touch()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def _records(path):
    with path.open() as f:
        return [{k: v for k, v in r.items() if k not in _TIMING} for r in csv.DictReader(f)]


def _jsonl(path):
    return [{k: v for k, v in json.loads(x).items() if k not in _TIMING} for x in path.read_text().splitlines()]


# (denoise's signal path is classify's; its resume is test_resume_is_bit_identical[denoise]: ~15 s saved
# on a CPU, run on GPU machines and with SPARSEFLASH_SLOW=1)
@pytest.mark.parametrize("objective", ["classify", pytest.param("denoise", marks=pytest.mark.slow)])
def test_sigterm_and_kill_then_resume_equal_one_run(tmp_path, one_thread, objective):
    """One run of 30 steps == the same run stopped by SIGTERM (sent to the whole process group,
    DataLoader workers included), resumed and killed with SIGKILL after log records past its last
    checkpoint, and resumed again: weights, optimizer, RNG, best-on-val, logs and summary.
    Dropout is on and the data order crosses two epoch boundaries (10 steps per epoch); with
    ``--objective denoise`` the masks come from the same restored RNG streams."""
    import signal

    from sparseflash.experiments.lra.data.listops import write_listops

    data = tmp_path / "data"
    write_listops(data, train=160, val=32, test=32, seed=1, min_len=10, max_len=60, max_depth=4, workers=1,
                  show_progress=False)
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = functools.partial(_listops_args, objective=objective)
    assert T.main(args(data, straight, "--num-workers", "0")) == 0

    # 1. SIGTERM to the process group while the two workers hold the 8th batch: a clean stop.
    rc, out, err = _run_child(tmp_path, args(data, split, "--num-workers", "2"), 16 * 4,
                              lambda pid: os.killpg(pid, signal.SIGTERM), "term")
    assert rc == T.EXIT_STOPPED, err
    s1 = _params(split)["step"]
    assert f"stopped at step {s1} by SIGTERM; continue with --resume" in out and 1 <= s1 < 30
    assert _params(split)["segments"][-1]["end"] == "SIGTERM"
    assert json.loads((split / "summary.json").read_text())["stopped_by"] == "SIGTERM"

    # 2. resumed, then killed outright in the middle of a step that follows a logged one which no
    # checkpoint holds: the next resume must drop that record.
    m = 3 if (s1 + 3) % 5 else 4  # steps this command completes; s1 + m is not a checkpoint step
    rc, _, err = _run_child(tmp_path, args(data, split, "--num-workers", "0", "--resume"), 1 + 16 * m + 1,
                            lambda pid: os.killpg(pid, signal.SIGKILL), "kill")
    assert rc == -signal.SIGKILL, err
    ck = _params(split)
    logged = [int(r["step"]) for r in _records(split / "train.csv")]
    assert logged[-1] == s1 + m and ck["step"] == 5 * ((s1 + m) // 5) < logged[-1]

    # 3. resumed to the end
    assert T.main(args(data, split, "--num-workers", "0", "--resume")) == 0

    a, b = _params(straight), _params(split)
    assert a["step"] == b["step"] == 30 and a["best"] == b["best"]
    for key in ("model", "best_model"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(t, b[key][n]) for n, t in a[key].items()), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"]) and a["rng"][0]["python"] == b["rng"][0]["python"]
    best = [torch.load(p / "checkpoints" / "best.pt", weights_only=True) for p in (straight, split)]
    assert best[0]["step"] == best[1]["step"]
    assert all(torch.equal(t, best[1]["model"][n]) for n, t in best[0]["model"].items())
    for name in ("train.csv", "eval.csv"):
        assert _records(straight / name) == _records(split / name), name
    assert _jsonl(straight / "metrics.jsonl") == _jsonl(split / "metrics.jsonl")
    assert len(_records(split / "train.csv")) == 30 and len(_records(split / "eval.csv")) == 5 + 2
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (straight, split))
    assert {k: v for k, v in sa.items() if k not in _WALL} == {k: v for k, v in sb.items() if k not in _WALL}
    assert sb["finished"] and sb["stopped_by"] is None and "test_best" in sb
    segs = sb["segments"]
    assert [(s["start_step"], s["end_step"], s["end"]) for s in segs] == [
        (0, s1, "SIGTERM"), (s1, ck["step"], "checkpoint"), (ck["step"], 30, "done")]
    assert sb["wall_s_total"] == pytest.approx(sum(s["wall_s"] for s in segs)) and sb["resumed_from"].endswith("last.pt")


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_run_takes_its_loader_workers_with_it(tmp_path, one_thread):
    """A run's main process killed outright (SIGKILL: nothing of it runs) takes its data-loader
    workers with it at once: a worker held inside a batch, where PyTorch's own watch for a dead
    parent does not look, is gone within seconds instead of running on, orphaned."""
    import signal
    import time

    from sparseflash.experiments.lra.data.listops import write_listops

    data = tmp_path / "data"
    write_listops(data, train=160, val=32, test=32, seed=1, min_len=10, max_len=60, max_depth=4, workers=1,
                  show_progress=False)
    left = {}

    def kill_the_main_process_only(pid):
        worker = int(next((tmp_path / "gate-kill").glob("ready-*")).name.split("-")[1])
        assert worker != pid and _running(worker)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while _running(worker) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        left["running"] = _running(worker)

    rc, _, err = _run_child(tmp_path, _listops_args(data, tmp_path / "run", "--num-workers", "2"), 20,
                            kill_the_main_process_only, "kill")
    assert rc == -signal.SIGKILL, err
    assert left == {"running": False}


class _Clock:
    """The training's clock in a test: time passes only when the data says so (no wall clock)."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_time_limit_stops_before_the_deadline(tmp_path, monkeypatch, capsys):
    """--time-limit: the command stops between steps, with a checkpoint, before its deadline,
    exit status 75; a resume goes on. Time is injected (`_Stopper.clock`): every training item
    takes 2 ms of it, nothing else any, so what is asserted holds on any machine under any load.
    0.07 min = 4.2 s of which 0.5 s of reserve and 1.25 s for the checkpoint not measured yet:
    about 80 steps of 32 ms."""
    clock = _Clock()
    monkeypatch.setattr(T._Stopper, "clock", staticmethod(clock))
    monkeypatch.setattr(T._Stopper, "RESERVE_S", 0.5)

    class Slow(Majority):
        def __getitem__(self, i):
            clock.t += 0.002
            return super().__getitem__(i)

    data = {"train": Slow(320, seed=0), "val": Majority(32, seed=1), "test": Majority(32, seed=2)}
    monkeypatch.setattr(T, "load_datasets", lambda cfg, root, cache_dir=None: data)
    args = ["--task", "listops", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--device", "cpu",
            "--num-workers", "0", "--no-progress", "--attention", "torch", "--set", "model.d_model=32",
            "--set", "train.batch_size=16", "--set", "train.steps=400", "--set", "train.eval_every=100",
            "--set", "train.log_every=10", "--set", "train.eval_batches=1"]
    t0 = clock()
    assert T.main([*args, "--time-limit", "0.07"]) == T.EXIT_STOPPED
    assert clock() - t0 < 0.07 * 60  # stopped before the deadline
    ck = _params(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 50 <= ck["step"] < 130 and summary["steps"] == ck["step"] and summary["stopped_by"] == "time_limit"
    assert ck["segments"][-1]["end"] == "time_limit" and ck["timing"]["step_s"] == pytest.approx(16 * 0.002)
    assert f"stopped at step {ck['step']} by time_limit" in capsys.readouterr().out
    # a deadline already passed: no step at all, nothing rewritten
    assert T.main([*args, "--resume", "--time-limit", "1e-9"]) == T.EXIT_STOPPED
    assert _params(tmp_path / "run")["step"] == ck["step"]
    assert T.main([*args, "--resume", "--max-steps", str(ck["step"] + 5)]) == 0
    assert _params(tmp_path / "run")["step"] == ck["step"] + 5
    with pytest.raises(SystemExit):
        T.main([*args, "--time-limit", "0"])


def test_stopper_prediction_and_signals():
    import signal
    import time

    clock = _Clock()
    s = T._Stopper(clock() + 10, {"step_s": 1.0, "eval_batch_s": 0.5, "save_s": 1.0})
    s.clock = clock
    assert s.needed_s(evals=4) == pytest.approx(1.25 * 4 + 2) and s.reason(first=False, evals=4) is None
    assert s.reason(first=False, tests=10) == "time_limit"  # 1.25 * 7 + 2 > 10
    assert s.reason(first=True, tests=10) is None  # a command's first step always runs
    clock.t += 10
    assert s.reason(first=True) == "time_limit"  # the deadline passed: not even a first step
    assert T._Stopper(None).reason(first=False, tests=10**9) is None
    # A shell starts background jobs with SIGINT ignored, and the stopper leaves an ignored signal
    # alone: give this process Python's own SIGINT handler first, whatever started it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with T._Stopper(None) as s:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert s.signal == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # a second one interrupts at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with T._Stopper(None):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # an ignored signal stays ignored
    finally:
        signal.signal(signal.SIGTERM, old)


def test_cpu_size_warning():
    """A GPU-sized config started on a CPU is told its estimated time (the issue's 146 s steps)."""
    from sparseflash.experiments.lra.configs import get_config

    text = T.cpu_size_warning(get_config("listops", "quick"), 146.0, 2499)
    assert "146.0 s" in text and "about 101.3 h" in text and "--config tiny" in text
    assert "about 17 min" in T.cpu_size_warning(get_config("listops", "quick"), 0.5, 2000)
    assert T.cpu_size_warning(get_config("listops", "quick"), 0.1, 2000) is None  # 200 s: no warning
    assert T.cpu_size_warning(get_config("listops", "tiny"), 146.0, 2499) is None
