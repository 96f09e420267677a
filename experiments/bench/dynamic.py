"""Masks selected on the GPU every call: top-k block selection + `BlockMask.from_indices`
+ attention, against the same call with the mask fixed and against FlexAttention with its block
mask built per call.

    python -m sparseflash.experiments.bench.dynamic --out DIR [--tokens 16384] [--heads 16]
        [--head-dims 64 128] [--ks 8 16] [--compile-ks 8 16] [--no-flex] [--merge]
    python -m sparseflash.experiments.bench.dynamic --plot DIR        (redraw DIR/dynamic.png)
    python -m sparseflash.experiments.bench.dynamic --device cpu --out DIR   (tiny CPU smoke run, labelled)

bf16, batch 1, causal, 128-token blocks (128 key blocks at 16K). Selection: `topk_indices` (the
top K of 128 key blocks of every query block by mean-pooled q·k, the own block on and not counted).
One row per (head_dim, K, provider, mode):

- ``select``: the selection alone (``topk_indices``); ``index``: ``BlockMask.from_indices`` + its
  row and column lists (one Triton launch on CUDA, `sparseflash.index_kernels`); both GPU time of
  their eager kernels (`timing.kernel_ms`, ``gpu_ms``); the index row's ``goal_ms`` is 0.030.
- ``fixed``: attention with the same mask built once (``from_layout``, index cached): ``ms`` eager
  back to back, ``gpu_ms`` its eager kernels' GPU time, ``graph_ms`` CUDA-graph replay.
- ``per-call``: selection + index + attention every call, eager (``ms``, `timing.stream_ms`: the
  host shows where it is the longer), ``graph_ms`` the whole step replayed from a CUDA graph, and
  ``compiled_ms`` the step under ``torch.compile(fullgraph=True)`` (for ``--compile-ks``, default
  every K; ``compile_s`` its first call). ``goal_ms`` = select gpu_ms + 1.1 x fixed gpu_ms (the bound
  a per-call mask should meet to cost no more than selecting plus a fixed mask's call) and ``meets_goal``.
- ``flex``: FlexAttention with its block mask built per call from the same top-k ids
  (``BlockMask.from_kv_blocks``: own block partial with a causal mask_mod, the selected blocks
  full): ``ms`` = mask built eagerly + ``torch.compile(flex_attention)`` (Flex's usual use),
  ``compiled_ms`` = the whole step compiled; ``speedup_vs_flex`` (eager) and
  ``compiled_speedup_vs_flex`` on the per-call rows.
- ``sync-check``: ``torch.cuda.set_sync_debug_mode("error")`` around selection + from_indices +
  attention forward (status ``ok`` or the error).

Modes ``fwd`` (no grad) and ``fwdbwd`` (``torch.autograd.grad`` of the output). ``max_diff``: the
per-call output against the fixed-mask output (exact: 0) and Flex's. Writes DIR/dynamic.csv,
DIR/dynamic.json and DIR/dynamic.png; prints a table last. Most of the time is compiling; with a
time limit near, run ``--head-dims 64`` and then ``--head-dims 128 --merge`` into one DIR (``--merge``
keeps DIR's rows of the head dims and Ks this run does not measure).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command

BLOCK = 128  # the default block (--block)
INDEX_GOAL_MS = 0.030  # issue 55: the index build from indices within 30 us of GPU time


def flex_mask_from_ids(pick: torch.Tensor, n: int, block: int = BLOCK):
    """A Flex BlockMask for causal attention from top-k ids ``pick [B, H, QB, W]`` (-1 = none; the own
    block is added here): the own block partial (causal mask_mod), the selected ones full. Built on
    the device without a host read."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    B, H, qb, _ = pick.shape
    kb = qb
    rows = torch.arange(qb, device=pick.device)
    sel = torch.where((pick >= 0) & (pick < rows[:, None]), pick, -1)
    sel = sel.sort(dim=-1, descending=True).values  # valid ids first (-1 last)
    full_num = (sel >= 0).sum(-1, dtype=torch.int32)
    full_idx = torch.nn.functional.pad(sel.clamp(min=0), (0, kb - sel.shape[-1])).to(torch.int32)
    part_num = torch.ones(B, H, qb, dtype=torch.int32, device=pick.device)
    part_idx = torch.nn.functional.pad(rows.view(1, 1, qb, 1).expand(B, H, qb, 1), (0, kb - 1)).to(torch.int32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return FlexBlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=causal,
                                        seq_lengths=(n, n))


def _grad_step(fwd, inputs, do):
    def step():
        torch.autograd.grad(fwd(), inputs, do)
    return step


def run(args, checkpoint=None) -> list[dict]:
    """The rows (module docstring); ``checkpoint(rows)`` after each (head_dim, K), so a run cut short keeps them."""
    import sparseflash
    from sparseflash import BlockMask
    from sparseflash.dynamic import topk_indices
    from sparseflash.experiments.bench import timing
    from sparseflash.experiments.bench.results import CPU_NOTE, environment

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    env = environment(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    n, H, B = args.tokens, args.heads, args.block
    rows = []
    flex_fn = None
    if cuda and not args.no_flex:
        from sparseflash.experiments.bench.providers import _flex_compiled

        flex_fn = _flex_compiled()  # (also raises dynamo's recompile limits, which the compiled rows need)

    def gpu(fn):
        return timing.kernel_ms(fn)[0] if cuda else timing.cpu_ms(fn, reps=1)

    def eager(fn):
        return timing.stream_ms(fn, calls=5) if cuda else timing.cpu_ms(fn, reps=1)

    for D in args.head_dims:
        g = torch.Generator(device=device).manual_seed(D)
        q, k, v, do = (torch.randn(1, H, n, D, device=device, dtype=dtype, generator=g) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for K in args.ks:
            base = dict(bench="dynamic", heads=H, seq_len=n, head_dim=D, k_blocks=K, kb=n // B, block=B,
                        dtype=str(dtype).replace("torch.", ""), causal=True, note="" if cuda else CPU_NOTE, **env)

            def select():
                return topk_indices(q, k, K, B, causal=True)

            def per_call_fwd():
                ids = topk_indices(q, k, K, B, causal=True)
                return sparseflash.attention(q, k, v, BlockMask.from_indices(ids, n, block_size=B, check=False),
                                             causal=True)

            ids = select()
            dyn = BlockMask.from_indices(ids, n, block_size=B)
            fixed = BlockMask.from_layout(dyn.layout.clone(), B, n)
            fixed.index(device)

            def fixed_fwd():
                return sparseflash.attention(q, k, v, fixed, causal=True)

            def add(provider, mode, **kw):
                rows.append(dict(base, provider=provider, mode=mode, status="ok", **kw))
                print(json.dumps({c: rows[-1].get(c) for c in ("provider", "mode", "head_dim", "k_blocks", "ms", "gpu_ms",
                                                               "graph_ms", "compiled_ms", "status")}), flush=True)

            sel_ms = gpu(select)
            add("select", "fwd", gpu_ms=sel_ms, density=round(float(fixed.density()), 4))
            idx_ms = gpu(lambda: BlockMask.from_indices(ids, n, block_size=B, check=False).index())
            add("index", "fwd", gpu_ms=idx_ms, goal_ms=INDEX_GOAL_MS, meets_goal=idx_ms <= INDEX_GOAL_MS)
            with torch.no_grad():
                o_dyn, o_fix = per_call_fwd().float(), fixed_fwd().float()
            diff_fixed = float((o_dyn - o_fix).abs().max())
            diff_flex = float("nan")
            if flex_fn is not None:
                with torch.no_grad():
                    o_flex = flex_fn(q, k, v, block_mask=flex_mask_from_ids(ids, n, B)).float()
                diff_flex = float((o_dyn - o_flex).abs().max())
            for mode in ("fwd", "fwdbwd"):
                def wrap(f):
                    if mode == "fwd":
                        def call():
                            with torch.no_grad():
                                f()
                        return call
                    return _grad_step(f, (q, k, v), do)

                fx = dict(ms=eager(wrap(fixed_fwd)), gpu_ms=gpu(wrap(fixed_fwd)))
                if cuda:
                    fx["graph_ms"] = timing.graph_ms(wrap(fixed_fwd))
                add("fixed", mode, **fx)
                pc = dict(ms=eager(wrap(per_call_fwd)), gpu_ms=gpu(wrap(per_call_fwd)), max_diff=diff_fixed)
                if cuda:
                    pc["graph_ms"] = timing.graph_ms(wrap(per_call_fwd))
                    if K in args.compile_ks:
                        comp = torch.compile(per_call_fwd, fullgraph=True)
                        t0 = time.perf_counter()
                        wrap(comp)()
                        torch.cuda.synchronize()
                        pc["compile_s"] = round(time.perf_counter() - t0, 1)
                        pc["compiled_ms"] = eager(wrap(comp))
                pc["goal_ms"] = sel_ms + 1.1 * fx["gpu_ms"]
                pc["meets_goal"] = pc["ms"] <= pc["goal_ms"]
                if flex_fn is not None:
                    def flex_fwd():
                        pick = topk_indices(q, k, K, B, causal=True)
                        return flex_fn(q, k, v, block_mask=flex_mask_from_ids(pick, n, B))

                    fl = dict(ms=eager(wrap(flex_fwd)), max_diff=diff_flex)
                    try:
                        fl["graph_ms"] = timing.graph_ms(wrap(flex_fwd))
                    except Exception as e:  # noqa: BLE001 - a capture Flex cannot do: say so in the row
                        fl["note"] = f"graph: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    if K in args.compile_ks:
                        from torch.nn.attention.flex_attention import flex_attention

                        def flex_step():
                            pick = topk_indices(q, k, K, B, causal=True)
                            return flex_attention(q, k, v, block_mask=flex_mask_from_ids(pick, n, B))

                        try:
                            comp_flex = torch.compile(flex_step, fullgraph=True)
                            wrap(comp_flex)()
                            fl["compiled_ms"] = eager(wrap(comp_flex))
                        except Exception as e:  # noqa: BLE001
                            fl["note"] = (fl.get("note", "") + f" compile: {type(e).__name__}: "
                                          f"{str(e).splitlines()[0][:120]}").strip()
                    add("flex", mode, **fl)
                    pc["speedup_vs_flex"] = fl["ms"] / pc["ms"]
                    if "compiled_ms" in fl and "compiled_ms" in pc:
                        pc["compiled_speedup_vs_flex"] = fl["compiled_ms"] / pc["compiled_ms"]
                add("per-call", mode, **pc)
            if cuda:
                status = "ok"
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.no_grad():
                        sel = topk_indices(q, k, K, B, causal=True)  # selection + index + attention
                        sparseflash.attention(q, k, v, BlockMask.from_indices(sel, n, block_size=B), causal=True)
                except Exception as e:  # noqa: BLE001 - the finding is the row
                    status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                rows.append(dict(base, provider="sync-check", mode="fwd", status=status))
            if checkpoint is not None:
                checkpoint(rows)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def plot(out: Path) -> Path:
    """DIR/dynamic.png from DIR/dynamic.json: ms per call by provider, one panel per (head_dim, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure, suptitle

    rows = [r for r in json.loads((out / "dynamic.json").read_text())["rows"] if r["status"] == "ok"]
    panels = sorted({(r["head_dim"], r["mode"]) for r in rows if r["provider"] in ("fixed", "per-call")})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.6 * max(1, len(panels)), 4), squeeze=False)
    bars = [("fixed", "gpu_ms", "fixed mask (GPU)"), ("per-call", "ms", "per-call eager"),
            ("per-call", "graph_ms", "per-call CUDA graph"), ("per-call", "compiled_ms", "per-call compiled"),
            ("flex", "ms", "Flex, mask per call"), ("flex", "compiled_ms", "Flex compiled")]
    for ax, (D, mode) in zip(axes[0], panels):
        ks = sorted({r["k_blocks"] for r in rows if r["head_dim"] == D})
        width = 0.8 / len(bars)
        for i, (prov, col, label) in enumerate(bars):
            ys = [next((r.get(col) for r in rows if r["provider"] == prov and r["head_dim"] == D
                        and r["mode"] == mode and r["k_blocks"] == K), None) for K in ks]
            ys = [float("nan") if y is None else y for y in ys]
            ax.bar([j + i * width for j in range(len(ks))], ys, width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ks))], [f"K={K}" for K in ks])
        ax.set_ylabel("ms per call")
        ax.set_title(f"d={D} {mode}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    r0 = rows[0] if rows else {}
    suptitle(fig, f"top-k blocks per call: {r0.get('seq_len')} tokens, {r0.get('heads')} heads, causal, {r0.get('dtype')}",
             rows)
    return save_figure(fig, out / "dynamic.png")


def merge_rows(path: Path, rows: list[dict]) -> list[dict]:
    """``rows`` after the rows of ``path`` (an earlier dynamic.json) whose (head_dim, k_blocks) ``rows``
    does not have."""
    if not path.exists():
        return rows
    new = {(r["head_dim"], r["k_blocks"]) for r in rows}
    old = [r for r in json.loads(path.read_text())["rows"] if (r["head_dim"], r["k_blocks"]) not in new]
    return old + rows


def _fmt(x) -> str:
    if x is None or x != x:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.dynamic", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dynamic_out")
    ap.add_argument("--plot", metavar="DIR", help="only redraw DIR/dynamic.png from DIR/dynamic.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=positive_int, default=None, help="GPU 16384, CPU 512 (a multiple of 128)")
    ap.add_argument("--heads", type=positive_int, default=None, help="GPU 16, CPU 2")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=None, help="GPU 64 128, CPU 16")
    ap.add_argument("--block", type=positive_int, default=BLOCK, help="block size (a multiple of 16; default 128)")
    ap.add_argument("--ks", type=positive_int, nargs="+", default=None, help="key blocks selected (GPU 8 16, CPU 1)")
    ap.add_argument("--compile-ks", type=positive_int, nargs="*", default=None,
                    help="the Ks also timed under torch.compile (GPU only; default every K; none: no value)")
    ap.add_argument("--merge", action="store_true",
                    help="keep DIR's earlier rows of the (head_dim, K) pairs this run does not measure")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    cuda = args.device.startswith("cuda")
    for name, g, c in (("tokens", 16384, 256), ("heads", 16, 2), ("head_dims", [64, 128], [16]), ("ks", [8, 16], [1])):
        if getattr(args, name) is None:
            setattr(args, name, g if cuda else c)
    if args.block % 16 or args.tokens % args.block:
        ap.error(f"--block must be a multiple of 16 and --tokens a multiple of --block, got {args.block}, {args.tokens}")
    if args.compile_ks is None:
        args.compile_ks = list(args.ks)
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda without a CUDA GPU")
    check_output_dir(args.out)
    t0 = time.time()
    from sparseflash.experiments.bench.results import write_tidy

    out = Path(args.out)
    command = "python -m sparseflash.experiments.bench.dynamic " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier = merge_rows(out / "dynamic.json", []) if args.merge else []

    def write(rows, done: bool):
        new = {(r["head_dim"], r["k_blocks"]) for r in rows}
        meta = dict(command=command, seconds=round(time.time() - t0, 1), complete=done)
        write_tidy([r for r in earlier if (r["head_dim"], r["k_blocks"]) not in new] + rows, meta, out, "dynamic",
                   "sparseflash-dynamic/1")

    rows = run(args, checkpoint=lambda rows: write(rows, False))  # (a run cut by a time limit keeps what it measured)
    write(rows, True)
    rows = merge_rows(out / "dynamic.json", []) if args.merge else rows
    print(f"wrote {out / 'dynamic.csv'}, {out / 'dynamic.json'}, {plot(out)}")
    cols = ("head_dim", "k_blocks", "provider", "mode", "ms", "gpu_ms", "graph_ms", "compiled_ms", "goal_ms",
            "meets_goal", "speedup_vs_flex", "compiled_speedup_vs_flex", "max_diff", "status")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{_fmt(r.get(c)):>12}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
