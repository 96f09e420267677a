"""Forward + backward at 16K tokens, ours against cuDNN, in short bursts and sustained, with the SM
clock and power drawn (issue 22: how far the H100's power cap moves a timing).

    python -m sparseflash.experiments.studies.hopper.power_probe [--out DIR]

Dense, bf16, B=1, H=16, d=128 and 64, two rounds. Per provider, after 1.5 s idle: 5 eager calls
(``burst5``, ms per call), then 100 (``burst100_after``), then `bench.timing.graph_ms` (``graph``,
about a second of CUDA-graph replays). ``nvidia-smi`` samples clocks.sm and power.draw every 50 ms
meanwhile; the table gives each window's mean clock and power. Needs nvidia-smi on the PATH.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command


def _burst(step, n: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        step()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.power_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.experiments.studies.hopper.fwd_bench import _call, save_json, step
    from sparseflash.flash import fast

    fast.ENABLED = False
    log_path = Path(tempfile.mkstemp(suffix=".csv")[1])
    with open(log_path, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                                "--format=csv,noheader", "-lms", "50"], stdout=log)
        rows = []
        try:
            for d in (128, 64):
                g = torch.Generator(device="cuda").manual_seed(16384 + d)
                q, k, v, do = (torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16, generator=g)
                               for _ in range(4))
                for rnd in range(2):
                    for prov in ("hopper", "sdpa-cudnn"):
                        run = step(prov, _call(prov, None, False, d ** -0.5), "fwdbwd", q, k, v, do)
                        run()
                        torch.cuda.synchronize()
                        time.sleep(1.5)
                        t0 = time.time()
                        b5, b100 = _burst(run, 5), _burst(run, 100)
                        t1 = time.time()
                        gm = graph_ms(run)
                        rows.append(dict(d=d, rnd=rnd, prov=prov, burst5=round(b5, 3), burst100_after=round(b100, 3),
                                         graph=round(gm, 3), _win=((t0, t1), (t1, time.time()))))
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "_win"}), flush=True)
        finally:
            smi.terminate()
            smi.wait()
    samples = []
    for line in log_path.read_text().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3:
            try:
                samples.append((datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(f[1].split()[0]),
                                float(f[2].split()[0]), f[3] if len(f) > 3 else ""))
            except ValueError:
                continue
    for r in rows:
        for name, (a, b) in zip(("burst", "graph"), r.pop("_win")):
            sel = [s for s in samples if a <= s[0] <= b]
            if sel:
                r[f"clk_{name}_mean"] = round(sum(s[1] for s in sel) / len(sel))
                r[f"power_{name}_mean"] = round(sum(s[2] for s in sel) / len(sel))
                r[f"throttle_{name}"] = sel[-1][3]
    if args.out:
        save_json(args.out, "power_probe.json", rows)
    print(f"{'d':>3s} {'provider':10s} {'burst5':>7s} {'graph':>7s} {'MHz burst':>9s} {'MHz graph':>9s} {'W graph':>7s}")
    for r in rows:
        print(f"{r['d']:3d} {r['prov']:10s} {r['burst5']:7.3f} {r['graph']:7.3f} {r.get('clk_burst_mean', 0):9d} "
              f"{r.get('clk_graph_mean', 0):9d} {r.get('power_graph_mean', 0):7d}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
