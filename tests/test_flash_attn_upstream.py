"""The helpers the upstream-test runner's flash_attn shim provides (pad/unpad, rotary), checked
against direct constructions; and the runners' per-case grouping."""

import math

import pytest
import torch

from sparseflash.experiments.studies.flash_attn_upstream import conformance, run_upstream


def test_unpad_pad_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 2, 4, generator=g)
    lengths = [7, 1, 4]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    tok, idx, cu, mx, used = run_upstream.unpad_input(x, mask)
    assert torch.equal(tok, torch.cat([x[b, :n] for b, n in enumerate(lengths)]))
    assert cu.tolist() == [0, 7, 8, 12] and cu.dtype == torch.int32 and mx == 7 and used.tolist() == lengths
    back = run_upstream.pad_input(tok, idx, 3, 7)
    assert torch.equal(back, x * mask[..., None, None])


def test_unpad_unused_tokens_are_packed_but_not_counted():
    x = torch.arange(8.0).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    tok, _, cu, mx, used = run_upstream.unpad_input(x, mask, unused)
    assert tok.flatten().tolist() == [0.0, 1.0, 2.0, 4.0]
    assert cu.tolist() == [0, 2, 3] and mx == 2 and used.tolist() == [3, 1]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_is_a_complex_rotation_at_the_offset_positions(interleaved):
    g = torch.Generator().manual_seed(1)
    B, S, H, D, r = 2, 5, 3, 12, 8
    x = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    angle = torch.rand(20, r // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    off = torch.tensor([0, 9])
    got = run_upstream.apply_rotary_emb(x.float(), angle.cos().float(), angle.sin().float(), interleaved=interleaved,
                                        seqlen_offsets=off)
    for b in range(B):
        for s in range(S):
            th = angle[off[b] + s]  # [r/2]
            v = x[b, s, :, :r]
            z = torch.complex(v[:, 0::2], v[:, 1::2]) if interleaved else torch.complex(v[:, :r // 2], v[:, r // 2:])
            z = z * torch.polar(torch.ones_like(th), th)
            want = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
            torch.testing.assert_close(got[b, s, :, :r].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., r:], x[..., r:].float())  # features past the rotary dim pass through
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        run_upstream.apply_rotary_emb(x, angle.cos(), angle.sin(), cu_seqlens=torch.tensor([0, 5]))


def test_shim_maps_the_names_the_upstream_file_imports():
    import sys

    import sparseflash

    saved = {k: sys.modules.get(k) for k in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding",
                                             "flash_attn.layers", "flash_attn.layers.rotary")}
    try:
        run_upstream.install_shim()
        from flash_attn import flash_attn_with_kvcache
        from flash_attn.bert_padding import pad_input
        from flash_attn.flash_attn_interface import USE_TRITON_ROCM, flash_attn_varlen_func
        from flash_attn.layers.rotary import apply_rotary_emb

        assert flash_attn_with_kvcache is sparseflash.flash_attn_with_kvcache
        assert flash_attn_varlen_func is sparseflash.flash_attn_varlen_func
        assert pad_input is run_upstream.pad_input and apply_rotary_emb is run_upstream.apply_rotary_emb
        assert USE_TRITON_ROCM is False
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_case_grouping():
    assert conformance.family_of("tests/x.py::test_attention_families[varlen_causal-float16-B8]") == "varlen_causal"
    assert run_upstream.function_of("test_flash_attn.py::test_flash_attn_output[0.0-128-False]") \
        == "test_flash_attn_output"
