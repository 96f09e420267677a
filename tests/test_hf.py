"""sparseflash.hf: tiny Llama / BERT / Mistral / Gemma-2 models built from configs (no weights
fetched) with sparseflash attention against transformers' eager attention (right and left padding,
batched left-padded cached generation, sliding-window layers, softcap); mask conversion and its
refusals. Skipped without transformers (pip install 'sparseflash[hf]')."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sparseflash.hf as sfhf  # noqa: E402
from sparseflash.patterns import butterfly  # noqa: E402

N = 80


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bert():
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, N), generator=g)
    lengths = torch.tensor([N, 61, 9])
    return ids, (torch.arange(N)[None, :] < lengths[:, None]).long()


def _run(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(scope="module")
def registered():
    return {
        "dense": sfhf.register("blocksparse"),
        "butterfly": sfhf.register("blocksparse-butterfly", pattern="butterfly", block_size=16),
        "layers": sfhf.register("blocksparse-layers", pattern=[None, butterfly(N, block_size=16)]),
    }


@pytest.mark.parametrize("build", [_llama, _bert], ids=["llama-gqa-causal", "bert-bidirectional"])
def test_dense_matches_eager_with_padding(registered, build):
    model = build()
    ids, mask = _batch()
    valid = mask.bool()
    eager = _run(model, "eager", ids, mask)
    torch.testing.assert_close(_run(model, "blocksparse", ids, mask)[valid], eager[valid], rtol=1e-5, atol=1e-5)
    # no padding at all: transformers passes no mask, the module's causal flag decides
    full = torch.ones_like(mask)
    torch.testing.assert_close(_run(model, "blocksparse", ids, full), _run(model, "eager", ids, full),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build, causal", [(_llama, True), (_bert, False)], ids=["llama", "bert"])
def test_pattern_matches_eager_with_the_same_mask(registered, build, causal):
    model = build()
    ids, mask = _batch()
    valid = mask.bool()
    got = _run(model, "blocksparse-butterfly", ids, mask)
    pattern = butterfly(N, block_size=16)
    assert pattern.density() < 0.7
    allowed = pattern.to_dense() & valid[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = _run(model, "eager", ids, additive)
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert (got - _run(model, "eager", ids, mask))[valid].abs().max() > 1e-3  # the pattern is real


def test_per_layer_patterns_and_generation(registered):
    model = _llama()
    ids, mask = _batch()
    _run(model, "blocksparse-layers", ids, mask)
    masks = registered["layers"].masks
    assert masks[(0, N, N, "cpu")] is None and masks[(1, N, N, "cpu")].density() < 0.7
    prompt = ids[:1, :12]
    outs = {}
    for impl in ("eager", "blocksparse"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(outs["eager"], outs["blocksparse"])  # decoding with a KV cache: Nq=1, causal off


def test_refusals(registered):
    model = _llama()
    ids, mask = _batch()
    holes = torch.ones(3, 1, N, N).tril().bool()
    holes[1, :, 40:, 10:20] = False  # rows whose keys are not one run
    model.set_attn_implementation("blocksparse")
    with pytest.raises(ValueError, match="not one contiguous run"):
        model(ids, attention_mask=holes)
    with pytest.raises(ValueError, match="contain 'flash'|containing 'flash'"):
        sfhf.register("sparseflash")
    causal = torch.ones(1, 1, 5, 7, dtype=torch.bool).tril(2)
    assert sfhf.mask_to_key_lengths(causal, True).tolist() == [7]
    keys = torch.arange(7)[None, None, None, :] < torch.tensor([7, 3])[:, None, None, None]
    assert sfhf.mask_to_key_lengths(keys.expand(2, 1, 5, 7), False).tolist() == [7, 3]
    with pytest.raises(ValueError, match="not a full"):
        sfhf.mask_to_key_lengths(causal, False)
    bias = torch.zeros(1, 1, 5, 7)
    bias[..., 0] = -1.5
    with pytest.raises(ValueError, match="additive biases"):
        sfhf.mask_to_key_lengths(bias, False)
    with pytest.raises(ValueError, match="additive biases"):
        sfhf.mask_to_key_ranges(bias)
    # ranges: left padding (3 keys) + causal + a window of 3 (j >= i), and a row that attends nothing
    i, j = torch.arange(5)[:, None], torch.arange(7)[None, :]
    m = (j >= 3) & (j <= i + 2) & (j > i - 1)
    assert sfhf.mask_to_key_ranges(m[None, None]).tolist() == [[[0, 0], [3, 4], [3, 5], [3, 6], [4, 7]]]
    with pytest.raises(ValueError, match="differs between heads"):
        sfhf.mask_to_key_ranges(torch.stack([m, m.flip(-1)])[None])


def _left(mask):
    """The same lengths as left padding."""
    return torch.stack([row.roll(int((row == 0).sum())) for row in mask])


def _mistral(window=16):
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     sliding_window=window)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).eval()


def _gemma2():
    cfg = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256, sliding_window=12, attn_logit_softcapping=2.0,
                                    query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger q/k projections: scores reach past the cap of 2, where tanh bends
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("build", [_llama, _mistral, _gemma2], ids=["llama", "mistral-window16", "gemma2-softcap-window12"])
def test_left_padding_windows_and_softcap_match_eager(registered, build):
    """Left and right padding, sliding-window layers (shorter than the sequence) and Gemma 2's
    softcap: the logits of every real token equal eager attention's (the reference backend)."""
    model = build()
    ids, right = _batch()
    for mask in (right, _left(right), torch.ones_like(right)):
        valid = mask.bool()
        got = _run(model, "blocksparse", ids, mask)
        want = _run(model, "eager", ids, mask)
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    if build is _gemma2:  # the cap is real: without it the logits differ
        attn = model.model.layers[0].self_attn
        attn.attn_logit_softcapping = None
        uncapped = _run(model, "eager", ids, torch.ones_like(right))
        attn.attn_logit_softcapping = 2.0
        assert (uncapped - _run(model, "blocksparse", ids, torch.ones_like(right))).abs().max() > 1e-3


@pytest.mark.parametrize("build", [_llama, _mistral, _gemma2], ids=["llama", "mistral-window16", "gemma2"])
def test_batched_left_padded_generation(registered, build):
    """Batched greedy generation with left padding and a KV cache (past the sliding windows): the
    same tokens as eager."""
    model = build()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (3, 14), generator=g)
    mask = _left((torch.arange(14)[None, :] < torch.tensor([14, 9, 5])[:, None]).long())
    ids = ids * mask
    outs = {}
    for impl in ("eager", "blocksparse"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(outs["eager"], outs["blocksparse"])


def test_gemma2_through_the_kernels(device):
    """Gemma 2's sliding window (key ranges) and softcap in the Triton kernels (interpreter on CPU),
    left padding, against eager attention."""
    sfhf.register("blocksparse-kernels", backend="triton")
    model = _gemma2().to(device)
    ids, right = _batch()
    ids, mask = ids[:, :24].to(device), _left(right[:, :24] * (torch.arange(24) < torch.tensor([[24], [20], [9]]))).to(device)
    valid = mask.bool()
    torch.testing.assert_close(_run(model, "blocksparse-kernels", ids, mask)[valid], _run(model, "eager", ids, mask)[valid],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_llama_on_cuda_kernels(registered):
    """The Triton kernels under a CUDA Llama (fp32, grouped heads, padding) against eager attention."""
    model = _llama().cuda()
    ids, mask = (t.cuda() for t in _batch())
    valid = mask.bool()
    eager = _run(model, "eager", ids, mask)
    torch.testing.assert_close(_run(model, "blocksparse", ids, mask)[valid], eager[valid], rtol=1e-4, atol=1e-4)
