"""Are the Hopper kernels the same code after a host-side change? Compiles every case of
`studies.hopper.compile_check` (forward and backward, d 64 and 128, dense, causal + key_lengths,
block lists of 128 and 256, exact bits) for sm_90 on any machine (no GPU) and writes each PTX with
its line-number and debug records removed, so a moved or renamed source file compares equal.

    python -m sparseflash.experiments.studies.one_interface.ptx_same dump DIR
    python -m sparseflash.experiments.studies.one_interface.ptx_same compare OLD_DIR NEW_DIR

``compare`` names each kernel "same", "reordered" (the same instructions, registers renumbered, in
another order: what a change of the kernel's signature leaves, as the parameters are loaded in
another order) or "differs" (exit status 1). Parameters are compared without their names or
positions (`normalised`): the GPU tests check that each reaches its place.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

_DROP = re.compile(r"^\s*(\.loc|//|\.file|\.b8|\.b16|\.b32|\.b64|\.section|\.param\b)|debug")


def normalised(ptx: str) -> str:
    """PTX without its line records, debug sections, label numbers and parameter declarations,
    each use of a parameter named only "param"."""
    lines = (re.sub(r"\w+_param_\d+", "param", re.sub(r"\$L__\w+", "", ln)) for ln in ptx.splitlines()
             if not _DROP.search(ln))
    return "\n".join(ln for ln in lines if ln.strip() != ":")  # (a debug label's line, its name gone)


def verdict(old: str, new: str) -> str:
    """"same", "reordered" or "differs" (see the module's doc) of two `normalised` PTX texts."""
    if old == new:
        return "same"
    shape = lambda text: Counter(re.sub(r"%[a-z]+\d+", "%", ln) for ln in text.splitlines())  # noqa: E731
    return "reordered" if shape(old) == shape(new) else "differs"


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
    verdicts = {n: verdict(open(os.path.join(old, n)).read(), open(os.path.join(new, n)).read()) for n in names}
    for n, v in verdicts.items():
        if v != "same":
            print(f"{v}: {n}")
    same, moved = (sum(v == k for v in verdicts.values()) for k in ("same", "reordered"))
    print(f"{same} of {len(names)} kernels the same, {moved} reordered")
    return 0 if same + moved == len(names) else 1


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(dump(a[1]) if a[:1] == ["dump"] else compare(a[1], a[2]) if a[:1] == ["compare"] else print(__doc__) or 2)
