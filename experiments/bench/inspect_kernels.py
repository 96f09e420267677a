"""Compile the attention kernels for Hopper (sm_90a) on a machine without a GPU, and report what
the compiler made of them: registers, spills, shared memory, layout conversions, instruction mix.

    python -m sparseflash.experiments.bench.inspect_kernels [--head-dim 128] [--dropout 0.1]
        [--mask-block 128] [--segments] [--kernels fwd dkdv dq] [--dump DIR]

It drives the real launchers (so tiles, constexprs and specialisations are exactly what a GPU run
would compile) with a stand-in Triton driver that targets sm_90 and a compile hook that stops
before the launch. Needs triton's bundled ptxas/cuobjdump (present in the Linux wheels). Useful
to check a kernel change costs no extra layout conversion or spill before spending GPU time on
it; `--dump DIR` writes each kernel's TTGIR, PTX and SASS for reading.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile

import torch

from sparseflash.cmdline import ArgumentParser, non_negative_int, positive_int, run_command

TARGET_ARCH = 90


class _HopperStandIn:
    """Just enough of a Triton driver to compile (never launch) for sm_90 without a GPU."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", TARGET_ARCH, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):  # only used for launchers, which we never build
        raise NotImplementedError


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


def _resources(cubin: bytes) -> dict:
    """Registers and local memory (spills) of the compiled kernel, from its cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    val = lambda key: int(m.group(1)) if (m := re.search(key + r":(\d+)", text)) else None  # noqa: E731
    return dict(regs=val("REG"), stack=val("STACK"), local=val("LOCAL"))


def _sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout


def _opcodes(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def _loops(sass: str) -> list[int]:
    """Instruction counts of the loops (a backward branch and what it jumps over), in code order."""
    addr, out = [], []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if not m:
            continue
        pc = int(m.group(1), 16)
        addr.append(pc)
        b = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", m.group(2))
        if b and int(b.group(1), 16) < pc:
            target = int(b.group(1), 16)
            out.append(sum(1 for a in addr if target <= a <= pc))
    return out


def compile_launches(run, every: bool = False) -> dict:
    """Call ``run()`` with Triton's driver replaced by the sm_90 stand-in and every kernel launch it
    makes compiled for sm_90 instead of launched (Triton and Gluon kernels alike, with the launch's
    register cap): {kernel name: CompiledKernel}, a kernel launched more than once by its last
    launch, or with ``every`` each launch's build, the later ones as "name.1", "name.2", ... in
    launch order (a plan that launches one kernel per query chunk). Kernels already in the
    in-memory cache do not reach the hook; each caller compiles fresh launches. The portable launchers choose tiles by
    the tensors' device: on CPU tensors they take the interpreter's 32 x 32 tile (which compiles
    to mma.sync, not wgmma). Give them the GPU's tiles with `tiles.tile_config`, as `main` does."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    compiled = {}

    def hook(*, fn, compile, **_):
        jf = fn.jit_function
        src_cls = ASTSource
        if type(jf).__name__ == "GluonJITFunction":
            from triton.experimental.gluon._runtime import GluonASTSource as src_cls
        src = src_cls(jf, compile["signature"], compile["constants"], compile["configs"][0])
        opts = dict(num_warps=compile["num_warps"], num_stages=compile["num_stages"], num_ctas=compile["num_ctas"])
        maxnreg = json.loads(compile["specialization_data"]).get("options", {}).get("maxnreg")
        if maxnreg:
            opts["maxnreg"] = maxnreg
        name = fn.name
        if every and name in compiled:
            name = f"{fn.name}.{sum(n.split('.')[0] == fn.name for n in compiled)}"
        compiled[name] = triton.compile(src, target=_HopperStandIn().target, options=opts)
        return True  # compiled here: skip the launch

    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, triton.runtime.driver._active
    triton.runtime.driver.set_active(_HopperStandIn())
    knobs.runtime.jit_cache_hook = hook
    try:
        run()
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        triton.runtime.driver._active = saved_driver
    return compiled


def gluon_report(ck) -> dict:
    """Shared memory, registers, spills, and the instruction families that show a warp-specialised
    Hopper design is in place (setmaxnreg values, wgmma, TMA loads and stores, mbarrier waits and
    arrives)."""
    ptx = ck.asm["ptx"]
    res = _resources(ck.asm["cubin"])
    return dict(shared=ck.metadata.shared, regs=res["regs"], stack=res["stack"], local=res["local"],
                setmaxnreg="/".join(sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)), key=int)),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global", ptx)),
                tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                mbarrier_arrives=len(re.findall(r"mbarrier\.arrive", ptx)))


def compile_kernels(kinds, head_dim, dropout, mask_block, causal=False, seq=1024, dtype=torch.bfloat16, tiles=None,
                    batch=1, heads=2, segments=False):
    """Compile the launchers' kernels for sm_90 and return {kernel name: CompiledKernel-like asm dict}.
    ``tiles``: {kind: TileConfig} in place of the launchers' defaults. ``seq``, ``batch``, ``heads``:
    the launch's shape (Triton specialises integer arguments that equal 1 or divide by 16, so these
    can change the kernel that compiles). ``segments``: the packed-documents variant (segment ids)."""
    import triton

    from sparseflash.flash import launch, tiles as policy
    from sparseflash.mask import BlockMask

    saved_interp = policy.interpreting
    policy.interpreting = lambda: False

    def run():
        B, H, N, D = batch, heads, seq, head_dim
        q, k, v, do = (torch.randn(B, H, N, D, dtype=dtype) for _ in range(4))
        scale = D ** -0.5
        cuda = torch.device("cuda")
        if mask_block:
            nb = triton.cdiv(N, mask_block)
            mask = BlockMask.from_layout(torch.ones(nb, nb, dtype=torch.bool), block_size=mask_block, seq_q=N, seq_k=N)
            idx = mask.index("cpu")
            lists = (idx.kv_idx, idx.q_idx)
        else:
            lists = (None, None)
        cfgs = {kind: policy.default_config(kind, D, cuda, triton.cdiv(N, mask_block) if mask_block else None, dropout > 0,
                                             segments=segments)
                for kind in ("fwd", "dkdv", "dq")}
        if dtype == torch.float32:
            cfgs = {kind: policy.fp32_config(c, kind, D) for kind, c in cfgs.items()}
        cfgs.update(tiles or {})
        mb = mask_block or None
        lse = torch.zeros(B, H, N)
        rng = torch.zeros(3, dtype=torch.int64)  # dropout's (seed_lo, seed_hi, offset)
        seg = None
        if segments:
            ids = torch.zeros(B, N, dtype=torch.int32)
            seg = (ids, ids[:, :])
        with policy.tile_config(**cfgs):
            if "fwd" in kinds:
                launch.fwd(q, k, v, lists[0], None, scale, causal, mb, mb, dropout, rng, segments=seg)
            bargs = (do, q, k, v, lse, lse, None, scale, causal, mb, mb, dropout, rng)
            if "dkdv" in kinds:
                launch.bwd_dkdv(*bargs, lists[1], segments=seg)
            if "dq" in kinds:
                launch.bwd_dq(*bargs, lists[0], o=q, segments=seg)

    try:
        compiled = compile_launches(run)
    finally:
        policy.interpreting = saved_interp
    return compiled


def report(compiled, dump: str | None = None) -> list[dict]:
    rows = []
    for name, ck in compiled.items():
        ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
        sass = _sass(ck.asm["cubin"])
        ops = _opcodes(sass)
        row = dict(kernel=name, shared=ck.metadata.shared, **_resources(ck.asm["cubin"]),
                   convert_layout=ttgir.count("ttg.convert_layout"), local_alloc=ttgir.count("ttg.local_alloc"),
                   sass_total=sum(ops.values()), loops="/".join(map(str, _loops(sass))), **{op: ops.get(op, 0) for op in ("HGMMA", "MUFU", "IMAD", "LOP3", "ISETP", "FSEL", "SHF", "BAR", "LDS", "STS")})
        rows.append(row)
        if dump:
            os.makedirs(dump, exist_ok=True)
            for ext, text in (("ttgir", ttgir), ("ptx", ptx), ("sass", sass)):
                with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                    f.write(text)
    return rows


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.inspect_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--mask-block", type=non_negative_int, default=128, help="0: dense kernels (mask=None)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--segments", action="store_true", help="the packed-documents variant (segment_ids)")
    ap.add_argument("--seq", type=positive_int, default=1024, help="sequence length of the launch (default 1024)")
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--heads", type=positive_int, default=2)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--kernels", nargs="+", default=["fwd", "dkdv", "dq"], choices=["fwd", "dkdv", "dq"])
    ap.add_argument("--tile", action="append", default=[], metavar="KIND=M,N,WARPS,STAGES[,MAXNREG[,Q_ROWS]]",
                    help="compile KIND (fwd, dkdv, dq) with this tile instead of the default; repeatable")
    ap.add_argument("--dump", default=None, help="write TTGIR, PTX and SASS of each kernel here")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: the kernels would run under the interpreter, not compile; unset it")
    tiles = {}
    for spec in args.tile:
        from sparseflash.experiments.bench.tune_tiles import parse_config
        from sparseflash.flash.tiles import TileConfig

        kind, _, nums = spec.partition("=")
        tiles[kind] = TileConfig(*parse_config(nums))
    compiled = compile_kernels(args.kernels, args.head_dim, args.dropout, args.mask_block, args.causal,
                               dtype=torch.float32 if args.fp32 else torch.bfloat16, tiles=tiles,
                               seq=args.seq, batch=args.batch, heads=args.heads, segments=args.segments)
    rows = report(compiled, args.dump)
    if args.json:
        print(json.dumps(rows))
        return 0
    cols = list(rows[0].keys())
    print(" ".join(f"{c:>14s}" if i == 0 else f"{c:>7s}" for i, c in enumerate(cols)))
    for r in rows:
        print(" ".join(f"{str(r[c]):>14s}" if i == 0 else f"{str(r[c]):>7s}" for i, c in enumerate(cols)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
