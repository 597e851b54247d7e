"""The next-use index: when each resident tensor is read next, and the order tensors should leave in.

Belady's rule needs, for every resident tensor, when it is read next.
Recomputing that for the whole tier at every decision costs O(resident) each
time; instead each stream whose trace is trusted keeps the absolute position
of every resident tensor's next read (the index fields of `Stream`), which
changes only when the cursor passes that tensor or its residency changes.
Resident tensors no indexed trace reads next are "infinitely far" and kept by
recency, least recent first.

`NextUseIndex.eviction_order` turns this into the eviction order: untraced
tensors least recently used first, then the rest farthest next use first.
What to do with that order (quotas, demand or prefetch room) is
`infinity.daemon.scheduler.eviction`'s business.

It reads the streams (never changes their steps) and the residency view,
whose arrivals and departures it watches.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Callable, Iterator, TypeVar

from infinity.daemon.scheduler.stream import Stream, StreamState
from infinity.daemon.scheduler.view import ResidencyView
from infinity.daemon.trace import INFINITE_S, StreamKey, TensorKey

__all__ = ["NextUseIndex", "heap_in_order"]

_T = TypeVar("_T")


def heap_in_order(heap: list[_T]) -> Iterator[_T]:
    """The items of a binary heap, smallest first, without changing it: O(log k) per item taken.

    A frontier of slots ordered by their items: a slot's children can only
    follow it. The heap must not change while this runs.
    """
    if not heap:
        return
    frontier: list[tuple[_T, int]] = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        item, slot = heapq.heappop(frontier)
        for child in (2 * slot + 1, 2 * slot + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
        yield item


class NextUseIndex:
    """Next reads of resident tensors per indexed stream, recency, and the eviction order.

    `streams`: the scheduler's streams (read here, owned by
    `infinity.daemon.scheduler.steps`). `is_pinned(key)`: the daemon's answer to
    "is this tensor leased now?", asked while walking the eviction order.

    Cost: an access, a load event or an eviction updates the index in
    O(streams x log n); a walk of the eviction order costs O(log n) per tensor
    it pulls, plus a sort of the tensors no trace needs.
    """

    def __init__(self, streams: Mapping[StreamKey, Stream], residency: ResidencyView, *,
                 is_pinned: Callable[[TensorKey], bool]) -> None:
        self._streams = streams
        self._residency = residency
        self._is_pinned = is_pinned
        # Resident tensors that no indexed trace reads next ("infinitely far"), and for the others
        # how many indexed traces read them next: kept as residency and indexes change.
        self._infinite: set[TensorKey] = set()
        self._live: dict[TensorKey, int] = {}
        # The infinite ones by recency, least recent on top: (recency, key), stale entries (touched
        # again, or no longer infinite) skipped lazily.
        self._lru_heap: list[tuple[int, TensorKey]] = []
        self._recency: dict[TensorKey, int] = {}  # higher: used more recently
        self._use_seq = 0

    # --- recency ---------------------------------------------------------------------

    def used(self, key: TensorKey) -> None:
        """`key` was just used (read, written or loaded): the most recent of all now."""
        self._use_seq += 1
        self._recency[key] = self._use_seq
        if key in self._infinite:
            self._push_lru(key)

    def recency(self, key: TensorKey) -> int:
        """`key`'s place in the order of use (higher: more recent; 0: never used)."""
        return self._recency.get(key, 0)

    def forget(self, key: TensorKey) -> None:
        """`key` was deleted: its recency goes (its residency went through the view)."""
        self._recency.pop(key, None)

    def _mark_infinite(self, key: TensorKey) -> None:
        if key not in self._infinite:
            self._infinite.add(key)
            self._push_lru(key)

    def _push_lru(self, key: TensorKey) -> None:
        heapq.heappush(self._lru_heap, (self._recency.get(key, 0), key))
        if len(self._lru_heap) > 2 * len(self._infinite) + 64:
            self._lru_heap = [(self._recency.get(k, 0), k) for k in self._infinite]
            heapq.heapify(self._lru_heap)

    def _lru_valid(self, entry: tuple[int, TensorKey]) -> bool:
        recency, key = entry
        return key in self._infinite and self._recency.get(key, 0) == recency

    # --- residency changes (the scheduler passes on the view's arrivals and departures) ------

    def resident_added(self, key: TensorKey) -> None:
        self._mark_infinite(key)  # until an index says a trace reads it
        for s in self._streams.values():
            if s.indexed and s.trace is not None and key in s.trace:
                self.index_key(s, key)

    def resident_dropped(self, key: TensorKey) -> None:
        self._infinite.discard(key)
        for s in self._streams.values():
            if s.indexed:
                self._unindex_key(s, key)

    # --- per-stream indexes ----------------------------------------------------------

    @staticmethod
    def _indexable(s: Stream) -> bool:
        if not s.active or s.trace is None or s.state is StreamState.RECORDING:
            return False
        return s.replay is None or not s.replay.diverged

    @staticmethod
    def position(s: Stream) -> int:
        """Index of the stream's next expected access in its trace (len: the next step's start)."""
        assert s.trace is not None
        if s.state is StreamState.REPLAYING and s.replay is not None:
            return s.replay.position
        return len(s.trace)

    def sync(self, s: Stream) -> None:
        """Index the stream, or drop its index, as its state now says (active, trusted trace)."""
        want = self._indexable(s)
        if s.indexed and not want:
            self.drop(s)
        elif want and not s.indexed:
            assert s.trace is not None
            s.indexed = True
            trace = s.trace
            resident = self._residency.resident
            if len(resident) <= len(trace):
                keys = [key for key in resident if key in trace]
            else:
                keys = [key for key in trace.keys if key in resident]
            for key in keys:
                self.index_key(s, key)

    def drop(self, s: Stream) -> None:
        """Drop the stream's index (its trace changes or is no longer trusted)."""
        for key in s.next_pos:
            self._live_changed(key, -1)
        s.next_pos.clear()
        s.heap.clear()
        s.indexed = False

    def reindex_resident(self, s: Stream, keys: list[TensorKey]) -> None:
        """The stream's cursor moved past these tensors: index the resident ones anew."""
        if s.indexed:
            resident = self._residency.resident
            for key in keys:
                if key in resident:
                    self.index_key(s, key)

    def index_key(self, s: Stream, key: TensorKey) -> None:
        """(Re)compute where `s` next reads the resident `key`, from its cursor."""
        trace = s.trace
        assert trace is not None
        n = len(trace)
        cursor = self.position(s)
        position = trace.next_access(key, cursor)
        had = s.next_pos.pop(key, None) is not None
        if position is None or trace.entries[position].write:
            if had:
                self._live_changed(key, -1)  # not read next: its bytes are dead to this stream
            return
        absolute = s.epoch * n + (position if position >= cursor else n + position)
        s.next_pos[key] = absolute
        if not had:
            self._live_changed(key, +1)
        heapq.heappush(s.heap, (-absolute, key))
        if len(s.heap) > 2 * len(s.next_pos) + 64:
            s.heap = [(-pos, k) for k, pos in s.next_pos.items()]  # shed stale entries
            heapq.heapify(s.heap)

    def _unindex_key(self, s: Stream, key: TensorKey) -> None:
        if s.next_pos.pop(key, None) is not None:
            self._live_changed(key, -1)

    def _live_changed(self, key: TensorKey, delta: int) -> None:
        count = self._live.get(key, 0) + delta
        if count > 0:
            self._live[key] = count
            self._infinite.discard(key)
        else:
            self._live.pop(key, None)
            if key in self._residency.resident:
                self._mark_infinite(key)

    # --- next uses and the eviction order ---------------------------------------------

    def _seconds_until(self, s: Stream, absolute: int) -> float:
        trace = s.trace
        assert trace is not None
        n = len(trace)
        relative = absolute - s.epoch * n
        return trace.time_until(self.position(s), relative if relative < n else relative - n)

    def need_s(self, key: TensorKey) -> float:
        """Seconds until some indexed stream reads `key` (resident or not); infinite if none."""
        need = INFINITE_S
        for s in self._streams.values():
            if s.indexed and s.trace is not None:
                need = min(need, s.trace.next_use_s(key, self.position(s)))
        return need

    def eviction_order(self) -> Iterator[tuple[float, TensorKey, int]]:
        """Resident unpinned tensors as (next_use_s, key, nbytes), in the order they should go.

        First those no trace reads next, least recently used first; then the
        rest, farthest next use first, by a lazy merge of the streams' heaps
        (a tensor several streams read counts at its soonest use).
        """
        resident = self._residency.resident
        lru = self._lru_heap
        while lru and not self._lru_valid(lru[0]):
            heapq.heappop(lru)  # touched again since, or no longer infinite: gone for good
        emitted: set[TensorKey] = set()
        for entry in heap_in_order(lru):
            key = entry[1]
            if self._lru_valid(entry) and key not in emitted:
                emitted.add(key)
                if not self._is_pinned(key):
                    yield INFINITE_S, key, resident[key]
        streams = [s for s in self._streams.values() if s.indexed]
        for s in streams:
            # Evicted tensors were the farthest, so their stale entries gather at the top: drop
            # them for good, or every walk would step over them again.
            while s.heap and s.next_pos.get(s.heap[0][1]) != -s.heap[0][0]:
                heapq.heappop(s.heap)
        walkers = [heap_in_order(s.heap) for s in streams]
        merge: list[tuple[float, int, TensorKey]] = []

        def advance(index: int) -> None:
            s = streams[index]
            for negated, key in walkers[index]:
                if s.next_pos.get(key) == -negated:  # else stale
                    heapq.heappush(merge, (-self._seconds_until(s, -negated), index, key))
                    return

        for index in range(len(streams)):
            advance(index)
        while merge:
            negated_s, index, key = heapq.heappop(merge)
            advance(index)
            if key in emitted:
                continue
            soonest = min(self._seconds_until(s, s.next_pos[key]) for s in streams if key in s.next_pos)
            if soonest < -negated_s:
                continue  # another stream reads it sooner: it comes again from that stream's heap
            emitted.add(key)
            if not self._is_pinned(key):
                yield soonest, key, resident[key]
