"""One training step of a StepPlan on a process group.

Token-wise work runs on each rank's tokens of the child layout (the parent layout when not
repacked). Full attention: entry exchange (child token layout -> parent head layout), varlen
attention over the parent's samples, exit exchange (parent head layout -> child token layout).
Sparse attention: the child's own node-local exchange pair, or local attention for a child of
one rank. Baseline is the same code with child layout == parent layout. Parameters are sharded
with FSDP2 (model.sharding) or replicated; either way each parameter's gradient is the sum of
every rank's, as in a single-process step over the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from config import ModelConfig, SettingError
from kernels.exchange import (
    CommStats,
    ExchangeGroups,
    HaloArgs,
    PhaseClock,
    dist_transport,
    exchange,
    exchange_args,
    halo_exchange,
    point_to_point,
)
from solver import Group, StepPlan, TokenLayout, Way, head_cu_seqlens, token_to_head_rank
from solver.cluster import InternalError
from solver.cost import sparse_cost, splits_over, ulysses_parts
from solver.layout import halo_transfers, state_hops, state_transfers, token_to_token_rank
from solver.sites import ENTRY_EXIT, Site

from .attention import KeySegments
from .experts import ExpertDispatch, inverse_permutation, permute_rows
from .hybrid import IGNORE, layer_attention
from .layers import Rotary
from .sharding import expert_params, is_sharded


class LayoutError(RuntimeError):
    """The plan cannot run on this process group (another world size, a model it was not planned
    for, a missing set-up step); the message says why."""


class LayoutInvariantError(InternalError):
    """The ranks' own work broke an invariant (their plans differ, though every rank computes the
    same plan from the same data): a bug, kept with its traceback."""


def validate(plan: StepPlan, cfg: ModelConfig, world_size: int, ep: int = 1) -> None:
    """Fail fast, before any exchange, with a message naming the problem (never a hang)."""
    if plan.cluster.world_size != world_size:
        raise LayoutError(f"the plan is for {plan.cluster.world_size} ranks but the process group has {world_size}")
    if ep > 1 and (world_size % ep or cfg.n_experts % ep):
        raise LayoutError(
            f"expert parallelism of degree {ep} needs the world ({world_size} ranks) and the experts ({cfg.n_experts}) "
            f"to be multiples of it"
        )
    sizes = sorted({g.size for g in plan.parent_layout.groups} | {g.size for g in plan.child_layout.groups if not g.halo})
    if any(g.halo for g in plan.child_layout.groups):  # halo children split no head, but need the sparse kind's reach
        try:
            sparse_cost(cfg.sparse_kind).check_local()
        except SettingError as e:
            raise LayoutError(str(e)) from None
    for p in sizes:
        if cfg.n_heads % p:
            raise LayoutError(
                f"n_heads={cfg.n_heads} is not divisible by group size {p} used by this plan (group sizes {sizes}): "
                f"query heads must split evenly over every group"
            )
        if cfg.n_kv_heads % p and p % cfg.n_kv_heads:
            raise LayoutError(
                f"n_kv_heads={cfg.n_kv_heads} neither divides nor is divided by group size {p} used by this plan (group "
                f"sizes {sizes}): key/value heads split evenly or are replicated over p / n_kv_heads ranks each"
            )
    # the S layers' own parts (an attention kind's are the attention's, checked above; a linear kind's its heads)
    child_sizes = sorted({g.size for g in plan.child_layout.groups if not g.halo and g.size > 1})
    bad = next((p for p in child_sizes if not splits_over(cfg, "S", p)), None)
    if bad is not None:
        heads = sparse_cost(cfg.sparse_kind).heads_text(cfg).removeprefix("; ")
        raise LayoutError(
            f"the {heads} do not split over a group of {bad} ranks used by this plan (sparse group sizes {child_sizes}): value "
            f"heads must be a multiple of every group size, and key heads a multiple or a divisor of it (then replicated)"
        )


def check_same_plan(plan: StepPlan, device="cpu") -> None:
    """Every rank must run the same plan: one all-reduce of the hash (and its negation, so MAX
    gives both the largest and the smallest) per step, instead of gathering Python objects.
    `device`: where the backend's collectives run (CUDA for NCCL)."""
    h = int(plan.hash[:15], 16)  # 60 bits: fits int64
    t = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != -int(t[1]):
        raise LayoutInvariantError(
            f"plan hash differs across ranks (this rank {plan.hash}; values range over {-int(t[1]):x}..{int(t[0]):x}): "
            f"plans must be computed identically on every rank"
        )


def redistributes_at(plan: StepPlan, rank: int) -> bool:
    """Does the parent holding `rank` redistribute (ParentPlan.redistributed)? A plan where none
    does answers without looking for the rank's parent."""
    return plan.redistributes and next(p for p in plan.parents if p.group.start <= rank < p.group.stop).redistributed


def rank_exchanges(plan: StepPlan, cfg: ModelConfig, rank: int, device="cpu", redistributed: bool = False):
    """(full entry, full exit, sparse entry, sparse exit) of `rank`, as device tensors (the sparse
    ones None in a halo child): only this
    rank's part of each exchange, so the host work of a step grows with the rank's groups, not
    with the cluster (experiments.host_bench times it). An exit is its entry's inverse. A
    redistributing parent's full layers (redistributed: redistributes_at(plan, rank)) run on its
    own token layout."""
    parent, child = plan.parent_layout, plan.child_layout
    (full_in, _), (full_out, _) = ulysses_parts(cfg, "F")
    full = token_to_head_rank(parent if redistributed else child, parent, rank)
    full_args = (exchange_args(full, full_in, device), exchange_args(full.inverse(), full_out, device))
    if child.group_of(rank).halo:  # its sparse layers exchange halos, not heads
        return (*full_args, None, None)
    (sparse_in, _), (sparse_out, _) = ulysses_parts(cfg, "S")  # a linear kind's S layers move their own parts
    sparse = token_to_head_rank(child, child, rank)
    return (*full_args, exchange_args(sparse, sparse_in, device), exchange_args(sparse.inverse(), sparse_out, device))


@dataclass(frozen=True)
class ChainArgs:
    """One rank's part of a chain-passing halo child's states (solver.layout.state_hops): how many
    states each earlier rank sends it (receives: (source, states) by source; the receive buffer
    holds them source after source, each source's by sample), and per later rank the states it
    sends (sends: (destination, ((map row, incoming row), ...)) by destination: the outgoing state
    of the chunk whose map is that row of the maps, from its incoming state at that row of the
    receive buffer, or from zero where the row is -1, a sample's first chunk)."""

    rank: int
    receives: tuple[tuple[int, int], ...]
    sends: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


class _StateChain(torch.autograd.Function):
    """The chain: a rank receives its chunks' incoming states from the chunks before them, then
    sends each next chunk its outgoing state A S + B (its map (A, B) over the state it received,
    or B at a sample's first chunk), so states travel one hop after another. The backward runs
    the hops in reverse: the gradient of each outgoing state comes back from the chunk after it,
    gives the map's gradients (A's: g S^T; B's: g) and adds A^T g to the incoming state's
    gradient, which goes back to the chunk before."""

    @staticmethod
    def forward(ctx, maps, args: ChainArgs, stats, site):
        h, k = maps.shape[1], maps.shape[2]
        v = maps.shape[3] - k
        # timed as an exchange: the hops' sends and receives ("compose", the maps' products, is
        # compute, as the simulator prices it: not an exchange part, like "record")
        clock = PhaseClock.of_site(stats, site, maps.device)
        inn = [(src, maps.new_empty((n, h, k, v))) for src, n in args.receives]
        point_to_point([], inn)
        clock.lap("all_to_all")
        s_in = torch.cat([t for _, t in inn]) if inn else maps.new_zeros((0, h, k, v))
        out = []
        for dst, rows in args.sends:
            states = [maps[m][..., k:] if r < 0 else maps[m][..., :k] @ s_in[r] + maps[m][..., k:] for m, r in rows]
            out.append((dst, torch.stack(states).contiguous()))
        clock.lap("compose")
        if stats is not None:
            stats.record_peers(site, args.rank, {dst: len(rows) for dst, rows in args.sends}, h * k * v * maps.element_size())
        clock.lap("record")
        point_to_point(out, [])
        clock.lap("all_to_all")
        ctx.save_for_backward(maps, s_in)
        ctx.args, ctx.stats, ctx.site = args, stats, site
        return s_in

    @staticmethod
    def backward(ctx, grad):
        maps, s_in = ctx.saved_tensors
        args, k, stats, site = ctx.args, maps.shape[2], ctx.stats, ctx.site + ".bwd"
        clock = PhaseClock.of_site(stats, site, grad.device)
        got = [(dst, grad.new_empty((len(rows), *grad.shape[1:]))) for dst, rows in args.sends]
        point_to_point([], got)
        clock.lap("all_to_all")
        total, grad_maps = grad.clone(), torch.zeros_like(maps)
        for (_, rows), (_, g) in zip(args.sends, got):
            for j, (m, r) in enumerate(rows):
                grad_maps[m][..., k:] += g[j]
                if r >= 0:
                    grad_maps[m][..., :k] += g[j] @ s_in[r].transpose(-1, -2)
                    total[r] += maps[m][..., :k].transpose(-1, -2) @ g[j]
        back, at = [], 0
        for src, n in args.receives:  # each incoming state's gradient to the chunk before
            back.append((src, total[at : at + n].contiguous()))
            at += n
        clock.lap("compose")
        if stats is not None:
            stats.record_peers(site, args.rank, dict(args.receives), math.prod(grad.shape[1:]) * grad.element_size())
        clock.lap("record")
        point_to_point(back, [])
        clock.lap("all_to_all")
        return grad_maps, None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the world; the gradient of a sum every rank uses is the sum of their gradients."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        dist.all_reduce(g)
        return g


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Differentiable all-reduce (sum) over the default group."""
    return _AllReduceSum.apply(x)


def halo_rank_args(layout: TokenLayout, group: Group, rank: int, first_key, params: dict, device="cpu"):
    """One rank's halo exchange in halo group `group` of `layout`, and the key segments of its
    sparse attention: (HaloArgs, key rows, their inverse, KeySegments). The keys of a local chunk
    are the halo rows its queries reach back to, then the chunk's own rows: `key rows` gathers
    them, segment after segment, from the received rows followed by the local ones (every row of
    both once: a permutation)."""
    transfers = halo_transfers(layout, group, first_key, params, rank)
    chunks = layout.local_chunks(rank)
    offset, at = {}, 0
    for sid, a, b in chunks:
        offset[sid] = (at, a)
        at += b - a
    n_in = at
    sends: dict[int, list[np.ndarray]] = {}
    for t in (t for t in transfers if t.src == rank):  # ordered by destination, then sample and position
        first, a = offset[t.sample]
        sends.setdefault(t.dst, []).append(np.arange(first + t.lo - a, first + t.hi - a))
    recv_rows: dict[int, list[int]] = {}  # sample -> its halo rows' places in the receive buffer, by position
    recvs: dict[int, int] = {}
    for t in (t for t in transfers if t.dst == rank):  # ordered by source, then sample and position
        base = sum(recvs.values())
        recvs[t.src] = recvs.get(t.src, 0) + t.hi - t.lo
        recv_rows.setdefault(t.sample, []).extend(range(base, base + t.hi - t.lo))
    n_recv = sum(recvs.values())
    keys, cu_k, q_start, k_start = [], [0], [], []
    for sid, a, b in chunks:
        if b == a:
            continue
        halo = recv_rows.get(sid, [])
        first, _ = offset[sid]
        keys.append(np.concatenate([np.asarray(halo, dtype=np.int64), n_recv + np.arange(first, first + b - a)]))
        cu_k.append(cu_k[-1] + len(keys[-1]))
        q_start.append(a)
        k_start.append(a - len(halo))
    rows = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    args = HaloArgs(
        rank,
        n_in,
        tuple((dst, torch.as_tensor(np.concatenate(r), device=device)) for dst, r in sorted(sends.items())),
        tuple(sorted(recvs.items())),
    )
    key_rows = torch.as_tensor(rows, device=device)
    inverse = inverse_permutation(key_rows)
    segs = KeySegments(
        torch.as_tensor(cu_k, dtype=torch.int32, device=device), int(np.diff(cu_k).max(initial=0)), np.asarray(q_start), np.asarray(k_start)
    )
    return args, key_rows, inverse, segs


class RankPlacement:
    """Attention for one rank of one step, with the step's exchanges, attention and rotary tables
    precomputed from the plan: nothing in the layers waits on the host."""

    def __init__(
        self,
        plan: StepPlan,
        cfg: ModelConfig,
        rank: int,
        groups: ExchangeGroups,
        pack_backend: str = "auto",
        backend: str = "auto",
        stats: CommStats | None = None,
        device="cpu",
        recompute_attention: bool = False,
        ep: int = 1,
    ):
        self.cfg, self.rank, self.pack_backend, self.backend, self.stats = cfg, rank, pack_backend, backend, stats
        self.recompute_attention = recompute_attention  # selective recompute: the kernels re-run in backward
        self.transport = dist_transport(groups)
        parent, child = plan.parent_layout, plan.child_layout
        self.parent_group = parent.group_of(rank)
        self.child_group = child.group_of(rank)
        redistributed = redistributes_at(plan, rank)
        self.full_entry, self.full_exit, self.sparse_entry, self.sparse_exit = rank_exchanges(plan, cfg, rank, device, redistributed)
        self.chunks = child.local_chunks(rank)  # (sample, start, end) of this rank's tokens, in local order
        self.positions, self.rotary = _rotary(self.chunks, cfg, device)
        self.halo = self.child_group.halo and self.child_group.size > 1
        keys = None
        if self.halo:  # sparse attention on the child's own token layout, with its neighbours' key/value halos
            first_key = sparse_cost(cfg.sparse_kind).check_local()
            self.halo_args, self.key_rows, self.key_inverse, keys = halo_rank_args(
                child, self.child_group, rank, first_key, cfg.sparse_params, device
            )
            sparse_cu = np.concatenate([[0], np.cumsum([b - a for _, a, b in self.chunks if b > a])]).astype(np.int32)
        else:
            sparse_cu = head_cu_seqlens(child, self.child_group)
        # a linear layer's samples (run_linear): in head layout, or a halo child's non-empty chunks
        self.sparse_cu = [int(c) for c in sparse_cu]
        if self.halo and sparse_cost(cfg.sparse_kind).state_elements(cfg.sparse_params):  # a kind that passes states: their plans too
            self._state_args(child, keys, device)
        self.attention_of = layer_attention(head_cu_seqlens(parent, self.parent_group), sparse_cu, cfg, device, keys)
        self._linear_columns: dict[int, torch.Tensor] = {}
        # a redistributing parent (ParentPlan.redistributed): each full layer runs on its own token
        # layout, the hidden states moved there and back by all-to-alls of their own (the pass the
        # paper avoids); a parent that is not repacked makes none
        self.redistribution = None
        self.full_rotary = self.rotary
        if redistributed:
            whole = token_to_token_rank(child, parent, self.parent_group, rank)
            self.redistribution = exchange_args(whole, [1], device)
            _, self.full_rotary = _rotary(parent.local_chunks(rank), cfg, device)
        self.reduce = all_reduce_sum
        self.total_tokens = plan.total_tokens
        self.dispatch = None
        if ep > 1:  # the rank's expert-parallel group: the aligned ep ranks around it
            start = rank - rank % ep
            self.dispatch = ExpertDispatch(start, ep, rank, cfg.n_experts, groups.get(start, ep), pack_backend, stats)

    def run_linear(self, mixer, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """A linear layer (model.linear.GatedDeltaNet) on this rank's tokens x [n, hidden] of the
        child layout. A child of one rank holds its samples whole and runs them alone; a wider
        Ulysses child projects its tokens, moves the projections to head layout (each rank: its
        value heads and the key heads they read, whole samples), runs the convolution and the
        recurrence there, and brings the outputs back, as attention does (the same exchange
        kernels, the sites Site.SPARSE_ENTRY and Site.SPARSE_EXIT); a halo child passes states
        (_state_passing)."""
        if self.child_group.size == 1:  # its samples whole, in head order: sparse_cu
            return mixer(x, self.sparse_cu, backend=self.backend)[0]
        if self.halo:
            return self._state_passing(mixer, x)
        mixed, z, a, b = mixer._project(x)
        cols = self._linear_columns.get(id(mixer))
        if cols is None:
            cols = self._linear_columns[id(mixer)] = mixer.ulysses_columns().to(x.device)
        sent = torch.cat([mixed, a, b], dim=1).index_select(1, cols)
        y = exchange(sent[:, :, None].contiguous(), self.sparse_entry, self.transport, self.pack_backend, self.stats, Site.SPARSE_ENTRY)
        o = mixer.forward_heads(y[:, :, 0], self.sparse_cu, self.child_group.size, self.rank - self.child_group.start, self.backend)
        o = exchange(o.contiguous(), self.sparse_exit, self.transport, self.pack_backend, self.stats, Site.SPARSE_EXIT)
        return mixer._output(o, z)

    def _state_passing(self, mixer, x: torch.Tensor) -> torch.Tensor:
        """A linear layer on a halo child's own token layout (each rank contiguous chunks of its
        samples, all heads): two point-to-point exchanges make each chunk exact. The pre-
        convolution rows its convolution reaches back to come from the ranks before (Site.SPARSE_HALO,
        the halo exchange attention uses, at the convolution's reach); each chunk whose sample goes
        on forms its map (A, B) from a zero state and sends it to every later rank holding the
        sample (Site.SPARSE_STATES), where a chunk composes the maps of its sample's earlier chunks,
        in rank order, into its incoming state; or, where the child passes states by the chain
        (Way.CHAIN), sends the next chunk only its outgoing state once it has its own
        (_StateChain). Backward, each halo's, map's and state's gradient goes back to its owner."""
        mixed, z, a, b = mixer._project(x)
        n, ch, reach = mixed.shape[0], mixed.shape[1], mixer.kernel - 1
        rows = mixed.view(n, 1, ch)
        before = halo_exchange(rows.contiguous(), self.halo_args, self.pack_backend, self.stats, Site.SPARSE_HALO)
        seg = permute_rows(torch.cat([before, rows]), self.key_rows, self.key_inverse, self.pack_backend)[:, 0]
        halos = []
        for lo, h in zip(self.linear_key_cu, self.linear_halo_rows):  # h <= reach: fewer at a sample's start
            halos.append(torch.cat([seg.new_zeros(reach - h, ch), seg[lo : lo + h]]))
        bounds = self.sparse_cu
        q, k, v, g, beta, _ = mixer._inputs(mixed, a, b, bounds, torch.stack(halos) if halos else None)
        hv, dk, sd = mixer.hv, mixer.dk, mixer.state_dtype(v.dtype)  # maps and states travel in the state dtype
        # each sending chunk's map from a zero state
        maps = [mixer.chunk_map(*(t[bounds[i] : bounds[i + 1]] for t in (q, k, v, g, beta)), self.backend) for i in self.map_chunks]
        # a rank that forms no map still joins the maps' backward (it sends the gradients of those it received)
        sent = torch.stack(maps) if maps else q.new_zeros(0, hv, dk, dk + mixer.dv, dtype=sd) + 0.0 * q.sum()
        if self.child_group.way is Way.CHAIN:  # each incoming state from the chunk before, one hop after another
            got = _StateChain.apply(sent, self.chain_args, self.stats, Site.SPARSE_STATES)
            zero = x.new_zeros(hv, dk, mixer.dv, dtype=sd)
            states = [zero if r < 0 else got[r] for r in self.state_of_chunk]
        else:  # every earlier map of the sample, composed here in rank order: S <- A S + B
            got = halo_exchange(
                sent.view(-1, hv * dk, dk + mixer.dv).contiguous(), self.state_args, self.pack_backend, self.stats, Site.SPARSE_STATES
            ).view(-1, hv, dk, dk + mixer.dv)
            states = []
            for rows_in in self.maps_of_chunk:
                s = x.new_zeros(hv, dk, mixer.dv, dtype=sd)
                for j in rows_in:
                    s = got[j][..., :dk] @ s + got[j][..., dk:]
                states.append(s)
        o = mixer._recurrence(q, k, v, g, beta, bounds, torch.stack(states) if states else None, self.backend)[0]
        return mixer._output(o, z) + 0.0 * got.sum()  # every rank joins the states' backward, received or not

    def _state_args(self, child: TokenLayout, keys: KeySegments, device) -> None:
        """A linear kind's halo child: each non-empty chunk's convolution halo rows in its key
        segment (`keys`, halo_rank_args'), the chunks that form maps, and how the states travel:
        by the chain (ChainArgs over solver.layout.state_hops; per chunk the row of its incoming
        state, or -1) or in one round (HaloArgs over state_transfers; per chunk the received maps
        it composes, in rank order)."""
        halo = (keys.q_start - keys.k_start).astype(np.int64)
        self.linear_halo_rows = halo.tolist()
        self.linear_key_cu = np.concatenate([[0], np.cumsum(halo + np.diff(self.sparse_cu))])[:-1].astype(np.int64).tolist()
        chain = self.child_group.chain
        transfers = (state_hops if chain else state_transfers)(child, self.child_group)
        index = {sid: i for i, (sid, _, _) in enumerate((sid, a, b) for sid, a, b in self.chunks if b > a)}
        mine = [t for t in transfers if t.src == self.rank]
        self.map_chunks = sorted({index[t.sample] for t in mine})
        row_of = {i: r for r, i in enumerate(self.map_chunks)}
        recvs: dict[int, int] = {}
        self.maps_of_chunk = [[] for _ in index]
        for at, t in enumerate(t for t in transfers if t.dst == self.rank):  # by source, then sample: the receive buffer's order
            recvs[t.src] = recvs.get(t.src, 0) + 1
            self.maps_of_chunk[index[t.sample]].append(at)
        if chain:  # a chunk receives at most one state (from the chunk before), at the row it arrives
            self.state_of_chunk = [rows[0] if rows else -1 for rows in self.maps_of_chunk]
            out: dict[int, list[tuple[int, int]]] = {}
            for t in mine:
                i = index[t.sample]
                out.setdefault(t.dst, []).append((row_of[i], self.state_of_chunk[i]))
            self.chain_args = ChainArgs(self.rank, tuple(sorted(recvs.items())), tuple((d, tuple(r)) for d, r in sorted(out.items())))
            return
        sends: dict[int, list[int]] = {}
        for t in mine:
            sends.setdefault(t.dst, []).append(row_of[index[t.sample]])
        self.state_args = HaloArgs(
            self.rank,
            len(self.map_chunks),
            tuple((dst, torch.as_tensor(r, dtype=torch.int64, device=device)) for dst, r in sorted(sends.items())),
            tuple(sorted(recvs.items())),
        )

    def _sent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v as one tensor of the parts the Ulysses exchange moves (solver.kinds.attention_parts):
        whole heads [n, H + 2 Hkv, D]; or, where value heads have their own size (MLA's), element j
        of every q, then k, then v head, a part each: [n, (H + Hkv) D + Hkv Dv, 1]."""
        if v.shape[2] == q.shape[2]:
            return torch.cat([q, k, v], dim=1)
        return torch.cat([t.transpose(1, 2).reshape(t.shape[0], t.shape[1] * t.shape[2]) for t in (q, k, v)], dim=1)[:, :, None]

    def _heads(self, y: torch.Tensor, p: int):
        """The way back of _sent on a group of p ranks: this rank's q, k, v heads."""
        c = self.cfg
        h, hkv = c.n_heads // p, max(c.n_kv_heads // p, 1)  # one replicated KV head when p > n_kv_heads
        if c.v_dim == c.head_dim:
            return y[:, :h], y[:, h : h + hkv], y[:, h + hkv :]
        n, d = y.shape[0], c.head_dim
        parts = y[:, :, 0].split([d * h, d * hkv, c.v_dim * hkv], dim=1)
        return tuple(t.view(n, dim, heads).transpose(1, 2) for t, dim, heads in zip(parts, (d, d, c.v_dim), (h, hkv, hkv)))

    def _rows(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A token's keys and values, all heads, as one halo row: [n, 2 Hkv, D], or [n, 1, Hkv (D + Dv)]
        where value heads have their own size."""
        if v.shape[2] == k.shape[2]:
            return torch.cat([k, v], dim=1)
        return torch.cat([t.reshape(t.shape[0], t.shape[1] * t.shape[2]) for t in (k, v)], dim=1)[:, None]

    def _keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The way back of _rows."""
        c = self.cfg
        if c.v_dim == c.head_dim:
            return rows[:, : c.n_kv_heads], rows[:, c.n_kv_heads :]
        k, v = rows[:, 0].split([c.n_kv_heads * c.head_dim, c.n_kv_heads * c.v_dim], dim=1)
        n = rows.shape[0]
        return k.view(n, c.n_kv_heads, c.head_dim), v.view(n, c.n_kv_heads, c.v_dim)

    def enter(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """x [n, hidden] in the layout the layer's token-wise work runs in: a redistribute plan's
        full layer moves it to the parent's token layout."""
        if layer_type != "F" or self.redistribution is None:
            return x
        return self._redistribute(x, self.redistribution, Site.FULL_REDIST)

    def leave(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """The way back of enter: the child layout again after a redistribute plan's full layer."""
        if layer_type != "F" or self.redistribution is None:
            return x
        return self._redistribute(x, self.redistribution.inverse(), Site.FULL_REDIST_BACK)

    def _redistribute(self, x: torch.Tensor, args, site: str) -> torch.Tensor:
        """x [n, hidden] whole rows through one all-to-all of `args` (a redistribution)."""
        y = exchange(x.reshape(x.shape[0], 1, x.shape[1]), args, self.transport, self.pack_backend, self.stats, site)
        return y.reshape(y.shape[0], x.shape[1])

    def rotary_for(self, layer_type: str) -> Rotary:
        return self.full_rotary if layer_type == "F" else self.rotary

    def attend(self, q, k, v, layer_type, layer, sinks=None):
        if layer_type == "S" and self.halo:
            kv = self._rows(k, v)  # keys and values, all heads: the halo rows
            got = halo_exchange(kv, self.halo_args, self.pack_backend, self.stats, Site.SPARSE_HALO)
            seg = permute_rows(torch.cat([got, kv]), self.key_rows, self.key_inverse, self.pack_backend)
            return self.attention_of["S"](q, *self._keys_values(seg), self.backend, self.recompute_attention, sinks)
        group = self.parent_group if layer_type == "F" else self.child_group
        entry, exit_ = (self.full_entry, self.full_exit) if layer_type == "F" else (self.sparse_entry, self.sparse_exit)
        p = group.size
        if p == 1:  # a group of one rank holds whole samples in head order: no communication
            return self.attention_of[layer_type](q, k, v, self.backend, self.recompute_attention, sinks)
        if sinks is not None:  # the query heads this rank holds after the entry: the group's j-th block of them
            n = self.cfg.n_heads // p
            sinks = sinks[(self.rank - group.start) * n : (self.rank - group.start + 1) * n]
        into, back = ENTRY_EXIT[layer_type]
        y = exchange(self._sent(q, k, v), entry, self.transport, self.pack_backend, self.stats, into)
        o = self.attention_of[layer_type](*self._heads(y, p), self.backend, self.recompute_attention, sinks)
        return exchange(o.contiguous(), exit_, self.transport, self.pack_backend, self.stats, back)

    def local_batch(self, sample_tokens: dict[int, np.ndarray], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's input tokens and next-token labels (the next token inside the same sample;
        none after a sample's last), one slice per local chunk."""
        toks, labs = [], []
        for s, a, b in self.chunks:
            t = np.asarray(sample_tokens[s])
            toks.append(t[a:b])
            labs.append(t[a + 1 : b + 1])
            if b == len(t):
                labs.append(np.array([IGNORE]))
        if not toks:
            return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device)
        tokens = torch.as_tensor(np.concatenate(toks).astype(np.int64), device=device)
        return tokens, torch.as_tensor(np.concatenate(labs).astype(np.int64), device=device)


def _rotary(chunks, cfg: ModelConfig, device) -> tuple[torch.Tensor, Rotary]:
    """(positions, rotary tables) of a rank's chunks (sample, start, end), in local order."""
    pos = [np.arange(a, b) for _, a, b in chunks] or [np.zeros(0)]
    positions = torch.as_tensor(np.concatenate(pos), dtype=torch.int64, device=device)
    return positions, Rotary(positions, cfg.head_dim, cfg.rope_theta, [(a, b) for _, a, b in chunks], cfg.rope_scaling, cfg.rotary_dim)


def expert_groups(ep: int, world: int) -> frozenset[tuple[int, int]]:
    """(start, size) of the expert-parallel groups: the world in aligned groups of `ep` ranks."""
    return frozenset((s, ep) for s in range(0, world, ep)) if ep > 1 else frozenset()


def label_count(plan: StepPlan) -> int:
    """Labelled tokens of the global batch: every token but each sample's last."""
    return plan.total_tokens - len(plan.lengths)


BUCKET_BYTES = 25 << 20  # gradients all-reduced per flat bucket of about this size


def allreduce_grads(model: torch.nn.Module, bucket_bytes: int | None = None) -> None:
    """Sum every parameter's gradient over the world (parameters are replicated), in flat buckets
    of at most `bucket_bytes` (a parameter larger than that is a bucket of its own): a few
    collectives per step rather than one per parameter. A parameter no token reached this step
    (an expert nobody routed to) contributes zeros."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # under expert parallelism (model.sharding.replicate_experts) the experts sum over their replicas only
    replicas = getattr(model, "expert_replicas", None)
    experts = {id(p) for p in expert_params(model).values()} if replicas is not None else set()
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}  # bytes in each bucket list's last bucket
    for p in model.parameters():
        key = (p.grad.dtype, p.grad.device, id(p) in experts)
        bs = buckets.setdefault(key, [[]])
        if bs[-1] and filled[key] + p.grad.nbytes > bucket_bytes:
            bs.append([])
            filled[key] = 0
        bs[-1].append(p.grad)
        filled[key] = filled.get(key, 0) + p.grad.nbytes
    for key, bs in buckets.items():
        for grads in bs:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=replicas if key[2] else None)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


def run_step(
    model,
    plan: StepPlan,
    sample_tokens: dict[int, np.ndarray],
    groups: ExchangeGroups,
    pack_backend="auto",
    backend="auto",
    stats: CommStats | None = None,
    check_hash: bool = True,
    autocast_dtype: torch.dtype | None = None,
    timers: dict | None = None,
) -> torch.Tensor:
    """Forward + backward of one step on this rank; returns the global loss (summed over ranks).
    Gradients are summed over the world: all-reduced in place (replicated parameters) or reduce-
    scattered into the shards (FSDP2). autocast_dtype (bf16 on CUDA, replicated) wraps the forward.
    timers: if given, gets this rank's wall seconds of each phase ("host": the plan's checks, the
    context and the local batch; "forward"; "backward", FSDP2's reductions included; "grad_sync":
    the replicated gradients' all-reduce; "loss_sum"), the device synchronized between phases."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = next(model.parameters()).device
    clock = PhaseClock(timers, dev)
    ep = getattr(model, "ep", 1)
    validate(plan, model.cfg, world, ep)
    if ep > 1 and not is_sharded(model) and getattr(model, "expert_replicas", None) is None:
        raise LayoutError(
            f"expert parallelism (degree {ep}) needs the experts' replicas to sum their gradients over: shard the model with "
            f"model.sharding.shard_model, or keep it replicated with model.sharding.replicate_experts"
        )
    if check_hash:
        check_same_plan(plan, dev)
    groups.ensure(plan.group_shapes | expert_groups(ep, world))  # every rank, the same groups: made in one global order
    selective = getattr(model, "recompute", "none") == "selective"
    place = RankPlacement(plan, model.cfg, rank, groups, pack_backend, backend, stats, dev, selective, ep)
    tokens, labels = place.local_batch(sample_tokens, dev)
    clock.lap("host")
    if autocast_dtype is not None:
        with torch.autocast(dev.type, dtype=autocast_dtype):
            loss = model.loss(tokens, labels, place, label_count(plan), world)
    else:
        loss = model.loss(tokens, labels, place, label_count(plan), world)
    clock.lap("forward")
    loss.backward()
    clock.lap("backward")
    if not is_sharded(model):  # FSDP2 reduce-scatters (sums) in the backward
        allreduce_grads(model)
    clock.lap("grad_sync")
    total = loss.detach().clone()
    dist.all_reduce(total)
    clock.lap("loss_sum")
    return total


__all__ = [
    "RankPlacement",
    "expert_groups",
    "LayoutError",
    "all_reduce_sum",
    "allreduce_grads",
    "check_same_plan",
    "label_count",
    "run_step",
    "validate",
    "IGNORE",
]
