"""The least-loaded-bin fill that the parent assignment, the parent solver's joint fill and the
child solver's greedy start share: bins grouped by shape, and per shape the bins that can still
take a sample found without walking past the ones that cannot.

Every bin of one shape prices a new item alike (same size, same cost line), and a bin's time only
grows with its load, so the least-loaded bin of a shape that still has room is the only one of
that shape an item needs to look at: a placement looks at one bin per shape, not at every bin.

What a query asks: the smallest (load, bin) among the shape's bins whose room, `room(bin)` (the
longest sample the bin can still take, by every budget it holds), is at least the sample's length.
Both keys change, in one direction each: loads only grow, rooms only shrink. Per shape:

- an *open* heap of (load, bin), re-keyed lazily: a bin whose load rose keeps its old, smaller key
  until it reaches the top, where it is re-keyed (no entry's key exceeds its bin's load, and a fresh
  top's key is at most every other entry's, so the first fresh top is the least-loaded open bin);
- a *parked* heap of the bins found too full, by largest room first, their keys the room they had
  when parked (at least their room now, since rooms only shrink).

A query for a sample of n tokens first opens every parked bin whose key is >= n (re-parking, with
its true room, one whose room shrank below n while parked: its key was an upper bound), so every
parked bin left has room < n; then takes the open heap's first fresh top with room >= n, parking
each fresh top it passes that has less. The answer is therefore the smallest (load, bin) among all
bins with room: the same bin as scanning every bin, so plans are unchanged. A bin is parked only
after its room fell below the current sample's length, and opened only when a sample fits it; with
samples placed longest first (every fill here) each bin is parked at most once per item it takes,
so a fill of n samples into B bins costs O((n + B) log B), whatever the fill (a nearly full step
used to pop and push back every full bin for every sample: O(n B log B)).

A caller may re-key a bin early (the bin a placement just chose is usually its heap's top:
heapreplace it with its new load), and may take an open heap's top itself, without a call, when
its key is fresh, it has room, and no parked bin's key reaches the sample's length (a parked bin
that may fit could be less loaded): what least_loaded would return. The fills do both inline
(their innermost loop) and call least_loaded otherwise.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable


class LeastLoaded:
    """Per shape of bin, the open heap of (load, bin) and the parked heap of (-room, bin);
    `load(bin)` gives a bin's current load (never falls), `room(bin)` the longest sample it can
    still take (never grows)."""

    def __init__(self, load: Callable[[int], float], room: Callable[[int], int]):
        self.load, self.room = load, room
        self.heaps: dict[Hashable, list[tuple[float, int]]] = {}  # open: (load, bin)
        self.parked: dict[Hashable, list[tuple[int, int]]] = {}  # (-room when parked, bin)

    def add(self, shape: Hashable, b: int) -> None:
        heapq.heappush(self.heaps.setdefault(shape, []), (self.load(b), b))
        self.parked.setdefault(shape, [])

    def add_many(self, shape: Hashable, bins: range) -> None:
        """add() of consecutive new bins of one shape that share their load (empty bins): the
        heap add() would build, in one step (pushing equal loads in increasing bin order appends
        each entry where it stays)."""
        heap = self.heaps.setdefault(shape, [])
        self.parked.setdefault(shape, [])
        if heap:
            for b in bins:
                heapq.heappush(heap, (self.load(b), b))
        else:
            key = self.load(bins[0]) if len(bins) else 0.0
            heap.extend((key, b) for b in bins)

    def shapes(self):
        return self.heaps.keys()

    def least_loaded(self, shape: Hashable, n: int) -> int:
        """The least-loaded bin of `shape` with room(bin) >= n (ties: the lowest bin), or -1."""
        heap, parked, load, room = self.heaps[shape], self.parked[shape], self.load, self.room
        while parked and -parked[0][0] >= n:  # may fit: open it, or park it again with its true room
            _, b = heapq.heappop(parked)
            r = room(b)
            if r >= n:
                heapq.heappush(heap, (load(b), b))
            else:
                heapq.heappush(parked, (-r, b))
        while heap:
            key, b = heap[0]
            now = load(b)
            if key != now:  # stale: the bin took an item since this entry was pushed
                heapq.heapreplace(heap, (now, b))
                continue
            r = room(b)
            if r >= n:
                return b
            heapq.heappop(heap)
            heapq.heappush(parked, (-r, b))
        return -1
