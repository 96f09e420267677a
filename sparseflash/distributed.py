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
The plan's digest is all-gathered once; ranks that built different plans all raise.

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

import torch
import torch.distributed as dist

from sparseflash.mask import BlockMask

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
        self._check_same()

    # ------------------------------------------------------------------ identity
    def _digest(self, mask, seg) -> int:
        h = hashlib.sha256()
        h.update(repr((self.seq_len, self.block_size, self.world_size, self.causal, self.placement,
                       self.owned)).encode())
        h.update(self._on.numpy().tobytes())
        h.update(self._full.numpy().tobytes())
        if seg is not None:
            h.update(seg.cpu().long().numpy().tobytes())
        return int.from_bytes(h.digest()[:7], "little")

    def _check_same(self):
        mine = torch.tensor([self.digest], dtype=torch.int64, device=self.comm_device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        got = [int(t.item()) for t in every]
        if len(set(got)) != 1:
            raise ValueError(f"plan: the ranks built different plans (digests {got}): every rank must pass the same "
                             f"seq_len, group, mask, causal, segment_ids and block_size")

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
        self._check_local(o_l, "o_l")
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


def plan(seq_len: int, group=None, mask: BlockMask | None = None, causal: bool = False, segment_ids=None,
         block_size: int = 128) -> Plan:
    """Build (collectively: every rank of ``group`` calls it with the same arguments) the `Plan` of one
    sequence of ``seq_len`` tokens. ``group`` None: the default group. ``segment_ids``: integer ``[N]`` or
    ``[B, N]`` packed-document ids (pairs attend only within equal ids). See the module docstring."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if group is None:
        _group_info(None)
        group = dist.group.WORLD
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
    _group_info(group)
    return Plan(seq_len, group, mask, causal, segment_ids, block_size)


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

    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a sparseflash.distributed.Plan (from sfd.plan), got {type(plan).__name__}")
    for name, x in (("q_l", q_l), ("k_l", k_l), ("v_l", v_l)):
        plan._check_local(x, name)
    if not (q_l.device == k_l.device == v_l.device):
        raise ValueError(f"q_l, k_l, v_l must be on one device, got {q_l.device}, {k_l.device}, {v_l.device}")
    if k_l.shape[:3] != v_l.shape[:3] or q_l.shape[0] != k_l.shape[0] or q_l.shape[1] % k_l.shape[1]:
        raise ValueError(f"k_l and v_l must share [batch, heads_kv, local_len] with heads_q a multiple of heads_kv "
                         f"and the same batch as q_l: got q_l {tuple(q_l.shape)}, k_l {tuple(k_l.shape)}, "
                         f"v_l {tuple(v_l.shape)}")
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
