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
