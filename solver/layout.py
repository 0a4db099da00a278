"""Token layouts, head layouts and the row plans of the all-to-all between them.

A *token layout* partitions ranks into groups (contiguous, aligned, power-of-two rank ranges).
Each sample belongs to one group and is cut into contiguous chunks over the group's ranks:
rank k of a group of P holds tokens [L*k//P, L*(k+1)//P) of every sample of the group, sample
after sample. The *head layout* of a group holds every token of the group's samples (sample
after sample, the order of `Group.samples`) for a 1/P slice of the heads.

The exchange plans here are plain integer arrays; the kernels consume them without importing
anything else of this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .cluster import Cluster, PlanError, is_pow2


class Way(Enum):
    """How a group runs its sparse layers. Its value is the group's mark in a plan's JSON (none
    for Ulysses): [start, size, samples, "halo"]."""

    ULYSSES = None  # the heads split over the group by Ulysses' all-to-all, every sample whole per head
    # its own token layout: each rank receives from the ranks before it the rows its reach needs
    # (keys and values; a linear kind's convolution rows) and a linear kind's states in one round,
    # every earlier chunk's map to each later chunk of its sample (state_transfers)
    HALO = "halo"
    # as HALO, a linear kind's states passed by the chain: each chunk's outgoing state to the next
    # chunk only, one hop after another (state_hops)
    CHAIN = "halo:chain"


HALO_MARK, CHAIN_MARK = Way.HALO.value, Way.CHAIN.value


@dataclass(frozen=True)
class Group:
    """Ranks [start, start + size) and the samples they hold, each cut into contiguous chunks
    over them, and the way its sparse layers run (Way). A group of a step's layouts is an aligned
    power-of-two range whose attention runs by Ulysses' head exchange; a *halo* group (a halo
    child, any Way but ULYSSES) is any contiguous range inside its parent whose sparse layers run
    on its own token layout (the kind's reach; a linear kind's states passed as its way says:
    solver.kinds.StatePassing)."""

    start: int
    size: int
    samples: tuple[int, ...]
    way: Way = Way.ULYSSES

    @property
    def halo(self) -> bool:
        """Its sparse layers run on its own token layout (a halo child), whichever way it passes states."""
        return self.way is not Way.ULYSSES

    @property
    def chain(self) -> bool:
        """A halo child that passes a linear kind's states by the chain."""
        return self.way is Way.CHAIN

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def ranks(self) -> range:
        return range(self.start, self.stop)

    def spans_nodes(self, gpus_per_node: int) -> bool:
        """Its ranks lie on more than one node (of `gpus_per_node` ranks each)."""
        return self.start // gpus_per_node != (self.stop - 1) // gpus_per_node

    def same_tokens(self, other: Group) -> bool:
        """The same ranks and samples: the same token layout, whatever the attention."""
        return (self.start, self.size, self.samples) == (other.start, other.size, other.samples)

    def to_json(self) -> list:
        return [self.start, self.size, list(self.samples)] + ([self.way.value] if self.halo else [])

    @staticmethod
    def from_json(obj) -> Group:
        mark = obj[3] if len(obj) > 3 else None
        if mark not in (HALO_MARK, CHAIN_MARK, None):
            raise PlanError(f"group {obj!r}: a group's fourth item may only be {HALO_MARK!r} or {CHAIN_MARK!r}")
        return Group(int(obj[0]), int(obj[1]), tuple(int(s) for s in obj[2]), Way(mark))


def chunk_bounds(length, parts: int) -> np.ndarray:
    """Offsets [parts + 1] of the contiguous chunks of a sample cut over `parts` ranks; for an
    array of lengths [n], every sample's at once: [n, parts + 1]."""
    k = np.arange(parts + 1, dtype=np.int64)
    return np.multiply.outer(np.asarray(length, dtype=np.int64), k) // parts


def rank_tokens(
    groups, length_of: Mapping[int, int], world: int, lengths: np.ndarray | None = None, shape=None, pieces: bool = False
) -> np.ndarray:
    """Tokens each of `world` ranks holds in these groups, every sample cut over its group's
    ranks in order (chunk_bounds: rank j of s ranks holds (n (j + 1)) // s - (n j) // s of n
    tokens), for all the groups' samples at once. `lengths`: the groups' samples' lengths in
    order, where the caller has them; `shape`: the groups' (sample counts, sizes, first ranks) as
    arrays, where the caller has them. pieces=True: instead of tokens, how many samples each rank
    holds a piece of (at least one token)."""
    if shape is None:
        shape = (
            np.fromiter((len(g.samples) for g in groups), dtype=np.int64, count=len(groups)),
            np.fromiter((g.size for g in groups), dtype=np.int64, count=len(groups)),
            np.fromiter((g.start for g in groups), dtype=np.int64, count=len(groups)),
        )
    counts = shape[0]
    if lengths is None:
        n = np.fromiter((length_of[s] for g in groups for s in g.samples), dtype=np.int64, count=int(counts.sum()))
    else:
        n = np.asarray(lengths).astype(np.int64)
    sizes, starts = np.repeat(shape[1], counts), np.repeat(shape[2], counts)
    if not pieces and (sizes == 1).all():  # every sample whole on one rank
        return np.bincount(starts, n, world).astype(np.float64)
    per = np.repeat(np.arange(len(n)), sizes)  # one entry per (sample, rank of its group)
    j = np.arange(len(per)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    n_of, s_of = n[per], sizes[per]
    held = (n_of * (j + 1)) // s_of - (n_of * j) // s_of
    return np.bincount(starts[per] + j, held > 0 if pieces else held, world).astype(np.float64)


def check_group_shape(start: int, size: int, cluster: Cluster, aligned: bool = True) -> None:
    """aligned: a Ulysses group (a power of two starting at a multiple of itself); a halo group
    is any range of one rank or more."""
    if size < 1:
        raise PlanError(f"group at rank {start} has size={size}; a group holds at least one rank")
    if aligned and not is_pow2(size):
        raise PlanError(f"group at rank {start} has size={size}; group sizes must be powers of two")
    if aligned and start % size:
        raise PlanError(f"group of size {size} starts at rank {start}; it must start at a multiple of {size}")
    if start < 0 or start + size > cluster.world_size:
        raise PlanError(f"group [{start}, {start + size}) lies outside the cluster's ranks [0, {cluster.world_size})")


@dataclass(frozen=True)
class TokenLayout:
    """Groups of ranks with their samples; `lengths` maps sample id -> tokens."""

    groups: tuple[Group, ...]
    lengths: Mapping[int, int] = field(hash=False, compare=True)
    _by_rank: dict | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    # ----- queries -------------------------------------------------------------------------
    def group_of_rank(self) -> dict[int, Group]:
        """rank -> its group (made once per layout: every per-rank query reads it)."""
        if self._by_rank is None:
            object.__setattr__(self, "_by_rank", {r: g for g in self.groups for r in g.ranks})
        return self._by_rank

    def group_of(self, rank: int) -> Group:
        """`rank`'s group, by one scan of the groups (no map of every rank: a rank's per-step work
        need not touch the whole cluster)."""
        if self._by_rank is not None:
            return self._by_rank[rank]
        for g in self.groups:
            if g.start <= rank < g.start + g.size:
                return g
        raise PlanError(f"rank {rank} is in no group of this layout")

    def groups_within(self, outer: Group) -> list[Group]:
        """The groups whose ranks lie inside `outer`'s (a child layout's children of a parent)."""
        return [g for g in self.groups if outer.start <= g.start < outer.start + outer.size]

    def local_chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """(sample_id, first_token, stop_token) of every chunk `rank` holds, in local order."""
        g = self.group_of(rank)
        k = rank - g.start
        out = []
        for sid in g.samples:
            b = chunk_bounds(self.lengths[sid], g.size)
            out.append((sid, int(b[k]), int(b[k + 1])))
        return out

    def tokens_per_rank(self) -> dict[int, int]:
        counts = {}
        for g in self.groups:
            counts.update(zip(g.ranks, self._group_rank_tokens(g)))
        return counts

    def _group_rank_tokens(self, g: Group) -> list[int]:
        """Tokens on each of g's ranks, in rank order."""
        if g.size == 1:
            return [sum(self.lengths[s] for s in g.samples)]
        lens = np.array([self.lengths[s] for s in g.samples], dtype=np.int64)
        return np.diff(chunk_bounds(lens, g.size), axis=1).sum(axis=0).tolist()

    def group_tokens(self, g: Group) -> int:
        return sum(self.lengths[s] for s in g.samples)

    # ----- validation ----------------------------------------------------------------------
    def validate(self, cluster: Cluster, ranks: range | None = None, name: str = "layout") -> None:
        """Raise PlanError unless groups tile `ranks` (default: all), every sample sits in exactly
        one group, and no rank holds more than tokens_per_rank.

        Each check runs over whole arrays first; only a layout that fails one is walked group by
        group, to name the first bad group, sample or rank."""
        ranks = range(cluster.world_size) if ranks is None else ranks
        groups = self.groups
        starts = np.fromiter((g.start for g in groups), dtype=np.int64, count=len(groups))
        sizes = np.fromiter((g.size for g in groups), dtype=np.int64, count=len(groups))
        halo = np.fromiter((g.halo for g in groups), dtype=bool, count=len(groups))
        pow2 = (sizes >= 1) & ((sizes & (sizes - 1)) == 0)
        if not (
            (pow2 | (halo & (sizes >= 1))).all()
            and (halo | (starts % np.where(pow2, sizes, 1) == 0)).all()
            and (starts >= 0).all()
            and (starts + sizes <= cluster.world_size).all()
        ):
            for g in groups:
                check_group_shape(g.start, g.size, cluster, aligned=not g.halo)
        order = np.argsort(starts, kind="stable")
        s, z = starts[order], sizes[order]
        if not (len(s) and s[0] == ranks.start and (s[1:] == s[:-1] + z[:-1]).all() and s[-1] + z[-1] == ranks.stop):
            covered = sorted(r for g in groups for r in g.ranks)
            raise PlanError(f"{name}: groups cover ranks {covered} but must cover each of [{ranks.start}, {ranks.stop}) exactly once")
        flat = [sid for g in groups for sid in g.samples]
        placed = set(flat)
        if len(placed) != len(flat) or not placed <= self.lengths.keys():
            self._name_misplaced(name)
        missing = sorted(set(self.lengths) - placed)
        if missing:
            raise PlanError(f"{name}: samples {missing[:8]} are not placed in any group")
        # no rank holds more than the sum of its group's ceil(L / P) chunks: only a group whose sum
        # passes the budget can have a rank over it
        lens = np.fromiter(map(self.lengths.__getitem__, flat), dtype=np.int64, count=len(flat))
        per_group = np.fromiter((len(g.samples) for g in groups), dtype=np.int64, count=len(groups))
        bound = np.bincount(
            np.repeat(np.arange(len(groups)), per_group), weights=-(-lens // np.repeat(sizes, per_group)), minlength=len(groups)
        )
        for k in np.nonzero(bound > cluster.tokens_per_rank)[0].tolist():
            for r, n in zip(groups[k].ranks, self._group_rank_tokens(groups[k])):
                if n > cluster.tokens_per_rank:
                    raise PlanError(f"{name}: rank {r} holds {n} tokens, over tokens_per_rank={cluster.tokens_per_rank}")

    def _name_misplaced(self, name: str) -> None:
        """Raise PlanError naming the first unknown or twice-placed sample (validate found one)."""
        placed: dict[int, int] = {}
        for g in self.groups:
            for s in g.samples:
                if s not in self.lengths:
                    raise PlanError(f"{name}: group at rank {g.start} names unknown sample id={s}")
                if s in placed:
                    raise PlanError(f"{name}: sample id={s} is placed twice (groups at ranks {placed[s]} and {g.start})")
                placed[s] = g.start
        raise AssertionError("validate found a misplaced sample but none is")


def head_cu_seqlens(layout: TokenLayout, g: Group) -> np.ndarray:
    """cu_seqlens [n_samples + 1] of a group's head layout (int32, as varlen attention wants)."""
    lens = [layout.lengths[s] for s in g.samples]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# ----- exchange plans -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RankExchange:
    """One rank's part of one all-to-all over its group (peers are group-local indices 0..P-1).

    to_heads: token layout -> head layout (an entry exchange); False: the way back (an exit).
    whole: a token layout -> another token layout (a redistribution): rows move with all their
    heads, and to_heads only says which way.
    pack: send[m] = input[pack_rows[m]] (with the heads of the destination peer's slice when the
    input is in a token layout); the send buffer holds send_counts[j] rows for peer j, peer after
    peer. unpack: output[unpack_rows[m]] = recv[m] (merging head slices when the output is in a
    token layout); recv holds recv_counts[j] rows from peer j. These plain arrays are all the
    kernels read (kernels.exchange_args makes device tensors of them, and inverts through here).
    """

    to_heads: bool
    group_start: int
    group_size: int
    rank: int
    n_in: int
    n_out: int
    send_counts: np.ndarray
    recv_counts: np.ndarray
    pack_rows: np.ndarray
    unpack_rows: np.ndarray
    whole: bool = False  # a token layout to another: every row moves with all its heads (a redistribution)

    @property
    def peer_index(self) -> int:
        return self.rank - self.group_start

    def inverse(self) -> RankExchange:
        """The exchange back: sends become receives and pack rows unpack rows (the backward)."""
        return RankExchange(
            to_heads=not self.to_heads,
            group_start=self.group_start,
            group_size=self.group_size,
            rank=self.rank,
            n_in=self.n_out,
            n_out=self.n_in,
            send_counts=self.recv_counts,
            recv_counts=self.send_counts,
            pack_rows=self.unpack_rows,
            unpack_rows=self.pack_rows,
            whole=self.whole,
        )


def _head_groups(src: TokenLayout, heads: TokenLayout) -> dict[int, Group]:
    """Map every rank to its head group, checking that `src` refines `heads` (each head group's
    ranks hold exactly its samples in `src`)."""
    by_rank = heads.group_of_rank()
    src_by_rank = src.group_of_rank()
    if set(by_rank) != set(src_by_rank):
        raise PlanError("token layout and head layout cover different ranks")
    for hg in heads.groups:
        inside = {sg for r in hg.ranks for sg in [src_by_rank[r]]}
        if any(sg.start < hg.start or sg.stop > hg.stop for sg in inside):
            raise PlanError(f"a token-layout group straddles head group [{hg.start}, {hg.stop})")
        ids = sorted(s for sg in inside for s in sg.samples)
        if ids != sorted(hg.samples):
            raise PlanError(
                f"head group [{hg.start}, {hg.stop}) holds samples {sorted(hg.samples)} but its ranks hold {ids} in the token layout"
            )
    return by_rank


def _group_token_rows(src: TokenLayout, hg: Group) -> dict[int, np.ndarray]:
    """For every rank of head group `hg`: the row in hg's head layout of each of its local tokens
    in `src`, in local order. One array expression per token-layout group inside hg (chunk
    bounds of all its samples at once), no per-sample Python work."""
    offset, at = {}, 0
    for s in hg.samples:
        offset[s] = at
        at += src.lengths[s]
    out: dict[int, np.ndarray] = {}
    for g in src.groups_within(hg):
        lens = np.array([src.lengths[s] for s in g.samples], dtype=np.int64)
        offs = np.array([offset[s] for s in g.samples], dtype=np.int64)
        bounds = chunk_bounds(lens, g.size)  # every sample's: [samples, size + 1]
        for j in range(g.size):
            starts, n = bounds[:, j], bounds[:, j + 1] - bounds[:, j]
            before = np.cumsum(n) - n  # rows of this rank's earlier chunks
            out[g.start + j] = np.repeat(offs + starts - before, n) + np.arange(int(n.sum()), dtype=np.int64)
    return out


def _entry_of_group(src: TokenLayout, heads: TokenLayout, hg: Group, ranks=None) -> dict[int, RankExchange]:
    """The entry exchange of `ranks` (default: every rank) of head group `hg`; the work grows with
    the group's tokens, not with the cluster."""
    idx = _group_token_rows(src, hg)
    counts = np.array([len(idx[r]) for r in hg.ranks], dtype=np.int64)
    n_group = heads.group_tokens(hg)
    unpack = np.concatenate([idx[r] for r in hg.ranks])
    plans = {}
    for r in hg.ranks if ranks is None else ranks:
        n = len(idx[r])
        plans[r] = RankExchange(
            to_heads=True,
            group_start=hg.start,
            group_size=hg.size,
            rank=r,
            n_in=n,
            n_out=n_group,
            send_counts=np.full(hg.size, n, dtype=np.int64),
            recv_counts=counts,
            pack_rows=np.tile(np.arange(n, dtype=np.int64), hg.size),
            unpack_rows=unpack,
        )
    return plans


def token_to_head_plan(src: TokenLayout, heads: TokenLayout) -> dict[int, RankExchange]:
    """Entry exchange: `src` token layout -> head layout of each group of `heads`, every rank
    (a rank that runs a step needs only its own: token_to_head_rank).

    Senders keep their local order (pack is the head split); receivers place rows in the head
    group's sample order (unpack is the row permutation).
    """
    by_rank = _head_groups(src, heads)
    plans = {}
    for hg in heads.groups:
        plans.update(_entry_of_group(src, heads, hg))
    assert set(plans) == set(by_rank)
    return plans


def token_to_head_rank(src: TokenLayout, heads: TokenLayout, rank: int) -> RankExchange:
    """token_to_head_plan's exchange of one rank, from its head group alone: the host work of a
    step grows with the rank's group, not with the cluster. The layouts are a validated plan's
    (StepPlan.validate checks that the children refine their parents)."""
    return _entry_of_group(src, heads, heads.group_of(rank), ranks=(rank,))[rank]


def head_to_token_rank(heads: TokenLayout, dst: TokenLayout, rank: int) -> RankExchange:
    """head_to_token_plan's exchange of one rank (the inverse of its entry)."""
    return token_to_head_rank(dst, heads, rank).inverse()


def head_to_token_plan(heads: TokenLayout, dst: TokenLayout) -> dict[int, RankExchange]:
    """Exit exchange: head layout of each group of `heads` -> `dst` token layout (which may be a
    child layout: that is the repacking). The inverse of token_to_head_plan(dst, heads)."""
    return {r: p.inverse() for r, p in token_to_head_plan(dst, heads).items()}


def token_to_token_rank(src: TokenLayout, dst: TokenLayout, group: Group, rank: int) -> RankExchange:
    """One rank's part of a redistribution inside `group` (a parent): every token of the group's
    samples from its rank in `src` to its rank in `dst`, whole (all heads), one all-to-all over the
    group. Senders pack their rows by destination, each destination's in its row order; receivers
    unpack into their local order. Both layouts must tile the group with its samples."""
    src_rows = _group_token_rows(src, group)  # each rank's tokens' index in the group's token order
    dst_rows = _group_token_rows(dst, group)
    n = src.group_tokens(group)
    owner = np.empty(n, dtype=np.int64)  # the destination rank of each token, and its row there
    row_there = np.empty(n, dtype=np.int64)
    source = np.empty(n, dtype=np.int64)
    for r in group.ranks:
        owner[dst_rows[r]] = r - group.start
        row_there[dst_rows[r]] = np.arange(len(dst_rows[r]))
        source[src_rows[r]] = r - group.start
    mine = src_rows[rank]
    order = np.lexsort((row_there[mine], owner[mine]))  # by destination, then its row
    incoming = dst_rows[rank]
    back = np.lexsort((np.arange(len(incoming)), source[incoming]))  # by source, then my row: the order blocks arrive in
    return RankExchange(
        to_heads=True,
        group_start=group.start,
        group_size=group.size,
        rank=rank,
        n_in=len(mine),
        n_out=len(incoming),
        send_counts=np.bincount(owner[mine], minlength=group.size).astype(np.int64),
        recv_counts=np.bincount(source[incoming], minlength=group.size).astype(np.int64),
        pack_rows=order.astype(np.int64),
        unpack_rows=back.astype(np.int64),
        whole=True,
    )


def relayout_rows(src: TokenLayout, dst: TokenLayout, group: Group) -> dict[tuple[int, int], int]:
    """Rows each (source rank, destination rank) of `group` moves when its tokens go from `src`
    to `dst`: token_to_token_rank's counts for every rank at once, from the chunks' overlaps
    (each sample's chunk bounds in both layouts merged; tests tie the two)."""
    where_src = {s: g for g in src.groups_within(group) for s in g.samples}
    where_dst = {s: g for g in dst.groups_within(group) for s in g.samples}
    out: dict[tuple[int, int], int] = {}
    for sid in group.samples:
        n, a, b = src.lengths[sid], where_src[sid], where_dst[sid]
        ba, bb = chunk_bounds(n, a.size), chunk_bounds(n, b.size)
        cuts = np.union1d(ba, bb)
        lo, hi = cuts[:-1], cuts[1:]
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
        ra = np.searchsorted(ba, lo, side="right") - 1  # the rank of each piece in each layout
        rb = np.searchsorted(bb, lo, side="right") - 1
        for i, j, rows in zip((a.start + ra).tolist(), (b.start + rb).tolist(), (hi - lo).tolist()):
            out[(i, j)] = out.get((i, j), 0) + rows
    return out


@dataclass(frozen=True)
class HaloTransfer:
    """Rows [lo, hi) of sample `sample` (positions in the sample) that rank `src` holds and rank
    `dst`'s queries reach back to."""

    src: int
    dst: int
    sample: int
    lo: int
    hi: int


def halo_transfers(layout: TokenLayout, group: Group, first_key, params: dict, rank: int | None = None) -> list[HaloTransfer]:
    """Every key/value halo a halo group's sparse layers move: for each sample of the group and
    each of its chunks [a, b) on rank k, the rows [first_key(a), a) it reaches back to, from the
    earlier ranks that hold them (none for a chunk whose reach stays inside it: the first, or one
    that starts a chunk of a chunked kind). Ordered by destination, source, then sample and
    position: the order every rank packs and unpacks in.

    `rank`: only the transfers that rank sends or receives, in the same order (what its own
    exchange needs). A rank of a wide halo group builds its share without building the group's
    every transfer: an SP32 halo child of a full step has thousands."""
    me = None if rank is None else rank - group.start
    out = []
    for sid in group.samples:
        bounds = chunk_bounds(layout.lengths[sid], group.size)
        reach = np.asarray(first_key(bounds[:-1], params), dtype=np.int64)
        held = bounds[1:] > bounds[:-1]
        # the chunks that reach back before their start: non-empty, after the first
        takers = np.nonzero(held & (reach < bounds[:-1]))[0]
        takers = takers[takers >= (1 if me is None else max(me, 1))]  # a rank takes from earlier ranks, sends to later ones
        for k in takers.tolist():
            if me is None or k == me:  # every earlier non-empty chunk that ends after the reach
                sources = np.nonzero(held[:k] & (bounds[1 : k + 1] > reach[k]))[0].tolist()
            else:  # a later chunk: only what `rank` sends it
                sources = [me] if held[me] and bounds[me + 1] > reach[k] else []
            lo = int(reach[k])
            out.extend(HaloTransfer(group.start + j, group.start + k, sid, max(lo, int(bounds[j])), int(bounds[j + 1])) for j in sources)
    order = {sid: i for i, sid in enumerate(group.samples)}
    return sorted(out, key=lambda t: (t.dst, t.src, order[t.sample], t.lo))


def halo_pair_rows(layout: TokenLayout, group: Group, first_key, params: dict) -> dict[tuple[int, int], int]:
    """Rows per (source, destination) of halo_transfers, summed: what the simulator prices (tests
    tie the two). With numpy over the group's samples at once (in blocks that bound the
    [samples, ranks, ranks] arrays): for each sample, rank j < k sends rank k the rows of j's
    chunk at or after the first key k's chunk reads, max(0, end_j - max(start_j, first_key(start_k)))."""
    m = group.size
    if m < 2 or not group.samples:
        return {}
    n = np.fromiter((layout.lengths[sid] for sid in group.samples), dtype=np.int64, count=len(group.samples))
    rank = np.arange(m)
    earlier = rank[:, None] < rank[None, :]  # [j, k]: j < k
    total = np.zeros((m, m), dtype=np.int64)
    step = max(1, HALO_ROWS_BLOCK // (m * m))
    for i in range(0, n.size, step):
        bounds = chunk_bounds(n[i : i + step], m)  # [samples, m + 1]
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        reads = np.asarray(first_key(lo.ravel(), params), dtype=np.int64).reshape(lo.shape)  # each chunk's first key
        rows = hi[:, :, None] - np.maximum(lo[:, :, None], reads[:, None, :])  # [sample, j, k]
        keep = earlier[None] & (hi > lo)[:, None, :] & (rows > 0)
        total += np.where(keep, rows, 0).sum(axis=0)
    js, ks = np.nonzero(total)
    return {(group.start + j, group.start + k): int(total[j, k]) for j, k in zip(js.tolist(), ks.tolist())}


# halo_pair_rows' elements per block of samples (samples x ranks x ranks)
HALO_ROWS_BLOCK = 1 << 18


def state_transfers(layout: TokenLayout, group: Group) -> list[HaloTransfer]:
    """Every map a state-passing group's linear layers move (StatePassing): for each sample of the
    group and each of its non-empty chunks on rank k, the map of each earlier non-empty chunk of
    the sample, from its rank (one map each: lo, hi = 0, 1). Ordered by destination, source, then
    sample: the order every rank packs and unpacks in, and the order a chunk composes them in."""
    out = []
    for sid in group.samples:
        bounds = chunk_bounds(layout.lengths[sid], group.size)
        held = [k for k in range(group.size) if bounds[k + 1] > bounds[k]]
        out.extend(HaloTransfer(group.start + j, group.start + k, sid, 0, 1) for i, k in enumerate(held) for j in held[:i])
    order = {sid: i for i, sid in enumerate(group.samples)}
    return sorted(out, key=lambda t: (t.dst, t.src, order[t.sample]))


def state_hops(layout: TokenLayout, group: Group) -> list[HaloTransfer]:
    """Every state a chain-passing group's linear layers move (Way.CHAIN): for each sample of
    the group, from each of its non-empty chunks to the next one (one state each: lo, hi = 0, 1).
    Ordered by destination, source, then sample."""
    out = []
    for sid in group.samples:
        bounds = chunk_bounds(layout.lengths[sid], group.size)
        held = [k for k in range(group.size) if bounds[k + 1] > bounds[k]]
        out.extend(HaloTransfer(group.start + j, group.start + k, sid, 0, 1) for j, k in zip(held, held[1:]))
    order = {sid: i for i, sid in enumerate(group.samples)}
    return sorted(out, key=lambda t: (t.dst, t.src, order[t.sample]))


def state_pair_maps(layout: TokenLayout, group: Group) -> dict[tuple[int, int], int]:
    """Maps per (source, destination) of state_transfers, summed: what the simulator prices."""
    out: dict[tuple[int, int], int] = {}
    for t in state_transfers(layout, group):
        out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + 1
    return out


def exchange_bytes(plans: Mapping[int, RankExchange], world_size: int, row_bytes: int) -> np.ndarray:
    """[world, world] bytes rank i sends to rank j (self-sends included on the diagonal)."""
    m = np.zeros((world_size, world_size), dtype=np.int64)
    for r, p in plans.items():
        m[r, p.group_start : p.group_start + p.group_size] = p.send_counts * row_bytes
    return m


def token_ids(layout: TokenLayout, rank: int) -> np.ndarray:
    """Global id (sample_id << 32 | position) of every local token of `rank`, in local order."""
    parts = [(np.int64(s) << 32) + np.arange(a, b, dtype=np.int64) for s, a, b in layout.local_chunks(rank)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def head_token_ids(layout: TokenLayout, g: Group) -> np.ndarray:
    """Global ids of a group's head layout rows (sample after sample): the tests' yardstick of
    where an entry exchange must put every token."""
    parts = [(np.int64(s) << 32) + np.arange(layout.lengths[s], dtype=np.int64) for s in g.samples]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def simulate_exchange(plans: Mapping[int, RankExchange], inputs: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Row-level reference of one exchange on every rank at once (no heads): pack, deliver the
    per-peer blocks as all_to_all_single would, unpack. Unwritten output rows stay -1. The tests'
    yardstick of the exchange plans (the kernels are checked against it through the tests)."""
    sent = {}
    for r, p in plans.items():
        buf = inputs[r][p.pack_rows]
        offs = np.concatenate([[0], np.cumsum(p.send_counts)])
        sent[r] = [buf[offs[j] : offs[j + 1]] for j in range(p.group_size)]
    out = {}
    for r, p in plans.items():
        blocks = [sent[p.group_start + j][p.peer_index] for j in range(p.group_size)]
        if [len(b) for b in blocks] != list(p.recv_counts):
            raise PlanError(f"rank {r} expects {list(p.recv_counts)} rows but peers send {[len(b) for b in blocks]}")
        recv = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
        o = np.full(p.n_out, -1, dtype=recv.dtype)
        o[p.unpack_rows] = recv
        out[r] = o
    return out
