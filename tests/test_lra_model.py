"""LRA model: shapes, padding, agreement of the attention backends, position-grid upsampling."""

import math

import pytest
import torch

from sparseflash.experiments.lra.model import (
    ATTENTIONS, GridRotary, LRAClassifier, LRADenoiser, ModelConfig, build_pattern, dihedral_permutations, load_pretrained, parse_pattern_spec,
    upsample_grid,
)


def _flex_forward_ok() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = [a if a != "flex" or _flex_forward_ok() else pytest.param(a, marks=pytest.mark.skip("no FlexAttention"))
            for a in ATTENTIONS]


def _cfg(**kw):
    base = dict(vocab_size=11, num_classes=3, seq_len=80, d_model=32, n_heads=2, n_layers=2, d_ff=48, dropout=0.0,
                attn_dropout=0.0, block_size=16)
    base.update(kw)
    return ModelConfig(**base)


def _inputs(cfg, batch=3, seed=0, min_len=5):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 2, cfg.seq_len) if cfg.dual else (batch, cfg.seq_len)
    tokens = torch.randint(1, cfg.vocab_size, shape, generator=g)
    lengths = torch.randint(min_len, cfg.seq_len + 1, shape[:-1], generator=g)
    lengths.view(-1)[0] = cfg.seq_len  # one full-length input
    pad = torch.arange(cfg.seq_len) >= lengths[..., None]
    return tokens.masked_fill(pad, 0), lengths


def _logits(model, attention, tokens, lengths):
    model.cfg.attention = attention
    with torch.no_grad():
        return model(tokens, lengths)


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_shapes(dual, pooling):
    cfg = _cfg(dual=dual, pooling=pooling, pattern="butterfly")
    model = LRAClassifier(cfg)
    tokens, lengths = _inputs(cfg, batch=4)
    out = model(tokens, lengths)
    assert out.shape == (4, 3) and torch.isfinite(out).all()
    assert model(tokens).shape == (4, 3)  # no lengths: nothing is padding
    assert model.pattern_mask().seq_q == cfg.seq_len + (pooling == "cls")
    with pytest.raises(ValueError, match="tokens must be"):
        model(tokens[..., 0])
    with pytest.raises(ValueError, match="lengths must have shape"):
        model(tokens, lengths[:2])


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("pattern", [None, "butterfly"], ids=["dense", "butterfly"])
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_padded_tokens_cannot_change_output(attention, pattern, dual):
    torch.manual_seed(0)
    cfg = _cfg(dual=dual, pattern=pattern, attention=attention)
    model = LRAClassifier(cfg).eval()
    tokens, lengths = _inputs(cfg, seed=1)
    pad = torch.arange(cfg.seq_len) >= lengths[..., None]
    assert pad.any()
    scrambled = torch.where(pad, torch.randint(1, cfg.vocab_size, tokens.shape), tokens)
    a, b = _logits(model, attention, tokens, lengths), _logits(model, attention, scrambled, lengths)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # ...while a real token does change it
    changed = tokens.clone()
    changed.view(-1)[0] = 1 + changed.view(-1)[0] % (cfg.vocab_size - 1)
    assert (_logits(model, attention, changed, lengths) - a).abs().max() > 1e-6


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("pattern", [None, "butterfly", "butterfly:n_factors=0", "butterfly:global_blocks=1"],
                         ids=["dense", "butterfly", "diagonal", "global"])
def test_backends_agree(pattern, pooling):
    """One set of weights, the same logits (and gradients) through every attention backend.
    The diagonal-only pattern with padding leaves query rows with no key at all."""
    torch.manual_seed(0)
    name, kw = parse_pattern_spec(pattern)
    cfg = _cfg(pattern=name, pattern_kwargs=kw, pooling=pooling)
    model = LRAClassifier(cfg).eval()
    tokens, lengths = _inputs(cfg, batch=4, seed=2, min_len=3)
    ref = _logits(model, "torch", tokens, lengths)
    assert torch.isfinite(ref).all()
    for attention in ATTENTIONS:
        if attention == "flex" and not _flex_forward_ok():
            continue
        torch.testing.assert_close(_logits(model, attention, tokens, lengths), ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{attention}: {m}")
    grads = {}
    for attention in ("torch", "sdpa", "sparseflash"):  # FlexAttention has no CPU backward
        model.zero_grad()
        model.cfg.attention = attention
        model(tokens, lengths).square().sum().backward()
        grads[attention] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for attention in ("sdpa", "sparseflash"):
        for n, g in grads[attention].items():
            assert torch.isfinite(g).all(), (attention, n)
            torch.testing.assert_close(g, grads["torch"][n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{attention} {n}: {m}")


@pytest.mark.skipif(not _flex_forward_ok(), reason="no FlexAttention")
@pytest.mark.parametrize("pattern", ["butterfly:n_factors=1", "local:window=200"])
def test_flex_from_block_index(pattern):
    """Unpadded inputs in whole 128-blocks: flex gets our block index directly (all blocks full)."""
    torch.manual_seed(0)
    name, kw = parse_pattern_spec(pattern)
    cfg = _cfg(seq_len=512, block_size=128, pattern=name, pattern_kwargs=kw)
    model = LRAClassifier(cfg).eval()
    tokens = torch.randint(1, cfg.vocab_size, (2, 512))
    full = torch.full((2,), 512)
    ref = _logits(model, "torch", tokens, full)
    torch.testing.assert_close(_logits(model, "flex", tokens, full), ref, rtol=1e-5, atol=1e-5)
    (flex_mask,) = model.encoder._flex_cache.values()
    assert int(flex_mask.kv_num_blocks.sum()) == 0
    assert int(flex_mask.full_kv_num_blocks.sum()) == int(model.pattern_mask().layout.sum()) < 16


def test_pattern_changes_the_function():
    """Block sparsity is real: with padding absent, butterfly and dense differ."""
    torch.manual_seed(0)
    cfg = _cfg(seq_len=128)
    model = LRAClassifier(cfg).eval()
    tokens, _ = _inputs(cfg)
    dense = _logits(model, "torch", tokens, None)
    model.cfg.pattern = "butterfly"
    model.encoder._masks.clear()
    assert model.pattern_mask().density() < 1
    assert (_logits(model, "torch", tokens, None) - dense).abs().max() > 1e-4


def test_attention_dropout_only_in_training(monkeypatch):
    import sparseflash

    seen = []
    real = sparseflash.attention

    def spy(*a, dropout_p=0.0, **kw):
        seen.append(dropout_p)
        return real(*a, dropout_p=0.0, **kw)

    monkeypatch.setattr(sparseflash, "attention", spy)
    cfg = _cfg(attn_dropout=0.25, attention="sparseflash")
    model = LRAClassifier(cfg)
    tokens, lengths = _inputs(cfg)
    model.train()(tokens, lengths)
    assert seen == [0.25] * cfg.n_layers
    seen.clear()
    with torch.no_grad():
        model.eval()(tokens, lengths)
    assert seen == [0.0] * cfg.n_layers


@pytest.mark.parametrize("attention", ["torch", "sdpa"])
def test_attention_dropout_torch_backends(attention):
    torch.manual_seed(0)
    cfg = _cfg(attn_dropout=0.5, attention=attention)
    model = LRAClassifier(cfg)
    tokens, lengths = _inputs(cfg)
    with torch.no_grad():
        a, b = model.train()(tokens, lengths), model.train()(tokens, lengths)
        c, d = model.eval()(tokens, lengths), model.eval()(tokens, lengths)
    assert not torch.equal(a, b) and torch.equal(c, d)


def test_flex_warns_that_it_has_no_dropout():
    with pytest.warns(UserWarning, match="no attention dropout"):
        LRAClassifier(_cfg(attention="flex", attn_dropout=0.1))


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "grid", "grid_sincos", "grid_rope", "none"])
def test_position_embeddings(pos_emb):
    cfg = _cfg(seq_len=64, pos_emb=pos_emb, grid=(8, 8) if pos_emb.startswith("grid") else None)
    model = LRAClassifier(cfg)
    tokens, lengths = _inputs(cfg)
    assert model(tokens, lengths).shape == (3, 3)
    table = model.encoder.pos(64)
    if pos_emb in ("none", "grid_rope"):
        assert table is None
    else:
        assert table.shape == (64, 32) and len({tuple(r.tolist()) for r in table}) == 64
    if pos_emb == "sinusoidal":
        assert torch.allclose(table[3, 0], torch.tensor(math.sin(3.0))) and torch.allclose(table[3, 1], torch.tensor(math.cos(3.0)))
    if pos_emb == "grid_sincos":  # cell (row 2, col 5): rows in the first 16 channels, columns in the last 16
        assert torch.allclose(table[2 * 8 + 5, 0], torch.tensor(math.sin(2.0)))
        assert torch.allclose(table[2 * 8 + 5, 16], torch.tensor(math.sin(5.0)))
        assert not any(p.requires_grad for n, p in model.named_parameters() if ".pos." in n)


@pytest.mark.parametrize("offset", [0, 1])
def test_grid_rotary_scores_depend_on_the_offset_only(offset):
    # Same query and key content everywhere: the score of cell p against cell q must be a function
    # of (row_p - row_q, col_p - col_q), and must change with both components.
    rows, cols, hd = 5, 7, 16
    rope = GridRotary((rows, cols), hd, base=10.0, offset=offset)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(hd, generator=g, dtype=torch.float64).expand(1, 1, offset + rows * cols, hd)
    k = torch.randn(hd, generator=g, dtype=torch.float64).expand(1, 1, offset + rows * cols, hd)
    s = (rope(q) @ rope(k).transpose(-1, -2))[0, 0]
    if offset:  # the CLS position is not turned
        torch.testing.assert_close(rope(q)[0, 0, 0], q[0, 0, 0])
        s = s[1:, 1:]
    s = s.view(rows, cols, rows, cols)
    for (r1, c1, r2, c2), (r3, c3, r4, c4) in [((0, 0, 2, 3), (2, 3, 4, 6)), ((1, 5, 0, 1), (4, 6, 3, 2))]:
        assert (r1 - r2, c1 - c2) == (r3 - r4, c3 - c4)
        torch.testing.assert_close(s[r1, c1, r2, c2], s[r3, c3, r4, c4], rtol=1e-5, atol=1e-6)  # float32 turns
    assert not torch.isclose(s[0, 0, 1, 0], s[0, 0, 0, 1])  # rows and columns are told apart
    assert not torch.isclose(s[0, 0, 1, 0], s[0, 0, 2, 0])
    with pytest.raises(ValueError, match="rotary encoding covers"):
        rope(torch.zeros(1, 1, offset + rows * cols + 1, hd))


def test_grid_rope_model_has_no_position_parameters_and_checks_head_dim():
    cfg = _cfg(seq_len=64, pos_emb="grid_rope", grid=(8, 8), pooling="cls")
    model = LRAClassifier(cfg)
    assert not [n for n, _ in model.named_parameters() if ".pos." in n or "rope" in n]
    tokens, _ = _inputs(cfg)
    logits = model(tokens)
    # Moving the whole image changes the output (position is seen), unlike a model with no positions
    shifted = tokens.view(-1, 8, 8).roll(1, dims=2).flatten(1)
    assert not torch.allclose(model(shifted), logits)
    with pytest.raises(ValueError, match="divisible by 4"):
        LRAClassifier(_cfg(seq_len=64, pos_emb="grid_rope", grid=(8, 8), d_model=36, n_heads=2))
    with pytest.raises(ValueError, match="rope_base"):
        LRAClassifier(_cfg(seq_len=64, pos_emb="grid_rope", grid=(8, 8), rope_base=1.0))


def test_pixel_embedding_is_affine_in_the_gray_level():
    cfg = _cfg(vocab_size=257, seq_len=16, embed="pixel")
    emb = LRAClassifier(cfg).encoder.embed
    tokens = torch.tensor([[0, 1, 128, 256]])
    out = emb(tokens)
    w, b = emb.proj.weight[:, 0], emb.proj.bias
    torch.testing.assert_close(out[0, 1], b)  # gray level 0
    torch.testing.assert_close(out[0, 3], w + b)  # gray level 255
    torch.testing.assert_close(out[0, 2], w * 127 / 255 + b)
    assert torch.count_nonzero(out[0, 0]) == 0  # padding
    assert LRAClassifier(cfg)(torch.randint(1, 257, (2, 16))).shape == (2, 3)
    with pytest.raises(ValueError, match="model.embed"):
        LRAClassifier(_cfg(embed="pixel"))  # vocab 11 is not gray levels
    with pytest.raises(ValueError, match="model.embed"):
        LRAClassifier(_cfg(embed="onehot"))


def test_dihedral_permutations_are_the_grid_symmetries():
    perms = dihedral_permutations(4, 4)
    assert perms.shape == (8, 16) and len({tuple(p.tolist()) for p in perms}) == 8
    assert torch.equal(perms[0], torch.arange(16))
    for p in perms:  # each is a permutation that keeps 4-neighbours neighbours (paths stay paths)
        assert sorted(p.tolist()) == list(range(16))
        y, x = p // 4, p % 4  # where the source of each output cell sits
        grid_y, grid_x = y.view(4, 4), x.view(4, 4)
        steps = torch.cat([(grid_y[1:] - grid_y[:-1]).abs() + (grid_x[1:] - grid_x[:-1]).abs(),
                           ((grid_y[:, 1:] - grid_y[:, :-1]).abs() + (grid_x[:, 1:] - grid_x[:, :-1]).abs()).t()])
        assert (steps == 1).all()
    assert dihedral_permutations(2, 3).shape == (4, 6)  # a rectangle has no transposes


def test_dihedral_augmentation_only_in_training():
    cfg = _cfg(seq_len=64, pos_emb="grid", grid=(8, 8), augment="dihedral")
    model = LRAClassifier(cfg)
    tokens = torch.randint(1, cfg.vocab_size, (64, 64), generator=torch.Generator().manual_seed(0))
    seen = []
    model.encoder.embed.register_forward_hook(lambda m, inp, out: seen.append(inp[0].clone()))
    model.eval()
    model(tokens)
    assert torch.equal(seen[-1], tokens)
    model.train()
    torch.manual_seed(0)
    model(tokens)
    got = seen[-1]
    assert not torch.equal(got, tokens)
    for row, src in zip(got, tokens):  # every example is one symmetry of its own grid
        assert any(torch.equal(row, src[p]) for p in dihedral_permutations(8, 8))
    with pytest.raises(ValueError, match="model.augment"):
        LRAClassifier(_cfg(augment="rot"))
    with pytest.raises(ValueError, match="model.grid"):
        LRAClassifier(_cfg(augment="dihedral"))


def test_upsample_grid_maps_cells():
    H, W, d = 3, 4, 5
    grid = torch.arange(H * W * d, dtype=torch.float32).reshape(H, W, d)
    for fh, fw in ((2, 2), (3, 1), (1, 4)):
        up = upsample_grid(grid, (H * fh, W * fw))
        assert up.shape == (H * fh, W * fw, d)
        for i in range(H * fh):
            for j in range(W * fw):
                assert torch.equal(up[i, j], grid[i // fh, j // fw])
    for bad in ((5, 8), (6, 6), (2, 4)):
        with pytest.raises(ValueError, match="integer factor"):
            upsample_grid(grid, bad)
    with pytest.raises(ValueError, match=r"\[H, W, d\]"):
        upsample_grid(grid.flatten(0, 1), (6, 8))


def test_load_pretrained_upsamples_position_grid():
    torch.manual_seed(0)
    small = LRAClassifier(_cfg(seq_len=16, pos_emb="grid", grid=(4, 4)))
    big = LRAClassifier(_cfg(seq_len=64, pos_emb="grid", grid=(8, 8)))
    notes = load_pretrained(big, small.state_dict())
    assert len(notes) == 1 and "(4, 4) -> (8, 8)" in notes[0]
    pos_small, pos_big = small.encoder.pos(16), big.encoder.pos(64)
    for r in range(8):  # pixel (r, c) of the 8x8 image reads cell (r // 2, c // 2) of the 4x4 one
        for c in range(8):
            assert torch.equal(pos_big[r * 8 + c], pos_small[(r // 2) * 4 + c // 2])
    for name, t in small.state_dict().items():
        if not name.endswith("pos.grid"):
            assert torch.equal(big.state_dict()[name], t)
    other = LRAClassifier(_cfg(seq_len=16, pos_emb="grid", grid=(4, 4), d_ff=64))
    with pytest.raises(ValueError, match="shape"):
        load_pretrained(other, small.state_dict())
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(LRAClassifier(_cfg(seq_len=16, pooling="cls")), LRAClassifier(_cfg(seq_len=16)).state_dict())


def test_pattern_spec_and_errors():
    assert parse_pattern_spec("butterfly:n_factors=2, global_blocks=1") == ("butterfly", {"n_factors": 2, "global_blocks": 1})
    assert parse_pattern_spec("dense") == (None, {}) and parse_pattern_spec(None) == (None, {})
    with pytest.raises(ValueError, match="key=value"):
        parse_pattern_spec("butterfly:n_factors")
    with pytest.raises(ValueError, match="unknown pattern 'nope'"):
        build_pattern("nope", 64, 16)
    with pytest.raises(ValueError, match="rejected its arguments"):
        build_pattern("butterfly", 64, 16, wrong=1)
    assert build_pattern("butterfly", 64, 16).seq_q == 64


def _masked_reference(model, tokens):
    """The released pipelines' forward, written out: every pixel in place, black keys masked out of
    attention, final outputs times the mask, mean over all positions, then the head."""
    enc, cfg = model.encoder, model.cfg
    keep = tokens != 1  # [B, N]
    x = enc.embed(tokens) + enc.pos(tokens.shape[1])
    for blk in enc.blocks:
        q, k, v = blk.attn.project(blk.ln1(x))  # [B, h, N, head_dim]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        x = x + blk.attn.output(s.softmax(-1) @ v)
        x = x + blk.ffn(blk.ln2(x))
    return model.head((enc.norm(x) * keep[..., None]).mean(1))


@pytest.mark.parametrize("attention", BACKENDS)
def test_black_is_padding_is_the_masked_attention_of_the_release(attention):
    torch.manual_seed(0)
    cfg = _cfg(vocab_size=257, num_classes=2, attention=attention, black_is_padding=True, grid=(8, 10))
    model = LRAClassifier(cfg).eval()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, 257, (4, cfg.seq_len), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 0.55] = 1  # black pixels, a different count per image
    tokens[3, 40:] = 1  # one image black after its first 40 pixels
    tokens[2] = 1  # one all black: attends to nothing, pools to 0
    with torch.no_grad():
        got = model(tokens)
        want = _masked_reference(model, tokens.clone().masked_fill_((tokens == 1).all(1, keepdim=True), 0))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[[0, 1, 3]], want[[0, 1, 3]], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (model.encoder(tokens, None)[2] == 0).all()  # the pooled vector of the black image
        torch.testing.assert_close(got[2], model.head(torch.zeros(1, cfg.d_model))[0], rtol=1e-6, atol=1e-6)
    # token id 0 (padding, as after `lengths`) is not a drawn pixel either
    padded = tokens.clone()
    padded[0, 70:] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(padded), model(padded, torch.tensor([70, 80, 80, 80])), rtol=1e-6, atol=1e-6)
    # black pixels' positions cannot change anything; a drawn pixel can
    with torch.no_grad():
        model.encoder.pos.table[torch.nonzero(tokens[0] == 1)[0, 0]] += 1.0
        torch.testing.assert_close(model(tokens)[0], got[0], rtol=0, atol=1e-6)
        changed = tokens.clone()
        changed[0, torch.nonzero(tokens[0] != 1)[0, 0]] = 7
        assert (model(changed)[0] - got[0]).abs().max() > 1e-6


def test_black_is_padding_errors():
    with pytest.raises(ValueError, match="vocab 257"):
        LRAClassifier(_cfg(black_is_padding=True, grid=(8, 10)))
    with pytest.raises(ValueError, match="pixel tasks"):  # text tasks have vocab 257 too, but no grid
        LRAClassifier(_cfg(vocab_size=257, black_is_padding=True))
    with pytest.raises(ValueError, match="grid_rope"):
        LRAClassifier(_cfg(vocab_size=257, black_is_padding=True, pos_emb="grid_rope", grid=(8, 10), n_heads=2, d_model=32))
    with pytest.raises(ValueError, match="classifiers"):
        LRADenoiser(_cfg(vocab_size=257, black_is_padding=True, grid=(8, 10)))


@pytest.mark.parametrize("bad, match", [
    (dict(d_model=30, n_heads=4), "divisible"),
    (dict(attention="xformers"), "model.attention"),
    (dict(pooling="max"), "model.pooling"),
    (dict(pos_emb="grid", grid=(8, 8)), "cells"),
    (dict(pos_emb="grid"), "model.grid"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(vocab_size=0), "model.vocab_size"),
    (dict(backend="cuda"), "model.backend"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        LRAClassifier(_cfg(**bad))


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [None, "butterfly"])
def test_backends_agree_bf16_cuda(pattern):
    """On the GPU in bf16 autocast: the Triton kernels, SDPA and compiled flex against fp32 torch.
    Bound: twice torch's own bf16 error plus a small floor."""
    torch.manual_seed(0)
    cfg = _cfg(seq_len=1000, block_size=128, pattern=pattern, d_model=128, n_heads=2)
    model = LRAClassifier(cfg).cuda().eval()
    tokens, lengths = _inputs(cfg, batch=4)
    tokens, lengths = tokens.cuda(), lengths.cuda()
    ref = _logits(model, "torch", tokens, lengths)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = {a: _logits(model, a, tokens, lengths).float() for a in ATTENTIONS}
    bound = 2 * (bf16["torch"] - ref).abs().max() + 1e-2
    for a in ATTENTIONS:
        assert (bf16[a] - ref).abs().max() <= bound, a


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [None, "butterfly"])
def test_black_is_padding_cuda(pattern):
    """black_is_padding through the Triton kernels (packed keys, key_lengths) on the GPU: fp32
    against the released pipelines' masked forward, and every backend in bf16 within twice torch's
    own bf16 error of it."""
    torch.manual_seed(0)
    cfg = _cfg(vocab_size=257, num_classes=2, seq_len=1024, block_size=128, d_model=64, n_heads=2, pattern=pattern,
               black_is_padding=True, grid=(32, 32))
    model = LRAClassifier(cfg).cuda().eval()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 257, (4, cfg.seq_len), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 0.55] = 1
    tokens[3] = 1  # all black: packed length 0 through every backend
    tokens = tokens.cuda()
    ref = _logits(model, "torch", tokens, None)
    assert torch.isfinite(ref).all()
    if pattern is None:
        with torch.no_grad():
            torch.testing.assert_close(ref[:3], _masked_reference(model, tokens)[:3], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(_logits(model, "sparseflash", tokens, None), ref, rtol=2e-3, atol=2e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = {a: _logits(model, a, tokens, None).float() for a in ATTENTIONS}
    bound = 2 * (bf16["torch"] - ref).abs().max() + 1e-2
    for a in ATTENTIONS:
        assert (bf16[a] - ref).abs().max() <= bound, a


def test_conv_stem_starts_as_identity_and_mixes_neighbours():
    torch.manual_seed(0)
    kw = dict(vocab_size=257, num_classes=2, seq_len=64, grid=(8, 8), pos_emb="grid", attention="torch")
    model = LRAClassifier(_cfg(conv_stem=2, **kw)).eval()
    plain = LRAClassifier(_cfg(**kw)).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".stem." not in k})
    tokens = torch.randint(1, 257, (3, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)  # zero-initialised convolutions
        for conv in model.encoder.stem:
            conv.conv.weight.normal_(std=0.1)
        # with a stem, position 9 (row 1, col 1) sees its neighbour 0 before any attention:
        # the stem's output there changes when only pixel 0 changes, and not when pixel 63 does
        emb = lambda t: model.encoder.embed(t) + model.encoder.pos(64)  # noqa: E731
        def stem(t):
            x = emb(t)
            for conv in model.encoder.stem:
                x = conv(x, 8, 8)
            return x
        a, near, far = tokens.clone(), tokens.clone(), tokens.clone()
        near[:, 0] = 1 + near[:, 0] % 255
        far[:, 63] = 1 + far[:, 63] % 255
        assert (stem(near)[:, 9] - stem(a)[:, 9]).abs().max() > 1e-4
        torch.testing.assert_close(stem(far)[:, 9], stem(a)[:, 9], rtol=0, atol=0)
    with pytest.raises(ValueError, match="model.grid"):
        LRAClassifier(_cfg(vocab_size=257, seq_len=64, conv_stem=1))
    with pytest.raises(ValueError, match="conv_stem"):
        LRAClassifier(_cfg(vocab_size=257, seq_len=64, grid=(8, 8), conv_stem=-1))


@pytest.mark.parametrize("pattern, pooling, stem", [("butterfly", "mean", 0), ("random", "cls", 0), (None, "mean", 1),
                                                    ("butterfly", "cls", 1)])
def test_black_is_padding_trims_to_the_widest_image_exactly(monkeypatch, pattern, pooling, stem):
    """The encoder runs on the packed drawn pixels trimmed to the widest image of the batch (rounded up
    to the block size); the logits equal those of the untrimmed packed sequence, a pattern's top-left
    corner standing in for the whole pattern."""
    torch.manual_seed(0)
    cfg = _cfg(vocab_size=257, num_classes=2, black_is_padding=True, seq_len=128, grid=(8, 16), block_size=8,
               pattern=pattern, pooling=pooling, pattern_kwargs={"blocks_per_row": 2} if pattern == "random" else {},
               conv_stem=stem)
    model = LRAClassifier(cfg).eval()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(2, 257, (3, cfg.seq_len), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 0.7] = 1
    enc = model.encoder
    order, packed, width = enc._pack(tokens, None)
    assert width == -(-int(packed.max()) // cfg.block_size) * cfg.block_size < cfg.seq_len
    with torch.no_grad():
        got, feats = model(tokens), enc.features(tokens, None)[0]
    full_pack = enc._pack
    monkeypatch.setattr(type(enc), "_pack", lambda self, t, l: (*full_pack(t, l)[:2], t.shape[1]))
    with torch.no_grad():
        want, want_feats = model(tokens), enc.features(tokens, None)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(feats, want_feats, rtol=1e-5, atol=1e-6)
    assert feats.shape == (3, cfg.seq_len + (pooling == "cls"), cfg.d_model)
