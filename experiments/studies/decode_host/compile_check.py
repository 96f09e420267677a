"""The decode split kernel under each set of switches (`decode_host.VARIANTS`), compiled for sm_90 on any
machine (no GPU): registers, spills, shared memory, and for the fused merge whether its tile of
partial outputs gets `decode_combine_kernel`'s layout (the same layout sums the splits in the same
order: bitwise the combine's answer, which the GPU tests then check).

    python -m sparseflash.experiments.studies.decode_host.compile_check [--out DIR]

Cases: the decode bench's dense points at a 16K cache (GQA 32/8, d 128, bf16, one query token, the
split count `decode.pick_splits` gives on an H200's 132 SMs under the variant: B1 33 splits, B4 12
balanced (the default) or 9 unbalanced, B16 3) and B3 with leftpad and a batch index (11 splits). The
bounds are checked in the split kernel unless the variant turns ``check_in_split`` off. Each plan's
launches go through Triton's own specialisation with a stand-in sm_90 driver
(`inspect_kernels.compile_launches`); nothing runs. Prints a table; with ``--out`` writes
DIR/compile_sm90.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

H, HK, D, N, SMS = 32, 8, 128, 16384, 132
CASES = [("B1", 1, {}), ("B4", 4, {}), ("B16", 16, {}), ("B3-leftpad-bidx", 3, dict(leftpad=True, batch_idx=True))]


@contextmanager
def _switches(overrides: dict):
    """decode.OVERRIDES set to ``overrides`` inside (restored after); yields the decode module."""
    from sparseflash.flash import decode

    with decode.overridden(overrides):
        yield decode


def splits(batch: int, overrides: dict | None = None) -> int:
    """`decode.pick_splits` on an H200 (132 SMs) for the 16K cache (256 key tiles of 64) under ``overrides``
    (balanced unless they turn ``balanced_splits`` off)."""
    with _switches(overrides or {}) as decode:
        sm_count = decode.sm_count
        decode.sm_count = lambda device: SMS
        try:
            return decode.pick_splits(batch, HK, N // 64, torch.device("cpu"))
        finally:
            decode.sm_count = sm_count


def compile_case(batch: int, overrides: dict, leftpad: bool = False, batch_idx: bool = False) -> dict:
    """{kernel name: CompiledKernel} of one decode call's split (and combine) launch for sm_90."""
    from sparseflash.experiments.bench.inspect_kernels import compile_launches

    n_splits = splits(batch, overrides)
    with _switches(overrides) as decode:
        q = torch.zeros(batch, 1, H, D, dtype=torch.bfloat16)
        k = torch.zeros(batch + batch_idx, N, HK, D, dtype=torch.bfloat16)
        vec = torch.zeros(batch, dtype=torch.int32)
        p = decode.plan(q, k, k, scale=D ** -0.5, window=(-1, -1), batch_idx=batch_idx, leftpad=leftpad,
                        num_splits=n_splits, max_len=N, store_lse=False, check=decode.switch("check_in_split"))
        return compile_launches(lambda: p(q, k, k, vec, vec if leftpad else None, vec if batch_idx else None))


def _layouts(ttgir: str) -> dict:
    return dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]+)$", ttgir, re.M))


def partial_tile_layout(ttgir: str, fused: bool) -> str | None:
    """The layout of the 2-D float32 tile of partial outputs the merge loads (fused: the .cg load of the
    split kernel; else the combine kernel's), or None when there is none."""
    pattern = r"tt\.load [^\n]*" + (r"cache_modifier = cg[^\n]*" if fused else "") \
        + r": tensor<\d+x\d+x!tt\.ptr<f32>, (#\w+)>"
    m = re.search(pattern, ttgir)
    return _layouts(ttgir).get(m.group(1), m.group(1)) if m else None


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.decode_host.compile_check",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for compile_sm90.json")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would not compile; unset it", file=sys.stderr)
        return 2
    from sparseflash.experiments.bench.inspect_kernels import report
    from sparseflash.experiments.studies.decode_host import VARIANTS

    rows = []
    for label, batch, kw in CASES:
        combine_layout = None
        for variant, overrides in VARIANTS.items():
            compiled = compile_case(batch, overrides, **kw)
            for r in report(compiled):
                ttgir = compiled[r["kernel"]].asm["ttgir"]
                row = dict(case=label, batch=batch, splits=splits(batch, overrides), variant=variant,
                           kernel=r["kernel"], regs=r["regs"], stack=r["stack"], local=r["local"], shared=r["shared"])
                if r["kernel"] == "decode_combine_kernel" and variant == "default":
                    combine_layout = partial_tile_layout(ttgir, fused=False)
                if r["kernel"] == "decode_split_kernel" and overrides.get("fused_combine"):
                    row["merge_layout_is_combine_s"] = partial_tile_layout(ttgir, fused=True) == combine_layout
                    ptx = compiled[r["kernel"]].asm["ptx"]
                    row["ticket_atomic"] = "atom.global.gpu.acq_rel.add" in ptx
                rows.append(row)
    print(f"{'case':>16} {'S':>3} {'variant':>10} {'kernel':>22} {'regs':>5} {'spill':>6} {'shared':>7}  merge layout")
    for r in rows:
        merge = "" if "merge_layout_is_combine_s" not in r else \
            ("the combine's" if r["merge_layout_is_combine_s"] else "DIFFERS") + \
            ("" if r["ticket_atomic"] else ", no acq_rel ticket")
        print(f"{r['case']:>16} {r['splits']:>3} {r['variant']:>10} {r['kernel']:>22} {r['regs']:>5} "
              f"{r['stack'] + r['local']:>6} {r['shared']:>7}  {merge}")
    if args.out:
        from sparseflash.experiments.bench.results import environment

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_sm90.json").write_text(json.dumps(dict(meta=dict(environment(torch.device("cpu")),
                                                                         target="sm_90"), rows=rows), indent=1) + "\n")
        print(f"wrote {out / 'compile_sm90.json'}")
    bad = [r for r in rows if r["stack"] or r["local"] or r.get("merge_layout_is_combine_s") is False
           or r.get("ticket_atomic") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_command(main))
