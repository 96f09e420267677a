"""Block-sparse context parallelism: one sequence's attention across the ranks of a process group.

Usage (every rank runs the same lines; ``q, k, v`` are the full ``[B, H, N, D]`` tensors)::

    import sparseflash.distributed as sfd
    plan = sfd.plan(N, group, mask=mask, causal=True, segment_ids=None, block_size=128)
    q_l, k_l, v_l = plan.shard(q), plan.shard(k), plan.shard(v)
    o_l = sfd.attention(q_l, k_l, v_l, plan)   # autograd; dropout_p=, scale= as sparseflash.attention
    o = plan.unshard(o_l)                       # the full [B, H, N, D] on every rank

Algorithm
---------
*The plan* (`plan`, a pure function of the layout, the same on every rank). The sequence is cut into
token blocks of ``block_size`` and padded to ``world * blocks_per_rank`` blocks; every rank holds the
same number of blocks. The global predicate of pair (i, j) is ``mask`` (its ``mask_mod`` inside partial
blocks, or its layout) AND ``j <= i`` if ``causal`` AND ``seg[i] == seg[j]`` with ``segment_ids`` AND
``j < N``; its block-level form (which block pairs have any pair on, which have all on) is counted per
query block. Three placements are scored by the most work one rank gets (on block pairs) and by the
traffic (key blocks some other rank needs): contiguous runs (documents and windows stay together),
zig-zag (rank r takes chunks r and 2W-1-r of 2W: balanced causal) and a longest-processing-time greedy
with equal block counts. The least traffic among the placements within 10% of the best balance wins.

*The checks* (`_agree`). Before any exchange (in `plan`, `attention` and `Plan.unshard`) every rank runs its
own checks and then one small all-gather compares what every rank must share: in `plan` the lengths, block
size, ``causal`` and the digests of the mask (its layout, full blocks and the bits its ``mask_mod`` gives in
every partial block) and of the segment ids; in `attention` the plan's digest, every shard's shape and
dtype, ``dropout_p``, ``scale`` and whether a backward will follow. A rank whose own checks fail still
takes part, so every rank raises the same error (that rank's message) instead of waiting in an exchange
until the backend's timeout; values that differ between ranks raise on every rank, naming them. The
gather runs on the group itself when it takes CPU tensors (gloo), else on a gloo group over the same
ranks made once (no device synchronisation).

For each pair (my query blocks, rank s) the plan keeps the key blocks of s that some on block needs
(only those are sent: a window sends its halo, rank-aligned documents nothing) and a `BlockMask` in
local coordinates whose ``mask_mod`` maps local to global positions and evaluates the global predicate,
so causality, windows and documents stay token-exact although a rank's blocks are not contiguous.
Sources with no needed block are neither sent nor computed.

*The exchange*: one ``batch_isend_irecv`` is posted first (`_start_exchange`), sending each rank the K/V
blocks it needs (K and V packed in one buffer per peer); then the own blocks' attention is computed, so
on CUDA those kernels run while NCCL (on its own stream) moves the remote blocks; then `_Exchange` (an
autograd Function) waits for the requests and hands over the received blocks, and the remote blocks'
attention runs. Its backward sends their gradients back to the owners, which add them into dK/dV (the
backward exchange is not overlapped). *The compute*: `sparseflash.attention(..., return_lse=True)` per
source with the pair's sub-mask; the partial outputs are merged by log-sum-exp in
float32 (a row with no key anywhere: output 0, LSE -inf, zero gradients). Gradients come from autograd
through attention's (out, lse) and the exchange.

Limits
------
- The mask is one `BlockMask` over ``N x N`` with block ``(block_size, block_size)``; a layout that
  varies with the batch / head is kept (the balance counts all of it).
- Segment blocks are judged by each block's (min, max) id: exact for packed documents (ids that never
  decrease); other orders may send (never compute wrongly) blocks that turn out empty.
- ``unshard``'s gradient is this rank's slice of the output gradient: every rank is taken to compute the
  same loss from the gathered output. A loss on the shard uses ``o_l`` directly.
- With dropout each partial result draws its own random bits: the same distribution as one process,
  not the same bits.
- The communication is one batched exchange, not a ring: peak memory holds every needed remote block.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch
import torch.distributed as dist

from sparseflash.mask import BlockMask
from sparseflash.mask_mods import FN_CHUNK_ELEMS, eval_partial

__all__ = ["Plan", "plan", "attention"]

# a placement whose busiest rank has at most this much more work than the best one may win on traffic
_BALANCE_SLACK = 1.1


# ------------------------------------------------------------------ checks
def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "on every rank before sparseflash.distributed.plan")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group given")
    return rank, dist.get_world_size(group)


def _comm_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# a gloo group over the same ranks per NCCL group: the checks talk there (CPU tensors, no device sync)
_CONTROL: dict = {}


def _control_group(group):
    """The group the ranks' checks are gathered on: ``group`` itself when its backend takes CPU tensors
    (gloo), else a gloo group over the same ranks, made once (collectively: every member calls this)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    if group not in _CONTROL:
        _CONTROL[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                         use_local_synchronization=True)
    return _CONTROL[group]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _float_code(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_SHOW = {
    "dtype": lambda c: str(_DTYPES[c]).replace("torch.", "") if c < len(_DTYPES) else "another dtype",
    "float": lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]),
    "digest": lambda c: f"{c:014x}",
    "int": str,
    "bool": lambda c: str(bool(c)),
}


_MAX_FIELDS = 32


def _agree(ctl, what: str, fields: list | None, error: BaseException | None):
    """Every rank's ``fields`` (``(name, kind, int)`` triples, the same names everywhere) and whether it
    passed its own checks, gathered in one collective on the control group; then every rank raises the
    same error if some rank failed (its message; ``error`` is this rank's own failure, or None) or the
    ranks' fields differ. So a rank's bad input stops every rank at once instead of leaving the others
    blocked in an exchange until the backend's timeout."""
    world = dist.get_world_size(ctl)
    row = torch.zeros(_MAX_FIELDS + 2, dtype=torch.int64)  # one size on every rank, whatever failed where
    if error is None:
        row[0], row[1] = 1, len(fields)
        row[2:2 + len(fields)] = torch.tensor([v for _, _, v in fields], dtype=torch.int64)
    every = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(every, row, group=ctl)
    rows = torch.stack(every).tolist()
    if not all(r[0] for r in rows):
        mine = None if error is None else (type(error).__name__, str(error))
        msgs = [None] * world
        dist.all_gather_object(msgs, mine, group=ctl)
        failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
        by_text: dict = {}
        for r, (kind, text) in failed:
            by_text.setdefault((kind, text), []).append(r)
        parts = [f"{text} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                 for (_, text), rs in by_text.items()]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(failed[0][1][0], RuntimeError)
        raise cls(f"{what}: " + "; ".join(parts)) from error
    if len({r[1] for r in rows}) != 1 or any(r[2:] != rows[0][2:] for r in rows):
        diff = [(i, name, kind) for i, (name, kind, _) in enumerate(fields) if len({r[2 + i] for r in rows}) > 1]
        show = "; ".join(f"{name}: " + ", ".join(f"rank {r} {_SHOW[kind](rows[r][2 + i])}" for r in range(world))
                         for i, name, kind in diff)
        raise ValueError(f"{what}: the ranks disagree ({show}): every rank must make the same call")


def _tensor_digest(t) -> int:
    """7 bytes of the sha256 of a tensor's shape, dtype and values (0 for None)."""
    if t is None:
        return 0
    h = hashlib.sha256(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


# partial blocks whose mask_mod bits one step of `_mask_digest` evaluates
_DIGEST_BLOCKS = 1024


def _mask_digest(mask) -> int:
    """Digest of what a mask attends (0 for None): its layout and full blocks, and with a ``mask_mod`` the
    bits it gives inside every partial block (evaluated on the mask's device a chunk of blocks at a
    time, as `BlockMask.exact_bits` does, but not kept): two masks attend the same pairs iff their
    digests agree (up to a hash collision), whatever functions define them."""
    if mask is None:
        return 0
    h = hashlib.sha256(repr((mask.seq_q, mask.seq_k, mask.block_size)).encode())
    h.update(_tensor_digest(mask.layout).to_bytes(7, "little"))
    if mask.mask_mod is not None:
        h.update(_tensor_digest(mask.full).to_bytes(7, "little"))
        nz = mask.partial.nonzero()
        for i in range(0, nz.shape[0], _DIGEST_BLOCKS):
            bits = eval_partial(mask.mask_mod, nz[i:i + _DIGEST_BLOCKS], mask.seq_q, mask.seq_k, mask.block_size,
                                FN_CHUNK_ELEMS["cuda" if mask.device.type == "cuda" else "cpu"])
            h.update(bits.cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def _tensor_fields(name, t) -> list:
    dims = ("batch", "heads", "tokens", "head_dim")
    return [(f"{name} {d}", "int", int(n)) for d, n in zip(dims, t.shape)] + [(f"{name} dtype", "dtype",
                                                                                _dtype_code(t.dtype))]


def _check_call(plan, what: str, local):
    """The collective check before an exchange: ``local()`` runs this rank's own checks and returns
    ``(tensors, fields)`` (named tensors whose shapes and dtypes, and named values, every rank must
    share); then `_agree` on the plan's control group, with the plan's digest."""
    if not isinstance(plan, Plan):
        # the other ranks wait in the check on their plan's control group: join the default group's
        # if there is one (the usual case), else this rank can only raise alone
        ctl = _CONTROL.get(dist.group.WORLD, dist.group.WORLD if dist.is_initialized() and "gloo" in str(
            dist.get_backend()).lower() else None)
        error = TypeError(f"plan must be a sparseflash.distributed.Plan (from sfd.plan), got {type(plan).__name__}")
        if ctl is None:
            raise error
        _agree(ctl, what, None, error)
    fields, error = None, None
    try:
        tensors, extra = local()
        fields = [("plan", "digest", plan.digest)] + [f for n, t in tensors for f in _tensor_fields(n, t)] + extra
    except (TypeError, ValueError) as e:
        error = e
    _agree(plan.control, what, fields, error)


# ------------------------------------------------------------------ the global predicate
class _GlobalMod:
    """mask_mod of one (query shard, key blocks) pair: local indices -> global positions -> the predicate."""

    def __init__(self, qpos, kpos, n, user_mod, causal, seg):
        self.qpos, self.kpos, self.n, self.user_mod, self.causal, self.seg = qpos, kpos, n, user_mod, causal, seg

    def __call__(self, b, h, q_idx, kv_idx):
        gq, gk = self.qpos[q_idx], self.kpos[kv_idx]
        on = gk < self.n
        gq, gk = gq.clamp(max=self.n - 1), gk.clamp(max=self.n - 1)
        if self.causal:
            on = on & (gk <= gq)
        if self.seg is not None:
            sb = b if self.seg.shape[0] > 1 else 0
            on = on & (self.seg[sb, gq] == self.seg[sb, gk])
        if self.user_mod is not None:
            on = on & self.user_mod(b, h, gq, gk)
        return on

    def to(self, device):
        mod = self.user_mod.to(device) if hasattr(self.user_mod, "to") else self.user_mod
        seg = None if self.seg is None else self.seg.to(device)
        return _GlobalMod(self.qpos.to(device), self.kpos.to(device), self.n, mod, self.causal, seg)


def _block_layout(n, bs, nb_pad, mask, causal, seg):
    """(on, full) bool ``[B', H', nb_pad, nb_pad]`` of the global predicate, and the user mask_mod."""
    nb = math.ceil(n / bs)
    on = torch.zeros(1, 1, nb_pad, nb_pad, dtype=torch.bool)
    on[..., :nb, :nb] = True
    full = on.clone()
    if n % bs:
        full[..., nb - 1] = False  # the tail key block holds padding
    user_mod = None
    if mask is not None:
        lay = mask.layout.cpu()
        mfull = mask.full.cpu() if mask.mask_mod is not None else lay
        pad = (0, nb_pad - nb, 0, nb_pad - nb)
        on = on & torch.nn.functional.pad(lay, pad)
        full = full & torch.nn.functional.pad(mfull, pad)
        user_mod = mask.mask_mod
        if user_mod is None:
            layout_dev = mask.layout

            def user_mod(b, h, q_idx, kv_idx, _lay=layout_dev, _bs=bs):
                lb = b if _lay.shape[0] > 1 else 0
                lh = h if _lay.shape[1] > 1 else 0
                return _lay.to(q_idx.device)[lb, lh, q_idx // _bs, kv_idx // _bs]
    if causal:
        i = torch.arange(nb_pad)
        on = on & (i[:, None] >= i[None, :])
        full = full & (i[:, None] > i[None, :])
    if seg is not None:
        s = seg.cpu().long()
        padded = torch.nn.functional.pad(s, (0, nb_pad * bs - n), value=0)
        lo = padded.view(s.shape[0], nb_pad, bs)
        big = torch.iinfo(torch.int64).max
        real = (torch.arange(nb_pad * bs) < n).view(nb_pad, bs)
        lo_min = torch.where(real, lo, big).amin(-1)
        lo_max = torch.where(real, lo, -big).amax(-1)
        meet = (lo_min[:, :, None] <= lo_max[:, None, :]) & (lo_min[:, None, :] <= lo_max[:, :, None])
        single = lo_min == lo_max
        same = single[:, :, None] & single[:, None, :] & (lo_min[:, :, None] == lo_min[:, None, :])
        on = on & meet[:, None]
        full = full & same[:, None]
    return on, full & on, user_mod


def _placements(work, w, per):
    """Candidate block -> rank assignments (lists of sorted block lists), work ``[nb_pad]``."""
    nbp = w * per
    out = {"contiguous": [list(range(r * per, (r + 1) * per)) for r in range(w)]}
    if per % 2 == 0:
        half = per // 2
        out["zigzag"] = [list(range(r * half, (r + 1) * half)) + list(range((2 * w - 1 - r) * half, (2 * w - r) * half))
                         for r in range(w)]
    order = sorted(range(nbp), key=lambda i: (-float(work[i]), i))
    load, owned = [0.0] * w, [[] for _ in range(w)]
    for i in order:
        r = min((r for r in range(w) if len(owned[r]) < per), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += float(work[i])
    out["greedy"] = [sorted(o) for o in owned]
    return out


class Plan:
    """Where every token block lives and which key blocks each rank needs from whom (see module doc).

    Attributes: ``seq_len``, ``block_size``, ``world_size``, ``rank``, ``group``, ``owned`` (a list per
    rank of its global block indices, ascending), ``local_len`` (tokens per rank, padding included),
    ``placement`` (its name), ``work`` (on block pairs per rank), ``needed`` (``needed[r][s]``: global
    key blocks rank r receives from s), ``bytes_sent`` (bytes this rank has sent through exchanges,
    forward and backward; reset it freely).
    """

    def __init__(self, seq_len, group, mask, causal, segment_ids, block_size):
        rank, world = _group_info(group)
        self.group, self.rank, self.world_size = group, rank, world
        self.seq_len, self.block_size, self.causal = seq_len, block_size, causal
        self.comm_device = _comm_device(group)
        nb = math.ceil(seq_len / block_size)
        self.blocks_per_rank = per = math.ceil(nb / world)
        self.padded_len = world * per * block_size
        self.local_len = per * block_size
        on, full, user_mod = _block_layout(seq_len, block_size, world * per, mask, causal, segment_ids)
        self._on, self._full = on, full
        row_work = on.sum(dim=(0, 1, 3))  # [nb_pad]
        cands = _placements(row_work, world, per)
        scored = {}
        col_any = on.any(dim=1).any(dim=0)  # [nb_pad, nb_pad]
        for name, owned in cands.items():
            loads = [int(row_work[o].sum()) for o in owned]
            traffic = 0
            for r, o in enumerate(owned):
                need = col_any[o].any(dim=0)
                mine = torch.zeros_like(need)
                mine[o] = True
                traffic += int((need & ~mine).sum())
            scored[name] = (max(loads), traffic, loads)
        best = min(v[0] for v in scored.values())
        ok = [n for n in cands if scored[n][0] <= best * _BALANCE_SLACK + 1e-9]
        self.placement = min(ok, key=lambda n: (scored[n][1], scored[n][0]))
        self.owned = cands[self.placement]
        self.work = scored[self.placement][2]
        self.traffic_blocks = scored[self.placement][1]
        owner = torch.empty(world * per, dtype=torch.long)
        local_slot = torch.empty(world * per, dtype=torch.long)
        for r, o in enumerate(self.owned):
            owner[o] = r
            local_slot[o] = torch.arange(per)
        self._owner, self._local_slot = owner, local_slot
        self.needed = [[[] for _ in range(world)] for _ in range(world)]
        for r, o in enumerate(self.owned):
            need = col_any[o].any(dim=0)
            for s in range(world):
                self.needed[r][s] = [j for j in self.owned[s] if bool(need[j])]
        self._user_mod, self._seg = user_mod, None if segment_ids is None else segment_ids
        self._masks: dict = {}
        self.bytes_sent = 0
        self.digest = self._digest(mask, segment_ids)
        self.control = None  # the group the ranks' checks talk on (`plan` sets it)

    # ------------------------------------------------------------------ identity
    def _digest(self, mask, seg) -> int:
        """What every rank must agree on: the arguments' digests and the placement."""
        self._mask_digest, self._seg_digest = _mask_digest(mask), _tensor_digest(seg)
        h = hashlib.sha256(repr((self.seq_len, self.block_size, self.world_size, self.causal, self.placement,
                                 self.owned, self._mask_digest, self._seg_digest)).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def _fields(self) -> list:
        return [("seq_len", "int", self.seq_len), ("block_size", "int", self.block_size),
                ("causal", "bool", int(self.causal)), ("mask", "digest", self._mask_digest),
                ("segment_ids", "digest", self._seg_digest), ("plan", "digest", self.digest)]

    # ------------------------------------------------------------------ per-pair masks
    def _positions(self, blocks, device):
        bs = self.block_size
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        return (b[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)

    def sub_mask(self, s: int, device) -> BlockMask:
        """The `BlockMask` of this rank's queries against the key blocks it needs from rank ``s``."""
        key = (s, torch.device(device))
        if key not in self._masks:
            mine, theirs = self.owned[self.rank], self.needed[self.rank][s]
            on = self._on[:, :, mine][..., theirs]
            full = self._full[:, :, mine][..., theirs]
            seg = None if self._seg is None else self._seg.to(device).long()
            seg = None if seg is None else (seg.unsqueeze(0) if seg.dim() == 1 else seg)
            mod = _GlobalMod(self._positions(mine, device), self._positions(theirs, device), self.seq_len,
                             self._user_mod, self.causal, seg)
            bs = self.block_size
            self._masks[key] = BlockMask(on.to(device), bs, len(mine) * bs, len(theirs) * bs,
                                         full=full.to(device), mask_mod=mod)
        return self._masks[key]

    def expected_bytes(self, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> int:
        """Bytes this rank sends in one forward exchange for local shards ``k``, ``v`` (the blocks peers
        need from it); ``backward=True`` adds the backward's (the gradients of the blocks it received)."""
        per_block = (k[:, :, :self.block_size].numel() * k.element_size()
                     + v[:, :, :self.block_size].numel() * v.element_size())
        me, w = self.rank, self.world_size
        blocks = sum(len(self.needed[r][me]) for r in range(w) if r != me)
        if backward:
            blocks += sum(len(self.needed[me][s]) for s in range(w) if s != me)
        return blocks * per_block

    # ------------------------------------------------------------------ shard / unshard
    def _check_full(self, x, name):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a [batch, heads, seq_len, head_dim] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, H, local_len, D]`` part of the full ``x [B, H, seq_len, D]`` (zero padded)."""
        self._check_full(x, "x")
        if x.shape[2] != self.seq_len:
            raise ValueError(f"x: the plan was built for seq_len={self.seq_len}, got x.shape[2]={x.shape[2]}")
        pos = self._positions(self.owned[self.rank], x.device)
        xp = torch.nn.functional.pad(x, (0, 0, 0, self.padded_len - self.seq_len))
        return xp.index_select(2, pos)

    def unshard(self, o_l: torch.Tensor) -> torch.Tensor:
        """The full ``[B, H, seq_len, D]`` from every rank's ``o_l``; gradient: this rank's slice."""
        def local():
            self._check_local(o_l, "o_l")
            return [("o_l", o_l)], []

        _check_call(self, "Plan.unshard", local)
        return _Unshard.apply(o_l, self)

    def _check_local(self, x, name):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a [batch, heads, local_len, head_dim] tensor (plan.shard's output), "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[2] != self.local_len:
            raise ValueError(f"{name}: this plan's shards hold local_len={self.local_len} tokens, got "
                             f"{name}.shape[2]={x.shape[2]} (a plan built for another length or group?)")
        if x.device.type != self.comm_device.type:
            raise ValueError(f"{name} is on {x.device}, but the group's backend communicates on "
                             f"{self.comm_device.type} tensors")


def _check_plan_args(seq_len, mask, causal, segment_ids, block_size):
    """The arguments of `plan` checked on this rank; returns ``segment_ids`` as ``[B, N]`` (or None)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if mask is not None:
        if not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a sparseflash.BlockMask or None, got {type(mask).__name__}")
        if (mask.seq_q, mask.seq_k) != (seq_len, seq_len):
            raise ValueError(f"mask was built for ({mask.seq_q}, {mask.seq_k}) tokens, expected ({seq_len}, {seq_len})")
        if mask.block_size != (block_size, block_size):
            raise ValueError(f"mask has block size {mask.block_size}; the plan's block_size={block_size} must match: "
                             f"build the mask with block_size={block_size}")
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype.is_floating_point \
                or segment_ids.dtype == torch.bool:
            raise TypeError(f"segment_ids must be an integer tensor [seq_len] or [batch, seq_len], got "
                            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}")
        if segment_ids.dim() == 1:
            segment_ids = segment_ids.unsqueeze(0)
        if segment_ids.dim() != 2 or segment_ids.shape[1] != seq_len:
            raise ValueError(f"segment_ids must have shape [seq_len] or [batch, seq_len] with seq_len={seq_len}, "
                             f"got {tuple(segment_ids.shape)}")
    return segment_ids


def plan(seq_len: int, group=None, mask: BlockMask | None = None, causal: bool = False, segment_ids=None,
         block_size: int = 128) -> Plan:
    """Build (collectively: every rank of ``group`` calls it with the same arguments) the `Plan` of one
    sequence of ``seq_len`` tokens. ``group`` None: the default group. ``segment_ids``: integer ``[N]`` or
    ``[B, N]`` packed-document ids (pairs attend only within equal ids). See the module docstring.

    Every rank's arguments (lengths, block size, causal, the digests of the mask, its ``mask_mod``
    included, and of the ids) and the plan it built are compared in one collective: if any rank's
    arguments fail its own checks, or the ranks' differ, every rank raises the same error."""
    if group is None:
        _group_info(None)
        group = dist.group.WORLD
    _group_info(group)  # (no group to talk on: this one raises alone)
    ctl = _control_group(group)
    built, error = None, None
    try:
        segment_ids = _check_plan_args(seq_len, mask, causal, segment_ids, block_size)
        built = Plan(seq_len, group, mask, causal, segment_ids, block_size)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks before it is raised
        error = e
    _agree(ctl, "sparseflash.distributed.plan", None if built is None else built._fields(), error)
    built.control = ctl
    return built


# ------------------------------------------------------------------ communication
def _exchange(plan: Plan, sends: dict, recv_shapes: dict, like: torch.Tensor) -> dict:
    """Send ``sends[peer]`` to each peer and receive ``recv_shapes[peer]`` from each; returns the received."""
    ops, got = [], {}
    for peer, shape in recv_shapes.items():
        got[peer] = torch.empty(shape, dtype=like.dtype, device=like.device)
        ops.append(dist.P2POp(dist.irecv, got[peer], dist.get_global_rank(plan.group, peer)
                              if plan.group is not dist.group.WORLD else peer, plan.group))
    for peer, buf in sends.items():
        ops.append(dist.P2POp(dist.isend, buf, dist.get_global_rank(plan.group, peer)
                              if plan.group is not dist.group.WORLD else peer, plan.group))
        plan.bytes_sent += buf.numel() * buf.element_size()
    reqs = dist.batch_isend_irecv(ops) if ops else []
    return got, reqs


def _slots(plan: Plan, blocks, device):
    bs = plan.block_size
    s = plan._local_slot[blocks].to(device)
    return (s[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)


def _start_exchange(plan: Plan, k: torch.Tensor, v: torch.Tensor):
    """Post the sends of this rank's blocks that peers need and the receives of the blocks it needs."""
    me, w = plan.rank, plan.world_size
    kc, vc = k.detach().contiguous(), v.detach().contiguous()
    sends, recv = {}, {}
    for r in range(w):
        if r != me and plan.needed[r][me]:
            pos = _slots(plan, plan.needed[r][me], k.device)
            sends[r] = torch.cat([kc.index_select(2, pos).reshape(-1), vc.index_select(2, pos).reshape(-1)])
    per_token = kc[:, :, :1].numel() + vc[:, :, :1].numel()
    for s in range(w):
        if s != me and plan.needed[me][s]:
            recv[s] = per_token * len(plan.needed[me][s]) * plan.block_size
    got, reqs = _exchange(plan, sends, recv, kc)
    return {"sends": sends, "got": got, "reqs": reqs}


class _Exchange(torch.autograd.Function):
    """Finish `_start_exchange`: (k_l, v_l) -> the received K/V blocks of every peer, flat and packed
    (peers ascending; each peer's K then V). Backward: the gradients of those blocks go back to their
    owners, which add them into dK / dV at the blocks' places."""

    @staticmethod
    def forward(ctx, k, v, plan, handle):
        for q in handle["reqs"]:
            q.wait()
        ctx.plan, ctx.kshape, ctx.vshape = plan, k.shape, v.shape
        ctx.peers = sorted(handle["got"])
        got = [handle["got"][s] for s in ctx.peers]
        return torch.cat(got) if got else k.new_empty(0)

    @staticmethod
    def backward(ctx, g):
        plan, me, w = ctx.plan, ctx.plan.rank, ctx.plan.world_size
        B, Hk, n_l, Dk = ctx.kshape
        Hv, Dv = ctx.vshape[1], ctx.vshape[3]
        per_token = B * Hk * Dk + B * Hv * Dv
        off, sends = 0, {}
        for s in ctx.peers:
            size = per_token * len(plan.needed[me][s]) * plan.block_size
            sends[s] = g[off:off + size].contiguous()
            off += size
        recv = {r: per_token * len(plan.needed[r][me]) * plan.block_size
                for r in range(w) if r != me and plan.needed[r][me]}
        got, reqs = _exchange(plan, sends, recv, g)
        for q in reqs:
            q.wait()
        dk = g.new_zeros(ctx.kshape)
        dv = g.new_zeros(ctx.vshape)
        for r, buf in got.items():
            pos = _slots(plan, plan.needed[r][me], g.device)
            n = pos.numel()
            dk.index_add_(2, pos, buf[:B * Hk * n * Dk].view(B, Hk, n, Dk))
            dv.index_add_(2, pos, buf[B * Hk * n * Dk:].view(B, Hv, n, Dv))
        return dk, dv, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_l, plan):
        ctx.plan = plan
        oc = o_l.contiguous()
        every = [torch.empty_like(oc) for _ in range(plan.world_size)]
        dist.all_gather(every, oc, group=plan.group)
        full = oc.new_empty(oc.shape[0], oc.shape[1], plan.padded_len, oc.shape[3])
        for r, part in enumerate(every):
            full.index_copy_(2, plan._positions(plan.owned[r], oc.device), part)
        return full[:, :, :plan.seq_len].clone()

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        gp = torch.nn.functional.pad(g, (0, 0, 0, plan.padded_len - plan.seq_len))
        return gp.index_select(2, plan._positions(plan.owned[plan.rank], g.device)), None


# ------------------------------------------------------------------ attention
def _merge(outs, lses, dtype):
    """Log-sum-exp merge of partial results in float32; rows with no key anywhere -> 0 / -inf."""
    lse = torch.stack(lses)  # [S, B, H, N]
    m = lse.detach().amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wgt = torch.exp(lse - m)  # exp(-inf) = 0
    den = wgt.sum(0)
    some = den > 0
    den_safe = torch.where(some, den, torch.ones_like(den))
    o = sum(wt[..., None] * ot.float() for wt, ot in zip(wgt, outs)) / den_safe[..., None]
    out_lse = torch.where(some, m + torch.log(den_safe), torch.full_like(den, -math.inf))
    return o.to(dtype), out_lse


def attention(q_l: torch.Tensor, k_l: torch.Tensor, v_l: torch.Tensor, plan: Plan, *, dropout_p: float = 0.0,
              scale: float | None = None, return_lse: bool = False, backend: str = "auto"):
    """Context-parallel `sparseflash.attention` of this rank's shards (``plan.shard`` outputs, GQA allowed).

    Every rank of ``plan.group`` must call it (and its backward). Returns this rank's ``o_l [B, H,
    local_len, D]`` (and the float32 LSE ``[B, H, local_len]`` with ``return_lse``); padding rows hold
    unspecified finite values that ``plan.unshard`` drops.
    """
    from sparseflash.api import attention as _attention

    def local():
        if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
        for name, x in (("q_l", q_l), ("k_l", k_l), ("v_l", v_l)):
            plan._check_local(x, name)
            if x.dtype not in _DTYPES:
                raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                                f"got {x.dtype}")
        if not (q_l.dtype == k_l.dtype == v_l.dtype):
            raise TypeError(f"q_l, k_l and v_l must share one dtype, got {q_l.dtype}, {k_l.dtype}, {v_l.dtype}")
        if not (q_l.device == k_l.device == v_l.device):
            raise ValueError(f"q_l, k_l, v_l must be on one device, got {q_l.device}, {k_l.device}, {v_l.device}")
        if k_l.shape != v_l.shape or q_l.shape[0] != k_l.shape[0] or q_l.shape[3] != k_l.shape[3] \
                or q_l.shape[1] % k_l.shape[1]:
            raise ValueError(f"k_l and v_l must have one shape [batch, heads_kv, local_len, head_dim] with q_l's "
                             f"batch and head_dim and heads_q a multiple of heads_kv: got q_l {tuple(q_l.shape)}, "
                             f"k_l {tuple(k_l.shape)}, v_l {tuple(v_l.shape)}")
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_l, k_l, v_l))
        return [("q_l", q_l), ("k_l", k_l), ("v_l", v_l)], [
            ("dropout_p", "float", _float_code(dropout_p)),
            ("scale", "float", _float_code(math.nan if scale is None else scale)),
            ("gradient (a backward will follow)", "bool", int(grad))]

    _check_call(plan, "sparseflash.distributed.attention", local)
    me = plan.rank
    handle = _start_exchange(plan, k_l, v_l)

    def part(s, ks, vs):
        return _attention(q_l, ks, vs, plan.sub_mask(s, q_l.device), scale=scale, dropout_p=dropout_p,
                          return_lse=True, exact=True, backend=backend)

    outs, lses = [], []
    if plan.needed[me][me]:  # own blocks while the exchange runs (NCCL: on its own stream)
        pos = _slots(plan, plan.needed[me][me], q_l.device)
        o, lse = part(me, k_l.index_select(2, pos), v_l.index_select(2, pos))
        outs.append(o)
        lses.append(lse)
    buf = _Exchange.apply(k_l, v_l, plan, handle)
    B, Hk, _, Dk = k_l.shape
    Dv = v_l.shape[3]
    off = 0
    for s in range(plan.world_size):
        if s == me or not plan.needed[me][s]:
            continue
        n = len(plan.needed[me][s]) * plan.block_size
        ks = buf[off:off + B * Hk * n * Dk].view(B, Hk, n, Dk)
        off += ks.numel()
        vs = buf[off:off + B * Hk * n * Dv].view(B, Hk, n, Dv)
        off += vs.numel()
        o, lse = part(s, ks, vs)
        outs.append(o)
        lses.append(lse)
    # empty sums tie this rank's output to the exchange, so its backward (entered by every rank) runs
    # even when no query here attends anything, and q_l gets a (zero) gradient then too
    tie = (buf[:0].sum() + q_l[:, :, :0].sum()).to(q_l.dtype)
    if not outs:
        o = torch.zeros_like(q_l) + tie
        lse = torch.full(q_l.shape[:3], -math.inf, device=q_l.device)
        return (o, lse) if return_lse else o
    if len(outs) == 1:  # one source: its result is the answer (empty rows already 0 / -inf)
        o, lse = outs[0] + tie, lses[0]
    else:
        o, lse = _merge(outs, lses, q_l.dtype)
        o = o + tie
    return (o, lse) if return_lse else o
