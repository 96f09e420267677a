"""Where does an eager call's host time go? cProfile of calls too small for the GPU to hide their host.

    python -m sparseflash.experiments.studies.hopper_threshold.host_profile --out DIR [--device cuda]

Cases (bf16, B1 H16 N16K d128, random masks of 1 block of 128 a row unless said): the Hopper kernels
(TMA_MODE "on") forward and forward+backward, the portable kernels (TMA_MODE "off") the same, and the
per-call mask step (`topk_blocks` of 8 blocks, causal, + attention; the default dispatch) forward and
forward+backward. Per case: host µs per call (calls issued back to back without a sync; the GPU
work is far shorter, so the issue rate is the host's), the number of host syncs one call makes
(`torch.cuda.set_sync_debug_mode("warn")`; where a call makes one, the traceback of the first), and the cProfile of 20 calls (top functions by own
time and by cumulative time). Writes DIR/host_profile.txt and DIR/host_profile.json; prints the
summary table last. About a minute on an H200 (the kernels compile first). ``--device cpu``: a
labelled check of the script under the interpreter (tiny sizes, portable kernels only).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command


def _host_us(step, calls: int) -> float:
    """Microseconds per call to issue ``calls`` calls back to back (synchronised before and after)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def _syncs(step) -> int:
    """Host syncs one call makes, as torch's sync debug mode reports them (0 on CPU)."""
    if not torch.cuda.is_available():
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (not the "prototype feature" notice torch gives the first time the mode is set)
    return sum("called a synchronizing" in str(w.message).lower() for w in caught)


def _sync_where(step) -> str:
    """The traceback of the first host sync of one call (sync debug mode "error"), or ""."""
    import traceback

    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError:
        return traceback.format_exc()[-2500:]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return ""


def _profile(step, calls: int, top: int) -> str:
    from sparseflash.experiments.bench.timing import profile_text

    return profile_text(step, calls, top, ("tottime", "cumulative"))


def cases(dev: torch.device, tiny: bool):
    import sparseflash
    from sparseflash.flash import tiles
    from sparseflash.patterns import random as random_mask

    b, h, n, d = (1, 2, 256, 64) if tiny else (1, 16, 16384, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.float32 if tiny else torch.bfloat16
    q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=dt, generator=g) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    mask = random_mask(n, 1, block_size=128, seed=0, device=dev)

    def fwd():
        with torch.no_grad():
            sparseflash.attention(q, k, v, mask=mask)

    def fwdbwd():
        torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=mask), (qg, kg, vg), do)

    def dyn_fwd():
        with torch.no_grad():
            m = sparseflash.topk_blocks(q, k, 8 if not tiny else 1, 128, causal=True)
            sparseflash.attention(q, k, v, mask=m, causal=True)

    def dyn_fwdbwd():
        m = sparseflash.topk_blocks(q, k, 8 if not tiny else 1, 128, causal=True)
        torch.autograd.grad(sparseflash.attention(qg, kg, vg, mask=m, causal=True), (qg, kg, vg), do)

    settings = [("portable", "off")] if tiny else [("hopper", "on"), ("portable", "off")]
    for name, mode in settings:
        for what, step in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            yield f"{name} {what}", mode, step
    for what, step in (("fwd", dyn_fwd), ("fwdbwd", dyn_fwdbwd)):
        yield f"per-call-topk8 {what}", tiles.TMA_MODE, step


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper_threshold.host_profile",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU (use --device cpu for the labelled check)")
    from sparseflash.experiments.bench.results import environment
    from sparseflash.flash import tiles

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = dev.type == "cpu"
    calls = 2 if tiny else args.calls
    rows, text = [], []
    saved = tiles.TMA_MODE
    try:
        for label, mode, step in cases(dev, tiny):
            tiles.TMA_MODE = mode
            for _ in range(3):
                step()  # compile, warm caches
            row = dict(case=label, tma_mode=mode, host_us=_host_us(step, calls), syncs=_syncs(step))
            if row["syncs"]:
                row["sync_where"] = _sync_where(step)
                print(row["sync_where"], flush=True)
            text.append(f"===== {label} (TMA_MODE {mode}): {row['host_us']:.0f} us/call, "
                        f"{row['syncs']} syncs\n" + _profile(step, calls, args.top))
            rows.append(row)
            print(f"{label:<24} {row['host_us']:8.0f} us  syncs {row['syncs']}", flush=True)
    finally:
        tiles.TMA_MODE = saved
    meta = dict(environment(dev), label="CPU check of the script (interpreter, tiny)" if tiny else None)
    (out / "host_profile.txt").write_text("\n".join(text))
    (out / "host_profile.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    print(f"\n{'case':<24} {'host us':>8} {'syncs':>5}")
    for r in rows:
        print(f"{r['case']:<24} {r['host_us']:8.0f} {r['syncs']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
