"""Test configuration shared by every test file.

Without a GPU the Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be in the
environment before triton compiles anything, so it is set here, before any test module imports
sparseflash or triton. On a GPU machine the same files run the kernels compiled, at full sizes.
"""

import os
import shutil
import subprocess

import pytest


def _has_cuda() -> bool:
    # Decide without importing torch (importing torch first is harmless, but keep this cheap).
    if os.environ.get("SPARSEFLASH_FORCE_CPU") == "1":
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_report_header(config):
    if HAS_CUDA:
        return None
    try:
        import numpy
        import triton
    except ImportError:
        return None
    from sparseflash._compat import interpreter_version_problem

    problem = interpreter_version_problem(triton.__version__, numpy.__version__)
    return f"WARNING: {problem}" if problem else None


def _skip_nested_lang_patching() -> None:
    """Make the Triton interpreter's device-function calls skip re-patching triton.language
    while a kernel launch has it patched already.

    Under the interpreter every call of a @triton.jit helper from inside a kernel re-runs
    ``_patch_lang`` (``inspect.getmembers`` over triton.language, its tensor and math modules),
    though the enclosing launch patched the same modules and restores them only when it ends:
    the re-patch installs equivalent wrappers over wrappers it skips. That redundant work was
    about 40% of the CPU time of a kernel test. Here a nested call whose language modules are
    already patched by the running launch does nothing; any other call (a launch, a helper
    that sees a language module the launch did not patch) goes through the stock function, so
    the patched state the kernels run under is the stock one. SPARSEFLASH_STOCK_INTERPRETER=1
    leaves the interpreter untouched; a triton without these internals is left untouched too."""
    if os.environ.get("SPARSEFLASH_STOCK_INTERPRETER") == "1":
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    stock = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if stock is None or executor is None or scope_cls is None or getattr(stock, "_sparseflash_shim", False):
        return
    patched: list[set] = []  # per running launch: ids of the language modules it patched
    langs_of: dict = {}

    def langs(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs_of:  # the same scan as the stock function's
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in [tl, tl.core])
        return langs_of[key]

    def patch_lang(fn):
        mods = langs(fn)
        if patched and mods and mods <= patched[-1]:
            return scope_cls()  # nothing to restore: the launch's own scope restores its changes
        scope = stock(fn)
        if patched:
            patched[-1] |= mods
        return scope

    patch_lang._sparseflash_shim = True
    patch_lang._sparseflash_stock = stock  # for tests/test_compat.py's comparison with the stock path
    launch = executor.__call__

    def call(self, *args, **kwargs):
        patched.append(set())  # filled by the launch's own (stock) _patch_lang call
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    call._sparseflash_stock = launch
    interp._patch_lang = patch_lang
    executor.__call__ = call


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":
        _skip_nested_lang_patching()
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: long on CPU; runs only with SPARSEFLASH_SLOW=1 (always on GPU)")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors under the interpreter; "
                                       "skipped where it cannot run (a GPU machine, or a triton / numpy pair it fails with)")


def _interpreter_unusable() -> str | None:
    """Why the Triton interpreter cannot run here, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "runs kernels under the Triton interpreter, which is on only on CPU machines"
    try:
        import numpy
        import triton
    except ImportError:
        return None
    from sparseflash._compat import interpreter_version_problem

    return interpreter_version_problem(triton.__version__, numpy.__version__)


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("SPARSEFLASH_SLOW") == "1" or HAS_CUDA
    skip_slow = pytest.mark.skip(reason="slow on CPU: set SPARSEFLASH_SLOW=1 to run")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interpreter = _interpreter_unusable() if any("interpreter" in item.keywords for item in items) else None
    for item in items:
        if "interpreter" in item.keywords and no_interpreter:
            item.add_marker(pytest.mark.skip(reason=no_interpreter))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On a GPU machine, a test still running after SPARSEFLASH_TEST_HANG_S seconds (default 240; 0
    turns the watchdog off) ends the run with every thread's traceback on stderr: a kernel that
    deadlocks (a barrier waiting for a step nobody issues) then names its test, instead of holding
    the GPU until an outer time bound cuts the run with no report."""
    limit = float(os.environ.get("SPARSEFLASH_TEST_HANG_S", "240")) if HAS_CUDA else 0.0
    if limit <= 0:
        yield
        return
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(limit, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def device():
    """'cuda' on a GPU machine, else 'cpu' (kernels then run under the Triton interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def tma_on(monkeypatch, device):
    """TMA descriptors wherever the inputs allow (the interpreter runs them on CPU); records each
    launch's choice (forward, then dQ and dK/dV when there is a backward), so a test can check
    the path it meant to cover was taken."""
    import torch

    from sparseflash.flash import tiles

    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90 or newer")
    from sparseflash.flash import fast

    monkeypatch.setattr(tiles, "TMA_MODE", "on")
    # these tests cover the portable kernels' descriptor loads: the Hopper forward stays out
    monkeypatch.setattr("sparseflash.flash.hopper.forward.MODE", "off")
    # every call through the launchers' decisions (the short path takes only calls without descriptors)
    monkeypatch.setattr(fast, "ENABLED", False)
    taken = []
    real = tiles.tma_args

    def spy(*a):
        args, tma = real(*a)
        taken.append(tma)
        return args, tma

    monkeypatch.setattr(tiles, "tma_args", spy)
    return taken


@pytest.fixture
def frozen_gc():
    """The objects alive before the test are left out of garbage collection for its length (``gc.freeze``;
    ``gc.unfreeze`` after): code under test that calls ``gc.collect()`` (the benchmark's timing, before every
    measurement) scans only what the test made, not the whole session's heap (0.2-0.5 s a call by the end
    of a CPU run). What is collected, and when, is otherwise unchanged."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
