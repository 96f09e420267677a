"""Are the Hopper kernels the same code after a host-side change? Compiles every case of
`studies.hopper.compile_check` (forward and backward, d 64 and 128, dense, causal + key_lengths,
block lists of 128 and 256, exact bits) for sm_90 on any machine (no GPU) and writes each PTX with
its line-number and debug records removed, so a moved or renamed source file compares equal.

    python -m sparseflash.experiments.studies.one_interface.ptx_same dump DIR
    python -m sparseflash.experiments.studies.one_interface.ptx_same compare OLD_DIR NEW_DIR
"""

from __future__ import annotations

import os
import re
import sys

_DROP = re.compile(r"^\s*(\.loc|//|\.file|\.b8|\.b32|\.section)|debug")


def normalised(ptx: str) -> str:
    """PTX without its line records, debug sections and label numbers."""
    return "\n".join(re.sub(r"\$L__\w+", "", ln) for ln in ptx.splitlines() if not _DROP.search(ln))


def dump(out: str) -> int:
    from sparseflash.experiments.studies.hopper import compile_check as cc

    os.makedirs(out, exist_ok=True)
    for kernel in ("fwd", "bwd"):
        for d in (64, 128):
            for label, dense, causal, keylen, block in cc.CASES + cc.EXACT_CASES:
                ck = cc.compile_case(d, dense, causal, keylen, block, seq=300, kernel=kernel,
                                     exact=label.startswith("exact"))
                with open(os.path.join(out, f"{kernel}-d{d}-{label.replace(' ', '_')}.ptx"), "w") as f:
                    f.write(normalised(ck.asm["ptx"]))
    return 0


def compare(old: str, new: str) -> int:
    names = sorted(n for n in os.listdir(old) if n.endswith(".ptx"))
    differ = [n for n in names if open(os.path.join(old, n)).read() != open(os.path.join(new, n)).read()]
    for n in differ:
        print("differs:", n)
    print(f"{len(names) - len(differ)} of {len(names)} kernels the same")
    return 1 if differ else 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(dump(a[1]) if a[:1] == ["dump"] else compare(a[1], a[2]) if a[:1] == ["compare"] else print(__doc__) or 2)
