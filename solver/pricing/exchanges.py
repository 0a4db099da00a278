"""The exchanges of a layout: each row's bytes, an all-to-all's seconds between ranks on and off
their nodes, a layout's cost line and a parent's shared time (solver.cost.CostModel's part)."""

from __future__ import annotations

import numpy as np

from .common import (
    exchanged_heads,
    rank_time,
    ulysses_parts,
)


class ExchangeCosts:
    """The exchanges' bytes and seconds, and a layout's cost line.

    A part of solver.cost.CostModel: its methods read the attributes CostModel.__init__ sets."""

    def entry_row_bytes(self, group_size: int, layer_type: str = "F") -> float:
        """Bytes of one token's Q, K, V (all heads; a linear kind's S layer: what it declares,
        ulysses_parts) in an entry exchange, key/value heads replicated up to a wider group."""
        (parts, width), _ = ulysses_parts(self.model, layer_type)
        return exchanged_heads(parts, group_size) * width * self.hw.bytes_per_element * self.byte_share

    def kv_row_bytes(self) -> float:
        """Bytes of one token's keys and values (all key/value heads): a halo exchange's row."""
        m = self.model
        return m.n_kv_heads * (m.head_dim + m.v_dim) * self.hw.bytes_per_element * self.byte_share

    def hidden_row_bytes(self) -> float:
        """Bytes of one token's hidden state: a redistribution's row."""
        return self.model.hidden * self.hw.bytes_per_element

    def exit_row_bytes(self, layer_type: str = "F") -> float:
        """Bytes of one token's attention output (a linear kind's S layer: its declared exit) in an exit exchange."""
        _, (parts, width) = ulysses_parts(self.model, layer_type)
        return sum(parts) * width * self.hw.bytes_per_element * self.byte_share

    def peers(self, start: int, size: int, rank: int) -> tuple[int, int]:
        """(other peers on rank's node, peers on other nodes) inside group [start, start + size)."""
        g = self.gpus_per_node
        if g is None:
            raise ValueError("this CostModel has no node size to price exchanges with: use cost.for_cluster(cluster)")
        node = rank // g
        lo, hi = max(start, node * g), min(start + size, (node + 1) * g)
        same = hi - lo
        return same - 1, size - same

    def exchange_time(self, tokens: float, start: int, size: int, rank: int, row_bytes: float) -> tuple[float, float]:
        """(intra, inter) seconds for `rank` to send its `tokens` rows' 1/size slices to each peer."""
        if size == 1:
            return 0.0, 0.0
        intra_peers, inter_peers = self.peers(start, size, rank)
        per_peer = tokens * row_bytes / size
        extra = self.hw.a2a_inter_latency if inter_peers else 0.0  # a call across nodes pays the network's round trip
        latency = self.hw.a2a_call_latency(size)
        if self.hw.ratio_reading == "group" and inter_peers:  # the whole all-to-all at the cross-node rate
            return latency, per_peer * (intra_peers + inter_peers) / self.hw.inter_node_bw + extra
        return (
            per_peer * intra_peers / self.hw.intra_node_bw + latency,
            per_peer * inter_peers / self.hw.inter_node_bw + extra,
        )

    def exchange_line(self, size: int, layer_type: str = "F") -> tuple[float, float]:
        """One layer's exchanges (fwd + bwd) in an aligned group of `size`, for x tokens per rank,
        as a * x + b: (seconds per token, fixed seconds). Cached per size and layer type."""
        line = self._lines.get((size, layer_type))
        if line is None:
            b = self.layer_exchange_time(0.0, 0, size, 0, layer_type)
            line = self._lines[(size, layer_type)] = (float(self.layer_exchange_time(1.0, 0, size, 0, layer_type) - b), float(b))
        return line

    def child_line(self, size: int, parent_size: int) -> tuple[float, float]:
        """Per-rank seconds of the token-layout work of a layout of `size` ranks inside a parent
        of `parent_size`, as (tokenwise + a * tokens) / size + b for the layout's tokenwise seconds and
        tokens: a holds its own exchanges at the sparse layers and its share of the parent's at
        the full layers; b the sparse layers' fixed cost. A group in its own layout is the case
        size == parent_size. The parent's full attention and parent_fixed come on top. Cached."""
        line = self._child_lines.get((size, parent_size))
        if line is None:
            m = self.model
            a_c, b_c = self.exchange_line(size, "S")
            a_p = self.exchange_line(parent_size)[0]
            line = self._child_lines[(size, parent_size)] = (m.n_sparse * a_c + m.n_full * a_p, m.n_sparse * b_c)
        return line

    def parent_fixed(self, parent_size: int) -> float:
        """Fixed seconds of a parent's full-layer exchanges (every rank of the parent waits them). Cached."""
        fixed = self._parent_fixed.get(parent_size)
        if fixed is None:
            fixed = self._parent_fixed[parent_size] = self.model.n_full * self.exchange_line(parent_size)[1]
        return fixed

    def shared_time(self, full_seconds: float, parent_size: int) -> float:
        """Per-rank seconds every rank of a parent spends on its full attention (`full_seconds`:
        full_cost summed over its samples, split over its ranks) and its full-layer exchanges'
        fixed cost. A parent's time is this plus its slowest child's rank_time."""
        return full_seconds / parent_size + self.parent_fixed(parent_size)

    def own_layout_time(self, lengths, size: int) -> float:
        """rank_time of a group of `size` ranks that keeps its own (evenly split) layout at every layer."""
        n = np.asarray(lengths, dtype=np.float64)
        return rank_time(float(self.tokenwise_cost(n).sum()), float(n.sum()), size, self.child_line(size, size))

    def group_rate(self, size: int) -> float:
        """Bytes per second a rank sends to its peers in one all-to-all of an aligned group of
        `size` ranks (latency aside): the effective rate the ratio and its reading imply."""
        per_byte = sum(self.exchange_time(1.0, 0, size, 0, 1.0)) - sum(self.exchange_time(0.0, 0, size, 0, 1.0))  # latencies cancel
        return (size - 1) / size / per_byte

    def halo_line(self, parent_size: int, pass_seconds: float, map_seconds: float = 0.0) -> tuple[float, float]:
        """cost.rank_time's line of a halo child inside a parent of `parent_size`: its share of the
        parent's full-layer exchanges per token; as the fixed part, its sparse layers' halo
        exchanges (`pass_seconds` a pass at its slowest rank, solver.reference.halo_pass; every
        exchange pass) and the forward seconds of the maps its slowest rank forms (a linear
        kind's state passing; every attention pass). No head exchange."""
        m = self.model
        per_layer = self.exchange_passes * pass_seconds + self.attention_passes * map_seconds
        return m.n_full * self.exchange_line(parent_size)[0], m.n_sparse * per_layer

    def layer_exchange_time(self, tokens: float, start: int, size: int, rank: int, layer_type: str = "F") -> float:
        """Forward + backward seconds of one layer's entry and exit exchanges (`layer_type` 'F' or 'S')."""
        if size == 1:
            return 0.0
        a = sum(self.exchange_time(tokens, start, size, rank, self.entry_row_bytes(size, layer_type)))
        b = sum(self.exchange_time(tokens, start, size, rank, self.exit_row_bytes(layer_type)))
        return self.exchange_passes * (a + b)
