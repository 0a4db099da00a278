"""The least-loaded-bin fill that the baseline assignment, the parent solver's joint fill and the
child solver's greedy start share: bins grouped by shape, one heap per shape.

Every bin of one shape prices a new item alike (same size, same cost line), and a bin's time only
grows with its load, so the least-loaded bin of a shape that still has room is the only one of
that shape an item needs to look at: a placement looks at one bin per shape, not at every bin.

Loads only grow. A bin whose load rose keeps its old, smaller key until it reaches the top of its
heap, where it is re-keyed (lazy re-keying): a placement costs O(log bins), with no heap rebuild.
The bin found is the same as with exact keys: the smallest (load, bin) among bins with room (a
fresh top's key is at most every other entry's key, and no entry's key exceeds its bin's load).
So a caller may re-key a bin early (the bin a placement just chose is usually its heap's top:
heapreplace it with its new load), and may take a heap's top itself, without a call, when its
key is fresh and it has room: what least_loaded would return. The fills do both inline (their
innermost loop) and call least_loaded only for a stale or full top.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable


class LeastLoaded:
    """Heaps of (load, bin) per shape of bin; `load(bin)` gives a bin's current load."""

    def __init__(self, load: Callable[[int], float]):
        self.load = load
        self.heaps: dict[Hashable, list[tuple[float, int]]] = {}

    def add(self, shape: Hashable, b: int) -> None:
        heapq.heappush(self.heaps.setdefault(shape, []), (self.load(b), b))

    def shapes(self):
        return self.heaps.keys()

    def least_loaded(self, shape: Hashable, has_room: Callable[[int], bool]) -> int:
        """The least-loaded bin of `shape` for which has_room(bin) holds, or -1."""
        heap, load = self.heaps[shape], self.load
        found, skipped = -1, None  # no list made in the common case: a fresh top with room
        while heap:
            key, b = heap[0]
            now = load(b)
            if key != now:  # stale: the bin took an item since this entry was pushed
                heapq.heapreplace(heap, (now, b))
                continue
            if has_room(b):
                found = b
                break
            if skipped is None:
                skipped = []
            skipped.append(heapq.heappop(heap))
        for e in skipped or ():
            heapq.heappush(heap, e)
        return found
