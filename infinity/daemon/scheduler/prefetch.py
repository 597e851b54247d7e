"""Prefetch planning: what to load next, for which stream, and how far ahead each stream looks.

Rules:

- A stream prefetches only while it replays its trace and is on it (or,
  with `prefetch_across_steps`, between steps); after an access that breaks
  the trace's order, nothing more is prefetched for it until it is back.
- A prefetch never needs the eviction of a tensor whose next use comes
  sooner than the prefetched tensor's own, and it must fit its namespace's
  quota (`VictimPool`, from `infinity.daemon.scheduler.eviction`).
- Lookahead: disk bytes ahead of the cursor of one bandwidth share times the
  lookahead time (`infinity.daemon.scheduler.meter`), within the stream's
  share of the tier's prefetch window.
- Streams share the engine and the tier: every stream that is loading,
  waiting or has something to prefetch competes; none may get more than one
  quantum of bytes ahead of the least served of them (unless the engine
  would idle); each plan interleaves their prefetches by deficit round robin
  over bytes; they share the prefetch bytes in flight and the tier's
  prefetch window evenly, with the same lookahead.

It keeps the fair-queueing state (bytes loaded per stream) and the last plan
(to attribute a prefetch the daemon starts to its stream).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.eviction import VictimPool
from infinity.daemon.scheduler.meter import ReadMeter
from infinity.daemon.scheduler.nextuse import NextUseIndex
from infinity.daemon.scheduler.stream import LoadNote, Stream, StreamState
from infinity.daemon.scheduler.view import ResidencyView
from infinity.daemon.trace import StreamKey, TensorKey, Trace

__all__ = ["PrefetchPlanner"]


@dataclass(slots=True)
class _Candidate:
    stream: StreamKey
    key: TensorKey
    nbytes: int
    need_s: float  # expected seconds until the stream reads it


class PrefetchPlanner:
    """Plans prefetches over all streams; hears of the loads it is owed (`load_started`)."""

    def __init__(self, config: SchedulerConfig, *, cpu_tier_bytes: int,
                 streams: Mapping[StreamKey, Stream], residency: ResidencyView,
                 loads: Mapping[TensorKey, LoadNote], nextuse: NextUseIndex,
                 meter: ReadMeter) -> None:
        self._config = config
        self._cpu_tier_bytes = cpu_tier_bytes
        self._streams = streams
        self._residency = residency
        self._loads = loads  # the scheduler's notes of the loads in flight
        self._nextuse = nextuse
        self._meter = meter
        self._planned: dict[TensorKey, StreamKey] = {}  # the last plan, for load_started's attribution
        self._round_robin = 0  # which stream a plan serves first, rotating
        self._served: dict[StreamKey, int] = {}  # bytes loaded for each stream (fair queueing)
        self._fair_before: frozenset[StreamKey] = frozenset()

    # --- loads, for fair queueing ------------------------------------------------------

    def load_started(self, key: TensorKey, nbytes: int, *, prefetch: bool,
                     stream: StreamKey | None) -> StreamKey | None:
        """A load started: returns the stream it is for (a prefetch's, from the last plan, when
        the daemon did not say) and counts its bytes as served to that stream."""
        if prefetch and stream is None:
            stream = self._planned.get(key)
        self._planned.pop(key, None)
        if stream is not None:
            self._served[stream] = self._served.get(stream, 0) + nbytes
        return stream

    def load_cancelled(self, stream: StreamKey, nbytes: int) -> None:
        """A load counted for `stream` was dropped before it read: not served after all."""
        self._served[stream] = self._served.get(stream, 0) - nbytes

    def forget_stream(self, stream: StreamKey) -> None:
        """The stream is gone for good: no fair-queueing account, no share of the last plan."""
        self._served.pop(stream, None)
        self._planned = {key: owner for key, owner in self._planned.items() if owner != stream}

    # --- lookahead -------------------------------------------------------------------

    def _plan_cursor(self, s: Stream) -> int | None:
        """Where the stream's lookahead starts, or None when it must not prefetch now."""
        if not s.indexed:
            return None
        if s.state is StreamState.REPLAYING:
            assert s.replay is not None
            return s.replay.position if s.replay.on_track else None
        if not self._config.prefetch_across_steps:
            return None
        return self._nextuse.position(s)  # between steps: the next step's start

    def upcoming(self, stream: StreamKey, *, namespace: str, max_entries: int,
                 max_bytes: int) -> list[tuple[TensorKey, int]]:
        """The stream's next reads of tensors in `namespace` by the trace it replays, soonest
        first: distinct tensors (writes skipped), at most `max_entries` and `max_bytes` (the
        first always). Empty when it replays no trace, or strayed from it. For a client's
        device cache, which brings tensors further, into device memory, ahead of their use."""
        s = self._streams.get(stream)
        cursor = self._plan_cursor(s) if s is not None else None
        if s is None or cursor is None or s.trace is None:
            return []
        entries = s.trace.entries
        n = len(entries)
        steps = n if self._config.prefetch_across_steps else n - cursor
        sizes = self._residency.sizes
        out: list[tuple[TensorKey, int]] = []
        seen: set[TensorKey] = set()
        total = 0
        for i in range(steps):
            entry = entries[(cursor + i) % n]
            if entry.write or entry.key in seen or entry.key[0] != namespace:
                continue
            seen.add(entry.key)
            nbytes = sizes.get(entry.key, entry.nbytes)
            if out and total + nbytes > max_bytes:
                break
            out.append((entry.key, nbytes))
            total += nbytes
            if len(out) == max_entries:
                break
        return out

    def _planning_streams(self) -> list[tuple[Stream, int]]:
        out: list[tuple[Stream, int]] = []
        for key in sorted(self._streams):
            s = self._streams[key]
            cursor = self._plan_cursor(s)
            if cursor is not None:
                out.append((s, cursor))
        return out

    def _window_cap_bytes(self, n_streams: int) -> int:
        return int(self._config.lookahead_max_fraction * self._cpu_tier_bytes / max(1, n_streams))

    def _own_budget_bytes(self, trace: Trace, cursor: int, n_streams: int) -> int:
        """Disk bytes to have under way ahead of the cursor: bandwidth share x lookahead time."""
        n = len(trace)
        ahead = min(self._config.lookahead_accesses, n - 1)
        horizon_s = trace.time_until(cursor, (cursor + ahead) % n)
        horizon_s = max(self._config.lookahead_min_s, horizon_s)
        return int(self._meter.estimate / max(1, n_streams) * horizon_s)

    def _budgets(self, planning: list[tuple[Stream, int]]) -> dict[StreamKey, int]:
        """Each planning stream's lookahead in bytes.

        Streams that prefetch at the same time all get the largest of their
        own budgets (within the tier share): the engine serves requests in
        order, so a stream's share of the disk follows its share of the bytes
        queued, and a loaded engine delays everyone's data by the queue ahead
        of it, which a longer lookahead covers.
        """
        n_streams = len(planning)
        cap = self._window_cap_bytes(n_streams)
        own = {s.key: self._own_budget_bytes(s.trace, cursor, n_streams)
               for s, cursor in planning if s.trace is not None}
        widest = max(own.values(), default=0)
        return {key: min(widest, cap) for key in own}

    def budgets(self) -> dict[StreamKey, int]:
        """The lookahead in bytes of every stream prefetching now."""
        return self._budgets(self._planning_streams())

    def lookahead_bytes(self, stream: StreamKey) -> int:
        """The stream's current prefetch lookahead in bytes (0: not prefetching now)."""
        return self.budgets().get(stream, 0)

    def _candidates(self, s: Stream, cursor: int, n_streams: int, budget: int) -> list[_Candidate]:
        """Upcoming reads of one stream that should be brought in, soonest first."""
        trace = s.trace
        assert trace is not None
        entries = trace.entries
        n = len(entries)
        cap = self._window_cap_bytes(n_streams)
        residency = self._residency
        sizes, resident, inflight = residency.sizes, residency.resident, residency.loading  # hot loop
        steps = min(n if self._config.prefetch_across_steps else n - cursor,
                    self._config.lookahead_max_entries)
        seen: set[TensorKey] = set()
        window = 0  # upcoming distinct reads, resident or not: what the stream holds in the tier
        loading = 0  # of which not resident: disk work ahead of the cursor
        out: list[_Candidate] = []
        position = cursor - 1
        for _ in range(steps):
            position += 1
            if position == n:
                position = 0
            entry = entries[position]
            key = entry.key
            if key in seen:
                continue
            seen.add(key)
            if entry.write:
                continue  # written before read: the client makes the bytes, nothing to load
            nbytes = sizes.get(key, entry.nbytes)
            window += nbytes
            if window > cap:
                break
            if key in resident:
                continue
            loading += nbytes
            if loading > budget and loading > nbytes:
                break  # past the lookahead (the first missing one is always allowed)
            if key not in inflight:
                out.append(_Candidate(s.key, key, nbytes, trace.time_until(cursor, position)))
        return out

    # --- the plan --------------------------------------------------------------------

    def plan(self, *, free_bytes: int | None = None) -> list[TensorKey]:
        """Tensors to start loading into the tier now, in order (see `Scheduler.plan_prefetch`)."""
        self._planned = {}
        planning = self._planning_streams()
        if not planning:
            return []
        n_streams = len(planning)
        budgets = self._budgets(planning)
        queues: dict[StreamKey, deque[_Candidate]] = {}
        for s, cursor in planning:
            candidates = self._candidates(s, cursor, n_streams, budgets[s.key])
            if candidates:
                queues[s.key] = deque(candidates)
        if not queues:
            return []

        config = self._config
        residency = self._residency
        stream_inflight: dict[StreamKey, int] = {}  # prefetch bytes in flight per stream
        total_inflight = 0
        loading: set[StreamKey] = set()  # streams with any load in flight (demand or prefetch)
        for load in self._loads.values():
            if load.stream is not None and load.stream in self._streams:
                loading.add(load.stream)
            if load.prefetch:
                total_inflight += load.nbytes
                if load.stream is not None:
                    stream_inflight[load.stream] = stream_inflight.get(load.stream, 0) + load.nbytes
        # Backlogged streams share the engine: those with something to prefetch, with loads in
        # flight, or waiting for data (a waiting client's demand loads must not queue behind
        # another client's whole lookahead).
        waiting = {s.key for s in self._streams.values() if s.active and s.open_waits > 0}
        busy = waiting | loading
        sharing = set(queues) | busy
        inflight_share = config.prefetch_inflight_max_bytes / max(1, len(sharing))
        fair = set(sharing)  # streams whose served bytes bound the others' lead
        quantum_bytes = config.fair_quantum_bytes
        for key in fair - self._fair_before:
            # A stream that comes back after a pause gets no banked credit: it starts level
            # with the others (less one quantum), not with what it was owed while away.
            others = [self._served.get(k, 0) for k in fair if k != key]
            if others:
                self._served[key] = max(self._served.get(key, 0), min(others) - quantum_bytes)
        self._fair_before = frozenset(fair)

        free = (self._cpu_tier_bytes - residency.resident_bytes - residency.loading_bytes
                if free_bytes is None else free_bytes)
        namespace_used = residency.namespace_totals()
        pool: VictimPool | None = None
        plan: list[TensorKey] = []
        planned_bytes = 0
        stream_planned: dict[StreamKey, int] = {}

        def victim_pool() -> VictimPool:
            nonlocal pool
            if pool is None:
                pool = VictimPool(self._nextuse.eviction_order())
            return pool

        def served(key: StreamKey) -> int:
            return self._served.get(key, 0) + stream_planned.get(key, 0)

        def try_plan(c: _Candidate) -> str:
            """"planned" | "skip" (already handled) | "wait_turn" | "stop_stream" | "stop_all"."""
            nonlocal free, planned_bytes
            if c.key in self._planned or c.key in residency.resident or c.key in residency.loading:
                return "skip"  # another stream's plan took it: shared read-only data
            # Fair queueing over bytes loaded (demand and prefetch): a stream may lead the least
            # served competing stream by at most one quantum, unless the engine would idle.
            behind = [served(k) for k in fair if k != c.stream]
            if (behind and served(c.stream) - min(behind) >= quantum_bytes
                    and residency.loading_bytes + planned_bytes > 0):
                return "wait_turn"
            out_total = total_inflight + planned_bytes
            if out_total > 0 and out_total + c.nbytes > config.prefetch_inflight_max_bytes:
                return "stop_all"
            out_stream = stream_inflight.get(c.stream, 0) + stream_planned.get(c.stream, 0)
            if out_stream > 0 and out_stream + c.nbytes > inflight_share:
                return "stop_stream"
            victims: list[tuple[TensorKey, int]] = []
            namespace = c.key[0]
            quota = config.quota_bytes(namespace)
            if quota is not None:
                if c.nbytes > quota:
                    return "stop_stream"
                excess = namespace_used.get(namespace, 0) + c.nbytes - quota
                if excess > 0:
                    picked = victim_pool().pick(excess, later_than_s=c.need_s, namespace=namespace)
                    if picked is None:
                        return "stop_stream"  # later entries are needed later still: no better
                    victims += picked
            short = c.nbytes - free - sum(n for _, n in victims)
            if short > 0:
                picked = victim_pool().pick(short, later_than_s=c.need_s,
                                            exclude=frozenset(k for k, _ in victims))
                if picked is None:
                    return "stop_stream"
                victims += picked
            if victims:
                victim_pool().take(victims)
            for key, nbytes in victims:
                free += nbytes
                namespace_used[key[0]] = namespace_used.get(key[0], 0) - nbytes
            free -= c.nbytes
            namespace_used[namespace] = namespace_used.get(namespace, 0) + c.nbytes
            planned_bytes += c.nbytes
            stream_planned[c.stream] = stream_planned.get(c.stream, 0) + c.nbytes
            self._planned[c.key] = c.stream
            plan.append(c.key)
            return "planned"

        # Deficit round robin over bytes; the first stream served rotates from plan to plan.
        order = sorted(queues)
        start = self._round_robin % len(order)
        self._round_robin += 1
        active = order[start:] + order[:start]
        deficit = {key: 0 for key in active}
        while active:
            quantum = max(quantum_bytes, min(queues[k][0].nbytes for k in active))
            still: list[StreamKey] = []
            changed = False
            waiting_turn = 0
            for key in active:
                queue = queues[key]
                deficit[key] += quantum
                while queue and queue[0].nbytes <= deficit[key]:
                    verdict = try_plan(queue[0])
                    if verdict == "stop_all":
                        return plan
                    if verdict == "wait_turn":
                        waiting_turn += 1
                        break
                    changed = True
                    if verdict == "stop_stream":
                        queue.clear()
                        break
                    candidate = queue.popleft()
                    if verdict == "planned":
                        deficit[key] -= candidate.nbytes
                if queue:
                    still.append(key)
                elif key not in busy:
                    fair.discard(key)  # nothing more to load now: it must not hold the others back
            active = still
            if not changed and waiting_turn == len(active):
                break  # everyone left is ahead of a stream that cannot load more in this plan
        return plan
