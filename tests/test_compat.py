"""Known-bad version pairs on the Triton interpreter path (`sparseflash._compat`), and the test
suite's interpreter shim (tests/conftest.py). About 5 s on CPU."""

import numpy
import pytest
import torch
import triton

import sparseflash
from sparseflash import _compat


@pytest.mark.parametrize("triton_v, numpy_v, bad", [
    ("3.6.0", "2.4.6", True),   # checked: every kernel launch fails in the interpreter
    ("3.6.0", "2.4.0rc1", True),
    ("3.0.0", "2.5.0", True),
    ("3.6.0", "2.3.5", False),  # checked: passes
    ("3.6.0", "1.26.4", False),
    ("3.8.0", "2.4.6", False),  # checked: triton fixed it (int(array.squeeze()))
    ("3.9.0+git1234", "2.4.6", False),
])
def test_interpreter_version_problem(triton_v, numpy_v, bad):
    problem = _compat.interpreter_version_problem(triton_v, numpy_v)
    assert (problem is not None) == bad
    if bad:
        assert triton_v in problem and numpy_v in problem and "numpy<2.4" in problem


def test_unreadable_version():
    with pytest.raises(ValueError, match="version"):
        _compat.interpreter_version_problem("main", "2.4.0")


def test_attention_names_the_versions(monkeypatch):
    """Under the interpreter, a failing pair is a RuntimeError naming both versions, before any launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    _compat.check_interpreter_versions.cache_clear()
    try:
        q = torch.randn(1, 1, 16, 16)
        with pytest.raises(RuntimeError, match=r"triton 3\.6\.0 fails with numpy 2\.4\.1"):
            sparseflash.attention(q, q, q, backend="triton")
        out = sparseflash.attention(q, q, q, backend="reference")  # the reference does not care
        assert torch.isfinite(out).all()
    finally:
        _compat.check_interpreter_versions.cache_clear()


def test_installed_versions_pass_or_are_named():
    problem = _compat.interpreter_version_problem(triton.__version__, numpy.__version__)
    _compat.check_interpreter_versions.cache_clear()
    if problem is None:
        _compat.check_interpreter_versions()
    else:
        with pytest.raises(RuntimeError):
            _compat.check_interpreter_versions()


def test_info_reports_the_interpreter_pair(monkeypatch):
    from sparseflash.cli import info

    assert info()["triton_interpreter"] == (_compat.interpreter_version_problem(triton.__version__, numpy.__version__)
                                            or "ok")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    assert "numpy<2.4" in info()["triton_interpreter"]


@pytest.mark.interpreter
def test_conftest_interpreter_shim_changes_nothing_but_time(monkeypatch):
    """tests/conftest.py has the interpreter skip re-patching triton.language on nested jit calls
    inside a launch: the same numbers as the stock interpreter, bit for bit (forward and backward,
    a mask with partial blocks, GQA, causal)."""
    from triton.runtime import interpreter as interp

    shim = interp._patch_lang
    if not getattr(shim, "_sparseflash_shim", False):
        pytest.skip("the shim is off (SPARSEFLASH_STOCK_INTERPRETER=1, or a triton without its internals)")
    from sparseflash import BlockMask

    mask = BlockMask.from_fn(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 20), 40, block_size=16)
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    k, v = torch.randn(1, 1, 40, 16, generator=g), torch.randn(1, 1, 40, 16, generator=g)

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = sparseflash.attention(qq, kk, vv, mask, causal=True, backend="triton")
        o.backward(do)
        return o.detach(), qq.grad, kk.grad, vv.grad

    fast = run()
    monkeypatch.setattr(interp, "_patch_lang", shim._sparseflash_stock)
    monkeypatch.setattr(interp.GridExecutor, "__call__", interp.GridExecutor.__call__._sparseflash_stock)
    stock = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, stock):
        assert torch.equal(a, b), name
