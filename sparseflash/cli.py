"""The `sparseflash` command line (also `python -m sparseflash`).

Subcommands are contributed by the modules that own them, each through a ``register(subparsers)``
function that only declares arguments (heavy imports happen when a command runs):

    sparseflash info                      versions, GPU, triton backend
    sparseflash patterns ...              draw and analyse the pattern zoo        (analysis.py)
    sparseflash bench sparsity|seqlen     benchmarks against the baselines         (experiments/bench)
    sparseflash plot RESULTS              redraw figures from saved results        (experiments/bench)
    sparseflash lra data|show|train|speed LRA / Path-X data and experiments       (experiments/lra)

The error contract (one line ``sparseflash: error: <what> (<what to do>)`` and exit status 2 for
a known failure) and the argument helpers every command uses live in `sparseflash.cmdline`, a leaf
module: the command modules import it, never this one, so loading them here makes no import loop.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

from sparseflash import _env
# the shared error contract and argument helpers (re-exported: commands and tests use them from here too)
from sparseflash.cmdline import (EXIT_INTERRUPTED, EXIT_USAGE, ArgumentParser, CommandError,  # noqa: F401
                                 check_output_dir, check_output_file, known_error, non_negative_int, positive_int,
                                 run_command)

_REGISTRARS = (
    "sparseflash.analysis",
    "sparseflash.experiments.bench.cli",
    "sparseflash.experiments.lra.cli",
)


def info() -> dict:
    """Versions, devices and which attention backends can run here."""
    import torch

    import sparseflash

    out = {
        "sparseflash": sparseflash.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "TRITON_INTERPRET": _env.text("TRITON_INTERPRET"),
    }
    try:
        import numpy
        import triton

        from sparseflash._compat import interpreter_version_problem

        out["triton"] = triton.__version__
        out["numpy"] = numpy.__version__
        out["triton_interpreter"] = interpreter_version_problem(triton.__version__, numpy.__version__) or "ok"
    except ImportError as e:  # pragma: no cover - triton is a dependency on Linux
        out["triton"] = f"not importable ({e})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
        out["cuda"] = torch.version.cuda
    from sparseflash.api import resolve_backend

    out["backend_auto_cuda"] = "triton" if torch.cuda.is_available() else "n/a (no GPU)"
    out["backend_auto_cpu"] = resolve_backend("auto", torch.device("cpu"))
    return out


def _cmd_info(args) -> int:
    for k, v in info().items():
        print(f"{k:20s} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from sparseflash import __version__

    parser = ArgumentParser(prog="sparseflash", description="Block-sparse FlashAttention toolkit")
    parser.add_argument("--version", action="version", version=f"sparseflash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="print versions, GPU and triton availability")
    p.set_defaults(func=_cmd_info)
    for name in _REGISTRARS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that part of the toolkit is not installed
            raise
        module.register(sub)
    return parser


def main(argv=None) -> int:
    """Run one command; known failures end with one line on stderr and `EXIT_USAGE` (module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return run_command(args.func, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
