"""What the machine can compile for Hopper without a GPU (shared by test_bench and test_studies)."""

import os


def ptxas_available() -> bool:
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def gluon_hopper_available() -> bool:
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no gluon for Hopper here
        return False
    return True


def compile_sm90(*variants: str, timeout: int = 900) -> str:
    """Run tests/_compile_sm90.py for ``variants`` in a child process outside the interpreter (the
    checkout's root first on its path, so it imports this sparseflash also where none is installed);
    skips the calling test when this triton cannot compile for CUDA here, fails it when a compile
    fails, and returns the child's output (one line per kernel compiled)."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    here = Path(__file__).resolve()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(here.with_name("_compile_sm90.py")), *variants], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout
