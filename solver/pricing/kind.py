"""What the sparse layers' kind adds (solver.kinds answers each question): its halo rows, a
linear kind's maps and carried states and their dtype, the maps' and the recurrence's blocks'
seconds (solver.cost.CostModel's part)."""

from __future__ import annotations

import numpy as np

from ..kinds import STATE_DTYPES, resolve_state_dtype


class KindCosts:
    """The sparse kind's own costs: halo rows, maps, carried states, recurrence blocks.

    A part of solver.cost.CostModel: its methods read the attributes CostModel.__init__ sets."""

    def block_time(self, lengths):
        """Forward seconds a rank pays per sample (or chunk) of these lengths for the blocks of a
        linear kind's recurrence it loops over, whatever its share of the heads
        (HardwareConfig.linear_block_latency per block; 0 for other kinds and on GPUs)."""
        n = np.asarray(lengths, dtype=np.float64)
        if self.hw.linear_block_latency == 0:  # no blocks are priced (GPUs): whatever the kind
            return np.zeros_like(n)
        return self.sparse.recurrence_blocks(n, self.model.sparse_params) * self.hw.linear_block_latency

    def halo_row_bytes(self) -> float:
        """Bytes of one halo row: a token's keys and values, or a linear kind's pre-convolution row."""
        return self.sparse.halo_row_elements(self.model) * self.hw.bytes_per_element * self.byte_share

    def state_bytes(self) -> float:
        """Bytes of one chunk's map (A, B) a linear kind's state passing sends (0 for other kinds)."""
        return self.sparse.state_elements(self.model.sparse_params) * self.state_element_bytes() * self.byte_share

    def carried_bytes(self) -> float:
        """Bytes of one state the chain carries from a chunk to the next (a linear kind's; 0 otherwise)."""
        return self.sparse.carried_elements(self.model.sparse_params) * self.state_element_bytes() * self.byte_share

    def state_element_bytes(self) -> int:
        """Bytes of one element of a linear kind's maps and states (its state_dtype)."""
        return STATE_DTYPES[resolve_state_dtype(self.sparse.state_dtype(self.model.sparse_params), self.hw.bytes_per_element)]

    def map_time(self, lengths):
        """Forward seconds of the maps of chunks of these lengths (a linear kind's state passing; 0 otherwise)."""
        n = np.asarray(lengths, dtype=np.float64)  # two recurrences a chunk: A's and B's
        return self.sparse.map_flops(n, self.model) / self.sparse_rate + 2 * self.block_time(n)
