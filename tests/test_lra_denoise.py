"""Self-pretraining (``train.objective="denoise"``): the masks (count, only real tokens, fixed in
evaluation), the mask vector in place of the embedding, the head's alignment under the dihedral
augmentation, a tiny run that learns, initialising a classifier from a denoiser (and back) with
the Path-X grid upsampling, and the errors. Bit-identical resume of a denoise run is tested with
the classifier's in tests/test_lra_train.py (both of its resume tests are parametrized)."""

import argparse
import csv
import json
import math

import pytest
import torch

from sparseflash.experiments.lra import train as T
from sparseflash.experiments.lra.configs import get_config
from sparseflash.experiments.lra.model import (
    AttentionKernel, LRAClassifier, LRADenoiser, ModelConfig, load_pretrained, mask_positions)
from test_lra_train import Majority, toy_config  # the toy dataset protocol and config of the training tests


class Repeat(Majority):
    """Each sequence repeats one symbol of 1..vocab-1 over a random length (padding 0 after it); the
    label is the symbol's parity. A masked token is any unmasked one of its sequence: learnable only
    by attending, and to zero loss, while the symbols' own entropy is ln(vocab - 1)."""

    def __init__(self, n, seq_len=32, vocab=9, dual=False, seed=0, min_len=None):
        g = torch.Generator().manual_seed(seed)
        docs = (n, 2) if dual else (n,)
        self.lengths = torch.randint(min_len or seq_len // 2, seq_len + 1, docs, generator=g)
        sym = torch.randint(1, vocab, docs, generator=g)
        self.tokens = sym[..., None].expand(*docs, seq_len).clone()
        self.tokens[torch.arange(seq_len) >= self.lengths[..., None]] = 0
        self.labels = (sym[:, 0] if dual else sym) % 2
        self.seq_len, self.vocab_size, self.num_classes, self.pad_id = seq_len, vocab, 2, 0


def _data(n=256, **kw):
    return {"train": Repeat(n, seed=0, **kw), "val": Repeat(64, seed=1, **kw), "test": Repeat(64, seed=2, **kw)}


def _config(task="listops", **over):
    """The training tests' toy config, as a denoiser with plain PyTorch attention."""
    return toy_config(task, **{"model.attention": "torch", "model.pattern": None, "train.objective": "denoise",
                               "train.mask_ratio": 0.25, **over})


def _model_cfg(**over):
    kw = dict(vocab_size=9, num_classes=2, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.0,
              attn_dropout=0.0, attention="torch", block_size=8)
    kw.update(over)
    return ModelConfig(**kw)


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------ masks
def test_masks_hit_only_real_tokens_in_the_right_number():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 2, 7, 40, 63, 64, 0])
    for ratio in (0.15, 0.5, 0.9):
        m = mask_positions(torch.rand(7, 64, generator=g), lengths, ratio)
        assert m.dtype == torch.bool and m.shape == (7, 64)
        assert not (m & (torch.arange(64) >= lengths[:, None])).any()  # never padding
        want = [min(n, max(1, round(ratio * n))) for n in lengths.tolist()]
        assert m.sum(1).tolist() == want
    # no lengths: every position is real; [B, 2, N] (dual) masks each document on its own
    m = mask_positions(torch.rand(3, 2, 20, generator=g), torch.tensor([[20, 10], [5, 20], [20, 20]]), 0.3)
    assert m.sum(-1).tolist() == [[6, 3], [2, 6], [6, 6]] and not m[0, 1, 10:].any()
    assert mask_positions(torch.rand(2, 10, generator=g), None, 0.3).sum(1).tolist() == [3, 3]
    # equal scores: the first k positions (stable), still exactly k
    assert mask_positions(torch.zeros(1, 8), torch.tensor([6]), 0.5)[0].tolist() == [True] * 3 + [False] * 5
    # uniform over the real positions: each of 16 positions is masked in a quarter of 4000 draws
    freq = mask_positions(torch.rand(4000, 24, generator=g), torch.full((4000,), 16), 0.25).double().mean(0)
    assert (freq[:16] - 0.25).abs().max() < 0.035 and freq[16:].sum() == 0


def test_eval_masks_are_fixed_per_example():
    lengths = torch.tensor([30, 12, 32, 20])
    a = T.eval_mask([5, 6, 7, 8], lengths, (4, 32), 0.25)
    b = T.eval_mask([7, 8], lengths[2:], (2, 32), 0.25)  # same examples in another batch
    assert torch.equal(a[2:], b) and not torch.equal(a[0], a[2])
    assert a.sum(1).tolist() == [round(0.25 * n) for n in lengths.tolist()]
    assert not (a & (torch.arange(32) >= lengths[:, None])).any()
    dual = T.eval_mask([0, 1], torch.tensor([[8, 16], [16, 4]]), (2, 2, 16), 0.5)
    assert dual.shape == (2, 2, 16) and dual.sum(-1).tolist() == [[4, 8], [8, 2]]


# ------------------------------------------------------------------------------------------ model
@pytest.mark.parametrize("embed, pooling", [("table", "mean"), ("pixel", "mean"), ("table", "cls")])
def test_mask_vector_replaces_the_token_embedding(embed, pooling):
    torch.manual_seed(0)
    vocab = 257 if embed == "pixel" else 9
    model = LRADenoiser(_model_cfg(vocab_size=vocab, embed=embed, pooling=pooling)).eval()
    tokens = torch.randint(1, vocab, (3, 16))
    lengths = torch.tensor([16, 11, 5])
    masked = mask_positions(torch.rand(3, 16), lengths, 0.4)
    out = model(tokens, lengths, masked)
    assert out.shape == (3, 16, vocab)
    other = torch.where(masked, torch.randint(1, vocab, (3, 16)), tokens)
    assert torch.equal(model(other, lengths, masked), out)  # masked ids are not seen at all
    assert not torch.allclose(model(other, lengths), model(tokens, lengths))  # ... but unmasked they are
    # the same as embedding by hand: the mask vector in place of the token's embedding, positions added
    enc = model.encoder
    x = torch.where(masked[..., None], model.mask_embed, enc.embed(tokens)) + enc.pos(16)
    if enc.cls is not None:
        x = torch.cat([enc.cls.expand(3, 1, -1), x], 1)
    n = x.shape[1]
    kernel = AttentionKernel("torch", n, 3, "cpu", key_lengths=lengths + (enc.cls is not None))
    for block in enc.blocks:
        x = block(x, kernel)
    x = enc.norm(x)[:, 1:] if enc.cls is not None else enc.norm(x)
    torch.testing.assert_close(out, model.denoise_head(x), rtol=0, atol=1e-5)
    with torch.no_grad():
        model.mask_embed += 1.0
    assert not torch.allclose(model(tokens, lengths, masked), out)


def test_dihedral_augmentation_keeps_logits_aligned():
    """In training, the denoiser sees each grid turned or flipped; its logits come back in the
    input's positions: equal to the eval-mode logits of the turned input, turned back."""
    torch.manual_seed(0)
    model = LRADenoiser(_model_cfg(pos_emb="grid", grid=(4, 4), augment="dihedral"))
    tokens = torch.randint(1, 9, (6, 16))
    masked = mask_positions(torch.rand(6, 16), None, 0.3)
    torch.manual_seed(1)
    out = model.train()(tokens, None, masked)
    torch.manual_seed(1)
    perm = model._dihedral[torch.randint(8, (6,))]
    assert len({tuple(p.tolist()) for p in perm}) > 1
    turned = model.eval()(tokens.gather(1, perm), None, masked.gather(1, perm))
    torch.testing.assert_close(out.gather(1, perm[..., None].expand_as(out)), turned, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ train
def test_tiny_denoise_run_learns(tmp_path):
    """Masked-token loss from ln 8 (8 symbols) to far below it, which only attention can do; eval.csv
    and summary.json say what was measured; best.pt holds the weights of the lowest val loss."""
    torch.manual_seed(0)
    s = T.train(_config(**{"train.log_every": 2, "train.eval_every": 10}), tmp_path, datasets=_data(), device="cpu",
                show_progress=False)
    train_rows = _rows(tmp_path / "train.csv")
    assert float(train_rows[0]["loss"]) > 1.6  # ln 8 = 2.08 at the start
    assert max(float(r["loss"]) for r in train_rows[-3:]) < 0.3
    assert s["objective"] == "denoise" and s["mask_ratio"] == 0.25
    ev = _rows(tmp_path / "eval.csv")
    assert list(ev[0]) == ["step", "split", "weights", "loss", "acc", "tokens", "n", "time_s"]
    assert [(r["step"], r["split"], r["weights"]) for r in ev] == [
        ("10", "val", "current"), ("20", "val", "current"), ("30", "val", "current"), ("40", "val", "current"),
        ("40", "test", "final"), ("40", "test", "best")]
    val = [r for r in ev if r["split"] == "val"]
    # the same masks in every evaluation: the same number of masked tokens (and about 25% of the real ones)
    real = int(Repeat(64, seed=1).lengths.sum())
    assert len({r["tokens"] for r in val}) == 1 and abs(int(val[0]["tokens"]) / real - 0.25) < 0.02
    assert all(r["n"] == "64" for r in ev)
    i = min(range(len(val)), key=lambda j: float(val[j]["loss"]))
    assert s["best_val"] == {"loss": float(val[i]["loss"]), "acc": float(val[i]["acc"]), "step": int(val[i]["step"])}
    assert s["best_val"]["acc"] > 0.95 and s["test_best"]["acc"] > 0.95 and s["test_best"]["tokens"] > 0
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == s["best_val"]["step"] and "mask_embed" in best["model"]


def test_dual_task_denoises(tmp_path):
    s = T.train(_config("retrieval", **{"train.steps": 3, "model.attention": "sdpa"}), tmp_path,
                datasets=_data(48, dual=True), device="cpu", show_progress=False)
    assert s["steps"] == 3 and math.isfinite(s["test_final"]["loss"]) and s["test_final"]["n"] == 64


def test_init_from_denoise_into_classify_and_back(tmp_path, capsys):
    """Denoise at a 4x4 grid, then classify at 8x8 from it: the encoder arrives exactly (the grid
    upsampled 2x2), the mask vector and denoising head are skipped and the classifier head is
    fresh, and the command says so. Then a denoise run from the classifier skips its head."""
    small = {k: Repeat(n, seq_len=16, seed=s, min_len=16) for k, n, s in (("train", 32, 0), ("val", 16, 1), ("test", 16, 2))}
    big = {k: Repeat(n, seq_len=64, seed=s, min_len=64) for k, n, s in (("train", 32, 0), ("val", 16, 1), ("test", 16, 2))}
    over = {"train.steps": 2}
    T.train(_config("pathfinder32", **over), tmp_path / "spt", datasets=small, device="cpu", show_progress=False)
    pre = torch.load(tmp_path / "spt" / "checkpoints" / "best.pt", weights_only=True)["model"]

    # the loading itself: exact, and what is not in the checkpoint is the model's own initialisation
    cfg = _config("pathfinder32", **{"train.objective": "classify"})
    T.fit_to_data(cfg, big["train"])
    torch.manual_seed(3)
    clf = LRAClassifier(cfg.model)
    fresh_head = {k: v.clone() for k, v in clf.state_dict().items() if k.startswith("head.")}
    notes = load_pretrained(clf, pre)
    got = clf.state_dict()
    for name, t in pre.items():
        if name == "encoder.pos.grid":
            assert torch.equal(got[name], t.repeat_interleave(2, 0).repeat_interleave(2, 1))
        elif name.startswith("encoder."):
            assert torch.equal(got[name], t), name
    assert all(torch.equal(got[k], v) for k, v in fresh_head.items())
    assert notes[0] == "encoder.pos.grid: upsampled (4, 4) -> (8, 8)"
    assert notes[1].startswith("skipped (not in this model): denoise_head.0.bias") and "mask_embed" in notes[1]
    assert notes[2].startswith("left at initialisation (not in the checkpoint): head.0.bias")

    # through train(): the notes are printed; with a vanishing lr the weights stay where they were loaded
    capsys.readouterr()
    T.train(_config("pathfinder32", **over, **{"train.objective": "classify", "train.lr": 1e-12}), tmp_path / "ft",
            datasets=big, device="cpu", init_from=str(tmp_path / "spt" / "checkpoints" / "best.pt"),
            show_progress=False)
    err = capsys.readouterr().err
    assert "initialised from" in err and "(a denoise checkpoint, into a classify model)" in err
    assert "skipped (not in this model): denoise_head.0.bias" in err and "upsampled (4, 4) -> (8, 8)" in err
    post = torch.load(tmp_path / "ft" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name in pre:
        if name.startswith("encoder.") and name != "encoder.pos.grid":
            torch.testing.assert_close(post[name], pre[name], rtol=0, atol=1e-9)

    # and back: a classifier checkpoint into a denoise run
    T.train(_config("pathfinder32", **over), tmp_path / "spt2", datasets=big, device="cpu",
            init_from=str(tmp_path / "ft" / "checkpoints" / "last.pt"), show_progress=False)
    err = capsys.readouterr().err
    assert "(a classify checkpoint, into a denoise model)" in err
    assert "skipped (not in this model): head.0.bias" in err
    assert "left at initialisation (not in the checkpoint): denoise_head.0.bias" in err and "mask_embed" in err
    # an encoder that does not fit is still an error
    bad = dict(pre)
    bad.pop("encoder.norm.weight")
    with pytest.raises(ValueError, match=r"does not fit the model's encoder: missing \['encoder.norm.weight'\]"):
        load_pretrained(LRADenoiser(_model_cfg(pos_emb="grid", grid=(4, 4), vocab_size=9)), bad)


def test_command_line_objective(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(T, "load_datasets", lambda cfg, root, cache_dir=None: _data(64))
    args = ["--task", "listops", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--attention", "torch",
            "--max-steps", "2", "--device", "cpu", "--num-workers", "0", "--no-progress", "--set", "model.d_model=32",
            "--set", "train.batch_size=16", "--set", "train.eval_batches=1"]
    assert T.main([*args, "--objective", "denoise", "--set", "train.mask_ratio=0.3"]) == 0
    assert "listops (denoise): 2 steps, best val masked-token loss" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["objective"] == "denoise" and summary["mask_ratio"] == 0.3
    # resuming under another objective is refused, naming the field
    with pytest.raises(ValueError, match=r"config differs in \['train.objective'\]"):
        T.main([*args, "--resume", "--set", "train.mask_ratio=0.3"])


def test_checkpoint_from_before_the_objective_resumes(tmp_path):
    """A classifier's last.pt written before train.objective / train.mask_ratio existed (the
    faithful Pathfinder runs') resumes: a field the saved config lacks counts as its default."""
    cfg = _config(**{"train.objective": "classify", "train.mask_ratio": 0.15, "train.steps": 4})
    data = _data(64)
    T.train(cfg, tmp_path, datasets=data, device="cpu", max_steps=2, show_progress=False)
    ck = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    del ck["config"]["train"]["objective"], ck["config"]["train"]["mask_ratio"]
    torch.save(ck, tmp_path / "checkpoints" / "last.pt")
    assert T.train(cfg, tmp_path, datasets=data, device="cpu", resume="auto", show_progress=False)["steps"] == 4
    ck = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    del ck["config"]["train"]["objective"]
    torch.save(ck, tmp_path / "checkpoints" / "last.pt")
    with pytest.raises(ValueError, match=r"config differs in \['train.objective'\]"):  # ... the default, not any
        T.train(_config(**{"train.steps": 4, "train.mask_ratio": 0.15}), tmp_path, datasets=data, device="cpu", resume="auto", show_progress=False)


@pytest.mark.parametrize("bad, match", [
    (["train.mask_ratio=0"], r"train.mask_ratio must be a number in \(0, 1\), got 0.0"),
    (["train.mask_ratio=1"], r"train.mask_ratio must be a number in \(0, 1\), got 1.0"),
    (["train.mask_ratio=-0.1"], "train.mask_ratio must be"),
    (["train.mask_ratio=much"], "override train.mask_ratio='much': expected"),
    (["train.objective=mlm"], r"train.objective must be one of \('classify', 'denoise'\), got 'mlm'"),
])
def test_bad_values_name_the_option(bad, match):
    with pytest.raises(ValueError, match=match):
        get_config("listops", "quick", bad)


def test_bad_inputs_name_the_argument():
    p = argparse.ArgumentParser()
    T.add_train_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--task", "listops", "--out", "o", "--objective", "mlm"])
    model = LRADenoiser(_model_cfg())
    with pytest.raises(ValueError, match=r"masked must be a bool tensor of shape \(2, 16\)"):
        model(torch.ones(2, 16, dtype=torch.long), None, torch.ones(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="masked must be a bool tensor"):
        model(torch.ones(2, 16, dtype=torch.long), None, torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask ratio must be in \(0, 1\)"):
        mask_positions(torch.rand(2, 8), None, 1.0)


@pytest.mark.gpu
def test_denoise_compiled_bf16_cuda(tmp_path):
    """On the GPU: a compiled bf16 denoise run with the sparseflash kernels and a block pattern
    learns, and resumes bit-identically where the kernels are deterministic (checked loosely)."""
    over = {"model.attention": "sparseflash", "model.pattern": "butterfly", "model.block_size": 16,
            "model.pos_emb": "learned", "train.steps": 60, "train.eval_every": 30}
    data = _data(512, seq_len=64)
    s = T.train(_config(**over), tmp_path / "run", datasets=data, device="cuda", compile=True, show_progress=False)
    assert s["precision"] == "bf16" and s["best_val"]["acc"] > 0.9
    T.train(_config(**over), tmp_path / "split", datasets=data, device="cuda", compile=True, max_steps=30,
            show_progress=False)
    r = T.train(_config(**over), tmp_path / "split", datasets=data, device="cuda", compile=True, resume="auto",
                show_progress=False)
    assert r["steps"] == 60 and abs(r["best_val"]["loss"] - s["best_val"]["loss"]) < 0.05
