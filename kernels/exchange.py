"""The exchange: pack -> all_to_all_single with per-peer split sizes -> unpack, as one autograd op.

Every exchange of the model is "token layout <-> head layout of a group". A rank's part of it is
given by a plan object with the attributes of solver.layout.RankExchange (kind, group_start,
group_size, rank, n_in, n_out, send_counts, recv_counts, pack_rows, unpack_rows); this module
reads only those plain arrays. Heads: the token-side tensor holds parts of heads given by
`head_counts` (Q, K, V: [H, Hkv, Hkv]; an attention output: [H]); peer j of a group of P gets the
j-th 1/P slice of every part, so Q, K and V travel in one all-to-all. The backward of an exchange is its inverse
(entry's backward is an exit over the same layouts, and vice versa).
"""

from __future__ import annotations

import datetime
import math
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .permute import gather_heads, gather_rows, scatter_heads


def head_split_map(head_counts: Sequence[int], group_size: int, replicated: bool = False) -> np.ndarray:
    """[P, heads per peer] token-side head index of each head a peer gets, part by part.

    A part of s heads that P divides gives each peer s / P heads. The first part (query
    heads, or an attention output) must split so. A later one (key/value heads) narrower than the
    group, s dividing P, is replicated: peer j gets head j // (P / s), the key/value head its query
    heads attend to in the model's GQA mapping. replicated=True numbers those heads instead by
    replica slot (peer j: slot j of the part's P), the layout the way back unpacks into before
    the replicas' gradients are summed (fold_replicas)."""
    off, parts = 0, []
    for i, s in enumerate(head_counts):
        if s % group_size == 0:
            k = s // group_size
            parts.append(off + np.arange(group_size)[:, None] * k + np.arange(k)[None, :])
            off += s
        elif i > 0 and group_size % s == 0:
            if replicated:
                parts.append(off + np.arange(group_size)[:, None])
                off += group_size
            else:
                parts.append(off + (np.arange(group_size) // (group_size // s))[:, None])
                off += s
        else:
            raise ValueError(
                f"a part of {s} heads cannot be split over a group of {group_size} ranks: query heads must be a "
                f"multiple of every group size used, and key/value heads a multiple or a divisor of it (then replicated)"
            )
    rows = np.concatenate(parts, axis=1) if parts else np.zeros((group_size, 0), dtype=np.int64)
    return rows.astype(np.int32)


def replica_counts(head_counts: Sequence[int], group_size: int) -> tuple[tuple[int, int], ...] | None:
    """(heads, replicas) per part when an exchange over `group_size` replicates any (replicas 1
    otherwise); None when nothing is replicated."""
    out = tuple((s, group_size // s if s % group_size and group_size % s == 0 else 1) for s in head_counts)
    return out if any(r > 1 for _, r in out) else None


def fold_replicas(x: torch.Tensor, replicas: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """[n, sum(heads x replicas), D] -> [n, sum(heads), D]: each replicated head's slots summed, in
    slot order (a fixed order: deterministic, no atomics). The backward of a replicating entry:
    every replica of a key/value head sends back its gradient, and the gradients add up.

    >>> fold_replicas(torch.ones(2, 1 + 4, 3), ((1, 1), (2, 2))).shape
    torch.Size([2, 3, 3])
    """
    parts, at = [], 0
    for heads, r in replicas:
        seg = x[:, at : at + heads * r]
        parts.append(seg if r == 1 else seg.reshape(x.shape[0], heads, r, x.shape[2]).sum(dim=2))
        at += heads * r
    return torch.cat(parts, dim=1)


@dataclass(frozen=True, eq=False)
class ExchangeArgs:
    """One rank's exchange as device tensors, ready for the kernels and the collective.

    `plan` is the plain-array plan they were made from (solver.layout.RankExchange or any object
    with its attributes); its fields are not copied here, and the inverse (the backward) is made
    from plan.inverse(), so the logic of an exchange lives in one place."""

    plan: object
    head_counts: tuple[int, ...]
    device: torch.device
    in_heads: int
    out_heads: int
    send_counts: list[int]
    recv_counts: list[int]
    pack_rows: torch.Tensor
    pack_peers: torch.Tensor
    pack_map: torch.Tensor
    unpack_rows: torch.Tensor
    unpack_peers: torch.Tensor
    unpack_map: torch.Tensor
    # on the way back (to_heads False) of a replicating exchange: unpack into one slot per replica
    # (out_heads counts them), then fold_replicas sums them into the token side's heads
    replicas: tuple[tuple[int, int], ...] | None = None
    _inverse: list = field(default_factory=list, repr=False)

    @property
    def group_start(self) -> int:
        return self.plan.group_start

    @property
    def group_size(self) -> int:
        return self.plan.group_size

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def n_in(self) -> int:
        return int(self.plan.n_in)

    @property
    def n_out(self) -> int:
        return int(self.plan.n_out)

    def inverse(self) -> ExchangeArgs:
        """The exchange back (made once, then kept)."""
        if not self._inverse:
            self._inverse.append(exchange_args(self.plan.inverse(), self.head_counts, self.device))
        return self._inverse[0]


def exchange_args(plan, head_counts: Sequence[int], device: torch.device | str = "cpu") -> ExchangeArgs:
    """Tensors for one rank's exchange `plan` (a RankExchange-like object) moving `head_counts` heads.

    >>> import numpy as np
    >>> class P:  # a 1-rank "group": the exchange is a local copy
    ...     to_heads, group_start, group_size, rank, n_in, n_out = True, 0, 1, 0, 3, 3
    ...     send_counts = recv_counts = np.array([3]); pack_rows = unpack_rows = np.arange(3)
    >>> exchange_args(P(), [4]).pack_map.shape
    torch.Size([1, 4])
    """
    device = torch.device(device)
    p = plan.group_size
    if getattr(plan, "whole", False):  # a redistribution: every peer gets whole rows, all heads
        split = torch.arange(int(sum(head_counts)), dtype=torch.int32, device=device).expand(p, -1).contiguous()
    else:
        split = torch.as_tensor(head_split_map(head_counts, p), device=device)
    hs = split.shape[1]
    ident = torch.arange(hs, dtype=torch.int32, device=device).expand(p, hs).contiguous()
    tokens_heads = int(sum(head_counts))
    send = [int(c) for c in plan.send_counts]
    recv = [int(c) for c in plan.recv_counts]

    def peers(counts):
        return torch.as_tensor(np.repeat(np.arange(p, dtype=np.int32), counts), device=device)

    def idx(a):
        return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)

    replicas = None if getattr(plan, "whole", False) else replica_counts(head_counts, p)
    if plan.to_heads:  # token side in, head side out: pack splits heads (replicating), unpack keeps them
        pack_map, unpack_map, in_heads, out_heads = split, ident, tokens_heads, hs
    elif replicas is None:
        pack_map, unpack_map, in_heads, out_heads = ident, split, hs, tokens_heads
    else:  # into replica slots, summed by unpack (fold_replicas)
        slots = torch.as_tensor(head_split_map(head_counts, p, replicated=True), device=device)
        pack_map, unpack_map, in_heads, out_heads = ident, slots, hs, sum(h * r for h, r in replicas)
    if len(plan.pack_rows) != sum(send) or len(plan.unpack_rows) != sum(recv):
        raise ValueError(
            f"rank {plan.rank}: plan rows ({len(plan.pack_rows)}, {len(plan.unpack_rows)}) do not match "
            f"its split sizes ({sum(send)}, {sum(recv)})"
        )
    return ExchangeArgs(
        plan=plan,
        head_counts=tuple(int(s) for s in head_counts),
        device=device,
        in_heads=in_heads,
        out_heads=out_heads,
        send_counts=send,
        recv_counts=recv,
        pack_rows=idx(plan.pack_rows),
        pack_peers=peers(send),
        pack_map=pack_map,
        unpack_rows=idx(plan.unpack_rows),
        unpack_peers=peers(recv),
        unpack_map=unpack_map,
        replicas=None if plan.to_heads else replicas,
    )


# ----- communication ---------------------------------------------------------------------------
@dataclass
class CommStats:
    """Counts every exchange: all-to-all calls per site, bytes per (src, dst) rank, bytes across nodes.
    timed: also the wall seconds of each exchange's pack, all-to-all and unpack per site (the
    device synchronized around each part, so only for measurement runs)."""

    gpus_per_node: int = 8
    timed: bool = False
    seconds: dict = field(default_factory=lambda: defaultdict(dict))  # site -> {"pack", "all_to_all", "unpack", "record"}: seconds
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes_to_peer: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))  # site -> (src, dst) -> bytes
    bytes_by_site: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # site -> [intra, inter]

    def record(self, site: str, args: ExchangeArgs, row_bytes: int) -> None:
        self.record_counts(site, args.rank, args.group_start, args.send_counts, row_bytes)

    def record_counts(self, site: str, rank: int, group_start: int, send_counts, row_bytes: int) -> None:
        """One call at `site`: send_counts[j] rows of row_bytes to rank group_start + j."""
        self.record_peers(site, rank, {group_start + j: c for j, c in enumerate(send_counts)}, row_bytes)

    def record_peers(self, site: str, rank: int, rows_to: dict, row_bytes: int) -> None:
        """One call at `site`: rows_to[dst] rows of row_bytes to each rank dst (point-to-point)."""
        self.calls[site] += 1
        src_node = rank // self.gpus_per_node
        for dst, c in rows_to.items():
            if dst == rank or c == 0:
                continue
            b = c * row_bytes
            self.bytes_to_peer[site][(rank, dst)] += b
            self.bytes_by_site[site][0 if dst // self.gpus_per_node == src_node else 1] += b

    # `sites`: the site keys to sum over (solver.sites.sites_of: a family's, forward and backward;
    # None: every site counted), by name, never by a prefix of it
    def exchange_seconds(self, sites: Collection[str] | None = None, part: str | None = None) -> float:
        """Timed seconds of these sites: one part ("pack", "all_to_all", "unpack") or all three
        (the counting itself, "record", is in none)."""
        parts = EXCHANGE_PARTS if part is None else (part,)
        return sum(v.get(q, 0.0) for k, v in self.seconds.items() if sites is None or k in sites for q in parts)

    def inter_node_bytes(self, sites: Collection[str] | None = None) -> int:
        return sum(v[1] for k, v in self.bytes_by_site.items() if sites is None or k in sites)

    def intra_node_bytes(self, sites: Collection[str] | None = None) -> int:
        return sum(v[0] for k, v in self.bytes_by_site.items() if sites is None or k in sites)

    def total_calls(self, sites: Collection[str] | None = None) -> int:
        return sum(v for k, v in self.calls.items() if sites is None or k in sites)


class ExchangeGroups:
    """The exchanges' torch.distributed process groups: each aligned power-of-two rank range of
    two or more ranks that a step uses, made the first time a step uses it.

    `ensure(groups)` is called by every rank with the same groups (a step plan's: every rank runs
    the same plan, its hash checked first) and makes the new ones in one global order, widest
    first, then by first rank, every rank calling new_group for each: so every rank agrees on a
    group's name, and a member never waits for a peer that makes another group first. A rank
    outside a group only counts it (new_group connects and allocates nothing there); a rank joins
    only the groups its own steps use, one of each width at most (aligned groups of one width are
    disjoint): log2 of the widest group, whatever the world. timeout: how long a collective on
    them may wait (a subgroup does not inherit the default group's; give the run's).

    Rank r holds (start, size) with start <= r < start + size; `held` counts them and `seconds` is
    the time spent making groups."""

    def __init__(self, world_size: int | None = None, timeout: datetime.timedelta | None = None):
        self.world_size = world_size or dist.get_world_size()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout = timeout
        self.made: set[tuple[int, int]] = set()
        self.groups: dict[tuple[int, int], object] = {}  # this rank's
        self.seconds = 0.0

    def _check(self, start: int, size: int) -> None:
        if size < 1 or size & (size - 1) or start % size or start < 0 or start + size > self.world_size:
            raise ValueError(
                f"no process group for ranks [{start}, {start + size}): groups must be aligned powers of two "
                f"inside a world of {self.world_size}"
            )

    def ensure(self, groups) -> int:
        """Make the groups (start, size) of `groups` not made yet (size 1 needs none); every rank
        calls this with the same groups. Returns how many were made."""
        new = set()
        for start, size in groups:
            self._check(start, size)
            if size > 1 and (start, size) not in self.made:
                new.add((start, size))
        t = time.perf_counter()
        for start, size in sorted(new, key=lambda g: (-g[1], g[0])):
            group = dist.new_group(list(range(start, start + size)), timeout=self.timeout)
            self.made.add((start, size))
            if start <= self.rank < start + size:
                self.groups[(start, size)] = group
        self.seconds += time.perf_counter() - t
        return len(new)

    def ensure_every_aligned_group(self) -> int:
        """Make every aligned group of the world (what a calibration that measures every width uses)."""
        sizes = [1 << k for k in range(1, self.world_size.bit_length()) if (1 << k) <= self.world_size]
        return self.ensure((start, size) for size in sizes for start in range(0, self.world_size - size + 1, size))

    @property
    def held(self) -> int:
        return len(self.groups)

    def get(self, start: int, size: int):
        self._check(start, size)
        if (start, size) not in self.groups:
            raise ValueError(
                f"rank {self.rank} holds no process group for ranks [{start}, {start + size}): "
                + (
                    "it is not one of them"
                    if not start <= self.rank < start + size
                    else "ensure() makes a step's groups before its exchanges"
                )
            )
        return self.groups[(start, size)]


Transport = Callable[[torch.Tensor, ExchangeArgs], torch.Tensor]


def dist_transport(groups: ExchangeGroups) -> Transport:
    """all_to_all_single over the plan's group with the plan's per-peer split sizes (rows)."""

    def run(send: torch.Tensor, args: ExchangeArgs) -> torch.Tensor:
        recv = send.new_empty((sum(args.recv_counts),) + tuple(send.shape[1:]))
        if args.group_size == 1:
            recv.copy_(send)
            return recv
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=args.recv_counts,
            input_split_sizes=args.send_counts,
            group=groups.get(args.group_start, args.group_size),
        )
        return recv

    return run


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, stats, site):
        ctx.args = (recv_counts, send_counts, group, stats, site + ".bwd")
        return _all_to_all_rows(x, send_counts, recv_counts, group, stats, site)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAllRows.apply(grad.contiguous(), *ctx.args), None, None, None, None, None


def _all_to_all_rows(x, send_counts, recv_counts, group, stats, site):
    if group is None:  # a group of one rank
        return x.clone()
    clock = PhaseClock.of_site(stats, site, x.device)
    if stats is not None:
        rank = dist.get_rank()
        start = rank - dist.get_group_rank(group, rank)  # the groups here are aligned ranges
        stats.record_counts(site, rank, start, send_counts, math.prod(x.shape[1:]) * x.element_size())
    clock.lap("record")
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group)
    clock.lap("all_to_all")
    return out


def all_to_all_rows(x: torch.Tensor, send_counts, recv_counts, group, stats: CommStats | None = None, site: str = "rows"):
    """Rows of x [n, ...] to the peers of `group` (send_counts[j] to its rank j), rows from them
    (recv_counts[j] from rank j) -> [sum(recv_counts), ...]; differentiable (the backward is the
    reverse all-to-all), counted in `stats` under `site`. group None: one rank, a copy."""
    return _AllToAllRows.apply(x, list(send_counts), list(recv_counts), group, stats, site)


@dataclass(frozen=True, eq=False)
class HaloArgs:
    """One rank's part of a halo exchange: the rows of its local tensor each later rank's queries
    reach back to (sends: (destination rank, local rows) by destination), and how many rows each
    earlier rank sends it (recvs: (source rank, rows) by source; the receive buffer holds them
    source after source, each source's in the order it packs them). Point-to-point over the
    default group: no process group of its own (a halo child is any range of ranks)."""

    rank: int
    n_in: int
    sends: tuple[tuple[int, torch.Tensor], ...]
    recvs: tuple[tuple[int, int], ...]

    @property
    def n_recv(self) -> int:
        return sum(c for _, c in self.recvs)


def point_to_point(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """Send each (peer, tensor) of `sends` and receive into each of `recvs`, over the default
    group, in one batch; returns when all are done."""
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends] + [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, args, backend, stats, site):
        ctx.args, ctx.backend, ctx.stats, ctx.site = args, backend, stats, site
        clock = PhaseClock.of_site(stats, site, kv.device)
        out = [(dst, gather_rows(kv, rows, backend)) for dst, rows in args.sends]
        clock.lap("pack")
        if stats is not None:
            row_bytes = math.prod(kv.shape[1:]) * kv.element_size()
            stats.record_peers(site, args.rank, {dst: int(rows.numel()) for dst, rows in args.sends}, row_bytes)
        clock.lap("record")
        inn = [(src, kv.new_empty((c, *kv.shape[1:]))) for src, c in args.recvs]
        point_to_point(out, inn)
        clock.lap("all_to_all")
        return torch.cat([t for _, t in inn]) if inn else kv.new_empty((0, *kv.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        args, stats, site = ctx.args, ctx.stats, ctx.site + ".bwd"
        clock = PhaseClock.of_site(stats, site, grad.device)
        grad = grad.contiguous()
        back, at = [], 0
        for src, c in args.recvs:  # each halo's gradient to the rank that holds it
            back.append((src, grad[at : at + c]))
            at += c
        clock.lap("pack")
        if stats is not None:
            row_bytes = math.prod(grad.shape[1:]) * grad.element_size()
            stats.record_peers(site, args.rank, {src: c for src, c in args.recvs}, row_bytes)
        clock.lap("record")
        got = [(dst, grad.new_empty((int(rows.numel()), *grad.shape[1:]))) for dst, rows in args.sends]
        point_to_point(back, got)
        clock.lap("all_to_all")
        out = grad.new_zeros((args.n_in, *grad.shape[1:]))
        for (_, rows), (_, g) in zip(args.sends, got):  # destination by destination: a fixed order of the sums
            out.index_add_(0, rows, g)
        clock.lap("unpack")
        return out, None, None, None, None


def halo_exchange(kv: torch.Tensor, args: HaloArgs, backend: str = "auto", stats: CommStats | None = None, site: str = "halo"):
    """Send the rows of `kv` [n_in, H, D] each later rank reaches back to, receive the rows the
    earlier ranks send: -> [n_recv, H, D], differentiable (the backward sends each halo's
    gradient back to its owner, where they add up destination by destination)."""
    if kv.shape[0] != args.n_in:
        raise ValueError(f"rank {args.rank}: halo exchange input has {kv.shape[0]} rows, the plan expects {args.n_in}")
    return _Halo.apply(kv, args, backend, stats, site)


def pack(x: torch.Tensor, args: ExchangeArgs, backend: str = "auto") -> torch.Tensor:
    if x.shape[0] != args.n_in or x.shape[1] != args.in_heads:
        raise ValueError(
            f"rank {args.rank}: exchange input has shape {tuple(x.shape)}, the plan expects [{args.n_in}, {args.in_heads}, head_dim]"
        )
    return gather_heads(x, args.pack_rows, args.pack_peers, args.pack_map, backend)


def unpack(recv: torch.Tensor, args: ExchangeArgs, backend: str = "auto") -> torch.Tensor:
    out = scatter_heads(recv, args.unpack_rows, args.unpack_peers, args.unpack_map, args.n_out, args.out_heads, backend)
    return out if args.replicas is None else fold_replicas(out, args.replicas)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, args, transport, backend, stats, site):
        ctx.args, ctx.transport, ctx.backend, ctx.stats, ctx.site = args, transport, backend, stats, site
        return _run(x, args, transport, backend, stats, site)

    @staticmethod
    def backward(ctx, grad):
        inv = ctx.args.inverse()
        return (
            _Exchange.apply(grad.contiguous(), inv, ctx.transport, ctx.backend, ctx.stats, ctx.site + ".bwd"),
            None,
            None,
            None,
            None,
            None,
        )


EXCHANGE_PARTS = ("pack", "all_to_all", "unpack")


class PhaseClock:
    """Wall seconds between laps, added into a dict by lap name, the device synchronized at each
    lap; given no dict, it neither syncs nor times (a measurement run's clock, free otherwise)."""

    def __init__(self, timers: dict | None, device: torch.device):
        self.timers, self.device = timers, device
        self.t = self._now() if timers is not None else 0.0

    @classmethod
    def of_site(cls, stats: CommStats | None, site: str, device: torch.device) -> PhaseClock:
        """The clock of one call at an exchange site: adding into `stats`' seconds of `site` where
        they are timed (CommStats.timed), free otherwise."""
        return cls(stats.seconds[site] if stats is not None and stats.timed else None, device)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        if self.timers is not None:
            t = self._now()
            self.timers[name] = self.timers.get(name, 0.0) + t - self.t
            self.t = t


def _run(x, args, transport, backend, stats, site):
    clock = PhaseClock.of_site(stats, site, x.device)
    send = pack(x, args, backend)
    clock.lap("pack")
    if stats is not None:
        stats.record(site, args, send.shape[1] * send.shape[2] * send.element_size())
    clock.lap("record")
    recv = transport(send, args)
    clock.lap("all_to_all")
    out = unpack(recv, args, backend)
    clock.lap("unpack")
    return out


def exchange(
    x: torch.Tensor, args: ExchangeArgs, transport: Transport, backend: str = "auto", stats: CommStats | None = None, site: str = "exchange"
) -> torch.Tensor:
    """One exchange with autograd: [n_in, in_heads, D] -> [n_out, out_heads, D].

    Exactly one all-to-all per call (and one per backward). `stats` counts it under `site`.
    """
    return _Exchange.apply(x, args, transport, backend, stats, site)


def exchange_all_ranks(xs: dict[int, torch.Tensor], args: dict[int, ExchangeArgs], backend: str = "auto") -> dict[int, torch.Tensor]:
    """Single-process reference of one exchange on every rank at once: the tests' yardstick, the
    torch permutation the distributed run is compared with (differentiable through the torch backend)."""
    sends = {r: pack(xs[r], a, backend) for r, a in args.items()}
    out = {}
    for r, a in args.items():
        blocks = []
        for j in range(a.group_size):
            src = args[a.group_start + j]
            off = int(np.sum(src.send_counts[: a.rank - a.group_start]))
            blocks.append(sends[a.group_start + j][off : off + src.send_counts[a.rank - a.group_start]])
        recv = torch.cat(blocks) if blocks else sends[r][:0]
        out[r] = unpack(recv, a, backend)
    return out
